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
``_bwd_dkdv`` (five GEMMs, not bit-reproducible; slower at d 128 on the H200).  ``choose`` is the
one decision place (``refusal``: what the passes cannot run goes to the Triton backward).

Tiles past S_q or S_k: TMA reads the next head's rows there (zeros past the tensor's end); their
scores are masked, so P = 0 and nothing of them reaches this head's gradients (for finite inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import triton.language as tl

from .prefill import _job, _tile_of

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAS_GLUON = True
except (ImportError, AttributeError):  # a Triton without Gluon: the engine is unavailable
    HAS_GLUON = False
    TensorDescriptor = None

    class gluon:  # noqa: N801 - keeps the definitions below importable; ``refusal`` refuses the engine
        jit = staticmethod(lambda fn: fn)

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)  # q.k's and v's (equal)
GROUP_BITS = 7  # an entry: query block << 8 | head within the group << 1 | PARTIAL
MAX_GROUP = 1 << GROUP_BITS
MIN_ROWS = 128  # (B * H * S rows of Q and of K/V: no TMA box is taller than its tensor)


DQ_MODES = ("gluon", "triton", "atomic")


@dataclass(frozen=True)
class GluonBackwardConfig:
    """The Gluon backward's launch: the dK/dV pass's tiles (``block_m`` query rows per entry,
    ``block_n`` keys per program), Q/dO stages and kernel (``warp_specialize``: a TMA warp and two
    consumer warpgroups, ``_bwd_dkdv_ws``; else ``_bwd_dkdv``, 8 warps issuing their own loads), and
    how dQ is made (``dq``): "gluon", its own warp-specialized pass (``_bwd_dq_ws``, 128-row tiles over
    ``dq_block_n``-key blocks, ``dq_stages`` K/V stages); "triton", the Triton backward's dQ pass;
    "atomic", float32 atomics inside the (plain) dK/dV pass -- five GEMMs per block instead of
    seven, not bit-reproducible."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    warp_specialize: bool = True
    dq: str = "gluon"
    dq_block_n: int = 64
    dq_stages: int = 2

    def __post_init__(self):
        if self.dq not in DQ_MODES:
            raise ValueError(f"GluonBackwardConfig.dq must be one of {', '.join(DQ_MODES)}, not {self.dq!r}")
        if self.dq == "atomic" and self.warp_specialize:
            raise ValueError("GluonBackwardConfig: dq='atomic' runs in the plain dK/dV kernel (warp_specialize=False)")
        if self.warp_specialize and self.block_n != 128:
            raise ValueError("GluonBackwardConfig: the warp-specialized dK/dV kernel takes 128-key tiles (two halves "
                             f"of 64), not {self.block_n}")

    def describe(self) -> str:
        kind = "warp-specialized" if self.warp_specialize else "plain"
        return (f"gluon dK/dV {kind} {self.block_m} x {self.block_n}, {self.stages} stages; dQ {self.dq}"
                + (f" 128 x {self.dq_block_n}, {self.dq_stages} stages" if self.dq == "gluon" else ""))


def default_config(d: int) -> GluonBackwardConfig:
    """The untuned launch: 64 query rows per dK/dV entry (registers: a consumer holds dK, dV, S^T and
    dP^T of its 64 keys), dQ on 128 x 64 tiles at d 128, 128 x 128 at d 64."""
    return GluonBackwardConfig(dq_block_n=64 if d > 64 else 128)


def smem_bytes(d: int, config: GluonBackwardConfig) -> int:
    """Shared memory of the larger of the two passes' programs (2-byte elements, plus barriers): the
    dK/dV pass's K and V tiles and STAGES Q and dO tiles (and dS^T, atomic dQ); the dQ pass's Q and
    dO tiles and its K/V stages."""
    c = config
    dkdv = 2 * c.block_n * d + 2 * c.stages * c.block_m * d + (c.block_m * c.block_n if c.dq == "atomic" else 0)
    dq = 2 * 128 * d + 2 * c.dq_stages * c.dq_block_n * d if c.dq == "gluon" else 0
    return 2 * max(dkdv, dq) + 128


def refusal(program, batch: int, s_q: int, s_k: int, bhsd_contiguous: bool, capability: int, interpreted: bool,
            config: GluonBackwardConfig) -> str | None:
    """Why the Gluon dK/dV pass cannot run this call (a sentence), or None: the one decision place
    (everything it refuses runs the Triton backward)."""
    from .gluon_engine import SMEM
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
def group_lists(classes: np.ndarray, group: int) -> dict:
    """The dK/dV pass's walk from the plan's tile classes [PLAN_B, PLAN_H, q_tiles, k_tiles]
    (0 SKIP, 1 PARTIAL, 2 FULL): for each (request plane, K/V head plane, key tile) -- K/V head
    planes: PLAN_H // group where the plan depends on the head, else 1 --, the computed query
    blocks of every query head of the group in turn, ascending, as ``ptr`` / ``ent`` (CSR; an
    entry is query block << 8 | head in group << 1 | PARTIAL); ``order``: each plane's key tiles
    by descending entries (the jobs' order); ``kv_planes``."""
    pb, ph, qt, kt = classes.shape
    if ph > 1:
        kv_planes = ph // group
        c = classes.reshape(pb, kv_planes, group, qt, kt)
    else:
        kv_planes = 1
        c = np.broadcast_to(classes.reshape(pb, 1, 1, qt, kt), (pb, 1, group, qt, kt))
    c = c.transpose(0, 1, 4, 2, 3).reshape(-1, group * qt)  # [lists, (g, query block)]
    lists, flat = np.nonzero(c)  # row-major: by list, then head in group, then query block
    g, qb = np.divmod(flat, qt)
    ent = (qb.astype(np.int64) << 8) | (g.astype(np.int64) << 1) | (c[lists, flat] == 1)
    counts = np.bincount(lists, minlength=len(c))
    ptr = np.zeros(len(c) + 1, np.int32)
    np.cumsum(counts, out=ptr[1:])
    order = np.argsort(-counts.reshape(-1, kt), axis=1, kind="stable").reshape(-1).astype(np.int32)
    return {"ptr": ptr, "ent": ent.astype(np.int32), "order": order, "kv_planes": kv_planes}


# ---------------------------------------------------------------- the kernel
@gluon.jit
def _load_entry(q_desc, do_desc, q_smem, do_smem, ready, G_ENT, i, c, b, kv_h, S_Q, STAGES: tl.constexpr,
                H_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Entry i's Q and dO tiles into stage c % STAGES (TMA, completing on its ``ready`` barrier)."""
    e = gl.load(G_ENT + i)
    h = kv_h * GROUP + ((e >> 1) & 127)
    row = (b * H_Q + h) * S_Q + (e >> 8) * BLOCK_M
    stage = c % STAGES
    mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    _tma_load(q_desc, [row, 0], ready.index(stage), q_smem.index(stage))
    _tma_load(do_desc, [row, 0], ready.index(stage), do_smem.index(stage))


@gluon.jit
def _probs_t(s_raw, part, b, h, q_pos, k_pos, lse2, TS, K_END, Q_END, EVEN: tl.constexpr, VISIBLE: tl.constexpr,
             SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr):
    """P^T from the saved LSE (base 2) and d score / d (scale q.k) on a transposed tile of raw q.k
    (keys are rows): PARTIAL (part != 0) hides cells by the predicate and, unless EVEN, the bounds."""
    if HAS_SCORE:
        s, g = SCORE_GRAD(s_raw * SCALE, b, h, q_pos, k_pos, TS)
        s = s * 1.4426950408889634
    else:
        s = s_raw * (SCALE * 1.4426950408889634)
        g = 1.0
    if part != 0:
        if EVEN:
            s = gl.where(VISIBLE(b, h, q_pos, k_pos, TS), s, float("-inf"))
        else:
            s = gl.where(VISIBLE(b, h, q_pos, k_pos, TS) & (k_pos < K_END) & (q_pos < Q_END), s, float("-inf"))
    return gl.exp2(s - lse2[None, :]), g


@gluon.jit
def _bwd_dkdv(q_desc, k_desc, v_desc, do_desc, DK, DV, DQA, LSE, DELTA, ORDER, G_PTR, G_ENT, TS,
              S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
              VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
              H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_WARPS: tl.constexpr):
    """dK and dV of one K/V tile of one (request, K/V head), summed over its query group (module
    docstring).  DK, DV: contiguous [B, H_kv, S_k, D]; LSE, DELTA: [B, H_q, S_q] float32; DQA
    (ATOMIC_DQ): float32 [B * H_q * S_q, D], zero before the launch, unscaled."""
    rank, bkv = _job(gl.program_id(0), BKV, K_TILES, HEAD_GROUP)
    b = bkv // H_KV
    kv_h = bkv % H_KV
    col0 = (gl.where(PLAN_B > 1, b, 0) * KV_PLANES + gl.where(PLAN_H > 1, kv_h, 0)) * K_TILES
    pid_n = gl.load(ORDER + col0 + rank)
    lo = gl.load(G_PTR + col0 + pid_n)
    hi = gl.load(G_PTR + col0 + pid_n + 1)

    dtype: tl.constexpr = q_desc.dtype
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: tl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)  # along keys
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)  # along query rows

    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()

    kv_row = bkv * S_K + pid_n * BLOCK_N
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [kv_row, 0], kv_bar, k_smem)
    _tma_load(v_desc, [kv_row, 0], kv_bar, v_smem)
    for j in gl.static_range(STAGES):
        if lo + j < hi:
            _load_entry(q_desc, do_desc, q_smem, do_smem, ready, G_ENT, lo + j, j, b, kv_h, S_Q, STAGES, H_Q,
                        GROUP, BLOCK_M)

    if ATOMIC_DQ:
        ds_layout: tl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        if BLOCK_M >= 128:
            dq_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                                instr_shape=[16, D, 16])
        else:
            dq_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                                instr_shape=[16, D // (NUM_WARPS // 4), 16])
        dq0 = gl.zeros([BLOCK_M, D], gl.float32, dq_layout)
        dq_rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, dq_layout))
        dq_cols = gl.arange(0, D, gl.SliceLayout(0, dq_layout))

    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, row_l)
    k_pos = (K_OFF + offs_n)[:, None]
    K_END = K_OFF + S_K
    Q_END = Q_OFF + S_Q
    s0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    n_edge = pid_n * BLOCK_N + BLOCK_N > S_K
    mbarrier.wait(kv_bar, 0)
    for i in range(lo, hi):
        c = i - lo
        stage = c % STAGES
        e = gl.load(G_ENT + i)
        qb = e >> 8
        h = kv_h * GROUP + ((e >> 1) & 127)
        part = e & 1
        bh = b * H_Q + h
        offs_m = qb * BLOCK_M + gl.arange(0, BLOCK_M, col_l)
        if EVEN_M:
            lse = gl.load(LSE + bh * S_Q + offs_m)
            delta = gl.load(DELTA + bh * S_Q + offs_m)
        else:
            lse = gl.load(LSE + bh * S_Q + offs_m, mask=offs_m < S_Q, other=float("inf"))
            delta = gl.load(DELTA + bh * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
        if not (EVEN_M and EVEN_N):
            part = gl.where(n_edge | (qb * BLOCK_M + BLOCK_M > S_Q), 1, part)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        q_pos = (Q_OFF + offs_m)[None, :]
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        q_t = q_smem.index(stage)
        do_t = do_smem.index(stage)
        st = warpgroup_mma(k_smem, q_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        pt, gt = _probs_t(st, part, b, h, q_pos, k_pos, lse2, TS, K_END, Q_END, EVEN_M and EVEN_N, VISIBLE,
                          SCORE_GRAD, HAS_SCORE, SCALE)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))
        dst = pt * (dpt - delta[None, :])
        if HAS_SCORE:
            dst = gl.where(pt > 0.0, dst * gt, 0.0)
        ds_op = dst.to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_op, op_layout), q_t, dk, is_async=True)
        if ATOMIC_DQ:  # this entry's dQ = dS K, from dS^T in shared memory (both warpgroups' keys)
            ds_smem.store(ds_op)
            fence_async_shared()
            gl.thread_barrier()
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq0, use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            rows = qb * BLOCK_M + dq_rows
            ptrs = DQA + (bh * S_Q + rows)[:, None] * D + dq_cols[None, :]
            if EVEN_M:
                gl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                gl.atomic_add(ptrs, dq, mask=(rows < S_Q)[:, None], sem="relaxed")
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        gl.thread_barrier()  # both warpgroups are done with this stage (and with dS^T): it may be refilled
        if i + STAGES < hi:
            _load_entry(q_desc, do_desc, q_smem, do_smem, ready, G_ENT, i + STAGES, c + STAGES, b, kv_h, S_Q,
                        STAGES, H_Q, GROUP, BLOCK_M)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    mbarrier.invalidate(kv_bar)
    out_rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
    keys = pid_n * BLOCK_N + out_rows
    offs = (bkv * S_K + keys)[:, None] * D + out_cols[None, :]
    if EVEN_N:
        gl.store(DK + offs, (dk * SCALE).to(DK.dtype.element_ty))
        gl.store(DV + offs, dv.to(DV.dtype.element_ty))
    else:
        gl.store(DK + offs, (dk * SCALE).to(DK.dtype.element_ty), mask=(keys < S_K)[:, None])
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=(keys < S_K)[:, None])



