"""The separable form of a score program: ``score' = a * score + r(b, h, q) + c(b, h, k)``.

Softmax is invariant to a term added to every cell of a row, so a kernel that knows this form
computes per cell only ``y = s * (a * SCALE * log2 e) + c(k) * log2 e`` (one FMA; ``c`` evaluated
once per key column of a block) and adds ``r(q)`` to the row's LSE in its epilogue.  ALiBi
(``score - slope(h) * (q - k)``): a = 1, r(q) = -slope(h) * q, c(k) = slope(h) * k.

**The analysis** (:func:`analyze`) reads the statements in order, each as ``A * score + terms``
in its input: ``score`` itself, sums, differences, negations, products and quotients by a factor
that reads neither q, k nor the score (a per-(b, h) value: constants, ``h``, ``slope[h]``), and
``where(c, x, y)`` whose condition reads none of them; an expression without the score that
reads q or k but not both is one term.  An integer reading q and k under a conversion is split
into its terms (``float(q - k + 5) = float(q) - float(k) + 5.0``, as ``compiler/fast_score.py``
groups them; an integer factor reading no position distributed: ``float(h * (q - k))``), each
reading one position.  The parts are exact as algebra: products distribute
over sums, a conversion over a sum of integers (the kernel evaluates the parts, not the
program).  Anything else is refused with the reason: the score under a function (softcap's
tanh), a product of two factors that read positions or the score (``score * q``, ``q * k``),
``abs``, ``min``, ``max`` or ``where`` reading q and k together, a tensor read indexed by both.

**The origin.** ALiBi's parts are large where the cell's value is small: ``slope * q`` and
``slope * k`` cancel near the diagonal.  Where a part's term ``f * w * float(q)`` meets one
``-f * w * float(k)`` (one factor ``f``, opposite integer weights: the term ``f * w * float(q -
k)`` split), the parts read the positions from an origin ``o`` instead: ``f * w * float(q - o)``
and ``-f * w * float(k - o)``, whose sum is the same for every ``o``.  The other terms read
absolute positions.  So ``row(q, o) + column(k, o) = r(q) + c(k)`` for every integer ``o`` (o = 0:
the absolute parts), and a kernel gives each run of at most ORIGIN_ROWS consecutive query rows
the origin in its middle: ALiBi's row part is then ``-slope * float(q - o)``, at most
``slope * ORIGIN_ROWS / 2`` in magnitude, and its column part ``slope * float(k - o)``, within
that of the cell's own ``-slope * (q - k)``.

**Precision.** The kernel rounds ``column(k, o)`` in f32 and forms ``y`` once per cell, then adds
``row(q, o)`` to LSE.  Where the parts do not cancel, |y| is of the order of the per-cell value
and the roundings are those of the per-cell form (which rounds its score value, then
``s * log2 e``).  Where they cancel, |column| exceeds the cell's |row + column| by up to |row|
(and by no more than |column| itself), and LSE's ``m + log2 l`` carries the same magnitude: the
exponent and LSE move by about ``2 * M * 2**-24`` (natural units) beyond the per-cell form's
error, ``M = min(max |row|, max |column|)``.  The form is taken where that is at most 1/8 of the
tighter of the spec dtype's declared O tolerance and LSE's absolute one (``compiler/numerics.py``;
LSE's 1e-4, f32 in every dtype, is the tighter: M <= 104), M bounded by the range analysis on
the call's positions (:func:`usable_positions`: the largest bound on positions where it holds,
which the launch layer compares with each call's, as ``fast_score.FAST_POSITIONS``).  Further:

* the row part must be finite (range analysis): the softmax runs without it, so a row whose
  r(q) is -inf (every cell -inf: O = 0 by the masked-rows policy) or NaN / +inf (the
  non-finite-score policy marks the row) would come out otherwise.  A column value of -inf,
  +inf or NaN reaches ``y`` as it reaches the per-cell value, so the column part needs no rule;
* ``a * SCALE * log2 e`` must be finite (the kernel's per-job factor);
* f32 specs never take it: their O tolerance (2e-5) leaves no room for other roundings, and
  the Gluon engine, the form's one user, runs f16 and bf16 only.

With the origin, ALiBi's M is ``max slope * ORIGIN_ROWS / 2`` (16 for slopes up to 1/2) at every
length; without it M would be ``slope * S_k`` and LSE would lose ``slope * S_k * 2**-24`` to the
cancellation (5e-4 at 8K keys), beyond its tolerance.

**The column part per block.** Evaluated per key, ALiBi's column part costs a subtraction, a
conversion and two multiplications per key, and a thread of a wgmma tile holds half as many keys
as cells.  Where the column part reads k only through ``float(k - o)``, linearly
(``Separable.affine_column``: ALiBi's), ``column(o) = 0`` and ``column(k) = column(m) + column(o +
k - m)`` for a block's middle key m: a kernel takes ``column(o + k - m)`` over a block's keys
once per job and ``column(m)`` once per block, and subtracts the latter from the row max (per
row) instead of adding it to each cell: per cell, one FMA, and a subtraction before the
exponential.  The cells then round ``s * a' + column(o + k - m)``, whose column term is at most
the part's span over half a block; M grows by that span (the range analysis with ``|k - o| <=
COLUMN_BLOCK / 2``): 32 for ALiBi's slopes up to 1/2 (:func:`usable_positions` with
``per_block``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir, numerics
from .ir import F32, I32
from .ranges import MAX_LENGTH, IntRanges, float_range
from .scalar import FLT_MAX
from .scalar import f32 as fold_f32

ORIGIN = ir.Var("o", I32)
"""The origin the parts read positions from (``o``: not a language name)."""
ORIGIN_ROWS = 64
"""A kernel taking the form gives each run of at most this many consecutive query rows one
origin, in its middle (its first row's position plus ORIGIN_ROWS // 2)."""
COLUMN_BLOCK = 128
"""The most keys a kernel taking an affine column part per block gives one block (module
docstring)."""
ULP = 2.0**-24  # f32's unit roundoff
LOG2E = 1.4426950408889634
ZERO = ir.Const(0.0, F32)
ONE = ir.Const(1.0, F32)
_CELL = frozenset(("q", "k", "score"))


@dataclass(frozen=True)
class Separable:
    """A score program's separable form: ``scale * score + row + column``.  ``scale`` reads b, h,
    the lengths and tensors; ``row`` reads q and ``o`` (not k); ``column`` reads k and ``o`` (not
    q); neither reads the score.  Their sum does not depend on ``o``."""

    scale: ir.Expr
    row: ir.Expr
    column: ir.Expr

    @property
    def relative(self) -> bool:
        """Whether the parts read positions from the origin."""
        return "o" in ir.free_vars(self.row) | ir.free_vars(self.column)

    @property
    def affine_column(self) -> bool:
        """Whether the column part reads k only through ``float(k - o)``, linearly (so it is
        ``beta(b, h) * (k - o)``, 0 at the origin): a kernel may take it per block."""
        return "k" in ir.free_vars(self.column) and _affine(self.column)


_KEY_STEP = ir.Unary("cast_f32", ir.Binary("sub", ir.Var("k", I32), ORIGIN, I32), F32)


def _affine(e: ir.Expr) -> bool:
    """Whether ``e`` is ``beta * float(k - o)`` with beta reading no k (and maybe 0)."""
    if "k" not in ir.free_vars(e):
        return e == ZERO
    if e == _KEY_STEP:
        return True
    if isinstance(e, ir.Unary) and e.op == "neg":
        return _affine(e.operand)
    if isinstance(e, ir.Binary) and e.op in ("add", "sub"):
        return _affine(e.left) and _affine(e.right)
    if isinstance(e, ir.Binary) and e.op == "mul":
        return any("k" not in ir.free_vars(f) and _affine(x) for f, x in ((e.left, e.right), (e.right, e.left)))
    if isinstance(e, ir.Binary) and e.op == "div":
        return "k" not in ir.free_vars(e.right) and _affine(e.left)
    if isinstance(e, ir.Select):
        return "k" not in ir.free_vars(e.cond) and _affine(e.if_true) and _affine(e.if_false)
    return False


# ---------------------------------------------------------------- the analysis
class _Refused(Exception):
    """The program is not separable (the message says where)."""


@dataclass(frozen=True)
class _Term:
    """``weight * factor * body``: ``factor`` reads neither q, k nor the score (None: 1), ``body``
    reads one position or none (and maybe the origin)."""

    factor: ir.Expr | None
    body: ir.Expr
    weight: int


@dataclass(frozen=True)
class _Affine:
    """``a * score + sum(terms)`` (a None: no score term)."""

    a: ir.Expr | None
    terms: tuple[_Term, ...]


def analyze(program: ir.Program) -> Separable | str:
    """The program's separable form, or why it has none (a sentence)."""
    if not program.score:
        return "the spec has no score program"
    value = _Affine(ONE, ())
    try:
        for stmt in program.score:
            value = _split(stmt, value)
        a, row, column = _finish(value)
    except _Refused as why:
        return str(why)
    out = Separable(a if a is not None else ZERO, row, column)
    _verify(out, program)
    return out


def separable(program: ir.Program) -> Separable | None:
    """The program's separable form, or None (``analyze`` says why)."""
    out = analyze(program)
    return out if isinstance(out, Separable) else None


def _reads(e: ir.Expr) -> frozenset[str]:
    return ir.free_vars(e) & _CELL


def _split(e: ir.Expr, score: _Affine) -> _Affine:
    """``e`` as an affine form in the statement's input ``score`` (its own affine form)."""
    if isinstance(e, ir.Var):  # (the only f32 variable)
        return score
    if isinstance(e, ir.Unary) and e.op == "neg":
        return _scaled(_split(e.operand, score), None, -1)
    if isinstance(e, ir.Unary) and e.op == "cast_f32":
        return _Affine(None, _integer_terms(e.operand))
    if isinstance(e, ir.Binary) and e.op in ("add", "sub"):
        left, right = _split(e.left, score), _split(e.right, score)
        right = right if e.op == "add" else _scaled(right, None, -1)
        return _Affine(_add(left.a, right.a), left.terms + right.terms)
    if isinstance(e, ir.Binary) and e.op == "mul" and not (_reads(e.left) and _reads(e.right)):
        factor, x = (e.left, e.right) if not _reads(e.left) else (e.right, e.left)
        return _scaled(_split(x, score), factor, 1)
    if isinstance(e, ir.Binary) and e.op == "div" and not _reads(e.right):
        return _scaled(_split(e.left, score), _reciprocal(e.right), 1)
    if isinstance(e, ir.Select) and not _reads(e.cond):
        return _select(e.cond, _split(e.if_true, score), _split(e.if_false, score))
    reads = _reads(e)
    if "score" not in reads and not {"q", "k"} <= reads:  # one term, of one position or none
        return _Affine(None, (_Term(None, e, 1),))
    if isinstance(e, ir.Binary) and e.op == "mul":
        raise _Refused(f"{ir.format_expr(e)}: a product of two factors that read q, k or the score")
    if isinstance(e, ir.Select):
        raise _Refused(f"{ir.format_expr(e)}: a where() whose condition reads q, k or the score")
    what = "the score" if "score" in reads else "q and k together"
    raise _Refused(f"{ir.format_expr(e)} reads {what} under {_operator(e)}")


def _operator(e: ir.Expr) -> str:
    if isinstance(e, ir.Call):
        return f"{e.fn}()"
    if isinstance(e, ir.Load):
        return f"a read of tensor '{e.tensor}'"
    if isinstance(e, ir.Select):
        return "where()"
    return {"div": "a division", "floordiv": "//", "mod": "%"}.get(getattr(e, "op", ""), "an operation")


def _integer_terms(x: ir.Expr) -> tuple[_Term, ...]:
    """float(x) for an integer x as terms: its sum's terms, each converted, a product by a
    constant or by a factor reading no position distributed over them (``float(h * (q - k))`` is
    ``float(h) * float(q) - float(h) * float(k)``), and its constant."""
    if isinstance(x, ir.Binary) and x.op in ("add", "sub"):
        right = _integer_terms(x.right)
        return _integer_terms(x.left) + (right if x.op == "add" else _scaled_terms(right, None, -1))
    if isinstance(x, ir.Unary) and x.op in ("neg", "cast_i64"):
        inner = _integer_terms(x.operand)
        return _scaled_terms(inner, None, -1) if x.op == "neg" else inner
    if isinstance(x, ir.Binary) and x.op == "mul":
        for c, t in ((x.left, x.right), (x.right, x.left)):
            if isinstance(c, ir.Const):
                return _scaled_terms(_integer_terms(t), None, c.value)
            if not ir.free_vars(c) & {"q", "k"} and ir.free_vars(t) & {"q", "k"}:
                return _scaled_terms(_integer_terms(t), ir.Unary("cast_f32", c, F32), 1)
    if isinstance(x, ir.Const):
        return (_Term(None, ir.Const(float(x.value), F32), 1),) if x.value else ()
    if {"q", "k"} <= ir.free_vars(x):
        raise _Refused(f"{ir.format_expr(x)} reads q and k together")
    return (_Term(None, ir.Unary("cast_f32", x, F32), 1),)


def _scaled_terms(terms: tuple[_Term, ...], factor: ir.Expr | None, weight: int) -> tuple[_Term, ...]:
    """The terms times ``weight * factor`` (factor None: 1)."""
    return tuple(_Term(t.factor if factor is None else (factor if t.factor is None else _mul(factor, t.factor)),
                       t.body, t.weight * weight) for t in terms if weight)


def _scaled(v: _Affine, factor: ir.Expr | None, weight: int) -> _Affine:
    """``weight * factor * v`` (factor None: 1)."""
    a = v.a if factor is None else (None if v.a is None else _mul(factor, v.a))
    if a is not None and weight < 0:
        a = _neg(a)
    return _Affine(a, _scaled_terms(v.terms, factor, weight))


def _select(cond: ir.Expr, x: _Affine, y: _Affine) -> _Affine:
    """``where(cond, x, y)`` for a condition reading no position: each part picks its branch's."""
    if x == y:
        return x
    (ax, rx, cx), (ay, ry, cy) = _finish(x), _finish(y)
    a = ax if ax == ay else ir.Select(cond, ZERO if ax is None else ax, ZERO if ay is None else ay, F32)
    terms = tuple(_Term(None, p if p == q else ir.Select(cond, p, q, F32), 1)
                  for p, q in ((rx, ry), (cx, cy)) if not p == q == ZERO)
    return _Affine(a, terms)


def _finish(v: _Affine) -> tuple[ir.Expr | None, ir.Expr, ir.Expr]:
    """(a, row, column) of an affine form: like terms collected, position terms that cancel
    between row and column read from the origin, row terms and scalar terms in the row part."""
    weights: dict[tuple, int] = {}
    for t in v.terms:
        weights[(t.factor, t.body)] = weights.get((t.factor, t.body), 0) + t.weight
    terms = [_Term(f, body, w) for (f, body), w in weights.items() if w]
    for i, t in enumerate(terms):
        pos = _position(t.body)
        if pos != "q":
            continue
        for j, u in enumerate(terms):
            if _position(u.body) == "k" and u.factor == t.factor and u.weight == -t.weight:
                terms[i] = _Term(t.factor, _relative("q"), t.weight)
                terms[j] = _Term(u.factor, _relative("k"), u.weight)
                break
    row = [t for t in terms if "k" not in ir.free_vars(t.body)]
    column = [t for t in terms if "k" in ir.free_vars(t.body)]
    return v.a, _sum(row), _sum(column)


def _position(body: ir.Expr) -> str | None:
    """"q" or "k" where the body is that position converted, else None."""
    if isinstance(body, ir.Unary) and body.op == "cast_f32" and isinstance(body.operand, ir.Var):
        return body.operand.name if body.operand.name in ("q", "k") else None
    return None


def _relative(pos: str) -> ir.Expr:
    """float(pos - o): an i32 (positions and origins lie in [0, 2**30 + ORIGIN_ROWS))."""
    return ir.Unary("cast_f32", ir.Binary("sub", ir.Var(pos, I32), ORIGIN, I32), F32)


def _sum(terms: list[_Term]) -> ir.Expr:
    out = None
    for t in terms:
        x = t.body if t.factor is None else _mul(t.factor, t.body)
        if abs(t.weight) != 1:
            x = _mul(ir.Const(float(abs(t.weight)), F32), x)
        if out is None:
            out = x if t.weight > 0 else _neg(x)
        else:
            out = ir.Binary("add" if t.weight > 0 else "sub", out, x, F32)
    return ZERO if out is None else out


def _mul(x: ir.Expr, y: ir.Expr) -> ir.Expr:
    """x * y, constants folded where f32 holds the product exactly (the parts stay exact)."""
    if x == ONE:
        return y
    if y == ONE:
        return x
    if isinstance(x, ir.Const) and isinstance(y, ir.Const) and fold_f32(x.value * y.value) == x.value * y.value:
        return ir.Const(x.value * y.value, F32)
    return ir.Binary("mul", x, y, F32)


def _add(x: ir.Expr | None, y: ir.Expr | None) -> ir.Expr | None:
    if x is None or y is None:
        return y if x is None else x
    return ir.Binary("add", x, y, F32)


def _neg(x: ir.Expr) -> ir.Expr:
    if isinstance(x, ir.Const):
        return ir.Const(-x.value, F32)
    if isinstance(x, ir.Unary) and x.op == "neg":
        return x.operand
    return ir.Unary("neg", x, F32)


def _reciprocal(x: ir.Expr) -> ir.Expr:
    """1 / x, folded where f32 holds it exactly (a power of two)."""
    if isinstance(x, ir.Const) and x.value and math.isfinite(x.value) and abs(math.frexp(x.value)[0]) == 0.5:
        inverse = 1.0 / x.value
        if fold_f32(inverse) == inverse:
            return ir.Const(inverse, F32)
    return ir.Binary("div", ONE, x, F32)


def _verify(s: Separable, program: ir.Program) -> None:
    """The parts' invariants (a failure is a compiler bug)."""
    allowed = ir.POSITION_VARS + ir.LENGTH_VARS + ("o",)
    for part, banned in ((s.scale, {"q", "k", "o", "score"}), (s.row, {"k", "score"}), (s.column, {"q", "score"})):
        ir.verify_expr(part, program, allowed)
        if part.type is not F32 or ir.free_vars(part) & banned:
            raise ir.VerifyError(f"separable part {ir.format_expr(part)} reads {sorted(ir.free_vars(part) & banned)}")


# ---------------------------------------------------------------- precision
def tolerance(dtype: str) -> float:
    """The most the form may move the exponent and LSE by (natural units): 1/8 of the tighter of
    the dtype's declared O tolerance and LSE's absolute one."""
    return min(*numerics.O_TOLERANCE[dtype], numerics.LSE_TOLERANCE[0]) / 8


class _OriginRanges(IntRanges):
    """Integer ranges on calls whose positions lie below ``end``, with the origin as a kernel
    places it: ``q - o`` within ORIGIN_ROWS // 2 (a row of the run), ``k - o`` a key's distance
    (``key_span``: at most that)."""

    def __init__(self, heads_q: int | None, end: int, key_span: int | None = None):
        super().__init__(heads_q, end)
        half = ORIGIN_ROWS // 2
        self.origin = (half, end - 1 + half)  # the first row of a run lies below end
        self.key_span = key_span

    def _compute(self, e: ir.Expr):
        if isinstance(e, ir.Binary) and e.op == "sub" and e.right == ORIGIN and isinstance(e.left, ir.Var):
            if e.left.name == "q":
                return -(ORIGIN_ROWS // 2), ORIGIN_ROWS // 2 - 1
            if self.key_span is not None:
                return -self.key_span, self.key_span
            lo, hi = self(e.left)
            return lo - self.origin[1], hi - self.origin[0]
        if e == ORIGIN:
            return self.origin
        return super()._compute(e)


def _magnitude(e: ir.Expr, ints: IntRanges) -> float:
    """The largest |value| of a part (inf where it may be non-finite or NaN)."""
    lo, hi, nan = float_range(e, ints)
    return math.inf if nan else max(abs(lo), abs(hi))


def excess(s: Separable, heads_q: int | None, end: int, per_block: bool = False) -> float:
    """M: the magnitude the parts may cancel by on calls whose positions lie below ``end``, plus
    ``per_block`` the column part's span over half a block (module docstring)."""
    ints = _OriginRanges(heads_q, end)
    m = min(_magnitude(s.row, ints), _magnitude(s.column, ints))
    if per_block:
        m += _magnitude(s.column, _OriginRanges(heads_q, end, COLUMN_BLOCK // 2))
    return m


def holds(s: Separable, program: ir.Program, end: int, per_block: bool = False) -> bool:
    """Whether the form is precise enough (module docstring) on calls whose positions lie
    below ``end``; ``per_block``: with its affine column part per block."""
    if program.dtype not in ("f16", "bf16") or (per_block and not s.affine_column):
        return False
    ints = _OriginRanges(program.heads_q, end)
    if _magnitude(s.scale, ints) * (program.scale or 1.0) * LOG2E >= FLT_MAX:
        return False
    if _magnitude(s.row, ints) == math.inf:
        return False
    return 2 * excess(s, program.heads_q, end, per_block) * ULP <= tolerance(program.dtype)


def usable_positions(program: ir.Program, s: Separable | None = None, per_block: bool = False) -> int:
    """The largest ``end`` such that the form holds on every call whose positions lie below it
    (0: none; at most MAX_LENGTH); ``per_block``: with its column part per block.  The ranges
    only grow with ``end``, so a bisection finds it."""
    s = s or separable(program)
    if s is None or not holds(s, program, 1, per_block):
        return 0
    if holds(s, program, MAX_LENGTH, per_block):
        return MAX_LENGTH
    lo, hi = 1, MAX_LENGTH  # holds at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(s, program, mid, per_block) else (lo, mid)
    return lo
