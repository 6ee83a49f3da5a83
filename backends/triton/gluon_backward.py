"""The backward pass for Hopper (sm_90) in Gluon: D, then a dK/dV pass and a dQ pass, each on TMA
loads and wgmma, walking the plan (SKIP blocks never loaded, FULL blocks without the element mask,
PARTIAL blocks -- and, unless S_q / S_k are multiples of the tiles, the blocks across them -- with
the spec's ``VISIBLE`` predicate and the bounds; the score program's derivative ``SCORE_GRAD``
inlined as in the Triton backward).  Deterministic: no atomics, every gradient element written by
one program, dK/dV summed over the GQA group in a fixed order.

* D = rowsum(dO * O) - dLSE: the Triton backward's ``_bwd_delta``.
* dK/dV (``_bwd_dkdv_ws``): one program per (K/V tile of 128 keys, request * K/V head), in
  ``prefill._job``'s order over each plane's key tiles sorted by work.  A TMA warp loads the tile's
  K and V once, then streams the Q and dO tiles (BLOCK_M rows) of the tile's *group column list*
  (``group_lists``: for every query head of the GQA group in turn, the query blocks whose class is
  not SKIP) through STAGES stages; two consumer warpgroups (FlashAttention-3's split), 64 keys each,
  released stage by stage through mbarriers, run per entry
      S^T = K Q^T and dP^T = V dO^T (issued together), P^T = exp2(S^T scale - LSE),
      dV += P^T dO (under dS^T's arithmetic), dS^T = P^T (dP^T - D), dK += dS^T Q,
  keeping dK and dV in registers; one warpgroup's arithmetic runs under the other's MMAs.
* dQ (``_bwd_dq_ws``): the forward engine's structure -- one program per (128-row query tile,
  request * query head), a TMA warp streaming the K/V blocks of the tile's row of the plan (FULL
  blocks, then PARTIAL ones), two consumer warpgroups of 64 rows: S = Q K^T, dP = dO V^T, dS,
  dQ += dS K.  Seven GEMMs per block in all (S and dP are computed in both passes) against
  FlashAttention's five with atomic dQ, the price of bit-identical gradients.

``GluonBackwardConfig`` also selects ``_bwd_dkdv`` (the same step on 8 warps that issue their own
loads: no warp specialization) and dQ by the Triton backward's dQ pass or by float32 atomics inside
``_bwd_dkdv`` (five GEMMs, not bit-reproducible; slower at d 128 on the H200), or fused into
``_bwd_dkdv_ws`` (dq "fused"; five GEMMs, bit-reproducible), FlashAttention-3's scheme: both
consumers put their halves of the entry's dS^T in shared memory (two buffers), and once both are
there dQ = dS K over the tile's 128 keys is made (d 128: each consumer 64 of the columns; d 64: the
consumers take whole entries in turn, ``dq_split``) into a float32 tile in shared memory, which a
one-warp dQ writer adds into a float32 workspace [B * H_q * S_qp, d] with one TMA reduce-add (in
L2; no per-element atomics).  The adds to a (query tile, query head) go in a fixed order, FlashAttention-3's
deterministic scheme: a counter per tile; an entry's turn (``group_lists``: how many key tiles
launched before its own compute the same tile) is awaited with acquire loads, the turn-0 program
stores (no zeroing), its writes are waited for, and the counter is raised with release; programs
wait only on programs launched earlier, and the walk goes down the query blocks so that a causal
plane's key tiles move in step (each waits one entry on its predecessor).  "fused_atomic" adds in
any order into a zeroed workspace.  ``_bwd_dq_store`` then scales and casts (a tile whose count is
0 -- nobody computed it -- is 0).  ``choose`` is the one decision place (``refusal``: what the
passes cannot run goes to the Triton backward).

Tiles past S_q or S_k: TMA reads the next head's rows there (zeros past the tensor's end); their
scores are masked, so P = 0 and nothing of them reaches this head's gradients (for finite inputs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import choice, device, grad as G, launch as L, plans as P
from .raw_launch import RAW_DESCRIPTORS, launches_hooked
from .kernels import backward as K
from .kernels.gluon_backward import HAS_GLUON, _bwd_dkdv, _bwd_dkdv_ws, _bwd_dq_ws
from .kernels.gluon_engine import SMEM

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except (ImportError, AttributeError):  # a Triton without Gluon: ``refusal`` refuses the engine
    gl = TensorDescriptor = None

HEAD_DIMS = (64, 128)  # q.k's and v's (equal)
GROUP_BITS = 7  # an entry: query block << 8 | head within the group << 1 | PARTIAL
MAX_GROUP = 1 << GROUP_BITS
MIN_ROWS = 128  # (B * H * S rows of Q and of K/V: no TMA box is taller than its tensor)
_INPUTS = {"q": 0, "k": 1, "v": 2}  # the passes' descriptor arguments of the inputs (``_descriptor``'s raw)


DQ_MODES = ("gluon", "triton", "atomic", "fused", "fused_atomic")
FUSED = {"fused": 1, "fused_atomic": 2}  # the dK/dV kernel's FUSED_DQ: ordered (deterministic), unordered


@dataclass(frozen=True)
class GluonBackwardConfig:
    """The Gluon backward's launch: the dK/dV pass's tiles (``block_m`` query rows per entry,
    ``block_n`` keys per program), Q/dO stages and kernel (``warp_specialize``: a TMA warp and two
    consumer warpgroups, ``_bwd_dkdv_ws``; else ``_bwd_dkdv``, 8 warps issuing their own loads), and
    how dQ is made (``dq``): "gluon", its own warp-specialized pass (``_bwd_dq_ws``, 128-row tiles over
    ``dq_block_n``-key blocks, ``dq_stages`` K/V stages); "triton", the Triton backward's dQ pass;
    "atomic", float32 atomics inside the (plain) dK/dV pass -- five GEMMs per block instead of
    seven, not bit-reproducible; "fused", the warp-specialized dK/dV pass makes dQ too (five GEMMs:
    each entry's dS K added into a float32 workspace by a dQ warp, the K/V tiles of a query tile in
    a fixed order behind a counter per (query tile, head): bit-reproducible), then a pass scales and
    casts it; "fused_atomic", the same with the adds unordered (not bit-reproducible)."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    warp_specialize: bool = True
    dq: str = "gluon"
    dq_block_n: int = 64
    dq_stages: int = 2
    dq_buffers: int = 1  # fused: float32 dQ tiles per consumer (2: it may run two entries ahead of the writer)
    dq_split: int = 0  # fused: 1 or 2 (``dq_split``); 0, by the head dim

    def __post_init__(self):
        if self.dq not in DQ_MODES:
            raise ValueError(f"GluonBackwardConfig.dq must be one of {', '.join(DQ_MODES)}, not {self.dq!r}")
        if self.dq == "atomic" and self.warp_specialize:
            raise ValueError("GluonBackwardConfig: dq='atomic' runs in the plain dK/dV kernel (warp_specialize=False)")
        if self.dq in FUSED and not self.warp_specialize:
            raise ValueError(f"GluonBackwardConfig: dq={self.dq!r} runs in the warp-specialized dK/dV kernel "
                             "(warp_specialize=True)")
        if self.dq_split not in (0, 1, 2):
            raise ValueError(f"GluonBackwardConfig.dq_split must be 0 (by the head dim), 1 or 2, not {self.dq_split!r}")
        if self.dq_buffers not in (1, 2):
            raise ValueError(f"GluonBackwardConfig.dq_buffers must be 1 or 2, not {self.dq_buffers!r}")
        if self.warp_specialize and self.block_n != 128:
            raise ValueError("GluonBackwardConfig: the warp-specialized dK/dV kernel takes 128-key tiles (two halves "
                             f"of 64), not {self.block_n}")

    def describe(self) -> str:
        kind = "warp-specialized" if self.warp_specialize else "plain"
        return (f"gluon dK/dV {kind} {self.block_m} x {self.block_n}, {self.stages} stages; dQ {self.dq}"
                + (f" 128 x {self.dq_block_n}, {self.dq_stages} stages" if self.dq == "gluon" else "")
                + (f", {self.dq_buffers} dQ tiles per consumer" if self.dq in FUSED else "")
                + (f", dQ split {self.dq_split}" if self.dq in FUSED and self.dq_split else ""))

    def split(self, d: int) -> int:
        """The fused dQ's split at head dim d: the config's, else ``dq_split(d)``."""
        return self.dq_split or dq_split(d)