# ---------------------------------------------------------------- the warp-specialized kernel
@gluon.jit
def _dkdv_job(ORDER, G_PTR, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, HEAD_GROUP: tl.constexpr, H_KV: tl.constexpr):
    """This program's job: (key tile, b, K/V head, b * H_kv + K/V head, its entries [lo, hi))."""
    rank, bkv = _job(gl.program_id(0), BKV, K_TILES, HEAD_GROUP)
    b = bkv // H_KV
    kv_h = bkv % H_KV
    col0 = (gl.where(PLAN_B > 1, b, 0) * KV_PLANES + gl.where(PLAN_H > 1, kv_h, 0)) * K_TILES
    pid_n = gl.load(ORDER + col0 + rank)
    return pid_n, b, kv_h, bkv, gl.load(G_PTR + col0 + pid_n), gl.load(G_PTR + col0 + pid_n + 1)


@gluon.jit
def _ws_dkdv_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, bars, ORDER, G_PTR, G_ENT,
                      S_Q, S_K, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, H_Q: tl.constexpr,
                      H_KV: tl.constexpr, GROUP: tl.constexpr):
    """The TMA warp: the K/V tile's two halves once, then each entry's Q and dO into a stage both
    consumers have released."""
    kv_bar, ready, empty = bars
    pid_n, b, kv_h, bkv, lo, hi = _dkdv_job(ORDER, G_PTR, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, HEAD_GROUP, H_KV)
    HALF: tl.constexpr = BLOCK_N // 2
    kv_row = bkv * S_K + pid_n * BLOCK_N
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(k_desc, [kv_row + w * HALF, 0], kv_bar, k_smem.index(w))
        _tma_load(v_desc, [kv_row + w * HALF, 0], kv_bar, v_smem.index(w))
    for i in range(lo, hi):
        c = i - lo
        mbarrier.wait(empty.index(c % STAGES), ((c // STAGES) & 1) ^ 1)
        _load_entry(q_desc, do_desc, q_smem, do_smem, ready, G_ENT, i, c, b, kv_h, S_Q, STAGES, H_Q, GROUP, BLOCK_M)


@gluon.jit
def _ws_dkdv_consumer(half, q_smem, do_smem, k_smem, v_smem, bars, DK, DV, LSE, DELTA, ORDER, G_PTR, G_ENT, TS,
                      S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, EVEN_M: tl.constexpr,
                      EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, VISIBLE: tl.constexpr,
                      SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
                      H_KV: tl.constexpr, GROUP: tl.constexpr):
    """One warpgroup's half of the K/V tile (keys [half * BLOCK_N / 2, + BLOCK_N / 2)): every entry's
    S^T, dP^T, dV and dK (``_bwd_dkdv``'s step on 64 keys), the stage released once its MMAs are
    done; then its rows of dK and dV."""
    kv_bar, ready, empty = bars
    pid_n, b, kv_h, bkv, lo, hi = _dkdv_job(ORDER, G_PTR, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, HEAD_GROUP, H_KV)
    HALF: tl.constexpr = BLOCK_N // 2
    dtype: tl.constexpr = k_smem.dtype
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: tl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)
    k_t = k_smem.index(half)
    v_t = v_smem.index(half)
    offs_n = pid_n * BLOCK_N + half * HALF + gl.arange(0, HALF, row_l)
    k_pos = (K_OFF + offs_n)[:, None]
    K_END = K_OFF + S_K
    Q_END = Q_OFF + S_Q
    dk = gl.zeros([HALF, D], gl.float32, acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, acc_layout)
    n_edge = pid_n * BLOCK_N + BLOCK_N > S_K
    mbarrier.wait(kv_bar, 0)
    for i in range(lo, hi):
        c = i - lo
        stage = c % STAGES
        e = gl.load(G_ENT + i)
        qb = e >> 8
        h = kv_h * GROUP + ((e >> 1) & 127)
        part = e & 1
        bh = b * H_Q + h
        offs_m = qb * BLOCK_M + gl.arange(0, BLOCK_M, col_l)
        if EVEN_M:
            lse = gl.load(LSE + bh * S_Q + offs_m)
            delta = gl.load(DELTA + bh * S_Q + offs_m)
        else:
            lse = gl.load(LSE + bh * S_Q + offs_m, mask=offs_m < S_Q, other=float("inf"))
            delta = gl.load(DELTA + bh * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
        if not (EVEN_M and EVEN_N):
            part = gl.where(n_edge | (qb * BLOCK_M + BLOCK_M > S_Q), 1, part)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        q_pos = (Q_OFF + offs_m)[None, :]
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        q_t = q_smem.index(stage)
        do_t = do_smem.index(stage)
        s0 = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)  # (made here: not a live tile across the loop)
        st = warpgroup_mma(k_t, q_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        pt, gt = _probs_t(st, part, b, h, q_pos, k_pos, lse2, TS, K_END, Q_END, EVEN_M and EVEN_N, VISIBLE,
                          SCORE_GRAD, HAS_SCORE, SCALE)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))
        dst = pt * (dpt - delta[None, :])
        if HAS_SCORE:
            dst = gl.where(pt > 0.0, dst * gt, 0.0)
        dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_t, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(stage), count=1)
    out_rows = gl.arange(0, HALF, gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
    keys = pid_n * BLOCK_N + half * HALF + out_rows
    offs = (bkv * S_K + keys)[:, None] * D + out_cols[None, :]
    if EVEN_N:
        gl.store(DK + offs, (dk * SCALE).to(DK.dtype.element_ty))
        gl.store(DV + offs, dv.to(DV.dtype.element_ty))
    else:
        gl.store(DK + offs, (dk * SCALE).to(DK.dtype.element_ty), mask=(keys < S_K)[:, None])
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=(keys < S_K)[:, None])


