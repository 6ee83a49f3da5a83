"""numpy backend code generation: IR -> a self-contained numpy module.

Logic stays here; the template (templates/numpy/attention.py.j2) receives
already-printed expression code and constants, never user text.  Identifiers
in the output are the checked tensor names (prefixed ``t_`` inside the mask
and score functions so they cannot collide with the generated helpers).
"""
from __future__ import annotations

from dataclasses import dataclass

from attnc.compiler import __version__, ir
from attnc.backends.common import render

BLOCK_M, BLOCK_N = 16, 16

_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "bitand": "&", "bitor": "|", "bitxor": "^",
           "shl": "<<", "shr": ">>"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# The language's functions (keyed by ir.CALL_FNS): a source template, {i} the i-th argument.
# ``_erf`` is compiler/interp.py's, printed into the module where it is used (language_helpers).
_CALLS = {"min": "np.minimum({0}, {1})", "max": "np.maximum({0}, {1})", "abs": "np.abs({0})",
          "sign": "np.sign({0})", "exp": "np.exp({0})", "log": "np.log({0})", "sqrt": "np.sqrt({0})",
          "tanh": "np.tanh({0})", "erf": "_erf({0})", "sin": "np.sin({0})", "cos": "np.cos({0})"}


class _Printer:
    """numpy source for IR expressions.  The branches of ``where(c, a, b)`` and the right side of
    ``&`` and ``|`` are printed with a *care* mask (``_w<n>`` names the deciding condition, bound
    with ``:=`` where it is evaluated first): a tensor read outside its tensor is an error only
    where its value is used (compiler/interp.py's semantics)."""

    def __init__(self, f64: bool = False):
        self.n = 0
        self.f64 = f64  # f32 values in float64 (the backward reference, templates/numpy/backward.py.j2)

    def _name(self) -> str:
        self.n += 1
        return f"_w{self.n}"

    def expr(self, e: ir.Expr, care: str = "None") -> str:
        rec = lambda x, c=care: self.expr(x, c)  # noqa: E731
        if isinstance(e, ir.Const):
            if e.type is ir.F32:
                return f"np.float64({e.value!r})" if self.f64 else f"np.float32({e.value!r})"
            return repr(e.value)
        if isinstance(e, ir.Var):
            return e.name
        if isinstance(e, ir.Load):
            return f'_load("{e.tensor}", t_{e.tensor}, {", ".join(rec(i) for i in e.index)}, care={care})'
        if isinstance(e, ir.Unary):
            x = rec(e.operand)
            cast = f"_f64({x})" if self.f64 else f"_f32({x})"
            return {"neg": f"(-{x})", "not": f"np.logical_not({x})", "cast_f32": cast, "cast_i64": x}[e.op]
        if isinstance(e, ir.Binary) and e.op in ("and", "or") and _reads(e.right):
            w = self._name()  # the right side's reads count where the left does not decide
            side = w if e.op == "and" else f"~{w}"
            right = rec(e.right, side if care == "None" else f"({care} & {side})")
            return f"np.logical_{e.op}(({w} := {rec(e.left)}), {right})"
        if isinstance(e, ir.Binary):
            a, b = rec(e.left), rec(e.right)
            if e.op in _BINARY:
                return f"({a} {_BINARY[e.op]} {b})"
            return {"floordiv": f"_floordiv({a}, {b})", "mod": f"_mod({a}, {b})",
                    "and": f"np.logical_and({a}, {b})", "or": f"np.logical_or({a}, {b})"}[e.op]
        if isinstance(e, ir.Compare):
            return f"({rec(e.left)} {_COMPARE[e.op]} {rec(e.right)})"
        if isinstance(e, ir.Select) and not (_reads(e.if_true) or _reads(e.if_false)):
            return f"np.where({rec(e.cond)}, {rec(e.if_true)}, {rec(e.if_false)})"
        if isinstance(e, ir.Select):
            w = self._name()
            yes, no = (w, f"~{w}") if care == "None" else (f"({care} & {w})", f"({care} & ~{w})")
            return f"np.where(({w} := {rec(e.cond)}), {rec(e.if_true, yes)}, {rec(e.if_false, no)})"
        if isinstance(e, ir.Call):
            return _CALLS[e.fn].format(*(rec(a) for a in e.args))
        raise TypeError(e)


def _reads(e: ir.Expr) -> bool:
    return any(isinstance(n, ir.Load) for n in ir.walk(e))


def numpy_expr(e: ir.Expr, f64: bool = False) -> str:
    """numpy source for one IR expression over broadcastable b, h, q, k (and score): f32 values
    in float32, or in float64 with ``f64`` (the backward reference)."""
    return _Printer(f64).expr(e)


def language_helpers(program: ir.Program) -> str:
    """The language's arithmetic the generated code calls, printed from compiler/interp.py (one
    definition; the generated module stays self-contained)."""
    import inspect

    from attnc.compiler import interp
    used = {n.fn for e in (program.mask, *program.score) for n in ir.walk(e) if isinstance(n, ir.Call)}
    from attnc.compiler import sinks
    used = used | {n.fn for n in ir.walk(program.sink) if isinstance(n, ir.Call)} if program.sink is not None else used
    fns = [interp.floordiv, interp.mod] + ([interp.erf] if "erf" in used else [])
    text = "\n\n".join(inspect.getsource(f).replace(f"def {f.__name__}(", f"def _{f.__name__}(") for f in fns)
    if program.sink is not None:  # the sink's merge, once per row (compiler/sinks.py)
        text += "\n\n" + inspect.getsource(sinks.join).replace("def join(", "def _join_sink(")
    return text


