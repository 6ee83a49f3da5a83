"""FlashMask column intervals by abstract interpretation of the mask (DESIGN §4, M4.5 §0x06).

For concrete ``S_q``, ``S_k`` and runtime tensors, every key column gets the set of
query *rows* ``i`` (``q = S_k - S_q + i``) where the mask is true, as a list of
half-open intervals — computed by interpreting the mask over sets of rows,
vectorized over columns with numpy, never by evaluating the ``S_q x S_k``
rectangle.

The abstract value of a condition is a pair of row sets per column, ``must``
(rows where it is certainly true) and ``may`` (rows where it may be true).
Atoms the analysis can solve (linear comparisons in ``q`` or ``q // C`` with
column-dependent coefficients, column-only predicates, ``t[.., q] op c`` over
monotone or run-structured tensors) are exact: ``must == may``.  Anything else
(``(q - k) % 2 == 0``, ``q`` in float arithmetic, ...) is *unknown*:
``must = {}``, ``may = all rows``, and the result is marked inexact with the
atom as the reason.  ``&``, ``|``, ``!`` are intersection, union and the
complement that swaps ``must`` and ``may``, so tile classes derived from the
pair are always safe (SKIP only where nothing may be visible, FULL only where
everything must be) and exact whenever the analysis is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnc.compiler import ir, resources
from attnc.compiler.errors import PlanError
from attnc.compiler.interp import evaluate, load
from attnc.compiler.ranges import check_length


# ---------------------------------------------------------------- interval lists
@dataclass(frozen=True)
class Runs:
    """Per column ``n``, sorted disjoint non-adjacent intervals ``[start[n, r], end[n, r])``
    of rows in ``[0, rows)``; unused slots hold ``[rows, rows)``."""

    start: np.ndarray  # int64 [N, R]
    end: np.ndarray
    rows: int

    @property
    def columns(self) -> int:
        return self.start.shape[0]

    @staticmethod
    def between(lo, hi, rows: int, columns: int) -> "Runs":
        """One interval ``[lo, hi)`` per column, clipped to the row range."""
        lo = _clamp(np.broadcast_to(np.asarray(lo, np.int64), (columns,)), 0, rows)
        hi = _clamp(np.broadcast_to(np.asarray(hi, np.int64), (columns,)), 0, rows)
        return _normalize(lo[:, None], hi[:, None], rows)

    @staticmethod
    def every(rows: int, columns: int, holds: bool) -> "Runs":
        """Every row of every column (``holds``), else none: ``between(0, rows or 0, ...)`` made
        directly."""
        end = np.full((columns, 1), rows, np.int64)
        return Runs(np.zeros((columns, 1), np.int64) if holds else end.copy(), end, rows)

    @staticmethod
    def where(flag, rows: int, columns: int) -> "Runs":
        """All rows where ``flag`` (a per-column bool) holds, none elsewhere."""
        flag = np.broadcast_to(np.asarray(flag, bool), (columns,))
        return Runs.between(0, np.where(flag, rows, 0), rows, columns)

    def count(self) -> np.ndarray:
        """Number of runs per column."""
        return (self.end > self.start).sum(axis=1)

    def complement(self) -> "Runs":
        n = self.columns
        starts = np.concatenate([np.zeros((n, 1), np.int64), self.end], axis=1)
        ends = np.concatenate([self.start, np.full((n, 1), self.rows, np.int64)], axis=1)
        return _normalize(starts, ends, self.rows)

    def _full(self) -> bool:
        """Every column holds every row (one run ``[0, rows)``, as a normalized full set is held)."""
        return self.start.shape[1] == 1 and not self.start.any() and bool((self.end == self.rows).all())

    def _empty(self) -> bool:
        return not (self.end > self.start).any()

    def _trivial(self, other: "Runs") -> bool:
        """Whether the shortcuts of ``&`` and ``|`` apply: with rows and columns, a full or empty set
        (an atom the analysis gave up on, a guard that always holds) combines without a normalize,
        into the very arrays (widths included) the normalize would give."""
        return bool(self.rows and self.columns and self.start.shape[1] and other.start.shape[1])

    def __and__(self, other: "Runs") -> "Runs":
        if self._trivial(other):
            if other._full():
                return self
            if self._full():
                return other
        s = np.maximum(self.start[:, :, None], other.start[:, None, :]).reshape(self.columns, -1)
        e = np.minimum(self.end[:, :, None], other.end[:, None, :]).reshape(self.columns, -1)
        return _normalize(s, e, self.rows)

    def __or__(self, other: "Runs") -> "Runs":
        if self._trivial(other):
            for a, b in ((self, other), (other, self)):
                if b._full():
                    return b
                if b._empty():
                    return a
        return _normalize(np.concatenate([self.start, other.start], axis=1),
                          np.concatenate([self.end, other.end], axis=1), self.rows)

    def __eq__(self, other) -> bool:
        if other is self:
            return True
        return (isinstance(other, Runs) and self.rows == other.rows
                and self.start.shape[0] == other.start.shape[0]
                and np.array_equal(*_same_width(self.start, other.start, self.rows))
                and np.array_equal(*_same_width(self.end, other.end, self.rows)))

    __hash__ = None

    def cells_in(self, i0, i1) -> np.ndarray:
        """Per column, how many rows of ``[i0, i1)`` the runs contain (i0/i1 broadcast)."""
        i0 = np.asarray(i0)[..., None]
        i1 = np.asarray(i1)[..., None]
        overlap = np.minimum(self.end, i1) - np.maximum(self.start, i0)
        return np.clip(overlap, 0, None).sum(axis=-1)

    def dense(self) -> np.ndarray:
        """bool [N, rows] (tests and small fallbacks only)."""
        i = np.arange(self.rows)
        return ((i >= self.start[:, :, None]) & (i < self.end[:, :, None])).any(axis=1)


def _same_width(a, b, fill):
    w = max(a.shape[1], b.shape[1])
    pad = lambda x: x if x.shape[1] == w else np.concatenate(  # noqa: E731
        [x, np.full((x.shape[0], w - x.shape[1]), fill, x.dtype)], axis=1)
    return pad(a), pad(b)


def _clamp(x, lo, hi):
    """``np.clip(x, lo, hi)`` (np.clip with Python ints costs about 4x two ufuncs)."""
    return np.minimum(np.maximum(x, lo), hi)


def _normalize(start: np.ndarray, end: np.ndarray, rows: int) -> Runs:
    """Sort, drop empties, merge overlapping or touching intervals, compact.  The bounds are rows
    already, in ``[0, rows]`` (``Runs.between`` clips; the set operations keep them there)."""
    valid = end > start
    if start.shape[1] == 1:
        return Runs(np.where(valid, start, rows), np.where(valid, end, rows), rows)
    big = np.int64(rows + 1)
    s = np.where(valid, start, big)
    e = np.where(valid, end, big)
    if s.shape[1] == 2:
        return _normalize_pair(s, e, big, rows)
    order = np.argsort(s, axis=1, kind="stable")
    s, e = np.take_along_axis(s, order, 1), np.take_along_axis(e, order, 1)
    valid = s < big
    reach = np.maximum.accumulate(np.where(valid, e, -1), axis=1)  # furthest end so far
    prev_reach = np.concatenate([np.full((s.shape[0], 1), -1, np.int64), reach[:, :-1]], axis=1)
    new_run = valid & (s > prev_reach)
    run_id = np.cumsum(new_run, axis=1) - 1
    width = int(new_run.sum(axis=1).max()) if s.size else 0
    out_s = np.full((s.shape[0], width), rows, np.int64)
    out_e = np.full((s.shape[0], width), rows, np.int64)
    rows_idx = np.broadcast_to(np.arange(s.shape[0])[:, None], s.shape)
    out_s[rows_idx[new_run], run_id[new_run]] = s[new_run]
    nxt_new = np.concatenate([new_run[:, 1:] | ~valid[:, 1:], np.ones((s.shape[0], 1), bool)], axis=1)
    last = valid & nxt_new
    out_e[rows_idx[last], run_id[last]] = reach[last]
    return Runs(out_s, out_e, rows)


def _normalize_pair(s: np.ndarray, e: np.ndarray, big, rows: int) -> Runs:
    """_normalize for two intervals per column: one compare-and-swap and one merge test."""
    swap = s[:, 0] > s[:, 1]
    s0, s1 = np.where(swap, s[:, 1], s[:, 0]), np.where(swap, s[:, 0], s[:, 1])
    e0, e1 = np.where(swap, e[:, 1], e[:, 0]), np.where(swap, e[:, 0], e[:, 1])
    merge = (s1 <= e0) & (s1 < big)
    first_s = np.where(s0 < big, s0, rows)
    first_e = np.where(s0 < big, np.where(merge, np.maximum(e0, e1), e0), rows)
    two = (s1 < big) & ~merge
    if not two.any():
        return Runs(first_s[:, None], first_e[:, None], rows)
    return Runs(np.stack([first_s, np.where(two, s1, rows)], 1), np.stack([first_e, np.where(two, e1, rows)], 1), rows)


@dataclass(frozen=True)
class Truth:
    """Rows where a condition must / may hold, per column."""

    must: Runs
    may: Runs

    @property
    def exact(self) -> bool:
        return self.must == self.may

    # an exact solver's result holds one Runs as both must and may: its operations compute once
    def __and__(self, o: "Truth") -> "Truth":
        if self.must is self.may and o.must is o.may:
            r = self.must & o.must
            return Truth(r, r)
        return Truth(self.must & o.must, self.may & o.may)

    def __or__(self, o: "Truth") -> "Truth":
        if self.must is self.may and o.must is o.may:
            r = self.must | o.must
            return Truth(r, r)
        return Truth(self.must | o.must, self.may | o.may)

    def __invert__(self) -> "Truth":
        if self.must is self.may:
            r = self.must.complement()
            return Truth(r, r)
        return Truth(self.may.complement(), self.must.complement())


# ---------------------------------------------------------------- linear forms
class NotInterval(Exception):
    """The analysis cannot solve this atom exactly; the message says why."""


@dataclass(frozen=True)
class Linear:
    """``a * ((q + off) // d) + c`` per column (all int64 [N]); ``d == 1`` means plain ``q``."""

    a: np.ndarray
    c: np.ndarray
    d: np.ndarray
    off: np.ndarray


@dataclass(frozen=True)
class QLoad:
    """``tensor[.., q + off, ..]``: per column, a row of the tensor along its ``s`` axis."""

    tensor: str
    table: np.ndarray  # [M, L] distinct rows
    row_of: np.ndarray  # [N] which row each column reads
    off: np.ndarray  # [N]


_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


@dataclass(frozen=True)
class MaskIntervals:
    """The analysis result for one call shape.  Columns are flattened ``[B', H', S_k]`` where
    ``B'`` is B if the mask depends on the request (else 1) and ``H'`` likewise for heads."""

    visible: Truth
    shape: tuple[int, int, int]
    s_q: int
    s_k: int
    exact: bool
    representable: bool
    reason: str | None
    UTS: np.ndarray | None = None  # int32 [B', H', S_k] row indices, half-open
    UTE: np.ndarray | None = None
    LTS: np.ndarray | None = None
    LTE: np.ndarray | None = None
    method: str = "analysis"  # or "evaluation": evaluate_columns, cell by cell

    @property
    def q_offset(self) -> int:
        return self.s_k - self.s_q

    def vectors(self) -> dict[str, np.ndarray]:
        return {"UTS": self.UTS, "UTE": self.UTE, "LTS": self.LTS, "LTE": self.LTE}


def column_shape(program: ir.Program, batch: int, s_k: int) -> tuple[int, int, int]:
    """``(B', H', S_k)``: the analysed columns (B' = B if the mask reads b, else 1; H' likewise)."""
    names = ir.free_vars(program.mask)
    return (batch if "b" in names else 1, program.heads_q if "h" in names else 1, s_k)


def require_columns(program: ir.Program, batch: int, s_k: int, axis: str = "S_k") -> tuple[int, int, int]:
    """:func:`column_shape`, after refusing a length past int32 positions or an analysis over the
    memory limit."""
    resources.check_length(axis, s_k)
    shape = column_shape(program, batch, s_k)
    n = shape[0] * shape[1] * s_k
    resources.require(f"the interval analysis of '{program.name}' ({n:,} columns: B' x H' x {axis} = "
                      f"{shape[0]} x {shape[1]} x {s_k})", resources.intervals_bytes(n))
    return shape


class _Analyzer:
    def __init__(self, program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict, transposed=False,
                 lengths: tuple[int, int] | None = None):
        if s_q < 0 or s_k < 0 or batch < 0:
            raise PlanError(f"negative length: B = {batch}, S_q = {s_q}, S_k = {s_k}")
        if s_q > s_k and not transposed:
            raise PlanError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys (bottom-right alignment)")
        check_length(max(s_q, s_k))
        self.program, self.tensors = program, tensors
        self.shape = require_columns(program, batch, s_k, "S_q" if transposed else "S_k")
        self.n = int(np.prod(self.shape))
        self.rows, self.q0 = s_q, s_k - s_q
        length_q, length_k = lengths or (s_q, s_k)  # the call's S_q, S_k (a transposed analysis swaps rows)
        self.env = {"b": np.arange(self.shape[0]).reshape(-1, 1, 1),
                    "h": np.arange(self.shape[1]).reshape(1, -1, 1),
                    "k": np.arange(s_k).reshape(1, 1, -1),
                    "S_q": np.asarray(length_q), "S_k": np.asarray(length_k)}
        self.reasons: list[str] = []
        # where the value being analyzed is used (the language's guards: where's branches, the
        # right side of & and |; reads outside a tensor are errors only there): a column-only
        # guard narrows ``care`` (per column), a guard on q ``rows_cared`` (the rows per column
        # where it holds); a guard the analysis cannot solve exactly makes ``lenient`` true, and a
        # read at q that may leave its tensor is then left to the per-cell evaluation
        self.care: np.ndarray | None = None
        self.rows_cared: Runs | None = None
        self.lenient = False
        self._facts: dict[int, tuple] = {}  # id(node) -> (node, whether it reads q, whether it reads a tensor)
        self._constants: dict[int, np.ndarray] = {}

    def constant(self, value: int) -> np.ndarray:
        """A read-only int64 [N] of ``value``, made once (the forms share it; nothing writes to it)."""
        a = self._constants.get(value)
        if a is None:
            a = self._constants[value] = np.full(self.n, value, np.int64)
            a.flags.writeable = False
        return a

    def facts(self, e: ir.Expr) -> tuple:
        """``(e, "q" in ir.free_vars(e), whether e reads a tensor)``, each node's computed once (the
        analysis asks at every node of a subtree it walks; the node is kept: its id is not reused)."""
        hit = self._facts.get(id(e))
        if hit is None:
            kids = [self.facts(c) for c in ir.children(e)]
            hit = self._facts[id(e)] = (e, (isinstance(e, ir.Var) and e.name == "q") or any(k[1] for k in kids),
                                        isinstance(e, ir.Load) or any(k[2] for k in kids))
        return hit

    def reads_q(self, e: ir.Expr) -> bool:
        return self.facts(e)[1]

    # column-only values ------------------------------------------------
    def column(self, e: ir.Expr) -> np.ndarray:
        """``e`` (which does not read q) per column, its reads checked where it is used: in the
        columns ``care`` keeps that have a row ``rows_cared`` keeps.  Under a guard the analysis
        cannot solve (``lenient``) a read that may leave its tensor is not an error here: the
        cells decide (``NotInterval``), as the oracle raises only where the read is used."""
        used = self.used_columns()
        care = None if used is None else used.reshape(self.shape)
        try:
            return np.broadcast_to(evaluate(e, self.env, self.tensors, care), self.shape).reshape(-1)
        except PlanError:
            if not self.lenient:
                raise
            raise NotInterval("a tensor read that may leave its tensor, under a condition the analysis "
                              "cannot solve") from None

    def used_columns(self) -> np.ndarray | None:
        """bool [N]: the columns where the value being analyzed is used (None: all of them)."""
        if self.rows_cared is None:
            return self.care
        r = self.rows_cared
        some = (r.end > r.start).any(axis=1)
        return some if self.care is None else self.care & some

    def under(self, guard: ir.Expr, truth: "Truth", holds: bool, e: ir.Expr) -> "Truth":
        """``truth(e)`` where ``guard`` (whose ``truth`` the caller has) holds (``holds``) or not.  The
        guard only narrows where reads are checked: an ``e`` that reads no tensor skips it."""
        if not self.facts(e)[2]:
            return self.truth(e)
        saved = self.care, self.rows_cared, self.lenient
        if self.reads_q(guard):
            t = truth if holds else ~truth
            if t.exact:
                self.rows_cared = t.must if self.rows_cared is None else self.rows_cared & t.must
            else:
                self.lenient = True
        else:
            try:
                g = self.column(guard).astype(bool)
            except NotInterval:  # the guard's own read may leave its tensor: where e is used is unknown
                g = None
                self.lenient = True
            if g is not None:
                g = g if holds else ~g
                self.care = g if self.care is None else self.care & g
        try:
            return self.truth(e)
        finally:
            self.care, self.rows_cared, self.lenient = saved

    def unknown(self, e: ir.Expr, why: str) -> Truth:
        self.reasons.append(f"atom '{ir.format_expr(e)}' is not interval-analyzable: {why}")
        return Truth(Runs.every(self.rows, self.n, False), Runs.every(self.rows, self.n, True))

    # conditions ----------------------------------------------------------
    def truth(self, e: ir.Expr) -> Truth:
        if not self.reads_q(e):
            try:
                r = Runs.where(self.column(e), self.rows, self.n)
            except NotInterval as why:
                return self.unknown(e, str(why))
            return Truth(r, r)
        if isinstance(e, ir.Binary) and e.op in ("and", "or"):
            a = self.truth(e.left)
            b = self.under(e.left, a, e.op == "and", e.right)
            return a & b if e.op == "and" else a | b
        if isinstance(e, ir.Unary) and e.op == "not":
            return ~self.truth(e.operand)
        if isinstance(e, ir.Select):
            c = self.truth(e.cond)
            return (c & self.under(e.cond, c, True, e.if_true)) | (~c & self.under(e.cond, c, False, e.if_false))
        if isinstance(e, ir.Compare):
            try:
                return self.compare(e)
            except NotInterval as why:
                return self.unknown(e, str(why))
        return self.unknown(e, "not a comparison of positions")

    def compare(self, e: ir.Compare) -> Truth:
        left, right, op = e.left, e.right, e.op
        if left.type is ir.BOOL:  # a == b over conditions: (a & b) | (!a & !b)
            a, b = self.truth(left), self.truth(right)
            same = (a & b) | (~a & ~b)
            return same if op == "eq" else ~same
        for side, other, o in ((left, right, op), (right, left, _FLIP[op])):
            if self.reads_q(side) and isinstance(side, (ir.Call, ir.Select)):
                return self.truth(_distribute(side, other, o))
        lf, rf = self.form(left), self.form(right)
        if isinstance(lf, QLoad) and isinstance(rf, np.ndarray):
            return self.solve_load(lf, op, rf)
        if isinstance(rf, QLoad) and isinstance(lf, np.ndarray):
            return self.solve_load(rf, _FLIP[op], lf)
        if isinstance(lf, QLoad) or isinstance(rf, QLoad):
            raise NotInterval("a tensor read at q compared with another q-dependent value")
        return self.solve_linear(self.as_linear(lf, rf), op, self.as_linear(rf, lf))

    # numeric forms ------------------------------------------------------
    def form(self, e: ir.Expr):
        """Column values (ndarray [N]), a Linear form, or a QLoad."""
        if not self.reads_q(e):
            v = self.column(e)
            if not e.type.integer:
                return v
            return v.astype(np.int64)
        one, zero = self.constant(1), self.constant(0)
        if isinstance(e, ir.Var):  # q
            return Linear(one, zero, one, zero)
        if isinstance(e, ir.Unary) and e.op == "cast_i64":  # a width, not a value
            return self.form(e.operand)
        if isinstance(e, ir.Unary) and e.op == "neg":
            f = self.form(e.operand)
            if isinstance(f, Linear):
                return Linear(-f.a, -f.c, f.d, f.off)
        if isinstance(e, ir.Binary) and e.type.integer:
            a, b = self.form(e.left), self.form(e.right)
            if e.op in ("add", "sub"):
                sign = 1 if e.op == "add" else -1
                la, lb = self.as_linear(a, b), self.as_linear(b, a)
                if isinstance(la, Linear) and isinstance(lb, Linear):
                    if (la.a != 0).any() and (lb.a != 0).any() and not (
                            np.array_equal(la.d, lb.d) and np.array_equal(la.off, lb.off)):
                        raise NotInterval("a sum of positions under different divisors")
                    base = la if (la.a != 0).any() else lb
                    return Linear(la.a + sign * lb.a, la.c + sign * lb.c, base.d, base.off)
            if e.op == "mul":
                for f, g in ((a, b), (b, a)):
                    if isinstance(f, Linear) and isinstance(g, np.ndarray):
                        return Linear(f.a * g, f.c * g, f.d, f.off)
            if e.op == "floordiv" and isinstance(a, Linear) and isinstance(b, np.ndarray):
                if (a.d == 1).all() and (a.a == 1).all() and (b > 0).all():
                    return Linear(one, zero, b, a.c)  # (q + c) // D
            if e.op == "mod":
                raise NotInterval("q under '%' selects a periodic set of rows")
            raise NotInterval(f"q under '{e.op}' in a form that is not linear")
        if isinstance(e, ir.Load):
            return self.q_load(e)
        raise NotInterval("q in float or non-linear arithmetic")

    def as_linear(self, f, other) -> Linear:
        """``f`` as a Linear form in the same variable as ``other``."""
        if isinstance(f, Linear):
            return f
        if isinstance(f, np.ndarray) and f.dtype.kind in "iu":
            base = other if isinstance(other, Linear) else None
            z = self.constant(0)
            d = base.d if base is not None else self.constant(1)
            off = base.off if base is not None else z
            return Linear(z, f.astype(np.int64), d, off)
        raise NotInterval("a position compared with a non-integer value")

    def q_load(self, e: ir.Load) -> QLoad:
        decl = self.program.tensor(e.tensor)
        q_axes = [i for i, ix in enumerate(e.index) if self.reads_q(ix)]
        if len(q_axes) != 1 or decl.axes[q_axes[0]] != "s":
            raise NotInterval(f"'{e.tensor}' is read at q outside a single 's' axis")
        ax = q_axes[0]
        f = self.form(e.index[ax])
        if not (isinstance(f, Linear) and (f.a == 1).all() and (f.d == 1).all()):
            raise NotInterval(f"'{e.tensor}' is read at a q position that is not q + offset")
        others = [ix for i, ix in enumerate(e.index) if i != ax]
        if any("k" in ir.free_vars(ix) for ix in others):
            raise NotInterval(f"'{e.tensor}' is read at q and at k in one subscript")
        array = self.tensors[e.tensor]
        length = array.shape[ax]
        first, last = np.zeros(self.n, np.int64), np.full(self.n, self.rows - 1, np.int64)  # rows read
        cols = np.ones(self.n, bool) if self.care is None else self.care.copy()
        if self.rows_cared is not None:
            r = self.rows_cared
            some = r.end > r.start
            cols &= some.any(axis=1)
            first = np.where(some, r.start, self.rows).min(axis=1, initial=self.rows)
            last = np.where(some, r.end - 1, -1).max(axis=1, initial=-1)
        lo = int((self.q0 + first + f.c)[cols].min(initial=0))
        hi = int((self.q0 + last + f.c)[cols].max(initial=0))
        if self.rows and cols.any() and (lo < 0 or hi >= length):
            if self.lenient:
                raise NotInterval(f"'{e.tensor}' is read under a condition the analysis cannot solve, at "
                                  "rows outside the tensor")
            bad = lo if lo < 0 else hi
            raise PlanError(f"tensor '{e.tensor}' read out of range: axis {ax} index {bad} is outside "
                            f"[0, {length}) (shape {list(array.shape)})")
        idx = [self.column(ix) for ix in others]
        other_dims = tuple(d for i, d in enumerate(array.shape) if i != ax)
        if self.n:  # the other subscripts are checked like every read, where it is used
            try:
                load(e.tensor, array, _insert(tuple(idx), ax, np.zeros(self.n, np.int64)), cols)
            except PlanError:
                if not self.lenient:
                    raise
                raise NotInterval(f"'{e.tensor}' is read under a condition the analysis cannot solve, "
                                  "outside the tensor") from None
            if not cols.all():
                idx = [np.clip(i, 0, d - 1) for i, d in zip(idx, other_dims)]
        # distinct rows without sorting: subscripts are bounded by the tensor's shape
        flat = np.ravel_multi_index(tuple(idx), other_dims) if idx else np.zeros(self.n, np.int64)
        present = np.zeros(int(np.prod(other_dims)), bool)
        present[flat] = True
        rank = np.cumsum(present) - 1
        uniq = np.stack(np.unravel_index(np.flatnonzero(present), other_dims), axis=1) if idx \
            else np.zeros((1 if self.n else 0, 0), np.int64)
        row_of = rank[flat]
        table = np.stack([array[_insert(tuple(int(x) for x in u), ax, slice(None))] for u in uniq]) \
            if len(uniq) else np.zeros((0, length))
        return QLoad(e.tensor, table.reshape(len(uniq), length), row_of.reshape(-1), f.c)

    # solvers --------------------------------------------------------------
    def solve_linear(self, lf: Linear, op: str, rf: Linear) -> Truth:
        if not (np.array_equal(lf.d, rf.d) and np.array_equal(lf.off, rf.off)) and \
                (lf.a != 0).any() and (rf.a != 0).any():
            raise NotInterval("positions under different divisors")
        base = lf if (lf.a != 0).any() else rf
        a, c = lf.a - rf.a, rf.c - lf.c  # a * u  op  c
        uniform = _uniform(a), _uniform(base.d), _uniform(base.off)
        if None not in uniform and uniform[0] != 0:
            return self.solve_uniform(*uniform, op, c)
        neg = a < 0
        a, c = np.abs(a), np.where(neg, -c, c)
        safe = np.where(a == 0, 1, a)
        floor, ceil = c // safe, -((-c) // safe)
        divides = c % safe == 0
        lo, hi = _u_bounds(op, floor, ceil, divides)
        if neg.any():  # -|a| u op c  <=>  |a| u flip(op) -c
            flo, fhi = _u_bounds(_FLIP[op], floor, ceil, divides)
            lo, hi = np.where(neg, flo, lo), np.where(neg, fhi, hi)
        ne = op == "ne"
        # a == 0: the comparison does not involve q
        const_true = _apply(op, np.zeros_like(c), c)
        d, off = base.d, base.off
        qmin, qmax = self.q0, self.q0 + self.rows
        umin, umax = (qmin + off) // d - 1, (qmax + off) // d + 1
        lo, hi = _clamp(lo, umin, umax), _clamp(hi, umin, umax)
        q_lo, q_hi = d * lo - off, d * hi - off
        runs = Runs.between(q_lo - self.q0, q_hi - self.q0, self.rows, self.n)
        if ne:
            runs = runs.complement()
        zero = a == 0
        if zero.any():
            runs = _choose(zero, Runs.where(const_true, self.rows, self.n), runs, self.rows)
        return Truth(runs, runs)

    def solve_uniform(self, a: int, d: int, off: int, op: str, c: np.ndarray) -> Truth:
        """:meth:`solve_linear` where ``a != 0``, ``d`` and ``off`` are one value for every column
        (``q - k < w``, ``q // C == k // C``, ...): the same runs from scalar bounds, in a third
        of the array operations."""
        if a < 0:  # -|a| u op c  <=>  |a| u flip(op) -c
            a, c, op = -a, -c, _FLIP[op]
        if a == 1:
            floor = ceil = c
            divides = True
        else:
            floor, ceil = c // a, -((-c) // a)
            divides = c % a == 0
        umin, umax = (self.q0 + off) // d - 1, (self.q0 + self.rows + off) // d + 1
        if op == "lt":
            lo, hi = umin, _clamp(ceil, umin, umax)
        elif op == "le":
            lo, hi = umin, _clamp(floor + 1, umin, umax)
        elif op == "gt":
            lo, hi = _clamp(floor + 1, umin, umax), umax
        elif op == "ge":
            lo, hi = _clamp(ceil, umin, umax), umax
        else:  # eq / ne: the eq set (complemented below)
            lo = _clamp(ceil, umin, umax)
            hi = _clamp(ceil + 1 if divides is True else np.where(divides, ceil + 1, ceil), umin, umax)
        shift = off + self.q0
        runs = Runs.between(d * lo - shift, d * hi - shift, self.rows, self.n)
        if op == "ne":
            runs = runs.complement()
        return Truth(runs, runs)

    def solve_load(self, f: QLoad, op: str, c: np.ndarray) -> Truth:
        lo = np.zeros(self.n, np.int64)
        hi = np.zeros(self.n, np.int64)
        length = f.table.shape[1]
        for m, row in enumerate(f.table):
            cols = np.flatnonzero(f.row_of == m)
            op_m = op
            if np.all(row[1:] >= row[:-1]):  # non-decreasing: search as it is
                values, key = row, c[cols]
            elif np.all(row[1:] <= row[:-1]):  # non-increasing: negate both sides
                values, key, op_m = -row, -c[cols], _FLIP[op]
            elif op in ("eq", "ne"):  # equal values in contiguous runs: search run ranks
                values, key = _run_ranks(f.tensor, row, c[cols])
            else:
                raise NotInterval(f"'{f.tensor}' is not monotone along s, so '{op}' on it has no single run")
            lo[cols], hi[cols] = _sorted_range(values, key, op_m, length)
        # positions p = q + off  ->  rows i = p - off - q0
        runs = Runs.between(lo - f.off - self.q0, hi - f.off - self.q0, self.rows, self.n)
        if op == "ne":
            runs = runs.complement()
        return Truth(runs, runs)


_BIG = np.int64(1) << 40


def _uniform(x: np.ndarray):
    """The one value of every entry of ``x`` (an int), else None."""
    if not x.size:
        return None
    first = int(x[0])
    return first if int(x.min()) == first == int(x.max()) else None


def _u_bounds(op: str, floor, ceil, divides):
    """[lo, hi) of integers u with u op c/a (a > 0); ``ne`` gives the ``eq`` set (complemented later)."""
    if op == "lt":
        return np.full_like(ceil, -_BIG), ceil
    if op == "le":
        return np.full_like(floor, -_BIG), floor + 1
    if op == "gt":
        return floor + 1, np.full_like(floor, _BIG)
    if op == "ge":
        return ceil, np.full_like(ceil, _BIG)
    return ceil, np.where(divides, ceil + 1, ceil)  # eq / ne


def _insert(t: tuple, at: int, value) -> tuple:
    return t[:at] + (value,) + t[at:]


def _apply(op: str, a, b):
    return {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}[op](a, b)


def _choose(flag: np.ndarray, a: Runs, b: Runs, rows: int) -> Runs:
    """Per column: a where flag else b."""
    sa, sb = _same_width(a.start, b.start, rows)
    ea, eb = _same_width(a.end, b.end, rows)
    return _normalize(np.where(flag[:, None], sa, sb), np.where(flag[:, None], ea, eb), rows)


def _sorted_range(values: np.ndarray, key: np.ndarray, op: str, length: int):
    """[lo, hi) of positions p with values[p] op key, for non-decreasing values."""
    left = np.searchsorted(values, key, "left")
    right = np.searchsorted(values, key, "right")
    zero, end = np.zeros_like(left), np.full_like(left, length)
    lo = {"eq": left, "ne": left, "lt": zero, "le": zero, "gt": right, "ge": left}[op]
    hi = {"eq": right, "ne": right, "lt": left, "le": right, "gt": end, "ge": end}[op]
    return lo, hi


def _run_ranks(name: str, row: np.ndarray, key: np.ndarray):
    """Relabel a row whose equal values form contiguous runs by run index (monotone), and map
    each key to the rank of its run (or -1, matching nothing)."""
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
    run_values = row[starts]
    order = np.argsort(run_values, kind="stable")
    sorted_vals = run_values[order]
    dup = np.flatnonzero(sorted_vals[1:] == sorted_vals[:-1])
    if dup.size:
        v = sorted_vals[dup[0]]
        where = np.flatnonzero(row == v)
        gap = where[np.flatnonzero(np.diff(where) > 1)[0] + 1]
        raise NotInterval(f"tensor '{name}' value {v} appears in separate runs (at index {where[0]} "
                          f"and again at index {gap})")
    ranks = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(row)]))
    pos = np.searchsorted(sorted_vals, key)
    found = (pos < len(sorted_vals)) & (sorted_vals[np.minimum(pos, len(sorted_vals) - 1)] == key)
    key_rank = np.where(found, order[np.minimum(pos, len(order) - 1)], -1)
    return ranks, key_rank


