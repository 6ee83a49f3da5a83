"""Triton backend code generation: IR -> the spec's module (its mask and score as
``@triton.jit`` functions, its constants, the tensors it reads).

The kernels are a library (``prefill.py``, ``gluon_engine.py``, ``split.py``) that takes the
generated functions and constants as constexpr arguments.  Expression code is printed here
(never user text; tensors by generated names).  Integer `//` and `%` go through helpers
with the language's floor semantics (Triton's operators truncate), except where the dividend is
never negative and the divisor a positive constant (``triton_expr``'s ``ints``); tensor reads
clamp their subscripts so a kernel never touches memory outside a tensor (plan
time reports out-of-range reads as errors before launch).
"""
from __future__ import annotations

from dataclasses import dataclass

from attnc.compiler import __version__, fast_score, ir, separable
from attnc.compiler.ranges import IntRanges
from attnc.backends.common import render

_BINARY = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "bitand": "&", "bitor": "|", "bitxor": "^",
           "shl": "<<", "shr": ">>"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# The language's functions (keyed by ir.CALL_FNS): a source template, {i} the i-th argument; the
# names starting with '_' are lang.py's (templates/triton/spec.py.j2 imports them).  sqrt and f32
# division round correctly (as numpy's); exp, log, tanh, erf, sin, cos are the device's (within a
# few ulp).  sign: -1, 0, 1 in the operand's type, NaN for NaN and +0.0 for -0.0 (x - x), as np.sign.
_CALLS = {"min": "tl.minimum({0}, {1})", "max": "tl.maximum({0}, {1})", "abs": "tl.abs({0})",
          "sign": "tl.where({0} > 0, 1, tl.where({0} < 0, -1, {0} - {0}))",
          "exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.math.sqrt_rn({0})", "tanh": "_tanh({0})",
          "erf": "tl.math.erf({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})"}
# Calls whose f32 result takes another form: f32 min and max propagate NaN, as np.minimum and
# np.maximum (max.NaN.f32); on integers the plain form above.
F32_CALLS = {"min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
             "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"}
# Storage whose tolerance takes the GPU's tanh.approx.f32 (lang._tanh_approx): measured on the
# H200, relative error at most 1.1e-5 (2**-16.5) over |x| <= 12, so about s * 1e-5 on a softcapped
# score s, within f16's and bf16's tolerance on O at any cap, not within f32's (2e-5).  (The PTX
# ISA promises only 2**-11, under which f16's would not hold once scores reach a few units.)
APPROX_TANH = ("f16", "bf16")


def tensor_names(program: ir.Program) -> dict[str, str]:
    """The generated names of the spec's tensors: ``_t<i>`` by declaration order (with ``_t<i>_s<a>``
    and ``_t<i>_n<a>`` for their strides and sizes), so no two tensors' names can collide and no
    user name (none starts with '_') can meet one."""
    return {t.name: f"_t{i}" for i, t in enumerate(program.tensors)}


def calls(dtype: str) -> dict[str, str]:
    """The functions a spec stored in ``dtype`` calls."""
    return {**_CALLS, "tanh": "_tanh_approx({0})"} if dtype in APPROX_TANH else _CALLS