@gluon.jit
def _bwd_dkdv_ws(q_desc, k_desc, v_desc, do_desc, DK, DV, DQA, LSE, DELTA, ORDER, G_PTR, G_ENT, TS,
                 S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_WARPS: tl.constexpr,
                 CONSUMER_REGS: tl.constexpr = 240, PRODUCER_REGS: tl.constexpr = 24):
    """``_bwd_dkdv``'s job, warp-specialized: a TMA producer warp and two consumer warpgroups, each
    with half of the K/V tile's keys (its own dK and dV rows), released stage by stage through
    mbarriers, so that one warpgroup's softmax-side arithmetic runs under the other's MMAs.  Same
    arguments (k_desc / v_desc in BLOCK_N / 2-row boxes; DQA and ATOMIC_DQ unused: dQ by its own
    pass)."""
    HALF: tl.constexpr = BLOCK_N // 2
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release a stage
    fence_async_shared()
    bars = (kv_bar, ready, empty)
    gl.warp_specialize([
        (_ws_dkdv_consumer, (0, q_smem, do_smem, k_smem, v_smem, bars, DK, DV, LSE, DELTA, ORDER, G_PTR, G_ENT, TS,
                             S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, EVEN_M, EVEN_N, BLOCK_M,
                             BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, H_Q, H_KV, GROUP)),
        (_ws_dkdv_consumer, (1, q_smem, do_smem, k_smem, v_smem, bars, DK, DV, LSE, DELTA, ORDER, G_PTR, G_ENT, TS,
                             S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, EVEN_M, EVEN_N, BLOCK_M,
                             BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, H_Q, H_KV, GROUP)),
        (_ws_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, bars, ORDER, G_PTR,
                             G_ENT, S_Q, S_K, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, BLOCK_M, BLOCK_N, STAGES,
                             HEAD_GROUP, H_Q, H_KV, GROUP)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])



