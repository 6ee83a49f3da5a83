"""Tile classes by evaluating the mask over a tile's cells, for the tiles the interval analysis
leaves undecided (``tiles.plan_tiles``): SKIP where no cell is visible, FULL where all are, else
PARTIAL.  Exact whatever the analysis proves: a periodic ``q % 1024 < 16``, a bitwise
``(q & k) == 0`` or a dilation ``(q - k) % 2 == 0`` make the analysis give up on every tile it
cannot prove, and the predicate then decides them.

A tile evaluator is a callable ``evaluator(tiles, block_m, block_n) -> int8 classes`` over
int64 ``[n, 4]`` rows ``(b', h', q tile, k tile)`` of the plan's grid, with a ``name``.  This
module's runs on the host with the IR interpreter (the oracle's semantics, reads outside a tensor
included), a few tiles at a time so memory stays bounded at any length; the Triton backend's
(``backends/triton/tile_classes.py``) runs the spec's emitted predicate on the GPU.
"""
from __future__ import annotations

import numpy as np

from .. import ir
from ..interp import evaluate
from .tile_bounds import UNDECIDED, tile_bounds_classes
from .tiles import FULL, PARTIAL, SKIP

EVAL_CHUNK = 1 << 20  # cells one step holds (int64 temporaries of 8 MiB: measured no slower than 4x that)
# cells the host evaluates for one plan at most (about a minute on one core at ~100M cells/s): past
# it the undecided tiles stay PARTIAL (safe) and the plan says so; the GPU's evaluator has no limit
HOST_MAX_CELLS = 1 << 32


class NumpyTileEvaluator:
    """The mask over each tile's cells on the host, for one call shape (B, S_q, S_k) and its
    tensors (host arrays, as the plan's analysis reads them)."""

    name = "numpy"

    def __init__(self, program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
                 chunk: int = EVAL_CHUNK, max_cells: int | None = HOST_MAX_CELLS):
        self.program, self.batch, self.s_q, self.s_k = program, batch, s_q, s_k
        self.tensors = tensors or {}
        self.chunk = chunk
        self.max_cells = max_cells  # plan_tiles leaves the tiles PARTIAL past it
        self.cells = 0  # cells evaluated so far (a cost the bench reports)
        self.by_bounds = 0  # tiles the bounds decided without a cell (tile_bounds)

    def __call__(self, tiles: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
        return classify_tiles(self.program, self.s_q, self.s_k, self.tensors, tiles, block_m, block_n,
                              self.chunk, self)


def numpy_evaluator(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict) -> NumpyTileEvaluator:
    """The plan pipeline's default tile evaluator (``analysis.pipeline``)."""
    return NumpyTileEvaluator(program, batch, s_q, s_k, tensors)


def classify_tiles(program: ir.Program, s_q: int, s_k: int, tensors: dict, tiles: np.ndarray, block_m: int,
                   block_n: int, chunk: int = EVAL_CHUNK, counter=None) -> np.ndarray:
    """int8 classes of ``tiles`` (int64 [n, 4]: b', h', q tile, k tile) from the mask at every
    cell of each.  A tile across S_q or S_k evaluates its last row or key again in place of the
    ones past the end (the same cells, so the class is that of the cells inside).

    First the bounds of the mask over each tile (``tile_bounds``: no cell evaluated; a periodic
    row set's tiles away from its rows, a bitwise pattern's aligned tiles, documents that do not
    meet), then of the remaining tiles 16 cells each (rows and keys 0, 1, the middle and the
    last), then their borders (first and last rows, first and last keys: a few percent of the
    cells): a tile with a visible and a hidden cell among them is PARTIAL, and only the others are
    evaluated whole (a dilation's or a stripe's tiles are decided by their first cells)."""
    tiles = np.asarray(tiles, np.int64).reshape(-1, 4)
    out = tile_bounds_classes(program, s_q, s_k, tensors, tiles, block_m, block_n)
    todo = np.flatnonzero(out == UNDECIDED)
    out[todo] = PARTIAL
    if counter is not None:
        counter.by_bounds += len(tiles) - len(todo)
    q0 = s_k - s_q
    rows = lambda t, r: q0 + np.minimum(t[:, 2, None] * block_m + r, s_q - 1)  # noqa: E731
    keys = lambda t, c: np.minimum(t[:, 3, None] * block_n + c, s_k - 1)  # noqa: E731
    all_rows, all_keys = np.arange(block_m), np.arange(block_n)
    stages = []
    if block_m > 2 and block_n > 2:  # (rows, keys) parts of the cells each stage evaluates
        pick_m = np.unique([0, 1, block_m // 2, block_m - 1])
        pick_n = np.unique([0, 1, block_n // 2, block_n - 1])
        ends_m, ends_n = np.array([0, block_m - 1]), np.array([0, block_n - 1])
        stages = [((pick_m, pick_n),), ((ends_m, all_keys), (all_rows, ends_n))]
    for parts in stages:  # a stage that sees a visible and a hidden cell proves PARTIAL
        if not len(todo):
            break
        seen = sum(_visible(program, tensors, tiles[todo], lambda t, r=r: rows(t, r), lambda t, c=c: keys(t, c),
                            s_q, s_k, len(r) * len(c), chunk, counter) for r, c in parts)
        todo = todo[(seen == 0) | (seen == sum(len(r) * len(c) for r, c in parts))]
    seen = _visible(program, tensors, tiles[todo], lambda t: rows(t, all_rows), lambda t: keys(t, all_keys),
                    s_q, s_k, block_m * block_n, chunk, counter)
    out[todo] = np.where(seen == 0, SKIP, np.where(seen == block_m * block_n, FULL, PARTIAL))
    return out


def _visible(program, tensors, tiles, rows, keys, s_q: int, s_k: int, cells: int, chunk: int, counter):
    """Visible cells per tile among the rows ``rows(t)`` [n, r] x keys ``keys(t)`` [n, c]."""
    out = np.empty(len(tiles), np.int64)
    per = max(1, chunk // max(1, cells))
    lengths = {"S_q": np.asarray(s_q), "S_k": np.asarray(s_k)}
    for c0 in range(0, len(tiles), per):
        t = tiles[c0:c0 + per]
        q, k = rows(t), keys(t)
        env = {"b": t[:, 0, None, None], "h": t[:, 1, None, None], "q": q[:, :, None], "k": k[:, None, :], **lengths}
        vis = np.broadcast_to(evaluate(program.mask, env, tensors), (len(t), q.shape[1], k.shape[1]))
        out[c0:c0 + per] = np.count_nonzero(vis.reshape(len(t), -1), axis=1)
        if counter is not None:
            counter.cells += len(t) * cells
    return out
