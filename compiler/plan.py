"""Plan time (DESIGN §1): everything that depends on concrete lengths and runtime tensors.

``plan()`` runs the mask analyses for one call shape and freezes what a kernel needs:
the tile CSR (PARTIAL then FULL K/V blocks per (b', h', q-tile)) and, when the mask is
FlashMask-representable and reads tensors, the four interval vectors so PARTIAL tiles
test rows against intervals instead of re-reading the tensors; likewise, when each query row
sees one run of keys, that run per row ([KS, KE), the transposed analysis).  A kernel refuses a
plan made for another shape.

A plan is frozen with its plan key (``compiler.dispatch.PlanKey``, M4.5 §0x07F): the static
projection of the dispatch key (device, layout, page size, heads, head dims, dtypes, graph
mode).  A run whose static field differs is rejected naming the field; the declared dynamic
fields (lengths, tensors such as doc ids or page lists) change only through ``plan.update``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import ir, reads, resources
from .analysis import run_plan_pipeline
from .analysis.intervals import MaskIntervals, RowIntervals
from .analysis.splits import occupancy_for
from .analysis.tiles import TilePlan
from .dispatch import PLAN_DYNAMIC_FIELDS, PLAN_KEY_FIELDS, PlanKey
from .analysis import decode_rows
from .errors import AttncError, PlanError
from .ranges import check_length


@dataclass(frozen=True)
class Plan:
    program_digest: str
    batch: int
    s_q: int
    s_k: int
    intervals: MaskIntervals
    tiles: TilePlan
    mask_from_intervals: bool
    key: PlanKey | None = None
    program: ir.Program | None = field(default=None, repr=False, compare=False)
    rows: RowIntervals | None = field(default=None, repr=False, compare=False)
    # what classified the tiles the analysis left undecided (analysis.tile_eval), for retile
    tile_evaluator: object = field(default=None, repr=False, compare=False)

    def host_bytes(self) -> int:
        """The bytes of the numpy arrays this plan holds (tile classes, CSR lists, the interval
        vectors and row runs): what a plan keeps alive while a backend builds from it."""
        return resources.array_bytes((self.intervals, self.tiles, self.rows))

    @property
    def block_m(self) -> int:
        return self.tiles.block_m

    @property
    def block_n(self) -> int:
        return self.tiles.block_n

    def kernel_args(self) -> dict[str, object]:
        """The plan as the plain arrays and ints a kernel reads: tiles, the CSR lists of PARTIAL and
        FULL blocks per (b', h', query tile), the heaviest-first tile order, and the mask's interval
        vectors or row runs where the plan has them (a backend adds the arrays its own walk needs)."""
        b_, h_ = self.tiles.classes.shape[:2]
        args = {
            "block_m": self.block_m, "block_n": self.block_n, "plan_b": b_, "plan_h": h_,
            "q_tiles": self.tiles.classes.shape[2],
            "partial_indptr": self.tiles.partial_indptr, "partial_indices": self.tiles.partial_indices,
            "full_indptr": self.tiles.full_indptr, "full_indices": self.tiles.full_indices,
            "mask_from_intervals": self.mask_from_intervals,
            "q_tile_order": self.q_tile_order(),
        }
        if self.mask_from_intervals:
            args.update({n: v for n, v in self.intervals.vectors().items()})
        args["mask_from_rows"] = self.rows is not None
        if self.rows is not None:
            args.update({"KS": self.rows.KS, "KE": self.rows.KE})
        return args

    def q_tile_order(self) -> np.ndarray:
        """Each plane's (b', h') query tiles by descending work (computed K/V blocks), flattened
        [b' * h' * q_tiles]: the kernel launches every head's heaviest tile first, so the
        longest rows finish with the rest instead of after them (LPT)."""
        work = (self.tiles.classes != 0).sum(axis=3)
        order = np.argsort(-work, axis=2, kind="stable")
        return order.reshape(-1).astype(np.int32)

    def retile(self, block_m: int, block_n: int, method: str = "auto") -> "Plan":
        """The same call planned with other tiles: the mask analysis (the costly part) is reused, and
        so is the plan's tile evaluator (where the analysis is not exact)."""
        tiles = run_plan_pipeline(("tiles",), intervals=self.intervals, block_m=block_m, block_n=block_n,
                                  method=method, tile_evaluator=self.tile_evaluator)["tiles"]
        return replace(self, tiles=tiles)

    def check_call(self, program: ir.Program, batch: int, s_q: int, s_k: int, *, device: str | None = None,
                   graph_mode: bool | None = None) -> None:
        """Refuse a run this plan was not made for: a changed static field of the plan key
        (named), another spec, or other lengths (dynamic: ``plan.update`` them first)."""
        if self.key is not None:
            run = PlanKey.of(program, device=self.key.device if device is None else str(device),
                             workspace_device=self.key.workspace_device,
                             graph_mode=self.key.graph_mode if graph_mode is None else graph_mode)
            self.check_key(run)
        if ir.digest(program) != self.program_digest:
            raise PlanError("plan was made for a different spec")
        got, want = (batch, s_q, s_k), (self.batch, self.s_q, self.s_k)
        if got != want:
            names = ("B", "S_q", "S_k")
            field = next(n for n, g, w in zip(names, got, want) if g != w)
            raise PlanError(f"plan was made for {field} = {want[names.index(field)]}, "
                            f"the call has {field} = {got[names.index(field)]} "
                            f"(lengths are dynamic: plan.update({dict(B='batch').get(field, field.lower())}=...))")

    def check_key(self, run: PlanKey) -> None:
        """A run under plan key ``run`` may reuse this plan only if P(D_run) == K_plan (§0x07F);
        a host-only plan (device None) serves every device."""
        changed = [(n, mine, theirs) for n, mine, theirs in self.key.changed(run)
                   if not (n in ("device", "workspace_device") and mine is None)]
        if changed:
            n, mine, theirs = changed[0]
            more = f" (also {', '.join(c[0] for c in changed[1:])})" if len(changed) > 1 else ""
            raise PlanError(f"plan was made for {n} = {mine!r}, the run has {n} = {theirs!r}{more}: "
                            "a static field of the plan key; make a new plan")

    def update(self, **dynamic) -> "Plan":
        """A new plan for changed dynamic fields (``batch``, ``s_q``, ``s_k``, ``tensors``) under
        the same plan key and tile shape (the tile classifier is re-chosen for the new lengths);
        a static field is refused by name."""
        static = sorted(set(dynamic) & set(PLAN_KEY_FIELDS) | {n for n in dynamic if n in ("program", "block_m",
                                                                                            "block_n")})
        if static:
            raise PlanError(f"plan.update({static[0]}=...): {static[0]} is static in this plan "
                            f"(dynamic fields: {', '.join(PLAN_DYNAMIC_FIELDS)}); make a new plan")
        unknown = sorted(set(dynamic) - set(PLAN_DYNAMIC_FIELDS))
        if unknown:
            raise PlanError(f"plan.update({unknown[0]}=...): not a field of the plan "
                            f"(dynamic fields: {', '.join(PLAN_DYNAMIC_FIELDS)})")
        if self.program is None:
            raise PlanError("this plan does not hold its program; make a new plan with plan()")
        reads = sorted(ir.loads(self.program.mask))
        if reads and dynamic.get("tensors") is None:
            raise PlanError(f"plan.update: the mask reads {', '.join(reads)}; pass their values as tensors=")
        k = self.key
        return plan(self.program, dynamic.get("batch", self.batch), dynamic.get("s_q", self.s_q),
                    dynamic.get("s_k", self.s_k), dynamic.get("tensors"), self.block_m, self.block_n,
                    device=k.device if k else None,
                    workspace_device=k.workspace_device if k else None, graph_mode=k.graph_mode if k else False)


