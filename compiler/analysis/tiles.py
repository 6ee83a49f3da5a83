"""Tile classes and the block-sparse tile CSR (DESIGN §4, M4.5 §0x06C-D).

Two classifiers feed one :class:`TilePlan`:

* :func:`classify_summaries` — FlashMask's: eight min/max summaries per K/V block of
  the four interval vectors, then the interval-family test per Q tile.  O(tiles),
  never reads per-column vectors; may only err towards PARTIAL.
* :func:`classify_exact` — from the analysis' per-column row sets (``must``/``may``):
  exact whenever the analysis is exact, safe (PARTIAL) where it is not.  This is
  the path for masks FlashMask cannot represent.

Where the analysis is not exact (periodic ``%``, bitwise atoms, ...), a tile it calls PARTIAL
without proof (no cell certainly visible, or no cell certainly hidden) is *undecided*:
:func:`plan_tiles` hands those to a tile evaluator (``analysis.tile_eval``: the predicate over
the tile's cells, numpy on the host, a Triton kernel for CUDA calls), so the classes are exact
whatever the analysis proves.  Where the analysis is exact nothing is evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnc.compiler import resources
from attnc.compiler.ir import TileClass
from .intervals import MaskIntervals

SKIP, PARTIAL, FULL = TileClass.SKIP, TileClass.PARTIAL, TileClass.FULL
SUMMARY_NAMES = ("UTS_min", "UTS_max", "UTE_min", "UTE_max", "LTS_min", "LTS_max", "LTE_min", "LTE_max")


def _block_starts(s_k: int, block_n: int) -> np.ndarray:
    return np.arange(0, s_k, block_n)


def summaries(mi: MaskIntervals, block_n: int) -> dict[str, np.ndarray]:
    """The eight int32 summaries per K/V block, each [B', H', T_c]."""
    if not mi.representable:
        raise ValueError("summaries need FlashMask vectors; the mask is not representable")
    starts = _block_starts(mi.s_k, block_n)
    out = {}
    for name, v in mi.vectors().items():
        out[f"{name}_min"] = np.minimum.reduceat(v, starts, axis=-1).astype(np.int32)
        out[f"{name}_max"] = np.maximum.reduceat(v, starts, axis=-1).astype(np.int32)
    return {n: out[n] for n in SUMMARY_NAMES}


def _family(i0, i1, s_min, s_max, e_min, e_max):
    """(covers, may_overlap) of Q rows [i0, i1) against one interval family (M4.5 §0x06D)."""
    covers = (i0 >= s_max) & (i1 <= e_min)
    overlap = (i1 > s_min) & (i0 < e_max)
    return covers, overlap


def _row_tiles(s_q: int, block_m: int):
    i0 = np.arange(0, s_q, block_m)
    return i0, np.minimum(i0 + block_m, s_q)


def classify_summaries(summ: dict[str, np.ndarray], s_q: int, block_m: int) -> np.ndarray:
    """int8 tile classes [B', H', T_r, T_c] from the eight summaries alone."""
    i0, i1 = _row_tiles(s_q, block_m)
    i0, i1 = i0[:, None], i1[:, None]  # [T_r, 1] against [B', H', 1, T_c]
    ex = {n: v[:, :, None, :] for n, v in summ.items()}
    u_cov, u_ovl = _family(i0, i1, ex["UTS_min"], ex["UTS_max"], ex["UTE_min"], ex["UTE_max"])
    l_cov, l_ovl = _family(i0, i1, ex["LTS_min"], ex["LTS_max"], ex["LTE_min"], ex["LTE_max"])
    classes = np.full(u_cov.shape, PARTIAL, np.int8)
    classes[~u_ovl & ~l_ovl] = FULL
    classes[u_cov | l_cov] = SKIP
    return classes


def classify_exact(mi: MaskIntervals, block_m: int, block_n: int, chunk: int = 1 << 22,
                   undecided: np.ndarray | None = None) -> np.ndarray:
    """int8 tile classes [B', H', T_r, T_c] from the per-column must/may row sets.  ``undecided``
    (bool, the classes' shape), when given, is set where a tile is PARTIAL without proof: no cell
    of it is certainly visible or none is certainly hidden (only an inexact analysis leaves any).

    Linear in the columns' runs plus the tiles, never in query tiles x columns: a run of rows
    ``[s, e)`` of a column covers a range of query tiles (every row of the tile in the run) and
    touches a slightly wider one, so how many of a tile column's columns cover (or touch) each
    tile is a difference array along the query tiles, one ``bincount`` of the runs' range ends,
    summed.  A tile is FULL where every column of its tile column has a ``must`` run covering
    it, SKIP where no ``may`` run touches it.  Exact because runs are normalized (sorted, disjoint,
    never adjacent: ``intervals._normalize``), so rows that a column's runs cover lie in one run.
    ``chunk`` bounds the tiles of one step (a few query-tile rows of every tile column)."""
    b_, h_, s_k = mi.shape
    planes = b_ * h_
    t_r, t_c = -(-mi.s_q // block_m), -(-s_k // block_n)
    classes = np.empty((b_, h_, t_r, t_c), np.int8)
    if not classes.size:
        return classes
    must, may = mi.visible.must, mi.visible.may
    widest = max(must.start.shape[1], may.start.shape[1])
    step = min(t_r, max(1, chunk // (planes * t_c)))
    resources.require(f"the exact tile classifier ({step:,} query tiles x {planes * t_c:,} tile columns at a time, "
                      f"{planes * s_k:,} columns, {must.start.shape[1] + may.start.shape[1]} row-set runs)",
                      resources.exact_classify_bytes(planes * s_k, widest, planes * (step + 1) * t_c)
                      + resources.array_bytes(mi) + classes.nbytes * (3 if undecided is not None else 1))
    width = np.minimum(block_n, s_k - np.arange(t_c) * block_n)[:, None]  # columns per tile column
    # each column's (plane, tile column) as the flat offset of its counts along the query tiles
    # ([planes, T_c, rows + 1]: the running sums run along the contiguous axis)
    tile_col = np.arange(planes)[:, None] * t_c + np.arange(s_k)[None, :] // block_n
    for r0 in range(0, t_r, step):  # bounded memory: a few query-tile rows at a time
        rows = min(t_r - r0, step)
        at = (tile_col * (rows + 1)).reshape(-1)
        count = lambda runs, cover: _tile_counts(runs, cover, block_m, t_r, at, r0, rows,  # noqa: E731
                                                 planes * t_c).reshape(planes, t_c, rows)
        c = np.where(count(may, False) == 0, SKIP_I8, PARTIAL_I8)
        c[(count(must, True) == width) & (c == PARTIAL_I8)] = FULL_I8
        classes[:, :, r0:r0 + rows] = c.reshape(b_, h_, t_c, rows).transpose(0, 1, 3, 2)
        if undecided is not None:  # PARTIAL is proven by a certainly visible and a certainly hidden cell
            open_ = c == PARTIAL_I8
            open_ &= ~((count(must, False) > 0) & (count(may, True) < width))
            undecided[:, :, r0:r0 + rows] = open_.reshape(b_, h_, t_c, rows).transpose(0, 1, 3, 2)
            del open_
        del c, at
    return classes


SKIP_I8, PARTIAL_I8, FULL_I8 = (np.int8(c) for c in (SKIP, PARTIAL, FULL))


def _tile_counts(runs, cover: bool, block_m: int, t_r: int, at: np.ndarray, r0: int, rows: int,
                 lines: int) -> np.ndarray:
    """[lines, rows]: per tile column (of every plane) and query tile of ``[r0, r0 + rows)``, how
    many of its columns have a run of ``runs`` that covers the tile (``cover``: every row of the
    tile in the run; the last tile ends at S_q) or touches it (some row in it); ``at`` (int64 [N])
    is each column's tile column's offset in the step's difference array ``[lines, rows + 1]``."""
    s, e = runs.start, runs.end
    if cover:
        lo, hi = s + (block_m - 1), np.where(e >= runs.rows, t_r * block_m, e)
    else:
        lo, hi = s.copy(), e + (block_m - 1)
    lo //= block_m
    hi //= block_m
    hi[e <= s] = 0  # empty runs (unused slots): no tile
    if r0 or r0 + rows < t_r:
        np.clip(lo, r0, r0 + rows, out=lo)
        np.clip(hi, r0, r0 + rows, out=hi)
    np.maximum(hi, lo, out=hi)  # an empty range starts and ends at one place: its +1 and -1 cancel
    for x in (lo, hi):
        if r0:
            x -= r0
        x += at[:, None]
    size = lines * (rows + 1)
    diff = np.bincount(lo.reshape(-1), minlength=size)
    del lo
    diff -= np.bincount(hi.reshape(-1), minlength=size)
    del hi
    return np.cumsum(diff.reshape(lines, rows + 1)[:, :rows], axis=1)


@dataclass(frozen=True)
class TilePlan:
    """Tile classes and the block-sparse CSR over rows (b', h', q-tile): PARTIAL K/V blocks
    then FULL K/V blocks, each in increasing K/V order."""

    classes: np.ndarray  # int8 [B', H', T_r, T_c]
    block_m: int
    block_n: int
    partial_indptr: np.ndarray  # int32 [B'*H'*T_r + 1]
    partial_indices: np.ndarray  # int32 [nnz_partial]
    full_indptr: np.ndarray
    full_indices: np.ndarray
    method: str  # "summaries" | "exact"
    # tiles the analysis left undecided (PARTIAL without proof; 0 where it is exact), and the tile
    # evaluator that classified them ("numpy", "triton"; None: none did, they stay PARTIAL)
    undecided: int = 0
    evaluated_by: str | None = None
    skipped: str | None = None  # why they were not evaluated (over the evaluator's limit)

    @classmethod
    def from_classes(cls, classes: np.ndarray, block_m: int, block_n: int, method: str,
                     undecided: int = 0, evaluated_by: str | None = None, skipped: str | None = None) -> "TilePlan":
        """The CSR of given tile classes [B', H', T_r, T_c] (a whole call's, or a rectangle of one:
        ``compiler.cp`` cuts a call into blocks of query and key tiles)."""
        p_ptr, p_idx = _csr(classes == PARTIAL)
        f_ptr, f_idx = _csr(classes == FULL)
        return cls(classes, block_m, block_n, p_ptr, p_idx, f_ptr, f_idx, method, undecided, evaluated_by, skipped)

    @property
    def exact(self) -> bool:
        """Whether every tile's class is exact (the analysis proved it, or an evaluator decided it)."""
        return self.undecided == 0 or self.evaluated_by is not None

    def classified_by(self) -> str:
        """Which method classified the tiles, for a reader (``attnc explain``)."""
        if self.undecided == 0:
            return "interval analysis (every tile proven)"
        if self.evaluated_by is None:
            why = f": {self.skipped}" if self.skipped else ""
            return f"interval analysis (not exact: {self.undecided} undecided tiles left PARTIAL{why})"
        return (f"interval analysis + predicate evaluation ({self.evaluated_by}) of the {self.undecided} "
                "tiles it left undecided")

    def counts(self) -> dict[str, int]:
        return {"full": int((self.classes == FULL).sum()), "partial": int((self.classes == PARTIAL).sum()),
                "skip": int((self.classes == SKIP).sum())}

    def density(self) -> float:
        """Fraction of tiles that are computed (not skipped)."""
        return float((self.classes != SKIP).mean()) if self.classes.size else 0.0

    def flex_block_mask(self) -> dict[str, np.ndarray]:
        """FlexAttention BlockMask tensors (int32): kv_num_blocks/kv_indices hold the PARTIAL
        blocks (mask_mod applied), full_kv_* the FULL blocks (mask_mod skipped)."""
        out = {}
        for prefix, cls in (("", PARTIAL), ("full_", FULL)):
            hit = self.classes == cls
            num = hit.sum(-1).astype(np.int32)
            # stable sort puts the hit blocks first, in increasing order
            order = np.argsort(~hit, axis=-1, kind="stable").astype(np.int32)
            out[f"{prefix}kv_num_blocks"] = num
            out[f"{prefix}kv_indices"] = order
        return out


def _csr(hit: np.ndarray):
    rows = hit.reshape(-1, hit.shape[-1])
    indptr = np.zeros(rows.shape[0] + 1, np.int32)
    np.cumsum(rows.sum(axis=1), out=indptr[1:])
    return indptr, np.nonzero(rows)[1].astype(np.int32)


def require_tiles(shape: tuple[int, int, int], s_q: int, block_m: int, block_n: int) -> None:
    """Refuse a tile plan over columns ``shape = (B', H', S_k)`` that exceeds the memory limit."""
    b_, h_, s_k = shape
    t_r, t_c = -(-s_q // block_m), -(-s_k // block_n)
    resources.require(f"the tile plan ({b_} x {h_} x {t_r:,} x {t_c:,} tiles of {block_m}x{block_n})",
                      resources.tiles_bytes(b_ * h_, s_q, s_k, block_m, block_n))


EXACT_BUDGET = 1 << 24  # row-set cells the exact classifier may touch before "auto" prefers summaries


def plan_tiles(mi: MaskIntervals, block_m: int, block_n: int, method: str = "auto",
               evaluator=None) -> TilePlan:
    """Tile plan.  "auto": the exact classifier when it is cheap (it never calls a tile PARTIAL
    that is really FULL or SKIP), else FlashMask's O(tiles) summaries when the mask is
    representable, else the exact classifier regardless of cost (correct first).

    Where the analysis is not exact, the tiles it leaves undecided go to ``evaluator``
    (``analysis.tile_eval``: ``evaluator(tiles, block_m, block_n)``, with a ``name``, takes int64
    ``[n, 4]`` rows (b', h', q tile, k tile) and returns their int8 classes); without one they
    stay PARTIAL (safe)."""
    if block_m < 1 or block_n < 1:
        raise ValueError(f"tile sizes must be positive, got {block_m}x{block_n}")
    require_tiles(mi.shape, mi.s_q, block_m, block_n)
    if method == "auto":
        width = mi.visible.must.start.shape[1] + mi.visible.may.start.shape[1]
        work = -(-mi.s_q // block_m) * mi.visible.must.columns * max(width, 1)
        method = "summaries" if mi.representable and work > EXACT_BUDGET else "exact"
    if method == "summaries":
        return TilePlan.from_classes(classify_summaries(summaries(mi, block_n), mi.s_q, block_m), block_m, block_n,
                                     method)
    if mi.exact:
        return TilePlan.from_classes(classify_exact(mi, block_m, block_n), block_m, block_n, method)
    undecided = np.zeros((mi.shape[0], mi.shape[1], -(-mi.s_q // block_m), -(-mi.s_k // block_n)), bool)
    classes = classify_exact(mi, block_m, block_n, undecided=undecided)
    todo = np.argwhere(undecided)
    limit = getattr(evaluator, "max_cells", None)
    if evaluator is None or not len(todo):
        return TilePlan.from_classes(classes, block_m, block_n, method, len(todo))
    if limit is not None and len(todo) * block_m * block_n > limit:  # too long to wait for: safe instead
        return TilePlan.from_classes(classes, block_m, block_n, method, len(todo),
                                     skipped=f"{len(todo) * block_m * block_n:,} cells to evaluate, over the "
                                             f"{evaluator.name} evaluator's limit of {limit:,}")
    classes[tuple(todo.T)] = evaluator(todo.astype(np.int64), block_m, block_n)
    return TilePlan.from_classes(classes, block_m, block_n, method, len(todo), evaluator.name)
