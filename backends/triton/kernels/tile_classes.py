"""The tile-class kernel: the spec's predicate over each undecided tile of a plan (the evaluator
that launches it, and why a kernel: ``backends/triton/tile_classes.py``)."""
import triton
import triton.language as tl


@triton.jit
def classify(TILES, OUT, TS, S_Q, S_K, Q_OFF, BLOCK_M, BLOCK_N,
             VISIBLE: tl.constexpr, SUB_M: tl.constexpr, SUB_N: tl.constexpr):
    """The class of tile ``TILES[i] = (b', h', q tile, k tile)``: rows and keys past the tile's
    end (or S_Q, S_K) repeat its last row or key, cells already counted."""
    i = tl.program_id(0)
    b = tl.load(TILES + 4 * i)
    h = tl.load(TILES + 4 * i + 1)
    row0 = tl.load(TILES + 4 * i + 2) * BLOCK_M
    key0 = tl.load(TILES + 4 * i + 3) * BLOCK_N
    row_last = tl.minimum(row0 + BLOCK_M, S_Q) - 1
    key_last = tl.minimum(key0 + BLOCK_N, S_K) - 1
    seen = tl.zeros([SUB_M, SUB_N], tl.int32)
    hidden = tl.zeros([SUB_M, SUB_N], tl.int32)
    for r in range(row0, row0 + BLOCK_M, SUB_M):
        q = Q_OFF + tl.minimum(r + tl.arange(0, SUB_M), row_last)
        for c in range(key0, key0 + BLOCK_N, SUB_N):
            k = tl.minimum(c + tl.arange(0, SUB_N), key_last)
            v = VISIBLE(b, h, q[:, None], k[None, :], TS).to(tl.int32) + tl.zeros([SUB_M, SUB_N], tl.int32)
            seen = tl.maximum(seen, v)
            hidden = tl.maximum(hidden, 1 - v)
    any_seen = tl.max(tl.max(seen, 1), 0)
    any_hidden = tl.max(tl.max(hidden, 1), 0)
    # SKIP 0, PARTIAL 1, FULL 2 (compiler.ir.TileClass)
    tl.store(OUT + i, tl.where(any_seen > 0, tl.where(any_hidden > 0, 1, 2), 0).to(tl.int8))