def plan(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
         block_m: int = 64, block_n: int = 64, method: str = "auto", *, device: str | None = None,
         workspace_device: str | None = None, graph_mode: bool = False, tile_evaluator=None) -> Plan:
    """The frozen plan of one call shape with its plan key (``device`` None: host arrays only):
    the pipeline's intervals -> rows -> tiles (``analysis.PLAN_PIPELINE``).  ``tile_evaluator``
    classifies the tiles an inexact analysis leaves undecided (default: the host's,
    ``analysis.tile_eval``)."""
    if program.flashmask:
        from .inputs import check_flashmask
        check_flashmask(program, tensors or {})
    reads.check_prefill(program, tensors or {}, batch, s_q, s_k)
    given = {} if tile_evaluator is None else {"tile_evaluator": tile_evaluator}
    r = run_plan_pipeline(("intervals", "rows", "tile_evaluator", "tiles"), program=program, batch=batch, s_q=s_q,
                          s_k=s_k, tensors=tensors or {}, block_m=block_m, block_n=block_n, method=method, **given)
    key = PlanKey.of(program, device=device, workspace_device=workspace_device, graph_mode=graph_mode)
    return Plan(ir.digest(program), batch, s_q, s_k, r["intervals"], r["tiles"],
                mask_from_intervals=r["intervals"].representable and bool(ir.loads(program.mask)), key=key,
                program=program, rows=r["rows"], tile_evaluator=r["tile_evaluator"])



@dataclass(frozen=True)
class DecodeBlocks:
    """For a split call over a K/V cache: the query tiles (``block_q`` consecutive query rows
    of one request; decode: one tile per request, its one new row), which K/V blocks each tile
    visits (SKIP removed; the union over the tile's rows and the query heads) and which of those
    need the element mask (PARTIAL for some row or head), split into ``splits`` balanced shares
    per tile, or, under a spec's ``split =`` policy, cut at its bounds: ``split_bounds`` then holds
    each (request, slot)'s ``[start, end)`` and a slot's entries are the tile's blocks that meet it."""

    block_n: int
    splits: int
    entry_ptr: np.ndarray  # int32 [tiles * splits + 1]: tile i's split s owns entries [ptr, ptr')
    blocks: np.ndarray  # int32 [entries]: K/V block index
    partial: np.ndarray  # int8 [entries]: 1 where the element mask applies
    skipped: int  # blocks within the requests' lengths that no split of a tile reads (summed over tiles)
    block_q: int = 1
    tile_req: np.ndarray | None = None  # int32 [tiles]: the request of each query tile
    tile_row0: np.ndarray | None = None  # int32 [tiles]: its first query row, counted within the request
    split_bounds: np.ndarray | None = None  # int32 [B * splits * 2]: (start, end) per (request, slot)

    @property
    def tiles(self) -> int:
        return len(self.tile_req)


