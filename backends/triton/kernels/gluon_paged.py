"""The Gluon engine over a K/V cache (Hopper, sm_90): append and mixed-batch calls with many query
rows per request, paged or not, without a split.

A split call (``Kernel.decode``: packed query rows, ``q_lens`` / ``qo_indptr``, over any cache)
whose rows fill the engine's 128-row tiles takes this program instead of the split-K/V
producer and combine (``split_choice.choose`` decides; ``decode.decode_plan`` cuts the rows
into 128-row tiles of one request, one split).  Its jobs are (tile, query head) in
``JOBS``'s order (``decode.engine_jobs``): request by request, K/V head by K/V head, the
head's tiles longest first with the GQA group's query heads next to each other (the jobs
running at once read one K/V head's blocks, which stay in L2), drawn from a counter by one
program per SM as in ``gluon_engine``.  The consumers are the engine's (``_ws_blocks``: the same
online softmax, the score program per cell or in its separable form where the call's positions allow
it (``launch.separable_mode``), PARTIAL blocks by the predicate, the ping-pong at d 128);
what differs is where the rows live:

* Q and O are the packed [total_q, H_q, d] tensors, viewed [total_q, H_q * d]: a tile's rows
  start at ``qo_indptr[b] + row0`` in head h's columns.  The rows of a tile past its request's
  ``q_len`` are the next request's (or past total_q, zero-filled by TMA): computed and dropped,
  O and LSE stored under a mask.
* K and V are read through the request's page table: a block of BLOCK_N keys is BLOCK_N / CHUNK
  TMA copies of CHUNK = min(page_size, BLOCK_N) rows, each from its page, into its rows of the
  stage (``_pg_kv_row``).  The cache is viewed as 2-D rows: token-major layouts (paged nhd,
  contiguous bshd, ragged) as [rows, H_kv * d] with the head's columns at kv_h * d; head-major
  ones (paged hnd, contiguous bhsd) as [rows, d] with the head's rows at kv_h * HEAD_ROWS.  A
  copy past the request's last key reads its last chunk again, never another page id.
* Request b's keys are [0, kv_len): the block across kv_len takes the mask path with the keys
  past it hidden, and its V rows past kv_len (a page's unwritten tail: stale values, possibly
  not finite) are zeroed in shared memory before P.V (``gluon_engine._ws_zero_v_tail``).  Query
  row i of request b sits at position kv_len - q_len + i (bottom-right), as in the split kernel.
"""
import triton.language as tl

from .gluon_engine import _ws_blocks, _ws_rows_out, _ws_separable
from .gluon_sync import _tma_load, _tma_store, _ws_claim_q, _ws_get, _ws_handover, _ws_put, _ws_take_job, gluon, gl, \
    mbarrier, tma, fence_async_shared  # noqa: F401


@gluon.jit
def _pg_job(t, H_Q: tl.constexpr, JOBS, ENTRY_PTR):
    """Job t: (tile, query head, the tile's block list [lo, hi)); JOBS[t] = tile * H_Q + h."""
    job = gl.load(JOBS + t)
    tile = job // H_Q
    return tile, job % H_Q, gl.load(ENTRY_PTR + tile), gl.load(ENTRY_PTR + tile + 1)


