"""The language's arithmetic on Python scalars: what the checker and the constant folder compute
for name-free expressions, so a folded constant is the value every backend would compute.

Integers are exact (``compiler/ranges.py`` proves each fits its width), ``x // 0 = 0`` and
``x % 0 = x``; floats are binary32: operands and every result are rounded to f32, ``x // y`` is
``floor(x / y)`` and ``x % y`` is ``x - floor(x / y) * y`` (each step rounded).
"""
from __future__ import annotations

import math

import numpy as np

FLT_MAX = float.fromhex("0x1.fffffep+127")


def f32(value: float) -> float:
    """A float as binary32 holds it."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def int_floordiv(a: int, b: int) -> int:
    return a // b if b else 0


def int_mod(a: int, b: int) -> int:
    return a % b if b else a


def float_floordiv(a: float, b: float) -> float:
    """floor(a / b) in f32 (a zero divisor raises ZeroDivisionError: not folded, run time computes it)."""
    return float(math.floor(f32(a / b)))


def float_mod(a: float, b: float) -> float:
    return f32(a - f32(float_floordiv(a, b) * b))


def sign(x):
    """-1, 0 or 1 in x's type (an int for an int, a float for a float); sign(NaN) is NaN and
    sign(-0.0) is 0.0, as numpy's ``np.sign``."""
    if x != x:
        return x
    return type(x)((x > 0) - (x < 0))


# The language's functions on Python scalars (ir.CALL_FNS's names), before the f32 rounding of
# the result that the checker and the constant folder apply.
CALLS = {"min": min, "max": max, "abs": abs, "sign": sign, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
         "tanh": math.tanh, "erf": math.erf, "sin": math.sin, "cos": math.cos}