def decode_blocks(program: ir.Program, kv_lens, tensors: dict | None, block_n: int, splits: int,
                  q_lens=None, block_q: int = 1, *, route: str = "auto") -> DecodeBlocks:
    """The block lists of a split call.  ``q_lens`` (default: one row per request, decode) gives
    each request's query rows, the last of its ``kv_lens[b]`` keys (bottom-right: row i is at
    position ``kv_lens[b] - q_lens[b] + i``); a request with no rows has no tile.

    ``route``: "auto" lists the blocks from the rows (``analysis.decode_rows``: the spec's cached
    position runs, or for a decode-shaped call the mask at each request's one row) where that
    applies, else runs the general route; "general" always runs the column analysis and the tile
    classifier once per distinct (q_len, kv_len) with the tile plan's rows = ``block_q``; "rows"
    refuses to fall back (tests).  Both give the same, exact lists (where the general analysis is
    not exact, the tiles it leaves undecided are classified by the predicate, ``analysis.tile_eval``)."""
    kv_lens = np.asarray(kv_lens, np.int64)
    batch = len(kv_lens)
    check_length(int(kv_lens.max(initial=0)), "a request's kv_len")
    if splits < 1:
        raise PlanError(f"split count must be at least 1, got {splits}")
    if block_q < 1:
        raise PlanError(f"query tile rows must be at least 1, got block_q = {block_q}")
    if q_lens is not None:
        q_lens = np.asarray(q_lens, np.int64)
        if q_lens.shape != (batch,):
            raise PlanError(f"q_lens has {q_lens.size} entries; the cache holds B = {batch} requests")
        if batch and (q_lens.min() < 0 or (q_lens > kv_lens).any()):
            for name, bad in (("is negative", q_lens < 0),
                              ("exceeds kv_lens", (q_lens > kv_lens) & (kv_lens > 0))):
                if bad.any():
                    b = int(np.flatnonzero(bad)[0])
                    raise PlanError(f"q_lens[{b}] = {int(q_lens[b])} {name} (kv_lens[{b}] = {int(kv_lens[b])})")
        if batch and q_lens.min() == 1 and q_lens.max() == 1:
            q_lens = None  # one row per request: decode
    if route not in ("auto", "general", "rows"):
        raise ValueError(f"route must be auto, general or rows, got {route!r}")
    return split_blocks(program, kv_lens, tensors or {}, block_n, splits, q_lens, block_q, route=route)


