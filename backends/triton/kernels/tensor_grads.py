"""The kernel of the Triton backward's score-tensor gradients (host side: ``score_grads.py``).

One launch per f32 load of the score program, specialised on which of b, h, q, k the load's
index names (KEEP_*): each program owns a piece of the load's gradient and sums into it, in a
fixed order, every computed tile of the (request, query head) planes that map to it, so every
output element is written once, by one program (no atomics: the same bits run to run).

  KEEP_Q and KEEP_K  one program per (query tile, key tile, kept plane): that tile, summed over
                     the reduced b / h (``bias[h, q, k]``: the batch)
  KEEP_Q only        one program per (query tile, kept plane): the row's key tiles summed
  KEEP_K only        one program per (key tile, kept plane): the column's query tiles summed
                     (``kb[b, k]``: the host keeps h apart, then sums it)
  neither            one program per (query tile, kept plane): one partial sum of the row's
                     tiles (``slope[h]``), summed over the query tiles by the host

A tile's class comes from the plan (CLS: int8 [PLAN_B, PLAN_H, Q_TILES, K_TILES] of
``ir.TileClass``: SKIP 0, PARTIAL 1, FULL 2): SKIP tiles are never loaded, FULL tiles skip the
mask's predicate.
"""
import triton
import triton.language as tl

from .backward import _probs


