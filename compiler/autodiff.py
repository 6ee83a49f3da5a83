"""Symbolic differentiation of score programs: the compiler half of the backward pass.

A score program is a chain of statements (``program.score``): statement ``i`` (0-based) reads
``Var("score")`` = its input ``s_i`` (``s_0`` = scale * q.k) and computes ``s_{i+1}``.  The
backward pass needs, per statement, the derivative of its value with respect to its input
and with respect to every ``f32`` tensor read it makes; :func:`score_grad` returns those as
IR expressions over the same variables (positions, ``score`` = the statement's input, loads),
so every backend prints them with the printer it already has and the IR interpreter
evaluates them for the oracle (``compiler/oracle.py: reference_backward``).

Rules (forward-mode, one node kind at a time; an ``i32`` or ``bool`` subexpression has
derivative 0, and so has ``cast_f32`` of an integer):

=================  ======================================================================
``a + b, a - b``   ``da + db``, ``da - db``
``a * b``          ``da * b + a * db``
``a / b``          ``(da - (a / b) * db) / b``
``a // b`` (f32)   0 (``floor(a / b)`` is piecewise constant; torch's ``floor`` has gradient 0)
``a % b`` (f32)    ``da - db * (a // b)`` (``a % b = a - b * floor(a / b)``; torch's remainder)
``-a``             ``-da``
``where(c, a, b)`` ``where(c, da, db)``: the derivative of the branch taken
``min(a, b)``      ``where(a < b, da, where(a == b, 0.5 * (da + db), db))``; ``max`` with ``>``
``abs(a)``         ``where(a > 0, da, where(a < 0, -da, 0))`` (``sign(0) = 0``)
``sign(a)``        0 (piecewise constant, as torch's ``sign``)
``exp(a)``         ``da * exp(a)``
``log(a)``         ``da / a``
``sqrt(a)``        ``da / (2 * sqrt(a))``
``tanh(a)``        ``da * (1 - tanh(a) * tanh(a))``
=================  ======================================================================

Where the derivative is not defined, the rules follow torch's autograd formulas for the same
function (``tools/autograd/derivatives.yaml``): ties of ``min``/``max`` split the gradient in
half, ``abs`` has derivative 0 at 0, ``sqrt`` has derivative ``+inf`` at 0 and ``log``
``+-inf`` at 0.  An infinite derivative at a visible cell is not turned into a silent NaN:
the backward references report it as an error naming the statement and the cell.

The result is simplified as it is built (``x * 1``, ``x + 0``, ``0 * x``, constant folding
when exact, ``c * (x / c) = x``), so the derivative of ``30.0 * tanh(score / 30.0)`` prints as
``1.0 - tanh(score / 30.0) * tanh(score / 30.0)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
import math

from . import ir
from .ir import F32

ZERO = ir.Const(0.0, F32)
ONE = ir.Const(1.0, F32)
HALF = ir.Const(0.5, F32)
SCORE = ir.Var("score", F32)


@dataclass(frozen=True)
class ScoreGrad:
    """The derivatives of a score program, statement by statement (indices 0-based).

    ``forward[i]`` is statement i (``program.score[i]``); it reads ``Var("score")`` = its input.
    ``dscore[i]`` is d(statement i) / d(its input), an f32 expression reading the same
    ``Var("score")``.  ``dloads`` holds ``(i, load, d(statement i) / d(load))`` for every
    distinct f32 ``Load`` node of statement i (structural equality; pre-order), again at the
    statement's input.  ``tensors`` names the f32 tensors those loads read, in declaration
    order: the tensors that get a gradient.  Chained from the last statement back, with
    ``g = dL/ds_n``: a load of statement i receives ``g_i * dloads`` and ``g_{i-1} = g_i *
    dscore[i]``; ``g_0 = dL/ds_0``.  A program without score statements gives empty tuples
    (``ds_n / ds_0 = 1``)."""

    forward: tuple[ir.Expr, ...]
    dscore: tuple[ir.Expr, ...]
    dloads: tuple[tuple[int, ir.Load, ir.Expr], ...]
    tensors: tuple[str, ...]


def score_grad(program: ir.Program) -> ScoreGrad:
    forward = tuple(program.score)
    dscore = tuple(derivative(s, SCORE) for s in forward)
    dloads = tuple((i, load, derivative(s, load)) for i, s in enumerate(forward) for load in f32_loads(s))
    read = {load.tensor for _, load, _ in dloads}
    return ScoreGrad(forward, dscore, dloads, tuple(t.name for t in program.tensors if t.name in read))


def f32_loads(e: ir.Expr) -> tuple[ir.Load, ...]:
    """The distinct f32 loads of ``e`` (structural equality), in pre-order."""
    return tuple(dict.fromkeys(n for n in ir.walk(e) if isinstance(n, ir.Load) and n.type is F32))


def derivative(e: ir.Expr, wrt: ir.Var | ir.Load) -> ir.Expr:
    """d e / d wrt as a simplified f32 expression; ``wrt`` is ``Var("score")`` or an f32
    ``Load`` node (every structurally equal occurrence of it is the same variable)."""
    if not (wrt == SCORE or (isinstance(wrt, ir.Load) and wrt.type is F32)):
        raise ValueError(f"cannot differentiate with respect to {wrt!r}: only score and f32 loads vary")
    return _derivative(e, wrt)


@lru_cache(maxsize=4096)
def _derivative(e: ir.Expr, wrt: ir.Expr) -> ir.Expr:
    if e == wrt:
        return ONE
    if e.type is not F32 or not _depends(e, wrt):
        return ZERO  # integer and boolean values, constants, other variables and loads
    d = lambda x: _derivative(x, wrt)  # noqa: E731
    if isinstance(e, ir.Unary):  # neg, or cast_f32 of an f32 (an i32 operand does not depend)
        return neg(d(e.operand)) if e.op == "neg" else d(e.operand)
    if isinstance(e, ir.Select):
        return select(e.cond, d(e.if_true), d(e.if_false))
    if isinstance(e, ir.Binary):
        a, b = e.left, e.right
        if e.op == "add":
            return add(d(a), d(b))
        if e.op == "sub":
            return sub(d(a), d(b))
        if e.op == "mul":
            return add(mul(d(a), b), mul(a, d(b)))
        if e.op == "div":
            return div(sub(d(a), mul(e, d(b))), b)
        if e.op == "floordiv":
            return ZERO
        if e.op == "mod":
            return sub(d(a), mul(d(b), ir.Binary("floordiv", a, b, F32)))
    if isinstance(e, ir.Call):
        return _call_rule(e, [d(a) for a in e.args])
    raise TypeError(f"no derivative rule for {e!r}")


def _call_rule(e: ir.Call, da: list[ir.Expr]) -> ir.Expr:
    x = e.args[0]
    if e.fn in ("min", "max"):
        a, b = e.args
        if da[0] == da[1]:
            return da[0]
        first = ir.Compare("lt" if e.fn == "min" else "gt", a, b)
        return select(first, da[0], select(ir.Compare("eq", a, b), mul(HALF, add(da[0], da[1])), da[1]))
    if e.fn == "sign":  # piecewise constant: 0 everywhere (torch's rule, at 0 too)
        return ZERO
    if e.fn == "abs":
        return select(ir.Compare("gt", x, ZERO), da[0], select(ir.Compare("lt", x, ZERO), neg(da[0]), ZERO))
    if e.fn == "exp":
        return mul(da[0], e)
    if e.fn == "log":
        return div(da[0], x)
    if e.fn == "sqrt":
        return div(da[0], mul(ir.Const(2.0, F32), e))
    if e.fn == "tanh":
        return mul(da[0], sub(ONE, mul(e, e)))
    if e.fn == "sin":
        return mul(da[0], ir.Call("cos", (x,), F32))
    if e.fn == "cos":
        return neg(mul(da[0], ir.Call("sin", (x,), F32)))
    if e.fn == "erf":  # 2 / sqrt(pi) exp(-x^2)
        return mul(da[0], mul(ir.Const(1.1283791670955126, F32), ir.Call("exp", (neg(mul(x, x)),), F32)))
    raise TypeError(f"no derivative rule for {e.fn}")


@lru_cache(maxsize=4096)
def _depends(e: ir.Expr, wrt: ir.Expr) -> bool:
    return e == wrt or any(_depends(c, wrt) for c in ir.children(e))


# ---------------------------------------------------------------- simplifying constructors
def _const(e: ir.Expr) -> float | None:
    return e.value if isinstance(e, ir.Const) and e.type is F32 else None


def _exact(value: float, exact: Fraction) -> ir.Const | None:
    """``value`` as a constant when it is finite and equal to the exact result."""
    if math.isfinite(value) and Fraction(value) == exact:
        return ir.Const(float(value), F32)
    return None


def neg(a: ir.Expr) -> ir.Expr:
    if _const(a) is not None:
        return ir.Const(-a.value, F32)
    if isinstance(a, ir.Unary) and a.op == "neg":
        return a.operand
    return ir.Unary("neg", a, F32)


def add(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a == ZERO:
        return b
    if b == ZERO:
        return a
    if isinstance(b, ir.Unary) and b.op == "neg":
        return sub(a, b.operand)
    if _const(a) is not None and _const(b) is not None:
        folded = _exact(a.value + b.value, Fraction(a.value) + Fraction(b.value))
        if folded is not None:
            return folded
    return ir.Binary("add", a, b, F32)


def sub(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if b == ZERO:
        return a
    if a == ZERO:
        return neg(b)
    if isinstance(b, ir.Unary) and b.op == "neg":
        return add(a, b.operand)
    if _const(a) is not None and _const(b) is not None:
        folded = _exact(a.value - b.value, Fraction(a.value) - Fraction(b.value))
        if folded is not None:
            return folded
    return ir.Binary("sub", a, b, F32)


def mul(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _const(b) is not None and _const(a) is None:
        a, b = b, a  # a constant factor goes first
    if a == ZERO or b == ZERO:
        return ZERO
    if a == ONE:
        return b
    if _const(a) == -1.0:
        return neg(b)
    if isinstance(a, ir.Unary) and a.op == "neg":
        return neg(mul(a.operand, b))
    if isinstance(b, ir.Unary) and b.op == "neg":
        return neg(mul(a, b.operand))
    for x, y in ((a, b), (b, a)):  # x * (1 / y) = x / y
        if isinstance(y, ir.Binary) and y.op == "div" and y.left == ONE:
            return div(x, y.right)
    if _const(a) is not None:
        c = a.value
        if _const(b) is not None:
            folded = _exact(c * b.value, Fraction(c) * Fraction(b.value))
            if folded is not None:
                return folded
        if isinstance(b, ir.Binary) and b.op in ("mul", "div") and _const(b.left if b.op == "mul" else b.right) \
                is not None:  # c * (c2 * x) and c * (x / c2): merge the constants when exact
            other, c2 = (b.right, b.left.value) if b.op == "mul" else (b.left, b.right.value)
            exact = Fraction(c) * Fraction(c2) if b.op == "mul" else Fraction(c) / Fraction(c2)
            folded = _exact(c * c2 if b.op == "mul" else c / c2, exact)
            if folded is not None:
                return mul(folded, other)
    return ir.Binary("mul", a, b, F32)


def div(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if b == ONE:
        return a
    if a == ZERO:
        return ZERO
    if isinstance(a, ir.Unary) and a.op == "neg":
        return neg(div(a.operand, b))
    if _const(a) is not None and _const(b) is not None and b.value != 0:
        folded = _exact(a.value / b.value, Fraction(a.value) / Fraction(b.value))
        if folded is not None:
            return folded
    return ir.Binary("div", a, b, F32)


def select(cond: ir.Expr, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a == b:
        return a
    if isinstance(cond, ir.Const):
        return a if cond.value else b
    return ir.Select(cond, a, b, F32)
