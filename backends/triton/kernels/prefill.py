"""The prefill / append kernel over attnc's tile plan (Triton; any GPU Triton runs on, and the
CPU interpreter).

One program per (query tile, request * query head), in ``_job``'s order: heads in groups of
HEAD_GROUP, and within a group every head's heaviest tile first (the plan's ``q_tile_order``).
A program walks the plan's computed K/V blocks of its row; SKIP blocks are never loaded.  WALK
says how:

* ``merged`` (2): every computed block, FULL and PARTIAL together in ascending order, as runs of
  consecutive blocks, one pipelined loop per run (best when runs are long: causal, full);
* ``merged_blocks`` (3): the same blocks as one list, one pipelined loop (short runs: documents);
* ``runs`` (1): FULL blocks as runs, then PARTIAL blocks one by one;
* ``blocks`` (0): the FULL list, then the PARTIAL list, block by block.

In the merged walks a block's PARTIAL flag decides at run time whether the element mask is
applied before the max/sum update; FULL blocks take no mask.  The mask comes from the spec's
``VISIBLE`` function (the predicate) or, MASK_FROM_INTERVALS, from FlashMask's four column
vectors.  The spec's ``SCORE`` function runs on the scaled q.k when HAS_SCORE.  Scores live in
base 2 (exp2) inside the loop; LSE is written in natural log, -inf for rows with no visible
key, whose O is 0.  Positions are bottom-right aligned: query row i is at q = Q_OFF + i with
Q_OFF = S_k - S_q, key j at k = K_OFF + j with K_OFF = 0; one block of a larger call (context
parallelism) passes its rows' and keys' absolute positions instead.

Everything the spec decides arrives as constexpr arguments (``SPEC_ARGS``): the mask and score
functions (``@triton.jit`` functions of the generated module, inlined where they are called),
head counts, head dims and their power-of-two pads, the scale and the dot precision.  TS is
the tuple of the tensors the spec declares, each followed by its strides and sizes, in the
order the generated functions unpack it.
"""
import triton
import triton.language as tl

from .numerics import _checked_lse, _checked_sum

WALKS = {"blocks": 0, "runs": 1, "merged": 2, "merged_blocks": 3}
LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, readable inside a kernel (compiled Triton reads only constexpr globals)


@triton.jit
def _interval_vectors(UTS, UTE, LTS, LTE, vec_base, k_pos, S_K):
    """FlashMask's four column vectors for the block's keys."""
    inside = k_pos < S_K
    return (tl.load(UTS + vec_base + k_pos, mask=inside, other=0), tl.load(UTE + vec_base + k_pos, mask=inside, other=0),
            tl.load(LTS + vec_base + k_pos, mask=inside, other=0), tl.load(LTE + vec_base + k_pos, mask=inside, other=0))


@triton.jit
def _hide(s, b, h, q_pos, k_pos, S_K, Q_OFF, K_OFF, uts, ute, lts, lte, TS, VISIBLE: tl.constexpr,
          MASK_FROM_INTERVALS: tl.constexpr):
    """Hidden cells and keys past S_K to -inf: from the interval vectors (hidden iff the row is
    in [UTS, UTE) or [LTS, LTE)) when MASK_FROM_INTERVALS, else from the predicate (at the
    absolute key position K_OFF + k_pos; ``k_pos`` is the key's index in this call)."""
    if MASK_FROM_INTERVALS:
        row = q_pos - Q_OFF
        keep = ~(((row >= uts) & (row < ute)) | ((row >= lts) & (row < lte)))
    else:
        keep = VISIBLE(b, h, q_pos, K_OFF + k_pos, TS)
    return tl.where(keep & (k_pos < S_K), s, float("-inf"))


