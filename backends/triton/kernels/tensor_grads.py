"""The kernel of the Triton backward's score-tensor gradients (host side: ``score_grads.py``)."""
import triton
import triton.language as tl

from .backward import _probs


@triton.jit
def _bwd_tensor_cells(Q, K, V, DO, LSE, DELTA, W, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                      s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd, R_PTR, R_IDX, TS, S_Q, S_K, Q_OFF, K_OFF,
                      PLAN_B, PLAN_H, Q_TILES, BH, N_LOADS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr,
                      TENSOR_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
                      GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
                      D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dS times each load's derivative on every computed cell of one query tile of one (request,
    query head), written to its cell of W [N_LOADS, B * H_Q, S_Q, S_K]."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_Q
    h = bh % H_Q
    kv_h = h // GROUP
    plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
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
    for i in tl.range(tl.load(R_PTR + 2 * row), tl.load(R_PTR + 2 * row + 2)):  # FULL and PARTIAL blocks
        offs_n = tl.load(R_IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_pos = (K_OFF + offs_n)[None, :]
        kt = tl.load(K + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd,
                     mask=(offs_n[None, :] < S_K) & (offs_dk[:, None] < D_QK), other=0.0)
        vt = tl.load(V + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd,
                     mask=(offs_n[None, :] < S_K) & (offs_dv[:, None] < D_V), other=0.0)
        s_raw = tl.dot(q, kt, input_precision=DOT_PRECISION)
        # (every block takes the predicate: a FULL block's is true on every cell)
        p, g = _probs(s_raw, b, h, q_pos, k_pos, lse2, TS, K_OFF + S_K, Q_OFF + S_Q, True, False, VISIBLE,
                      SCORE_GRAD, HAS_SCORE, SCALE)
        ds = p * (tl.dot(do, vt, input_precision=DOT_PRECISION) - delta[:, None])
        inside = row_in[:, None] & (offs_n[None, :] < S_K)
        for n in tl.static_range(N_LOADS):
            cell = tl.where(p > 0.0, ds * TENSOR_GRAD(s_raw * SCALE, b, h, q_pos, k_pos, TS, n), 0.0)
            tl.store(W + ((n * BH + bh) * S_Q + offs_m[:, None]).to(tl.int64) * S_K + offs_n[None, :], cell,
                     mask=inside)