def default_config(d: int, deterministic: bool = True) -> GluonBackwardConfig:
    """The untuned launch: 64 query rows per dK/dV entry (registers: a consumer holds dK, dV, S^T and
    dP^T of its 64 keys); dQ at d 128 by its own pass on 128 x 64 tiles, at d 64 fused in order (both
    deterministic).  H200, kernel alone, causal B4 S8K (study r54): d 64 H32 fused 365.0 TFLOP/s
    against the own pass's 319.5; d 128 H16 fused 402.2 against 425.1 (the ordered adds wait on
    each other there; fused_atomic, not bit-reproducible, 463.8).  Study r58, after dQ's GEMMs were
    issued behind dV's and dK's: d 128 fused 424.3 against the own pass's 420.1 (causal), 448.2 against
    453.6 (full) -- level, so the own pass stays; dQ made by one warpgroup per entry (dq_split 1) 383.8.
    ``deterministic`` False (the caller's ``attnc.compile(..., deterministic=False)``): the fused dQ
    unordered at every head dim, 1.09x the deterministic default at d 128 (r58: 457.2, 492.7 full)."""
    if not deterministic:
        return GluonBackwardConfig(dq="fused_atomic")
    if d <= 64:
        return GluonBackwardConfig(dq="fused")
    return GluonBackwardConfig(dq_block_n=64)


