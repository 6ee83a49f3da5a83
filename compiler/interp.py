"""An IR interpreter over numpy arrays (int64 for i32, float64 for f32).

The float64 oracle and the mask analyses evaluate IR with it; the code
generators print IR instead, so the two paths check each other.
"""
from __future__ import annotations

import numpy as np

from . import ir
from .errors import PlanError

_ARITH = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.mod, "and": np.logical_and, "or": np.logical_or,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
_CALL = {"min": np.minimum, "max": np.maximum, "abs": np.abs, "exp": np.exp, "log": np.log,
         "sqrt": np.sqrt, "tanh": np.tanh}


def load(name: str, array: np.ndarray, index: tuple) -> np.ndarray:
    """``array[index]`` with every index checked; an out-of-range read is a PlanError
    naming the tensor, the axis, the index and the value."""
    index = [np.asarray(i) for i in index]
    for axis, (i, n) in enumerate(zip(index, array.shape)):
        bad = (i < 0) | (i >= n)
        if np.any(bad):
            where = tuple(int(x[0]) for x in np.nonzero(bad))
            value = int(i[where] if i.ndim else i)
            raise PlanError(f"tensor '{name}' read out of range: axis {axis} index {value} is outside "
                            f"[0, {n}) (shape {list(array.shape)})")
    return array[tuple(index)]


def evaluate(e: ir.Expr, env: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> np.ndarray:
    """Evaluate ``e`` with numpy broadcasting; i32 in int64, f32 in float64 (the oracle)."""
    if isinstance(e, ir.Const):
        return np.asarray(e.value, {ir.BOOL: bool, ir.I32: np.int64, ir.F32: np.float64}[e.type])
    if isinstance(e, ir.Var):
        return env[e.name]
    if isinstance(e, ir.Load):
        idx = tuple(evaluate(i, env, tensors) for i in e.index)
        return load(e.tensor, tensors[e.tensor], idx)
    if isinstance(e, ir.Unary):
        x = evaluate(e.operand, env, tensors)
        return {"neg": np.negative, "not": np.logical_not,
                "cast_f32": lambda a: np.asarray(a, np.float64)}[e.op](x)
    if isinstance(e, ir.Binary):
        a, b = evaluate(e.left, env, tensors), evaluate(e.right, env, tensors)
        if e.op in ("floordiv", "mod") and e.type is ir.I32 and np.any(b == 0):
            raise PlanError(f"integer division by zero in '{e.op}' while evaluating the spec")
        with np.errstate(divide="ignore", invalid="ignore"):
            return _ARITH[e.op](a, b)
    if isinstance(e, ir.Compare):
        return _COMPARE[e.op](evaluate(e.left, env, tensors), evaluate(e.right, env, tensors))
    if isinstance(e, ir.Select):
        return np.where(evaluate(e.cond, env, tensors), evaluate(e.if_true, env, tensors),
                        evaluate(e.if_false, env, tensors))
    if isinstance(e, ir.Call):
        args = [evaluate(a, env, tensors) for a in e.args]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return _CALL[e.fn](*args)
    raise TypeError(e)
