"""The fast form of a score program: its integer-to-float conversions moved off the cells.

A kernel calls the score program on a tile: ``q`` is a [rows, 1] vector, ``k`` a [1, keys]
vector, ``b`` and ``h`` are scalars, so what reads q but not k is computed per row, what reads k
but not q per key, and only what reads both per cell.  Lowering converts an integer to f32 where
it meets a float, so ALiBi's ``slope * (q - k)`` converts ``q - k`` in every cell: an integer
subtraction and a conversion (IADD3 and I2FP.F32.S32 per cell in the H200's SASS).  The fast
form converts each position on its vector and subtracts in f32: ``float(q) - float(k)``.

It computes the same values, bit for bit, on every call whose positions lie below
FAST_POSITIONS, and the launch layer passes it only to those (``backends/triton/launch.py:
score_functions``):

* f32 holds every integer of magnitude up to 2**24, and an f32 ``+``, ``-`` or ``*`` of two
  such integers rounds the exact result once, to nearest, as converting the integer result
  does: ``float(a - b) == float(a) - float(b)`` when |a|, |b| <= 2**24 (whatever a - b is);
* conversion is monotone and odd, so ``min``, ``max``, ``abs`` and ``where`` commute with it;
  a zero converts to +0.0, so negation is ``0.0 - x`` and a product that could be -0.0 is
  left alone;
* integer sums are regrouped by what their terms read (q and scalars, k, both), like terms
  collected, so ``q - k + 5`` becomes ``float(q + 5) - float(k)``: one f32 operation per cell;
* below 2**23 a non-negative integer converts with an integer addition and an f32 subtraction
  (``lang._f32_small``: 2**23 + x holds x in its mantissa), no conversion instruction: a wgmma
  tile gives each thread keys / 4 elements of the key vector against its keys / 2 cells, so the
  key vector's conversions are half as many as the cells'.

Float arithmetic is never reassociated or distributed: ``c * (a - b)`` stays (``c * a - c * b``
would lose the small differences of large positions: an error of about c * q * 2**-24).
"""
from __future__ import annotations

from . import ir
from .ir import F32, I32
from .lower import _cast, map_expr
from .ranges import IntRanges, binary_range, fits

FAST_POSITIONS = 2**23
"""The fast form is the exact one on calls whose positions q, k all lie below this."""
EXACT = 2**24  # f32 holds every integer in [-EXACT, EXACT]
ZERO = ir.Const(0.0, F32)


def guard_ranges(program: ir.Program) -> IntRanges:
    """Integer ranges on the calls the fast form runs on (positions below FAST_POSITIONS)."""
    return IntRanges(program.heads_q, FAST_POSITIONS)


def fast_expr(e: ir.Expr, ranges: IntRanges) -> ir.Expr:
    """``e`` (an f32 expression) with each conversion of a per-cell integer rewritten."""
    def node(n: ir.Expr) -> ir.Expr:
        if isinstance(n, ir.Unary) and n.op == "cast_f32" and n.operand.type.integer:
            return _to_f32(n.operand, ranges)
        return n
    return map_expr(e, node)


def fast_score(program: ir.Program) -> tuple[ir.Expr, ...]:
    """The score statements' fast form (module docstring)."""
    ranges = guard_ranges(program)
    return tuple(fast_expr(s, ranges) for s in program.score)


def converts_by_addition(x: ir.Expr, ranges: IntRanges) -> bool:
    """Whether the fast form converts the integer ``x`` with ``lang._f32_small``: an i32 that
    reads a position and lies in [0, 2**23) on the guarded calls."""
    if x.type is not I32 or not ir.free_vars(x) & {"q", "k"}:
        return False
    lo, hi = ranges(x)
    return lo >= 0 and hi < 2**23


# ---------------------------------------------------------------- conversions
def _cell(e: ir.Expr) -> bool:
    return {"q", "k"} <= ir.free_vars(e)


def _exact(e: ir.Expr, ranges: IntRanges) -> bool:
    lo, hi = ranges(e)
    return -EXACT <= lo and hi <= EXACT