# ---------------------------------------------------------------- the dQ pass
@gluon.jit
def _dq_job(ORDER, R_PTR, PLAN_B, PLAN_H, Q_TILES, BH, HEAD_GROUP: tl.constexpr, H_Q: tl.constexpr):
    """This program's job: (query tile, b, h, b * H_q + h, its blocks [lo, hi), PARTIAL from mid)."""
    rank, bh = _job(gl.program_id(0), BH, Q_TILES, HEAD_GROUP)
    pid_m, b, h, row = _tile_of(rank, bh, ORDER, PLAN_B, PLAN_H, Q_TILES, H_Q)
    return pid_m, b, h, bh, gl.load(R_PTR + 2 * row), gl.load(R_PTR + 2 * row + 1), gl.load(R_PTR + 2 * row + 2)


@gluon.jit
def _ws_dq_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, bars, ORDER, R_PTR, R_IDX,
                    S_Q, S_K, PLAN_B, PLAN_H, Q_TILES, BH, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr,
                    GROUP: tl.constexpr):
    """The TMA warp of the dQ pass: the tile's Q and dO (two ROWS-row halves) once, then K and V of
    every computed block of its row, each into a stage both consumers have released."""
    q_bar, ready, empty = bars
    pid_m, b, h, bh, lo, mid, hi = _dq_job(ORDER, R_PTR, PLAN_B, PLAN_H, Q_TILES, BH, HEAD_GROUP, H_Q)
    q_row = bh * S_Q + pid_m * (2 * ROWS)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(q_desc, [q_row + w * ROWS, 0], q_bar, q_smem.index(w))
        _tma_load(do_desc, [q_row + w * ROWS, 0], q_bar, do_smem.index(w))
    kv_row0 = (b * H_KV + h // GROUP) * S_K
    for i in range(lo, hi):
        c = i - lo
        stage = c % STAGES
        kb = gl.load(R_IDX + i)
        mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + kb * BLOCK_N, 0], ready.index(stage), k_smem.index(stage))
        _tma_load(v_desc, [kv_row0 + kb * BLOCK_N, 0], ready.index(stage), v_smem.index(stage))


