"""AST -> IR, and the ordered pass pipeline.

``compile_spec`` is the front half of the pipeline diagram in DESIGN §1:
parse -> check -> lower -> PIPELINE passes.  Lowering folds the sugar
(`causal`, `window`, `softcap`, `where`, mixed int/float arithmetic) so every
backend sees one small set of typed nodes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from . import ast, ir
from .check import Spec, check
from .frontend import parse, parse_file
from .ir import BOOL, F32, I32


# ---------------------------------------------------------------- lowering
def _cast(e: ir.Expr, t: ir.Type) -> ir.Expr:
    if e.type is t:
        return e
    assert t is F32 and e.type is I32, (e, t)
    if isinstance(e, ir.Const):
        return ir.Const(float(e.value), F32)
    return ir.Unary("cast_f32", e, F32)


def _binary(op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    t = ir.binary_type(op, a.type, b.type)
    if op not in ir.LOGIC_OPS:
        common = F32 if op == "div" else ir.promote(a.type, b.type)
        a, b = _cast(a, common), _cast(b, common)
    return ir.Binary(op, a, b, t)


def _compare(op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a.type.numeric and b.type.numeric:
        common = ir.promote(a.type, b.type)
        a, b = _cast(a, common), _cast(b, common)
    return ir.Compare(op, a, b)


def _call(fn: str, args: list[ir.Expr]) -> ir.Expr:
    if fn in ir.FLOAT_FNS:
        args = [_cast(a, F32) for a in args]
    elif len(args) == 2:
        common = ir.promote(args[0].type, args[1].type)
        args = [_cast(a, common) for a in args]
    return ir.Call(fn, tuple(args), ir.call_type(fn, tuple(a.type for a in args)))


Q, K = ir.Var("q", I32), ir.Var("k", I32)


def lower_flashmask(e: ast.Call, spec: Spec) -> ir.Expr:
    """``flashmask(sri, causal)`` as plain IR: loads of the bounds and compares on ``q``, so
    every backend and the interval analysis see an ordinary mask.

    Paddle's semantics (``flashmask_attention`` docstring, python/paddle/nn/functional/
    flash_attention.py; dense reference ``startend_row_indices_to_attn_bias`` in
    PaddlePaddle/flash-attention flashmask/tests/generate_startend_row_indices.py): column
    ``k`` hides the half-open row ranges

    =========  ====  ======================================  ==============================
    causal     n     bounds ``sri[b, h, k, :]``              masked rows of column k
    =========  ====  ======================================  ==============================
    true       1     ``LTS``                                 ``q < k``, ``[LTS, S)``
    true       2     ``LTS, LTE``                            ``q < k``, ``[LTS, LTE)``
    false      2     ``LTS, UTE``                            ``[0, UTE)``, ``[LTS, S)``
    false      4     ``LTS, LTE, UTS, UTE``                  ``[UTS, UTE)``, ``[LTS, LTE)``
    =========  ====  ======================================  ==============================

    The bounds are compared with the absolute position ``q``: equal to Paddle's row index at
    prefill (``S_q = S_k``), and the same mask's bottom rows in append and decode.  A head
    axis of size 1 broadcasts; a head axis of size H_kv (Paddle's per-K/V-head layout under
    GQA) is read at ``h // G``."""
    name, causal = e.args[0].id, e.args[1].value
    decl = spec.tensor_types[name]
    head_axis, n = decl.axes[1], decl.axes[3]
    h = ir.Var("h", I32)
    if head_axis == "h" or head_axis == spec.heads_q:  # per query head (Paddle: num_heads = H_q)
        head = h
    elif head_axis == 1:
        head = ir.Const(0, I32)
    else:  # H_kv: query head h reads K/V head h // G
        group = spec.heads_q // spec.heads_kv
        head = h if group == 1 else _binary("floordiv", h, ir.Const(group, I32))
    b = ir.Var("b", I32)

    def bound(j: int) -> ir.Expr:
        return ir.Load(name, (b, head, K, ir.Const(j, I32)), I32)

    def masked(lo: ir.Expr, hi: ir.Expr) -> ir.Expr:  # !(lo <= q < hi)
        return ir.Unary("not", _binary("and", ir.Compare("ge", Q, lo), ir.Compare("lt", Q, hi)), BOOL)

    if causal:
        lower = ir.Compare("lt", Q, bound(0)) if n == 1 else masked(bound(0), bound(1))
        return _binary("and", ir.Compare("le", K, Q), lower)
    if n == 2:  # visible: UTE <= q < LTS
        return _binary("and", ir.Compare("lt", Q, bound(0)), ir.Compare("ge", Q, bound(1)))
    return _binary("and", masked(bound(0), bound(1)), masked(bound(2), bound(3)))


