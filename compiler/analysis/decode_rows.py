"""Block lists of split calls from the query rows' own keys (plan time, DESIGN §1).

A split call (decode, append, mixed batches) lists, for every query tile of every request,
the K/V blocks some row and head of the tile sees, and flags the blocks that need the element
mask (PARTIAL: some cell of the tile's rows x heads x the block's keys is hidden).  The
general route (``compiler.plan.decode_blocks``) runs the column analysis and the tile
classifier once per distinct (q_len, kv_len).  This module lists the same blocks from the rows:

* **Position runs** — a mask that reads no tensor and does not depend on the request ``b``
  says the same thing about absolute positions ``(q, k)`` in every request (the mask language
  has no length variables; bottom-right alignment puts request b's row i at
  ``q = kv_lens[b] - q_lens[b] + i``), and a request only cuts the keys at its length.  The
  transposed analysis (``intervals.row_intervals``'s, kept with every run) gives, once per spec
  and length bucket, the runs of keys ``[start, end)`` each position ``q`` sees, per head
  (:func:`position_runs`, cached); a call then looks its rows up and clips them at their
  lengths: O(rows + blocks) numpy work, no Python loop over requests.  Decode (one row per
  request, one head, one run of keys per row) reads a per-block-size table of every length's
  lists (:func:`decode_table`): one gather, then the runs laid end to end.
* **Row slab** — any other mask (it reads tensors, depends on b, or its runs are not exact)
  in a decode-shaped call (at most one query row per request) is evaluated at each request's
  one row over its keys, ``[tiles, H', S_k]`` cells (:func:`slab_lists`), with the IR
  interpreter's semantics and bounds checks; declared tensors are sliced, not gathered, where
  the subscript is ``b``, ``h`` or ``k`` itself.  This reads the tensor every call: O(B x H' x
  max kv_len) cells, hundreds of microseconds at B = 64 (``bench/plan_decode_cost.py``), still
  far below one analysis per distinct length.

Both are exact: a block is listed iff some cell in range is visible and is FULL iff every
cell in range (keys below the request's length) is — what the general route gives whenever
its analysis is exact (``tests/unit/test_decode_rows.py`` checks equality on every example,
and the oracle's cells where the general route is inexact and only safe).  A mask whose
general analysis is inexact gets the exact lists here, which are a subset of the safe ones.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from attnc.compiler import ir
from attnc.compiler.interp import ARITH, CALL, COMPARE, load
from .intervals import _Analyzer

# the smallest length bucket of the position runs (a spec's runs are made once per bucket)
MIN_POSITIONS = 1024
# specs whose position runs are kept (the one made longest ago goes first)
CACHE_SPECS = 16


@dataclass(frozen=True)
class PositionRuns:
    """For every absolute query position ``q < length`` and head ``h'`` (H' = 1 unless the mask
    reads ``h``), the runs of keys it sees: ``[start, end)``, int32 ``[H', length, R]``, sorted,
    disjoint, not touching; unused slots are empty (``start == end == length``)."""

    start: np.ndarray
    end: np.ndarray
    length: int
    # block_n -> the one-row table (decode_table), made on first use
    tables: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def heads(self) -> int:
        return self.start.shape[0]

    @property
    def width(self) -> int:
        return self.start.shape[2]


def reads_positions_only(program: ir.Program) -> bool:
    """Whether the mask's visibility is a function of (q, k, h) alone: no tensor, no ``b``, not
    the request's lengths."""
    names, loads = mask_facts(program)
    return not loads and not names & {"b", *ir.LENGTH_VARS}


def mask_facts(program: ir.Program) -> tuple[frozenset, frozenset]:
    """(the mask's variables, the tensors it reads), remembered per program object."""
    mine = _FACTS.get(id(program))
    if mine is None or mine[0] is not program:
        if len(_FACTS) >= 4 * CACHE_SPECS:
            _FACTS.clear()
        mine = _FACTS[id(program)] = (program, (ir.free_vars(program.mask), ir.loads(program.mask)))
    return mine[1]


_FACTS: dict = {}


def position_runs(program: ir.Program, length: int) -> PositionRuns | None:
    """The keys every position ``q < length`` sees (over keys ``< length``), from the column
    analysis of the transposed mask; None where it is inexact.  Only for masks that
    :func:`reads_positions_only`."""
    if not reads_positions_only(program):
        raise ValueError("position runs need a mask that reads no tensor and not b")
    i32 = ir.I32
    swapped = ir.substitute(program.mask, {"q": ir.Var("k", i32), "k": ir.Var("q", i32)})
    a = _Analyzer(program, 1, length, length, {}, transposed=True)
    visible = a.truth(swapped)
    if not visible.exact:
        return None
    runs = visible.must  # columns: (h', q) flattened; rows: keys
    heads = a.shape[1]
    width = max(runs.start.shape[1], 1)
    start = np.full((runs.columns, width), length, np.int64)
    end = np.full((runs.columns, width), length, np.int64)
    start[:, :runs.start.shape[1]], end[:, :runs.end.shape[1]] = runs.start, runs.end
    shape = (heads, length, width)
    return PositionRuns(start.astype(np.int32).reshape(shape), end.astype(np.int32).reshape(shape), length)


_CACHE: dict = {}  # (mask, H_q) -> (positions covered, PositionRuns or None), in the order made
_LOCK = threading.Lock()
_BY_ID: dict = {}  # id(program) -> (program, its cache key): a call skips hashing the mask


class _Key:
    """(mask, H_q) with its hash computed once: the mask's hash walks the expression tree."""

    __slots__ = ("value", "hash")

    def __init__(self, value: tuple):
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and self.value == other.value


def _remember(program: ir.Program) -> _Key:
    key = _Key((program.mask, program.heads_q))
    with _LOCK:
        if len(_BY_ID) >= 4 * CACHE_SPECS:
            _BY_ID.clear()
        _BY_ID[id(program)] = (program, key)
    return key


def cached_position_runs(program: ir.Program, need: int) -> PositionRuns | None:
    """:func:`position_runs` over at least ``need`` positions, made once per spec (its mask and
    head count) and power-of-two length bucket, and kept for the ``CACHE_SPECS`` specs made last;
    None (also kept) for a mask that does not :func:`reads_positions_only` or whose runs are not
    exact."""
    mine = _BY_ID.get(id(program))
    key = mine[1] if mine is not None and mine[0] is program else _remember(program)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] >= need:
        return hit[1]
    length = max(MIN_POSITIONS, 1 << max(int(need) - 1, 0).bit_length())
    if reads_positions_only(program):
        runs = position_runs(program, length)
    else:
        length, runs = 1 << 62, None
    with _LOCK:
        _CACHE.pop(key, None)
        _CACHE[key] = (length, runs)
        while len(_CACHE) > CACHE_SPECS:  # the spec made (or grown) longest ago goes first
            _CACHE.pop(next(iter(_CACHE)))
    return runs


