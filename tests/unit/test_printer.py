"""The MLIR printer (`attnc ir`, compiler/printer.py).

Every printed module must parse with xDSL as an unregistered `attn` dialect.
Beyond parsing, the mask and score regions are *run*: a small numpy
interpreter over the parsed ops is compared with a direct evaluation of the IR
trees on a (b, h, q, k) grid, so operand order, predicates and the chaining of
score statements are checked, not just the shape of the text.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from attnc.compiler import ir
from attnc.compiler.lower import compile_file, compile_spec
from attnc.compiler.printer import print_program

xdsl = pytest.importorskip("xdsl")
from xdsl.context import Context  # noqa: E402
from xdsl.dialects.builtin import Builtin, FloatAttr, IntegerAttr  # noqa: E402
from xdsl.parser import Parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.attn"))

BRIEF = """attention t { heads = 4 / 2  head_dim = 16
  tensor doc: i32[b, s]
  score = softcap(score, 30.0)
  score = score - 0.5 * abs(q - k)
  mask = causal & doc[b, q] == doc[b, k] | where(q > 3, k < 2, false) }"""

KITCHEN = """attention kitchen {
  heads = 8 / 2  head_dim = 192 / 128  dtype = f16  scale = 0.125
  tensor doc: i32[b, s] ~ segments(2, 5)
  tensor bias: f32[h, s] ~ uniform(-1.0, 1.0)
  tensor keep: bool[b, h, s] ~ bernoulli(0.9)
  tensor pfx: i32[4]
  score = score + bias[h, k] * exp(-abs(q - k) / 8) + log(2.0 + sqrt(q)) - tanh(min(q, k) * 0.5)
  score = max(score, -1e30) * 1e-5 + score * -0.0 + score * 0.0
  score = where(keep[b, h, k], score, -score) - 3 // 2 + q % 3 + max(score, -1e30 * 1e30)
  mask = !(q // 4 == k // 4) | keep[b, h, k] & window(3) | k < pfx[doc[b, k] % 4] | where(q > 2, 1, 2) > k
  cache = paged(page_size = 16, layout = nhd, table = csr)
  split = heuristic(0.85)
  state = mlu
}"""

NO_SCORE = "attention plain { heads = 2 head_dim = 8 }"
SHIFT = ("attention shift { heads = 4 / 2 head_dim = 8 mask = causal cache = paged(page_size = 16) "
         "split = capacity(2, 4) state = shared_shift(1.5, -30, 30) }")

INLINE = {"brief": BRIEF, "kitchen": KITCHEN, "no_score": NO_SCORE, "shared_shift": SHIFT}


def parse(text: str):
    ctx = Context(allow_unregistered=True)
    ctx.load_dialect(Builtin)
    module = Parser(ctx, text).parse_module()
    module.verify()
    return module


def name(op) -> str:
    return op.op_name.data if hasattr(op, "op_name") else op.name


def attention_parts(module):
    """(attention op, tensor ops, mask block, score block); a sink's block is ``sink_block``'s."""
    (att,) = module.body.block.ops
    assert name(att) == "attn.attention"
    ops = list(att.regions[0].block.ops)
    tensors = [o for o in ops if name(o) == "attn.tensor"]
    programs = {name(o): o.regions[0].block for o in ops if name(o) != "attn.tensor"}
    assert [name(o) for o in ops[len(tensors):]] in (["attn.mask_program", "attn.score_program"],
                                                     ["attn.mask_program", "attn.score_program", "attn.sink_program"])
    return att, tensors, programs["attn.mask_program"], programs["attn.score_program"]


def sink_block(module):
    """The ``attn.sink_program`` block of a spec with a sink, else None."""
    (att,) = module.body.block.ops
    return next((o.regions[0].block for o in att.regions[0].block.ops if name(o) == "attn.sink_program"), None)


def attr_value(a):
    if isinstance(a, (IntegerAttr, FloatAttr)):
        return a.value.data
    if hasattr(a, "data") and isinstance(a.data, tuple):
        return tuple(attr_value(x) for x in a.data)
    if hasattr(a, "data") and isinstance(a.data, Mapping):  # a policy's arguments by name
        return {k: attr_value(v) for k, v in a.data.items()}
    return a.data


# ---------------------------------------------------------------- evaluation
BIN = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
       "floordiv": np.floor_divide, "mod": np.mod, "and": np.logical_and, "or": np.logical_or}
CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
       "gt": np.greater, "ge": np.greater_equal}
UN = {"neg": np.negative, "not": np.logical_not, "cast_f32": lambda x: np.asarray(x, np.float64)}
FN = {"min": np.minimum, "max": np.maximum, "abs": np.abs, "exp": np.exp, "log": np.log,
      "sqrt": np.sqrt, "tanh": np.tanh}
S = 8


def inputs(p: ir.Program):
    rng = np.random.default_rng(0)
    env = {"b": np.arange(2).reshape(2, 1, 1, 1), "h": np.arange(p.heads_q).reshape(1, -1, 1, 1),
           "q": np.arange(S).reshape(1, 1, S, 1), "k": np.arange(S).reshape(1, 1, 1, S),
           "score": np.linspace(-3, 3, S * S).reshape(1, 1, S, S)}
    tensors = {}
    for t in p.tensors:
        shape = [{"b": 2, "h": p.heads_q, "s": S}.get(a, a) for a in t.axes]
        draw = {ir.I32: lambda: rng.integers(0, 4, shape), ir.F32: lambda: rng.standard_normal(shape),
                ir.BOOL: lambda: rng.random(shape) < 0.5}
        tensors[t.name] = draw[t.dtype]()
    return env, tensors


def load(tensors, tensor, idx):
    arr = tensors[tensor]
    return arr[tuple(np.clip(i, 0, n - 1) for i, n in zip(idx, arr.shape))]


def eval_ir(e, env, tensors):
    ev = [eval_ir(c, env, tensors) for c in ir.children(e)]
    if isinstance(e, ir.Const):  # an f32 attribute holds the value rounded to f32
        return float(np.float32(e.value)) if e.type is ir.F32 else e.value
    if isinstance(e, ir.Var):
        return env[e.name]
    if isinstance(e, ir.Load):
        return load(tensors, e.tensor, ev)
    if isinstance(e, ir.Unary):
        return UN[e.op](*ev)
    if isinstance(e, ir.Binary):
        return BIN[e.op](*ev)
    if isinstance(e, ir.Compare):
        return CMP[e.op](*ev)
    if isinstance(e, ir.Select):
        return np.where(*ev)
    return FN[e.fn](*ev)


def eval_block(block, env, tensors):
    vals = {arg: env[arg.name_hint] for arg in block.args}
    for op in block.ops:
        kind, attrs = name(op)[len("attn."):], {k: attr_value(v) for k, v in op.attributes.items()}
        args = [vals[o] for o in op.operands]
        if kind == "yield":
            return args[0]
        out = {"const": lambda: bool(attrs["value"]) if op.results[0].type.name == "integer_type"
               and op.results[0].type.width.data == 1 else attrs["value"],
               "load": lambda: load(tensors, attrs["tensor"], args),
               "cmp": lambda: CMP[attrs.get("predicate")](*args), "call": lambda: FN[attrs.get("fn")](*args),
               "select": lambda: np.where(*args)}.get(kind) or (lambda: {**BIN, **UN}[kind](*args))
        vals[op.results[0]] = out()
    raise AssertionError("block has no attn.yield")


def check_module(p: ir.Program, text: str) -> None:
    module = parse(text)
    att, tensors, mask, score = attention_parts(module)
    a = {k: attr_value(v) for k, v in att.attributes.items()}
    assert a["sym_name"] == p.name and a["dtype"] == p.dtype and a["scale"] == p.scale
    assert (a["heads_q"], a["heads_kv"], a["d_qk"], a["d_v"]) == (p.heads_q, p.heads_kv, p.d_qk, p.d_v)
    assert (a["cache_kind"], a["cache_layout"], a.get("cache_page_size"), a.get("cache_table")) == (
        p.cache.kind.value, p.cache.layout.value, p.cache.page_size, p.cache.table)
    assert (a["split_kind"], a["split_params"], a["state"]) == (p.split.kind.value, dict(p.split.params), p.state.value)
    assert a.get("state_params") == (dict(p.state.params) if isinstance(p.state, ir.SharedShift) else None)
    assert [attr_value(t.attributes["sym_name"]) for t in tensors] == [t.name for t in p.tensors]
    assert [attr_value(t.attributes["axes"]) for t in tensors] == [t.axes for t in p.tensors]
    assert [str(arg.type) for arg in mask.args] == ["i32"] * 4
    assert [arg.name_hint for arg in score.args] == ["b", "h", "q", "k", "score"]
    assert str(mask.last_op.operands[0].type) == "i1" and str(score.last_op.operands[0].type) == "f32"
    assert all(name(o).startswith("attn.") for o in [*mask.ops, *score.ops])
    env, data = inputs(p)
    with np.errstate(all="ignore"):
        np.testing.assert_equal(np.broadcast_to(eval_block(mask, env, data), (2, p.heads_q, S, S)),
                                np.broadcast_to(eval_ir(p.mask, env, data), (2, p.heads_q, S, S)))
        want = env["score"]
        for s in p.score:
            want = eval_ir(s, {**env, "score": want}, data)
        np.testing.assert_equal(eval_block(score, env, data), want)
        sink = sink_block(module)
        assert (sink is None) == (p.sink is None)
        if sink is not None:  # a region over b and h only
            assert [arg.name_hint for arg in sink.args] == ["b", "h"]
            np.testing.assert_equal(eval_block(sink, env, data), eval_ir(p.sink, env, data))


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_parse_and_agree(path):
    p = compile_file(path)
    check_module(p, print_program(p))


@pytest.mark.parametrize("key", INLINE)
def test_inline_specs_parse_and_agree(key):
    p = compile_spec(INLINE[key], key)
    text = print_program(p)
    assert text == print_program(compile_spec(INLINE[key], key))  # deterministic
    check_module(p, text)


def test_every_node_kind_is_printed():
    text = print_program(compile_spec(KITCHEN, "kitchen"))
    for op in ["const", "load", "neg", "not", "cast_f32", "add", "sub", "mul", "div", "floordiv", "mod",
               "and", "or", "cmp", "select", "call", "yield"]:
        assert f'"attn.{op}"(' in text, op
    for fn in ["min", "max", "abs", "exp", "log", "sqrt", "tanh"]:
        assert f'fn = "{fn}"' in text, fn
    # -0.0 and 0.0 are different constants; 1e-05 needs a '.'; -inf is a hex bit pattern
    assert "-0.0 : f32" in text and "{value = 0.0 : f32}" in text and "1.0e-05 : f32" in text
    assert "sample_args = [-1.0 : f64, 1.0 : f64]" in text  # folding never makes an inf constant (lower.py)


def test_op_counts_of_a_small_spec():
    _, _, mask, score = attention_parts(parse(print_program(compile_spec(BRIEF, "t"))))
    # mask: le, 2 loads, eq, and, 2 consts + 2 cmps (where's condition and true arm), const false,
    # select, or, yield.  score: softcap = const 30 (shared), const 1/30, mul, tanh, mul; 0.5, sub, abs, cast, mul,
    # sub; yield
    assert (len(list(mask.ops)), len(list(score.ops))) == (13, 12)
    _, _, _, score = attention_parts(parse(print_program(compile_spec(NO_SCORE, "plain"))))
    assert [name(o) for o in score.ops] == ["attn.yield"] and score.last_op.operands[0] is score.args[4]


EXACT_SPEC = """attention tiny { heads = 2  head_dim = 8
  tensor doc: i32[b, s] ~ segments(2, 5)
  score = score * 2.0
  score = max(score, -1.0)
  mask = causal & doc[b, q] == doc[b, k] }"""

EXACT = '''\
"builtin.module"() ({
  "attn.attention"() ({
    "attn.tensor"() {sym_name = "doc", dtype = i32, axes = ["b", "s"], sample = "segments", sample_args = [2 : i64, 5 : i64]} : () -> ()
    "attn.mask_program"() ({
    ^bb0(%b: i32, %h: i32, %q: i32, %k: i32):
      %0 = "attn.cmp"(%k, %q) {predicate = "le"} : (i32, i32) -> i1
      %1 = "attn.load"(%b, %q) {tensor = "doc"} : (i32, i32) -> i32
      %2 = "attn.load"(%b, %k) {tensor = "doc"} : (i32, i32) -> i32
      %3 = "attn.cmp"(%1, %2) {predicate = "eq"} : (i32, i32) -> i1
      %4 = "attn.and"(%0, %3) : (i1, i1) -> i1
      "attn.yield"(%4) : (i1) -> ()
    }) : () -> ()
    "attn.score_program"() ({
    ^bb0(%b: i32, %h: i32, %q: i32, %k: i32, %score: f32):
      %0 = "attn.const"() {value = 2.0 : f32} : () -> f32
      %1 = "attn.mul"(%score, %0) : (f32, f32) -> f32
      %2 = "attn.const"() {value = -1.0 : f32} : () -> f32
      %3 = "attn.call"(%1, %2) {fn = "max"} : (f32, f32) -> f32
      "attn.yield"(%3) : (f32) -> ()
    }) : () -> ()
  }) {sym_name = "tiny", heads_q = 2 : i64, heads_kv = 2 : i64, d_qk = 8 : i64, d_v = 8 : i64, \
dtype = "bf16", scale = 0.35355339059327373 : f64, cache_kind = "contiguous", cache_layout = "bhsd", \
split_kind = "auto", split_params = {}, state = "lse_o", masked_rows = "zero"} : () -> ()
}) : () -> ()
'''


def test_exact_output_of_a_small_spec():
    assert print_program(compile_spec(EXACT_SPEC, "tiny")) == EXACT


def test_scale_digits_round_trip():
    att, *_ = attention_parts(parse(EXACT))
    assert att.attributes["scale"].value.data == 1 / math.sqrt(8)