def _to_f32(x: ir.Expr, ranges: IntRanges) -> ir.Expr:
    """An f32 expression whose value is float(x), bit for bit, on the guarded calls (x an
    integer expression), converting on the position vectors where that is exact."""
    if isinstance(x, ir.Unary) and x.op == "cast_i64":
        return _to_f32(x.operand, ranges)
    plain = _cast(x, F32)
    if not _cell(x):
        return plain  # a row, key or scalar value: converted once where it lives
    if (isinstance(x, ir.Binary) and x.op in ("add", "sub")) or (isinstance(x, ir.Unary) and x.op == "neg"):
        return _sum(x, ranges) or plain
    if isinstance(x, ir.Binary) and x.op == "mul":
        (al, ah), (bl, bh) = ranges(x.left), ranges(x.right)
        negative_zero = (al <= 0 <= ah and bl < 0) or (bl <= 0 <= bh and al < 0)
        if _exact(x.left, ranges) and _exact(x.right, ranges) and not negative_zero:
            return ir.Binary("mul", _to_f32(x.left, ranges), _to_f32(x.right, ranges), F32)
        return plain
    if isinstance(x, ir.Call) and x.fn in ("abs", "min", "max"):
        return ir.Call(x.fn, tuple(_to_f32(a, ranges) for a in x.args), F32)
    if isinstance(x, ir.Select):
        return ir.Select(x.cond, _to_f32(x.if_true, ranges), _to_f32(x.if_false, ranges), F32)
    return plain


def _terms(x: ir.Expr, sign: int = 1) -> list[tuple[int, ir.Expr]]:
    """An integer sum as signed terms (``q - k + 5``: [(1, q), (-1, k), (1, 5)])."""
    if isinstance(x, ir.Binary) and x.op in ("add", "sub"):
        return _terms(x.left, sign) + _terms(x.right, sign if x.op == "add" else -sign)
    if isinstance(x, ir.Unary) and x.op == "neg":
        return _terms(x.operand, -sign)
    if isinstance(x, ir.Unary) and x.op == "cast_i64":  # (the groups are i32 on the guarded calls)
        return _terms(x.operand, sign)
    if isinstance(x, ir.Const) and fits((x.value, x.value), I32):
        return [(sign, ir.Const(x.value, I32))]
    return [(sign, x)]


def _sum(x: ir.Expr, ranges: IntRanges) -> ir.Expr | None:
    """float(x) for an integer sum reading q and k: its terms (like terms collected) grouped into
    one integer per row (the terms reading q but not k), one per key (k but not q) and each term
    reading both, the scalar terms joining the rows', else the keys', else on their own; the
    groups converted and added in f32 when every conversion and partial sum is exact.  None: no
    grouping is."""
    coefficients: dict[ir.Expr, int] = {}
    for sign, t in _terms(x):
        coefficients[t] = coefficients.get(t, 0) + sign
    terms = [(c, t) for t, c in coefficients.items() if c]
    if any(t.type is not I32 for _, t in terms):
        return None
    reads = [ir.free_vars(t) & {"q", "k"} for _, t in terms]
    row = [ct for ct, r in zip(terms, reads) if r == {"q"}]
    key = [ct for ct, r in zip(terms, reads) if r == {"k"}]
    scalar = [ct for ct, r in zip(terms, reads) if not r]
    cells = [[ct] for ct, r in zip(terms, reads) if len(r) == 2]
    for groups in ([row + scalar, key], [row, key + scalar], [row, key, scalar]):
        parts = [_group(g, ranges) for g in groups if g] + [_group(c, ranges) for c in cells]
        if None not in parts:
            out = _combine(parts, ranges) if parts else ZERO
            if out is not None:
                return out
    return None


def _group(terms: list[tuple[int, ir.Expr]], ranges: IntRanges) -> tuple[int, ir.Expr] | None:
    """(sign, integer) of terms with coefficients, the positive ones first (all negated when none
    is), or None when a partial sum may leave i32 on the guarded calls."""
    terms = sorted(terms, key=lambda ct: ct[0] < 0)
    sign = 1 if terms[0][0] > 0 else -1
    acc = None
    for c, t in terms:
        term = t if abs(c) == 1 else ir.Binary("mul", ir.Const(abs(c), I32), t, I32)
        acc = term if acc is None else ir.Binary("add" if (c > 0) == (sign > 0) else "sub", acc, term, I32)
        if not (fits(ranges(term), I32) and fits(ranges(acc), I32)):
            return None
    return sign, acc


def _combine(parts: list[tuple[int, ir.Expr]], ranges: IntRanges) -> ir.Expr | None:
    """The signed integer parts converted and added in f32, or None where that is not exact."""
    parts = sorted(parts, key=lambda sp: -sp[0])
    if not all(_exact(p, ranges) for _, p in parts):
        return None
    sign, first = parts[0]
    value = ranges(first) if sign > 0 else binary_range("sub", (0, 0), ranges(first))
    out = _to_f32(first, ranges)
    if sign < 0:
        out = ir.Binary("sub", ZERO, out, F32)
    for s, p in parts[1:]:
        if not (-EXACT <= value[0] and value[1] <= EXACT):
            return None
        value = binary_range("add" if s > 0 else "sub", value, ranges(p))
        out = ir.Binary("add" if s > 0 else "sub", out, _to_f32(p, ranges), F32)
    return out