def triton_expr(e: ir.Expr, names: dict[str, str] | None = None, functions: dict[str, str] = _CALLS,
                fast: IntRanges | None = None, ints: IntRanges | None = None) -> str:
    """Triton source for one IR expression over q [BLOCK_M, 1], k [1, BLOCK_N], scalar b, h.
    ``fast``: the guarded calls' ranges of a fast form (compiler/fast_score.py), whose small
    position conversions print as ``_f32_small``.  ``ints``: the program's integer ranges
    (``compiler.ranges``), by which `//` and `%` of a dividend that is never negative by a positive
    constant print as Triton's own operators (floor and truncation agree there), and by a power of
    two as a shift and a bitwise and: a periodic or chunked mask's cells cost one instruction per
    atom instead of the sign fix-up's ten."""
    rec = lambda x: triton_expr(x, names, functions, fast, ints)  # noqa: E731
    if isinstance(e, ir.Const):
        return repr(e.value)
    if isinstance(e, ir.Var):  # the request's lengths come with TS: kv_lens [B] and qo_indptr [B + 1]
        return {"S_k": "tl.load(_lk + b)", "S_q": "(tl.load(_lq + b + 1) - tl.load(_lq + b))"}.get(e.name, e.name)
    if isinstance(e, ir.Load):
        t = (names or {}).get(e.tensor, f"_{e.tensor}")
        offset = " + ".join(f"tl.minimum(tl.maximum({rec(i)}, 0), {t}_n{a} - 1) * {t}_s{a}"
                            for a, i in enumerate(e.index))
        return f"tl.load({t} + {offset})"
    if isinstance(e, ir.Unary):
        x = rec(e.operand)
        if e.op == "cast_f32" and fast is not None and fast_score.converts_by_addition(e.operand, fast):
            return f"_f32_small({x})"
        return {"neg": f"(-{x})", "not": f"(~{x})", "cast_f32": f"({x}).to(tl.float32)",
                "cast_i64": f"({x}).to(tl.int64)"}[e.op]
    if isinstance(e, ir.Binary):
        a, b = rec(e.left), rec(e.right)
        if e.op in _BINARY:
            return f"({a} {_BINARY[e.op]} {b})"
        if e.type is ir.F32:
            quotient = f"tl.math.div_rn({a}, {b})"
            return {"div": quotient, "floordiv": f"tl.floor({quotient})",
                    "mod": f"({a} - tl.floor({quotient}) * {b})"}[e.op]
        # integer // and % are total (x // 0 = 0, x % 0 = x): a divisor that may be 0 takes the guard
        total = "" if isinstance(e.right, ir.Const) and e.right.value != 0 else "_total"
        if not total and ints is not None and e.right.value > 0 and ints(e.left)[0] >= 0:
            c = int(e.right.value)
            if c & (c - 1) == 0:
                return {"floordiv": f"({a} >> {c.bit_length() - 1})", "mod": f"({a} & {c - 1})"}[e.op]
            return {"floordiv": f"({a} // {b})", "mod": f"({a} % {b})"}[e.op]
        return {"floordiv": f"_floordiv{total}({a}, {b})", "mod": f"_mod{total}({a}, {b})"}[e.op]
    if isinstance(e, ir.Compare):
        cmp = f"({rec(e.left)} {_COMPARE[e.op]} {rec(e.right)})"
        if e.left.type is ir.F32 and not (ir.free_vars(e) & {"q", "k", "score"}):
            # a scalar f32 comparison (`h >= 0.5`): Triton 3.9's interpreter stores its result as
            # float32 data, which `&` then refuses; as an integer select it is a bool everywhere
            return f"(tl.where({cmp}, 1, 0) != 0)"
        return cmp
    if isinstance(e, ir.Select):
        return f"tl.where({rec(e.cond)}, {rec(e.if_true)}, {rec(e.if_false)})"
    if isinstance(e, ir.Call):
        template = F32_CALLS.get(e.fn) if e.type is ir.F32 else None
        return (template or functions[e.fn]).format(*(rec(a) for a in e.args))
    raise TypeError(e)


def _pad(d: int) -> int:
    """Head dims that are not powers of two run padded, with predicated lanes."""
    return max(16, 1 << (d - 1).bit_length())


def _score_code(p: ir.Program, names: dict, fast: bool) -> list[str]:
    """The score statements, printed: score_program's, or ``fast`` score_program_fast's."""
    ranges = fast_score.guard_ranges(p) if fast else None
    exprs = [fast_score.fast_expr(s, ranges) for s in p.score] if fast else p.score
    return [triton_expr(s, names, calls(p.dtype), ranges) for s in exprs]


def _grad_code(p: ir.Program, names: dict, fast: bool) -> list[tuple[str, str]]:
    """(d s_i / d s_(i-1), s_i) per score statement, printed: the backward's score_grad (or
    ``fast`` score_grad_fast)."""
    if not p.score:
        return []
    from attnc.compiler.autodiff import score_grad
    g = score_grad(p)
    ranges = fast_score.guard_ranges(p) if fast else None
    form = (lambda e: fast_score.fast_expr(e, ranges)) if fast else (lambda e: e)  # noqa: E731
    functions = calls(p.dtype)
    return [(triton_expr(form(d), names, functions, ranges), triton_expr(form(s), names, functions, ranges))
            for d, s in zip(g.dscore, g.forward)]


