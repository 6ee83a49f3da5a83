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
