"""An IR interpreter over numpy arrays, with the language's semantics (README "The language"):
integers exact (int64 holds every i32 and i64 value the range analysis allows), floats in
binary32, ``x // 0 = 0`` and ``x % 0 = x``, and a tensor read outside its tensor an error only
where its value is used: ``where(c, a, b)`` evaluates ``a``'s errors only where ``c`` holds and
``b``'s only where it does not; ``a & b`` evaluates ``b``'s only where ``a`` holds, ``a | b``
only where it does not.

The oracle and the mask analyses evaluate IR with it; the code generators print IR instead, so
the two paths check each other.
"""
from __future__ import annotations

import math

import numpy as np

from . import ir
from .errors import PlanError

COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}


# The language's arithmetic that numpy lacks; backends/numpy/emit.py prints these three into the
# generated modules (so they use nothing but np and math).
def erf(x):
    """erf in float32 (numpy has none): computed in float64 by math.erf, rounded once."""
    x = np.asarray(x, np.float32)
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x), np.float64).astype(np.float32) if x.size else x


def _erf64(x):
    """erf in float64 (``evaluate(..., wide=True)``)."""
    x = np.asarray(x, np.float64)
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x), np.float64) if x.size else x


def floordiv(a, b):
    """The language's `//`: floor division, total on integers (x // 0 = 0); floor(a / b) on floats."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return np.floor(a / b)
    zero = b == 0
    return np.where(zero, 0, np.floor_divide(a, np.where(zero, 1, b)))


def mod(a, b):
    """The language's `%`: the remainder with the divisor's sign, total on integers (x % 0 = x);
    a - floor(a / b) * b on floats."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return a - np.floor(a / b) * b
    zero = b == 0
    return np.where(zero, a, np.mod(a, np.where(zero, 1, b)))


ARITH = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "floordiv": floordiv,
    "mod": mod, "bitand": np.bitwise_and, "bitor": np.bitwise_or, "bitxor": np.bitwise_xor,
    "shl": np.left_shift, "shr": np.right_shift, "and": np.logical_and, "or": np.logical_or,
}
CALL = {"min": np.minimum, "max": np.maximum, "abs": np.abs, "sign": np.sign, "exp": np.exp, "log": np.log,
        "sqrt": np.sqrt, "tanh": np.tanh, "erf": erf, "sin": np.sin, "cos": np.cos}  # keyed by ir.CALL_FNS


def load(name: str, array: np.ndarray, index: tuple, care=None) -> np.ndarray:
    """``array[index]`` with every index checked where ``care`` holds (everywhere when None):
    an out-of-range read there is a PlanError naming the tensor, the axis, the index and the
    value; elsewhere the read is clamped and its value unused."""
    index = [np.asarray(i) for i in index]
    for axis, (i, n) in enumerate(zip(index, array.shape)):
        bad = (i < 0) | (i >= n)
        if care is not None and np.any(bad):
            bad = bad & care
        if np.any(bad):
            where = tuple(int(x[0]) for x in np.nonzero(bad))
            full = np.broadcast_to(i, np.shape(bad))
            value = int(full[where] if full.ndim else full)
            raise PlanError(f"tensor '{name}' read out of range: axis {axis} index {value} is outside "
                            f"[0, {n}) (shape {list(array.shape)})")
        if care is not None:
            index[axis] = np.clip(i, 0, max(n - 1, 0))
    return array[tuple(index)]


def _narrow(care, where):
    return where if care is None else care & where


def _value(e: ir.Expr, v, wide: bool = False):
    """A value as its IR type holds it: f32 as float32 (float64 when ``wide``), integers as int64."""
    if e.type is ir.F32:
        return np.asarray(v, np.float64 if wide else np.float32)
    if e.type.integer:
        return np.asarray(v, np.int64)
    return np.asarray(v, bool)


def evaluate(e: ir.Expr, env: dict[str, np.ndarray], tensors: dict[str, np.ndarray], care=None,
             wide: bool = False) -> np.ndarray:
    """Evaluate ``e`` with numpy broadcasting.  ``care`` (a bool array, None: everywhere) is where
    the value is used: reads outside a tensor are errors only there.  ``wide``: f32 arithmetic in
    float64 instead (the float64 backward reference and its finite-difference checks; the
    language itself computes f32 in float32)."""
    rec = lambda x, c=care: evaluate(x, env, tensors, c, wide)  # noqa: E731
    if isinstance(e, ir.Const):
        return _value(e, e.value, wide)
    if isinstance(e, ir.Var):
        return _value(e, env[e.name], wide)
    if isinstance(e, ir.Load):
        idx = tuple(rec(i) for i in e.index)
        return _value(e, load(e.tensor, tensors[e.tensor], idx, care), wide)
    if isinstance(e, ir.Select):
        c = rec(e.cond)
        return np.where(c, rec(e.if_true, _narrow(care, c)), rec(e.if_false, _narrow(care, ~c)))
    if isinstance(e, ir.Binary) and e.op in ("and", "or"):  # the right side's errors count where it decides
        a = rec(e.left)
        b = rec(e.right, _narrow(care, a if e.op == "and" else ~a))
        return np.logical_and(a, b) if e.op == "and" else np.logical_or(a, b)
    args = [rec(c) for c in ir.children(e)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if isinstance(e, ir.Unary):
            x, = args
            f = np.float64 if wide else np.float32
            return {"neg": np.negative, "not": np.logical_not, "cast_f32": lambda a: np.asarray(a, f),
                    "cast_i64": lambda a: a}[e.op](x)
        if isinstance(e, ir.Binary):
            return _value(e, ARITH[e.op](*args), wide)
        if isinstance(e, ir.Compare):
            return COMPARE[e.op](*args)
        if isinstance(e, ir.Call):
            fn = _erf64 if wide and e.fn == "erf" else CALL[e.fn]
            return _value(e, fn(*args), wide)
    raise TypeError(e)
