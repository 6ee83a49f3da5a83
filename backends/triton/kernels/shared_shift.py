"""FlashDecoding++'s guarded shared shift on the split-K/V path (M4.5 §0x09C), for specs with
``state = shared_shift(phi, lower, upper)``.

Four launches, none of them waiting for the host:

1. ``_shift_split``: the producer.  Every split accumulates ``n = sum exp(s - phi) v`` and
   ``l = sum exp(s - phi)`` in the one frame the spec fixes: no running max, no rescaling of
   the accumulator per K/V block.  A visible score with ``s - phi`` outside ``(lower, upper)``
   sets the split's guard byte.
2. ``_shift_combine``: the reducer adds the splits' ``n`` and ``l`` (no max over splits, no
   exponential per split: the combine cost the shared frame saves), writes O = n / l and
   LSE = phi + log l, and marks the (row, head) in ``need`` when a split's guard tripped.
3. ``_fallback_split``: the synchronized (m, l, u) producer (``split._decode_split``), run only
   by the programs whose query tile has a marked (row, head); the others exit after one load.
4. ``_fallback_combine``: ``split._combine`` over those states, only for marked (row, head)s:
   their O and LSE are overwritten with the exact (m, l, u) result.

The fallback reuses the shift's workspace (``n`` as ``u``, ``l``, ``valid``) and adds ``m``;
:func:`workspace_layout` lays all of it out.  The producer's walk over the cache (rows, pages,
the mask, the score program) is ``split._decode_split``'s, with the shared-frame update.
"""
import triton
import triton.language as tl

from .numerics import _checked_lse

from . import split

LOG2E = 1.4426950408889634


