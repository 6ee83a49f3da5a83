"""The backward pass over attnc's tile plan (Triton; any GPU Triton runs on, and the CPU
interpreter).

Three launches, FlashAttention-2's schedule, with nothing but O and LSE saved by the forward:

* ``_bwd_delta``: D = rowsum(dO * O) - dLSE per query row (float32);
* ``_bwd_dkdv``: one program per (K/V tile, request * K/V head).  It walks the *transposed* plan
  -- for its key block, the query blocks that see it (the plan's classes read by column: what
  FlashMask's column intervals describe) -- for every query head of its GQA group in turn, so
  dK and dV of a K/V head are summed over its query group in one program, in a fixed order;
* ``_bwd_dq``: one program per (query tile, request * query head), walking the forward plan's
  row of blocks.

Both walks take a block list with one PARTIAL flag per block: FULL blocks run unmasked, PARTIAL
blocks apply the spec's ``VISIBLE`` predicate, SKIP blocks are never loaded.  No atomics: every
gradient element is written by one program, so the bits do not depend on scheduling
(deterministic), at the price of computing Q.K^T and dO.V^T in both passes (the dQ pass
recomputes what the dK/dV pass had; FlashAttention-2's atomic dQ does not).

With a score program, the spec's ``SCORE_GRAD`` (generated from the compiler's derivative of
the score statements, ``compiler.autodiff``) returns the final score and d score / d (scale q.k)
on each cell; dS is multiplied by it before the two GEMMs that use it.  Rows with no visible key
(LSE = -inf) take P = 0, so they contribute nothing and produce no NaN.  Positions are
bottom-right: query row i is at q = Q_OFF + i with Q_OFF = S_k - S_q, and key j at k = K_OFF + j
with K_OFF = 0; one block of a larger call (context parallelism, ``attnc.distributed``) passes
its rows' and keys' absolute positions instead, with the saved LSE of the whole row.
"""
import triton
import triton.language as tl

from .prefill import _job

LOG2E = 1.4426950408889634


