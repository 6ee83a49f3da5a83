"""The AHBM driver: lay a call out on the mesh simulator, launch a generated kernel, read back.

ADR-0060 §2.2 splits the work between the driver and the kernel: the driver supplies bases,
the counter and the rotation; the kernel derives the rest.  Here the driver also carries the
plan (compiler/plan.py) into the launch: the tile classes of each work item, merged over the
G query heads of a K/V head (a tile is SKIP for the group only if every head skips it, FULL
only if every head sees all of it), and the mask's streams (see backends/ahbm/emit.py).

A work item is one (request b, K/V head).  Each gets a CUBE of `sp` PEs (one PE without SP);
the CUBEs sit side by side on one mesh and all items run in one launch.  Four programs:

* decode, sp = 1   — `decode` on one PE per item (ADR-0060 §5.2)
* decode, sp = N   — `decode` on N PEs per item, tokens round-robin, §4 tree to the root (§5.3)
* prefill, sp = 1  — `prefill` on one PE per item (§5.4)
* prefill, sp = N  — `ring` on N PEs per item (§5.5)

`case` picks decode or prefill (default: decode when S_q == 1).  Decode handles S_q query rows
as one tile; prefill tiles them by BLOCK_M.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np

from attnc.compiler import inputs, interp, ir, numerics, sinks
from attnc.compiler.analysis.splits import balanced_bounds
from attnc.compiler.errors import PlanError
from attnc.compiler.plan import Plan, plan as make_plan
from attnc.backends.common import load_module
from .emit import Source, emit, stream_loads, stream_vars
from .sim import LatencyModel, Machine, MeshConfig, PerPE, RunResult
from .sim.errors import TopologyError
from .sim.mesh import Topology
from .sim.tree import tree_placement, tree_root

SKIP, PARTIAL, FULL = (int(c) for c in (ir.TileClass.SKIP, ir.TileClass.PARTIAL, ir.TileClass.FULL))
CASES = ("decode", "prefill")
# PEs one simulated call with sp > 1 may use (work items x sp): a ring's simulated time grows faster than
# sp^2 (2 items x sp 256, 512 PEs: ~35 s on one core), so larger meshes are refused up front
MAX_PES = 512
PROGRAMS = {("decode", False): "decode", ("decode", True): "decode-sp",
            ("prefill", False): "prefill", ("prefill", True): "ring"}


# ---------------------------------------------------------------- tile classes
def merge_classes(classes: np.ndarray, axis) -> np.ndarray:
    """One class for several tiles (or several heads of one tile): SKIP if all are SKIP,
    FULL if all are FULL, else PARTIAL."""
    skip = (classes == SKIP).all(axis=axis)
    full = (classes == FULL).all(axis=axis)
    return np.where(skip, SKIP, np.where(full, FULL, PARTIAL)).astype(np.int8)


def group_classes(classes: np.ndarray, batch: int, heads_q: int, group: int) -> np.ndarray:
    """Plan tile classes [B', H', T_r, T_c] -> [B, H_kv, T_r, T_c], merged over each K/V head's
    G query heads (they share every K/V tile load)."""
    c = np.broadcast_to(classes, (batch, heads_q) + classes.shape[2:])
    return merge_classes(c.reshape(batch, heads_q // group, group, *classes.shape[2:]), axis=2)


# ---------------------------------------------------------------- mesh
def cube_shape(n: int) -> tuple[int, int]:
    """rows x cols of an n-PE CUBE, as square as n allows (8 -> 2x4, as ADR-0060's N = 8)."""
    r = math.isqrt(n)
    while n % r:
        r -= 1
    return r, n // r


def ring_placement(rows: int, cols: int) -> tuple[tuple[int, int], ...]:
    """rank -> (row, col) with consecutive ranks N/S/E/W neighbours and, when the grid has an
    even side longer than 1, the last rank next to rank 0 (a Hamiltonian cycle; a grid with two
    odd sides has none, and the wrap-around send is routed)."""
    if rows % 2 and cols % 2 == 0 and rows > 1:
        return tuple((r, c) for c, r in ring_placement(cols, rows))
    if rows == 1 or cols == 1 or rows % 2:
        return tuple((r, c if r % 2 == 0 else cols - 1 - c) for r in range(rows) for c in range(cols))
    cells = [(0, c) for c in range(cols)]
    for r in range(1, rows):  # snake over columns 1..cols-1, then home up column 0
        span = range(cols - 1, 0, -1) if r % 2 else range(1, cols)
        cells += [(r, c) for c in span]
    return tuple(cells + [(r, 0) for r in range(rows - 1, 0, -1)])


def mesh_config(items: int, n: int, kind: str) -> MeshConfig:
    """`items` CUBEs of n PEs side by side; inside each, ranks placed for the tree ("tree":
    every tree pair a neighbour, sim.tree_placement), the ring ("ring") or row-major."""
    cr, cc = cube_shape(n)
    local = tuple((r, c) for r in range(cr) for c in range(cc))
    if kind == "tree":  # no such placement: row-major, and sends route over hops (and pay for them)
        with contextlib.suppress(TopologyError):
            local = tree_placement(n, cr, cc)
    elif kind == "ring":
        local = ring_placement(cr, cc)
    placement = tuple((r, w * cc + c) for w in range(items) for r, c in local)
    return MeshConfig(rows=cr, cols=items * cc, cube_rows=cr, cube_cols=cc, placement=placement)


def ports(topology: Topology, rank: int, n: int) -> dict[int, object]:
    """The queue pairs a PE of an n-PE group sees: peer rank -> N/S/E/W for a physical
    neighbour, else the rank (a routed send).  The SFR install of the driver."""
    base = rank - rank % n
    return {p: topology.direction(rank, p) or p for p in range(base, base + n) if p != rank}


# ---------------------------------------------------------------- streams
def _streams_of(program: ir.Program, loads, call, b: int, h0: int, q_pos, k_pos,
                k_tiles, q_tiles, hbm, prefix: str) -> list:
    """Evaluate each tensor read of one work item over the heads, query rows and keys it
    varies with and lay it out tile by tile: returns the kernel's stream entries."""
    G = program.group
    out = []
    for n, load in enumerate(loads):
        vars_ = stream_vars(load)
        if "q" in vars_ and "k" in vars_:
            raise PlanError(f"ahbm: the tensor read {ir.format_expr(load)} varies with both q and k; "
                            f"the AHBM programs stream mask tensors per query row or per key")
        env = {"b": np.int64(b), "h": (h0 + np.arange(G)).reshape(-1, 1, 1),
               "q": np.asarray(q_pos, np.int64).reshape(1, -1, 1),
               "k": np.asarray(k_pos, np.int64).reshape(1, 1, -1),
               "S_q": np.int64(call.s_q), "S_k": np.int64(call.s_k)}
        # every position's value, clamped where it leaves the tensor: the plan raised the oracle's
        # error for each read a visible cell uses, and a stream entry no cell uses is never read
        value = np.asarray(interp.evaluate(load, env, call.tensors, care=np.False_))
        dtype = {ir.I32: np.int32, ir.F32: np.float32, ir.BOOL: np.bool_}[load.type]
        gs = G if "h" in vars_ else 1
        if not vars_:
            out.append(("scalar", 1, value.reshape(()).astype(dtype).item()))
            continue
        shape = (gs, len(q_pos) if "q" in vars_ else 1, len(k_pos) if "k" in vars_ else 1)
        value = np.broadcast_to(value, shape).astype(dtype)
        if "k" in vars_:
            kind, flat = "k", _pack(value[:, 0, :], k_tiles)
        elif "q" in vars_:
            kind, flat = "q", _pack(value[:, :, 0], q_tiles)
        else:
            kind, flat = "h", value.reshape(-1)
        out.append((kind, gs, hbm.alloc(f"{prefix}{n}", flat)))
    return out


def _interval_streams(plan: Plan, b: int, h0: int, G: int, k_pos, k_tiles, hbm) -> list:
    """The FlashMask vectors UTS, UTE, LTS, LTE of one work item as one key stream [4 * Gs, W]
    per tile (one DMA per PARTIAL tile; Gs = G when the vectors vary per head, else 1)."""
    rows = []
    for vec in plan.intervals.vectors().values():
        vb = vec[b if vec.shape[0] > 1 else 0]
        rows.append(vb[h0:h0 + G] if vb.shape[0] > 1 else vb[:1])
    values = np.concatenate(rows)[:, np.asarray(k_pos, np.int64)].astype(np.int32)
    return [("k", values.shape[0], hbm.alloc("intervals", _pack(values, k_tiles)))]


def _pack(values: np.ndarray, tiles) -> np.ndarray:
    """[Gs, L] along positions -> tile by tile, each tile [Gs, width] contiguous."""
    parts = [values[:, lo:hi].reshape(-1) for lo, hi in tiles]
    return np.concatenate(parts) if parts else np.zeros(0, values.dtype)


def _tiles(lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(a + block, hi)) for a in range(lo, hi, block)]