def split_blocks(program: ir.Program, kv_lens: np.ndarray, tensors: dict, block_n: int, splits: int,
                 q_lens: np.ndarray | None, block_q: int, *, longest: int | None = None,
                 nonempty: bool = False, route: str = "auto", bounds=None) -> DecodeBlocks:
    """:func:`decode_blocks` for a caller that checked its arguments (``backends.triton.decode``):
    ``kv_lens`` int64, ``q_lens`` int64 or None for one row per request; ``longest`` (the
    largest length) and ``nonempty`` (every length >= 1) when it knows them.  ``bounds`` (a
    ``SplitBounds`` of the spec's policy) replaces the ``splits`` balanced shares of blocks."""
    batch = len(kv_lens)
    if program.flashmask:
        from .inputs import check_flashmask
        check_flashmask(program, tensors)
    one_row = q_lens is None and batch > 0
    reads.check_requests(program, tensors, kv_lens, q_lens)
    if q_lens is None:
        q_lens = decode_rows.constant("ones", batch)
    n_tiles = q_lens if block_q == 1 or one_row else -(-q_lens // block_q)
    lists = None
    if route != "general":
        lists = _row_lists(program, kv_lens, q_lens, tensors, block_n, block_q, one_row,
                           int(kv_lens.max(initial=1)) if longest is None else max(longest, 1), nonempty)
    if lists is None:
        if route == "rows":
            raise PlanError("the rows' route does not apply to this call")
        lists = _general_lists(program, kv_lens, q_lens, n_tiles, tensors, block_n, block_q)
    split_bounds = None
    if bounds is not None:
        splits = bounds.capacity
        req = np.arange(batch) if one_row else np.repeat(np.arange(batch), n_tiles)
        entry_ptr, lists = _slot_entries(lists, req, bounds.starts, bounds.ends, block_n)
        split_bounds = np.stack([bounds.starts, bounds.ends], axis=-1).astype(np.int32).reshape(-1)
    elif splits == 1 and lists.ptr is not None:
        entry_ptr = lists.ptr
    elif splits == 1:
        entry_ptr = np.zeros(len(lists.counts) + 1, np.int32)
        np.cumsum(lists.counts, out=entry_ptr[1:])
    else:
        entry_ptr = np.zeros(len(lists.counts) * splits + 1, np.int32)
        q, r = np.divmod(lists.counts, splits)  # balanced: the first r splits take one more block
        np.cumsum((q[:, None] + (np.arange(splits) < r[:, None])).reshape(-1), out=entry_ptr[1:])
    if one_row:  # a tile per request, its row 0
        tile_req, tile_row0 = decode_rows.constant("arange32", batch), decode_rows.constant("zeros32", batch)
    else:
        tile_req = np.repeat(np.arange(batch), n_tiles).astype(np.int32)
        first = np.cumsum(n_tiles) - n_tiles
        tile_row0 = ((np.arange(len(tile_req)) - np.repeat(first, n_tiles)) * block_q).astype(np.int32)
    return DecodeBlocks(block_n, splits, entry_ptr, lists.blocks, lists.partial, lists.skipped, block_q,
                        tile_req, tile_row0, split_bounds)


def _slot_entries(lists, req: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_n: int):
    """(entry_ptr [tiles * S_cap + 1], the lists re-laid per slot) under explicit split bounds:
    slot s of a tile of request b lists the tile's visited blocks that meet ``[starts[b, s],
    ends[b, s])``, ascending.  A block a bound cuts is listed for both slots (each program masks
    its keys to its own range), so the slots own disjoint positions exactly as the policy says."""
    counts = np.asarray(lists.counts, np.int64)
    n_tiles, cap = len(counts), starts.shape[1]
    s, e = starts[req], ends[req]  # [tiles, S_cap]
    first = s // block_n
    stop = np.where(e > s, -(-e // block_n), first)  # blocks [first, stop) meet the slot
    width = max(int(stop.max(initial=0)), int(lists.blocks.max(initial=0)) + 1) + 1
    key = np.repeat(np.arange(n_tiles, dtype=np.int64) * width, counts) + lists.blocks
    row = np.arange(n_tiles, dtype=np.int64)[:, None] * width
    lo, hi = np.searchsorted(key, row + first).reshape(-1), np.searchsorted(key, row + stop).reshape(-1)
    entry_ptr = np.zeros(n_tiles * cap + 1, np.int64)
    np.cumsum(hi - lo, out=entry_ptr[1:])
    idx = np.arange(entry_ptr[-1]) + np.repeat(lo - entry_ptr[:-1], hi - lo)
    return entry_ptr.astype(np.int32), lists._replace(blocks=lists.blocks[idx], partial=lists.partial[idx], ptr=None)


def _row_lists(program, kv_lens, q_lens, tensors, block_n, block_q, one_row, longest, nonempty):
    """``analysis.decode_rows``' lists, or None where they do not apply (the general route
    then runs, and raises its own errors for bad tensors)."""
    dr = decode_rows
    runs = dr.cached_position_runs(program, longest)
    if runs is not None:
        table = dr.decode_table(runs, block_n) if one_row else None
        if table is not None:
            return dr.one_row_lists(table, kv_lens, nonempty)
        return dr.run_lists(runs, kv_lens, q_lens, block_n, block_q)
    if q_lens.size and int(q_lens.max()) > 1:
        return None
    if any(n not in tensors for n in dr.mask_facts(program)[1]):
        return None
    try:
        return dr.slab_lists(program, kv_lens, q_lens, tensors, block_n)
    except PlanError:
        return None


def _general_lists(program, kv_lens, q_lens, n_tiles, tensors, block_n, block_q):
    """The column analysis and the tile classifier once per distinct (kv_len, q_len)."""
    tensors = {n: t.astype(np.int64) if t.dtype.kind in "iu" else t
               for n, t in ((n, np.asarray(t)) for n, t in tensors.items())}
    batch = len(kv_lens)
    # per request, its tiles' (block indices, partial flags)
    per_tile: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(batch)]
    skipped = 0
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int8))
    for t_len, c_len in sorted({(int(t), int(c)) for t, c in zip(kv_lens, q_lens) if c > 0}):
        rows = np.flatnonzero((kv_lens == t_len) & (q_lens == c_len))
        if t_len == 0:  # decode's default row over an empty request: nothing to read
            for b in rows:
                per_tile[b] = [empty] * int(n_tiles[b])
            continue
        classes = run_plan_pipeline(("tiles",), program=program, batch=batch, s_q=c_len, s_k=t_len,
                                    tensors=tensors, block_m=block_q, block_n=block_n,
                                    method="auto")["tiles"].classes  # [B', H', T_q, T_k]
        for b in rows:
            c = classes[b if classes.shape[0] > 1 else 0]
            visited = ~(c == 0).all(axis=0)  # [T_q, T_k]
            partial = ~(c == 2).all(axis=0) & visited
            skipped += int((~visited).sum())
            for j in range(int(n_tiles[b])):
                idx = np.flatnonzero(visited[j]).astype(np.int32)
                per_tile[b].append((idx, partial[j, idx].astype(np.int8)))
    tiles = [t for req in per_tile for t in req]
    counts = np.array([len(idx) for idx, _ in tiles], np.int64)
    blocks = np.concatenate([idx for idx, _ in tiles]) if tiles else np.zeros(0, np.int32)
    partial = np.concatenate([p for _, p in tiles]) if tiles else np.zeros(0, np.int8)
    return decode_rows.TileLists(counts, blocks.astype(np.int32), partial.astype(np.int8), skipped)


