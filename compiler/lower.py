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
from .errors import SpecError
from .frontend import parse, parse_file
from .ir import BOOL, F32, I32, I64
from .ranges import SHIFT_COUNT, IntRanges, fits
from .scalar import CALLS as scalar_calls
from .scalar import f32 as fold_f32
from .scalar import float_floordiv, float_mod, int_floordiv, int_mod


# ---------------------------------------------------------------- lowering
def _cast(e: ir.Expr, t: ir.Type) -> ir.Expr:
    if e.type is t or (t.integer and e.type.integer):  # integer widths: widen_integers decides
        return e
    assert t is F32 and e.type.integer, (e, t)
    if isinstance(e, ir.Const):
        return ir.Const(float(e.value), F32)
    return ir.Unary("cast_f32", e, F32)


def _binary(op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    t = ir.binary_type(op, a.type, b.type)
    if op in ir.BIT_OPS:
        return ir.Binary(op, a, b, t)
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


def lower_expr(e: ast.Expr, spec: Spec, ranges: IntRanges | None = None) -> ir.Expr:
    """The IR of one checked expression.  Every integer node's range must fit i64 (positions
    below MAX_LENGTH, i32 tensor values anywhere in i32): one that may not is a located error,
    as is a shift count that may leave [0, 63]."""
    ranges = ranges or IntRanges(spec.heads_q)
    rec = lambda x: lower_expr(x, spec, ranges)  # noqa: E731
    out = _lower_node(e, spec, rec)
    if isinstance(out, ir.Binary) and out.op in ("shl", "shr"):
        lo, hi = ranges(out.right)
        if lo < SHIFT_COUNT[0] or hi > SHIFT_COUNT[1]:
            raise SpecError(f"shift count may lie outside [0, 63]: its values lie in [{lo}, {hi}]",
                            e.right.span)
    if out.type.integer and not isinstance(e, (ast.IntLit, ast.Name, ast.Index)):
        lo, hi = ranges(out)
        if not fits((lo, hi), I64):
            raise SpecError(f"integer expression may overflow i64: its values lie in [{lo}, {hi}] "
                            f"(positions q, k are below 2**30, i32 tensor values anywhere in i32)", e.span,
                            ("integers are exact: the compiler computes in i32 where the range allows, "
                             "else in i64, and refuses what i64 cannot hold",))
    return out


def _lower_node(e: ast.Expr, spec: Spec, rec) -> ir.Expr:
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
        a, b = rec(e.left), rec(e.right)
        if e.op in ir.SURFACE_BITWISE and a.type.integer:  # & | ^ on integers; << >>
            return _binary(ir.SURFACE_BITWISE[e.op], a, b)
        if e.op == "^":  # on conditions: exclusive or
            return ir.Compare("ne", a, b)
        return _binary(ir.SURFACE_BINARY[e.op], a, b)
    if isinstance(e, ast.Compare):
        return _compare(ir.SURFACE_COMPARE[e.op], rec(e.left), rec(e.right))
    if isinstance(e, ast.Call):
        if e.func == "flashmask":
            return lower_flashmask(e, spec)
        args = [rec(a) for a in e.args]
        if e.func == "window":  # q - k < n
            return _compare("lt", _binary("sub", Q, K), args[0])
        if e.func == "softcap":  # cap * tanh(x / cap); a constant cap: cap * tanh(x * (1 / cap))
            x, cap = args
            if isinstance(cap, ir.Const):  # (a multiply per cell, not a correctly rounded division)
                inner = _binary("mul", x, ir.Const(fold_f32(1.0 / float(cap.value)), F32))
            else:
                inner = _binary("div", x, cap)
            return _binary("mul", _cast(cap, F32), _call("tanh", [inner]))
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
    ranges = IntRanges(spec.heads_q)
    mask = lower_expr(spec.mask, spec, ranges) if spec.mask is not None else ir.Const(True, BOOL)
    score = tuple(_cast(lower_expr(s, spec, ranges), F32) for s in spec.score)
    return ir.Program(
        name=spec.name, heads_q=spec.heads_q, heads_kv=spec.heads_kv, d_qk=spec.d_qk, d_v=spec.d_v,
        dtype=spec.dtype, scale=spec.scale, tensors=tuple(spec.tensor_types.values()), score=score,
        mask=mask, cache=spec.cache, split=spec.split, state=spec.state, masked_rows=spec.masked_rows,
        open_fields=spec.open_fields, flashmask=flashmask_contracts(spec.mask, spec),
        sink=_cast(lower_expr(spec.sink, spec, ranges), F32) if spec.sink is not None else None)


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
    return replace(p, mask=map_expr(p.mask, f), score=tuple(map_expr(s, f) for s in p.score),
                   sink=None if p.sink is None else map_expr(p.sink, f))


_FOLD = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "floordiv": float_floordiv, "mod": float_mod,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
}
_FOLD.update({"bitand": lambda a, b: a & b, "bitor": lambda a, b: a | b, "bitxor": lambda a, b: a ^ b,
              "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b})
_FOLD_CALL = scalar_calls


def _typed(value, t: ir.Type) -> ir.Const:
    """The folded constant: integers exact (i64 where i32 cannot hold them), floats rounded to
    f32 as every backend computes them."""
    if t.integer:
        value = int(value)
        return ir.Const(value, I32 if fits((value, value), I32) else I64)
    if t is F32:
        value = fold_f32(value)
        if not math.isfinite(value):
            raise OverflowError("non-finite constant")  # leave the node: run time sees the same arithmetic
        return ir.Const(value, t)
    return ir.Const(bool(value), t)


def _integer_fold(op: str, a: int, b: int) -> int:
    return {"floordiv": int_floordiv, "mod": int_mod}.get(op, _FOLD[op])(a, b)


def _fold_node(e: ir.Expr) -> ir.Expr:
    consts = [c for c in ir.children(e) if isinstance(c, ir.Const)]
    if isinstance(e, (ir.Const, ir.Var, ir.Load)) or len(consts) != len(ir.children(e)):
        return e
    values = [fold_f32(c.value) if c.type is F32 else c.value for c in consts]  # f32 operands
    try:
        if isinstance(e, ir.Unary):
            v = values[0]
            return _typed({"neg": lambda: -v, "not": lambda: not v, "cast_f32": lambda: float(v),
                           "cast_i64": lambda: v}[e.op](), e.type)
        if isinstance(e, ir.Binary) and e.type.integer:
            return _typed(_integer_fold(e.op, *values), e.type)
        if isinstance(e, (ir.Binary, ir.Compare)):
            return _typed(_FOLD[e.op](*values), e.type)
        if isinstance(e, ir.Select):
            return consts[1] if consts[0].value else consts[2]
        if isinstance(e, ir.Call):
            return _typed(_FOLD_CALL[e.fn](*values), e.type)
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


def widen_integers(program: ir.Program) -> ir.Program:
    """Type every integer node i32 or i64: i64 where its range or an operand's type needs it;
    operands of an i64 node are cast to i64.  Lowering has already refused ranges beyond i64."""
    ranges = IntRanges(program.heads_q)

    def node(e: ir.Expr) -> ir.Expr:
        if not e.type.integer and not (isinstance(e, ir.Compare) and e.left.type.integer):
            return e
        if isinstance(e, (ir.Const, ir.Var, ir.Load)):
            if isinstance(e, ir.Const) and not fits((e.value, e.value), I32):
                return ir.Const(e.value, I64)
            return e
        kids = [c for c in ir.children(e) if c.type.integer]
        if isinstance(e, ir.Select):
            kids = [e.if_true, e.if_false]
        wide = any(c.type is I64 for c in kids) or (not isinstance(e, ir.Compare) and not fits(ranges(e), I32))
        if isinstance(e, ir.Binary) and e.op in ("shl", "shr") and ranges(e.right)[1] > 31:
            wide = True  # a count of 32 or more shifts an i64
        t = I64 if wide else I32
        if isinstance(e, ir.Compare):
            return ir.Compare(e.op, _as(e.left, t), _as(e.right, t))
        if isinstance(e, ir.Select):
            return ir.Select(e.cond, _as(e.if_true, t), _as(e.if_false, t), t)
        if isinstance(e, ir.Unary):
            if e.op == "cast_i64":
                return e
            return ir.Unary(e.op, _as(e.operand, t), t)
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, _as(e.left, t), _as(e.right, t), t)
        if isinstance(e, ir.Call):
            return ir.Call(e.fn, tuple(_as(a, t) for a in e.args), t)
        return e

    return map_program(program, node)


def _as(e: ir.Expr, t: ir.Type) -> ir.Expr:
    if e.type is t or not e.type.integer:
        return e
    if t is I32:
        return e
    if isinstance(e, ir.Const):
        return ir.Const(e.value, I64)
    return ir.Unary("cast_i64", e, I64)


# The passes, in the order they run.  Each is Program -> Program and leaves it valid.
PIPELINE: tuple[Callable[[ir.Program], ir.Program], ...] = (
    fold_constants,
    widen_integers,
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
