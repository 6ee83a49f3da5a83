"""Print an :class:`ir.Program` as an MLIR module (`attnc ir`, DESIGN §7).

Generic operation syntax with an unregistered ``attn`` dialect, so any MLIR
parser (``mlir-opt --allow-unregistered-dialect``, xDSL with
``Context(allow_unregistered=True)``) reads it without a dialect definition::

    "builtin.module"() ({
      "attn.attention"() ({
        "attn.tensor"() {sym_name = "doc", dtype = i32, axes = ["b", "s"]} : () -> ()
        "attn.mask_program"() ({
        ^bb0(%b: i32, %h: i32, %q: i32, %k: i32):
          %0 = "attn.cmp"(%k, %q) {predicate = "le"} : (i32, i32) -> i1
          "attn.yield"(%0) : (i1) -> ()
        }) : () -> ()
        "attn.score_program"() ({
        ^bb0(%b: i32, %h: i32, %q: i32, %k: i32, %score: f32):
          "attn.yield"(%score) : (f32) -> ()
        }) : () -> ()
      }) {sym_name = "t", heads_q = 4 : i64, ...} : () -> ()
    }) : () -> ()

Choices: every IR node but ``Var`` is one op (``Var`` is a block argument);
comparisons are one ``attn.cmp`` op with a ``predicate``; identical ops in a
region are printed once (value numbering on the printed text, so ``0.0`` and
``-0.0`` stay apart); each region numbers its values from ``%0``; the
``attn.score_program`` op is always present and, with no score statements,
yields its ``%score`` argument (the language's default ``score = score``).  A spec with a sink
adds an ``attn.sink_program`` region over ``%b`` and ``%h`` yielding the sink's f32 value.
Policy attributes are flat (``cache_kind``, ``split_kind``, ...) but for a policy's arguments,
a dictionary by their declared names (``split_params = {splits = 5 : i64, capacity = 8 : i64}``,
``state_params`` for the shared shift); ``cache_page_size`` and ``cache_table`` are left out when
the cache has none.
"""
from __future__ import annotations

import enum
import math
import struct

from . import ir

MLIR_TYPE = {ir.I32: "i32", ir.I64: "i64", ir.F32: "f32", ir.BOOL: "i1"}
POSITION_ARGS = ("b", "h", "q", "k")  # block arguments, in order (then S_q, S_k where the spec reads them)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\' or not (" " <= ch <= "~"):
            out.extend(f"\\{b:02X}" for b in ch.encode())
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _float(x: float, width: str) -> str:
    """A float attribute whose digits round-trip (repr); inf/nan as MLIR hex bit patterns."""
    if not math.isfinite(x):
        fmt, digits = (">f", 8) if width == "f32" else (">d", 16)
        return f"0x{int.from_bytes(struct.pack(fmt, x), 'big'):0{digits}X} : {width}"
    text = repr(float(x))
    if "." not in text:  # MLIR float literals need a '.': 1e-05 -> 1.0e-05
        mantissa, _, exponent = text.partition("e")
        text = f"{mantissa}.0" + (f"e{exponent}" if exponent else "")
    return f"{text} : {width}"


def _attr(v) -> str:
    """A Python value of a spec field as an MLIR attribute."""
    if isinstance(v, ir.Type):
        return MLIR_TYPE[v]
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v} : i64"
    if isinstance(v, float):
        return _float(v, "f64")
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_attr(x) for x in v) + "]"
    raise TypeError(f"no attribute form for {v!r}")


def _dict(attrs: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {v}" for k, v in attrs.items()) + "}" if attrs else ""


def _const(c: ir.Const) -> str:
    if c.type is ir.BOOL:
        return "true" if c.value else "false"
    return _float(c.value, "f32") if c.type is ir.F32 else f"{c.value} : {MLIR_TYPE[c.type]}"


def _op(e: ir.Expr) -> tuple[str, dict[str, str]]:
    """The op name and attributes of one non-Var node."""
    if isinstance(e, ir.Const):
        return "const", {"value": _const(e)}
    if isinstance(e, ir.Load):
        return "load", {"tensor": _string(e.tensor)}
    if isinstance(e, ir.Compare):
        return "cmp", {"predicate": _string(e.op)}
    if isinstance(e, ir.Call):
        return "call", {"fn": _string(e.fn)}
    if isinstance(e, (ir.Unary, ir.Binary)):
        return e.op, {}
    if isinstance(e, ir.Select):
        return "select", {}
    raise TypeError(f"not an IR expression: {e!r}")