def _load_grad_code(p: ir.Program, names: dict) -> list[dict]:
    """Per f32 load of the score program (``score_grad``'s dloads, in order): the printed lines
    that take the scaled q.k in ``score`` to d (final score) / d (that load) in ``grad``."""
    if not p.score:
        return []
    from attnc.compiler.autodiff import score_grad
    g = score_grad(p)
    functions = calls(p.dtype)
    out = []
    for n, (j, load, d) in enumerate(g.dloads):
        lines = [f"score = {triton_expr(s, names, functions)}" for s in g.forward[:j]]
        lines.append(f"grad = {triton_expr(d, names, functions)}")
        for m in range(j + 1, len(g.forward)):
            lines.append(f"score = {triton_expr(g.forward[m - 1], names, functions)}")
            lines.append(f"grad = grad * ({triton_expr(g.dscore[m], names, functions)})")
        out.append({"n": n, "source": ir.format_expr(load), "lines": lines})
    return out


def _separable_code(p: ir.Program, names: dict) -> dict | None:
    """The separable form's parts, printed, and the positions below which the Gluon engine takes
    it, with its column part per key and per block (compiler/separable.py), for a spec that has
    one the engine can take on some call; else None (the module then has none of it)."""
    form = separable.separable(p)
    positions = separable.usable_positions(p, form) if form is not None else 0
    if not positions:
        return None
    functions = calls(p.dtype)
    parts = ("scale", "row", "column")
    return {"positions": positions, "block_positions": separable.usable_positions(p, form, per_block=True),
            **{f"{n}_source": ir.format_expr(getattr(form, n)) for n in parts},
            **{f"{n}_code": triton_expr(getattr(form, n), names, functions) for n in parts}}


@dataclass(frozen=True)
class Source:
    text: str
    module_stem: str
    entry: str = "attention"


def uses_lengths(program: ir.Program) -> bool:
    """Whether the spec reads S_q or S_k (then TS ends with the call's kv_lens and qo_indptr)."""
    return bool(set().union(*(ir.free_vars(e) for e in (program.mask, *program.score))) & set(ir.LENGTH_VARS))


def emit(program: ir.Program) -> Source:
    p = program
    names = tensor_names(p)
    score, fast = _score_code(p, names, False), _score_code(p, names, True)
    grad, fast_grad = _grad_code(p, names, False), _grad_code(p, names, True)
    text = render(
        "triton", "spec.py.j2",
        name=p.name, version=__version__, digest=ir.digest(p),
        heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group, d_qk=p.d_qk, d_v=p.d_v,
        d_qk_pad=_pad(p.d_qk), d_v_pad=_pad(p.d_v), dtype=p.dtype, scale=repr(p.scale),
        tensors=[{"name": t.name, "arg": names[t.name], "dtype": t.dtype.value, "axes": tuple(t.axes)}
                 for t in p.tensors],
        mask_source=ir.format_expr(p.mask), score_source=[ir.format_expr(s) for s in p.score],
        mask_code=triton_expr(p.mask, names, ints=IntRanges(p.heads_q)), score_code=score,
        fast_code=fast if fast != score else None,
        grad_code=grad, fast_grad_code=fast_grad if fast_grad != grad else None,
        lengths=uses_lengths(p), fast_positions=f"2**{fast_score.FAST_POSITIONS.bit_length() - 1}",
        separable=_separable_code(p, names), load_grads=_load_grad_code(p, names),
        broadcast_score=not ir.score_keeps_tile(p),
        sink_source=ir.format_expr(p.sink) if p.sink is not None else None,
        sink_code=triton_expr(p.sink, names, calls(p.dtype)) if p.sink is not None else None,
    )
    return Source(text, f"{p.name}_triton", entry="visible")
