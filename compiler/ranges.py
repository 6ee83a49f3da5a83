"""Value ranges of expressions: the one place that decides integer widths and which score
programs can produce a non-finite value.

**Integers** are mathematical integers in the language.  Every integer expression has a range
computed here from the ranges of what it reads — positions ``q``, ``k`` in ``[0, MAX_LENGTH)``,
``b`` below ``MAX_BATCH``, ``h`` below the spec's ``H_q``, i32 tensor values anywhere in i32 —
and is computed in i32 where its range (and its operands') fits, in i64 where it does not
(``compiler/lower.py: widen_integers``).  An expression whose range may leave i64 is refused by lowering with a
located error, so no backend ever wraps around.

**Floats** are IEEE binary32.  ``may_be_nonfinite`` decides whether a score program can turn a
finite score into NaN or +inf (``exp`` overflow, ``log``/``sqrt`` of a negative, a division by
a value that may be 0, a sum or product that may overflow, ...): only such programs pay for the
run-time check of the non-finite-score policy on the kernels that cannot raise in place.  Its
inputs -- the scaled q.k and the f32 tensors' values -- are taken to be finite and at most 2^63 in
magnitude (``FINITE_INPUT``: sums and products of two are finite, ``exp`` of one is not); a NaN or
inf in them, or a larger value that overflows, is the inputs' and is found as a NaN in q or K is,
by the rows it marks (on a GPU, the device flag).
"""
from __future__ import annotations

import math

from . import ir
from .ir import I32, INT_BOUNDS
from .scalar import FLT_MAX

MAX_LENGTH = 2**30
"""The most keys a request may have (S_k): positions are in [0, MAX_LENGTH), so `q + small`
and `q - k` stay i32.  Calls with longer requests are refused (compiler.ranges.check_length)."""
MAX_BATCH = 2**31 - 1
MAX_HEADS = 2**16

SHIFT_COUNT = (0, 63)

Range = tuple[int, int]


def check_length(s_k: int, what: str = "S_k") -> None:
    """Refuse a call whose positions leave the range the compiler proved its arithmetic for."""
    if s_k > MAX_LENGTH:
        from .errors import PlanError
        raise PlanError(f"{what} = {s_k} keys exceeds the language's limit of {MAX_LENGTH} positions "
                        "(integer arithmetic in masks is proven to fit for positions below it)")


def var_range(name: str, heads_q: int | None, positions: int = MAX_LENGTH) -> Range:
    """The values a variable takes; ``positions`` bounds q and k (a guard tighter than the
    language's, for code that runs only on such calls), never the lengths S_q and S_k."""
    if name in ("q", "k"):
        return 0, positions - 1
    if name == "b":
        return 0, MAX_BATCH - 1
    if name == "h":
        return 0, (heads_q or MAX_HEADS) - 1
    if name in ("S_q", "S_k"):
        return 1, MAX_LENGTH
    raise KeyError(name)


def fits(r: Range, t: ir.Type) -> bool:
    lo, hi = INT_BOUNDS[t]
    return lo <= r[0] and r[1] <= hi


class IntRanges:
    """Ranges of the integer nodes of one program's expressions (memoized by node identity);
    ``positions``: q and k lie below it (default: the language's MAX_LENGTH)."""

    def __init__(self, heads_q: int | None, positions: int = MAX_LENGTH):
        self.heads_q = heads_q
        self.positions = positions
        self._memo: dict[int, tuple[ir.Expr, Range]] = {}

    def __call__(self, e: ir.Expr) -> Range:
        hit = self._memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        r = self._compute(e)
        self._memo[id(e)] = (e, r)
        return r

    def _compute(self, e: ir.Expr) -> Range:
        if isinstance(e, ir.Const):
            return int(e.value), int(e.value)
        if isinstance(e, ir.Var):
            return var_range(e.name, self.heads_q, self.positions)
        if isinstance(e, ir.Load):
            return INT_BOUNDS[I32]  # a declared i32 tensor holds any i32
        if isinstance(e, ir.Unary):
            lo, hi = self(e.operand)
            return (-hi, -lo) if e.op == "neg" else (lo, hi)  # cast_i64 keeps the value
        if isinstance(e, ir.Select):
            (a, b), (c, d) = self(e.if_true), self(e.if_false)
            return min(a, c), max(b, d)
        if isinstance(e, ir.Call):
            return _call_range(e.fn, [self(a) for a in e.args])
        if isinstance(e, ir.Binary):
            return binary_range(e.op, self(e.left), self(e.right))
        raise TypeError(f"not an integer expression: {e!r}")