@triton.jit
def _bwd_delta(O, DO, DLSE, DELTA, s_ob, s_oh, s_om, s_od, s_db, s_dh, s_dm, s_dd, S_Q,
               H_Q: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK: tl.constexpr, D_V: tl.constexpr,
               D_V_PAD: tl.constexpr):
    bh = tl.program_id(1)
    b = bh // H_Q
    h = bh % H_Q
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_V_PAD)
    inside = (offs_m[:, None] < S_Q) & (offs_d[None, :] < D_V)
    o = tl.load(O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od, mask=inside, other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_d[None, :] * s_dd, mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
    tl.store(DELTA + bh * S_Q + offs_m, delta, mask=offs_m < S_Q)


@triton.jit
def _probs(s_raw, b, h, q_pos, k_pos, lse2, TS, K_END, Q_END, MASKED: tl.constexpr, EVEN: tl.constexpr,
           VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr):
    """P (from the saved LSE, base 2) and d score / d (scale q.k) on a tile of raw q.k.  MASKED
    (a PARTIAL block) hides cells by the spec's predicate; cells past S_q or S_k are hidden
    unless the call's lengths are multiples of the tiles (EVEN).  Positions are absolute: keys
    end at K_END = K_OFF + S_K, rows at Q_END = Q_OFF + S_Q."""
    if HAS_SCORE:
        s, g = SCORE_GRAD(s_raw * SCALE, b, h, q_pos, k_pos, TS)
        s = s * 1.4426950408889634
    else:
        s = s_raw * (SCALE * 1.4426950408889634)
        g = 1.0
    if MASKED:
        keep = VISIBLE(b, h, q_pos, k_pos, TS)
        if not EVEN:
            keep = keep & (k_pos < K_END) & (q_pos < Q_END)
        s = tl.where(keep, s, float("-inf"))
    elif not EVEN:
        s = tl.where((k_pos < K_END) & (q_pos < Q_END), s, float("-inf"))
    return tl.math.exp2(s - lse2), g


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, DQA, C_IDX, i, b, h, bh, k_pos, offs_dk, offs_dv,
               s_qm, s_qd, s_dm, s_dd, TS, S_Q, K_END, Q_OFF, ATOMIC_DQ: tl.constexpr, MASKED: tl.constexpr,
               EVEN_M: tl.constexpr,
               EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr,
               HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
               D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One query block's share of a K/V block's dK and dV (transposed tiles: keys are rows)."""
    offs_m = tl.load(C_IDX + i) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = (Q_OFF + offs_m)[None, :]
    row_in = offs_m < S_Q
    if EVEN_M and D_QK_PAD == D_QK:
        q = tl.load(q_base + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd)
    else:
        q = tl.load(q_base + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd,
                    mask=row_in[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    if EVEN_M and D_V_PAD == D_V:
        do = tl.load(do_base + offs_m[:, None] * s_dm + offs_dv[None, :] * s_dd)
    else:
        do = tl.load(do_base + offs_m[:, None] * s_dm + offs_dv[None, :] * s_dd,
                     mask=row_in[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if EVEN_M:
        lse = tl.load(LSE + bh * S_Q + offs_m)
        delta = tl.load(DELTA + bh * S_Q + offs_m)
    else:
        lse = tl.load(LSE + bh * S_Q + offs_m, mask=row_in, other=float("inf"))
        delta = tl.load(DELTA + bh * S_Q + offs_m, mask=row_in, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    s_raw = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    pt, gt = _probs(s_raw, b, h, q_pos, k_pos, lse2[None, :], TS, K_END, Q_OFF + S_Q, MASKED, EVEN_M and EVEN_N,
                    VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dst = pt * (dpt - delta[None, :])
    if HAS_SCORE:
        dst = tl.where(pt > 0.0, dst * gt, 0.0)
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:  # this block's share of dQ, added in whatever order the programs arrive
        dq = tl.dot(tl.trans(dst).to(k.dtype), k, input_precision=DOT_PRECISION)
        tl.atomic_add(DQA + (bh * S_Q + offs_m[:, None]) * D_QK_PAD + offs_dk[None, :], dq, sem="relaxed",
                      mask=row_in[:, None])
    return dk, dv


@triton.jit
def _dkdv_program(t, Q, K, V, DO, DK, DV, LSE, DELTA, DQA,
                  s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                  s_db, s_dh, s_dm, s_dd, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd,
                  C_ORDER, C_PTR, C_IDX, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, K_TILES, BKV,
                  EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr, VISIBLE: tl.constexpr,
                  SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
                  H_KV: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
                  D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK and dV of one K/V block of one (request, K/V head), summed over its query group: job t
    in ``prefill._job``'s order (heads in groups, each head's heaviest column first)."""
    rank, bkv = _job(t, BKV, K_TILES, HEAD_GROUP)
    b = bkv // H_KV
    kv_h = bkv % H_KV
    plane0 = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, kv_h * GROUP, 0)
    pid_n = tl.load(C_ORDER + plane0 * K_TILES + rank)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_pos = (K_OFF + offs_n)[:, None]
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    k = tl.load(K + b * s_kb + kv_h * s_kh + offs_n[:, None] * s_kn + offs_dk[None, :] * s_kd,
                mask=(offs_n[:, None] < S_K) & (offs_dk[None, :] < D_QK), other=0.0)
    v = tl.load(V + b * s_vb + kv_h * s_vh + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd,
                mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < D_V), other=0.0)
    dk = tl.zeros([BLOCK_N, D_QK_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_V_PAD], tl.float32)
    for g in range(GROUP):
        h = kv_h * GROUP + g
        bh = b * H_Q + h
        plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
        col = plane * K_TILES + pid_n
        q_base = Q + b * s_qb + h * s_qh
        do_base = DO + b * s_db + h * s_dh
        lo, mid, hi = tl.load(C_PTR + 2 * col), tl.load(C_PTR + 2 * col + 1), tl.load(C_PTR + 2 * col + 2)
        for i in tl.range(lo, mid):  # FULL blocks: no element mask
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, DQA, C_IDX, i, b, h, bh, k_pos, offs_dk,
                                offs_dv, s_qm, s_qd, s_dm, s_dd, TS, S_Q, K_OFF + S_K, Q_OFF, ATOMIC_DQ, False, EVEN_M, EVEN_N, BLOCK_M,
                                VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
        for i in tl.range(mid, hi):  # PARTIAL blocks: the spec's predicate
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, DQA, C_IDX, i, b, h, bh, k_pos, offs_dk,
                                offs_dv, s_qm, s_qd, s_dm, s_dd, TS, S_Q, K_OFF + S_K, Q_OFF, ATOMIC_DQ, True, EVEN_M, EVEN_N, BLOCK_M,
                                VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    dk = dk * SCALE
    tl.store(DK + b * s_dkb + kv_h * s_dkh + offs_n[:, None] * s_dkn + offs_dk[None, :] * s_dkd,
             dk.to(DK.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_dk[None, :] < D_QK))
    tl.store(DV + b * s_dvb + kv_h * s_dvh + offs_n[:, None] * s_dvn + offs_dv[None, :] * s_dvd,
             dv.to(DV.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_step(dq, q, do, K, V, R_IDX, i, b, h, q_pos, lse2, delta, offs_dk, offs_dv, s_kn, s_kd, s_vn, s_vd,
             TS, S_Q, S_K, Q_OFF, K_OFF, MASKED: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
             BLOCK_N: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr,
             SCALE: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
             D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V block's share of a query tile's dQ."""
    offs_n = tl.load(R_IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_pos = (K_OFF + offs_n)[None, :]
    if EVEN_N and D_QK_PAD == D_QK:
        kt = tl.load(K + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd)
    else:
        kt = tl.load(K + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd,
                     mask=(offs_n[None, :] < S_K) & (offs_dk[:, None] < D_QK), other=0.0)
    if EVEN_N and D_V_PAD == D_V:
        vt = tl.load(V + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd)
    else:
        vt = tl.load(V + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd,
                     mask=(offs_n[None, :] < S_K) & (offs_dv[:, None] < D_V), other=0.0)
    s_raw = tl.dot(q, kt, input_precision=DOT_PRECISION)
    p, g = _probs(s_raw, b, h, q_pos, k_pos, lse2, TS, K_OFF + S_K, Q_OFF + S_Q, MASKED, EVEN_M and EVEN_N,
                  VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE)
    dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_SCORE:
        ds = tl.where(p > 0.0, ds * g, 0.0)
    return tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_program(t, Q, K, V, DO, DQ, LSE, DELTA,
                s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                s_db, s_dh, s_dm, s_dd, s_dqb, s_dqh, s_dqm, s_dqd,
                R_ORDER, R_PTR, R_IDX, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_GROUP: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr,
                HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr,
                GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
                D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ of one query tile of one (request, query head): job t in ``prefill._job``'s order."""
    rank, bh = _job(t, BH, Q_TILES, HEAD_GROUP)
    b = bh // H_Q
    h = bh % H_Q
    kv_h = h // GROUP
    plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
    pid_m = tl.load(R_ORDER + plane * Q_TILES + rank)
    row = plane * Q_TILES + pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = (Q_OFF + offs_m)[:, None]
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    row_in = offs_m < S_Q
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd,
                mask=row_in[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_dv[None, :] * s_dd,
                 mask=row_in[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    lse = tl.load(LSE + bh * S_Q + offs_m, mask=row_in, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)[:, None]
    delta = tl.load(DELTA + bh * S_Q + offs_m, mask=row_in, other=0.0)
    K += b * s_kb + kv_h * s_kh
    V += b * s_vb + kv_h * s_vh
    dq = tl.zeros([BLOCK_M, D_QK_PAD], tl.float32)
    lo, mid, hi = tl.load(R_PTR + 2 * row), tl.load(R_PTR + 2 * row + 1), tl.load(R_PTR + 2 * row + 2)
    for i in tl.range(lo, mid):  # FULL blocks
        dq = _dq_step(dq, q, do, K, V, R_IDX, i, b, h, q_pos, lse2, delta, offs_dk, offs_dv, s_kn, s_kd, s_vn, s_vd,
                      TS, S_Q, S_K, Q_OFF, K_OFF, False, EVEN_M, EVEN_N, BLOCK_N, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE,
                      D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    for i in tl.range(mid, hi):  # PARTIAL blocks
        dq = _dq_step(dq, q, do, K, V, R_IDX, i, b, h, q_pos, lse2, delta, offs_dk, offs_dv, s_kn, s_kd, s_vn, s_vd,
                      TS, S_Q, S_K, Q_OFF, K_OFF, True, EVEN_M, EVEN_N, BLOCK_N, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE,
                      D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    dq = dq * SCALE
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqm + offs_dk[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_in[:, None] & (offs_dk[None, :] < D_QK))


@triton.jit
def _bwd_main(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, DQA,
              s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd,
              s_dqb, s_dqh, s_dqm, s_dqd, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd,
              C_ORDER, C_PTR, C_IDX, R_ORDER, R_PTR, R_IDX, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, K_TILES, Q_TILES,
              BKV, BH, DKDV_JOBS,
              EVEN_M1: tl.constexpr, EVEN_N1: tl.constexpr, EVEN_M2: tl.constexpr, EVEN_N2: tl.constexpr,
              BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
              PASSES: tl.constexpr, HEAD_GROUP: tl.constexpr, ATOMIC_DQ: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr,
              HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr,
              GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
              D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The dK/dV and dQ passes.  PASSES: 3 = both in one launch (the dK/dV jobs first, then the
    dQ jobs: the two passes share the GPU instead of waiting for each other), 1 = dK/dV only,
    2 = dQ only.  ATOMIC_DQ: the dK/dV pass also adds each block's dQ into the float32 DQA
    (FlashAttention-2's schedule: five GEMMs per block instead of seven, not deterministic)."""
    t = tl.program_id(0)
    if PASSES == 2:
        t += DKDV_JOBS
    if t < DKDV_JOBS:
        _dkdv_program(t, Q, K, V, DO, DK, DV, LSE, DELTA, DQA, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                      s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn,
                      s_dvd, C_ORDER, C_PTR, C_IDX, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, K_TILES, BKV,
                      EVEN_M1, EVEN_N1, BLOCK_M1, BLOCK_N1, HEAD_GROUP, ATOMIC_DQ, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE,
                      H_Q, H_KV, GROUP, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    else:
        _dq_program(t - DKDV_JOBS, Q, K, V, DO, DQ, LSE, DELTA, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                    s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd, s_dqb, s_dqh, s_dqm, s_dqd,
                    R_ORDER, R_PTR, R_IDX, TS, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH,
                    EVEN_M2, EVEN_N2, BLOCK_M2, BLOCK_N2, HEAD_GROUP, VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE,
                    H_Q, H_KV, GROUP, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)


@triton.jit
def _bwd_dq_store(DQA, DQ, COUNTS, s_b, s_h, s_m, s_d, S_Q, S_QA, H_Q: tl.constexpr, BLOCK: tl.constexpr,
                  D_QK: tl.constexpr, D_QK_PAD: tl.constexpr, SCALE: tl.constexpr, COUNTED: tl.constexpr = False):
    """dQ = SCALE * the float32 accumulator DQA [B * H_q, S_QA, D_QK_PAD] (S_QA >= S_q rows per head),
    in dQ's dtype and strides (ATOMIC_DQ; the Gluon backward's atomic and fused dQ).  COUNTED (the
    Gluon fused dQ in order): COUNTS [B * H_q, cdiv(S_q, BLOCK)] holds how many K/V tiles wrote each
    BLOCK-row tile of DQA, never written where 0 (dQ = 0)."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_QK_PAD)
    inside = (offs_m[:, None] < S_Q) & (offs_d[None, :] < D_QK)
    acc = tl.load(DQA + (bh * S_QA + offs_m[:, None]) * D_QK_PAD + offs_d[None, :], mask=inside, other=0.0)
    if COUNTED:
        acc = tl.where(tl.load(COUNTS + bh * tl.cdiv(S_Q, BLOCK) + tl.program_id(0)) > 0, acc, 0.0)
    tl.store(DQ + (bh // H_Q) * s_b + (bh % H_Q) * s_h + offs_m[:, None] * s_m + offs_d[None, :] * s_d,
             (acc * SCALE).to(DQ.dtype.element_ty), mask=inside)
