"""Partitions of a sequence's tiles among ranks (context parallelism, ``compiler.cp``): each
function maps T tiles to the rank that owns each, from the tiles' work and, for ``balanced``,
how many needed key tiles each cut would cross.  Pure numpy, no plan objects."""
from __future__ import annotations

import numpy as np

BALANCE_SLACK = 0.025  # balanced: the busiest rank may exceed the least possible by this much to cross less K/V


def even_owner(tiles: int, ranks: int) -> np.ndarray:
    """Rank r owns tiles [r T / N, (r + 1) T / N): token-even contiguous ranges."""
    bounds = np.arange(ranks + 1) * tiles // ranks
    return np.repeat(np.arange(ranks, dtype=np.int32), np.diff(bounds))


def zigzag_owner(tiles: int, ranks: int) -> np.ndarray:
    """2N equal chunks; rank r owns chunks r and 2N-1-r."""
    chunks = 2 * ranks
    bounds = np.arange(chunks + 1) * tiles // chunks
    c = np.arange(chunks)
    return np.repeat(np.minimum(c, chunks - 1 - c).astype(np.int32), np.diff(bounds))


def balanced_owner(row_work: np.ndarray, crossing: np.ndarray, ranks: int,
                   slack: float = BALANCE_SLACK) -> np.ndarray:
    """N contiguous ranges of tiles.  Among the partitions whose busiest range has at most
    ``1 + slack`` times the least possible work (:func:`bottleneck`): those whose worst cut is
    crossed by the fewest needed key tiles (``crossing[t]`` for a cut at boundary t), and of
    those the one whose cuts lie closest to r/N of the work.  Every range gets a tile when there
    are enough of them."""
    tiles = len(row_work)
    cum = np.concatenate([[0], np.cumsum(row_work, dtype=np.float64)])  # cum[t]: work of tiles < t
    if cum[-1] == 0:
        return even_owner(tiles, ranks)
    cap = bottleneck(cum, ranks) * (1 + slack)
    levels = np.unique(crossing)
    lo, hi = 0, len(levels) - 1  # the least level whose cuts can make the ranges (greedy test)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _packs(cum, cap, crossing <= levels[mid], ranks) else (mid + 1, hi)
    for level in levels[lo:]:
        cuts = _closest_cuts(cum, cap, crossing <= level, ranks)
        if cuts is not None:
            return np.repeat(np.arange(ranks, dtype=np.int32), np.diff(cuts))
    raise AssertionError("the unrestricted cuts always make the ranges")  # pragma: no cover


def _packs(cum: np.ndarray, cap: float, allowed: np.ndarray, ranks: int) -> bool:
    """Whether at most ``ranks`` ranges of work <= cap, cut only where ``allowed``, cover the tiles
    (greedy: each range reaches the furthest allowed boundary it can)."""
    tiles = len(cum) - 1
    points = np.flatnonzero(allowed | (np.arange(tiles + 1) == tiles))
    t, parts = 0, 0
    while t < tiles:
        reach = int(np.searchsorted(cum, cum[t] + cap, "right")) - 1
        nxt = int(points[np.searchsorted(points, reach, "right") - 1])
        if nxt <= t or parts == ranks:
            return False
        t, parts = nxt, parts + 1
    return True


def _closest_cuts(cum: np.ndarray, cap: float, allowed: np.ndarray, ranks: int) -> list[int] | None:
    """The cuts 0 = c_0 <= ... <= c_N = T, at allowed boundaries, every range's work <= cap, that
    minimise the cuts' distances from r/N of the work (a dynamic program over (range, boundary)
    with a sliding-window minimum, O(N T log T)); None where there are none."""
    tiles, total = len(cum) - 1, cum[-1]
    allowed = allowed.copy()
    allowed[-1] = True
    lo = np.searchsorted(cum, cum - cap, "left")  # the first boundary s with cum[t] - cum[s] <= cap
    hi = np.arange(tiles + 1) - (1 if tiles >= ranks else 0)  # ranges are not empty when they can be
    cost = np.where(allowed & (cum <= cap), np.abs(cum - total / ranks), np.inf)
    if tiles >= ranks:
        cost[0] = np.inf
    choice = np.zeros((ranks, tiles + 1), np.int64)
    for r in range(2, ranks + 1):
        best, choice[r - 1] = _window_min(cost, lo, hi)
        here = np.where(allowed, np.abs(cum - total * r / ranks), np.inf)
        here[-1] = 0.0
        cost = best + here
    if not np.isfinite(cost[-1]):
        return None
    cuts = [tiles]
    for r in range(ranks - 1, 0, -1):
        cuts.append(int(choice[r][cuts[-1]]))
    return [0] + cuts[::-1]


def bottleneck(cum: np.ndarray, ranks: int) -> float:
    """The least work of the busiest of ``ranks`` contiguous ranges (``cum``: prefix sums of the
    tiles' work): a binary search over the cap, each tried by packing ranges greedily."""
    lo, hi = float(np.diff(cum).max(initial=0)), float(cum[-1])

    def fits(cap: float) -> bool:
        t, parts = 0, 0
        while t < len(cum) - 1:
            t = int(np.searchsorted(cum, cum[t] + cap, "right")) - 1
            parts += 1
            if parts > ranks:
                return False
        return True

    while hi - lo > max(1.0, hi * 1e-12):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every t, the least ``values[s]`` over s in [lo[t], hi[t]] and its s (a sparse table;
    inf where the window is empty)."""
    n = len(values)
    best, arg = [values], [np.arange(n)]
    width = 1
    while 2 * width <= n:
        v, a = best[-1], arg[-1]
        right = np.concatenate([v[width:], np.full(width, np.inf)])
        take = right < v
        best.append(np.where(take, right, v))
        arg.append(np.where(take, np.concatenate([a[width:], a[-width:]]), a))
        width *= 2
    empty = hi < lo
    lo, hi = np.where(empty, 0, lo), np.where(empty, 0, hi)
    level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
    start = hi - (1 << level) + 1
    stack_v, stack_a = np.stack(best), np.stack(arg)
    left_v, left_a = stack_v[level, lo], stack_a[level, lo]
    right_v, right_a = stack_v[level, start], stack_a[level, start]
    take = right_v < left_v
    return np.where(empty, np.inf, np.where(take, right_v, left_v)), np.where(take, right_a, left_a)


def cut_crossings(needed: np.ndarray) -> np.ndarray:
    """For every tile boundary t in [0, T]: how many key tiles are needed across it (keys left
    of t by rows right of it, and keys right of t by rows left of it), from ``needed`` [T, T]
    (query tile, key tile) -> computed."""
    tiles = needed.shape[0]
    diff = np.zeros(tiles + 2, np.int64)
    used = needed.any(axis=0)
    cols = np.flatnonzero(used)
    first = needed.argmax(axis=0)[cols]
    last = tiles - 1 - needed[::-1].argmax(axis=0)[cols]
    left = last > cols  # key tile j < t <= last row
    np.add.at(diff, cols[left] + 1, 1)
    np.add.at(diff, last[left] + 1, -1)
    right = first < cols  # first row < t <= key tile j
    np.add.at(diff, first[right] + 1, 1)
    np.add.at(diff, cols[right] + 1, -1)
    return np.cumsum(diff)[:tiles + 1]
