"""AHBM backend code generation: IR -> a module of greenlet `tl` kernels (ADR-0060 §3-§5).

One module holds the four programs of ADR-0060 §10 (decode without and with SP, prefill
without SP, prefill as a ring) as three kernels — `decode` (N = 1 PE, or N PEs with the
round-robin placement and the §4 tree), `prefill` and `ring` — plus the helpers they share.
Logic stays here; the templates (templates/ahbm/) receive already-printed expression code.

The mask and the score program are printed from the IR as `tl` operations on rank-3 tensors
`[G, T, W]` (the G query heads of one K/V head x T query rows x W keys): `h` is `[G, 1, 1]`,
`q` is `[1, T, 1]`, `k` is `[1, 1, W]`, `score` is `[G, T, W]`, and `b` is a Python int.
Sub-expressions free of `h`, `q`, `k` and `score` are printed as plain Python.

`tl` has no gather, so a tensor read `t[...]` in the mask or the score program becomes a
*stream*: the driver (backends/ahbm/runtime.py) evaluates the read once per (head, query row)
or (head, key) of the work item and lays the values out tile by tile in the PE's HBM; the
kernel DMA-loads the slice of the tile it works on.  `ld[i]` in the printed code is the i-th
stream's tile (or a Python scalar for a read that depends on `b` only).  A read that varies
with both `q` and `k` cannot be streamed per tile; the runtime refuses it with a PlanError.
"""
from __future__ import annotations

from dataclasses import dataclass

from attnc.compiler import __version__, ir
from attnc.backends.common import render

BLOCK_M, BLOCK_N = 16, 16
"""Default tile: BLOCK_M query rows (per query head) x BLOCK_N keys."""
PREFETCH = 2
"""ADR-0062 prefetch depth: K/V tiles in flight ahead of the one being computed (§9.1)."""

_TENSOR_VARS = frozenset({"h", "q", "k", "score"})
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "bitand": "&", "bitor": "|", "bitxor": "^",
           "shl": "<<", "shr": ">>"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# The language's functions (keyed by ir.CALL_FNS): a source template, {i} the i-th argument.  On
# tensors, the simulator's `tl` operations (sim/tl.py: the machine has no sign instruction, so
# sign is two selects; `x - x` is +0.0 for ±0 and NaN for NaN, as np.sign):
_TL_CALLS = {"min": "tl.minimum({0}, {1})", "max": "tl.maximum({0}, {1})", "abs": "tl.abs({0})",
             "sign": "tl.where({0} > 0, 1, tl.where({0} < 0, -1, {0} - {0}))", "exp": "tl.exp({0})",
             "log": "tl.log({0})", "sqrt": "tl.sqrt({0})", "tanh": "tl.tanh({0})", "erf": "tl.erf({0})",
             "sin": "tl.sin({0})", "cos": "tl.cos({0})"}
# Python scalars (a value that depends on b only): integers exact, floats as np.float32 (f32)
_PY_CALLS = {"min": "min({0}, {1})", "max": "max({0}, {1})", "abs": "abs({0})", "sign": "np.sign({0})",
             "exp": "np.exp({0})", "log": "np.log({0})", "sqrt": "np.sqrt({0})", "tanh": "np.tanh({0})",
             "erf": "_erf({0})", "sin": "np.sin({0})", "cos": "np.cos({0})"}


def stream_loads(exprs) -> tuple[ir.Load, ...]:
    """The distinct tensor reads of `exprs`, in first-appearance (pre-order) order: the
    order of the `ld` streams the kernel receives for them."""
    out: list[ir.Load] = []
    for e in exprs:
        for n in ir.walk(e):
            if isinstance(n, ir.Load) and n not in out:
                out.append(n)
    return tuple(out)


def stream_vars(load: ir.Load) -> frozenset[str]:
    """The positions a stream varies with (b is fixed per work item)."""
    return ir.free_vars(load) - {"b"}


def _is_tensor(e: ir.Expr) -> bool:
    if isinstance(e, ir.Var):
        return e.name in _TENSOR_VARS
    if isinstance(e, ir.Load):
        return bool(stream_vars(e))
    return any(_is_tensor(c) for c in ir.children(e))


