"""The float64 dense oracle: the definition every backend is tested against.

It evaluates the IR mask and score program over the whole
``[B, H_q, S_q, S_k]`` score rectangle with an IR interpreter of its own (not
the code generator's printer, so the two check each other), with
bottom-right positions ``q = S_k - S_q + i`` (M4.5 §0x08B) and the all-masked
policy ``O = 0, LSE = -inf`` (§0x02C).  Inputs are logical ``bhsd`` arrays.
"""
from __future__ import annotations

import numpy as np

from compiler import ir
from compiler.errors import PlanError

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


def positions(batch: int, heads: int, s_q: int, s_k: int) -> dict[str, np.ndarray]:
    """Broadcastable b, h, q, k grids over [B, H_q, S_q, S_k] with bottom-right q."""
    if s_q > s_k:
        raise PlanError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys; every query row is a "
                        "token whose own key is in the cache (bottom-right alignment)")
    return {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(heads).reshape(1, -1, 1, 1),
        "q": (s_k - s_q + np.arange(s_q)).reshape(1, 1, -1, 1),
        "k": np.arange(s_k).reshape(1, 1, 1, -1),
    }


def dense_mask(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict) -> np.ndarray:
    """The visibility of every cell, bool [B, H_q, S_q, S_k]."""
    env = positions(batch, program.heads_q, s_q, s_k)
    m = evaluate(program.mask, env, tensors)
    return np.broadcast_to(m, (batch, program.heads_q, s_q, s_k))


def reference(program: ir.Program, q, k, v, tensors: dict | None = None):
    """Float64 attention: returns (O [B,H_q,S_q,d_v], LSE [B,H_q,S_q]).

    q [B,H_q,S_q,d_qk], k [B,H_kv,S_k,d_qk], v [B,H_kv,S_k,d_v] (bhsd)."""
    tensors = tensors or {}
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, _, s_q, _ = q.shape
    s_k = k.shape[2]
    kv_head = np.arange(program.heads_q) // program.group
    k, v = k[:, kv_head], v[:, kv_head]  # GQA: query head h reads K/V head h // G
    scores = np.einsum("bhid,bhjd->bhij", q, k) * program.scale
    env = positions(batch, program.heads_q, s_q, s_k)
    for stmt in program.score:
        scores = np.broadcast_to(evaluate(stmt, {**env, "score": scores}, tensors), scores.shape)
    visible = dense_mask(program, batch, s_q, s_k, tensors)
    bad = visible & ~np.isfinite(scores)
    if bad.any():
        b, h, i, j = (int(x[0]) for x in np.nonzero(bad))
        raise PlanError(f"the score program produced {scores[b, h, i, j]} at visible cell "
                        f"(b={b}, h={h}, q={s_k - s_q + i}, k={j})")
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    valid = np.isfinite(m)
    p = np.exp(scores - np.where(valid, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    o = np.where(valid, (p @ v) / np.where(valid, l, 1.0), 0.0)
    lse = np.where(valid, m + np.log(np.where(valid, l, 1.0)), -np.inf)[..., 0]
    return o, lse