def _distribute(side: ir.Expr, other: ir.Expr, op: str) -> ir.Expr:
    """Push a comparison through abs/min/max/where so each atom is linear:
    ``abs(x) < y`` is ``x < y & -x < y``; ``min(x, z) < y`` is ``x < y | z < y``; ..."""
    cmp = lambda a, o=op: ir.Compare(o, a, other)  # noqa: E731
    AND = lambda a, b: ir.Binary("and", a, b, ir.BOOL)  # noqa: E731
    OR = lambda a, b: ir.Binary("or", a, b, ir.BOOL)  # noqa: E731
    if isinstance(side, ir.Select):
        return OR(AND(side.cond, cmp(side.if_true)), AND(ir.Unary("not", side.cond, ir.BOOL), cmp(side.if_false)))
    if side.fn == "abs" and side.type.integer:
        x = side.args[0]
        neg_x = ir.Unary("neg", x, x.type)
        if op in ("lt", "le"):
            return AND(cmp(x), cmp(neg_x))
        if op in ("gt", "ge"):
            return OR(cmp(x), cmp(neg_x))
        if op == "eq":
            return AND(OR(cmp(x), cmp(neg_x)), ir.Compare("ge", other, ir.Const(0, ir.I32)))
        return ir.Unary("not", _distribute(side, other, "eq"), ir.BOOL)
    if side.fn in ("min", "max") and side.type.integer:
        x, z = side.args
        # min(x, z) < y  <=>  x < y | z < y ;  max(x, z) < y  <=>  x < y & z < y
        smaller = op in ("lt", "le")
        if op in ("eq", "ne"):
            # min(x, z) == y  <=>  x == y & z >= y  |  z == y & x >= y  (max: <=)
            lo_side = "ge" if side.fn == "min" else "le"
            eq = OR(AND(cmp(x, "eq"), cmp(z, lo_side)), AND(cmp(z, "eq"), cmp(x, lo_side)))
            return eq if op == "eq" else ir.Unary("not", eq, ir.BOOL)
        join = OR if (side.fn == "min") == smaller else AND
        return join(cmp(x), cmp(z))
    return _Unsolvable(side)