# ---------------------------------------------------------------- runs
@dataclass
class Run:
    """One launch: outputs (logical bhsd), the simulator's result and what was launched."""

    program: str  # decode | decode-sp | prefill | ring
    sp: int
    o: np.ndarray  # [B, H_q, S_q, d_v] in the storage dtype's values
    lse: np.ndarray  # [B, H_q, S_q]
    result: RunResult
    machine: Machine
    plan: Plan
    classes: list = field(default_factory=list)
    """Per PE, the tile classes the kernel was given."""
    group_tiles: dict = field(default_factory=dict)
    """Group tile counts {full, partial, skip} over every work item (what the kernels walk)."""
    batch: int = 0
    s_q: int = 0
    s_k: int = 0

    @property
    def latency(self) -> float:
        return self.result.latency

    @property
    def oplog(self):
        return self.result.oplog

    def report(self, name: str = "") -> str:
        res, lat, cfg = self.result, self.machine.latency, self.machine.config
        log = res.oplog
        c = log.counters()
        items = cfg.cols // cfg.cube_cols
        lines = [
            f"{name or 'attention'} on ahbm: program {self.program} (N = {self.sp}), B={self.batch} "
            f"S_q={self.s_q} S_k={self.s_k}; {items} work item(s) (request, K/V head) on "
            f"{self.machine.size} PEs, one {cfg.cube_rows}x{cfg.cube_cols} CUBE each",
            "latency model: " + ", ".join(f"{k} {v:g}" for k, v in vars(lat).items()),
            *_busy_table(log, self.machine.size),
            f"counters: dma_read_count {c['dma_read_count']} (by buffer {log.dma_reads_by_buffer()}), "
            f"dma_write_count {c['dma_write_count']}, gemm_count {c['gemm_count']}, "
            f"math_count {c['math_count']}, ipcq_send_count {c['ipcq_send_count']}, "
            f"ipcq_recv_count {c['ipcq_recv_count']}",
            f"bytes: DMA {c['bytes']['DMA']}, IPCQ {c['bytes']['IPCQ']}; FLOPs: GEMM "
            f"{c['flops']['GEMM']:g}, MATH {c['flops']['MATH']:g}",
            f"group tiles: {self.group_tiles}; scratch peak {max(res.scratch_peak.values())} B "
            f"of {cfg.scratch_bytes} B",
        ]
        return "\n".join(lines) + "\n"