@triton.jit
def _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd, start_n, m_i, l_i, acc, b, h, q_pos,
          S_K, Q_OFF, K_OFF, vec_base, qk_scale, UTS, UTE, LTS, LTE, TS, part,
          PARTIAL: tl.constexpr, DYNAMIC: tl.constexpr, MASK_FROM_INTERVALS: tl.constexpr,
          EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
          VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
          D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
          DOT_PRECISION: tl.constexpr):
    """Absorb one K/V block into the row state (m in base-2 scaled units).  PARTIAL blocks set
    hidden scores to -inf before the max/sum update; FULL blocks take no mask and no -inf guard
    (every cell is visible, so the running max is finite).  DYNAMIC: the block's class is the
    run-time flag ``part`` (the interval vectors are loaded either way, so the loop's loads do
    not sit under a branch and stay pipelined)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_pos = offs_n[None, :]
    if USE_TMA:
        kt = desc_k.load([kv_row0 + start_n, 0]).T
    else:
        offs_dk = tl.arange(0, D_QK_PAD)
        k_ptrs = K + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd
        if EVEN_N and D_QK_PAD == D_QK:
            kt = tl.load(k_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=(k_pos < S_K) & (offs_dk[:, None] < D_QK), other=0.0)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    if HAS_SCORE:
        s = SCORE(s * SCALE, b, h, q_pos, K_OFF + k_pos, TS)
    if PARTIAL or DYNAMIC:
        uts, ute, lts, lte = 0, 0, 0, 0
        if MASK_FROM_INTERVALS:
            uts, ute, lts, lte = _interval_vectors(UTS, UTE, LTS, LTE, vec_base, k_pos, S_K)
        if PARTIAL:
            s = _hide(s, b, h, q_pos, k_pos, S_K, Q_OFF, K_OFF, uts, ute, lts, lte, TS, VISIBLE, MASK_FROM_INTERVALS)
        else:
            hide = part != 0
            if not EVEN_N:  # the block across S_K takes the mask path (it hides keys past S_K); a
                hide = hide | (start_n + BLOCK_N > S_K)  # run-time if/else on s breaks Triton 3.6's pipeliner
            if hide:
                s = _hide(s, b, h, q_pos, k_pos, S_K, Q_OFF, K_OFF, uts, ute, lts, lte, TS, VISIBLE,
                          MASK_FROM_INTERVALS)
    elif not EVEN_N:
        s = tl.where(k_pos < S_K, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if PARTIAL or DYNAMIC or not EVEN_N:  # a row may have seen nothing yet: keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if USE_TMA:
        v = desc_v.load([kv_row0 + start_n, 0])
    else:
        offs_dv = tl.arange(0, D_V_PAD)
        v_ptrs = V + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd
        if EVEN_N and D_V_PAD == D_V:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < D_V), other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _join_sink(m_i, l_i, acc, sink):
    """The sink (natural units) as one more term of each row's denominator with no value
    (attnc.compiler.sinks), into the row state (m in base-2 units): a row that saw nothing gets
    m = sink, l = 1, acc = 0 (O = 0, LSE = sink); a sink of -inf leaves the row as it is; a NaN
    or +inf sink makes l NaN, which marks the row."""
    s2 = sink * LOG2E_C
    m_new = tl.maximum(m_i, s2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    return m_new, l_i * alpha + tl.math.exp2(s2 - m_use), acc * alpha[:, None]


@triton.jit
def _job(t, BH, Q_TILES, HEAD_GROUP: tl.constexpr):
    """The launch's t-th (query tile rank, request * query head): heads in groups of
    HEAD_GROUP, one group after another; within a group, every head's heaviest tile, then
    every head's next heaviest, and so on (longest first across heads, while the programs in
    flight share a few heads' K/V in L2).  ``launch.job_order`` is its numpy twin."""
    base = (t // (HEAD_GROUP * Q_TILES)) * HEAD_GROUP
    g = tl.minimum(BH - base, HEAD_GROUP)
    r = t - base * Q_TILES
    return r // g, base + r % g


@triton.jit
def _tile_of(rank, bh, ORDER, PLAN_B, PLAN_H, Q_TILES, H_Q: tl.constexpr):
    """(query tile, b, h, plan row) of head bh's rank-th heaviest tile in the plan's order."""
    b = bh // H_Q
    h = bh % H_Q
    plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
    pid_m = tl.load(ORDER + plane * Q_TILES + rank)
    return pid_m, b, h, plane * Q_TILES + pid_m


@triton.jit
def _tile_origin(bh, S, H: tl.constexpr, COLS: tl.constexpr, BSHD: tl.constexpr):
    """(row, column) of the first row of head ``bh`` (b * H + h) in the 2-D view a TMA descriptor
    copies: bhsd, [B * H * S, d] (row bh * S, column 0); BSHD, [B * S, H * COLS] (row b * S, column
    h * COLS).  The head's row r is then row + r.  ``launch.tile_origin`` is its numpy twin."""
    if BSHD:
        return (bh // H) * S, (bh % H) * COLS
    else:
        return bh * S, 0


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, desc_k, desc_v,
              s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
              s_ob, s_oh, s_om, s_od,
              ORDER, F_PTR, F_LO, F_HI, P_CSR, P_IDX, F_CSR, F_IDX, M_PTR, M_LO, M_HI, M_BASE, M_FLAG,
              M_CSR, M_IDX, UTS, UTE, LTS, LTE, TS,
              S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, qk_scale, BH, FLAG, MARK,
              MASK_FROM_INTERVALS: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr,
              WALK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_GROUP: tl.constexpr,
              VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
              H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr,
              D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
              DOT_PRECISION: tl.constexpr, HAS_SINK: tl.constexpr = False, SINK: tl.constexpr = None):
    """One query tile of one (request, query head): the program's job in ``_job``'s order.  HAS_SINK:
    the spec's sink (``SINK(b, h, TS)``, natural units) joins every row once after its keys.  MARK:
    a row whose LSE is NaN sets the call's non-finite flag FLAG (int32), so no launch of its own
    marks the call (``runtime.Kernel._check_scores``)."""
    rank, bh = _job(tl.program_id(0), BH, Q_TILES, HEAD_GROUP)
    pid_m, b, h, row = _tile_of(rank, bh, ORDER, PLAN_B, PLAN_H, Q_TILES, H_Q)
    kv_h = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = (Q_OFF + offs_m)[:, None]
    offs_dk = tl.arange(0, D_QK_PAD)
    q_ptrs = Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < S_Q) & (offs_dk[None, :] < D_QK), other=0.0)
    K += b * s_kb + kv_h * s_kh
    V += b * s_vb + kv_h * s_vh
    kv_row0 = (b * H_KV + kv_h) * S_K  # row of this head in the [B * H_kv * S_k, d] TMA view
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V_PAD], tl.float32)
    vec_base = (row // Q_TILES) * S_K
    if WALK == 3:
        for i in tl.range(tl.load(M_CSR + row), tl.load(M_CSR + row + 1)):
            m_i, l_i, acc = _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd,
                                  tl.load(M_IDX + i) * BLOCK_N, m_i, l_i, acc, b, h, q_pos, S_K, Q_OFF, K_OFF, vec_base,
                                  qk_scale, UTS, UTE, LTS, LTE, TS, tl.load(M_FLAG + i), False, True,
                                  MASK_FROM_INTERVALS, EVEN_N, USE_TMA, BLOCK_N, VISIBLE, SCORE, HAS_SCORE, SCALE,
                                  D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    elif WALK == 2:
        for r in range(tl.load(M_PTR + row), tl.load(M_PTR + row + 1)):
            lo = tl.load(M_LO + r)
            flags = M_FLAG + tl.load(M_BASE + r) - lo
            for j in tl.range(lo, tl.load(M_HI + r)):
                m_i, l_i, acc = _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd,
                                      j * BLOCK_N, m_i, l_i, acc, b, h, q_pos, S_K, Q_OFF, K_OFF, vec_base,
                                      qk_scale, UTS, UTE, LTS, LTE, TS, tl.load(flags + j), False, True,
                                      MASK_FROM_INTERVALS, EVEN_N, USE_TMA, BLOCK_N, VISIBLE, SCORE, HAS_SCORE,
                                      SCALE, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    elif WALK == 1:
        for r in range(tl.load(F_PTR + row), tl.load(F_PTR + row + 1)):
            for start_n in tl.range(tl.load(F_LO + r) * BLOCK_N, tl.load(F_HI + r) * BLOCK_N, BLOCK_N):
                m_i, l_i, acc = _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd,
                                      start_n, m_i, l_i, acc, b, h, q_pos, S_K, Q_OFF, K_OFF, vec_base,
                                      qk_scale, UTS, UTE, LTS, LTE, TS, 0, False, False,
                                      MASK_FROM_INTERVALS, EVEN_N, USE_TMA, BLOCK_N, VISIBLE, SCORE, HAS_SCORE,
                                      SCALE, D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    else:
        for i in range(tl.load(F_CSR + row), tl.load(F_CSR + row + 1)):
            m_i, l_i, acc = _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd,
                                  tl.load(F_IDX + i) * BLOCK_N, m_i, l_i, acc, b, h, q_pos, S_K, Q_OFF, K_OFF, vec_base,
                                  qk_scale, UTS, UTE, LTS, LTE, TS, 0, False, False,
                                  MASK_FROM_INTERVALS, EVEN_N, USE_TMA, BLOCK_N, VISIBLE, SCORE, HAS_SCORE, SCALE,
                                  D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    if WALK < 2:
        for i in range(tl.load(P_CSR + row), tl.load(P_CSR + row + 1)):
            m_i, l_i, acc = _tile(q, K, V, desc_k, desc_v, kv_row0, s_kn, s_kd, s_vn, s_vd,
                                  tl.load(P_IDX + i) * BLOCK_N, m_i, l_i, acc, b, h, q_pos, S_K, Q_OFF, K_OFF, vec_base,
                                  qk_scale, UTS, UTE, LTS, LTE, TS, 1, True, False,
                                  MASK_FROM_INTERVALS, EVEN_N, USE_TMA, BLOCK_N, VISIBLE, SCORE, HAS_SCORE, SCALE,
                                  D_QK, D_V, D_QK_PAD, D_V_PAD, DOT_PRECISION)
    if HAS_SINK:
        m_i, l_i, acc = _join_sink(m_i, l_i, acc, SINK(b, h, TS))
    l_i = _checked_sum(m_i, l_i)
    seen = (l_i > 0) | (l_i != l_i)  # NaN: a visible score was NaN or +inf; LSE NaN marks the row
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse = _checked_lse(tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf")))
    out = tl.where((lse != lse)[:, None], float("nan"), out)
    offs_dv = tl.arange(0, D_V_PAD)
    o_ptrs = O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_dv[None, :] * s_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < D_V))
    tl.store(LSE + bh * S_Q + offs_m, lse, mask=offs_m < S_Q)
    if MARK:  # (every program that finds a NaN row stores the same value: their order does not matter)
        tl.store(FLAG, 1, mask=tl.max(((lse != lse) & (offs_m < S_Q)).to(tl.int32), 0) > 0)