@triton.jit
def _rows(Q, DO, LSE, DELTA, s_qb, s_qh, s_qm, s_qd, s_db, s_dh, s_dm, s_dd, b, h, qt, S_Q,
          BLOCK_M: tl.constexpr, H_Q: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
          D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr):
    """What a tile reads of query tile qt of request b, query head h: q, dO, LSE (base 2: rows
    past S_q or with no visible key give P = 0) and D."""
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    row_in = offs_m < S_Q
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd,
                mask=row_in[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_dv[None, :] * s_dd,
                 mask=row_in[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    bh = b * H_Q + h
    lse = tl.load(LSE + bh * S_Q + offs_m, mask=row_in, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * S_Q + offs_m, mask=row_in, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _keys(K, V, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, b, h, kt, S_K, BLOCK_N: tl.constexpr,
          GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
          D_V_PAD: tl.constexpr):
    """K and V of key tile kt of request b, query head h's K/V head, transposed ([d, keys])."""
    kv_h = h // GROUP
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    key_in = offs_n < S_K
    kt_ = tl.load(K + b * s_kb + kv_h * s_kh + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd,
                  mask=key_in[None, :] & (offs_dk[:, None] < D_QK), other=0.0)
    vt = tl.load(V + b * s_vb + kv_h * s_vh + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd,
                 mask=key_in[None, :] & (offs_dv[:, None] < D_V), other=0.0)
    return kt_, vt


@triton.jit
def _tile_grad(q, do, lse2, delta, kt_, vt, TS, b, h, qt, kt, full, S_Q, S_K, Q_OFF, K_OFF, N: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VISIBLE: tl.constexpr,
               SCORE_GRAD: tl.constexpr, TENSOR_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr,
               SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dS times d (final score) / d (load N) on the cells of one computed tile (query tile qt, key
    tile kt) of request b, query head h, from its rows (``_rows``) and keys (``_keys``): P and
    dS = P (dP - D) recomputed; cells that are hidden or past S_q / S_k give 0."""
    q_pos = (Q_OFF + qt * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    k_pos = (K_OFF + kt * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    s_raw = tl.dot(q, kt_, input_precision=DOT_PRECISION)
    if full:  # a FULL tile: no predicate
        p, g = _probs(s_raw, b, h, q_pos, k_pos, lse2[:, None], TS, K_OFF + S_K, Q_OFF + S_Q, False, EVEN,
                      VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE)
    else:
        p, g = _probs(s_raw, b, h, q_pos, k_pos, lse2[:, None], TS, K_OFF + S_K, Q_OFF + S_Q, True, EVEN,
                      VISIBLE, SCORE_GRAD, HAS_SCORE, SCALE)
    ds = p * (tl.dot(do, vt, input_precision=DOT_PRECISION) - delta[:, None])
    return tl.where(p > 0.0, ds * TENSOR_GRAD(s_raw * SCALE, b, h, q_pos, k_pos, TS, N), 0.0)


@triton.jit
def _bwd_tensor_grad(Q, K, V, DO, LSE, DELTA, CLS, W, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                     s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd, TS, B, S_Q, S_K, Q_OFF, K_OFF,
                     PLAN_B, PLAN_H, Q_TILES, K_TILES, N: tl.constexpr, KEEP_B: tl.constexpr,
                     KEEP_H: tl.constexpr, KEEP_Q: tl.constexpr, KEEP_K: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VISIBLE: tl.constexpr,
                     SCORE_GRAD: tl.constexpr, TENSOR_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr,
                     SCALE: tl.constexpr, H_Q: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr,
                     D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Load N's gradient piece of program (tile, kept plane) into W (module docstring): W is
    [kept b, kept h, S_Q, S_K] (KEEP_Q and KEEP_K), [.., S_Q], [.., S_K] or [.., Q_TILES]."""
    pid = tl.program_id(0)
    kept = tl.program_id(1)
    kb = kept // H_Q if KEEP_H else kept
    kh = kept % H_Q if KEEP_H else 0
    reduced_h = 1 if KEEP_H else H_Q
    reduced = reduced_h if KEEP_B else B * reduced_h
    if KEEP_Q and KEEP_K:
        qt = pid // K_TILES
        kt = pid % K_TILES
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif KEEP_K:
        qt = 0
        kt = pid
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        qt = pid
        kt = 0
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in tl.range(0, reduced):  # the reduced (request, head) planes, in order
        b = kb if KEEP_B else r // reduced_h
        h = kh if KEEP_H else r % reduced_h
        plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
        if KEEP_Q and KEEP_K:
            c = tl.load(CLS + (plane * Q_TILES + qt).to(tl.int64) * K_TILES + kt)
            if c != 0:
                q, do, lse2, delta = _rows(Q, DO, LSE, DELTA, s_qb, s_qh, s_qm, s_qd, s_db, s_dh, s_dm, s_dd, b, h,
                                           qt, S_Q, BLOCK_M, H_Q, D_QK, D_V, D_QK_PAD, D_V_PAD)
                kt_, vt = _keys(K, V, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, b, h, kt, S_K, BLOCK_N, GROUP,
                                D_QK, D_V, D_QK_PAD, D_V_PAD)
                acc += _tile_grad(q, do, lse2, delta, kt_, vt, TS, b, h, qt, kt, c == 2, S_Q, S_K, Q_OFF, K_OFF, N,
                                  EVEN, BLOCK_M, BLOCK_N, VISIBLE, SCORE_GRAD, TENSOR_GRAD, HAS_SCORE, SCALE,
                                  DOT_PRECISION)
        elif KEEP_K:
            kt_, vt = _keys(K, V, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, b, h, kt, S_K, BLOCK_N, GROUP,
                            D_QK, D_V, D_QK_PAD, D_V_PAD)
            for i in tl.range(0, Q_TILES):  # the column's query tiles, ascending
                c = tl.load(CLS + (plane * Q_TILES + i).to(tl.int64) * K_TILES + kt)
                if c != 0:
                    q, do, lse2, delta = _rows(Q, DO, LSE, DELTA, s_qb, s_qh, s_qm, s_qd, s_db, s_dh, s_dm, s_dd, b,
                                               h, i, S_Q, BLOCK_M, H_Q, D_QK, D_V, D_QK_PAD, D_V_PAD)
                    cell = _tile_grad(q, do, lse2, delta, kt_, vt, TS, b, h, i, kt, c == 2, S_Q, S_K, Q_OFF, K_OFF,
                                      N, EVEN, BLOCK_M, BLOCK_N, VISIBLE, SCORE_GRAD, TENSOR_GRAD, HAS_SCORE, SCALE,
                                      DOT_PRECISION)
                    acc += tl.sum(cell, 0)
        else:
            q, do, lse2, delta = _rows(Q, DO, LSE, DELTA, s_qb, s_qh, s_qm, s_qd, s_db, s_dh, s_dm, s_dd, b, h, qt,
                                       S_Q, BLOCK_M, H_Q, D_QK, D_V, D_QK_PAD, D_V_PAD)
            for j in tl.range(0, K_TILES):  # the row's key tiles, ascending
                c = tl.load(CLS + (plane * Q_TILES + qt).to(tl.int64) * K_TILES + j)
                if c != 0:
                    kt_, vt = _keys(K, V, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, b, h, j, S_K, BLOCK_N,
                                    GROUP, D_QK, D_V, D_QK_PAD, D_V_PAD)
                    cell = _tile_grad(q, do, lse2, delta, kt_, vt, TS, b, h, qt, j, c == 2, S_Q, S_K, Q_OFF, K_OFF,
                                      N, EVEN, BLOCK_M, BLOCK_N, VISIBLE, SCORE_GRAD, TENSOR_GRAD, HAS_SCORE, SCALE,
                                      DOT_PRECISION)
                    acc += tl.sum(cell, 1)
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    if KEEP_Q and KEEP_K:
        tl.store(W + (kept * S_Q + offs_m[:, None]).to(tl.int64) * S_K + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < S_Q) & (offs_n[None, :] < S_K))
    elif KEEP_K:
        tl.store(W + kept.to(tl.int64) * S_K + offs_n, acc, mask=offs_n < S_K)
    elif KEEP_Q:
        tl.store(W + kept.to(tl.int64) * S_Q + offs_m, acc, mask=offs_m < S_Q)
    else:
        tl.store(W + kept * Q_TILES + qt, tl.sum(acc, 0))