@triton.jit
def _shift_split(Q, K, V, P_N, P_L, P_VALID, P_GUARD,
                 s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                 KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL, TS,
                 S_CAP, qk_scale, phi2, lower2, upper2,
                 CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, P_F32: tl.constexpr,
                 ONE_ROW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
                 VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr,
                 D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One (split, query tile * K/V head) in the shared frame; ``phi2``, ``lower2``, ``upper2``
    are phi and the window in base-2 units (s * qk_scale is a base-2 logit).  ``P_F32``: p enters
    the P.V product in float32 (an f16 V could not hold exp(s - phi) up to e**64)."""
    split_id = tl.program_id(0)
    tk = tl.program_id(1)
    tile = tk // H_KV
    kv_h = tk % H_KV
    b, h, row_ok, t_len, q_row, q_pos = split._tile_rows(tile, kv_h, KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0,
                                                         ONE_ROW, BLOCK_Q, G_PAD, GROUP)
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    q_off = q_row * s_qt + h * s_qh
    q = tl.load(Q + q_off[:, None] + offs_dk[None, :] * s_qd,
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    base = tl.load(BASE + b)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    guard = tl.zeros([BLOCK_Q * G_PAD], tl.int32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_V_PAD], tl.float32)
    slot = tile * S_CAP + split_id
    for e in range(tl.load(ENTRY_PTR + slot), tl.load(ENTRY_PTR + slot + 1)):
        t = tl.load(BLOCKS + e) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = t < t_len
        k_off, v_off = split._kv_rows(t, live, b, base, TABLE, s_tb, s_kp, s_kt, s_vp, s_vt, CACHE, PAGE_SIZE)
        kt = tl.load(K + k_off[None, :] + kv_h * s_kh + offs_dk[:, None] * s_kd,
                     mask=live[None, :] & (offs_dk[:, None] < D_QK), other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if HAS_SCORE:
            s = SCORE(s * SCALE, b, h[:, None], q_pos, t[None, :], TS)
        keep = live[None, :] & row_ok[:, None]
        if tl.load(PARTIAL + e) != 0:
            keep = keep & VISIBLE(b, h[:, None], q_pos, t[None, :], TS)
        d = s * qk_scale - phi2  # s - phi, base 2
        outside = keep & ((d <= lower2) | (d >= upper2))
        guard = tl.maximum(guard, tl.max(outside.to(tl.int32), 1))
        # clamped to the window: a tripped split's sums stay finite, and are not used
        p = tl.where(keep, tl.math.exp2(tl.minimum(tl.maximum(d, lower2), upper2)), 0.0)
        l_i += tl.sum(p, 1)
        vt = tl.load(V + v_off[:, None] + kv_h * s_vh + offs_dv[None, :] * s_vd,
                     mask=live[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        if P_F32:
            acc = tl.dot(p, vt.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=DOT_PRECISION)
    valid = l_i > 0
    state = (q_row * H_Q + h) * S_CAP + split_id
    tl.store(P_L + state, l_i, mask=row_ok)
    tl.store(P_N + state[:, None] * D_V + offs_dv[None, :], acc, mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(P_VALID + state, valid.to(tl.uint8), mask=row_ok)
    tl.store(P_GUARD + state, guard.to(tl.uint8), mask=row_ok)


@triton.jit
def _shift_combine(P_N, P_L, P_VALID, P_GUARD, NEED, O, LSE, s_ot, s_oh, s_od, S_CAP, phi, SINKS, lower, upper,
                   SPLITS_PAD: tl.constexpr, H_Q: tl.constexpr, D_V: tl.constexpr, D_V_PAD: tl.constexpr,
                   HAS_SINK: tl.constexpr = False):
    """Add the S_cap shared-frame states of one (packed query row, query head): sums only.
    HAS_SINK: the row's sink (SINKS, natural units) is one more term exp(sink - phi) of l, under
    the guard: a sink with sink - phi outside (lower, upper) (NaN and +inf included; -inf is no
    sink) marks the row for the fallback, whose combine joins it exactly."""
    rh = tl.program_id(0)
    row = rh // H_Q
    h = rh % H_Q
    sp = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    in_cap = sp < S_CAP
    state = rh * S_CAP + sp
    valid = (tl.load(P_VALID + state, mask=in_cap, other=0) != 0) & in_cap
    tripped = tl.max(tl.load(P_GUARD + state, mask=valid, other=0).to(tl.int32), 0)
    l = tl.sum(tl.load(P_L + state, mask=valid, other=0.0), 0)
    n = tl.sum(tl.load(P_N + state[:, None] * D_V + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < D_V),
                       other=0.0), 0)
    if HAS_SINK:
        d = tl.load(SINKS + rh) - phi
        inside = (d > lower) & (d < upper)
        l = l + tl.where(inside, tl.exp(tl.where(inside, d, 0.0)), 0.0)  # noqa: E741
        tripped = tl.maximum(tripped, tl.where(inside | (d == float("-inf")), 0, 1))
    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    out = tl.where(seen, n / l_safe, 0.0)
    lse = _checked_lse(tl.where(seen, phi + tl.log(l_safe), float("-inf")))
    out = tl.where(lse != lse, float("nan"), out)
    tl.store(O + row * s_ot + h * s_oh + offs_dv * s_od, out.to(O.dtype.element_ty), mask=offs_dv < D_V)
    tl.store(LSE + rh, lse)
    tl.store(NEED + rh, tripped.to(tl.uint8))


@triton.jit
def _fallback_split(NEED, Q, K, V, P_O, P_M, P_L, P_VALID,
                    s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                    KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL, TS,
                    S_CAP, qk_scale,
                    CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, ABI_MLU: tl.constexpr,
                    ONE_ROW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
                    VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                    H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr,
                    D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr, D_V_PAD: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """``split._decode_split`` with (m, l, u) states, for a query tile some (row, head) of which
    the shift combine marked in NEED [total_q * H_Q]; every other program returns at once."""
    tk = tl.program_id(1)
    tile = tk // H_KV
    kv_h = tk % H_KV
    r = tl.arange(0, BLOCK_Q)
    g = tl.arange(0, G_PAD)
    if ONE_ROW:
        q_row = tile + r * 0
        ok = r < 1
    else:
        b = tl.load(TILE_REQ + tile)
        row0 = tl.load(QO_INDPTR + b)
        i = tl.load(TILE_ROW0 + tile) + r
        ok = i < tl.load(QO_INDPTR + b + 1) - row0
        q_row = row0 + i
    marked = tl.load(NEED + q_row[:, None] * H_Q + kv_h * GROUP + g[None, :],
                     mask=ok[:, None] & (g[None, :] < GROUP), other=0)
    if tl.max(tl.max(marked.to(tl.int32), 1), 0) != 0:
        split._decode_split(Q, K, V, P_O, P_M, P_L, P_VALID,
                            s_qt, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                            KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, ENTRY_PTR, BLOCKS, PARTIAL,
                            TS, S_CAP, qk_scale, KV_LENS,  # (no split bounds: the fast route's even splits)
                            CACHE, PAGE_SIZE, ABI_MLU, False, ONE_ROW, BLOCK_Q, BLOCK_N, G_PAD,
                            VISIBLE, SCORE, HAS_SCORE, SCALE, H_Q, H_KV, GROUP, D_QK, D_V, D_QK_PAD, D_V_PAD,
                            DOT_PRECISION)


@triton.jit
def _fallback_combine(NEED, P_O, P_M, P_L, P_VALID, O, LSE, s_ot, s_oh, s_od, S_CAP, SINKS,
                      ABI_MLU: tl.constexpr, SPLITS_PAD: tl.constexpr, H_Q: tl.constexpr, D_V: tl.constexpr,
                      D_V_PAD: tl.constexpr, HAS_SINK: tl.constexpr = False):
    """``split._combine`` of the (m, l, u) states, only where NEED marks the (row, head)."""
    if tl.load(NEED + tl.program_id(0)) != 0:
        split._combine(P_O, P_M, P_L, P_VALID, O, LSE, s_ot, s_oh, s_od, S_CAP, SINKS, LSE, 0, ABI_MLU, SPLITS_PAD,
                       H_Q, D_V, D_V_PAD, HAS_SINK)