@gluon.jit
def _ws_dq_consumer(half, q_smem, do_smem, k_smem, v_smem, bars, DQ, LSE, DELTA, ORDER, R_PTR, R_IDX, TS,
                    S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, EVEN_M: tl.constexpr,
                    EVEN_N: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, VISIBLE: tl.constexpr,
                    SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr):
    """One warpgroup's ROWS query rows of the tile: per K/V block, S = Q K^T and dP = dO V^T,
    P from the saved LSE, dS = P (dP - D), dQ += dS K; then its rows of dQ (times SCALE)."""
    q_bar, ready, empty = bars
    pid_m, b, h, bh, lo, mid, hi = _dq_job(ORDER, R_PTR, PLAN_B, PLAN_H, Q_TILES, BH, HEAD_GROUP, H_Q)
    dtype: tl.constexpr = k_smem.dtype
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: tl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)
    q_t = q_smem.index(half)
    do_t = do_smem.index(half)
    offs_m = pid_m * (2 * ROWS) + half * ROWS + gl.arange(0, ROWS, row_l)
    if EVEN_M:
        lse = gl.load(LSE + bh * S_Q + offs_m)
        delta = gl.load(DELTA + bh * S_Q + offs_m)
    else:
        lse = gl.load(LSE + bh * S_Q + offs_m, mask=offs_m < S_Q, other=float("inf"))
        delta = gl.load(DELTA + bh * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    q_pos = (Q_OFF + offs_m)[:, None]
    K_END = K_OFF + S_K
    Q_END = Q_OFF + S_Q
    m_edge = pid_m * (2 * ROWS) + 2 * ROWS > S_Q
    dq = gl.zeros([ROWS, D], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)
    for i in range(lo, hi):
        c = i - lo
        stage = c % STAGES
        kb = gl.load(R_IDX + i)
        part = gl.where(i >= mid, 1, 0)
        if not (EVEN_M and EVEN_N):
            part = gl.where(m_edge | (kb * BLOCK_N + BLOCK_N > S_K), 1, part)
        k_pos = (K_OFF + kb * BLOCK_N + gl.arange(0, BLOCK_N, col_l))[None, :]
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        k_t = k_smem.index(stage)
        v_t = v_smem.index(stage)
        s0 = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_t, k_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        if HAS_SCORE:
            sc, g = SCORE_GRAD(s * SCALE, b, h, q_pos, k_pos, TS)
            sc = sc * 1.4426950408889634
        else:
            sc = s * (SCALE * 1.4426950408889634)
            g = 1.0
        if part != 0:
            if EVEN_M and EVEN_N:
                sc = gl.where(VISIBLE(b, h, q_pos, k_pos, TS), sc, float("-inf"))
            else:
                sc = gl.where(VISIBLE(b, h, q_pos, k_pos, TS) & (k_pos < K_END) & (q_pos < Q_END), sc,
                              float("-inf"))
        p = gl.exp2(sc - lse2[:, None])
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = p * (dp - delta[:, None])
        if HAS_SCORE:
            ds = gl.where(p > 0.0, ds * g, 0.0)
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_t, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(empty.index(stage), count=1)
    rows = pid_m * (2 * ROWS) + half * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
    offs = (bh * S_Q + rows)[:, None] * D + cols[None, :]
    if EVEN_M:
        gl.store(DQ + offs, (dq * SCALE).to(DQ.dtype.element_ty))
    else:
        gl.store(DQ + offs, (dq * SCALE).to(DQ.dtype.element_ty), mask=(rows < S_Q)[:, None])


@gluon.jit
def _bwd_dq_ws(q_desc, k_desc, v_desc, do_desc, DQ, LSE, DELTA, ORDER, R_PTR, R_IDX, TS,
               S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH,
               EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, VISIBLE: tl.constexpr,
               SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
               H_KV: tl.constexpr, GROUP: tl.constexpr, CONSUMER_REGS: tl.constexpr = 240,
               PRODUCER_REGS: tl.constexpr = 24):
    """dQ of one query tile (2 * ROWS rows) of one (request, query head), warp-specialized as the
    forward engine: a TMA warp streams the K/V blocks of the tile's row of the plan (the Triton
    backward's row lists: FULL blocks, then PARTIAL ones from ``mid``) through STAGES stages, two
    consumer warpgroups of ROWS rows each accumulate dQ in registers.  DQ: contiguous
    [B, H_q, S_q, D]; q_desc / do_desc in ROWS-row boxes, k_desc / v_desc in BLOCK_N-row boxes."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    bars = (q_bar, ready, empty)
    gl.warp_specialize([
        (_ws_dq_consumer, (0, q_smem, do_smem, k_smem, v_smem, bars, DQ, LSE, DELTA, ORDER, R_PTR, R_IDX, TS, S_Q, S_K,
                           Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, EVEN_M, EVEN_N, ROWS, BLOCK_N, D, STAGES,
                           HEAD_GROUP, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, H_Q)),
        (_ws_dq_consumer, (1, q_smem, do_smem, k_smem, v_smem, bars, DQ, LSE, DELTA, ORDER, R_PTR, R_IDX, TS, S_Q, S_K,
                           Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, EVEN_M, EVEN_N, ROWS, BLOCK_N, D, STAGES,
                           HEAD_GROUP, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, H_Q)),
        (_ws_dq_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, bars, ORDER, R_PTR, R_IDX,
                           S_Q, S_K, PLAN_B, PLAN_H, Q_TILES, BH, ROWS, BLOCK_N, STAGES, HEAD_GROUP, H_Q, H_KV,
                           GROUP)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------- host side: the launch
# Whether the backward takes the Gluon passes by default where ``refusal`` allows it (else only when
# a caller passes a GluonBackwardConfig).  Measured on the H200 (study r2, bench/results/README.md),
# kernel alone, B4 S8K bf16, against the Triton backward: causal d128 H16 428.5 / 357 TFLOP/s, full
# d128 457.5 / 375, causal d64 H32 324.9 / 115; every gradient within the Triton backward's error.
DEFAULT = True
REGS = (168, 240, 24)  # the warp-specialized kernels' maxnreg, consumer and producer registers


def choose(program, config, s_q: int, s_k: int, tensors: tuple, bshd: bool, interpreted: bool):
    """The backward's engine for a call: a GluonBackwardConfig (the Gluon passes), or None (the
    Triton backward).  ``config``: the caller's -- a GluonBackwardConfig asks for the Gluon passes
    (a ValueError says why they cannot run), a ``grad.BackwardConfig`` for the Triton ones; None:
    the default (``DEFAULT``, where ``refusal`` allows).  ``tensors``: q, k, v and O (dO, which
    autograd may hand over expanded or strided, is copied where TMA cannot read it: ``tma_input``)."""
    from . import launch as L
    asked = isinstance(config, GluonBackwardConfig)
    if config is not None and not asked:
        return None
    if not asked and not DEFAULT:
        return None
    cfg = config if asked else default_config(program.d_qk)
    t = tensors[0]
    capability = L.capability(t.device) if t.is_cuda else 0
    batch = t.shape[0]
    why = refusal(program, batch, s_q, s_k, not bshd and L.tma_ready(*tensors), capability, interpreted, cfg)
    if why is not None:
        if asked:
            raise ValueError(f"GluonBackwardConfig: {why}")
        return None
    return cfg


def kernel_constexprs(module, config: GluonBackwardConfig, s_q: int, s_k: int) -> dict:
    """The Gluon passes' kernels for a call: {"dkdv": (kernel, constexprs, launch options), and where
    config.dq is "gluon", "dq": likewise} (the launch's and the compile test's one source)."""
    from . import launch as L
    c, spec = config, module.SPEC
    score = dict(VISIBLE=module.visible, SCORE_GRAD=L.score_functions(module, L.position_end(s_q, s_k, None))[1],
                 HAS_SCORE=spec["HAS_SCORE"], SCALE=spec["SCALE"], H_Q=spec["H_Q"], H_KV=spec["H_KV"],
                 GROUP=spec["GROUP"])
    maxnreg, consumer, producer = REGS
    ws = dict(CONSUMER_REGS=consumer, PRODUCER_REGS=producer)
    out = {"dkdv": (_bwd_dkdv_ws if c.warp_specialize else _bwd_dkdv, dict(
        EVEN_M=s_q % c.block_m == 0, EVEN_N=s_k % c.block_n == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        D=spec["D_QK"], STAGES=c.stages, HEAD_GROUP=L.HEAD_GROUP, ATOMIC_DQ=c.dq == "atomic",
        NUM_WARPS=4 if c.warp_specialize else 8, **score, **(ws if c.warp_specialize else {})),
        dict(num_warps=4, maxnreg=maxnreg) if c.warp_specialize else dict(num_warps=8))}
    if c.dq == "gluon":
        out["dq"] = (_bwd_dq_ws, dict(EVEN_M=s_q % 128 == 0, EVEN_N=s_k % c.dq_block_n == 0, ROWS=64,
                                      BLOCK_N=c.dq_block_n, D=spec["D_QK"], STAGES=c.dq_stages,
                                      HEAD_GROUP=L.HEAD_GROUP, **ws, **score), dict(num_warps=4, maxnreg=maxnreg))
    return out


def tma_input(t):
    """``t`` as the Gluon passes read it: itself where TMA can (contiguous, 16-byte aligned), else a
    contiguous copy (autograd's dO of ``o.sum()`` is an expanded view, for example)."""
    import torch
    from . import launch as L
    return t if L.tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


class GluonBackwardLaunch:
    """The backward of one call shape on the Gluon passes: D by the Triton backward's ``_bwd_delta``,
    dK and dV by ``_bwd_dkdv_ws`` (or ``_bwd_dkdv``), dQ by ``_bwd_dq_ws`` (or the Triton backward's dQ
    pass, or atomics and ``_bwd_dq_store``).  ``retile(bm, bn)``: the call's plan on other tiles
    (``Plan.retile``: the mask analysis is reused)."""

    def __init__(self, module, config: GluonBackwardConfig, retile, shape: tuple, device):
        from . import backward as K, grad as G, launch as L, plans as P
        self.module, self.config = module, config
        self.batch, self.s_q, self.s_k = shape
        spec = module.SPEC
        self.h_q, self.h_kv, self.d = spec["H_Q"], spec["H_KV"], spec["D_QK"]
        c = config
        classes = retile(c.block_m, c.block_n).tiles.classes
        lists = group_lists(classes, spec["GROUP"])
        host = {"order": lists["order"], "ptr": lists["ptr"], "ent": lists["ent"]}
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
            self.triton = G.BackwardLaunch(module, L.replace(t, fused=False), retile(t.block_m1, t.block_n1),
                                           retile(t.block_m2, t.block_n2), shape, device)
        else:
            self.store = L.Launcher(K._bwd_dq_store, dict(H_Q=self.h_q, BLOCK=G.DELTA_ROWS, D_QK=self.d,
                                                          D_QK_PAD=spec["D_QK_PAD"], SCALE=spec["SCALE"]))
        self.arrays = P.upload(host, device)
        self.layouts, self.descs = {}, {}
        self.nbytes = P.nbytes_of(self.arrays) + (self.triton.nbytes if self.triton else 0)

    def _descriptor(self, t, rows: int, role: str | None = None):
        """``t``'s TMA descriptor as [-1, d] in ``rows``-row boxes; with a ``role`` (q, k, v: inputs the
        caller keeps anyway), kept and reused while the tensor (address, shape, strides) is the same."""
        key = (rows, str(t.dtype))
        layout = self.layouts.get(key)
        if layout is None:
            dt = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16}[str(t.dtype)]
            layout = self.layouts[key] = gl.NVMMASharedLayout.get_default_for([rows, self.d], dt)
        if role is None:
            return TensorDescriptor.from_tensor(t.view(-1, self.d), [rows, self.d], layout)
        seen = (t.data_ptr(), t.shape, t.stride())
        hit = self.descs.get((role, rows))
        if hit is None or hit[0] != seen:
            hit = self.descs[(role, rows)] = (seen, TensorDescriptor.from_tensor(t.view(-1, self.d), [rows, self.d],
                                                                                  layout))
        return hit[1]

    def __call__(self, q, k, v, o, lse, do, dlse, ts: tuple, dq, dk, dv, key=None):
        """Launch on contiguous bhsd tensors; writes dq, dk, dv (``grad.BackwardLaunch.__call__``'s
        arguments)."""
        delta = self.delta_pass(o, do, dlse, key)
        dqa = self.dkdv_pass(q, k, v, lse, do, ts, dk, dv, delta, key)
        self.dq_pass(q, k, v, lse, do, ts, dq, dk, dv, delta, dqa, key)

    def delta_pass(self, o, do, dlse, key):
        """D = rowsum(dO * O) - dLSE, float32 [B, H_q, S_q]."""
        import torch
        from .grad import DELTA_ROWS, triton_cdiv
        delta = torch.empty((self.batch, self.h_q, self.s_q), device=o.device, dtype=torch.float32)
        has_dlse = dlse is not None
        self.delta[has_dlse].launch((triton_cdiv(self.s_q, DELTA_ROWS), self.batch * self.h_q),
                                    (o, do, dlse if has_dlse else delta, delta, *o.stride(), *do.stride(), self.s_q),
                                    key)
        return delta

    def dkdv_pass(self, q, k, v, lse, do, ts, dk, dv, delta, key):
        """dK and dV; returns the float32 dQ accumulator the pass added into (dq 'atomic'), else delta
        (an unused pointer)."""
        import torch
        dqa = delta
        if self.config.dq == "atomic":
            dqa = torch.zeros((self.batch * self.h_q * self.s_q * self.d,), device=q.device, dtype=torch.float32)
        a, bm = self.arrays, self.config.block_m
        args = (self._descriptor(q, bm, "q"), self._descriptor(k, self.kv_rows, "k"),
                self._descriptor(v, self.kv_rows, "v"), self._descriptor(do, bm), dk, dv, dqa, lse, delta, a["order"],
                a["ptr"], a["ent"], ts, *self.ints)
        self.dkdv.launch(self.grid, args, key)
        return dqa

    def dq_pass(self, q, k, v, lse, do, ts, dq, dk, dv, delta, dqa, key):
        from .grad import DELTA_ROWS, triton_cdiv
        mode, a = self.config.dq, self.arrays
        if mode == "gluon":
            bn = self.config.dq_block_n
            args = (self._descriptor(q, 64, "q"), self._descriptor(k, bn, "k"), self._descriptor(v, bn, "v"),
                    self._descriptor(do, 64), dq, lse, delta, a["r_order"], a["r_ptr"], a["r_idx"], ts, *self.dq_ints)
            self.dq.launch(self.dq_grid, args, key)
        elif mode == "atomic":
            self.store.launch((triton_cdiv(self.s_q, DELTA_ROWS), self.batch * self.h_q),
                              (dqa, dq, *dq.stride(), self.s_q), key)
        else:
            t = self.triton
            ta = t.arrays
            args = (q, k, v, do, dq, dk, dv, lse, delta, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                    *dq.stride(), *dk.stride(), *dv.stride(), ta["c_order"], ta["c_ptr"], ta["c_idx"],
                    ta["r_order"], ta["r_ptr"], ta["r_idx"], ts, *t.ints)
            launcher, jobs = t.passes[-1]  # (the dQ pass: grad.BackwardLaunch with fused=False)
            launcher.launch((jobs,), args, key)
