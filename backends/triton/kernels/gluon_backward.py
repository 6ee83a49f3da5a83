"""The Gluon kernels of the Hopper backward (``gluon_backward`` holds their configuration, decision
and launch; its docstring describes the passes)."""
from __future__ import annotations

import triton.language as tl

from .prefill import _job, _tile_of  # noqa: F401  (the jobs' order, shared with the forward)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier  # (a partition's warps: bar.sync; Triton 3.6 / 3.9)
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """TMA reduce-add of a shared-memory tile into global memory (``tma.async_atomic_add`` of Triton
        3.9; Triton 3.6's Gluon has the builder's op but no wrapper): one bulk operation, added in L2."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    HAS_GLUON = True
except (ImportError, AttributeError):  # a Triton without Gluon: the engine is unavailable
    HAS_GLUON = False

    class gluon:  # noqa: N801 - keeps the definitions below importable; ``refusal`` refuses the engine
        jit = staticmethod(lambda fn: fn)

LOG2E = 1.4426950408889634


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
def _bwd_dkdv(q_desc, k_desc, v_desc, do_desc, DK, DV, DQA, LSE, DELTA, ORDER, G_PTR, G_ENT, SEM, TURN, TS,
              S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
              VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
              H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_WARPS: tl.constexpr):
    """dK and dV of one K/V tile of one (request, K/V head), summed over its query group (module
    docstring).  DK, DV: contiguous [B, H_kv, S_k, D]; LSE, DELTA: [B, H_q, S_q] float32; DQA
    (ATOMIC_DQ): float32 [B * H_q * S_q, D], zero before the launch, unscaled; SEM, TURN: unused
    (``_bwd_dkdv_ws``'s fused dQ)."""
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
            _sync()
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
        _sync()  # both warpgroups are done with this stage (and with dS^T): it may be refilled
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
    kv_bar, ready, empty, ds_full, dq_full, dq_empty = bars
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
def _dq_issue(ds_smem, k_smem, ds_full, dq_empty, c, uses, db, slot, COL0: tl.constexpr, BLOCK_M: tl.constexpr,
              DQ_COLS: tl.constexpr, DQ_BUFS: tl.constexpr, dq_layout: tl.constexpr):
    """Entry c's dQ columns [COL0, + DQ_COLS) = dS K over the tile's keys (both halves of dS^T buffer
    ``db``), issued (two wgmma groups, not waited for) once both halves are there and the writer has
    sent what slot ``slot`` held (``uses``: the warpgroup's earlier uses of its dQ buffers)."""
    mbarrier.wait(ds_full.index(db), (c // 2) & 1)  # both halves of entry c's dS^T
    mbarrier.wait(dq_empty.index(slot), ((uses // DQ_BUFS) & 1) ^ 1)  # the writer has sent its last tile
    dq0 = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_smem.index(db * 2).permute((1, 0)), k_smem.index(0).slice(COL0, DQ_COLS, dim=1),
                       dq0, use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(db * 2 + 1).permute((1, 0)), k_smem.index(1).slice(COL0, DQ_COLS, dim=1),
                         dq, is_async=True)


@gluon.jit
def _dq_publish(dq, dq_stage, dq_full, slot):
    """An issued dQ tile waited for, put in ``dq_stage[slot]`` and handed to the dQ writer."""
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    dq_stage.index(slot).store(dq)
    fence_async_shared()
    _sync()  # (every thread's rows are in shared memory before the writer is told)
    mbarrier.arrive(dq_full.index(slot), count=1)


@gluon.jit
def _ws_dkdv_consumer(half: tl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_stage, bars, DK, DV, LSE, DELTA, ORDER,
                      G_PTR, G_ENT, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, VISIBLE: tl.constexpr,
                      SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
                      H_KV: tl.constexpr, GROUP: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_SPLIT: tl.constexpr,
                      DQ_BUFS: tl.constexpr):
    """One warpgroup's half of the K/V tile (keys [half * BLOCK_N / 2, + BLOCK_N / 2)): every entry's
    S^T, dP^T, dV and dK (``_bwd_dkdv``'s step on 64 keys), the stage released once its MMAs are
    done; then its rows of dK and dV.  FUSED_DQ: the entry's dS^T also goes to shared memory
    (``ds_smem``: two buffers of both halves, [buffer * 2 + half]), and once both halves are there
    (``ds_full``) dQ = dS K over all BLOCK_N keys is made -- DQ_SPLIT 2: each warpgroup its D / 2
    columns every entry; 1: the whole of it by warpgroup ``c % 2`` (entries alternate) -- into
    ``dq_stage[half * DQ_BUFS + use % DQ_BUFS]`` (float32: DQ_BUFS tiles per warpgroup, so that it
    may run DQ_BUFS entries ahead of the writer), handed to the dQ writer (``dq_full`` /
    ``dq_empty``).  A dS^T
    buffer is rewritten two entries later, after both warpgroups have read it: each warpgroup that
    reads entry c's buffer does so before it writes entry c + 1's half, which the next reader
    awaits."""
    kv_bar, ready, empty, ds_full, dq_full, dq_empty = bars
    pid_n, b, kv_h, bkv, lo, hi = _dkdv_job(ORDER, G_PTR, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, HEAD_GROUP, H_KV)
    HALF: tl.constexpr = BLOCK_N // 2
    dtype: tl.constexpr = k_smem.dtype
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: tl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    DQ_COLS: tl.constexpr = D // DQ_SPLIT
    dq_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
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
        ds_op = dst.to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_op, op_layout), q_t, dk, is_async=True)
        if FUSED_DQ != 0:  # dS^T to shared memory: dQ reads both halves
            db = c % 2
            ds_smem.index(db * 2 + half).store(ds_op)
            fence_async_shared()
            _sync()  # (the warpgroup's whole half is in shared memory before it says so)
            mbarrier.arrive(ds_full.index(db), count=1)
        if FUSED_DQ != 0 and DQ_SPLIT == 2:  # dQ's GEMMs issued behind dV's and dK's: the tensor cores run them back to back
            db = c % 2
            slot = half * DQ_BUFS + c % DQ_BUFS
            dq = _dq_issue(ds_smem, k_smem, ds_full, dq_empty, c, c, db, slot, half * (D - DQ_COLS), BLOCK_M,
                           DQ_COLS, DQ_BUFS, dq_layout)
            dv, dk = warpgroup_mma_wait(2, deps=(dv, dk))  # (dQ's two groups may still run)
            mbarrier.arrive(empty.index(stage), count=1)  # (dQ reads dS^T and K, not this stage's Q or dO)
            _dq_publish(dq, dq_stage, dq_full, slot)
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(empty.index(stage), count=1)
            if FUSED_DQ != 0:  # DQ_SPLIT 1: the warpgroups take whole entries in turn
                if c % 2 == half:
                    uses = c // 2  # (this warpgroup's earlier uses of its dQ buffer)
                    slot = half * DQ_BUFS + uses % DQ_BUFS
                    dq = _dq_issue(ds_smem, k_smem, ds_full, dq_empty, c, uses, c % 2, slot, 0, BLOCK_M, DQ_COLS,
                                   DQ_BUFS, dq_layout)
                    _dq_publish(dq, dq_stage, dq_full, slot)
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
def _bulk_wait(WRITES: tl.constexpr):
    """This thread's TMA stores and adds waited for: until their shared-memory sources are read, or
    (WRITES) until their writes to global memory are done -- before a release that publishes them
    (Triton 3.6's ``store_wait`` waits for the reads only)."""
    if WRITES:
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        tma.store_wait(0)


@gluon.jit
def _ws_dq_writer(dq_stage, bars, dqa_desc, SEM, TURN, ORDER, G_PTR, G_ENT, S_Q, PLAN_B, PLAN_H, KV_PLANES, K_TILES,
                  BKV, BLOCK_M: tl.constexpr, D: tl.constexpr, HEAD_GROUP: tl.constexpr, H_Q: tl.constexpr,
                  H_KV: tl.constexpr, GROUP: tl.constexpr, ORDERED: tl.constexpr, DQ_SPLIT: tl.constexpr,
                  DQ_BUFS: tl.constexpr):
    """The dQ warp of FUSED_DQ: per entry, the consumers' float32 dQ tile (``dq_stage``: DQ_SPLIT 2,
    each warpgroup's D / 2 columns; 1, warpgroup c % 2's whole tile) added into the workspace DQA
    (``dqa_desc``: float32 [B * H_q * S_qp, D], S_qp = S_q rounded up to BLOCK_M, so that no tile
    reaches another head's rows; unscaled) by TMA reduce-add, one bulk operation per tile, added in
    L2 (FlashAttention-3's dQ accumulation).  ORDERED (the deterministic mode): the K/V tiles of a
    (query tile, query head) add in a fixed order -- the entry's turn TURN[i] (how many
    earlier-launched programs add to this tile) is awaited on the tile's counter SEM[b * H_q + h,
    query tile] (acquire), the turn-0 program stores instead of adding (DQA needs no zeroing), its
    writes are waited for, and the counter is then raised (release).  A program waits only on
    programs launched before it, so the waits cannot deadlock while the GPU starts programs in
    launch order.  Unordered: adds into a zeroed DQA, in whatever order they land."""
    kv_bar, ready, empty, ds_full, dq_full, dq_empty = bars
    pid_n, b, kv_h, bkv, lo, hi = _dkdv_job(ORDER, G_PTR, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, HEAD_GROUP, H_KV)
    DQ_COLS: tl.constexpr = D // DQ_SPLIT
    q_tiles = (S_Q + BLOCK_M - 1) // BLOCK_M
    for i in range(lo, hi):
        c = i - lo
        e = gl.load(G_ENT + i)
        qb = e >> 8
        bh = b * H_Q + kv_h * GROUP + ((e >> 1) & 127)
        row = (bh * q_tiles + qb) * BLOCK_M
        lock = SEM + bh * q_tiles + qb
        first = i < 0  # (False: unordered adds never store)
        if ORDERED:
            turn = gl.load(TURN + i)
            seen = gl.atomic_add(lock, 0, sem="acquire", scope="gpu")
            while seen != turn:
                seen = gl.atomic_add(lock, 0, sem="acquire", scope="gpu")
            first = turn == 0
        if DQ_SPLIT == 2:  # (both warpgroups' tiles of this entry: their use c)
            s0 = c % DQ_BUFS
            s1 = DQ_BUFS + c % DQ_BUFS
            mbarrier.wait(dq_full.index(s0), (c // DQ_BUFS) & 1)
            mbarrier.wait(dq_full.index(s1), (c // DQ_BUFS) & 1)
            if first:
                _tma_store(dqa_desc, [row, 0], dq_stage.index(s0))
                _tma_store(dqa_desc, [row, DQ_COLS], dq_stage.index(s1))
            else:
                _tma_add(dqa_desc, [row, 0], dq_stage.index(s0))
                _tma_add(dqa_desc, [row, DQ_COLS], dq_stage.index(s1))
            _bulk_wait(ORDERED)
            mbarrier.arrive(dq_empty.index(s0), count=1)
            mbarrier.arrive(dq_empty.index(s1), count=1)
        else:  # (warpgroup c % 2's tile: its use c // 2)
            u = c // 2
            slot = (c % 2) * DQ_BUFS + u % DQ_BUFS
            mbarrier.wait(dq_full.index(slot), (u // DQ_BUFS) & 1)
            if first:
                _tma_store(dqa_desc, [row, 0], dq_stage.index(slot))
            else:
                _tma_add(dqa_desc, [row, 0], dq_stage.index(slot))
            _bulk_wait(ORDERED)
            mbarrier.arrive(dq_empty.index(slot), count=1)
        if ORDERED:
            _sync()  # (the issuing lane's writes are done before any lane releases them)
            gl.atomic_add(lock, 1, sem="release", scope="gpu")


@gluon.jit
def _bwd_dkdv_ws(q_desc, k_desc, v_desc, do_desc, DK, DV, DQA, LSE, DELTA, ORDER, G_PTR, G_ENT, SEM, TURN, TS,
                 S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_WARPS: tl.constexpr,
                 CONSUMER_REGS: tl.constexpr = 240, PRODUCER_REGS: tl.constexpr = 24, FUSED_DQ: tl.constexpr = 0,
                 WRITER_REGS: tl.constexpr = 24, DQ_SPLIT: tl.constexpr = 2, DQ_BUFS: tl.constexpr = 1):
    """``_bwd_dkdv``'s job, warp-specialized: a TMA producer warp and two consumer warpgroups, each
    with half of the K/V tile's keys (its own dK and dV rows), released stage by stage through
    mbarriers, so that one warpgroup's softmax-side arithmetic runs under the other's MMAs.  Same
    arguments (k_desc / v_desc in BLOCK_N / 2-row boxes; ATOMIC_DQ unused) and SEM, TURN.  FUSED_DQ
    (1: ordered, deterministic; 2: unordered; 0: dQ by its own pass): the consumers also make every
    entry's dQ = dS K (a fifth GEMM; ``_ws_dkdv_consumer``, DQ_SPLIT) and a dQ warp
    (``_ws_dq_writer``) adds it into the workspace by TMA: DQA is then a TMA descriptor of float32
    [B * H_q * S_qp, D] in [BLOCK_M, D / DQ_SPLIT] boxes (S_qp: S_q rounded up to BLOCK_M); SEM:
    int32 [B * H_q, query tiles], zero before the launch (ordered); TURN: each entry's turn, beside
    G_ENT."""
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
    if FUSED_DQ != 0:
        ds_layout: tl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], k_desc.dtype)
        ds_smem = gl.allocate_shared_memory(k_desc.dtype, [4, HALF, BLOCK_M], ds_layout)  # [buffer * 2 + half]
        dq_stage = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFS] + DQA.block_type.shape, DQA.layout)
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFS, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(2):
            mbarrier.init(ds_full.index(w), count=2)  # both halves of a dS^T buffer
        for w in gl.static_range(2 * DQ_BUFS):
            mbarrier.init(dq_full.index(w), count=1)
            mbarrier.init(dq_empty.index(w), count=1)
        fence_async_shared()
        bars = (kv_bar, ready, empty, ds_full, dq_full, dq_empty)
        gl.warp_specialize([
            (_ws_dkdv_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_stage, bars, DK, DV, LSE, DELTA,
                                 ORDER, G_PTR, G_ENT, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES,
                                 BKV, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD,
                                 HAS_SCORE, SCALE, H_Q, H_KV, GROUP, FUSED_DQ, DQ_SPLIT, DQ_BUFS)),
            (_ws_dkdv_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_stage, bars, DK, DV, LSE, DELTA,
                                 ORDER, G_PTR, G_ENT, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES,
                                 BKV, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD,
                                 HAS_SCORE, SCALE, H_Q, H_KV, GROUP, FUSED_DQ, DQ_SPLIT, DQ_BUFS)),
            (_ws_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, bars, ORDER, G_PTR,
                                 G_ENT, S_Q, S_K, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV, BLOCK_M, BLOCK_N, STAGES,
                                 HEAD_GROUP, H_Q, H_KV, GROUP)),
            (_ws_dq_writer, (dq_stage, bars, DQA, SEM, TURN, ORDER, G_PTR, G_ENT, S_Q, PLAN_B, PLAN_H, KV_PLANES,
                             K_TILES, BKV, BLOCK_M, D, HEAD_GROUP, H_Q, H_KV, GROUP, FUSED_DQ == 1, DQ_SPLIT,
                             DQ_BUFS)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, WRITER_REGS])
    else:
        fence_async_shared()
        bars = (kv_bar, ready, empty, ready, ready, empty)  # (no dQ barriers: FUSED_DQ 0 never reads them)
        gl.warp_specialize([
            (_ws_dkdv_consumer, (0, q_smem, do_smem, k_smem, v_smem, k_smem, k_smem, bars, DK, DV, LSE, DELTA, ORDER,
                                 G_PTR, G_ENT, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
                                 EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD,
                                 HAS_SCORE, SCALE, H_Q, H_KV, GROUP, FUSED_DQ, DQ_SPLIT, DQ_BUFS)),
            (_ws_dkdv_consumer, (1, q_smem, do_smem, k_smem, v_smem, k_smem, k_smem, bars, DK, DV, LSE, DELTA, ORDER,
                                 G_PTR, G_ENT, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, KV_PLANES, K_TILES, BKV,
                                 EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE_GRAD,
                                 HAS_SCORE, SCALE, H_Q, H_KV, GROUP, FUSED_DQ, DQ_SPLIT, DQ_BUFS)),
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
