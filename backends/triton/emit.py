"""Triton backend code generation: IR -> the spec's module (its mask and score as
``@triton.jit`` functions, its constants, the tensors it reads).

The kernels are a library (``prefill.py``, ``gluon_engine.py``, ``split.py``) that takes the
generated functions and constants as constexpr arguments.  Expression code is printed here
(never user text).  Integer `//` and `%` go through helpers
with the language's floor semantics (Triton's operators truncate); tensor reads
clamp their subscripts so a kernel never touches memory outside a tensor (plan
time reports out-of-range reads as errors before launch).
"""
from __future__ import annotations

from dataclasses import dataclass

from attnc.compiler import __version__, ir
from attnc.backends.common import render

_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "and": "&", "or": "|"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_CALLS = {"min": "tl.minimum", "max": "tl.maximum", "abs": "tl.abs", "exp": "tl.exp", "log": "tl.log",
          "sqrt": "tl.sqrt", "tanh": "_tanh"}


def triton_expr(e: ir.Expr) -> str:
    """Triton source for one IR expression over q [BLOCK_M, 1], k [1, BLOCK_N], scalar b, h."""
    if isinstance(e, ir.Const):
        return repr(e.value)
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Load):
        offset = " + ".join(f"tl.minimum(tl.maximum({triton_expr(i)}, 0), {e.tensor}_n{a} - 1) * {e.tensor}_s{a}"
                            for a, i in enumerate(e.index))
        return f"tl.load(T_{e.tensor} + {offset})"
    if isinstance(e, ir.Unary):
        x = triton_expr(e.operand)
        return {"neg": f"(-{x})", "not": f"(~{x})", "cast_f32": f"({x}).to(tl.float32)"}[e.op]
    if isinstance(e, ir.Binary):
        a, b = triton_expr(e.left), triton_expr(e.right)
        if e.op in _BINARY:
            return f"({a} {_BINARY[e.op]} {b})"
        if e.type is ir.F32:
            return {"floordiv": f"tl.floor({a} / {b})", "mod": f"({a} - tl.floor({a} / {b}) * {b})"}[e.op]
        return {"floordiv": f"_floordiv({a}, {b})", "mod": f"_mod({a}, {b})"}[e.op]
    if isinstance(e, ir.Compare):
        return f"({triton_expr(e.left)} {_COMPARE[e.op]} {triton_expr(e.right)})"
    if isinstance(e, ir.Select):
        return f"tl.where({triton_expr(e.cond)}, {triton_expr(e.if_true)}, {triton_expr(e.if_false)})"
    if isinstance(e, ir.Call):
        return f"{_CALLS[e.fn]}({', '.join(triton_expr(a) for a in e.args)})"
    raise TypeError(e)


def _pad(d: int) -> int:
    """Head dims that are not powers of two run padded, with predicated lanes."""
    return max(16, 1 << (d - 1).bit_length())


def _grad_code(p: ir.Program) -> list[tuple[str, str]]:
    """(d s_i / d s_(i-1), s_i) per score statement, printed: the backward's score_grad."""
    if not p.score:
        return []
    from attnc.compiler.autodiff import score_grad
    g = score_grad(p)
    return [(triton_expr(d), triton_expr(s)) for d, s in zip(g.dscore, g.forward)]


@dataclass(frozen=True)
class Source:
    text: str
    module_stem: str
    entry: str = "attention"


def emit(program: ir.Program) -> Source:
    p = program
    text = render(
        "triton", "spec.py.j2",
        name=p.name, version=__version__, digest=ir.digest(p),
        heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group, d_qk=p.d_qk, d_v=p.d_v,
        d_qk_pad=_pad(p.d_qk), d_v_pad=_pad(p.d_v), dtype=p.dtype, scale=repr(p.scale),
        tensors=[{"name": t.name, "dtype": t.dtype.value, "axes": tuple(t.axes)} for t in p.tensors],
        mask_source=ir.format_expr(p.mask), score_source=[ir.format_expr(s) for s in p.score],
        mask_code=triton_expr(p.mask), score_code=[triton_expr(s) for s in p.score],
        grad_code=_grad_code(p),
    )
    return Source(text, f"{p.name}_triton", entry="visible")
