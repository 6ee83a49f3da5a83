"""Split-K/V kernels: the producer over a K/V cache and the exact combine (Triton).

``_decode_split``: one program per (split, query tile * K/V head).  A query tile is BLOCK_Q
consecutive query rows of one request (decode: the request's one new row); they and the G query
heads of the K/V head form the rows of one tile, row r = (query row r // G_PAD, head r % G_PAD),
so each K/V block is loaded once for the whole group and all the tile's positions.  Request b's
query row i is at position kv_lens[b] - q_lens[b] + i (bottom-right) and sits at packed row
qo_indptr[b] + i.  The program walks its share of the tile's visible K/V blocks (the plan
removed SKIP blocks, the union over the tile's rows and heads, and flags PARTIAL ones), reading
the cache through the request's page table, and writes one partial state per (packed query row,
query head) in the declared workspace ABI.  ONE_ROW (every request has one query row, decode) is
the tile = request special case: no tile or row metadata is read.  BOUNDED (a spec's explicit
``split =`` policy): slot ``split`` of request b owns the key positions SPLIT_BOUNDS[b, split] =
[start, end) exactly as the policy cut them; its block list holds the blocks meeting that range
(a block a bound cuts is in both slots' lists) and every key outside it is masked.  Otherwise
a slot owns whole blocks (balanced shares of the tile's list).

The workspace stores each field in its declared dtype (``compiler.analysis.ledger``): (m, l, u)
keeps u in float32 (unnormalized: it can exceed the storage range); (LSE, O) stores the
normalized partial O in the storage dtype (a convex combination of V rows always fits it).

``_combine`` merges the S_cap partial states of each (packed query row, query head) with the
validity branch (M4.5 §0x02C): invalid (empty or inactive) slots are the identity, excluded
before any exponential.  Where MARK, it also sets the call's non-finite flag (FLAG, int32) on a
row whose LSE is NaN: the combine writes LSE last, so no launch of its own marks a split call.

A split call launches ``_split_at`` and ``_combine_at``: the same programs over one uint8
workspace and each field's byte offset (``WS + *_AT`` cast to the field's type), so the host
makes no per-field tensor view per call.

The spec arrives as constexpr arguments (``VISIBLE``, ``SCORE``, head counts and dims, scale),
as in ``prefill.py``; TS is the tuple of the spec's tensors with their strides and sizes.
"""
import triton
import triton.language as tl

from .numerics import _checked_lse, _checked_sum

CACHE_KINDS = {"contiguous": 0, "paged_dense": 1, "paged_csr": 2}


@triton.jit
def _tile_rows(tile, kv_h, KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, ONE_ROW: tl.constexpr, BLOCK_Q: tl.constexpr,
               G_PAD: tl.constexpr, GROUP: tl.constexpr):
    """A split program's rows (BLOCK_Q query rows x the G_PAD query heads of K/V head kv_h):
    (request b, query heads h, row_ok, the request's t_len, packed q_row, bottom-right q_pos)."""
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    if ONE_ROW:  # decode: tile = request b, its one row at the last position, packed row b
        b = tile
        g = rows
        row_ok = g < GROUP
        t_len = tl.load(KV_LENS + b)
        q_row = b
        q_pos = t_len - 1
    else:
        b = tl.load(TILE_REQ + tile)
        g = rows % G_PAD
        row0 = tl.load(QO_INDPTR + b)
        n_q = tl.load(QO_INDPTR + b + 1) - row0
        i = tl.load(TILE_ROW0 + tile) + rows // G_PAD  # query row within the request
        row_ok = (g < GROUP) & (i < n_q)
        t_len = tl.load(KV_LENS + b)
        q_row = row0 + i
        q_pos = (t_len - n_q + i)[:, None]  # bottom-right
    return b, kv_h * GROUP + g, row_ok, t_len, q_row, q_pos