# ---------------------------------------------------------------- split plans (decode, append, mixed batches)
# The split heuristic's N_SM when no device is read (an H100 SXM / H200: 132 SMs): the numpy backend
# (no SMs: it plans what the GPU kernel would), Triton's interpreter, `attnc plan --device sm_90`.
DEFAULT_SMS = 132
# K/V rows per producer segment on contiguous and ragged caches (a page is never merged either)
SPLIT_BLOCK_ROWS = 16


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """A split-K/V plan of one call over a concrete K/V layout (M4.5 §0x03, §0x04, §0x08F).

    ``manifest`` holds each request's ``(T, C)``: ``C = q_lens[b]`` query rows at absolute
    positions ``T .. T + C - 1`` over ``kv_lens[b] = T + C`` visible keys.  ``bounds`` splits
    every request's ``[0, kv_lens[b])``; ``graph`` is the schedule (producer tasks
    ``(b, kv_head, s)``, workspace buffers, reducers ``(b, h_q)``), already validated for exact
    coverage.  The ``seg_*`` arrays list, per producer slot ``(b, s)``, the storage runs its
    K/V range lives in (:func:`compiler.analysis.layout.storage_segments`): the program reads
    exactly those rows and nothing past a request's length."""

    program_digest: str
    layout: object            # compiler.analysis.layout.KVLayout
    manifest: object          # compiler.analysis.phases.Manifest
    bounds: object            # compiler.analysis.splits.SplitBounds
    call: object              # compiler.analysis.ledger.DecodeCall
    graph: object             # networkx.DiGraph (compiler.analysis.schedule)
    seg_ptr: np.ndarray       # [B * S_cap + 1]: slot (b, s) owns segments seg_ptr[b*S_cap+s] ..
    seg_block: np.ndarray     # page / cache row / 0 (ragged)
    seg_offset: np.ndarray    # first row inside the block
    seg_count: np.ndarray     # rows
    seg_t0: np.ndarray        # logical position of the first row
    num_sms: int | None = None
    # the backend's launch of this call (``compiler/launch_plan.py``: engine, slots, the workspace it
    # allocates, the device facts it was decided with), or None: the plan alone
    launch: dict | None = None

    # ------------------------------------------------------------ shapes
    @property
    def batch(self) -> int:
        return self.bounds.batch

    @property
    def capacity(self) -> int:
        return self.bounds.capacity

    @property
    def kv_lens(self) -> np.ndarray:
        return self.layout.kv_lens

    @property
    def q_lens(self) -> np.ndarray:
        return self.manifest.C

    @property
    def qo_indptr(self) -> np.ndarray:
        return self.manifest.qo_indptr

    @property
    def total_q(self) -> int:
        return int(self.manifest.C.sum())

    @property
    def s_k(self) -> int:
        """The size of a declared tensor's ``s`` axis: the longest request's K/V length."""
        return int(self.kv_lens.max(initial=0))

    def workspace_fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """ABI field -> (allocation shape, dtype name), from the schedule's workspace nodes."""
        nodes = self.graph.nodes
        return {f.name: (tuple(nodes["workspace", f.name]["shape"]), nodes["workspace", f.name]["dtype"])
                for f in self.call.state_fields()}

    def state_rows(self) -> np.ndarray:
        """The first workspace row of each request: the graph keeps one row per request when
        no request has more than one query row (``[B, H_q, S_cap]``), else packed query rows."""
        lead = next(iter(self.workspace_fields().values()))[0][0]
        if lead == self.batch and self.graph.graph["q_lens"] and max(self.graph.graph["q_lens"]) <= 1:
            return np.arange(self.batch, dtype=np.int64)
        return self.qo_indptr[:-1].copy()

    # ------------------------------------------------------------ what the program reads
    def kernel_args(self) -> dict[str, object]:
        """The plan as the plain ints and arrays the generated split program reads."""
        from .analysis.ledger import consumed_slots
        q = self.q_lens
        live = self.bounds.nonempty & (q[:, None] > 0)
        return {
            "batch": self.batch, "capacity": self.capacity, "total_q": self.total_q,
            "kv_lens": self.kv_lens, "q_lens": q, "q_start": self.manifest.T, "qo_indptr": self.qo_indptr,
            "split_start": self.bounds.starts, "split_end": self.bounds.ends, "split_live": live,
            "consumed": consumed_slots(self.bounds, self.call) & (q[:, None] > 0),
            "state_row": self.state_rows(), "workspace": self.workspace_fields(),
            "seg_ptr": self.seg_ptr, "seg_block": self.seg_block, "seg_offset": self.seg_offset,
            "seg_count": self.seg_count, "seg_t0": self.seg_t0,
        }

    def check_call(self, program: ir.Program, layout, q_lens) -> None:
        """Refuse a plan made for another spec, another layout or other lengths."""
        if ir.digest(program) != self.program_digest:
            raise PlanError("plan was made for a different spec")
        mine, theirs = self.layout, layout
        if (mine.kind, mine.order, mine.table) != (theirs.kind, theirs.order, theirs.table):
            raise PlanError(f"plan was made for a {mine.kind} {mine.order} cache, the call has a "
                            f"{theirs.kind} {theirs.order} cache")
        for name in ("kv_lens", "indptr", "block_table", "kv_indptr", "kv_indices", "kv_last_page_len",
                     "cache_batch_idx"):
            a, b = getattr(mine, name), getattr(theirs, name)
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                raise PlanError(f"plan was made for another {name} than the call's")
        if not np.array_equal(self.q_lens, np.asarray(q_lens)):
            raise PlanError(f"plan was made for q_lens {self.q_lens.tolist()}, the call has "
                            f"{np.asarray(q_lens).tolist()}")

    def microbatch(self, request_ids=None, cache_rows=None):
        """The call's frozen manifest (``analysis.microbatch``): ``request_ids`` (default 0..B-1)
        and ``cache_rows`` (default the layout's ``cache_batch_idx``, else 0..B-1) with its T, C."""
        from .analysis.microbatch import MicrobatchManifest
        b = np.arange(self.batch)
        rows = self.layout.cache_batch_idx if cache_rows is None else cache_rows
        return MicrobatchManifest.freeze(b if request_ids is None else request_ids, b if rows is None else rows,
                                         self.manifest.T, self.manifest.C)

    def allocated_bytes(self) -> int:
        """The bytes of the workspace a split launch of this plan allocates (``ledger.allocation``:
        every (query row, head, slot) state, 16-byte aligned fields), what the Triton launch
        allocates for it."""
        from .analysis.ledger import allocated_bytes
        c = self.call
        return allocated_bytes(c.abi, c.cache_dtype, self.total_q, c.heads_q, self.capacity, c.d_v)

    # ------------------------------------------------------------ reports (`attnc plan`)
    def ledgers(self):
        """The plan's ledgers (``analysis.schedule.SplitLedgers``), the pipeline's last step over
        this plan's own results."""
        return run_plan_pipeline(("ledgers",), graph=self.graph, bounds=self.bounds, call=self.call,
                                 layout=self.layout, manifest=self.manifest)["ledgers"]

    def report(self, request_ids=None, cache_rows=None) -> dict:
        """Split bounds, grids, owners, workspace, ledgers and the manifest (:meth:`microbatch`) as
        one JSON-able dict (DESIGN §7 field names)."""
        from .analysis import ledger as L
        from .analysis import schedule as S
        g, lay = self.graph, self.layout
        grids, owners = S.launch_grids(g), S.owner_counts(g)
        ledgers = self.ledgers()
        ws, led, meta = ledgers.workspace, ledgers.traffic, ledgers.metadata
        fields = [{"name": name, "dtype": dtype, "shape": list(shape),
                   "bytes": int(np.prod(shape)) * L.dtype_bytes(dtype)}
                  for name, (shape, dtype) in self.workspace_fields().items()]
        return {
            "name": g.graph.get("name"), "heads_q": self.call.heads_q, "heads_kv": self.call.heads_kv,
            "group": self.call.group, "d_qk": self.call.d_qk, "d_v": self.call.d_v,
            "dtype": self.call.cache_dtype,
            "cache": {"kind": lay.kind, "layout": lay.order, "page_size": lay.page_size, "table": lay.table},
            "policy": self.bounds.policy, "state": self.call.abi, "num_sms": self.num_sms,
            "kv_lens": self.kv_lens.tolist(), "q_lens": self.q_lens.tolist(),
            "qo_indptr": self.qo_indptr.tolist(), "phases": list(self.manifest.phases),
            "capacity": self.capacity, "splits_per_request": self.bounds.splits_per_request.tolist(),
            "split_lengths": self.bounds.split_lengths(),
            "split_bounds": [[list(r) for r in self.bounds.ranges(b)] for b in range(self.batch)],
            "producer_grid": list(grids["producer"]), "producer_tasks": list(grids["producer_tasks"]),
            "reducer_grid": list(grids["reducer"]), "owners": owners,
            "workspace": {"abi": ws.abi, "fields": fields},
            "workspace_bytes": {"per_state": ws.per_state, "configured": ws.logical,
                                "capacity": ws.capacity, "padding": ws.padding,
                                "allocated": self._launch_bytes()},
            "ledgers": {**led.as_dict(), "kv_reuse_factor": led.kv_reuse_factor,
                        "metadata": {"fields": dict(meta.fields), "table": meta.table, "total": meta.total},
                        "page_lookups": ledgers.page_lookups},
            "manifest": self.microbatch(request_ids, cache_rows).to_json(),
            **({"launch": self.launch} if self.launch is not None else {}),
            **self._fallback_report(ws),
        }

    def _launch_bytes(self) -> int:
        """The workspace bytes the launch allocates: the backend's account when it decided the
        launch (none on an engine that does not split), else the ledger's for these slots."""
        if self.launch is not None and "workspace_bytes" in self.launch:
            return int(self.launch["workspace_bytes"])
        return self.allocated_bytes()

    def _fallback_report(self, ws) -> dict:
        """A shared-shift plan's fallback (M4.5 §0x09C): the field it adds to the workspace and the
        logical demand of recomputing every output with (m, l, u) -- its worst case."""
        from dataclasses import replace as _replace
        from .analysis import ledger as L
        extra = L.fallback_fields(self.call.abi)
        if not extra:
            return {}
        worst = L.decode_ledger(self.bounds, _replace(self.call, abi="mlu"), self.q_lens)
        return {"fallback": {"fields": [{"name": f.name, "dtype": f.dtype,
                                         "bytes": ws.capacity_states * f.bytes_per_state(ws.d_v_padded)}
                                        for f in extra],
                             "worst_case": worst.as_dict()}}

    def text(self) -> str:
        """:meth:`report` for a reader."""
        r = self.report()
        n = lambda x: f"{x:,}"  # noqa: E731
        c = r["cache"]
        cache = f"{c['kind']} {c['layout']}" + (f", page_size {c['page_size']}, {c['table']} table"
                                                if c["kind"] == "paged" else "")
        lines = [f"plan {r['name']}: heads {r['heads_q']}/{r['heads_kv']} (GQA group {r['group']}), "
                 f"head_dim {r['d_qk']}/{r['d_v']}, {r['dtype']}",
                 f"  cache {cache}; split {r['policy']}, {r['capacity']} slot(s) per request; "
                 f"state {r['state']}" + (f"; N_SM {r['num_sms']}" if r["num_sms"] else ""),
                 "split bounds:",
                 f"  {'b':>3} {'kv_len':>7} {'q_len':>6} {'phase':>8} {'splits':>6}  lengths"]
        for b in range(self.batch):
            lines.append(f"  {b:>3} {r['kv_lens'][b]:>7} {r['q_lens'][b]:>6} {r['phases'][b]:>8} "
                         f"{r['splits_per_request'][b]:>6}  {_runs(r['split_lengths'][b])}")
        o = r["owners"]
        lines += [f"grids: producer {r['producer_grid']} (GQA tasks {r['producer_tasks']}), "
                  f"reducer {r['reducer_grid']}",
                  f"owners: {o['producer_owners']} producer ({o['active_owners']} active, "
                  f"{o['empty_or_inactive_owners']} empty or inactive), {o['reducer_owners']} reducer; "
                  f"{o['nonempty_binary_merges']} non-empty merges, {o['identity_bypasses']} identity bypasses"]
        w = r["workspace_bytes"]
        lines.append(f"workspace ({r['state']}): {w['per_state']} B/state, configured {n(w['configured'])} B, "
                     f"capacity {n(w['capacity'])} B, a launch allocates {n(w['allocated'])} B")
        for f in r["workspace"]["fields"]:
            lines.append(f"  {f['name']:<14} {f['dtype']:>4} {str(f['shape']):<22} {n(f['bytes']):>12} B")
        if "fallback" in r:
            fb = r["fallback"]
            lines.append("  fallback (m, l, u) adds " + ", ".join(f"{f['name']} {n(f['bytes'])} B" for f in fb["fields"])
                         + f"; recomputing every output demands {n(fb['worst_case']['two_launch_demand'])} B")
        if "launch" in r:
            lines += launch_lines(r["launch"])
        led = r["ledgers"]
        lines += ["ledgers (logical bytes):",
                  f"  unique Q {n(led['unique_q'])}, Q demand {n(led['q_demand'])}",
                  f"  unique K/V {n(led['unique_kv'])}, K/V demand {n(led['kv_demand'])} "
                  f"(x{led['kv_reuse_factor']:.2f})",
                  f"  workspace round trip {n(led['workspace_roundtrip'])}, final O {n(led['final_output'])}, "
                  f"final LSE {n(led['final_lse'])}: reduction path {n(led['reduction_path'])}",
                  f"  two-launch demand {n(led['two_launch_demand'])}",
                  "  metadata " + ", ".join(f"{k} {n(v)}" for k, v in led["metadata"]["fields"].items())
                  + f" (total {n(led['metadata']['total'])})"
                  + (f"; {n(led['page_lookups'])} page lookups" if c["kind"] == "paged" else "")]
        return "\n".join(lines) + "\n"


