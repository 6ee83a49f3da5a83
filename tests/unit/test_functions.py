"""Every function of the language (ir.CALL_FNS) in every table that computes or prints a call:
the scalar folder, the IR interpreter, the numpy, Triton and AHBM emit tables, the range
analyses and the derivative rules.  A function added to ir.CALL_FNS and missing from one of
them fails here by name (docs/ARCHITECTURE.md, "How to add a mask or score function"); the
last tests run a spec that calls it on every CPU backend against the float64 oracle
(tests/numerics/test_triton_language.py runs the same specs on the Triton kernels)."""
from __future__ import annotations

import importlib
import math
import re
import string

import numpy as np
import pytest

from attnc.backends.ahbm.sim.tl import Tl
from attnc.compiler import autodiff, interp, ir, ranges, scalar
from tests.unit.test_language_semantics import assert_agree, run_all, spec

ahbm_emit, numpy_emit, triton_emit = (importlib.import_module(f"attnc.backends.{b}.emit")
                                      for b in ("ahbm", "numpy", "triton"))  # (the packages export `emit`)
FNS = sorted(ir.CALL_FNS)

TABLES = {  # name -> the table (function name -> how it is computed or printed)
    "scalar.CALLS (checker and constant folder)": scalar.CALLS,
    "interp.CALL (IR interpreter, oracle, host tile evaluation)": interp.CALL,
    "numpy emit": numpy_emit._CALLS,
    **{f"triton emit ({d})": triton_emit.calls(d) for d in ("f16", "bf16", "f32")},
    "ahbm emit (tensors)": ahbm_emit._TL_CALLS,
    "ahbm emit (scalars)": ahbm_emit._PY_CALLS,
}
TEMPLATES = {name: table for name, table in TABLES.items() if "emit" in name}
TEMPLATES["triton emit (f32 results)"] = triton_emit.F32_CALLS  # a subset: f32 min/max keep NaN


@pytest.mark.parametrize("table", list(TABLES))
def test_every_table_has_exactly_the_languages_functions(table):
    keys = set(TABLES[table])
    assert not set(FNS) - keys, f"{table} lacks {sorted(set(FNS) - keys)}"
    assert not keys - set(FNS), f"{table} has functions the IR does not: {sorted(keys - set(FNS))}"


