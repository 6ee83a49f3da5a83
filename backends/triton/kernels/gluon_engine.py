"""The Gluon engine (Hopper, sm_90): the prefill plan walked by a warp-specialized program.

One program per SM draws (query tile, head) jobs from a counter in ``_job``'s longest-first
order (SCHEDULE COUNTER; or one job per program, ONE_TILE).  One producer warp hands each job
over with its Q, and every computed K/V block of the row's merged block list (the Triton
kernel's ``merged_blocks`` arrays) with the block's index and PARTIAL flag, through STAGES
shared-memory stages behind mbarriers (TMA loads); CONSUMERS warpgroups (two; three on 192-row
tiles at head dims <= 64, FlashAttention-3's tile there), each with 64 of the tile's query rows,
run Q.K^T and P.V on the tensor cores (wgmma) and the online softmax (PINGPONG, two consumers:
in turns on the tensor cores, one's softmax under the other's MMAs).  PARTIAL blocks apply each
row's run of keys [KS, KE) where the plan has one (MASK_FROM_ROWS: masks reading tensors, such
as documents), else the spec's ``VISIBLE`` predicate; the spec's ``SCORE`` program is inlined as
in the Triton kernel.  The spec arrives as constexpr arguments, as in ``prefill.py``.

Any S_q and S_k: the K/V block across S_k takes the mask path with its keys past S_k hidden (its
TMA load reads the next head's first rows there: K's are masked, and ZERO_TAIL zeroes V's in
shared memory before P.V, so that a non-finite value there -- the caller's garbage -- cannot
reach this head's rows as 0 * inf); the Q tile across S_q computes the next head's rows and drops them, storing
its own rows and LSE under a mask instead of a TMA store (EVEN_Q / EVEN_K: neither crosses).

OVERLAP (the launch layer's choice, ``launch.gluon_overlap``): each consumer issues block i+1's
Q.K^T before block i's softmax, so that it runs on the tensor cores under it (FlashAttention-3's
intra-warpgroup overlap; the loop is peeled, so no MMA is wasted).  FP8: e4m3 Q, K and V^T with
per-head descales, Q.K^T and P.V on FP8 wgmma, P rounded to e4m3, O in the spec's dtype
(``_ws_consumer``; the V^T blocks past S_k are zero-filled by TMA).  P_PERM (FP8): K's rows arrive
in the order in which P's accumulator registers already are P.V's FP8 operand (``_key_cols``,
``_p_operand``), so that P changes layout without shuffles or byte permutes.  A spec's sink
(HAS_SINK, the generated ``SINK``): each consumer joins it once per row after the row's keys, on
the finished LSE (``_ws_rows_out``), so that the separable form and FP8 take it as they are.

Q_BUFS (the launch layer's choice, ``launch.gluon_q_buffers``): two Q buffers, each with its job
slot and barriers, where they cost no K/V stage, so that the next tile's Q and K/V load under this
tile's last blocks (kernel alone, one process: FP8 causal / full at d 128 +3% / +4%; bf16 causal and
full at d 128 and d 64 unchanged).

Q_BSHD, K_BSHD, V_BSHD, O_BSHD (the launch layer's choice, ``choice.gluon_layouts``): each of q, k,
v and O is a contiguous bhsd tensor (its TMA view [B * H * S, d], a head's rows one after another)
or a token-major one (bshd: [B, S, H, d] memory, transformers' transposed views, read and written
in place: the view [B * S, H * d], a head's rows h * d columns in, ``_tile_origin``).  The tiles
across S_q and S_k then read the next request's rows where bhsd ones read the next head's: the same
masking drops them, and O's rows past S_q are never stored (the masked store).

The counter is an int32 the launch layer keeps per device and stream, zero before a launch: the
program whose draw is the launch's last (the counter then holds the job count) sets it back to
zero, so a launch leaves it ready for the next one on its stream, CUDA-graph replays included.
"""
import triton.language as tl

from .gluon_sync import (HAS_GLUON, TensorDescriptor, _ws_claim_q, _ws_get, _ws_handover, _ws_put,  # noqa: F401
                         _ws_take_job, gluon)  # (HAS_GLUON, TensorDescriptor: the launch layer's)
from .numerics import SCORE_LIMIT_C
from .prefill import _job, _tile_of, _tile_origin

if HAS_GLUON:
    from .gluon_sync import (_tma_load, _tma_store, fence_async_shared, gl, mbarrier, tma, warpgroup_mma,
                             warpgroup_mma_wait)


ROWS = 64  # query rows per consumer warpgroup; the engine's query tile is CONSUMERS * ROWS (2, or 3 at d <= 64)
REGS = (168, 232, 24)  # maxnreg, then the consumer warpgroups' and the producer warp's registers (launch.gluon_regs)
SMEM = 232448  # bytes of shared memory a program may take on sm_90
ONE_TILE, COUNTER = tl.constexpr(0), tl.constexpr(1)
SCHEDULES = {"one_tile": 0, "counter": 1}
# SEPARABLE: the score program per cell (0), or its separable form (compiler/separable.py) with the
# column part evaluated per key, or (an affine one) per block
COLUMN_PER_KEY, COLUMN_PER_BLOCK = tl.constexpr(1), tl.constexpr(2)


@gluon.jit
def _key_cols(BLOCK_N: tl.constexpr, col_l: tl.constexpr, P_PERM: tl.constexpr):
    """The key (within its block) of each score column: c, or P_PERM sigma(c) -- within each 32
    keys, c = 16 a1 + 8 a0 + 2 q + b holds key 16 a1 + 4 q + 2 a0 + b (K's rows were loaded so,
    ``_ws_producer``), the order in which P's FP8 operand takes its columns without shuffles
    (``_p_operand``)."""
    c = gl.arange(0, BLOCK_N, col_l)
    if P_PERM:
        c = (c & ~31) | (c & 16) | (((c >> 1) & 3) << 2) | (((c >> 3) & 1) << 1) | (c & 1)
    return c