def launch_lines(launch: dict) -> list[str]:
    """A backend's launch of a split call (``SplitPlan.launch``) for a reader."""
    name = launch.get("backend", "?")
    d = launch["device"]
    where = ("Triton's interpreter" if d["interpreter"] else f"sm_{d['capability']}") + f", {d['num_sms']} SMs" \
        + (", Gluon" if d["gluon"] else "")
    assumed = launch.get("assumed") or []
    facts = f"device {where}" + (f"; assumed: {', '.join(assumed)}" if assumed else "") \
        + ("" if d["here"] else " (no device read: --device here reads this host's)")
    if "refused" in launch:
        return [f"launch ({name}): refused: {launch['refused']}", f"  {facts}"]
    if launch["engine"] == "gluon":
        what = (f"the Gluon engine over the cache, unsplit, {launch['block_q']} x {launch['block_n']} tiles, "
                "no workspace")
    else:
        what = (f"split producer + combine, {launch['slots']} slot(s), block_n {launch['block_n']}, block_q "
                f"{launch['block_q']}, {launch['num_warps']} warps, {launch['num_stages']} stages, workspace "
                f"{launch['workspace_bytes']:,} B")
    return [f"launch ({name}): {what}; slots decided by {launch['decided_by']}, tuning cache: "
            f"{launch['tuning_cache']}", f"  {facts}"]