@triton.jit
def _kv_rows(t, live, b, base, TABLE, s_tb, s_kp, s_kt, s_vp, s_vt, CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of K/V rows ``t`` of request b in the cache's storage."""
    if CACHE == 0:  # contiguous or ragged: base = the request's first row
        row = base + t
        k_off = row.to(tl.int64) * s_kt
        v_off = row.to(tl.int64) * s_vt
    else:
        if CACHE == 1:  # dense table: its rows are in request order (the plan gathered them)
            page = tl.load(TABLE + b * s_tb + t // PAGE_SIZE, mask=live, other=0)
        else:  # CSR: the request's pages start at kv_indptr[b] (= base)
            page = tl.load(TABLE + base + t // PAGE_SIZE, mask=live, other=0)
        k_off = page.to(tl.int64) * s_kp + (t % PAGE_SIZE) * s_kt
        v_off = page.to(tl.int64) * s_vp + (t % PAGE_SIZE) * s_vt
    return k_off, v_off


@triton.jit
def _decode_split(Q, K, V, P_O, P_M, P_L, P_VALID,
                  s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                  KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL, TS,
                  S_CAP, qk_scale, SPLIT_BOUNDS,
                  CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, ABI_MLU: tl.constexpr, BOUNDED: tl.constexpr,
                  ONE_ROW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
                  VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                  H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr,
                  D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    split = tl.program_id(0)
    tk = tl.program_id(1)
    tile = tk // H_KV
    kv_h = tk % H_KV
    b, h, row_ok, t_len, q_row, q_pos = _tile_rows(tile, kv_h, KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, ONE_ROW,
                                                   BLOCK_Q, G_PAD, GROUP)
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    q_off = q_row * s_qt + h * s_qh
    q = tl.load(Q + q_off[:, None] + offs_dk[None, :] * s_qd,
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    base = tl.load(BASE + b)
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_V_PAD], tl.float32)
    slot = tile * S_CAP + split
    if BOUNDED:  # the policy's [start, end) of this slot (within [0, t_len))
        lo = tl.load(SPLIT_BOUNDS + 2 * (b * S_CAP + split))
        hi = tl.load(SPLIT_BOUNDS + 2 * (b * S_CAP + split) + 1)
    for e in range(tl.load(ENTRY_PTR + slot), tl.load(ENTRY_PTR + slot + 1)):
        t = tl.load(BLOCKS + e) * BLOCK_N + tl.arange(0, BLOCK_N)
        if BOUNDED:
            live = (t >= lo) & (t < hi)
        else:
            live = t < t_len  # rows past the request's length are never read
        k_off, v_off = _kv_rows(t, live, b, base, TABLE, s_tb, s_kp, s_kt, s_vp, s_vt, CACHE, PAGE_SIZE)
        kt = tl.load(K + k_off[None, :] + kv_h * s_kh + offs_dk[:, None] * s_kd,
                     mask=live[None, :] & (offs_dk[:, None] < D_QK), other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if HAS_SCORE:
            s = SCORE(s * SCALE, b, h[:, None], q_pos, t[None, :], TS)
        keep = live[None, :] & row_ok[:, None]
        if tl.load(PARTIAL + e) != 0:
            keep = keep & VISIBLE(b, h[:, None], q_pos, t[None, :], TS)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(V + v_off[:, None] + kv_h * s_vh + offs_dv[None, :] * s_vd,
                     mask=live[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    l_i = _checked_sum(m_i, l_i)
    valid = (l_i > 0) | (l_i != l_i)  # NaN: a visible score was NaN or +inf; merged on, LSE NaN marks the row
    state = (q_row * H_Q + h) * S_CAP + split  # workspace [total_q, H_q, S_cap, ...]
    if ABI_MLU:  # (m, l, u): m in natural units, u unnormalized
        tl.store(P_M + state, m_i * 0.6931471805599453, mask=row_ok)
        tl.store(P_L + state, l_i, mask=row_ok)
        tl.store(P_O + state[:, None] * D_V + offs_dv[None, :], acc,
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    else:  # (LSE, O): O normalized, LSE natural; empty splits write LSE = -inf, O = 0
        l_safe = tl.where(valid, l_i, 1.0)
        tl.store(P_M + state, tl.where(valid, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf")),
                 mask=row_ok)
        tl.store(P_O + state[:, None] * D_V + offs_dv[None, :], (acc / l_safe[:, None]).to(P_O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(P_VALID + state, valid.to(tl.uint8), mask=row_ok)


@triton.jit
def _split_at(Q, K, V, WS, O_AT, M_AT, L_AT, VALID_AT,
              s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
              KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL, TS,
              S_CAP, qk_scale, SPLIT_BOUNDS,
              P_VEC: tl.constexpr, CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, ABI_MLU: tl.constexpr,
              BOUNDED: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
              G_PAD: tl.constexpr, VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr,
              SCALE: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr,
              D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """``_decode_split`` over the uint8 workspace WS, its fields at byte offsets *_AT (O in P_VEC)."""
    _decode_split(Q, K, V, (WS + O_AT).to(tl.pointer_type(P_VEC)), (WS + M_AT).to(tl.pointer_type(tl.float32)),
                  (WS + L_AT).to(tl.pointer_type(tl.float32)), WS + VALID_AT,
                  s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                  KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL, TS,
                  S_CAP, qk_scale, SPLIT_BOUNDS, CACHE, PAGE_SIZE, ABI_MLU, BOUNDED, ONE_ROW, BLOCK_Q, BLOCK_N,
                  G_PAD, VISIBLE, SCORE, HAS_SCORE, SCALE, H_Q, H_KV, GROUP, D_QK, D_V, D_QK_PAD, D_V_PAD,
                  DOT_PRECISION)


@triton.jit
def _combine(P_O, P_M, P_L, P_VALID, O, LSE, s_ot, s_oh, s_od, S_CAP, SINKS, FLAG, MARK,
             ABI_MLU: tl.constexpr, SPLITS_PAD: tl.constexpr, H_Q: tl.constexpr, D_V: tl.constexpr,
             D_V_PAD: tl.constexpr, HAS_SINK: tl.constexpr = False):
    """Merge the S_cap partial states of one (packed query row, query head), SPLITS_PAD slots at
    a time (one pass when S_cap <= SPLITS_PAD, every launch the untuned rule makes): each chunk
    moves the sums to the running maximum (a factor exp(-inf) = 0 while nothing was valid).
    HAS_SINK: the row's sink (SINKS [total_q * H_Q], natural units, ``_sink_rows``) joins once,
    after every split: one more term of the denominator with no value (attnc.compiler.sinks)."""
    rh = tl.program_id(0)
    row = rh // H_Q
    h = rh % H_Q
    offs_dv = tl.arange(0, D_V_PAD)
    m_ref = tl.max(tl.full([SPLITS_PAD], float("-inf"), tl.float32), 0)
    denom = tl.sum(tl.zeros([SPLITS_PAD], tl.float32), 0)
    numer = tl.zeros([D_V_PAD], tl.float32)
    poisoned = tl.sum(tl.zeros([SPLITS_PAD], tl.int32), 0) > 0  # a split saw a NaN or +inf visible score
    for c0 in range(0, S_CAP, SPLITS_PAD):
        sp = c0 + tl.arange(0, SPLITS_PAD)
        in_cap = sp < S_CAP
        state = rh * S_CAP + sp
        valid = (tl.load(P_VALID + state, mask=in_cap, other=0) != 0) & in_cap
        m = tl.load(P_M + state, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m_ref, tl.max(m, 0))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        rescale = tl.exp(m_ref - m_use)
        w = tl.where(valid, tl.exp(m - m_use), 0.0)
        part = tl.load(P_O + state[:, None] * D_V + offs_dv[None, :],
                       mask=valid[:, None] & (offs_dv[None, :] < D_V), other=0.0).to(tl.float32)
        if ABI_MLU:  # l = sum alpha_s l_s, u = sum alpha_s u_s
            l_s = tl.load(P_L + state, mask=valid, other=0.0)
            denom = denom * rescale + tl.sum(w * l_s, 0)
            marked = valid & ((m != m) | (m == float("inf")) | (l_s != l_s))
        else:  # O = sum exp(LSE_s - LSE) O_s
            denom = denom * rescale + tl.sum(w, 0)
            marked = valid & (m != m)
        poisoned = poisoned | (tl.max(marked.to(tl.int32), 0) > 0)
        numer = numer * rescale + tl.sum(w[:, None] * part, 0)
        m_ref = m_new
    if HAS_SINK:  # a row that saw nothing: O = 0, LSE = sink; -inf: no sink; NaN or +inf marks the row
        sink = tl.load(SINKS + rh)
        m_new = tl.maximum(m_ref, sink)
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        rescale = tl.exp(m_ref - m_use)
        denom = denom * rescale + tl.exp(sink - m_use)
        numer = numer * rescale
        poisoned = poisoned | (sink != sink) | (sink == float("inf"))
        m_ref = m_new
    any_valid = m_ref > float("-inf")
    m_ref = tl.where(any_valid, m_ref, 0.0)
    d_safe = tl.where(any_valid, denom, 1.0)
    out = tl.where(poisoned, float("nan"), tl.where(any_valid, numer / d_safe, 0.0))
    lse = _checked_lse(tl.where(poisoned, float("nan"), tl.where(any_valid, m_ref + tl.log(d_safe), float("-inf"))))
    out = tl.where(lse != lse, float("nan"), out)
    tl.store(O + row * s_ot + h * s_oh + offs_dv * s_od, out.to(O.dtype.element_ty), mask=offs_dv < D_V)
    tl.store(LSE + rh, lse)
    if MARK:  # (every program that finds a NaN row stores the same value: their order does not matter)
        tl.store(FLAG, 1, mask=lse != lse)


@triton.jit
def _combine_at(WS, O_AT, M_AT, L_AT, VALID_AT, O, LSE, s_ot, s_oh, s_od, S_CAP, SINKS, FLAG, MARK,
                P_VEC: tl.constexpr, ABI_MLU: tl.constexpr, SPLITS_PAD: tl.constexpr, H_Q: tl.constexpr,
                D_V: tl.constexpr, D_V_PAD: tl.constexpr, HAS_SINK: tl.constexpr = False):
    """``_combine`` over the uint8 workspace WS, its fields at byte offsets *_AT (O in P_VEC)."""
    _combine((WS + O_AT).to(tl.pointer_type(P_VEC)), (WS + M_AT).to(tl.pointer_type(tl.float32)),
             (WS + L_AT).to(tl.pointer_type(tl.float32)), WS + VALID_AT, O, LSE, s_ot, s_oh, s_od, S_CAP, SINKS,
             FLAG, MARK, ABI_MLU, SPLITS_PAD, H_Q, D_V, D_V_PAD, HAS_SINK)


@triton.jit
def _sink_rows(OUT, QO_INDPTR, TS, SINK: tl.constexpr, H_Q: tl.constexpr, H_PAD: tl.constexpr):
    """The sink of every packed query row and query head, OUT [total_q * H_Q] float32: request b
    (this program) writes SINK(b, h, TS) to its rows qo_indptr[b]:qo_indptr[b + 1]."""
    b = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    sink = SINK(b, h, TS) + tl.zeros([H_PAD], tl.float32)
    for r in range(tl.load(QO_INDPTR + b), tl.load(QO_INDPTR + b + 1)):
        tl.store(OUT + r * H_Q + h, sink, mask=h < H_Q)
