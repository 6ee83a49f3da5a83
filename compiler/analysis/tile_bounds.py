"""Tile classes from bounds: the mask over a whole tile at once, before any cell of it (issue 34).

Over one tile the positions range over a box: ``q`` over the tile's rows, ``k`` over its keys,
``b`` and ``h`` fixed.  Interval arithmetic gives every integer subexpression bounds ``[lo, hi]``
over the box and every condition whether it can be true and whether it can be false somewhere
in it, vectorized over the tiles (numpy arrays, one entry per tile; never a loop per tile).  A
tile whose mask cannot be false is FULL, one where it cannot be true SKIP: exact classes, decided
without evaluating a cell.  Where the bounds cannot decide (the tile is PARTIAL, or its bounds
are loose) the caller evaluates cells (``tile_eval``).

Where the interval analysis gives up, bounds often still decide: ``q % 1024 < 16`` over rows
128..255 of a period is false; ``(q & k & 3072) == 0`` over 128-aligned tiles is one value (the
known bits of a range); ``doc[b, q] == doc[b, k]`` is false where the two tiles' document ids
(range minima and maxima of the tensor, from a sparse table) do not overlap.

The rules follow ``compiler.interp`` (integers exact in int64, ``x // 0 = 0``, ``x % 0 = x``,
floor division and the divisor-signed remainder); floats are unbounded.  A read outside its
tensor is an error where its value is used (interp's ``care``): a tile where such a read may be
used is left to the cells, whose evaluation raises the oracle's error.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ir, resources
from .tiles import FULL, SKIP

UNDECIDED = -1
BIG = np.int64(1) << 61  # bounds past it are unbounded (sums and differences of two stay inside int64)
SMALL = np.int64(1) << 31  # products of bounds within it stay inside int64
STEP_TILES = 1 << 16  # tiles one step bounds (a few int64 arrays each per subexpression)


@dataclass
class _Int:
    lo: np.ndarray  # int64 [n]
    hi: np.ndarray
    err: np.ndarray  # bool [n]: a read outside its tensor may be used here


@dataclass
class _Bool:
    can_true: np.ndarray  # bool [n]
    can_false: np.ndarray
    err: np.ndarray


def tile_bounds_classes(program: ir.Program, s_q: int, s_k: int, tensors: dict, tiles: np.ndarray,
                        block_m: int, block_n: int) -> np.ndarray:
    """int8 per tile (int64 ``[n, 4]``: b', h', query tile, key tile): SKIP where the mask cannot
    be true over the tile, FULL where it cannot be false, ``UNDECIDED`` elsewhere.  A tile across
    S_q or S_k counts the rows and keys inside only (as ``tile_eval`` does)."""
    tiles = np.asarray(tiles, np.int64).reshape(-1, 4)
    out = np.full(len(tiles), UNDECIDED, np.int8)
    ranges = _RangeTables(tensors)
    q0 = s_k - s_q
    for t0 in range(0, len(tiles), STEP_TILES):
        t = tiles[t0:t0 + STEP_TILES]
        row0, key0 = t[:, 2] * block_m, t[:, 3] * block_n
        box = {"q": (q0 + row0, q0 + np.minimum(row0 + block_m, s_q) - 1),
               "k": (key0, np.minimum(key0 + block_n, s_k) - 1),
               "b": (t[:, 0], t[:, 0]), "h": (t[:, 1], t[:, 1])}
        v = _Bounds(box, {"S_q": s_q, "S_k": s_k}, tensors, ranges, len(t)).bool(program.mask)
        decided = ~v.err & (v.can_true != v.can_false)
        out[t0:t0 + STEP_TILES] = np.where(decided, np.where(v.can_true, FULL, SKIP), UNDECIDED)
    return out


class _Bounds:
    """Bounds of IR expressions over the boxes of ``n`` tiles."""

    def __init__(self, box: dict, lengths: dict, tensors: dict, ranges: "_RangeTables", n: int):
        self.box, self.lengths, self.tensors, self.ranges, self.n = box, lengths, tensors, ranges, n
        self.no_err = np.zeros(n, bool)

    def point(self, value) -> _Int:
        if not -BIG <= value <= BIG:
            return self.top(self.no_err)
        v = np.full(self.n, value, np.int64)
        return _Int(v, v, self.no_err)

    def top(self, err) -> _Int:
        return _Int(np.full(self.n, -BIG), np.full(self.n, BIG), err)

    def unknown(self, err) -> _Bool:
        yes = np.ones(self.n, bool)
        return _Bool(yes, yes, err)

    def bound(self, lo, hi, err) -> _Int:
        """``[lo, hi]``, unbounded where it leaves ``[-BIG, BIG]``."""
        wide = (lo < -BIG) | (hi > BIG)
        if wide.any():
            lo, hi = np.where(wide, -BIG, lo), np.where(wide, BIG, hi)
        return _Int(lo, hi, err)

    # -------------------------------------------------------------- conditions
    def bool(self, e: ir.Expr) -> _Bool:
        if isinstance(e, ir.Const):
            return _Bool(np.full(self.n, bool(e.value)), np.full(self.n, not e.value), self.no_err)
        if isinstance(e, ir.Unary) and e.op == "not":
            a = self.bool(e.operand)
            return _Bool(a.can_false, a.can_true, a.err)
        if isinstance(e, ir.Binary) and e.op in ("and", "or"):  # the right side's reads count where it decides
            a, b = self.bool(e.left), self.bool(e.right)
            if e.op == "and":
                return _Bool(a.can_true & b.can_true, a.can_false | b.can_false, a.err | (b.err & a.can_true))
            return _Bool(a.can_true | b.can_true, a.can_false & b.can_false, a.err | (b.err & a.can_false))
        if isinstance(e, ir.Select):
            c, t, f = self.bool(e.cond), self.bool(e.if_true), self.bool(e.if_false)
            return _Bool((c.can_true & t.can_true) | (c.can_false & f.can_true),
                         (c.can_true & t.can_false) | (c.can_false & f.can_false),
                         c.err | (t.err & c.can_true) | (f.err & c.can_false))
        if isinstance(e, ir.Compare):
            return self.compare(e)
        if isinstance(e, ir.Load):
            v = self.load(e)
            return _Bool(v.hi > 0, v.lo <= 0, v.err)
        raise TypeError(f"not a condition: {e!r}")

    def compare(self, e: ir.Compare) -> _Bool:
        if e.left.type is ir.BOOL:
            a, b = self.bool(e.left), self.bool(e.right)
            same = (a.can_true & b.can_true) | (a.can_false & b.can_false)
            differ = (a.can_true & b.can_false) | (a.can_false & b.can_true)
            t, f = (same, differ) if e.op == "eq" else (differ, same)
            return _Bool(t, f, a.err | b.err)
        a, b = self.int(e.left), self.int(e.right)
        err = a.err | b.err
        if not (e.left.type.integer and e.right.type.integer):  # floats: unbounded
            return self.unknown(err)
        op = e.op
        if op in ("gt", "ge"):  # a > b  is  b < a
            a, b, op = b, a, {"gt": "lt", "ge": "le"}[op]
        if op == "lt":
            return _Bool(a.lo < b.hi, a.hi >= b.lo, err)
        if op == "le":
            return _Bool(a.lo <= b.hi, a.hi > b.lo, err)
        overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
        one = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
        t, f = (overlap, ~one) if op == "eq" else (~one, overlap)
        return _Bool(t, f, err)

    # -------------------------------------------------------------- integers
    def int(self, e: ir.Expr) -> _Int:
        """Bounds of an integer expression (a float one: unbounded, with its reads' errors)."""
        if not e.type.integer:
            if isinstance(e, ir.Load):
                return self.load(e)
            errs = [self.int(c).err for c in ir.children(e) if c.type is not ir.BOOL] + \
                   [self.bool(c).err for c in ir.children(e) if c.type is ir.BOOL]
            return self.top(np.logical_or.reduce(errs) if errs else self.no_err)
        if isinstance(e, ir.Const):
            return self.point(e.value)
        if isinstance(e, ir.Var):
            if e.name in self.box:
                lo, hi = self.box[e.name]
                return _Int(lo, hi, self.no_err)
            return self.point(self.lengths[e.name])
        if isinstance(e, ir.Load):
            return self.load(e)
        if isinstance(e, ir.Unary):
            a = self.int(e.operand)
            return _Int(-a.hi, -a.lo, a.err) if e.op == "neg" else a  # neg, or cast_i64 (a width)
        if isinstance(e, ir.Select):
            c, t, f = self.bool(e.cond), self.int(e.if_true), self.int(e.if_false)
            only_t, only_f = c.can_true & ~c.can_false, c.can_false & ~c.can_true
            lo = np.where(only_t, t.lo, np.where(only_f, f.lo, np.minimum(t.lo, f.lo)))
            hi = np.where(only_t, t.hi, np.where(only_f, f.hi, np.maximum(t.hi, f.hi)))
            return _Int(lo, hi, c.err | (t.err & c.can_true) | (f.err & c.can_false))
        if isinstance(e, ir.Call):
            return self.call(e.fn, [self.int(x) for x in e.args])
        if isinstance(e, ir.Binary):
            return self.arith(e.op, self.int(e.left), self.int(e.right))
        raise TypeError(f"not an integer expression: {e!r}")

    def call(self, fn: str, args: list[_Int]) -> _Int:
        err = np.logical_or.reduce([a.err for a in args])
        if fn in ("min", "max"):
            a, b = args
            f = np.minimum if fn == "min" else np.maximum
            return _Int(f(a.lo, b.lo), f(a.hi, b.hi), err)
        a, = args
        if fn == "abs":
            lo = np.where(a.lo >= 0, a.lo, np.where(a.hi <= 0, -a.hi, 0))
            return _Int(lo, np.maximum(np.abs(a.lo), np.abs(a.hi)), err)
        if fn == "sign":
            return _Int(np.sign(a.lo), np.sign(a.hi), err)
        return self.top(err)

    def arith(self, op: str, a: _Int, b: _Int) -> _Int:
        err = a.err | b.err
        if op == "add":
            return self.bound(a.lo + b.lo, a.hi + b.hi, err)
        if op == "sub":
            return self.bound(a.lo - b.hi, a.hi - b.lo, err)
        if op == "mul":
            small = (np.maximum(np.abs(a.lo), np.abs(a.hi)) <= SMALL) & (np.maximum(np.abs(b.lo), np.abs(b.hi)) <= SMALL)
            ends = [np.where(small, x * y, 0) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return self.bound(np.where(small, np.minimum.reduce(ends), -BIG - 1),
                              np.where(small, np.maximum.reduce(ends), BIG + 1), err)
        if op == "floordiv":
            return self.floordiv(a, b, err)
        if op == "mod":
            return self.mod(a, b, err)
        if op in ("bitand", "bitor", "bitxor"):
            return self.bits(op, a, b, err)
        if op in ("shl", "shr"):
            s = np.clip(b.lo, 0, 62)
            ok = (b.lo == b.hi) & (b.lo >= 0) & (b.lo <= 62)
            if op == "shr":  # an arithmetic shift is floor(x / 2^s): monotone
                lo, hi = a.lo >> s, a.hi >> s
            else:
                ok &= np.maximum(np.abs(a.lo), np.abs(a.hi)) < (BIG >> s)
                lo, hi = np.where(ok, a.lo, 0) << s, np.where(ok, a.hi, 0) << s
            return self.bound(np.where(ok, lo, -BIG - 1), np.where(ok, hi, BIG + 1), err)
        return self.top(err)  # (a float "div" has a float type and never reaches here)

    def floordiv(self, a: _Int, b: _Int, err) -> _Int:
        """Floor division is monotone in each operand on a divisor range of one sign: its bounds
        are among the four corners; ``x // 0 = 0``; a divisor range across 0 is unbounded."""
        signed = (b.lo > 0) | (b.hi < 0)
        d_lo, d_hi = np.where(signed, b.lo, 1), np.where(signed, b.hi, 1)
        ends = [x // y for x in (a.lo, a.hi) for y in (d_lo, d_hi)]
        zero = (b.lo == 0) & (b.hi == 0)
        known = signed | zero
        return self.bound(np.where(known, np.where(zero, 0, np.minimum.reduce(ends)), -BIG - 1),
                          np.where(known, np.where(zero, 0, np.maximum.reduce(ends)), BIG + 1), err)

    def mod(self, a: _Int, b: _Int, err) -> _Int:
        """``a % d`` for one divisor d per tile: within one period (one quotient) the remainder is
        ``a - quotient * d``, increasing; across periods it is any of d's remainders; ``x % 0 = x``."""
        d = np.where(b.lo == b.hi, b.lo, 0)
        one = (b.lo == b.hi) & (d != 0)
        safe = np.where(one, d, 1)
        same = one & (a.lo // safe == a.hi // safe)
        lo = np.where(same, a.lo % safe, np.where(d > 0, 0, d + 1))
        hi = np.where(same, a.hi % safe, np.where(d > 0, d - 1, 0))
        zero = (b.lo == 0) & (b.hi == 0)
        lo, hi = np.where(zero, a.lo, lo), np.where(zero, a.hi, hi)
        known = one | zero
        return self.bound(np.where(known, lo, -BIG - 1), np.where(known, hi, BIG + 1), err)

    def bits(self, op: str, a: _Int, b: _Int, err) -> _Int:
        """``&``, ``|``, ``^`` of non-negative ranges by known bits: the bits above the highest
        one that differs between a range's ends are the same across it."""
        ok = (a.lo >= 0) & (b.lo >= 0)
        ones_a, zeros_a = _known_bits(np.where(ok, a.lo, 0), np.where(ok, a.hi, 0))
        ones_b, zeros_b = _known_bits(np.where(ok, b.lo, 0), np.where(ok, b.hi, 0))
        if op == "bitand":
            ones, zeros = ones_a & ones_b, zeros_a | zeros_b
        elif op == "bitor":
            ones, zeros = ones_a | ones_b, zeros_a & zeros_b
        else:
            ones, zeros = (ones_a & zeros_b) | (zeros_a & ones_b), (ones_a & ones_b) | (zeros_a & zeros_b)
        free = MASK & ~(ones | zeros)
        return self.bound(np.where(ok, ones, -BIG - 1), np.where(ok, ones | free, BIG + 1), err)

    # -------------------------------------------------------------- reads
    def load(self, e: ir.Load) -> _Int:
        """A tensor's values over the box: a point read, or the range's minimum and maximum where
        one subscript ranges (the others fixed); an error where a subscript may leave the tensor."""
        array = self.tensors[e.tensor]
        index = [self.int(i) for i in e.index]
        err = np.logical_or.reduce([i.err for i in index]) if index else self.no_err
        for i, n in zip(index, array.shape):
            err = err | (i.lo < 0) | (i.hi >= n)
        if array.dtype.kind not in "iub":
            return self.top(err)
        ranged = [i.lo != i.hi for i in index]
        count = np.sum(ranged, axis=0) if index else np.zeros(self.n, int)
        lo, hi = np.full(self.n, -BIG), np.full(self.n, BIG)
        # clamped subscripts: a tile that may read outside is left to the cells anyway
        first = [np.clip(i.lo, 0, n - 1) for i, n in zip(index, array.shape)]
        last = [np.clip(i.hi, 0, n - 1) for i, n in zip(index, array.shape)]
        at = count == 0
        if at.any():
            v = array[tuple(f[at] for f in first)].astype(np.int64)
            lo[at], hi[at] = v, v
        for axis in range(len(index)):
            sel = (count == 1) & ranged[axis]
            if sel.any():
                lo[sel], hi[sel] = self.ranges.min_max(e.tensor, array, axis, [f[sel] for f in first],
                                                       last[axis][sel])
        return self.bound(lo, hi, err)


MASK = np.int64(np.iinfo(np.int64).max)  # the bits a non-negative value may have


def _known_bits(lo: np.ndarray, hi: np.ndarray):
    """(bits set in every value of ``[lo, hi]``, bits clear in every value), ``0 <= lo <= hi``."""
    vary = lo ^ hi
    for s in (1, 2, 4, 8, 16, 32):  # every bit at or below the highest differing one
        vary |= vary >> s
    return lo & ~vary, MASK & ~lo & ~vary


class _RangeTables:
    """Minima and maxima of a tensor over index ranges along one axis (a sparse table: level j
    holds each window of 2^j entries), built a level at a time for the queries at hand."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def min_max(self, name: str, array: np.ndarray, axis: int, first: list, last: np.ndarray):
        """Per query: the min and max of ``array`` over ``first[axis]..last`` along ``axis`` (the
        other subscripts ``first``), each range inside the tensor."""
        a = np.moveaxis(np.asarray(array), axis, -1)
        if a.dtype.kind == "b":
            a = a.astype(np.int8)
        resources.require(f"the range minima and maxima of tensor '{name}' (tile bounds)", 4 * a.size * a.itemsize)
        others = tuple(f for i, f in enumerate(first) if i != axis)
        start = first[axis]
        length = last - start + 1
        level = np.zeros(len(start), np.int64)
        while True:  # level = floor(log2(length)), in integers
            up = (np.int64(2) << level) <= length
            if not up.any():
                break
            level += up
        lo, hi = np.empty(len(start), np.int64), np.empty(len(start), np.int64)
        small, large = a, a
        for j in range(int(level.max(initial=0)) + 1):
            sel = level == j
            if sel.any():
                i1, i2 = start[sel], last[sel] - (1 << j) + 1
                o = tuple(x[sel] for x in others)
                lo[sel] = np.minimum(small[o + (i1,)], small[o + (i2,)])
                hi[sel] = np.maximum(large[o + (i1,)], large[o + (i2,)])
            w = 1 << j
            small = np.minimum(small[..., :-w], small[..., w:])
            large = np.maximum(large[..., :-w], large[..., w:])
        return lo, hi