def decode_table(runs: PositionRuns, block_n: int) -> tuple[np.ndarray, bool] | None:
    """For a request of every length ``T <= length`` with one query row (at ``q = T - 1``, the
    decode case), a mask with one head and one run of keys per row: int32 ``[5, length + 1]``
    columns indexed by T (visited blocks, first visited block, PARTIAL flag of the first, PARTIAL
    flag of the last, the request's blocks; T = 0 reads nothing).  Only the two ends of a run can
    be PARTIAL: block j is FULL iff ``j * block_n >= lo`` and ``min((j + 1) * block_n, T) <= hi``.
    Returned with whether some row (T >= 1) sees no key; None for several heads or runs.  Made
    once per block size."""
    if runs.heads != 1 or runs.width != 1:
        return None
    hit = runs.tables.get(block_n)
    if hit is not None:
        return hit
    bn = block_n
    t_len = np.arange(1, runs.length + 1, dtype=np.int64)
    hi = np.minimum(runs.end[0, :, 0], t_len)
    lo = np.minimum(runs.start[0, :, 0], hi)
    first, end = lo // bn, -(-hi // bn)
    some = hi > lo
    count = (end - first) * some
    f_lo, f_hi = -(-lo // bn), np.where(hi < t_len, hi // bn, end)  # FULL blocks: [f_lo, f_hi)
    cut_first = (first < f_lo) | (first >= f_hi)
    cut_last = (end <= f_lo) | (end > f_hi)
    single = count == 1  # its one block is both ends
    table = np.zeros((5, runs.length + 1), np.int32)  # column 0: T = 0
    table[:, 1:] = np.stack([count, first, (cut_first | (single & cut_last)) & some,
                             (cut_last | (single & cut_first)) & some, -(-t_len // bn)])
    runs.tables[block_n] = table, bool((count == 0).any())
    return runs.tables[block_n]


def one_row_lists(table: tuple[np.ndarray, bool], kv_lens: np.ndarray, nonempty: bool = False) -> TileLists:
    """Decode: one tile per request, its one row at ``kv_lens[b] - 1``, looked up in
    :func:`decode_table` — one gather, then the runs laid end to end (``nonempty``: the caller
    knows every length is >= 1)."""
    table, some_empty = table
    count, first, flag_first, flag_last, blocks_in = table[:, kv_lens]
    some_empty = some_empty or not (nonempty or kv_lens.all())
    ptr = np.zeros(len(count) + 1, np.int32)  # tile t's entries: [ptr[t], ptr[t + 1])
    np.cumsum(count, out=ptr[1:])
    starts, ends = ptr[:-1], ptr[1:]
    total = int(ptr[-1])
    blocks = np.arange(total, dtype=np.int32) - np.repeat(starts - first, count)
    partial = np.zeros(total + 1, np.int8)
    if some_empty and len(count) and count.min() == 0:  # tiles that see nothing write to the spare slot
        some = count > 0
        starts, last = np.where(some, starts, total), np.where(some, ends - 1, total)
    else:
        last = ends - 1
    partial[starts] = flag_first
    partial[last] = flag_last  # one-block runs: both flags are the same
    return TileLists(count, blocks, partial[:total], int(blocks_in.sum()) - total, ptr)



@functools.lru_cache(maxsize=64)
def constant(kind: str, n: int) -> np.ndarray:
    """Read-only per-size arrays every decode plan of a batch of ``n`` repeats: "ones" (int64),
    "arange" (int64 0..n-1), "arange32", "zeros32", "zeros" (int64)."""
    a = {"ones": lambda: np.ones(n, np.int64), "arange": lambda: np.arange(n, dtype=np.int64),
         "arange32": lambda: np.arange(n, dtype=np.int32), "zeros32": lambda: np.zeros(n, np.int32),
         "zeros": lambda: np.zeros(n, np.int64)}[kind]()
    a.setflags(write=False)
    return a


class TileLists(NamedTuple):
    """Per query tile (request order, then tile order), its visited blocks ascending, their
    PARTIAL flags, how many; and the blocks within the tiles' lengths no tile reads."""

    counts: np.ndarray   # int [tiles]
    blocks: np.ndarray   # int32 [entries]
    partial: np.ndarray  # int8 [entries]
    skipped: int
    ptr: np.ndarray | None = None  # int32 [tiles + 1], the counts' prefix sums, when at hand


def _tiles(kv_lens: np.ndarray, q_lens: np.ndarray, block_q: int):
    """Each tile's request, first row (within the request) and row count."""
    n_tiles = -(-q_lens // block_q)
    req = np.repeat(np.arange(len(kv_lens)), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    row0 = (np.arange(len(req)) - np.repeat(first, n_tiles)) * block_q
    rows = np.minimum(q_lens[req] - row0, block_q)
    return req, row0, rows


def run_lists(runs: PositionRuns, kv_lens: np.ndarray, q_lens: np.ndarray, block_n: int,
              block_q: int) -> TileLists:
    """The tiles' block lists from position runs (every request's rows at bottom-right positions,
    every row's runs cut at the request's length)."""
    req, row0, rows = _tiles(kv_lens, q_lens, block_q)
    t_len = kv_lens[req]
    if len(req) and int(t_len.max()) > runs.length:
        raise ValueError(f"position runs cover {runs.length} positions; a request has {int(t_len.max())}")
    if runs.heads == 1 and runs.width == 1 and (rows <= 1).all():
        q = np.maximum(t_len - q_lens[req] + row0, 0)  # T = 0 tiles (no row, no key) read nothing
        hi = np.minimum(runs.end[0, q, 0], t_len)
        lo = np.minimum(runs.start[0, q, 0], hi)
        return _one_run_lists(lo.astype(np.int64), hi.astype(np.int64), t_len, block_n)
    # several rows, heads or runs per tile: every (row, head, run) is an interval of keys
    n_rows = int(rows.sum())
    row_tile = np.repeat(np.arange(len(req)), rows)
    within = np.arange(n_rows) - np.repeat(np.cumsum(rows) - rows, rows)
    q = (t_len - q_lens[req] + row0)[row_tile] + within
    t_row = t_len[row_tile]
    hi = np.minimum(runs.end[:, q, :], t_row[None, :, None])  # [H', rows, R]
    lo = np.minimum(runs.start[:, q, :], hi)
    tile = np.broadcast_to(row_tile[None, :, None], hi.shape)
    return _interval_lists(tile.ravel(), lo.ravel().astype(np.int64), hi.ravel().astype(np.int64), t_len,
                           rows * runs.heads, block_n)


def _one_run_lists(lo, hi, t_len, block_n: int) -> TileLists:
    """One interval of keys per tile: its blocks are one run, PARTIAL at most at either end."""
    bn = block_n
    some = hi > lo
    first = lo // bn
    last = (hi - 1) // bn
    counts = np.where(some, last - first + 1, 0)
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    blocks = (np.arange(total) - np.repeat(starts - first, counts)).astype(np.int32)
    partial = np.zeros(total, np.int8)
    cut_first = (first * bn < lo) | (np.minimum((first + 1) * bn, t_len) > hi)
    cut_last = (last * bn < lo) | (np.minimum((last + 1) * bn, t_len) > hi)
    partial[starts[some]] = cut_first[some]
    partial[(starts + counts - 1)[some]] |= cut_last[some].astype(np.int8)
    skipped = int((-(-t_len // bn)).sum() - total)
    return TileLists(counts, blocks, partial, skipped)


def _interval_lists(tile, lo, hi, t_len, groups, block_n: int) -> TileLists:
    """Block lists from intervals of keys ``[lo, hi)`` (each already cut at its tile's length),
    ``groups[t]`` (row, head) pairs per tile whose intervals are each disjoint: a block is
    visited iff some interval meets it, FULL iff it lies inside one interval of every group."""
    bn, n = block_n, len(t_len)
    nb = -(-t_len // bn)
    width = int(nb.max(initial=0)) + 1
    some = hi > lo
    tile, lo, hi = tile[some], lo[some], hi[some]
    size = n * width
    base = tile * width
    diff = np.bincount(base + lo // bn, minlength=size) - np.bincount(base + (hi - 1) // bn + 1, minlength=size)
    visited = np.cumsum(diff.reshape(n, width), axis=1)[:, :-1] > 0
    tl = t_len[tile]
    f_lo = -(-lo // bn)
    f_hi = np.where(hi >= tl, -(-tl // bn), hi // bn)  # the request's last block counts up to its length
    whole = f_hi > f_lo
    diff = (np.bincount(base[whole] + f_lo[whole], minlength=size)
            - np.bincount(base[whole] + f_hi[whole], minlength=size))
    full = np.cumsum(diff.reshape(n, width), axis=1)[:, :-1] == np.asarray(groups)[:, None]
    return _from_grid(visited, full, nb)


def _from_grid(visited: np.ndarray, full: np.ndarray, nb: np.ndarray) -> TileLists:
    t, j = np.nonzero(visited)
    counts = visited.sum(axis=1)
    return TileLists(counts.astype(np.int64), j.astype(np.int32), (~full[t, j]).astype(np.int8),
                     int(nb.sum() - counts.sum()))


# ---------------------------------------------------------------- the row slab (decode-shaped calls)
_AXES = {"b": 0, "h": 1, "k": 2}


def slab_lists(program: ir.Program, kv_lens: np.ndarray, q_lens: np.ndarray, tensors: dict,
               block_n: int) -> TileLists:
    """The block lists of a call with at most one query row per request, from the mask evaluated
    at each tile's one row (``q = kv_lens[b] - 1``) over keys ``[0, max kv_len)``; a PlanError
    where the interpreter raises one (an out-of-range read, a division by zero)."""
    tiles = np.flatnonzero(q_lens > 0)
    nb_all = -(-kv_lens[tiles] // block_n)
    live = kv_lens[tiles] > 0  # a row over no keys (T = 0) reads nothing
    if not live.all():
        got = slab_lists(program, np.where(q_lens > 0, kv_lens, 0), (kv_lens > 0) & (q_lens > 0), tensors,
                         block_n) if live.any() else TileLists(np.zeros(0, np.int64), np.zeros(0, np.int32),
                                                               np.zeros(0, np.int8), 0)
        counts = np.zeros(len(tiles), np.int64)
        counts[live] = got.counts
        return TileLists(counts, got.blocks, got.partial, int(nb_all.sum() - counts.sum()))
    req = tiles
    t_len = kv_lens[req]
    bn, n = block_n, len(req)
    nb = nb_all
    s = int(t_len.max(initial=0))
    heads = program.heads_q if "h" in mask_facts(program)[0] else 1
    if n == 0:
        return _from_grid(np.zeros((0, 0), bool), np.zeros((0, 0), bool), nb)
    # positions in int32 (compares stay narrow; arithmetic widens to int64 as the interpreter's)
    idx = np.int32 if s < 2 ** 31 - 1 else np.int64
    env = {"b": req[:, None, None], "h": np.arange(heads, dtype=idx)[None, :, None],
           "q": (t_len - 1).astype(idx)[:, None, None], "k": np.arange(s, dtype=idx)[None, None, :],
           "S_q": np.ones((n, 1, 1), idx), "S_k": t_len.astype(idx)[:, None, None]}
    span = {"b": n if n == len(kv_lens) else None, "h": heads, "k": s}  # b: every request has a row
    vis = _evaluate(program.mask, env, tensors, span)
    width = int(nb.max()) * bn
    if vis.shape == (n, heads, width) and vis.dtype == bool and vis.flags.c_contiguous:
        cells = vis  # (already whole blocks)
    else:  # padded to whole blocks with hidden cells
        cells = np.zeros((n, heads, width), bool)
        cells[:, :, :s] = vis
    if bn == 64:  # a block is eight words of eight cells: popcounts, summed by one multiply (SWAR)
        counts = np.bitwise_count(cells.view(np.uint64)).reshape(n, heads, -1, 8)  # uint8, <= 8 each
        seen = (counts.view(np.uint64)[..., 0] * np.uint64(0x0101010101010101)) >> np.uint64(56)
    elif bn % 8 == 0:  # eight cells per word: count them with popcounts
        seen = np.bitwise_count(cells.view(np.uint64).reshape(n, heads, -1, bn // 8)).sum(axis=-1)
    else:
        seen = cells.reshape(n, heads, -1, bn).sum(axis=-1)
    # cells at keys >= the tile's length were counted: recount each tile's last block below its length
    cut = np.flatnonzero(t_len < nb * bn)
    if cut.size:
        last = nb[cut] - 1
        window = cells[cut[:, None, None], np.arange(heads)[None, :, None], (last * bn)[:, None, None]
                       + np.arange(bn)[None, None, :]]  # [cut, H', bn]
        inside = np.arange(bn)[None, :] < (t_len[cut] - last * bn)[:, None]
        seen[cut, :, last] = (window & inside[:, None, :]).sum(axis=-1)
    blocks = np.arange(width // bn)
    present = np.minimum(np.maximum(t_len[:, None] - blocks[None, :] * bn, 0), bn)  # keys of block j below T
    visited = seen.any(axis=1) & (blocks[None, :] < nb[:, None])
    full = (seen == present[:, None, :]).all(axis=1)
    return _from_grid(visited, full, nb)


def _evaluate(e: ir.Expr, env: dict, tensors: dict, span: dict, care=None):
    """``interp.evaluate`` on the slab's axes (b, h, k), with the language's semantics (integer
    arithmetic in int64, floats in f32, a read outside a tensor an error only where ``where``
    uses it), except that positions and reads stay as narrow as they are stored until arithmetic
    needs int64, and a read whose subscripts are ``b``, ``h``, ``k`` themselves, in that order, is
    a slice, not a gather."""
    rec = lambda x, c=care: _evaluate(x, env, tensors, span, c)  # noqa: E731
    if isinstance(e, ir.Const):
        if e.type is ir.I32:  # (compares with int32 positions stay narrow)
            return np.asarray(e.value, np.int32)
        return np.asarray(e.value, {ir.BOOL: bool, ir.I64: np.int64, ir.F32: np.float32}[e.type])
    if isinstance(e, ir.Var):
        return env[e.name]
    if isinstance(e, ir.Load):
        arr = tensors[e.tensor]
        got = _sliced(e, arr, span)
        if got is None:
            got = load(e.tensor, arr, tuple(rec(i) for i in e.index), care)
        return got.astype(np.float32) if got.dtype.kind == "f" else got
    if isinstance(e, ir.Select):
        c = rec(e.cond)
        yes, no = (c, ~c) if care is None else (care & c, care & ~c)
        return np.where(c, rec(e.if_true, yes), rec(e.if_false, no))
    if isinstance(e, ir.Binary) and e.op in ("and", "or"):  # the right side's errors count where it decides
        a = rec(e.left)
        side = a if e.op == "and" else ~a
        return ARITH[e.op](a, rec(e.right, side if care is None else care & side))
    if isinstance(e, ir.Unary):
        x = rec(e.operand)
        if e.op == "neg":
            return np.negative(_wide(x))
        if e.op == "not":
            return np.logical_not(x)
        return np.asarray(x, np.float32) if e.op == "cast_f32" else _wide(x)
    if isinstance(e, ir.Compare):
        return COMPARE[e.op](rec(e.left), rec(e.right))
    args = [rec(a) for a in ir.children(e)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if isinstance(e, ir.Binary):
            return ARITH[e.op](*(_wide(a) for a in args))
        if isinstance(e, ir.Call):
            return CALL[e.fn](*(_wide(a) for a in args))
    raise TypeError(e)


def _wide(x):
    """Integers as int64 before arithmetic (the interpreter's i32 semantics)."""
    x = np.asarray(x)
    return x.astype(np.int64) if x.dtype.kind in "iu" and x.dtype != np.int64 else x


def _sliced(e: ir.Load, arr: np.ndarray, span: dict):
    """``arr[:n_b, :H', :S]`` reshaped onto the slab's axes when every subscript is one of b, h, k
    (each once, in that order, each within the tensor's axis), else None."""
    if len(e.index) != arr.ndim:
        return None
    axes = []
    for ix, size in zip(e.index, arr.shape):
        if not (isinstance(ix, ir.Var) and ix.name in _AXES) or span[ix.name] is None or span[ix.name] > size:
            return None
        axes.append(_AXES[ix.name])
    if axes != sorted(set(axes)):
        return None
    got = arr[tuple(slice(0, span[{0: "b", 1: "h", 2: "k"}[a]]) for a in axes)]
    shape = [1, 1, 1]
    for a, n in zip(axes, got.shape):
        shape[a] = n
    return got.reshape(shape)