@pytest.mark.parametrize("table", list(TEMPLATES))
def test_every_template_takes_its_functions_arguments(table):
    assert set(TEMPLATES[table]) <= set(FNS), table
    for fn, template in TEMPLATES[table].items():
        used = {int(f) for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        assert used == set(range(ir.CALL_FNS[fn])), f"{table}: {fn} -> {template!r}"


def test_the_ahbm_templates_call_operations_the_simulator_has():
    for fn, template in ahbm_emit._TL_CALLS.items():
        for op in re.findall(r"\btl\.(\w+)", template):
            assert callable(getattr(Tl, op, None)), f"{fn}: the simulator has no tl.{op}"


def test_the_triton_templates_call_what_the_generated_module_imports():
    triton = pytest.importorskip("triton")
    import triton.language as tl  # noqa: F401
    from attnc.backends.triton import lang
    for table in (*(triton_emit.calls(d) for d in ("f16", "bf16", "f32")), triton_emit.F32_CALLS):
        for fn, template in table.items():
            for path in re.findall(r"\btl\.([\w.]+)\(", template):
                obj = triton.language
                for part in path.split("."):
                    obj = getattr(obj, part, None)
                assert obj is not None, f"{fn}: triton.language has no {path}"
            for helper in re.findall(r"(?<![\w.])(_\w+)\(", template):
                assert hasattr(lang, helper), f"{fn}: backends/triton/lang.py has no {helper}"


def _call(fn: str, t: ir.Type) -> ir.Call:
    args = tuple(ir.Var("score", t) if t is ir.F32 else ir.Var(v, t) for v in ("q", "k")[:ir.CALL_FNS[fn]])
    return ir.Call(fn, args, ir.call_type(fn, tuple(a.type for a in args)))


@pytest.mark.parametrize("fn", FNS)
def test_every_function_has_range_and_derivative_rules(fn):
    call = _call(fn, ir.F32)
    lo, hi, _ = ranges.float_range(ir.Call(fn, tuple(ir.Const(0.5, ir.F32) for _ in call.args), call.type),
                                   ranges.IntRanges(4))
    assert lo <= hi
    assert isinstance(autodiff.derivative(call, autodiff.SCORE), ir.Expr)
    if fn not in ir.FLOAT_FNS:  # integer results: the exactness analysis bounds them
        lo, hi = ranges.IntRanges(4)(_call(fn, ir.I32))
        assert lo <= hi


def _uses(fn: str) -> str:
    """A spec body that calls ``fn`` in the score program (on the score and on positions) and,
    where it gives integers, in the mask; its arguments stay in the function's domain."""
    n = ir.CALL_FNS[fn]
    if fn in ir.FLOAT_FNS:
        on_score = ", ".join(["0.5 * score * score + 0.25", "score * score + 1.0"][:n])
        on_pos = ", ".join(["(q - k) * (q - k) + 1", "k + 1"][:n])
        return f"mask = causal score = score + 0.5 * {fn}({on_score}) - 0.25 * {fn}({on_pos})"
    on_score = ", ".join(["score - 0.5", "0.25"][:n])
    on_pos = ", ".join(["q - 2 * k + 3", "k - 2"][:n])
    return f"mask = causal | {fn}({on_pos}) == 1 score = score + 0.5 * {fn}({on_score}) - 0.25 * {fn}({on_pos})"


@pytest.mark.parametrize("fn", FNS)
def test_every_function_agrees_with_the_oracle_on_every_cpu_backend(fn):
    results = run_all(spec(_uses(fn)), 7, 9, batch=2)
    assert not isinstance(results["oracle"], Exception), results["oracle"]
    assert_agree(results)


# ---------------------------------------------------------------- sign (the worked example)
def test_sign_is_minus_one_zero_or_one_in_its_operands_type():
    ints = np.array([-7, -1, 0, 1, 9], np.int32)
    got = interp.evaluate(ir.Call("sign", (ir.Var("q", ir.I32),), ir.I32), {"q": ints}, {})
    assert got.dtype.kind == "i" and got.tolist() == [-1, -1, 0, 1, 1]
    floats = np.array([-np.inf, -2.5, -0.0, 0.0, 1e-30, np.inf, np.nan], np.float32)
    got = interp.evaluate(ir.Call("sign", (ir.Var("score", ir.F32),), ir.F32), {"score": floats}, {})
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [-1, -1, 0, 0, 1, 1, np.nan])
    assert not np.signbit(got[2])  # sign(-0.0) = +0.0 everywhere (Triton and AHBM print x - x)
    assert [scalar.sign(v) for v in (-3, 0, 4)] == [-1, 0, 1]
    assert [scalar.sign(v) for v in (-0.5, -0.0, 2.0)] == [-1.0, 0.0, 1.0]
    assert math.isnan(scalar.sign(math.nan)) and type(scalar.sign(2.0)) is float


def test_sign_folds_and_bounds_like_the_other_functions():
    p = spec("mask = k <= q + sign(3 - 5) + 1 score = score * sign(2.0)")
    assert ir.format_expr(p.score[0]) == "score * 1.0"  # sign(2.0) folded to 1.0
    assert ir.format_expr(p.mask) == "k <= q + -1 + 1"  # sign(3 - 5) folded to -1
    q, k = ir.Var("q", ir.I32), ir.Var("k", ir.I32)
    sign = lambda x: ir.Call("sign", (x,), ir.I32)  # noqa: E731
    assert ranges.IntRanges(4)(sign(ir.Binary("sub", q, k, ir.I32))) == (-1, 1)
    assert ranges.IntRanges(4)(sign(ir.Binary("add", q, ir.Const(1, ir.I32), ir.I32))) == (1, 1)
    assert ranges.IntRanges(4)(sign(q)) == (0, 1)


def test_sign_of_a_tensor_read_in_the_mask_and_score_on_every_cpu_backend():
    body = ("tensor side: i32[b, s] ~ randint(-3, 3) tensor w: f32[h] ~ uniform(-1, 1) "
            "mask = sign(side[b, q]) == sign(side[b, k]) | k == q "
            "score = score + sign(w[h]) * abs(q - k) * 0.125")
    results = run_all(spec(body), 8, 8, batch=2)
    assert not isinstance(results["oracle"], Exception), results["oracle"]
    assert_agree(results)