def tl_expr(e: ir.Expr, loads: tuple[ir.Load, ...]) -> str:
    """Source for one IR expression inside a kernel: tl ops where the value is a tensor,
    Python where it is a scalar."""
    tensor = _is_tensor(e)
    if isinstance(e, ir.Const):
        if e.type is ir.F32 and not tensor:
            return f"np.float32({e.value!r})"
        return f"({e.value!r})" if isinstance(e.value, (int, float)) and not isinstance(e.value, bool) \
            and e.value < 0 else repr(e.value)
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Load):
        return f"ld[{loads.index(e)}]"
    sub = [tl_expr(c, loads) for c in ir.children(e)]
    if isinstance(e, ir.Unary):
        x = sub[0]
        if e.op == "neg":
            return f"(-{x})"
        if e.op == "not":
            return f"(~{x})" if tensor else f"(not {x})"
        if e.op == "cast_i64":  # Python integers are exact already
            return f'tl.cast({x}, "int64")' if tensor else x
        return f'tl.cast({x}, "float32")' if tensor else f"np.float32({x})"  # cast_f32
    if isinstance(e, ir.Binary):
        a, b = sub
        if e.op in ("floordiv", "mod"):  # the language's: total on integers, floor(a / b) on floats
            if e.type is not ir.F32 and isinstance(e.right, ir.Const) and e.right.value != 0:
                return f"({a} {'//' if e.op == 'floordiv' else '%'} {b})"
            return f"_{e.op}(tl, {a}, {b})"
        if e.op in _BINARY:
            return f"({a} {_BINARY[e.op]} {b})"
        if tensor:
            return f"({a} {'&' if e.op == 'and' else '|'} {b})"
        return f"({a} {e.op} {b})"
    if isinstance(e, ir.Compare):
        return f"({sub[0]} {_COMPARE[e.op]} {sub[1]})"
    if isinstance(e, ir.Select):
        c, a, b = sub
        return f"tl.where({c}, {a}, {b})" if tensor else f"({a} if {c} else {b})"
    if isinstance(e, ir.Call):
        table = _TL_CALLS if tensor else _PY_CALLS
        return table[e.fn].format(*sub)
    raise TypeError(e)


def _direct_vars(e: ir.Expr) -> set[str]:
    """Positions an expression reads itself (a tensor read's indices are the driver's)."""
    if isinstance(e, ir.Var):
        return {e.name}
    if isinstance(e, ir.Load):
        return set()
    return set().union(*(_direct_vars(c) for c in ir.children(e)))


def _uses(exprs, names) -> tuple[str, ...]:
    used = set().union(*(_direct_vars(e) for e in exprs))
    return tuple(n for n in names if n in used)


@dataclass(frozen=True)
class Source:
    """Generated source and the names a runtime needs to call it."""

    text: str
    module_stem: str
    entries: tuple[str, ...] = ("decode", "prefill", "ring")
    """The kernels (greenlet functions taking `tl`) the driver launches."""


def emit(program: ir.Program, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
         prefetch: int = PREFETCH) -> Source:
    p = program
    mask_loads = stream_loads([p.mask])
    score_loads = stream_loads(p.score)
    stream = lambda loads: repr(tuple((ir.format_expr(n), tuple(sorted(stream_vars(n)))) for n in loads))  # noqa: E731
    # (a statement that does not read the score may be a scalar or miss axes: it is broadcast to
    # the score's [G, T, W])
    mask_code = tl_expr(p.mask, mask_loads)
    score_code = [tl_expr(s, score_loads) if "score" in ir.free_vars(s) else
                  f"tl.zeros(score.shape) + {tl_expr(s, score_loads)}" for s in p.score]
    text = render(
        "ahbm", "module.py.j2",
        name=p.name, version=__version__, digest=ir.digest(p),
        heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group, d_qk=p.d_qk, d_v=p.d_v,
        dtype=p.dtype, scale=repr(p.scale), block_m=block_m, block_n=block_n, prefetch=prefetch,
        tensors=[{"name": t.name, "dtype": t.dtype.value, "axes": tuple(t.axes)} for t in p.tensors],
        mask_source=ir.format_expr(p.mask), score_source=[ir.format_expr(s) for s in p.score],
        sink_source=ir.format_expr(p.sink) if p.sink is not None else None,
        mask_code=mask_code, score_code=score_code,
        broadcast_score=not ir.score_keeps_tile(p),
        mask_streams=stream(mask_loads), score_streams=stream(score_loads),
        mask_vars=repr(_uses([p.mask], ("h", "q", "k"))), score_vars=repr(_uses(list(p.score), ("h", "q", "k"))),
    )
    return Source(text, f"{p.name}_ahbm")