def dq_split(d: int) -> int:
    """The fused dQ's split of each entry's dQ = dS K between the two consumer warpgroups: 2, each
    makes D / 2 columns (d 128: 64-column slices of K's 128-byte swizzled rows); 1, the warpgroups
    take whole entries in turn (d 64: a 32-column slice would cut a swizzle row)."""
    return 2 if d >= 128 else 1


def smem_bytes(d: int, config: GluonBackwardConfig) -> int:
    """Shared memory of the larger of the two passes' programs (2-byte elements, plus barriers): the
    dK/dV pass's K and V tiles and STAGES Q and dO tiles (and dS^T: atomic dQ one tile, fused two
    buffers; fused, the consumers' two float32 dQ tiles of D / dq_split columns); the dQ pass's Q and
    dO tiles and its K/V stages."""
    c = config
    ds = {"atomic": 1, "fused": 2, "fused_atomic": 2}.get(c.dq, 0) * c.block_m * c.block_n
    dq_tiles = 2 * 2 * c.dq_buffers * c.block_m * (d // c.split(d)) if c.dq in FUSED else 0  # (float32: 2 units)
    dkdv = 2 * c.block_n * d + 2 * c.stages * c.block_m * d + ds + dq_tiles
    dq = 2 * 128 * d + 2 * c.dq_stages * c.dq_block_n * d if c.dq == "gluon" else 0
    return 2 * max(dkdv, dq) + 128


def refusal(program, batch: int, s_q: int, s_k: int, bhsd_contiguous: bool, capability: int, interpreted: bool,
            config: GluonBackwardConfig) -> str | None:
    """Why the Gluon dK/dV pass cannot run this call (a sentence), or None: the one decision place
    (everything it refuses runs the Triton backward)."""
    if interpreted:
        return "Gluon kernels do not run in Triton's interpreter"
    if not HAS_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if capability != 90:
        return "the Gluon backward needs an sm_90 GPU (Hopper: wgmma and TMA)"
    if program.dtype not in ("f16", "bf16"):
        return f"the Gluon backward takes f16 / bf16, not {program.dtype}"
    if program.d_qk != program.d_v or program.d_qk not in HEAD_DIMS:
        return (f"the Gluon backward takes equal q.k and v head dims of {' or '.join(map(str, HEAD_DIMS))}, not "
                f"{program.d_qk} / {program.d_v}")
    if program.heads_q // program.heads_kv > MAX_GROUP:
        return f"the Gluon backward takes GQA groups of at most {MAX_GROUP} query heads"
    if not bhsd_contiguous:
        return "the Gluon backward reads contiguous bhsd tensors at 16-byte aligned addresses (TMA)"
    if min(batch * program.heads_q * s_q, batch * program.heads_kv * s_k) < MIN_ROWS:
        return f"the Gluon backward's TMA boxes need at least {MIN_ROWS} rows of Q and of K/V in all"
    if smem_bytes(program.d_qk, config) > SMEM:
        return f"the Gluon backward's buffers on {config.block_m} x {config.block_n} tiles exceed shared memory"
    return None


# ---------------------------------------------------------------- host side: the group column lists
def group_lists(classes: np.ndarray, group: int, fused: bool = False) -> dict:
    """The dK/dV pass's walk from the plan's tile classes [PLAN_B, PLAN_H, q_tiles, k_tiles]
    (0 SKIP, 1 PARTIAL, 2 FULL): for each (request plane, K/V head plane, key tile) -- K/V head
    planes: PLAN_H // group where the plan depends on the head, else 1 --, the computed query
    blocks of every query head of the group in turn, ascending, as ``ptr`` / ``ent`` (CSR; an entry
    is query block << 8 | head in group << 1 | PARTIAL); ``order``: each plane's key tiles by
    descending entries (the jobs' order); ``kv_planes``.  ``fused`` (the fused dQ): the query blocks
    descending, and ``turn``: beside each entry, how many key tiles of its plane that come before
    its own in ``order`` (the launch's order) compute the same (query block, head) -- the adds to a
    query tile's dQ go in turn; walking down, each key tile of a causal plane waits for its
    predecessor's entry of the same index only (a tile's walk starts where the previous one's does,
    at the last query block)."""
    pb, ph, qt, kt = classes.shape
    if ph > 1:
        kv_planes = ph // group
        c = classes.reshape(pb, kv_planes, group, qt, kt)
    else:
        kv_planes = 1
        c = np.broadcast_to(classes.reshape(pb, 1, 1, qt, kt), (pb, 1, group, qt, kt))
    c = c.transpose(0, 1, 4, 2, 3)  # [planes, key tile, head in group, query block]
    if fused:
        c = c[..., ::-1]
    c = c.reshape(-1, group * qt)  # [lists, (g, query block)]
    lists, flat = np.nonzero(c)  # row-major: by list, then head in group, then query block
    g, qb = np.divmod(flat, qt)
    if fused:
        qb = qt - 1 - qb
    ent = (qb.astype(np.int64) << 8) | (g.astype(np.int64) << 1) | (c[lists, flat] == 1)
    counts = np.bincount(lists, minlength=len(c))
    ptr = np.zeros(len(c) + 1, np.int32)
    np.cumsum(counts, out=ptr[1:])
    order = np.argsort(-counts.reshape(-1, kt), axis=1, kind="stable").astype(np.int32)
    out = {"ptr": ptr, "ent": ent.astype(np.int32), "order": order.reshape(-1), "kv_planes": kv_planes}
    if not fused:
        return out
    seen = np.take_along_axis((c != 0).reshape(-1, kt, group * qt), order[:, :, None], axis=1).astype(np.int32)
    before = np.cumsum(seen, axis=1, dtype=np.int32) - seen  # [planes, rank, cells]: earlier ranks computing it
    turns = np.empty_like(before)
    np.put_along_axis(turns, order[:, :, None], before, axis=1)
    out["turn"] = turns.reshape(-1, group * qt)[lists, flat]
    return out


# ---------------------------------------------------------------- host side: the launch
# Whether the backward takes the Gluon passes by default where ``refusal`` allows it (else only when
# a caller passes a GluonBackwardConfig).  Measured on the H200 (study r2, bench/results/README.md),
# kernel alone, B4 S8K bf16, against the Triton backward: causal d128 H16 428.5 / 357 TFLOP/s, full
# d128 457.5 / 375, causal d64 H32 324.9 / 115; every gradient within the Triton backward's error.
DEFAULT = True
REGS = (168, 240, 24)  # the warp-specialized kernels' maxnreg, consumer and producer registers
WRITER_REGS = 24  # the fused dQ's writer warp; it and the producer warp share a warpgroup, so both get the larger


def choose(program, config, s_q: int, s_k: int, tensors: tuple, bshd: bool, interpreted: bool,
           deterministic: bool = True):
    """The backward's engine for a call: a GluonBackwardConfig (the Gluon passes), or None (the
    Triton backward).  ``config``: the caller's -- a GluonBackwardConfig asks for the Gluon passes
    (a ValueError says why they cannot run), a ``grad.BackwardConfig`` for the Triton ones; None:
    the default (``DEFAULT``, where ``refusal`` allows).  ``tensors``: q, k, v and O (dO, which
    autograd may hand over expanded or strided, is copied where TMA cannot read it: ``tma_input``)."""
    asked = isinstance(config, GluonBackwardConfig)
    cfg = _candidate(program, config, deterministic)
    if cfg is None:
        return None
    t = tensors[0]
    capability = device.capability(t.device) if t.is_cuda else 0
    batch = t.shape[0]
    why = refusal(program, batch, s_q, s_k, not bshd and device.tma_ready(*tensors), capability, interpreted, cfg)
    if why is not None:
        if asked:
            raise ValueError(f"GluonBackwardConfig: {why}")
        return None
    return cfg


def _candidate(program, config, deterministic: bool) -> GluonBackwardConfig | None:
    """The Gluon passes' config a call asks for, before ``refusal``: the caller's GluonBackwardConfig,
    or the default (``default_config``) unless the caller asked for the Triton passes (a
    ``grad.BackwardConfig``) or ``DEFAULT`` is off (None)."""
    if isinstance(config, GluonBackwardConfig):
        return config
    if config is not None or not DEFAULT:
        return None
    return default_config(program.d_qk, deterministic)


def takes_copies(program, config, tensors: tuple, interpreted: bool, deterministic: bool = True) -> bool:
    """Whether a bhsd spec's backward call whose q, k, v and O (``tensors``) TMA cannot read as they
    are (transformers' token-major views, which the forward reads in place) copies them contiguous:
    where the Gluon passes (the caller's GluonBackwardConfig, or the default's) take the copies, which
    cost what the copies a forward on contiguous tensors made did (``choose`` then takes them)."""
    cfg = _candidate(program, config, deterministic)
    if cfg is None:
        return False
    q, k = tensors[0], tensors[1]
    capability = device.capability(q.device) if q.is_cuda else 0
    return refusal(program, q.shape[0], q.shape[2], k.shape[2], True, capability, interpreted, cfg) is None


def kernel_constexprs(module, config: GluonBackwardConfig, s_q: int, s_k: int) -> dict:
    """The Gluon passes' kernels for a call: {"dkdv": (kernel, constexprs, launch options), and where
    config.dq is "gluon", "dq": likewise; where it is fused, "store": the constexprs of
    ``_bwd_dq_store``} (the launch's and the compile test's one source)."""
    c, spec = config, module.SPEC
    score = dict(VISIBLE=module.visible, SCORE_GRAD=L.score_functions(module, L.position_end(s_q, s_k, None))[1],
                 HAS_SCORE=spec["HAS_SCORE"], SCALE=spec["SCALE"], H_Q=spec["H_Q"], H_KV=spec["H_KV"],
                 GROUP=spec["GROUP"])
    maxnreg, consumer, producer = REGS
    ws = dict(CONSUMER_REGS=consumer, PRODUCER_REGS=producer)
    out = {"dkdv": (_bwd_dkdv_ws if c.warp_specialize else _bwd_dkdv, dict(
        EVEN_M=s_q % c.block_m == 0, EVEN_N=s_k % c.block_n == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        D=spec["D_QK"], STAGES=c.stages, HEAD_GROUP=choice.HEAD_GROUP, ATOMIC_DQ=c.dq == "atomic",
        NUM_WARPS=4 if c.warp_specialize else 8, **score,
        **(dict(ws, FUSED_DQ=FUSED.get(c.dq, 0), WRITER_REGS=WRITER_REGS, DQ_SPLIT=c.split(spec["D_QK"]),
                DQ_BUFS=c.dq_buffers)
           if c.warp_specialize else {})),
        dict(num_warps=4, maxnreg=maxnreg) if c.warp_specialize else dict(num_warps=8))}
    if c.dq == "gluon":
        out["dq"] = (_bwd_dq_ws, dict(EVEN_M=s_q % 128 == 0, EVEN_N=s_k % c.dq_block_n == 0, ROWS=64,
                                      BLOCK_N=c.dq_block_n, D=spec["D_QK"], STAGES=c.dq_stages,
                                      HEAD_GROUP=choice.HEAD_GROUP, **ws, **score), dict(num_warps=4, maxnreg=maxnreg))
    if c.dq in ("atomic", *FUSED):
        out["store"] = (K._bwd_dq_store, dict(H_Q=spec["H_Q"], BLOCK=c.block_m if c.dq in FUSED else G.DELTA_ROWS,
                                              D_QK=spec["D_QK"], D_QK_PAD=spec["D_QK_PAD"], SCALE=spec["SCALE"],
                                              COUNTED=c.dq == "fused"), {})
    return out


def tma_input(t):
    """``t`` as the Gluon passes read it: itself where TMA can (contiguous, 16-byte aligned), else a
    contiguous copy (autograd's dO of ``o.sum()`` is an expanded view, for example)."""
    import torch
    return t if device.tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


class GluonBackwardLaunch:
    """The backward of one call shape on the Gluon passes: D by the Triton backward's ``_bwd_delta``,
    dK and dV by ``_bwd_dkdv_ws`` (or ``_bwd_dkdv``), dQ by ``_bwd_dq_ws`` (or the Triton backward's dQ
    pass, or float32 adds in the dK/dV pass -- atomic, fused, fused_atomic -- and ``_bwd_dq_store``).  ``retile(bm, bn)``: the call's plan on other tiles
    (``Plan.retile``: the mask analysis is reused)."""

    def __init__(self, module, config: GluonBackwardConfig, retile, shape: tuple, device):
        self.module, self.config = module, config
        self.batch, self.s_q, self.s_k = shape
        spec = module.SPEC
        self.h_q, self.h_kv, self.d = spec["H_Q"], spec["H_KV"], spec["D_QK"]
        c = config
        classes = retile(c.block_m, c.block_n).tiles.classes
        self.fused = c.dq in FUSED
        lists = group_lists(classes, spec["GROUP"], self.fused)
        host = {"order": lists["order"], "ptr": lists["ptr"], "ent": lists["ent"], "turn": lists.get("turn", np.zeros(1, np.int32))}
        self.q_tiles = classes.shape[2]
        self.s_qa = self.q_tiles * c.block_m  # (the fused dQ workspace's rows per head)
        k_tiles = classes.shape[3]
        bkv = self.batch * self.h_kv
        self.grid = (k_tiles * bkv,)
        q_off = self.s_k - self.s_q
        self.ints = (self.s_q, self.s_k, q_off, 0, *classes.shape[:2], lists["kv_planes"], k_tiles, bkv)
        kernels = kernel_constexprs(module, config, self.s_q, self.s_k)
        fn, consts, options = kernels["dkdv"]
        self.dkdv = L.Launcher(fn, consts, **options)
        self.kv_rows = c.block_n // 2 if c.warp_specialize else c.block_n
        self.delta = {n: L.Launcher(K._bwd_delta, dict(H_Q=self.h_q, HAS_DLSE=n, BLOCK=G.DELTA_ROWS, D_V=self.d,
                                                       D_V_PAD=spec["D_V_PAD"])) for n in (False, True)}
        self.triton = None
        if c.dq == "gluon":
            rows_plan = retile(128, c.dq_block_n)
            rc = rows_plan.tiles.classes
            r = G._lists(rc, False)
            host.update(r_order=rows_plan.q_tile_order(), r_ptr=r["ptr"], r_idx=r["idx"])
            self.dq_grid = (rc.shape[2] * self.batch * self.h_q,)
            self.dq_ints = (self.s_q, self.s_k, q_off, 0, *rc.shape[:2], rc.shape[2], self.batch * self.h_q)
            fn, consts, options = kernels["dq"]
            self.dq = L.Launcher(fn, consts, **options)
        elif c.dq == "triton":
            t = G.default_backward_config(self.d, self.d, False)
            self.triton = G.BackwardLaunch(module, replace(t, fused=False), retile(t.block_m1, t.block_n1),
                                           retile(t.block_m2, t.block_n2), shape, device)
        else:
            fn, consts, options = kernels["store"]
            self.store = L.Launcher(fn, consts, **options)
        self.arrays = P.upload(host, device)
        self.layouts, self.descs = {}, {}
        self.nbytes = P.nbytes_of(self.arrays) + (self.triton.nbytes if self.triton else 0)

    def _descriptor(self, t, rows: int, role: str | None = None, raw=None):
        """``t``'s TMA descriptor as [-1, d] in ``rows``-row boxes; with a ``role`` (q, k, v: inputs the
        caller keeps anyway), kept and reused while the tensor (address, shape, strides) is the same.
        ``raw``: the raw launch (``_raw``) the descriptor goes to, which takes it encoded
        (``raw_launch.Encoded``: kept in its place, holding no tensor; the launch skips its own lookup)."""
        if role is not None:
            seen = (t.data_ptr(), t.shape, t.stride(), t.dtype)
            hit = self.descs.get((role, rows, raw))
            if hit is not None and hit[0] == seen:
                return hit[1]
        key = (rows, str(t.dtype))
        layout = self.layouts.get(key)
        if layout is None:
            dt = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16}[str(t.dtype)]
            layout = self.layouts[key] = gl.NVMMASharedLayout.get_default_for([rows, self.d], dt)
        desc = TensorDescriptor.from_tensor(t.view(-1, self.d), [rows, self.d], layout)
        if raw is not None:  # (the TensorDescriptor kept before the launch went raw holds a tensor: dropped)
            desc = raw.encode(_INPUTS[role], desc)
            self.descs.pop((role, rows, None), None)
        if role is not None:
            if len(self.descs) >= RAW_DESCRIPTORS:
                self.descs.clear()
            self.descs[(role, rows, raw)] = (seen, desc)
        return desc

    @staticmethod
    def _raw(launcher, key):
        """The raw launch (``raw_launch``) ``launcher`` makes under ``key`` where it takes q, k, v and dO
        as its first four descriptor arguments and no tool hooks launches (``Launcher.launch`` goes raw
        then); else None (the launch takes TensorDescriptors)."""
        raw = launcher.raw.get(key) if key is not None else None
        if raw is None or tuple(raw.positions[:4]) != (0, 1, 2, 3):
            return None
        runtime = L._knobs().runtime
        if launches_hooked(runtime):
            return None
        return raw

    def _workspace_descriptor(self, dqa):
        """The fused dQ's float32 workspace [-1, d] as the writer adds into it: boxes of the dK/dV
        pass's query rows by d / ``dq_split`` columns (the layout made once)."""
        box = [self.config.block_m, self.d // self.config.split(self.d)]
        layout = self.layouts.get(("workspace", tuple(box)))
        if layout is None:
            layout = self.layouts[("workspace", tuple(box))] = gl.NVMMASharedLayout.get_default_for(box, gl.float32)
        return TensorDescriptor.from_tensor(dqa.view(-1, self.d), box, layout)

    def __call__(self, q, k, v, o, lse, do, dlse, ts: tuple, dq, dk, dv, key=None):
        """Launch on contiguous bhsd tensors; writes dq, dk, dv (``grad.BackwardLaunch.__call__``'s
        arguments)."""
        stream = L._stream() if key is not None else None  # (asked once for the three launches)
        delta = self.delta_pass(o, do, dlse, key, stream)
        work = self.dkdv_pass(q, k, v, lse, do, ts, dk, dv, delta, key, stream)
        self.dq_pass(q, k, v, lse, do, ts, dq, dk, dv, delta, work, key, stream)
        return delta  # (D - dLSE: a sink's gradient is read from it, as from grad.BackwardLaunch)

    def delta_pass(self, o, do, dlse, key, stream=None):
        """D = rowsum(dO * O) - dLSE, float32 [B, H_q, S_q]."""
        import torch
        DELTA_ROWS, triton_cdiv = G.DELTA_ROWS, G.triton_cdiv
        delta = o.new_empty((self.batch, self.h_q, self.s_q), dtype=torch.float32)
        has_dlse = dlse is not None
        self.delta[has_dlse].launch((triton_cdiv(self.s_q, DELTA_ROWS), self.batch * self.h_q),
                                    (o, do, dlse if has_dlse else delta, delta, *o.stride(), *do.stride(), self.s_q),
                                    key, stream)
        return delta

    def dkdv_pass(self, q, k, v, lse, do, ts, dk, dv, delta, key, stream=None):
        """dK and dV (and, dq atomic or fused, dQ's float32 sums); returns (the float32 dQ workspace the
        pass added into, the fused ordered mode's counters), with delta for what the mode lacks (an
        unused pointer)."""
        import torch
        dqa = sem = delta
        mode, a, bm = self.config.dq, self.arrays, self.config.block_m
        if mode == "atomic":
            dqa = torch.zeros((self.batch * self.h_q * self.s_q * self.d,), device=q.device, dtype=torch.float32)
        dqa_arg = dqa
        if mode in FUSED:  # [B * H_q * S_qp, d]: a tile's TMA box never reaches the next head's rows
            rows = self.batch * self.h_q * self.s_qa * self.d
            if mode == "fused":  # (the turn-0 tile stores: no zeroing; a tile nobody computes reads its count 0)
                dqa = torch.empty((rows,), device=q.device, dtype=torch.float32)
                sem = torch.zeros((self.batch * self.h_q * self.q_tiles,), device=q.device, dtype=torch.int32)
            else:
                dqa = torch.zeros((rows,), device=q.device, dtype=torch.float32)
            dqa_arg = self.dkdv.output_descriptor(key, dqa, self.d, lambda: self._workspace_descriptor(dqa))
        # (dO is new each call: where the launch goes raw, a per-call view of its rows, no descriptor made)
        raw = self._raw(self.dkdv, key)
        args = (self._descriptor(q, bm, "q", raw), self._descriptor(k, self.kv_rows, "k", raw),
                self._descriptor(v, self.kv_rows, "v", raw),
                self.dkdv.output_descriptor(key, do, self.d, lambda: self._descriptor(do, bm)), dk, dv, dqa_arg, lse,
                delta,
                a["order"], a["ptr"], a["ent"], sem, a["turn"], ts, *self.ints)
        self.dkdv.launch(self.grid, args, key, stream)
        return dqa, sem

    def dq_pass(self, q, k, v, lse, do, ts, dq, dk, dv, delta, work, key, stream=None):
        """dQ: its own pass (gluon, triton), or scaled and cast from ``dkdv_pass``'s workspace ``work``."""
        triton_cdiv = G.triton_cdiv
        mode, a = self.config.dq, self.arrays
        dqa, sem = work
        if mode == "gluon":
            bn = self.config.dq_block_n
            raw = self._raw(self.dq, key)
            args = (self._descriptor(q, 64, "q", raw), self._descriptor(k, bn, "k", raw),
                    self._descriptor(v, bn, "v", raw),
                    self.dq.output_descriptor(key, do, self.d, lambda: self._descriptor(do, 64)), dq, lse, delta,
                    a["r_order"], a["r_ptr"], a["r_idx"], ts, *self.dq_ints)
            self.dq.launch(self.dq_grid, args, key, stream)
        elif mode in ("atomic", *FUSED):
            s_qa = self.s_qa if mode in FUSED else self.s_q
            self.store.launch((triton_cdiv(self.s_q, self.store.constexprs["BLOCK"]), self.batch * self.h_q),
                              (dqa, dq, sem, *dq.stride(), self.s_q, s_qa), key, stream)
        else:
            t = self.triton
            ta = t.arrays
            args = (q, k, v, do, dq, dk, dv, lse, delta, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                    *dq.stride(), *dk.stride(), *dv.stride(), ta["c_order"], ta["c_ptr"], ta["c_idx"],
                    ta["r_order"], ta["r_ptr"], ta["r_idx"], ts, *t.ints)
            launcher, jobs = t.passes[-1]  # (the dQ pass: grad.BackwardLaunch with fused=False)
            launcher.launch((jobs,), args, key, stream)