def _runs(lengths: list[int]) -> str:
    """``[449, 449, 449, 448, ...]`` as ``449 x3, 448 x5``."""
    out: list[list[int]] = []
    for x in lengths:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return ", ".join(f"{x} x{k}" if k > 1 else str(x) for x, k in out) or "-"


def split_policy(program: ir.Program):
    """The spec's ``split =`` policy (compiler.analysis.splits)."""
    from .analysis.splits import from_ir
    return from_ir(program.split)


def split_occupancy(program: ir.Program, q_lens, num_sms: int = DEFAULT_SMS, **overrides):
    """What the split heuristic reads (compiler.analysis.splits.Occupancy) for this call."""
    return occupancy_for(program, q_lens, num_sms, **overrides)


def plan_split(program: ir.Program, layout, q_lens=None, *, policy=None, occupancy=None,
               num_sms: int = DEFAULT_SMS, block_rows: int | None = SPLIT_BLOCK_ROWS) -> SplitPlan:
    """Plan a split-K/V call of ``program`` over ``layout`` (a validated KVLayout): the pipeline's
    layout -> manifest (phases) -> occupancy -> bounds (splits) -> schedule graph -> segments
    (``analysis.PLAN_PIPELINE``).

    ``q_lens`` (default: one query row per request, decode, as the kernels' default; a
    request with no keys then has a row that sees nothing) gives each request's new query rows;
    ``policy`` overrides the spec's ``split =`` (``launch_plan.plan_launch`` passes the Triton
    launch's; left out, ``auto`` takes the numpy backend's tuned count for the call, else
    ``splits.auto_splits``); ``occupancy`` (or ``num_sms``) is what ``heuristic``/``auto`` read.
    Every contract break is a PlanError, before any arithmetic."""
    p = program
    kv = layout.kv_lens
    q = np.ones(kv.size, np.int64) if q_lens is None else q_lens
    checked = run_plan_pipeline(("layout", "manifest"), program=p, kv_layout=layout, q_lens=q)
    given = dict(checked)
    if policy is None:  # `split = auto` takes `attnc tune`'s split count for the numpy key, if cached
        from . import tune
        try:
            key = tune.call_key(p, len(kv), [int(x) for x in q], [int(x) for x in kv], "numpy")
        except AttncError:
            key = None
        if key is not None:
            given["policy"] = tune.tuned_split_policy(p, key)
    else:
        given["policy"] = policy
    if occupancy is not None:
        given["occupancy"] = occupancy
    r = run_plan_pipeline(("layout", "manifest", "occupancy", "bounds", "call", "graph", "segments"),
                          program=p, num_sms=num_sms, block_rows=block_rows, **given)
    return SplitPlan(ir.digest(p), r["layout"], r["manifest"], r["bounds"], r["call"], r["graph"],
                     *r["segments"], num_sms=getattr(r["occupancy"], "num_sms", None))