def lower_expr(e: ast.Expr, spec: Spec) -> ir.Expr:
    rec = lambda x: lower_expr(x, spec)  # noqa: E731
    if isinstance(e, ast.IntLit):
        return ir.Const(e.value, I32)
    if isinstance(e, ast.FloatLit):
        return ir.Const(e.value, F32)
    if isinstance(e, ast.BoolLit):
        return ir.Const(e.value, BOOL)
    if isinstance(e, ast.Name):
        if e.id == "causal":  # k <= q (DESIGN §3.2)
            return ir.Compare("le", K, Q)
        return ir.Var(e.id, F32 if e.id == "score" else I32)
    if isinstance(e, ast.Index):
        decl = spec.tensor_types[e.tensor]
        return ir.Load(e.tensor, tuple(rec(i) for i in e.indices), decl.dtype)
    if isinstance(e, ast.Unary):
        x = rec(e.operand)
        if e.op == "!":
            return ir.Unary("not", x, BOOL)
        return ir.Unary("neg", x, x.type)
    if isinstance(e, ast.Binary):
        return _binary(ir.SURFACE_BINARY[e.op], rec(e.left), rec(e.right))
    if isinstance(e, ast.Compare):
        return _compare(ir.SURFACE_COMPARE[e.op], rec(e.left), rec(e.right))
    if isinstance(e, ast.Call):
        args = [rec(a) for a in e.args]
        if e.func == "flashmask":
            return lower_flashmask(e, spec)
        if e.func == "window":  # q - k < n
            return _compare("lt", _binary("sub", Q, K), args[0])
        if e.func == "softcap":  # cap * tanh(x / cap)
            x, cap = args
            return _binary("mul", _cast(cap, F32), _call("tanh", [_binary("div", x, cap)]))
        if e.func == "where":
            c, a, b = args
            if a.type.numeric:
                common = ir.promote(a.type, b.type)
                a, b = _cast(a, common), _cast(b, common)
            return ir.Select(c, a, b, a.type)
        return _call(e.func, args)
    raise TypeError(e)


def flashmask_contracts(e: ast.Expr | None, spec: Spec) -> tuple[ir.FlashmaskBounds, ...]:
    """Every ``flashmask(tensor, causal)`` of a checked mask, once each (a walk with its own
    stack: masks may nest deeply)."""
    out, stack = [], [e] if e is not None else []
    while stack:
        x = stack.pop()
        if isinstance(x, ast.Call) and x.func == "flashmask":
            name = x.args[0].id
            c = ir.FlashmaskBounds(name, x.args[1].value, spec.tensor_types[name].axes[3])
            if c not in out:
                out.append(c)
            continue
        stack.extend(c for c in (getattr(x, f, None) for f in ("operand", "left", "right")) if c is not None)
        stack.extend(getattr(x, "args", ()) or ())
        stack.extend(getattr(x, "indices", ()) or ())
    return tuple(out)


def lower(spec: Spec) -> ir.Program:
    mask = lower_expr(spec.mask, spec) if spec.mask is not None else ir.Const(True, BOOL)
    score = tuple(_cast(lower_expr(s, spec), F32) for s in spec.score)
    return ir.Program(
        name=spec.name, heads_q=spec.heads_q, heads_kv=spec.heads_kv, d_qk=spec.d_qk, d_v=spec.d_v,
        dtype=spec.dtype, scale=spec.scale, tensors=tuple(spec.tensor_types.values()), score=score,
        mask=mask, cache=spec.cache, split=spec.split, state=spec.state, masked_rows=spec.masked_rows,
        open_fields=spec.open_fields, flashmask=flashmask_contracts(spec.mask, spec))