@gluon.jit
def _pg_kv_row(t, b, kvh, kv_len, base, TABLE, s_tb, PAGE_ROWS, HEAD_ROWS, PAGED: tl.constexpr,
               PAGE: tl.constexpr, CHUNK: tl.constexpr):
    """The cache row (of its 2-D view) where request b's CHUNK keys from key t start, for K/V head
    kvh: past the request's last key, its last chunk again (a page it owns)."""
    t = gl.minimum(t, gl.maximum(kv_len - 1, 0) // CHUNK * CHUNK)
    if PAGED:  # dense table: row b of TABLE (base 0); CSR: the request's pages start at base
        page = gl.load(TABLE + b * s_tb + base + t // PAGE)
        return page * PAGE_ROWS + kvh * HEAD_ROWS + t % PAGE
    return base + kvh * HEAD_ROWS + t


@gluon.jit
def _pg_copy(desc, rows, chunks, col, bar, dst, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """One K or V block into its stage ``dst``: BLOCK_N / CHUNK TMA copies, chunk j from cache row
    rows[j] (column ``col``) into dst's rows [j * CHUNK, + CHUNK), all completing on ``bar``."""
    mbarrier.expect(bar, (BLOCK_N // CHUNK) * desc.block_type.nbytes)
    for j in gl.static_range(BLOCK_N // CHUNK):
        row = gl.sum(gl.where(chunks == j, rows, 0), 0)
        if CHUNK == BLOCK_N:
            _tma_load(desc, [row, col], bar, dst)
        else:
            _tma_load(desc, [row, col], bar, dst.slice(j * CHUNK, CHUNK, dim=0))


@gluon.jit
def _pg_consumer(half, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KV_LENS, QO_INDPTR,
                 TILE_REQ, TILE_ROW0, n_jobs, qk_scale, TS, ROWS_: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, STAGES: tl.constexpr, VISIBLE: tl.constexpr, SCORE: tl.constexpr,
                 HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr, OVERLAP: tl.constexpr,
                 PINGPONG: tl.constexpr, SEPARABLE: tl.constexpr, SCORE_SCALE: tl.constexpr,
                 SCORE_ROW: tl.constexpr, SCORE_COLUMN: tl.constexpr, Q_BUFS: tl.constexpr = 1,
                 HAS_SINK: tl.constexpr = False, SINK: tl.constexpr = None):
    """Rows [half * ROWS_, + ROWS_) of each tile the producer hands over (``gluon_engine.
    _ws_consumer``'s protocol): the blocks of its list through ``_ws_blocks``, then O and LSE at
    the request's packed rows, under a mask where the tile crosses the request's end.  SEPARABLE:
    the score program's separable form as on the prefill engine, from an origin in the middle of
    this half's positions, the row part added to LSE.  HAS_SINK: request b's sink joins each row
    once, after its keys (``gluon_engine._ws_rows_out``: there is no split to merge)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    s_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: tl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    row_l: tl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: tl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: tl.constexpr = gl.SliceLayout(1, o_layout)
    o = o_smem.index(half)
    c = 0
    jc = 0
    tc = 0
    t = _ws_take_job(job_smem, q_ready, jc, Q_BUFS)
    while t < n_jobs:
        buf = jc % Q_BUFS
        q = q_smem.index(2 * buf + half)
        job = _ws_get(job_smem.index(buf), 1, 4)  # tile * H_Q + h
        lo = _ws_get(job_smem.index(buf), 2, 4)
        hi = _ws_get(job_smem.index(buf), 3, 4)
        tile = job // H_Q
        h = job % H_Q
        b = gl.load(TILE_REQ + tile)
        row0 = gl.load(TILE_ROW0 + tile) + half * ROWS_  # this half's first row within the request
        first = gl.load(QO_INDPTR + b)
        q_len = gl.load(QO_INDPTR + b + 1) - first
        kv_len = gl.load(KV_LENS + b)
        rows = row0 + gl.arange(0, ROWS_, row_l)
        q_pos = (kv_len - q_len + rows)[:, None]  # bottom-right
        origin = kv_len - q_len + row0 + ROWS_ // 2
        sep_scale, col_step = _ws_separable(b, h, origin, TS, SCALE, qk_scale, BLOCK_N, col_l, SEPARABLE,
                                            SCORE_SCALE, SCORE_COLUMN)
        acc, m_i, l_i, c, tc = _ws_blocks(q, k_smem, v_smem, blk_smem, bars, lo, hi, c, 0, 0, b, h, q_pos, kv_len, 0,
                                          qk_scale, TS, 1.0, False, False, ROWS_, BLOCK_N, D, STAGES, VISIBLE, SCORE,
                                          HAS_SCORE, SCALE, False, OVERLAP, True, PINGPONG, half, tc, sep_scale,
                                          origin, col_step, SEPARABLE, SCORE_COLUMN)
        mbarrier.arrive(q_empty.index(buf), count=1)  # this half's Q.K^T are done: the buffer may take a later Q
        l_safe, lse_out = _ws_rows_out(m_i, l_i, b, h, kv_len - q_len + rows, origin, TS, SEPARABLE, SCORE_ROW,
                                       HAS_SINK, SINK)
        out = acc / gl.convert_layout(l_safe, orow_l)[:, None]  # rows that saw nothing: acc = 0, O = 0
        if row0 + ROWS_ <= q_len:
            tma.store_wait(0)  # the last tile's O has left shared memory
            o.store(out.to(o_smem.dtype))
            fence_async_shared()
            _tma_store(o_desc, [first + row0, h * D], o)
        else:
            o_rows = row0 + gl.arange(0, ROWS_, orow_l)
            o_cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
            gl.store(O + ((first + o_rows) * H_Q + h)[:, None] * D + o_cols[None, :], out.to(O.dtype.element_ty),
                     mask=(o_rows < q_len)[:, None])
        gl.store(LSE + (first + rows) * H_Q + h, lse_out, mask=rows < q_len)
        jc += 1
        t = _ws_take_job(job_smem, q_ready, jc, Q_BUFS)
    tma.store_wait(0)


@gluon.jit
def _pg_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, job_smem, blk_smem, bars, COUNTER_PTR, JOBS,
                 ENTRY_PTR, BLOCKS, PARTIAL, KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, PAGE_ROWS,
                 HEAD_ROWS, K_COL, V_COL, n_jobs, ROWS_: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                 H_Q: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, PAGED: tl.constexpr,
                 PAGE: tl.constexpr, CHUNK: tl.constexpr, Q_BUFS: tl.constexpr = 1):
    """``gluon_engine._ws_producer`` over a cache: each job's Q halves from the request's packed
    rows, then every block of the tile's list as BLOCK_N / CHUNK copies per K and V
    (``_pg_kv_row``).  K_COL / V_COL: the columns of one K / V head in the cache's view (d on
    token-major layouts; 0 on head-major ones, whose HEAD_ROWS place the head)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    c = 0
    jc = 0
    t = gl.program_id(0)  # the grid never exceeds the jobs
    tile, h, lo, hi = _pg_job(t, H_Q, JOBS, ENTRY_PTR)
    while t < n_jobs:
        drawn = gl.atomic_add(COUNTER_PTR, 1)
        if drawn == n_jobs - 1:  # every program's draws add up to n_jobs: this one is the last
            gl.atomic_add(COUNTER_PTR, -n_jobs)  # (the counter holds n_jobs: back to zero)
        nxt = gl.num_programs(0) + drawn
        buf = _ws_claim_q(q_empty, jc, Q_BUFS)
        _ws_put(job_smem.index(buf), (t, tile * H_Q + h, lo, hi), 4)
        b = gl.load(TILE_REQ + tile)
        q_row0 = gl.load(QO_INDPTR + b) + gl.load(TILE_ROW0 + tile)
        mbarrier.expect(q_ready.index(buf), 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row0, h * D_QK], q_ready.index(buf), q_smem.index(2 * buf))
        _tma_load(q_desc, [q_row0 + ROWS_, h * D_QK], q_ready.index(buf), q_smem.index(2 * buf + 1))
        kvh = h // GROUP
        kv_len = gl.load(KV_LENS + b)
        base = gl.load(BASE + b).to(gl.int32)
        layout: tl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        chunks = gl.arange(0, BLOCK_N // CHUNK, layout)
        for i in range(lo, hi):
            stage = c % STAGES
            phase = (c // STAGES) & 1
            kb = gl.load(BLOCKS + i)
            part = gl.load(PARTIAL + i).to(gl.int32)
            # the block's rows in the cache (page table reads issued before the wait for a free stage)
            rows = _pg_kv_row(kb * BLOCK_N + chunks * CHUNK, b, kvh, kv_len, base, TABLE, s_tb, PAGE_ROWS,
                              HEAD_ROWS, PAGED, PAGE, CHUNK)
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            _ws_put(blk_smem.index(stage), (kb, part), 2)
            _pg_copy(k_desc, rows, chunks, kvh * K_COL, k_ready.index(stage), k_smem.index(stage), BLOCK_N, CHUNK)
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            _pg_copy(v_desc, rows, chunks, kvh * V_COL, v_ready.index(stage), v_smem.index(stage), BLOCK_N, CHUNK)
            c += 1
        jc += 1
        t = nxt
        tile, h, lo, hi = _pg_job(gl.minimum(t, n_jobs - 1), H_Q, JOBS, ENTRY_PTR)
    buf = _ws_claim_q(q_empty, jc, Q_BUFS)  # "none left", once the consumers are done with that buffer's last Q
    _ws_put(job_smem.index(buf), (t, 0, 0, 0), 4)
    mbarrier.arrive(q_ready.index(buf), count=1)


@gluon.jit
def _paged_fwd_ws(q_desc, k_desc, v_desc, o_desc, O, LSE, COUNTER_PTR, JOBS, ENTRY_PTR, BLOCKS, PARTIAL,
                  KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE, s_tb, PAGE_ROWS, HEAD_ROWS, K_COL, V_COL,
                  TS, n_jobs, qk_scale, ROWS_: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  STAGES: tl.constexpr, CONSUMER_REGS: tl.constexpr, PRODUCER_REGS: tl.constexpr,
                  VISIBLE: tl.constexpr, SCORE: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr,
                  H_Q: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, PAGED: tl.constexpr,
                  PAGE: tl.constexpr, CHUNK: tl.constexpr, OVERLAP: tl.constexpr, PINGPONG: tl.constexpr,
                  SEPARABLE: tl.constexpr = 0, SCORE_SCALE: tl.constexpr = None, SCORE_ROW: tl.constexpr = None,
                  SCORE_COLUMN: tl.constexpr = None, Q_BUFS: tl.constexpr = 1, HAS_SINK: tl.constexpr = False,
                  SINK: tl.constexpr = None):
    """Jobs (128-row tile of one request, query head) of a split call over a cache (module
    docstring), one program per SM drawing them from the counter at COUNTER_PTR.  D is V's (and
    O's) head dim, D_QK Q and K's; K and V blocks of BLOCK_N rows land as BLOCK_N / CHUNK copies.
    SEPARABLE and the form's functions: ``launch.separable_constexprs`` (0: the score program per cell).
    Q_BUFS: Q's buffers, as on the prefill engine (``gluon_engine._ws_producer``).  HAS_SINK: the
    spec's sink ``SINK`` joins every row once (``_pg_consumer``)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * Q_BUFS] + q_desc.block_type.shape, q_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_QK], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    job_smem, blk_smem, bars = _ws_handover(STAGES, 2, Q_BUFS)
    gl.warp_specialize([
        (_pg_consumer, (0, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KV_LENS,
                        QO_INDPTR, TILE_REQ, TILE_ROW0, n_jobs, qk_scale, TS, ROWS_, BLOCK_N, D, STAGES, VISIBLE,
                        SCORE, HAS_SCORE, SCALE, H_Q, OVERLAP, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                        SCORE_COLUMN, Q_BUFS, HAS_SINK, SINK)),
        (_pg_consumer, (1, q_smem, o_smem, k_smem, v_smem, job_smem, blk_smem, bars, o_desc, O, LSE, KV_LENS,
                        QO_INDPTR, TILE_REQ, TILE_ROW0, n_jobs, qk_scale, TS, ROWS_, BLOCK_N, D, STAGES, VISIBLE,
                        SCORE, HAS_SCORE, SCALE, H_Q, OVERLAP, PINGPONG, SEPARABLE, SCORE_SCALE, SCORE_ROW,
                        SCORE_COLUMN, Q_BUFS, HAS_SINK, SINK)),
        (_pg_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, job_smem, blk_smem, bars, COUNTER_PTR,
                        JOBS, ENTRY_PTR, BLOCKS, PARTIAL, KV_LENS, QO_INDPTR, TILE_REQ, TILE_ROW0, BASE, TABLE,
                        s_tb, PAGE_ROWS, HEAD_ROWS, K_COL, V_COL, n_jobs, ROWS_, BLOCK_N, STAGES, H_Q, GROUP, D_QK,
                        PAGED, PAGE, CHUNK, Q_BUFS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