class _Region:
    """One single-block region: block arguments, value-numbered ops, a yield."""

    def __init__(self, args: dict[str, ir.Type]):
        self.args = args
        self.names = {n: f"%{n}" for n in args}
        self.numbered: dict[str, str] = {}  # op text -> SSA name
        self.lines: list[str] = []

    def value(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Var):
            return self.names[e.name]
        kids = ir.children(e)
        operands = ", ".join(self.value(c) for c in kids)
        types = ", ".join(MLIR_TYPE[c.type] for c in kids)
        name, attrs = _op(e)
        attr_text = f" {_dict(attrs)}" if attrs else ""
        text = f'"attn.{name}"({operands}){attr_text} : ({types}) -> {MLIR_TYPE[e.type]}'
        if text not in self.numbered:
            self.numbered[text] = f"%{len(self.numbered)}"
            self.lines.append(f"{self.numbered[text]} = {text}")
        return self.numbered[text]

    def render(self, op: str, result: str, result_type: ir.Type, indent: str) -> list[str]:
        params = ", ".join(f"%{n}: {MLIR_TYPE[t]}" for n, t in self.args.items())
        body = self.lines + [f'"attn.yield"({result}) : ({MLIR_TYPE[result_type]}) -> ()']
        return ([f'{indent}"attn.{op}"() ({{', f"{indent}^bb0({params}):"]
                + [f"{indent}  {line}" for line in body] + [f"{indent}}}) : () -> ()"])


def _attention_attrs(p: ir.Program) -> dict[str, str]:
    attrs = {"sym_name": _attr(p.name), "heads_q": _attr(p.heads_q), "heads_kv": _attr(p.heads_kv),
             "d_qk": _attr(p.d_qk), "d_v": _attr(p.d_v), "dtype": _attr(p.dtype),
             "scale": _attr(float(p.scale)), "cache_kind": _attr(p.cache.kind),
             "cache_layout": _attr(p.cache.layout)}
    if p.cache.page_size is not None:
        attrs["cache_page_size"] = _attr(p.cache.page_size)
    if p.cache.table is not None:
        attrs["cache_table"] = _attr(p.cache.table)
    attrs.update(split_kind=_attr(p.split.kind), split_params=_params(p.split.params),
                 state=_attr(p.state.value), masked_rows=_attr(p.masked_rows))
    if isinstance(p.state, ir.SharedShift):
        attrs["state_params"] = _params(p.state.params)
    return attrs


def _params(params) -> str:
    """A policy's arguments by name (``compiler/policies.py``) as an MLIR dictionary attribute."""
    return "{" + ", ".join(f"{n} = {_attr(v)}" for n, v in params.items()) + "}"


def _tensor(t: ir.TensorDecl) -> str:
    attrs = {"sym_name": _attr(t.name), "dtype": _attr(t.dtype), "axes": _attr(tuple(t.axes))}
    if t.sample is not None:
        attrs.update(sample=_attr(t.sample.kind), sample_args=_attr(tuple(t.sample.args)))
    return f'"attn.tensor"() {_dict(attrs)} : () -> ()'


def print_program(program: ir.Program) -> str:
    """The program as an MLIR module in generic syntax; deterministic, ends with a newline."""
    inner = "    "
    used = set().union(*(ir.free_vars(e) for e in (program.mask, *program.score)))
    positions = {n: ir.I32 for n in POSITION_ARGS + tuple(n for n in ir.LENGTH_VARS if n in used)}
    mask = _Region(positions)
    score = _Region({**positions, "score": ir.F32})
    for statement in program.score:  # each statement reads the previous one's value
        score.names["score"] = score.value(statement)
    lines = ['"builtin.module"() ({', '  "attn.attention"() ({']
    lines += [inner + _tensor(t) for t in program.tensors]
    lines += mask.render("mask_program", mask.value(program.mask), ir.BOOL, inner)
    lines += score.render("score_program", score.names["score"], ir.F32, inner)
    if program.sink is not None:  # one f32 logit per (b, h): a region over b and h only
        sink = _Region({n: ir.I32 for n in ir.SINK_VARS})
        lines += sink.render("sink_program", sink.value(program.sink), ir.F32, inner)
    lines += [f"  }}) {_dict(_attention_attrs(program))} : () -> ()", "}) : () -> ()"]
    return "\n".join(lines) + "\n"
