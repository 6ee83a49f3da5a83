"""numpy backend code generation: IR -> a self-contained numpy module.

Logic stays here; the template (templates/numpy/attention.py.j2) receives
already-printed expression code and constants, never user text.  Identifiers
in the output are the checked tensor names (prefixed ``t_`` inside the mask
and score functions so they cannot collide with the generated helpers).
"""
from __future__ import annotations

from dataclasses import dataclass

from compiler import __version__, ir
from backends.common import render

BLOCK_M, BLOCK_N = 16, 16

_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_CALLS = {"min": "np.minimum", "max": "np.maximum", "abs": "np.abs", "exp": "np.exp", "log": "np.log",
          "sqrt": "np.sqrt", "tanh": "np.tanh"}


def numpy_expr(e: ir.Expr) -> str:
    """numpy source for one IR expression over broadcastable b, h, q, k (and score)."""
    if isinstance(e, ir.Const):
        if e.type is ir.F32:
            return f"np.float32({e.value!r})"
        return repr(e.value)
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Load):
        return f'_load("{e.tensor}", t_{e.tensor}, {", ".join(numpy_expr(i) for i in e.index)})'
    if isinstance(e, ir.Unary):
        x = numpy_expr(e.operand)
        return {"neg": f"(-{x})", "not": f"np.logical_not({x})", "cast_f32": f"_f32({x})"}[e.op]
    if isinstance(e, ir.Binary):
        a, b = numpy_expr(e.left), numpy_expr(e.right)
        if e.op in _BINARY:
            return f"({a} {_BINARY[e.op]} {b})"
        return {"floordiv": f"_floordiv({a}, {b})", "mod": f"_mod({a}, {b})",
                "and": f"np.logical_and({a}, {b})", "or": f"np.logical_or({a}, {b})"}[e.op]
    if isinstance(e, ir.Compare):
        return f"({numpy_expr(e.left)} {_COMPARE[e.op]} {numpy_expr(e.right)})"
    if isinstance(e, ir.Select):
        return f"np.where({numpy_expr(e.cond)}, {numpy_expr(e.if_true)}, {numpy_expr(e.if_false)})"
    if isinstance(e, ir.Call):
        return f"{_CALLS[e.fn]}({', '.join(numpy_expr(a) for a in e.args)})"
    raise TypeError(e)


@dataclass(frozen=True)
class Source:
    """Generated source and the names a runtime needs to call it."""

    text: str
    module_stem: str
    entry: str = "attention"


def emit(program: ir.Program, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> Source:
    layout = program.cache.layout.value if program.cache.kind is ir.CacheKind.CONTIGUOUS else "bhsd"
    p = program
    shapes = {"q": ("B", p.heads_q, "S_q", p.d_qk), "k": ("B", p.heads_kv, "S_k", p.d_qk),
              "v": ("B", p.heads_kv, "S_k", p.d_v)}
    if layout == "bshd":
        shapes = {n: (s[0], s[2], s[1], s[3]) for n, s in shapes.items()}
    fmt = lambda s: "[" + ", ".join(str(x) for x in s) + "]"  # noqa: E731
    text = render(
        "numpy", "attention.py.j2",
        name=p.name, version=__version__, digest=ir.digest(p),
        heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group, d_qk=p.d_qk, d_v=p.d_v,
        dtype=p.dtype, layout=layout, scale=repr(p.scale),
        tensors=[{"name": t.name, "dtype": t.dtype.value, "axes": tuple(t.axes)} for t in p.tensors],
        mask_source=ir.format_expr(p.mask), score_source=[ir.format_expr(s) for s in p.score],
        mask_code=numpy_expr(p.mask), score_code=[numpy_expr(s) for s in p.score],
        block_m=block_m, block_n=block_n,
        q_shape=fmt(shapes["q"]), k_shape=fmt(shapes["k"]), v_shape=fmt(shapes["v"]),
    )
    return Source(text, f"{p.name}_numpy")