def _call_range(fn: str, args: list[Range]) -> Range:
    """The range of an integer call (the functions of ir.CALL_FNS outside FLOAT_FNS)."""
    if fn == "sign":
        (lo, hi), = args
        return (-1 if lo < 0 else 0 if lo == 0 else 1), (1 if hi > 0 else 0 if hi == 0 else -1)
    if fn == "abs":
        (lo, hi), = args
        if lo >= 0:
            return lo, hi
        if hi <= 0:
            return -hi, -lo
        return 0, max(-lo, hi)
    if fn not in ("min", "max"):
        raise TypeError(f"no integer range rule for {fn}")
    (a, b), (c, d) = args
    return (min(a, c), min(b, d)) if fn == "min" else (max(a, c), max(b, d))


def _bits(r: Range) -> int:
    """The smallest m with r inside [-2**m, 2**m)."""
    return max(r[1].bit_length(), (-r[0] - 1).bit_length() if r[0] < 0 else 0)


def binary_range(op: str, a: Range, b: Range) -> Range:
    (al, ah), (bl, bh) = a, b
    if op == "add":
        return al + bl, ah + bh
    if op == "sub":
        return al - bh, ah - bl
    if op == "mul":
        c = (al * bl, al * bh, ah * bl, ah * bh)
        return min(c), max(c)
    if op == "floordiv":
        if bl > 0 or bh < 0:  # floor(x / y) is monotone in x and in y on one side of 0
            c = (al // bl, al // bh, ah // bl, ah // bh)
            return min(c), max(c)
        m = max(abs(al), abs(ah))  # |x // y| <= |x| for |y| >= 1, and x // 0 = 0
        return -m, m
    if op == "mod":
        m = max(abs(bl), abs(bh))
        lo = 0 if bl >= 0 else -(m - 1)
        hi = 0 if bh <= 0 else m - 1
        if bl <= 0 <= bh:  # x % 0 = x
            lo, hi = min(lo, al), max(hi, ah)
        return min(lo, 0), max(hi, 0)
    if op in ("shl", "shr"):  # x << n = x * 2**n, x >> n = floor(x / 2**n); counts lie in [0, 63]
        lo_n, hi_n = (min(max(n, SHIFT_COUNT[0]), SHIFT_COUNT[1]) for n in (bl, bh))
        shift = (lambda x, n: x << n) if op == "shl" else (lambda x, n: x >> n)
        c = (shift(al, lo_n), shift(al, hi_n), shift(ah, lo_n), shift(ah, hi_n))
        return min(c), max(c)
    if op in ("bitand", "bitor", "bitxor"):
        if op == "bitand" and (al >= 0 or bl >= 0):  # a non-negative operand bounds the result
            return 0, min(h for l, h in ((al, ah), (bl, bh)) if l >= 0)
        m = max(_bits(a), _bits(b))  # two's complement: [-2**m, 2**m) is closed under & | ^
        if al >= 0 and bl >= 0:
            return 0, 2**m - 1
        return -2**m, 2**m - 1
    raise ValueError(f"not an integer operator: {op}")


# ---------------------------------------------------------------- floats
_OVERFLOW = float.fromhex("0x1.ffffffp+127")  # the smallest magnitude that rounds to inf in f32
_EXP_MAX = math.log(FLT_MAX)


class _F:
    """A float node's possible values: [lo, hi] (±inf allowed) and whether NaN is possible."""

    __slots__ = ("lo", "hi", "nan")

    def __init__(self, lo: float, hi: float, nan: bool = False):
        self.lo, self.hi, self.nan = lo, hi, nan


INPUT_BOUND = 2.0 ** 63
FINITE_INPUT = _F(-INPUT_BOUND, INPUT_BOUND)  # the score or an f32 tensor read, as may_be_nonfinite takes them
ANY_VALUE = _F(-math.inf, math.inf, True)  # an f32 tensor read that may hold anything


def _round(x: float) -> float:
    return math.copysign(math.inf, x) if abs(x) >= _OVERFLOW else x


def _span(values, nan: bool) -> _F:
    vals = [v for v in values if not math.isnan(v)]
    nan = nan or len(vals) < len(values)
    return _F(_round(min(vals, default=-math.inf)), _round(max(vals, default=math.inf)), nan)


def _exp(x: float) -> float:
    """exp in f32's range: 0 below exp's underflow, inf past f32's largest (never OverflowError)."""
    return 0.0 if x < -745 else math.inf if x > _EXP_MAX else math.exp(x)


def _floor(x: float) -> float:
    return float(math.floor(x)) if math.isfinite(x) else x  # (a quotient may overflow to inf)


def _mul(a: float, b: float) -> float:
    return math.nan if (a == 0 and math.isinf(b)) or (b == 0 and math.isinf(a)) else a * b


def may_be_nonfinite(program: ir.Program) -> bool:
    """Whether the score program can produce NaN or +inf from finite inputs (``FINITE_INPUT``):
    the kernels that cannot raise at the cell then check their output rows after the call."""
    if not program.score:
        return False
    ints = IntRanges(program.heads_q)
    score = FINITE_INPUT
    for stmt in program.score:  # (each statement reads the score the one before it made)
        score = _evaluator(ints, score, FINITE_INPUT)(stmt)
        if score.nan or score.hi == math.inf:
            return True
    return False


def float_range(e: ir.Expr, ints: IntRanges, finite_tensors: bool = False) -> tuple[float, float, bool]:
    """(lo, hi, may be NaN): the values an f32 expression that reads no score may take, its
    integers ranging as ``ints`` has them (compiler/separable.py bounds a score program's parts
    with it); ``finite_tensors``: its f32 tensor reads are finite inputs (what ``may_be_nonfinite``
    assumes; compiler/sinks.py asks it of a sink), else anything, NaN included."""
    r = _evaluator(ints, _F(-math.inf, math.inf, True), FINITE_INPUT if finite_tensors else ANY_VALUE)(e)
    return r.lo, r.hi, r.nan


def _evaluator(ints: IntRanges, score: _F, tensor: _F):
    """``_float`` over a tree, each shared node evaluated once, ``score`` the range of the score,
    ``tensor`` that of an f32 tensor read."""
    memo: dict[int, tuple[ir.Expr, _F]] = {}

    def f(e: ir.Expr) -> _F:
        hit = memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        r = _float(e, f, ints, score, tensor)
        memo[id(e)] = (e, r)
        return r
    return f


def _float(e: ir.Expr, f, ints: IntRanges, score: _F, tensor: _F) -> _F:
    if isinstance(e, ir.Const):
        return _F(float(e.value), float(e.value), math.isnan(e.value))
    if isinstance(e, ir.Var):
        return score
    if isinstance(e, ir.Load):
        return tensor
    if isinstance(e, ir.Unary):
        if e.op == "cast_f32":
            lo, hi = ints(e.operand)
            return _F(_round(float(lo)), _round(float(hi)))
        x = f(e.operand)
        return _F(-x.hi, -x.lo, x.nan)
    if isinstance(e, ir.Select):
        a, b = f(e.if_true), f(e.if_false)
        return _F(min(a.lo, b.lo), max(a.hi, b.hi), a.nan or b.nan)
    if isinstance(e, ir.Binary):
        a, b = f(e.left), f(e.right)
        nan = a.nan or b.nan
        if e.op == "add":
            return _span([a.lo + b.lo, a.hi + b.hi], nan or (a.lo == -math.inf and b.hi == math.inf)
                         or (a.hi == math.inf and b.lo == -math.inf))
        if e.op == "sub":
            return _span([a.lo - b.hi, a.hi - b.lo], nan or (a.lo == -math.inf and b.lo == -math.inf)
                         or (a.hi == math.inf and b.hi == math.inf))
        if e.op == "mul":
            return _span([_mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)], nan)
        if b.lo <= 0 <= b.hi or math.isinf(a.lo) or math.isinf(a.hi):  # div, floordiv, mod
            return _F(-math.inf, math.inf, True)
        if e.op == "div":
            return _span([x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)], nan)
        if e.op == "floordiv":
            return _span([_floor(x / y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)], nan)
        m = max(abs(b.lo), abs(b.hi))
        return _F(-m, m, nan)
    if isinstance(e, ir.Call):
        xs = [f(a) for a in e.args]
        nan = any(x.nan for x in xs)
        if e.fn in ("min", "max"):
            pick = min if e.fn == "min" else max
            return _F(pick(xs[0].lo, xs[1].lo), pick(xs[0].hi, xs[1].hi), nan)
        x = xs[0]
        if e.fn == "abs":
            lo = 0.0 if x.lo <= 0 <= x.hi else min(abs(x.lo), abs(x.hi))
            return _F(lo, max(abs(x.lo), abs(x.hi)), nan)
        if e.fn == "exp":
            return _F(_exp(x.lo), _exp(x.hi), nan)
        if e.fn in ("log", "sqrt"):
            fn = math.log if e.fn == "log" else math.sqrt
            lo = -math.inf if x.lo <= 0 else fn(x.lo)
            if x.hi == math.inf or (x.hi <= 0 and e.fn == "log"):  # log of values <= 0: -inf (at 0) or NaN
                hi = math.inf if x.hi == math.inf else -math.inf
            else:
                hi = fn(max(x.hi, 0.0))
            return _F(lo, hi, nan or x.lo < 0)
        if e.fn == "sign":  # NaN stays NaN
            return _F(-1.0 if x.lo < 0 else 0.0 if x.lo == 0 else 1.0, 1.0 if x.hi > 0 else 0.0 if x.hi == 0 else -1.0, nan)
        if e.fn in ("tanh", "erf"):
            return _F(-1.0, 1.0, nan)
        if e.fn in ("sin", "cos"):
            return _F(-1.0, 1.0, nan or math.isinf(x.lo) or math.isinf(x.hi))  # NaN at ±inf
        raise TypeError(f"no float range rule for {e.fn}")
    if isinstance(e, ir.Compare):
        return _F(0, 1)
    raise TypeError(e)