def logical_layout(program: ir.Program, kv_lens):
    """A layout of the spec's ``cache =`` kind for lengths alone (``attnc plan``): pages are
    allocated in request order (page ids do not change a plan's bounds, grids, segment
    counts or bytes; a real call's tables do only change which pages are read)."""
    from .analysis import layout as lay
    from .analysis.ledger import dtype_bytes
    p = program
    kv = np.asarray(kv_lens, np.int64)
    resources.check_lengths("kv_lens", kv)
    dims = dict(heads_q=p.heads_q, heads_kv=p.heads_kv, d_qk=p.d_qk, d_v=p.d_v, elem_bytes=dtype_bytes(p.dtype))
    kind = p.cache.kind.value
    if kind == "contiguous":
        return lay.contiguous(kv, order=p.cache.layout.value, **dims)
    if kind == "ragged":
        return lay.ragged(np.concatenate([[0], np.cumsum(kv)]), **dims)
    size = p.cache.page_size
    n_pages = -(-kv // size)
    pages = int(n_pages.sum())
    table_entries = pages if (p.cache.table or "dense") == "csr" else kv.size * int(n_pages.max(initial=1))
    resources.require(f"the split plan over {pages:,} pages (the page table, a storage run per page)",
                      24 * table_entries + resources.split_plan_bytes(pages))
    first = np.concatenate([[0], np.cumsum(n_pages)])
    pool = max(int(first[-1]), 1)
    common = dict(page_size=size, num_pages=pool, order=p.cache.layout.value, **dims)
    if (p.cache.table or "dense") == "csr":
        last = np.where(n_pages > 0, kv - size * (n_pages - 1), 0)
        return lay.paged_csr(first, np.arange(first[-1]), last, **common)
    table = np.full((kv.size, max(int(n_pages.max(initial=0)), 1)), -1, np.int64)
    for b in range(kv.size):
        table[b, :n_pages[b]] = np.arange(first[b], first[b + 1])
    return lay.paged_dense(table, kv, **common)