@dataclass(frozen=True)
class Source:
    """Generated source and the names a runtime needs to call it."""

    text: str
    module_stem: str
    entry: str = "attention"
    family: str = "attention"


# Kernel families (one template each): the tiled prefill/append program over a contiguous
# cache, and the two-launch split program over any cache with per-request lengths.
FAMILIES = ("attention", "decode_split")


def default_family(program: ir.Program) -> str:
    """A ragged or paged spec compiles to the split program; a contiguous one to the tiled one
    (it can still run split calls: :func:`emit` with ``family="decode_split"``)."""
    return "attention" if program.cache.kind is ir.CacheKind.CONTIGUOUS else "decode_split"


def _spec_context(p: ir.Program) -> dict:
    """What every family prints about the spec: header, constants, mask and score code."""
    return dict(
        name=p.name, version=__version__, digest=ir.digest(p),
        heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group, d_qk=p.d_qk, d_v=p.d_v,
        dtype=p.dtype, scale=repr(p.scale),
        tensors=[{"name": t.name, "dtype": t.dtype.value, "axes": tuple(t.axes)} for t in p.tensors],
        mask_source=ir.format_expr(p.mask), score_source=[ir.format_expr(s) for s in p.score],
        mask_code=numpy_expr(p.mask), score_code=[numpy_expr(s) for s in p.score],
        sink_source=ir.format_expr(p.sink) if p.sink is not None else None,
        sink_code=numpy_expr(p.sink) if p.sink is not None else None,
        language_helpers=language_helpers(p), uses_math="erf" in language_helpers(p),
    )


def shape_docs(p: ir.Program, layout: str) -> dict[str, str]:
    """q_shape, k_shape, v_shape: the entry point's argument shapes as its docstring writes them."""
    shapes = {"q": ("B", p.heads_q, "S_q", p.d_qk), "k": ("B", p.heads_kv, "S_k", p.d_qk),
              "v": ("B", p.heads_kv, "S_k", p.d_v)}
    if layout == "bshd":
        shapes = {n: (s[0], s[2], s[1], s[3]) for n, s in shapes.items()}
    return {f"{n}_shape": "[" + ", ".join(str(x) for x in s) + "]" for n, s in shapes.items()}


def emit(program: ir.Program, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
         family: str | None = None) -> Source:
    family = family or default_family(program)
    if family == "decode_split":
        return emit_split(program)
    if family != "attention":
        raise ValueError(f"unknown numpy kernel family {family!r}; expected one of {FAMILIES}")
    layout = program.cache.layout.value if program.cache.kind is ir.CacheKind.CONTIGUOUS else "bhsd"
    p = program
    text = render("numpy", "attention.py.j2", **_spec_context(p), layout=layout, block_m=block_m, block_n=block_n,
                  **shape_docs(p, layout))
    return Source(text, f"{p.name}_numpy")


_IDENTITY = {"partial_u": "0.0", "partial_o": "0.0", "partial_m": "-np.inf", "partial_lse": "-np.inf",
             "partial_l": "0.0", "partial_valid": "0", "partial_n": "0.0", "partial_guard": "0"}


def emit_split(program: ir.Program) -> Source:
    """The two-launch split program (templates/numpy/decode_split.py.j2) for the spec's cache
    and state ABI; split bounds, segments and workspace shapes come with each call's plan."""
    from attnc.compiler.analysis.ledger import DecodeCall
    from attnc.compiler.analysis.splits import from_ir
    from attnc.compiler.inputs import cache_description, storage_shapes
    p = program
    fields = DecodeCall.from_program(p).state_fields()
    for f in fields:  # the program stores float fields as f32 or as the spec's storage dtype
        if f.dtype not in ("f32", "u8", p.dtype):
            raise ValueError(f"workspace field {f.name} of dtype {f.dtype} has no numpy storage here")
    kind = p.cache.kind.value
    shapes = storage_shapes(p)
    k_shape, v_shape = (shapes[n] for n in (("k_cache", "v_cache") if kind == "paged" else ("k", "v")))
    fmt = lambda s: "[" + ", ".join(str(x).split("=")[-1] for x in s) + "]"  # noqa: E731
    text = render(
        "numpy", "decode_split.py.j2", **_spec_context(p),
        cache=kind, order=p.cache.layout.value, cache_desc=cache_description(p),
        block_name={"paged": "page", "ragged": "request's packed rows", "contiguous": "cache row"}[kind],
        split=str(from_ir(p.split)), state=p.state.value,
        shift=[repr(float(x)) for x in (p.state.phi, p.state.lower, p.state.upper)] if p.state.value == "shared_shift"
        else [],
        fields=[f"{f.name} {f.dtype}" for f in fields],
        workspace=[{"name": f.name, "dtype": f.dtype, "identity": _IDENTITY[f.name]} for f in fields],
        k_shape=fmt(k_shape), v_shape=fmt(v_shape),
    )
    return Source(text, f"{p.name}_numpy_split", family="decode_split")