def _busy_table(log, pes: int, limit: int = 16) -> list[str]:
    """Busy ns per engine: every PE when there are few, else the total and the busiest PE."""
    if pes <= limit:
        return ["busy ns per engine and PE:", log.breakdown()]
    per = log.busy_by_pe()
    worst = max(per, key=lambda pe: (sum(per[pe].values()), -pe))
    tot = log.busy_by_engine()
    engines = list(tot)
    return [f"busy ns per engine ({pes} PEs; the busiest PE and the sum over all):",
            f"{'PE':>4} " + " ".join(f"{e:>12}" for e in engines),
            f"{worst:>4} " + " ".join(f"{per[worst][e]:>12.1f}" for e in engines),
            f"{'all':>4} " + " ".join(f"{tot[e]:>12.1f}" for e in engines),
            f"end-to-end latency {log.latency:.1f} ns"]


class Kernel:
    """A callable attention kernel for one program, run on the AHBM mesh simulator.

    `sp` PEs per work item (1: no sequence parallelism), `prefetch` K/V tiles in flight
    (0: blocking loads), `scoped` per-tile scratch recycling, `latency` the simulator's
    LatencyModel.  Every call keeps its `Run` in `last_run`; `report()` prints it."""

    def __init__(self, program: ir.Program, source: Source, *, sp: int = 1,
                 prefetch: int | None = None, scoped: bool = True,
                 latency: LatencyModel | None = None):
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)
        for what, exprs in (("MASK", [program.mask]), ("SCORE", program.score)):
            reads = tuple(ir.format_expr(n) for n in stream_loads(exprs))
            if tuple(r for r, _ in getattr(self.module, f"{what}_STREAMS")) != reads:
                raise PlanError(f"generated module {source.module_stem} streams other tensor reads "
                                f"than the driver ({reads}); regenerate it")
        self.sp = _check_sp(sp)
        self.prefetch = self.module.PREFETCH if prefetch is None else int(prefetch)
        self.scoped = scoped
        self.latency = latency or LatencyModel()
        self.last_run: Run | None = None

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None) -> Plan:
        return make_plan(self.program, batch, s_q, s_k, tensors, block_m or self.module.BLOCK_M,
                         block_n or self.module.BLOCK_N)

    def __call__(self, q, k, v, *, cache=None, lengths=None, plan: Plan | None = None,
                 return_lse=False, sp: int | None = None, case: str | None = None,
                 mask_from: str | None = None, **tensors):
        if cache is not None or lengths is not None:
            raise PlanError("the AHBM programs take contiguous q/k/v (the K/V layout is the "
                            "driver's: round-robin slots or ring blocks per PE)")
        run = self._simulate(q, k, v, plan, sp, case, mask_from, True, tensors)
        numerics.check_rows(run.lse, s_q=run.lse.shape[2], s_k=np.asarray(k).shape[
            1 if self.program.cache.layout is ir.Layout.BSHD else 2], sink=self.program.sink is not None)
        return (run.o, run.lse) if return_lse else run.o

    def report(self) -> str:
        if self.last_run is None:
            raise PlanError("no AHBM run to report yet")
        return self.last_run.report(self.program.name)

    # ------------------------------------------------------------ the driver
    def simulate(self, q, k, v, *, plan: Plan | None = None, sp: int | None = None,
                 case: str | None = None, mask_from: str | None = None, **tensors) -> Run:
        """Run one call; returns the Run (outputs in the spec's layout are run.o / run.lse).
        mask_from: None (the plan's choice), "predicate" or "intervals" (representable only)."""
        return self._simulate(q, k, v, plan, sp, case, mask_from, False, tensors)

    def _simulate(self, q, k, v, plan, sp, case, mask_from, finite_v: bool, tensors: dict) -> Run:
        """:meth:`simulate`; ``finite_v``: refuse a non-finite V first (a contiguous call's rule,
        numerics.check_values; an append checks its output rows instead)."""
        p = self.program
        call = inputs.validate(p, {"q": q, "k": k, "v": v, **tensors})
        sp = self.sp if sp is None else _check_sp(sp)
        case = case or ("decode" if call.s_q == 1 else "prefill")
        if case not in CASES:
            raise PlanError(f"ahbm: case must be one of {', '.join(CASES)}, got {case!r}")
        B, s_q, s_k = call.batch, call.s_q, call.s_k
        _check_mesh(sp, B * p.heads_kv)
        bm, bn = self.module.BLOCK_M, self.module.BLOCK_N
        col_classes = case == "decode" and sp > 1  # round-robin tiles regroup single columns
        if plan is None:
            plan = make_plan(p, B, s_q, s_k, call.tensors, s_q if case == "decode" else bm,
                             1 if col_classes else bn)
        plan.check_call(p, B, s_q, s_k)
        if finite_v:  # (bhsd after validate; after the plan's checks, as on every backend)
            numerics.check_values(call.v)
        want_n = 1 if col_classes else bn
        if plan.block_n != want_n or (plan.tiles.classes.shape[2] != 1 if case == "decode" else plan.block_m != bm):
            raise PlanError(f"ahbm {case} (N = {sp}) needs a plan with "
                            f"{'one query tile' if case == 'decode' else bm} x {want_n} tiles, got "
                            f"{plan.block_m}x{plan.block_n}")
        from_intervals = plan.mask_from_intervals
        if mask_from == "predicate":
            from_intervals = False
        elif mask_from == "intervals":
            if not plan.intervals.representable:
                raise PlanError(f"ahbm: the mask is not FlashMask-representable ({plan.intervals.reason})")
            from_intervals = True
        elif mask_from is not None:
            raise PlanError(f"ahbm: mask_from must be 'predicate' or 'intervals', got {mask_from!r}")
        classes = group_classes(plan.tiles.classes, B, p.heads_q, p.group)  # [B, H_kv, T_r, T_c]
        layout = _Layout(p, call, plan, classes, from_intervals, bm, bn)
        launch = layout.decode(sp) if case == "decode" else layout.prefill() if sp == 1 else layout.ring(sp)
        kwargs = dict(launch.kwargs, from_intervals=from_intervals, scoped=self.scoped)
        if launch.kernel != "ring":
            kwargs["prefetch"] = self.prefetch
        machine = Machine(launch.config, self.latency)
        if p.sink is not None:  # each PE's HBM holds its work item's G sinks [G, 1, 1], joined once per row
            values = sinks.values(p, B, call.tensors)
            per_item, G = sp if launch.kernel != "prefill" else 1, p.group
            for rank in range(len(layout.items) * per_item):
                b, kh = layout.items[rank // per_item]
                machine.hbm(rank).alloc("SINK", values[b, kh * G:(kh + 1) * G].reshape(G, 1, 1))
            kwargs["sink_ptr"] = PerPE(lambda r: machine.hbm(r).ptr("SINK") if r < len(layout.items) * per_item
                                       else None)
        for rank, buffers in launch.hbm.items():  # the host writes every PE's HBM
            for name, data in buffers:
                machine.hbm(rank).alloc(name, data)
        args = [a.value if isinstance(a, _Const) else PerPE(lambda r, a=a: _deref(machine, r, a[r]))
                for a in launch.args]
        result = machine.run(getattr(self.module, launch.kernel), *args, **kwargs)
        o, lse = layout.read(machine)
        o = inputs.to_storage(o, p.dtype)
        walked = np.concatenate([np.asarray(c, np.int8).reshape(-1) for c in launch.classes])
        counts = {n: int((walked == c).sum()) for n, c in (("full", FULL), ("partial", PARTIAL), ("skip", SKIP))}
        run = Run(PROGRAMS[case, sp > 1], sp, _to_layout(p, o), lse, result, machine, plan,
                  launch.classes, counts, B, s_q, s_k)
        self.last_run = run
        return run


def _check_sp(sp) -> int:
    if isinstance(sp, bool) or not isinstance(sp, (int, np.integer)) or sp < 1:
        raise PlanError(f"ahbm: sp (PEs per work item) must be a positive integer, got {sp!r}")
    return int(sp)


def _check_mesh(sp: int, items: int) -> None:
    """Refuse, before anything is simulated, an sp mesh over MAX_PES PEs."""
    if sp > 1 and items * sp > MAX_PES:
        raise PlanError(f"ahbm: sp = {sp} PEs for each of {items} work items (B x H_kv) is {items * sp} PEs; the "
                        f"simulator runs at most {MAX_PES}: use sp <= {max(1, MAX_PES // items)} or a smaller batch")


def _to_layout(program: ir.Program, o: np.ndarray) -> np.ndarray:
    if program.cache.kind is ir.CacheKind.CONTIGUOUS and program.cache.layout is ir.Layout.BSHD:
        return np.ascontiguousarray(o.transpose(0, 2, 1, 3))
    return o


@dataclass
class _Launch:
    config: MeshConfig
    hbm: dict  # rank -> [(buffer name, array)]
    kernel: str  # the generated function
    args: list  # per positional argument: {rank: value} or _Const
    kwargs: dict
    classes: list  # per PE, the tile classes it was given


class _HbmRef:
    """A buffer named before the machine exists: resolved to its Ptr at launch."""

    def __init__(self, name: str):
        self.name = name


def _deref(machine, rank, value):
    if isinstance(value, _HbmRef):
        return machine.hbm(rank).ptr(value.name)
    if isinstance(value, list):
        return [_deref(machine, rank, x) for x in value]
    if isinstance(value, tuple):
        return tuple(_deref(machine, rank, x) for x in value)
    return value


class _Buffers:
    """Host-side HBM contents per rank, collected before the machine is built."""

    def __init__(self, rank: int, store: dict):
        self.rank, self.store = rank, store

    def alloc(self, name: str, data) -> _HbmRef:
        self.store.setdefault(self.rank, []).append((name, np.asarray(data)))
        return _HbmRef(name)


class _Layout:
    """Where every input lives per PE, for one call and one program."""

    def __init__(self, program, call, plan, classes, from_intervals, bm, bn):
        self.p, self.call, self.plan, self.classes = program, call, plan, classes
        self.from_intervals, self.bm, self.bn = from_intervals, bm, bn
        self.storage = np.float16 if program.dtype == "f16" else np.float32
        self.mask_loads = stream_loads([program.mask])
        self.score_loads = stream_loads(program.score)
        self.items = [(b, kh) for b in range(call.batch) for kh in range(program.heads_kv)]

    def _q(self, b, kh):
        G = self.p.group
        return self.call.q[b, kh * G:(kh + 1) * G].astype(self.storage)

    def _kv(self, b, kh):
        return (self.call.k[b, kh].astype(self.storage), self.call.v[b, kh].astype(self.storage))

    def _streams(self, hbm, b, kh, q_pos, q_tiles, k_pos, k_tiles):
        G = self.p.group
        if self.from_intervals:
            mask = _interval_streams(self.plan, b, kh * G, G, k_pos, k_tiles, hbm)
        else:
            mask = _streams_of(self.p, self.mask_loads, self.call, b, kh * G, q_pos, k_pos,
                               k_tiles, q_tiles, hbm, "mask")
        score = _streams_of(self.p, self.score_loads, self.call, b, kh * G, q_pos, k_pos,
                            k_tiles, q_tiles, hbm, "score")
        return mask, score

    def _packed_q(self, b, kh, tiles):
        qg = self._q(b, kh)  # [G, S_q, d]
        parts = [qg[:, lo:hi].reshape(-1) for lo, hi in tiles]
        return np.concatenate(parts) if parts else np.zeros(0, self.storage)

    # -------------------------------------------------------- decode (§5.2, §5.3)
    def decode(self, n):
        p, call, G = self.p, self.call, self.p.group
        s_q, s_k = call.s_q, call.s_k
        config = mesh_config(len(self.items), n, "tree")
        topo = Topology(config)
        store: dict = {}
        args = {name: {} for name in ("q", "k", "v", "o", "lse", "classes", "mask", "score", "ports")}
        per_pe = []
        root = tree_root(n)
        for w, (b, kh) in enumerate(self.items):
            start_pe = b % n
            for pe in range(n):
                rank = w * n + pe
                hbm = _Buffers(rank, store)
                off = (pe - start_pe) % n
                k_pos = np.arange(off, s_k, n)  # slot -> global: slot * n + off
                assert ((start_pe + k_pos) % n == pe).all()  # pe = (request_id + token) mod N
                k_tiles = _tiles(0, len(k_pos), self.bn)
                if n == 1:
                    cls = [int(c) for c in self.classes[b, kh, 0]]
                else:  # per-column classes, regrouped into the PE's strided tiles
                    cols = self.classes[b, kh, 0]
                    cls = [int(merge_classes(cols[k_pos[lo:hi]], axis=0)) for lo, hi in k_tiles]
                kk, vv = self._kv(b, kh)
                args["q"][rank] = hbm.alloc("Q", self._q(b, kh))
                args["k"][rank] = hbm.alloc("K", kk[k_pos])
                args["v"][rank] = hbm.alloc("V", vv[k_pos])
                if pe == root:
                    args["o"][rank] = hbm.alloc("O", np.zeros((G, s_q, p.d_v), self.storage))
                    args["lse"][rank] = hbm.alloc("LSE", np.zeros((G, s_q, 1), np.float32))
                else:
                    args["o"][rank] = args["lse"][rank] = None
                q_pos = np.arange(s_k - s_q, s_k)
                args["mask"][rank], args["score"][rank] = self._streams(
                    hbm, b, kh, q_pos, [(0, s_q)], k_pos, k_tiles)
                args["classes"][rank] = cls
                args["ports"][rank] = ports(topo, rank, n)
                per_pe.append(cls)
        order = ("q", "k", "v", "o", "lse")
        positional = [args[n_] for n_ in order] + [_Const(s_k), _Const(n)] + \
                     [args["classes"], args["mask"], args["score"], args["ports"]]
        self._read = ("decode", n, root)
        return _Launch(config, store, "decode", positional, {"s_q": s_q}, per_pe)

    # -------------------------------------------------------- prefill (§5.4)
    def prefill(self):
        p, call, G = self.p, self.call, self.p.group
        s_q, s_k = call.s_q, call.s_k
        config = mesh_config(len(self.items), 1, "row-major")
        store: dict = {}
        args = {name: {} for name in ("q", "k", "v", "o", "lse", "classes", "mask", "score")}
        per_pe = []
        q_tiles = _tiles(0, s_q, self.bm)
        k_tiles = _tiles(0, s_k, self.bn)
        for rank, (b, kh) in enumerate(self.items):
            hbm = _Buffers(rank, store)
            kk, vv = self._kv(b, kh)
            args["q"][rank] = hbm.alloc("Q", self._packed_q(b, kh, q_tiles))
            args["k"][rank] = hbm.alloc("K", kk)
            args["v"][rank] = hbm.alloc("V", vv)
            args["o"][rank] = hbm.alloc("O", np.zeros(G * s_q * p.d_v, self.storage))
            args["lse"][rank] = hbm.alloc("LSE", np.zeros(G * s_q, np.float32))
            args["mask"][rank], args["score"][rank] = self._streams(
                hbm, b, kh, np.arange(s_k - s_q, s_k), q_tiles, np.arange(s_k), k_tiles)
            cls = self.classes[b, kh].tolist()
            args["classes"][rank] = cls
            per_pe.append(cls)
        positional = [args[n_] for n_ in ("q", "k", "v", "o", "lse")] + [_Const(s_q), _Const(s_k)] + \
                     [args["classes"], args["mask"], args["score"]]
        self._read = ("prefill", 1, q_tiles)
        return _Launch(config, store, "prefill", positional, {}, per_pe)

    # -------------------------------------------------------- ring (§5.5)
    def ring(self, n):
        p, call, G = self.p, self.call, self.p.group
        s_q, s_k = call.s_q, call.s_k
        config = mesh_config(len(self.items), n, "ring")
        topo = Topology(config)
        store: dict = {}
        names = ("q", "k", "v", "o", "lse", "classes", "need", "mask", "score", "ports", "q_split")
        args = {name: {} for name in names}
        per_pe = []
        q_tiles = _tiles(0, s_q, self.bm)
        k_tiles = _tiles(0, s_k, self.bn)
        qs, qe = (a[0] for a in balanced_bounds([len(q_tiles)], n))  # split bounds, in tiles
        ks, ke = (a[0] for a in balanced_bounds([len(k_tiles)], n))
        q_split = [(int(a), int(e)) for a, e in zip(qs, qe)]
        kv_split = [(int(a), int(e)) for a, e in zip(ks, ke)]
        self._ring = (q_split, q_tiles)
        for w, (b, kh) in enumerate(self.items):
            cls_item = self.classes[b, kh]  # [T_r, T_c]
            need = [[bool((cls_item[r0:r1, c0:c1] != SKIP).any()) for c0, c1 in kv_split]
                    for r0, r1 in q_split]
            kk, vv = self._kv(b, kh)
            for i in range(n):
                rank = w * n + i
                hbm = _Buffers(rank, store)
                r0, r1 = q_split[i]
                c0, c1 = kv_split[i]
                rows = (k_tiles[c0][0], k_tiles[c1 - 1][1]) if c1 > c0 else (0, 0)
                mine = q_tiles[r0:r1]
                t = sum(hi - lo for lo, hi in mine)
                args["q"][rank] = hbm.alloc("Q", self._packed_q(b, kh, mine))
                args["k"][rank] = hbm.alloc("K", kk[rows[0]:rows[1]])
                args["v"][rank] = hbm.alloc("V", vv[rows[0]:rows[1]])
                args["o"][rank] = hbm.alloc("O", np.zeros(G * t * p.d_v, self.storage))
                args["lse"][rank] = hbm.alloc("LSE", np.zeros(G * t, np.float32))
                first = mine[0][0] if mine else 0
                local_q = [(lo - first, hi - first) for lo, hi in mine]
                args["mask"][rank], args["score"][rank] = self._streams(
                    hbm, b, kh, np.arange(s_k - s_q + first, s_k - s_q + first + t), local_q,
                    np.arange(s_k), k_tiles)
                cls = cls_item[r0:r1].tolist()
                args["classes"][rank] = cls
                args["need"][rank] = need
                args["ports"][rank] = ports(topo, rank, n)
                args["q_split"][rank] = q_split
                per_pe.append(cls)
        positional = [args[n_] for n_ in ("q", "k", "v", "o", "lse")] + \
            [_Const(s_q), _Const(s_k), _Const(n), args["q_split"], _Const(kv_split), args["classes"],
             args["need"], args["mask"], args["score"], args["ports"]]
        self._read = ("ring", n, None)
        return _Launch(config, store, "ring", positional, {}, per_pe)

    # -------------------------------------------------------- outputs
    def read(self, machine: Machine):
        """O [B, H_q, S_q, d_v] and LSE [B, H_q, S_q] back from the PEs that stored them."""
        p, call, G = self.p, self.call, self.p.group
        s_q = call.s_q
        o = np.zeros((call.batch, p.heads_q, s_q, p.d_v), np.float32)
        lse = np.zeros((call.batch, p.heads_q, s_q), np.float32)
        kind, n = self._read[:2]
        for w, (b, kh) in enumerate(self.items):
            heads = slice(kh * G, (kh + 1) * G)
            if kind == "decode":
                hbm = machine.hbm(w * n + self._read[2])
                o[b, heads] = hbm.read("O")
                lse[b, heads] = hbm.read("LSE")[..., 0]
            elif kind == "prefill":
                hbm = machine.hbm(w)
                _unpack(o[b, heads], lse[b, heads], hbm.read("O"), hbm.read("LSE"), self._read[2], p.d_v)
            else:
                q_split, q_tiles = self._ring
                for i in range(n):
                    hbm = machine.hbm(w * n + i)
                    r0, r1 = q_split[i]
                    _unpack(o[b, heads], lse[b, heads], hbm.read("O"), hbm.read("LSE"),
                            q_tiles[r0:r1], p.d_v)
        return o, lse


def _unpack(o, lse, flat_o, flat_lse, tiles, d_v):
    """Query tiles packed [G, t, d] one after the other -> o [G, S_q, d], lse [G, S_q]."""
    G = o.shape[0]
    a = b = 0
    for lo, hi in tiles:
        t = hi - lo
        o[:, lo:hi] = flat_o[a:a + G * t * d_v].reshape(G, t, d_v)
        lse[:, lo:hi] = flat_lse[b:b + G * t].reshape(G, t)
        a, b = a + G * t * d_v, b + G * t


class _Const:
    """A launch argument that is the same on every PE."""

    def __init__(self, value):
        self.value = value


def load(program: ir.Program, *, sp: int = 1, prefetch: int | None = None, scoped: bool = True,
         latency: LatencyModel | None = None, **options) -> Kernel:
    """Compile `program` for the AHBM simulator; `options` go to emit (block_m, block_n)."""
    return Kernel(program, emit(program, **options), sp=sp, prefetch=prefetch, scoped=scoped,
                  latency=latency)