def _Unsolvable(side):
    raise NotInterval(f"q under {getattr(side, 'fn', 'where')}() in a form the analysis cannot split")


def analyze(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None) -> MaskIntervals:
    """Per-column visible rows of ``program.mask`` and, when every column has at most two masked
    runs, FlashMask's UTS/UTE/LTS/LTE."""
    a = _Analyzer(program, batch, s_q, s_k, tensors or {})
    visible = a.truth(program.mask)
    exact = visible.exact
    reason = None if exact else a.reasons[0]
    vectors = {}
    representable = False
    if exact:
        masked = visible.must.complement()
        runs = masked.count()
        if a.n and runs.max(initial=0) > 2:
            n = int(np.argmax(runs > 2))
            b, h, k = np.unravel_index(n, a.shape)
            live = masked.end[n] > masked.start[n]
            reason = (f"column k={k} (b={b}, h={h}) has {runs[n]} masked runs of query rows "
                      f"({_show_runs(masked.start[n][live], masked.end[n][live])}); FlashMask encodes at most two")
        else:
            representable = True
            vectors = _flashmask_vectors(masked, a.shape)
    return MaskIntervals(visible, a.shape, s_q, s_k, exact, representable, reason, **vectors)


EVAL_CHUNK = 1 << 22  # cells one step of the per-column evaluation holds at a time
# The per-column evaluation is admitted when the dense u8 mask it stands in for (M4.5 §0x06G's
# dense_u8 ledger: one byte per cell) fits the memory limit; it holds EVAL_CHUNK cells at a time.
EVAL_BYTES_PER_CELL = 1