@gluon.jit
def _k_operand(k_smem, stage, BLOCK_N: tl.constexpr, P_PERM: tl.constexpr):
    """K's block in stage ``stage`` as Q.K^T's B operand, K^T [d, BLOCK_N] (P_PERM: the 5-d block
    TMA wrote, read as [BLOCK_N, d], its rows in ``_key_cols``' order)."""
    k = k_smem.index(stage)
    if P_PERM:
        k = k.reshape([BLOCK_N, k.shape[4]])
    return k.permute((1, 0))


@gluon.jit
def _ws_softmax(s, part, kb, ks, ke, m_i, l_i, b, h, q_pos, S_K, K_OFF, qk_scale, TS, MASK_FROM_ROWS: tl.constexpr,
                EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, col_l: tl.constexpr, VISIBLE: tl.constexpr,
                SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, s_descale,
                FP8: tl.constexpr, sep_scale=1.0, origin=0, col_step=0.0, SEPARABLE: tl.constexpr = 0,
                SCORE_COLUMN: tl.constexpr = None, P_PERM: tl.constexpr = False):
    """K/V block kb of the row's list on the scores s: the score program, the mask where the
    block is PARTIAL (part != 0): the predicate, or MASK_FROM_ROWS the rows' runs of keys
    [ks, ke); then the online-softmax update.  Unless EVEN_K (S_K a multiple of BLOCK_N), the
    block across S_K takes the mask path and hides its keys past S_K (the TMA load read the next
    head's first rows there).  Returns P, alpha (the accumulator's rescale), m and l.
    SEPARABLE (the score program's separable form, compiler/separable.py): the scores become the
    base-2 logits less the row part (the epilogue adds it to LSE): s * sep_scale + the column part
    times qk_scale, one FMA per cell.  COLUMN_PER_KEY: SCORE_COLUMN once per key of the block;
    COLUMN_PER_BLOCK: its steps from the block's middle key (col_step, once per job), its value
    there (shift) once per block, kept out of the cells: m is the max of s + shift."""
    if not EVEN_K:
        part = gl.where(kb * BLOCK_N + BLOCK_N > S_K, 1, part)
    if SEPARABLE == COLUMN_PER_BLOCK:
        shift = SCORE_COLUMN(b, h, K_OFF + kb * BLOCK_N + BLOCK_N // 2, origin, TS) * qk_scale
    else:
        shift = 0.0
    if HAS_SCORE or part != 0:
        k_idx = (kb * BLOCK_N + _key_cols(BLOCK_N, col_l, P_PERM))[None, :]
        k_pos = K_OFF + k_idx
        if SEPARABLE == COLUMN_PER_BLOCK:  # sep_scale: the form's factor, SCALE (and descales) and qk_scale
            s = s * sep_scale + col_step
        elif SEPARABLE:
            s = s * sep_scale + SCORE_COLUMN(b, h, k_pos, origin, TS) * qk_scale
        elif HAS_SCORE:
            if FP8:  # q.k of FP8 values: their descales first, so the score program sees q.k
                s = SCORE(s * (SCALE * s_descale), b, h, q_pos, k_pos, TS)
            else:
                s = SCORE(s * SCALE, b, h, q_pos, k_pos, TS)
        if part != 0:
            if MASK_FROM_ROWS:  # (a row's run of keys ends at S_K at most)
                s = gl.where((k_pos >= ks) & (k_pos < ke), s, float("-inf"))
            elif EVEN_K:
                s = gl.where(VISIBLE(b, h, q_pos, k_pos, TS), s, float("-inf"))
            else:
                s = gl.where(VISIBLE(b, h, q_pos, k_pos, TS) & (k_idx < S_K), s, float("-inf"))
    if SEPARABLE:  # (s is in base 2 already, less shift)
        m_new = gl.maximum(m_i, gl.max(s, 1) + shift)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_new = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    if SEPARABLE:
        p = gl.exp2(s - (m_new - shift)[:, None])
    else:
        p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _ws_separable(b, h, origin, TS, q_factor, job_scale, BLOCK_N: tl.constexpr, col_l: tl.constexpr,
                  SEPARABLE: tl.constexpr, SCORE_SCALE: tl.constexpr, SCORE_COLUMN: tl.constexpr,
                  P_PERM: tl.constexpr = False):
    """A job's constants of the score program's separable form (``_ws_softmax``) for the rows around
    ``origin``: (sep_scale, the form's factor on q.k in base 2 -- ``q_factor`` is SCALE, times q.k's
    descales on FP8 calls --, and col_step, COLUMN_PER_BLOCK's column part at its steps from a
    block's middle key); (1.0, 0.0) where the call does not take the form."""
    if SEPARABLE:
        sep_scale = SCORE_SCALE(b, h, TS) * q_factor * job_scale
        if SEPARABLE == COLUMN_PER_BLOCK:
            steps = origin - BLOCK_N // 2 + _key_cols(BLOCK_N, col_l, P_PERM)[None, :]
            col_step = SCORE_COLUMN(b, h, steps, origin, TS) * job_scale
        else:
            col_step = 0.0
    else:
        sep_scale = 1.0
        col_step = 0.0
    return sep_scale, col_step


@gluon.jit
def _ws_zero_v_tail(v_stage, keep, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Zero rows [keep, BLOCK_N) of a V block in shared memory, 16 rows at a time: the keys past
    S_k, whose rows hold another head's or request's values, or a cache's stale ones, which
    P = 0 would still turn into NaN where they are not finite.  Every consumer writes the same
    values; the fence orders the writes before the warpgroup's P.V reads them."""
    CH: tl.constexpr = 16
    layout: tl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for g in gl.static_range(BLOCK_N // CH):
        if g * CH + CH > keep:
            rows = v_stage.slice(g * CH, CH, dim=0)
            vals = rows.load(layout)
            r = g * CH + gl.arange(0, CH, gl.SliceLayout(1, layout))
            rows.store(gl.where((r < keep)[:, None], vals, gl.zeros_like(vals)))
    fence_async_shared()


@gluon.jit
def _ws_v_operand(v_stage, kb, S_K, BLOCK_N: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr,
                  ZERO_TAIL: tl.constexpr):
    """V's block as P.V's operand, once in shared memory: ZERO_TAIL, the block across S_k has its
    rows past S_k zeroed first (``_ws_zero_v_tail``); FP8, V^T's block [D, BLOCK_N] read as
    [BLOCK_N, D], K-major (its columns past S_k were zero-filled by TMA)."""
    if FP8:
        v_op = v_stage.permute((1, 0))
    else:
        if ZERO_TAIL:
            if kb * BLOCK_N + BLOCK_N > S_K:
                _ws_zero_v_tail(v_stage, S_K - kb * BLOCK_N, BLOCK_N, D)
        v_op = v_stage
    return v_op


@gluon.jit
def _p_operand(p, op_dtype: tl.constexpr, p_layout: tl.constexpr, ROWS_: tl.constexpr, BLOCK_N: tl.constexpr,
               P_PERM: tl.constexpr):
    """P rounded to P.V's operand type in its operand layout.  P_PERM (FP8): within each 32 keys, the
    columns relabelled so that every thread keeps the values it holds (its accumulator columns
    2q, 2q + 1, 8 + 2q, ... become the operand's 4q .. 4q + 3, 16 + 4q ..): no shuffles, V^T's
    columns carry the same relabelling (``attnc.fp8``)."""
    x = p.to(op_dtype)
    if P_PERM:
        x = x.reshape([ROWS_, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([ROWS_, BLOCK_N])
    return gl.convert_layout(x, p_layout)


@gluon.jit
def _ws_pv(s, acc, m_i, l_i, part, kb, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale, v_stage, v_bar,
           phase, op_dtype: tl.constexpr, MASK_FROM_ROWS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
           col_l: tl.constexpr, orow_l: tl.constexpr, p_layout: tl.constexpr, VISIBLE: tl.constexpr,
           SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, FP8: tl.constexpr,
           D: tl.constexpr, ZERO_TAIL: tl.constexpr, sep_scale=1.0, origin=0, col_step=0.0,
           SEPARABLE: tl.constexpr = 0, SCORE_COLUMN: tl.constexpr = None, P_PERM: tl.constexpr = False):
    """Block kb's softmax on its scores s, the accumulator's rescale, and its P.V issued on the
    tensor cores once V is in: returns (P.V's pending accumulator, m, l)."""
    p, alpha, m_i, l_i = _ws_softmax(s, part, kb, ks, ke, m_i, l_i, b, h, q_pos, S_K, K_OFF, job_scale, TS,
                                     MASK_FROM_ROWS, EVEN_K, BLOCK_N, col_l, VISIBLE, SCORE, HAS_SCORE, SCALE,
                                     s_descale, FP8, sep_scale, origin, col_step, SEPARABLE, SCORE_COLUMN, P_PERM)
    acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
    mbarrier.wait(v_bar, phase)
    v_op = _ws_v_operand(v_stage, kb, S_K, BLOCK_N, D, FP8, ZERO_TAIL)
    p_op = _p_operand(p, op_dtype, p_layout, p.shape[0], BLOCK_N, P_PERM)
    acc = warpgroup_mma(p_op, v_op, acc, is_async=True)
    return acc, m_i, l_i


@gluon.jit
def _ws_row_totals(m_i, l_i):
    """A row's divisor for O and its LSE (natural log, not yet masked) from its running max m (base 2) and sum
    l, and whether it saw anything: a row that saw nothing (l = 0) divides by 1 (O = 0) and gets LSE -inf from
    its caller; l NaN (a visible NaN or +inf score) stays NaN in LSE, marking the row, and so do the rows
    ``numerics._checked_sum`` marks (m or l +inf, l = 0 under a finite m but 0).  Returns (l_safe, seen, lse)."""
    finite = (m_i != 0.0) & (m_i > float("-inf")) & (m_i < float("inf"))
    l_i = gl.where((m_i == float("inf")) | (l_i == float("inf")) | ((l_i == 0.0) & finite), float("nan"), l_i)
    seen = (l_i > 0) | (l_i != l_i)
    l_safe = gl.where(seen, l_i, 1.0)
    return l_safe, seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453


@gluon.jit
def _ws_lse(lse_out, seen, b, h, positions, origin, TS, SEPARABLE: tl.constexpr, SCORE_ROW: tl.constexpr):
    """A row's LSE as stored: SEPARABLE, the score program's row part at the rows' ``positions``
    added (the softmax left it out); -inf for a row that saw nothing (``_ws_row_totals``)."""
    if SEPARABLE:
        lse_out = lse_out + SCORE_ROW(b, h, positions, origin, TS)
    return gl.where(seen, lse_out, float("-inf"))


@gluon.jit
def _ws_rows_out(m_i, l_i, b, h, positions, origin, TS, SEPARABLE: tl.constexpr, SCORE_ROW: tl.constexpr,
                 HAS_SINK: tl.constexpr, SINK: tl.constexpr):
    """The rows' divisor for O and their LSE as stored (``_ws_row_totals``, ``_ws_lse``).  HAS_SINK:
    the spec's sink ``SINK(b, h, TS)`` (natural units) joined once per row as one more term of its
    denominator with no value (attnc.compiler.sinks), on the finished LSE, so in any frame of the
    scores (the separable form's included): LSE' = log(e^LSE + e^sink), O scaled by e^(LSE - LSE')
    through the divisor.  A row that saw nothing gets O = 0 and LSE = sink (both -inf: O = 0, LSE -inf); a NaN or
    +inf sink, a row already NaN or an LSE of 2^30 or more in magnitude make O and LSE NaN (the row is marked)."""
    l_safe, seen, lse = _ws_row_totals(m_i, l_i)
    lse = _ws_lse(lse, seen, b, h, positions, origin, TS, SEPARABLE, SCORE_ROW)
    if HAS_SINK:
        sink = SINK(b, h, TS)
        top = gl.maximum(lse, sink)
        top = gl.where(top == float("-inf"), 0.0, top)
        kept = gl.exp2((lse - top) * 1.4426950408889634)
        total = kept + gl.exp2((sink - top) * 1.4426950408889634)
        l_safe = l_safe / gl.where(total == 0.0, 0.0, kept / total)  # (factor 0: divisor inf, O = acc * 0)
        lse = top + gl.log2(total) * 0.6931471805599453
    far = (gl.abs(lse) >= SCORE_LIMIT_C) & (lse > float("-inf"))  # (as numerics._checked_lse)
    return gl.where(far, float("nan"), l_safe), gl.where(far, float("nan"), lse)


@gluon.jit
def _ws_job(t, BH, Q_TILES, ORDER, PLAN_B, PLAN_H, M_CSR, HEAD_GROUP: tl.constexpr, H_Q: tl.constexpr):
    """The launch's t-th job (``_job``'s order): its query tile, b * H_q + h, and its range
    [lo, hi) of the plan's merged block list."""
    rank, bh = _job(t, BH, Q_TILES, HEAD_GROUP)
    pid_m, b, h, row = _tile_of(rank, bh, ORDER, PLAN_B, PLAN_H, Q_TILES, H_Q)
    return pid_m, bh, gl.load(M_CSR + row), gl.load(M_CSR + row + 1)


@gluon.jit
def _ws_finish(s, acc, m_i, l_i, c, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale, v_smem, blk_smem, bars,
               op_dtype: tl.constexpr, MASK_FROM_ROWS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, STAGES: tl.constexpr, col_l: tl.constexpr, orow_l: tl.constexpr,
               p_layout: tl.constexpr, VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr,
               SCALE: tl.constexpr, FP8: tl.constexpr, ZERO_TAIL: tl.constexpr, sep_scale, origin, col_step,
               SEPARABLE: tl.constexpr, SCORE_COLUMN: tl.constexpr, P_PERM: tl.constexpr = False):
    """The c-th block, its scores s done: its index and flag, K's stage released, the softmax
    and P.V (``_ws_pv``) waited for, V's stage released.  Returns (acc, m, l)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    stage = c % STAGES
    kb = _ws_get(blk_smem.index(stage), 0, 2)
    part = _ws_get(blk_smem.index(stage), 1, 2)
    mbarrier.arrive(k_empty.index(stage), count=1)
    acc, m_i, l_i = _ws_pv(s, acc, m_i, l_i, part, kb, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale,
                           v_smem.index(stage), v_ready.index(stage), (c // STAGES) & 1, op_dtype, MASK_FROM_ROWS,
                           EVEN_K, BLOCK_N, col_l, orow_l, p_layout, VISIBLE, SCORE, HAS_SCORE, SCALE, FP8, D,
                           ZERO_TAIL, sep_scale, origin, col_step, SEPARABLE, SCORE_COLUMN, P_PERM)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_blocks(q, k_smem, v_smem, blk_smem, bars, lo, hi, c, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale,
               MASK_FROM_ROWS: tl.constexpr, EVEN_K: tl.constexpr, ROWS_: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, STAGES: tl.constexpr, VISIBLE: tl.constexpr, SCORE: tl.constexpr,
               HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, FP8: tl.constexpr, OVERLAP: tl.constexpr,
               ZERO_TAIL: tl.constexpr, PINGPONG: tl.constexpr = False, half=0, tc=0, sep_scale=1.0, origin=0,
               col_step=0.0, SEPARABLE: tl.constexpr = 0, SCORE_COLUMN: tl.constexpr = None,
               P_PERM: tl.constexpr = False):
    """One consumer's rows of a job over blocks [lo, hi) of its list, as the producer hands them
    over (``c``: the blocks this program consumed before, the K/V ring's stage and phase):
    returns (the unnormalized O accumulator, m, l, c).  OVERLAP: block i+1's Q.K^T runs on the
    tensor cores under block i's softmax (the loop is peeled); ZERO_TAIL: the block across S_K
    has V's rows past S_K zeroed before P.V (``_ws_v_operand``)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    MMA_K: tl.constexpr = 32 if FP8 else 16  # the wgmma instruction's depth: 32 bytes of operands
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, MMA_K])
    p_layout: tl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: tl.constexpr = gl.SliceLayout(1, o_layout)
    s0 = gl.zeros([ROWS_, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS_], float("-inf"), gl.float32, row_l)
    l_i = gl.full([ROWS_], 0.0, gl.float32, row_l)
    acc = gl.zeros([ROWS_, D], gl.float32, o_layout)
    if PINGPONG:  # FlashAttention-3's schedule: block i's Q.K^T and block i-1's P.V issued back to back,
        # in turns with the other warpgroup (``turns``), then block i's softmax under both
        mine = turns.index(half)
        other = turns.index(1 - half)
        if hi > lo:
            stage = c % STAGES
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            mbarrier.wait(mine, tc & 1)
            s = warpgroup_mma(q, _k_operand(k_smem, stage, BLOCK_N, P_PERM), s0, use_acc=False, is_async=True)
            mbarrier.arrive(other, count=1)
            tc += 1
            s = warpgroup_mma_wait(0, deps=(s, ))
            kb = _ws_get(blk_smem.index(stage), 0, 2)
            part = _ws_get(blk_smem.index(stage), 1, 2)
            mbarrier.arrive(k_empty.index(stage), count=1)
            p, alpha, m_i, l_i = _ws_softmax(s, part, kb, ks, ke, m_i, l_i, b, h, q_pos, S_K, K_OFF, job_scale, TS,
                                             MASK_FROM_ROWS, EVEN_K, BLOCK_N, col_l, VISIBLE, SCORE, HAS_SCORE,
                                             SCALE, s_descale, FP8, sep_scale, origin, col_step, SEPARABLE,
                                             SCORE_COLUMN, P_PERM)
            p_op = _p_operand(p, q.dtype, p_layout, ROWS_, BLOCK_N, P_PERM)
            pkb = kb
            pstage = stage
            c += 1
            for i in range(lo + 1, hi):
                stage = c % STAGES
                mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
                mbarrier.wait(v_ready.index(pstage), ((c - 1) // STAGES) & 1)
                v_op = _ws_v_operand(v_smem.index(pstage), pkb, S_K, BLOCK_N, D, FP8, ZERO_TAIL)
                mbarrier.wait(mine, tc & 1)
                s = warpgroup_mma(q, _k_operand(k_smem, stage, BLOCK_N, P_PERM), s0, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_op, acc * gl.convert_layout(alpha, orow_l)[:, None], is_async=True)
                mbarrier.arrive(other, count=1)
                tc += 1
                s = warpgroup_mma_wait(1, deps=(s, ))
                kb = _ws_get(blk_smem.index(stage), 0, 2)
                part = _ws_get(blk_smem.index(stage), 1, 2)
                mbarrier.arrive(k_empty.index(stage), count=1)
                p, alpha, m_i, l_i = _ws_softmax(s, part, kb, ks, ke, m_i, l_i, b, h, q_pos, S_K, K_OFF, job_scale,
                                                 TS, MASK_FROM_ROWS, EVEN_K, BLOCK_N, col_l, VISIBLE, SCORE,
                                                 HAS_SCORE, SCALE, s_descale, FP8, sep_scale, origin, col_step,
                                                 SEPARABLE, SCORE_COLUMN, P_PERM)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(pstage), count=1)
                p_op = _p_operand(p, q.dtype, p_layout, ROWS_, BLOCK_N, P_PERM)
                pkb = kb
                pstage = stage
                c += 1
            mbarrier.wait(v_ready.index(pstage), ((c - 1) // STAGES) & 1)
            v_op = _ws_v_operand(v_smem.index(pstage), pkb, S_K, BLOCK_N, D, FP8, ZERO_TAIL)
            mbarrier.wait(mine, tc & 1)
            acc = warpgroup_mma(p_op, v_op, acc * gl.convert_layout(alpha, orow_l)[:, None], is_async=True)
            mbarrier.arrive(other, count=1)
            tc += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(pstage), count=1)
    elif OVERLAP:  # block i+1's Q.K^T runs on the tensor cores under block i's softmax
        if hi > lo:
            stage = c % STAGES
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            s = warpgroup_mma(q, _k_operand(k_smem, stage, BLOCK_N, P_PERM), s0, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            for i in range(lo, hi - 1):
                stage = c % STAGES
                phase = (c // STAGES) & 1
                kb = _ws_get(blk_smem.index(stage), 0, 2)
                part = _ws_get(blk_smem.index(stage), 1, 2)
                mbarrier.arrive(k_empty.index(stage), count=1)
                nstage = (c + 1) % STAGES
                mbarrier.wait(k_ready.index(nstage), ((c + 1) // STAGES) & 1)
                s_next = warpgroup_mma(q, _k_operand(k_smem, nstage, BLOCK_N, P_PERM), s0, use_acc=False, is_async=True)
                acc, m_i, l_i = _ws_pv(s, acc, m_i, l_i, part, kb, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS,
                                       s_descale, v_smem.index(stage), v_ready.index(stage), phase, q.dtype,
                                       MASK_FROM_ROWS, EVEN_K, BLOCK_N, col_l, orow_l, p_layout, VISIBLE, SCORE,
                                       HAS_SCORE, SCALE, FP8, D, ZERO_TAIL, sep_scale, origin, col_step,
                                       SEPARABLE, SCORE_COLUMN, P_PERM)
                acc, s = warpgroup_mma_wait(0, deps=(acc, s_next))
                mbarrier.arrive(v_empty.index(stage), count=1)
                c += 1
            acc, m_i, l_i = _ws_finish(s, acc, m_i, l_i, c, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale,
                                       v_smem, blk_smem, bars, q.dtype, MASK_FROM_ROWS, EVEN_K, BLOCK_N, D, STAGES,
                                       col_l, orow_l, p_layout, VISIBLE, SCORE, HAS_SCORE, SCALE, FP8, ZERO_TAIL,
                                       sep_scale, origin, col_step, SEPARABLE, SCORE_COLUMN, P_PERM)
            c += 1
    else:
        for i in range(lo, hi):
            stage = c % STAGES
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            s = warpgroup_mma(q, _k_operand(k_smem, stage, BLOCK_N, P_PERM), s0, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            acc, m_i, l_i = _ws_finish(s, acc, m_i, l_i, c, ks, ke, b, h, q_pos, S_K, K_OFF, job_scale, TS, s_descale,
                                       v_smem, blk_smem, bars, q.dtype, MASK_FROM_ROWS, EVEN_K, BLOCK_N, D, STAGES,
                                       col_l, orow_l, p_layout, VISIBLE, SCORE, HAS_SCORE, SCALE, FP8, ZERO_TAIL,
                                       sep_scale, origin, col_step, SEPARABLE, SCORE_COLUMN, P_PERM)
            c += 1
    return acc, m_i, l_i, c, tc


@gluon.jit
def _ws_consumer(half, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK, DV,
                 S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                 MASK_FROM_ROWS: tl.constexpr,
                 EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, ROWS_: tl.constexpr,
                 BLOCK_N: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr,
                 VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
                 OVERLAP: tl.constexpr, ZERO_TAIL: tl.constexpr, PINGPONG: tl.constexpr,
                 SEPARABLE: tl.constexpr = 0, SCORE_SCALE: tl.constexpr = None, SCORE_ROW: tl.constexpr = None,
                 SCORE_COLUMN: tl.constexpr = None, CONSUMERS: tl.constexpr = 2,
                 P_PERM: tl.constexpr = False, Q_BUFS: tl.constexpr = 1, HAS_SINK: tl.constexpr = False,
                 SINK: tl.constexpr = None, O_BSHD: tl.constexpr = False):
    """Rows [half * ROWS_, + ROWS_) of each tile the producer hands over: every block of the
    tile's list, then O (through shared memory and a TMA store) and LSE.  The producer hands
    each job (t, query tile, block range) over with its Q, and each block's index and PARTIAL
    flag with its K, so that the consumers load nothing from the plan.  ``c`` counts the blocks
    this program has consumed: the K/V ring's stage and phase; ``jc`` its tiles: Q's buffer
    (of Q_BUFS, each with its job slot and barriers) and phase.
    Unless EVEN_Q, the rows of the tile across S_Q are stored from registers under a mask (a TMA
    store would write the next head's first rows); its Q rows past S_Q are the next head's,
    computed and dropped.  FP8: Q, K and V hold float8 e4m3 values with per-head descales (DQ
    [B * H_q], DK and DV [B * H_kv]); V arrives transposed ([D, BLOCK_N] blocks, K-major as FP8
    wgmma needs it), P is rounded to e4m3 for P.V, and O is written in O's dtype.  SEPARABLE: the
    score program's separable form (``_ws_softmax``), its parts reading positions from an origin
    in the middle of this half's rows (compiler/separable.py: ORIGIN_ROWS), the row part added to
    LSE.  HAS_SINK: the spec's sink joins each row once, after its keys (``_ws_rows_out``).  O_BSHD:
    O is token-major ([B, S, H_q, D] memory, rows H_q * D apart: ``_tile_origin``)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    MMA_K: tl.constexpr = 32 if FP8 else 16
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, MMA_K])
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: tl.constexpr = gl.SliceLayout(1, o_layout)
    o = o_smem.index(half)
    n_jobs = Q_TILES * BH
    c = 0
    jc = 0
    tc = 0
    t = _ws_take_job(job_smem, q_ready, jc, Q_BUFS)
    while t < n_jobs:
        buf = jc % Q_BUFS
        q = q_smem.index(buf * CONSUMERS + half)
        pid_m = _ws_get(job_smem.index(buf), 1, 4)
        lo = _ws_get(job_smem.index(buf), 2, 4)
        hi = _ws_get(job_smem.index(buf), 3, 4)
        bh = _job(t, BH, Q_TILES, HEAD_GROUP)[1]
        b = bh // H_Q
        h = bh % H_Q
        q_tile0 = pid_m * (CONSUMERS * ROWS_)
        rows = q_tile0 + half * ROWS_ + gl.arange(0, ROWS_, row_l)
        q_pos = (Q_OFF + rows)[:, None]
        if MASK_FROM_ROWS:  # the rows' runs of keys, for the tile's PARTIAL blocks
            plane = gl.where(PLAN_B > 1, b, 0) * PLAN_H + gl.where(PLAN_H > 1, h, 0)
            if EVEN_Q:
                ks = gl.load(KS + plane * S_Q + rows)[:, None]
                ke = gl.load(KE + plane * S_Q + rows)[:, None]
            else:
                ks = gl.load(KS + plane * S_Q + rows, mask=rows < S_Q, other=0)[:, None]
                ke = gl.load(KE + plane * S_Q + rows, mask=rows < S_Q, other=0)[:, None]
        else:
            ks = 0
            ke = 0
        if FP8:  # the job's descales: q.k's into the softmax scale (or the score), V's into O
            kvh = b * H_KV + h // GROUP
            s_descale = gl.load(DQ + bh) * gl.load(DK + kvh)
            job_scale = qk_scale if HAS_SCORE else qk_scale * s_descale
            v_descale = gl.load(DV + kvh)
        else:
            s_descale = 1.0
            job_scale = qk_scale
            v_descale = 1.0
        origin = Q_OFF + q_tile0 + half * ROWS_ + ROWS_ // 2
        sep_scale, col_step = _ws_separable(b, h, origin, TS, SCALE * s_descale, job_scale, BLOCK_N, col_l,
                                            SEPARABLE, SCORE_SCALE, SCORE_COLUMN, P_PERM)
        acc, m_i, l_i, c, tc = _ws_blocks(q, k_smem, v_smem, blk_smem, bars, lo, hi, c, ks, ke, b, h, q_pos, S_K,
                                          K_OFF, job_scale, TS, s_descale, MASK_FROM_ROWS, EVEN_K, ROWS_, BLOCK_N, D,
                                          STAGES, VISIBLE, SCORE, HAS_SCORE, SCALE, FP8, OVERLAP, ZERO_TAIL,
                                          PINGPONG, half, tc, sep_scale, origin, col_step, SEPARABLE,
                                          SCORE_COLUMN, P_PERM)
        mbarrier.arrive(q_empty.index(buf), count=1)  # this half's Q.K^T are done: the buffer may take a later Q
        l_safe, lse_out = _ws_rows_out(m_i, l_i, b, h, Q_OFF + rows, origin, TS, SEPARABLE, SCORE_ROW, HAS_SINK, SINK)
        if FP8:
            out = acc * gl.convert_layout(v_descale / l_safe, orow_l)[:, None]
        else:
            out = acc / gl.convert_layout(l_safe, orow_l)[:, None]  # rows that saw nothing: acc = 0, O = 0
        row0 = q_tile0 + half * ROWS_
        o_row, o_col = _tile_origin(bh, S_Q, H_Q, D, O_BSHD)
        if EVEN_Q or row0 + ROWS_ <= S_Q:  # (every row is this head's: in bshd, no other request's row is written)
            tma.store_wait(0)  # the last tile's O has left shared memory (o may be Q's own stage)
            o.store(out.to(o_smem.dtype))
            fence_async_shared()
            _tma_store(o_desc, [o_row + row0, o_col], o)
        else:
            o_rows = row0 + gl.arange(0, ROWS_, orow_l)
            o_cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
            if O_BSHD:  # (rows H_q * D apart, the head's columns o_col in)
                o_ptr = O + (o_row + o_rows)[:, None] * (H_Q * D) + o_col + o_cols[None, :]
            else:
                o_ptr = O + (o_row + o_rows)[:, None] * D + o_cols[None, :]
            gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(o_rows < S_Q)[:, None])
        if EVEN_Q:
            gl.store(LSE + bh * S_Q + rows, lse_out)
        else:
            gl.store(LSE + bh * S_Q + rows, lse_out, mask=rows < S_Q)
        if MARK:  # a NaN row sets the call's non-finite flag (every finder stores the same value)
            if gl.max(((lse_out != lse_out) & (rows < S_Q)).to(gl.int32), axis=0) > 0:
                gl.store(FLAG, 1)
        jc += 1
        t = _ws_take_job(job_smem, q_ready, jc, Q_BUFS)
    tma.store_wait(0)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, job_smem, blk_smem, bars, COUNTER_PTR, ORDER,
                 M_CSR, M_IDX, M_FLAG, S_Q, S_K, PLAN_B, PLAN_H, Q_TILES, BH, ROWS_: tl.constexpr,
                 BLOCK_N: tl.constexpr, STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, SCHEDULE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr,
                 CONSUMERS: tl.constexpr = 2, P_PERM: tl.constexpr = False, Q_BUFS: tl.constexpr = 1,
                 Q_BSHD: tl.constexpr = False, K_BSHD: tl.constexpr = False, V_BSHD: tl.constexpr = False):
    """For each of the program's jobs: once every consumer is done with the Q that last used its
    buffer (of Q_BUFS: with two, the next tile's Q and K/V load under this tile's last blocks,
    and the consumers need not meet at tile boundaries), the job and its Q, then K and V of
    every block of the tile's list, each into a stage every consumer has released, with the
    block's index and PARTIAL flag.  The next job (SCHEDULE) and its
    plan lookups are fetched while this one's K/V load; a job past the last tells the consumers
    to stop.  The launch's last draw from the counter resets it to zero (module docstring).
    Q_BSHD, K_BSHD, V_BSHD: that tensor is token-major (``_tile_origin``; not with FP8)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    n_jobs = Q_TILES * BH
    c = 0
    jc = 0
    t = gl.program_id(0)  # the grid never exceeds the jobs
    pid_m, bh, lo, hi = _ws_job(t, BH, Q_TILES, ORDER, PLAN_B, PLAN_H, M_CSR, HEAD_GROUP, H_Q)
    while t < n_jobs:
        if SCHEDULE == COUNTER:
            drawn = gl.atomic_add(COUNTER_PTR, 1)
            if drawn == n_jobs - 1:  # every program's draws add up to n_jobs: this one is the last
                gl.atomic_add(COUNTER_PTR, -n_jobs)  # (the counter holds n_jobs: back to zero)
            nxt = gl.num_programs(0) + drawn
        else:
            nxt = n_jobs
        buf = _ws_claim_q(q_empty, jc, Q_BUFS)
        _ws_put(job_smem.index(buf), (t, pid_m, lo, hi), 4)
        q_row, q_col = _tile_origin(bh, S_Q, H_Q, q_desc.block_type.shape[1], Q_BSHD)
        q_row0 = q_row + pid_m * (CONSUMERS * ROWS_)
        mbarrier.expect(q_ready.index(buf), CONSUMERS * q_desc.block_type.nbytes)
        for w in gl.static_range(CONSUMERS):
            _tma_load(q_desc, [q_row0 + w * ROWS_, q_col], q_ready.index(buf), q_smem.index(buf * CONSUMERS + w))
        kvh = (bh // H_Q) * H_KV + (bh % H_Q) // GROUP
        kv_row0, k_col = _tile_origin(kvh, S_K, H_KV, k_desc.block_type.shape[1], K_BSHD)
        v_row0, v_col = _tile_origin(kvh, S_K, H_KV, D, V_BSHD)
        for i in range(lo, hi):
            stage = c % STAGES
            phase = (c // STAGES) & 1
            kb = gl.load(M_IDX + i)
            part = gl.load(M_FLAG + i)
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            _ws_put(blk_smem.index(stage), (kb, part), 2)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            if P_PERM:  # (K's rows 16 at a time in _key_cols' order: a 5-d box, [BLOCK_N / 16, 2, 4, 2, d])
                _tma_load(k_desc, [(kv_row0 + kb * BLOCK_N) // 16, 0, 0, 0, 0], k_ready.index(stage),
                          k_smem.index(stage))
            else:
                _tma_load(k_desc, [kv_row0 + kb * BLOCK_N, k_col], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if FP8:  # V^T: the head's D rows, the block's BLOCK_N columns (past S_K: zero-filled)
                _tma_load(v_desc, [kvh * D, kb * BLOCK_N], v_ready.index(stage), v_smem.index(stage))
            else:
                _tma_load(v_desc, [v_row0 + kb * BLOCK_N, v_col], v_ready.index(stage), v_smem.index(stage))
            c += 1
        jc += 1
        t = nxt
        pid_m, bh, lo, hi = _ws_job(gl.minimum(t, n_jobs - 1), BH, Q_TILES, ORDER, PLAN_B, PLAN_H, M_CSR,
                                    HEAD_GROUP, H_Q)
    buf = _ws_claim_q(q_empty, jc, Q_BUFS)  # "none left", once the consumers are done with that buffer's last Q
    _ws_put(job_smem.index(buf), (t, 0, 0, 0), 4)
    mbarrier.arrive(q_ready.index(buf), count=1)



@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, O, LSE, COUNTER_PTR, ORDER, M_CSR, M_IDX, M_FLAG, KS, KE, DQ, DK, DV, TS,
                 S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, qk_scale, BH, FLAG, MARK,
                 MASK_FROM_ROWS: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, ROWS_: tl.constexpr,
                 BLOCK_N: tl.constexpr, D: tl.constexpr, SAME_D: tl.constexpr,
                 STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                 PRODUCER_REGS: tl.constexpr, SCHEDULE: tl.constexpr,
                 VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                 H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
                 OVERLAP: tl.constexpr, ZERO_TAIL: tl.constexpr, PINGPONG: tl.constexpr,
                 SEPARABLE: tl.constexpr = 0, SCORE_SCALE: tl.constexpr = None, SCORE_ROW: tl.constexpr = None,
                 SCORE_COLUMN: tl.constexpr = None, CONSUMERS: tl.constexpr = 2,
                 P_PERM: tl.constexpr = False, Q_BUFS: tl.constexpr = 1, HAS_SINK: tl.constexpr = False,
                 SINK: tl.constexpr = None, Q_BSHD: tl.constexpr = False, K_BSHD: tl.constexpr = False,
                 V_BSHD: tl.constexpr = False, O_BSHD: tl.constexpr = False):
    """Jobs (query tile of CONSUMERS * ROWS_ rows, request * query head) in ``_job``'s order: one per
    program (SCHEDULE == ONE_TILE), or one program per SM looping over jobs drawn from the
    counter at COUNTER_PTR (SCHEDULE == COUNTER) with O staged in its own buffers, so that the
    next tile's Q and K/V loads run under this tile's last blocks and epilogue.  KS, KE: each
    query row's run of keys (MASK_FROM_ROWS), [PLAN_B, PLAN_H, S_Q].  D is V's (and O's) head
    dim; Q and K's may differ (SAME_D false: d_qk != d_v, O has its own buffers).  FP8: float8
    e4m3 Q, K and V^T (v_desc over [B * H_kv * D, S_k]) with descales DQ, DK, DV (``_ws_consumer``);
    O has its own buffers in O's dtype.  SEPARABLE: the score program's separable form, SCORE_SCALE,
    SCORE_ROW and SCORE_COLUMN its parts (``_ws_softmax``; the launch layer decides per call).
    Q_BUFS: Q's buffers (``_ws_producer``; two where they cost no K/V stage: ``launch.gluon_q_buffers``).
    HAS_SINK: the spec's sink ``SINK`` joins every row once (``_ws_rows_out``; not on a block of a
    larger call, whose merge adds it).  MARK: a row whose LSE is NaN (a visible NaN or +inf score)
    sets the call's non-finite flag FLAG (int32), so no launch of its own marks the call.
    Q_BSHD, K_BSHD, V_BSHD, O_BSHD: that tensor is token-major (module docstring; q_desc, k_desc,
    v_desc and o_desc then view [B * S, H * d] with [rows, d] boxes)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    if SCHEDULE == ONE_TILE and SAME_D and not FP8:
        o_smem = q_smem  # one tile per program: O goes out through Q's stages
    else:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    job_smem, blk_smem, bars = _ws_handover(STAGES, CONSUMERS, Q_BUFS)
    # (the argument lists are written out: a JIT function cannot build a tuple holding the spec's functions)
    if CONSUMERS == 3:  # (d <= 64: three 64-row warpgroups, FlashAttention-3's 192-row tiles)
        gl.warp_specialize([
            (_ws_consumer, (0, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK,
                            DV, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                            MASK_FROM_ROWS,
                            EVEN_Q, EVEN_K, ROWS_, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE, HAS_SCORE, SCALE,
                            H_Q, H_KV, GROUP, FP8, OVERLAP, ZERO_TAIL, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                            SCORE_COLUMN, CONSUMERS, P_PERM, Q_BUFS, HAS_SINK, SINK, O_BSHD)),
            (_ws_consumer, (1, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK,
                            DV, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                            MASK_FROM_ROWS,
                            EVEN_Q, EVEN_K, ROWS_, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE, HAS_SCORE, SCALE,
                            H_Q, H_KV, GROUP, FP8, OVERLAP, ZERO_TAIL, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                            SCORE_COLUMN, CONSUMERS, P_PERM, Q_BUFS, HAS_SINK, SINK, O_BSHD)),
            (_ws_consumer, (2, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK,
                            DV, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                            MASK_FROM_ROWS,
                            EVEN_Q, EVEN_K, ROWS_, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE, HAS_SCORE, SCALE,
                            H_Q, H_KV, GROUP, FP8, OVERLAP, ZERO_TAIL, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                            SCORE_COLUMN, CONSUMERS, P_PERM, Q_BUFS, HAS_SINK, SINK, O_BSHD)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, job_smem, blk_smem, bars, COUNTER_PTR,
                            ORDER, M_CSR, M_IDX, M_FLAG, S_Q, S_K, PLAN_B, PLAN_H, Q_TILES, BH, ROWS_, BLOCK_N, STAGES,
                            HEAD_GROUP, SCHEDULE, H_Q, H_KV, GROUP, D, FP8, CONSUMERS, P_PERM, Q_BUFS, Q_BSHD,
                            K_BSHD, V_BSHD)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (0, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK,
                            DV, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                            MASK_FROM_ROWS,
                            EVEN_Q, EVEN_K, ROWS_, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE, HAS_SCORE, SCALE,
                            H_Q, H_KV, GROUP, FP8, OVERLAP, ZERO_TAIL, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                            SCORE_COLUMN, CONSUMERS, P_PERM, Q_BUFS, HAS_SINK, SINK, O_BSHD)),
            (_ws_consumer, (1, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KS, KE, DQ, DK,
                            DV, S_Q, S_K, Q_OFF, K_OFF, PLAN_B, PLAN_H, Q_TILES, BH, FLAG, MARK, qk_scale, TS,
                            MASK_FROM_ROWS,
                            EVEN_Q, EVEN_K, ROWS_, BLOCK_N, D, STAGES, HEAD_GROUP, VISIBLE, SCORE, HAS_SCORE, SCALE,
                            H_Q, H_KV, GROUP, FP8, OVERLAP, ZERO_TAIL, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                            SCORE_COLUMN, CONSUMERS, P_PERM, Q_BUFS, HAS_SINK, SINK, O_BSHD)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, job_smem, blk_smem, bars, COUNTER_PTR,
                            ORDER, M_CSR, M_IDX, M_FLAG, S_Q, S_K, PLAN_B, PLAN_H, Q_TILES, BH, ROWS_, BLOCK_N, STAGES,
                            HEAD_GROUP, SCHEDULE, H_Q, H_KV, GROUP, D, FP8, CONSUMERS, P_PERM, Q_BUFS, Q_BSHD,
                            K_BSHD, V_BSHD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