# ---------------------------------------------------------------- passes
def map_expr(e: ir.Expr, f: Callable[[ir.Expr], ir.Expr]) -> ir.Expr:
    """Rebuild ``e`` bottom-up, applying ``f`` to every node after its children."""
    if isinstance(e, ir.Load):
        e = ir.Load(e.tensor, tuple(map_expr(i, f) for i in e.index), e.type)
    elif isinstance(e, ir.Unary):
        e = ir.Unary(e.op, map_expr(e.operand, f), e.type)
    elif isinstance(e, ir.Binary):
        e = ir.Binary(e.op, map_expr(e.left, f), map_expr(e.right, f), e.type)
    elif isinstance(e, ir.Compare):
        e = ir.Compare(e.op, map_expr(e.left, f), map_expr(e.right, f))
    elif isinstance(e, ir.Select):
        e = ir.Select(map_expr(e.cond, f), map_expr(e.if_true, f), map_expr(e.if_false, f), e.type)
    elif isinstance(e, ir.Call):
        e = ir.Call(e.fn, tuple(map_expr(a, f) for a in e.args), e.type)
    return f(e)


def map_program(p: ir.Program, f: Callable[[ir.Expr], ir.Expr]) -> ir.Program:
    from dataclasses import replace
    return replace(p, mask=map_expr(p.mask, f), score=tuple(map_expr(s, f) for s in p.score))


_FOLD = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
}
_FOLD_CALL = {"min": min, "max": max, "abs": abs, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
              "tanh": math.tanh}


I32_RANGE = (-2**31, 2**31)


def _typed(value, t: ir.Type) -> ir.Const:
    value = {BOOL: bool, I32: int, F32: float}[t](value)
    if t is I32 and not I32_RANGE[0] <= value < I32_RANGE[1]:
        raise OverflowError("i32 overflow")  # leave the node: run time sees the same arithmetic
    if t is F32 and not math.isfinite(value):
        raise OverflowError("non-finite constant")
    return ir.Const(value, t)


def _fold_node(e: ir.Expr) -> ir.Expr:
    consts = [c for c in ir.children(e) if isinstance(c, ir.Const)]
    if isinstance(e, (ir.Const, ir.Var, ir.Load)) or len(consts) != len(ir.children(e)):
        return e
    try:
        if isinstance(e, ir.Unary):
            v = consts[0].value
            return _typed({"neg": lambda: -v, "not": lambda: not v, "cast_f32": lambda: float(v)}[e.op](), e.type)
        if isinstance(e, (ir.Binary, ir.Compare)):
            return _typed(_FOLD[e.op](consts[0].value, consts[1].value), e.type)
        if isinstance(e, ir.Select):
            return consts[1] if consts[0].value else consts[2]
        if isinstance(e, ir.Call):
            return _typed(_FOLD_CALL[e.fn](*(c.value for c in consts)), e.type)
    except (ZeroDivisionError, ValueError, OverflowError):
        return e  # leave it to run time (the checker already rejected literal zero divisors)
    return e




def _simplify_node(e: ir.Expr) -> ir.Expr:
    if isinstance(e, ir.Binary) and e.op in ir.LOGIC_OPS:
        unit = e.op == "and"  # x & true = x, x | false = x; x & false = false, x | true = true
        for this, other in ((e.left, e.right), (e.right, e.left)):
            if isinstance(this, ir.Const):
                return other if this.value == unit else this
    if isinstance(e, ir.Unary) and e.op == "not" and isinstance(e.operand, ir.Unary) and e.operand.op == "not":
        return e.operand.operand
    if isinstance(e, ir.Select) and isinstance(e.cond, ir.Const):
        return e.if_true if e.cond.value else e.if_false
    return e


def fold_constants(p: ir.Program) -> ir.Program:
    """Evaluate subtrees without variables (`window(64 * 2)`, `2 / 3`) and remove boolean
    identities (`true & causal` plans exactly like `causal`).  One bottom-up walk does
    both, so the result is a fixed point: `!(causal & !true)` becomes `true`."""
    return map_program(p, lambda e: _simplify_node(_fold_node(e)))


# The passes, in the order they run.  Each is Program -> Program and leaves it valid.
PIPELINE: tuple[Callable[[ir.Program], ir.Program], ...] = (
    fold_constants,
    ir.verify,
)


def run_pipeline(program: ir.Program, *, verify_between: bool = False) -> ir.Program:
    for p in PIPELINE:
        program = p(program)
        if verify_between:
            ir.verify(program)
    return program


def compile_spec(text: str, name: str = "<spec>") -> ir.Program:
    """Parse, check, lower and run the pipeline on one .attn text."""
    return run_pipeline(lower(check(parse(text, name))))


def compile_file(path: str | Path) -> ir.Program:
    return run_pipeline(lower(check(parse_file(path))))