def evaluation_cells(program: ir.Program, batch: int, s_q: int, s_k: int) -> int:
    """Cells :func:`evaluate_columns` visits: B' x H' x S_q x S_k (B', H' as in :func:`analyze`)."""
    b_, h_, _ = column_shape(program, batch, s_k)
    return b_ * h_ * s_q * s_k


def evaluate_columns(program: ir.Program, batch: int, s_q: int, s_k: int,
                     tensors: dict | None = None) -> MaskIntervals:
    """The exact per-column result :func:`analyze` gives for masks it can solve, for any mask:
    the mask is evaluated cell by cell (the IR interpreter, as the oracle evaluates it), a few
    columns at a time so memory stays bounded, and each column's masked rows are read off as
    runs.  Its cost is the rectangle (``evaluation_cells``), so callers budget it first
    (``resources.require`` with ``EVAL_BYTES_PER_CELL``).  Where a column hides more than two
    runs the result is exact but not representable, with that column as the reason (its
    runs are not kept: only representable masks keep per-column rows).  About 250M cells/s on
    one CPU core."""
    tensors = tensors or {}
    a = _Analyzer(program, batch, s_q, s_k, tensors)
    b_, h_, _ = a.shape
    q = (a.q0 + np.arange(s_q)).reshape(1, 1, 1, -1)  # rows last: each column's rows are contiguous
    env0 = {"b": np.arange(b_).reshape(-1, 1, 1, 1), "h": np.arange(h_).reshape(1, -1, 1, 1), "q": q}
    step = max(1, EVAL_CHUNK // max(1, b_ * h_ * s_q))
    starts = np.full((b_, h_, s_k, 2), s_q, np.int64)  # the (at most two) masked runs per column
    ends = np.full((b_, h_, s_k, 2), s_q, np.int64)
    for k0 in range(0, s_k, step):
        k1 = min(s_k, k0 + step)
        env = {**env0, "k": np.arange(k0, k1).reshape(1, 1, -1, 1)}
        masked = ~np.broadcast_to(evaluate(program.mask, env, tensors), (b_, h_, k1 - k0, s_q))
        first = masked.copy()  # the first row of each masked run
        first[..., 1:] &= ~masked[..., :-1]
        last = masked.copy()  # the last row of each masked run
        last[..., :-1] &= ~masked[..., 1:]
        count = first.sum(axis=3)
        if count.max(initial=0) > 2:
            bi, hi, ki = (int(x[0]) for x in np.nonzero(count > 2))
            rows = np.flatnonzero(first[bi, hi, ki]), np.flatnonzero(last[bi, hi, ki]) + 1
            reason = (f"column k={k0 + ki} (b={bi}, h={hi}) has {int(count[bi, hi, ki])} masked runs of query "
                      f"rows ({_show_runs(*rows)}); FlashMask encodes at most two")
            nothing = Runs.every(s_q, a.n, False)
            return MaskIntervals(Truth(nothing, nothing), a.shape, s_q, s_k, True, False, reason,
                                 method="evaluation")
        cols = slice(k0, k1)
        for slot in range(2):  # the earlier run, then the later one (two at most)
            has = count > slot
            r0, r1 = first.argmax(axis=3), last.argmax(axis=3)
            starts[:, :, cols, slot] = np.where(has, r0, s_q)
            ends[:, :, cols, slot] = np.where(has, r1 + 1, s_q)
            if slot == 0 and (count > 1).any():  # drop the first run, find the second
                np.put_along_axis(first, r0[..., None], False, axis=3)
                np.put_along_axis(last, r1[..., None], False, axis=3)
    masked = _normalize(starts.reshape(a.n, 2), ends.reshape(a.n, 2), s_q)
    visible = masked.complement()
    return MaskIntervals(Truth(visible, visible), a.shape, s_q, s_k, True, True, None,
                         **_flashmask_vectors(masked, a.shape), method="evaluation")


@dataclass(frozen=True)
class RowIntervals:
    """Per query row, the one run of keys it sees, ``[KS, KE)`` (empty: KS == KE), int32
    [B', H', S_q] like the column vectors; None where some row sees two or more runs."""

    KS: np.ndarray
    KE: np.ndarray


def row_intervals(program: ir.Program, batch: int, s_q: int, s_k: int,
                  tensors: dict | None = None) -> RowIntervals | None:
    """The keys each query row sees, when they form one run per row (causal, windows, documents,
    prefix-LM; not sink + window).  The column analysis of the transposed mask: the mask with q
    and k swapped, its "rows" the S_k keys and its "columns" the S_q queries (query row i at
    q = S_k - S_q + i; key j at k = j), so row runs of column i are the keys of query row i.
    None where the analysis is inexact or a row sees more than one run."""
    q0 = s_k - s_q
    i32 = ir.I32
    swapped = ir.substitute(program.mask, {
        "q": ir.Binary("add", ir.Var("k", i32), ir.Const(q0, i32), i32),
        "k": ir.Binary("add", ir.Var("q", i32), ir.Const(q0, i32), i32)})
    a = _Analyzer(program, batch, s_k, s_q, tensors or {}, transposed=True, lengths=(s_q, s_k))
    visible = a.truth(swapped)
    if not visible.exact:
        return None
    runs = visible.must
    count = runs.count()
    if count.max(initial=0) > 1:
        return None
    # runs are sorted, unused slots last: a row's one run is in slot 0
    start, end = (np.where(count == 1, v[:, 0], 0) if v.shape[1] else np.zeros(a.n, np.int64)
                  for v in (runs.start, runs.end))
    return RowIntervals(start.astype(np.int32).reshape(a.shape), end.astype(np.int32).reshape(a.shape))


def _show_runs(starts, ends, most: int = 6) -> str:
    runs = [f"[{int(a)}, {int(b)})" for a, b in zip(starts, ends)]
    return ", ".join(runs) if len(runs) <= most else ", ".join(runs[:most - 1]) + f", ..., {runs[-1]}"


def _flashmask_vectors(masked: Runs, shape) -> dict[str, np.ndarray]:
    rows = masked.rows
    s, e = _same_width(masked.start, masked.end, rows)
    s = np.pad(s, ((0, 0), (0, max(0, 2 - s.shape[1]))), constant_values=rows)
    e = np.pad(e, ((0, 0), (0, max(0, 2 - e.shape[1]))), constant_values=rows)
    count = masked.count()
    one_upper = (count == 1) & (s[:, 0] == 0)
    uts = np.where(count == 2, s[:, 0], np.where(one_upper, 0, 0))
    ute = np.where(count == 2, e[:, 0], np.where(one_upper, e[:, 0], 0))
    lts = np.where(count == 2, s[:, 1], np.where((count == 1) & ~one_upper, s[:, 0], rows))
    lte = np.where(count == 2, e[:, 1], np.where((count == 1) & ~one_upper, e[:, 0], rows))
    return {n: v.astype(np.int32).reshape(shape) for n, v in
            (("UTS", uts), ("UTE", ute), ("LTS", lts), ("LTE", lte))}
