"""Score programs' fast forms (compiler/fast_score.py): what they print, that they are the exact
form bit for bit on positions below FAST_POSITIONS (the IR interpreter, float32), and the one
launch-layer decision that passes them to a kernel (backends/triton/launch.py)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnc.backends.triton import launch
from attnc.backends.triton.emit import emit
from attnc.compiler import fast_score, ir
from attnc.compiler.interp import evaluate
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import ROOT

LIMIT = fast_score.FAST_POSITIONS


def _function(text: str, name: str) -> str:
    """The source of one generated function (or alias line)."""
    start = text.index(f"def {name}(") if f"def {name}(" in text else text.index(f"{name} = ")
    end = text.find("\n\n\n", start)
    return text[start:] if end < 0 else text[start:end]


def _spec(score: str, dtype: str = "f32") -> ir.Program:
    return compile_spec(f"attention a {{ heads = 4 head_dim = 16 dtype = {dtype} score = {score} mask = causal }}")


def test_alibi_converts_its_positions_on_the_vectors():
    text = emit(compile_file(ROOT / "examples" / "alibi.attn")).text
    exact, fast = _function(text, "score_program"), _function(text, "score_program_fast")
    assert "((q - k)).to(tl.float32)" in exact  # the exact form: a subtraction and a conversion per cell
    assert "(q - k)" not in fast and ".to(tl.float32)" not in fast.replace("((-(h + 1))).to(tl.float32)", "")
    assert "(_f32_small(q) - _f32_small(k))" in fast  # per cell: one subtraction (then the multiply-add)
    grad = _function(text, "score_grad_fast")
    assert "(_f32_small(q) - _f32_small(k))" in grad and "(q - k)" not in grad


def test_specs_with_nothing_to_gain_alias_the_exact_functions():
    text = emit(compile_file(ROOT / "examples" / "softcap.attn")).text
    assert "score_program_fast = score_program" in text and "score_grad_fast = score_grad" in text
    text = emit(compile_file(ROOT / "examples" / "causal.attn")).text
    assert "score_program_fast = score_program" in text and "score_grad_fast" not in text


def test_regrouping_and_the_rules_that_keep_it_exact():
    cases = {  # score -> the fast form's position arithmetic, printed
        "score + (q - k + 5)": "(((q + 5)).to(tl.float32) - _f32_small(k))",  # scalars join the rows' vector
        "score + (k - q - h)": "(_f32_small(k) - ((q + h)).to(tl.float32))",
        "score + (q - k - q - q + k - k)": "((0.0 - _f32_small(q)) - _f32_small(k))",  # like terms collected
        "score - 0.5 * abs(q - k)": "tl.abs((_f32_small(q) - _f32_small(k)))",
        "score + min(q - k, 100)": "tl.minimum((_f32_small(q) - _f32_small(k)), 100.0, propagate_nan=tl.PropagateNan.ALL)",
        "score + where(q > k, q, k)": "tl.where((q > k), _f32_small(q), _f32_small(k))",
        "score - (q // 64 - k // 64)": "(_f32_small(_floordiv(q, 64)) - _f32_small(_floordiv(k, 64)))",
        "score + -(q - k)": "(_f32_small(k) - _f32_small(q))",
        "score + -abs(q - k)": "(0.0 - tl.abs(",  # a zero converts to +0.0, never -0.0
    }
    for score, want in cases.items():
        fast = _function(emit(_spec(score)).text, "score_program_fast")
        assert want in fast, (score, fast)
    # a product that could be -0.0 in f32 (0 * negative) keeps its per-cell conversion
    assert "score_program_fast = score_program" in emit(_spec("score + (q - k) * h")).text


def test_softcap_takes_the_gpus_tanh_in_half_dtypes():
    for dtype, want in (("bf16", "_tanh_approx("), ("f16", "_tanh_approx("), ("f32", "_tanh(")):
        text = emit(_spec("softcap(score, 30.0)", dtype)).text
        assert want in _function(text, "score_program") and want in _function(text, "score_grad"), dtype
    from attnc.backends.triton import lang
    if lang.INTERPRETED:  # the interpreter runs no inline assembly: the accurate form there
        assert lang._tanh_approx is lang._tanh


class _Module:
    score_program, score_program_fast = "exact", "fast"
    score_grad, score_grad_fast = "exact grad", "fast grad"
    visible, SPEC = "visible", {}


def test_the_launch_layer_takes_the_fast_form_only_below_the_limit():
    assert launch.fast_scores(LIMIT) and launch.fast_scores(1)
    assert not launch.fast_scores(LIMIT + 1) and not launch.fast_scores(2**24) and not launch.fast_scores(None)
    assert launch.score_functions(_Module, LIMIT) == ("fast", "fast grad")
    assert launch.score_functions(_Module, 2**24) == ("exact", "exact grad")
    assert launch.score_functions(_Module, None) == ("exact", "exact grad")  # split calls: positions unknown
    assert launch.spec_constexprs(_Module, 2**24 + 1)["SCORE"] == "exact"
    assert launch.spec_constexprs(_Module, 4096)["SCORE"] == "fast"
    # one past the largest position: a whole call's is S_k; a block's, its offsets plus its sizes
    assert launch.position_end(100, 300, None) == 300
    assert launch.position_end(64, 128, (LIMIT - 64, LIMIT - 200)) == LIMIT - 64 + 64
    assert launch.position_end(64, 128, (LIMIT - 32, LIMIT - 128)) == LIMIT + 32


# ---------------------------------------------------------------- property: fast == exact, bit for bit
EDGES = np.array([0, 1, 2, 5, 63, 64, 1000, 2**22, LIMIT - 2**20, LIMIT - 64, LIMIT - 3, LIMIT - 2, LIMIT - 1])


@st.composite
def affine(draw, depth=0):
    """An integer expression in q, k, h: affine forms and the operations the fast form rewrites."""
    if depth > 2 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(["q", "k", "h", "0", "1", "7", "-3", "q - k", "k - q", "q + k"]))
    sub = lambda: draw(affine(depth + 1))  # noqa: E731
    kind = draw(st.integers(0, 6))
    if kind <= 1:
        return f"({sub()} {draw(st.sampled_from(['+', '-']))} {sub()})"
    if kind == 2:
        return f"({draw(st.sampled_from(['2', '-1', '3', 'h']))} * {sub()})"
    if kind == 3:
        fn = draw(st.sampled_from(["abs", "min", "max"]))
        return f"abs({sub()})" if fn == "abs" else f"{fn}({sub()}, {sub()})"
    if kind == 4:
        return f"where({sub()} < {sub()}, {sub()}, {sub()})"
    if kind == 5:
        return f"-{sub()}"
    return f"({sub()} // {draw(st.sampled_from(['16', '3']))})"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(affine(), st.sampled_from(["score + {}", "score - 0.25 * ({} + q - k)",
                                  "score * 0.5 + exp(-(h + 1) * 0.5) * {}", "score - abs({}) * 0.125"]))
def test_fast_form_is_the_exact_form_bit_for_bit(expr, template):
    program = _spec(template.format(expr))
    fast = fast_score.fast_score(program)
    for stmt in fast:
        ir.verify_expr(stmt, program, ir.POSITION_VARS + ir.LENGTH_VARS + ("score",))
    rng = np.random.default_rng(len(expr))
    q = np.concatenate([EDGES, rng.integers(0, LIMIT, 8)]).reshape(-1, 1)
    k = np.concatenate([EDGES, rng.integers(0, LIMIT, 8)]).reshape(1, -1)
    score = rng.standard_normal((q.size, k.size)).astype(np.float32)
    for h in (0, 3):
        env = {"q": q, "k": k, "h": np.asarray(h), "b": np.asarray(0), "score": score}
        for exact_stmt, fast_stmt in zip(program.score, fast):
            want = np.broadcast_to(evaluate(exact_stmt, env, {}), score.shape)
            got = np.broadcast_to(evaluate(fast_stmt, env, {}), score.shape)
            assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), (expr, ir.format_expr(fast_stmt))


def _small_coefficients(terms) -> bool:
    coeff = {v: sum(s for s, t in terms if t == v) for v in ("q", "k")}
    return {"q", "k"} <= {t for _, t in terms} and all(abs(c) <= 2 for c in coeff.values())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from([-1, 1]), st.sampled_from(["q", "k", "h", "5", "64"])), min_size=2,
                max_size=6).filter(_small_coefficients))
def test_affine_position_terms_convert_no_cell(terms):
    """A sum of position terms (coefficients up to 2: each group stays within 2**24 below the
    limit) converts no cell: its q terms (and the scalars) on the rows, its k terms on the keys."""
    text = " ".join(f"{'+' if s > 0 else '-'} {t}" for s, t in terms).lstrip("+ ")
    stmt, = fast_score.fast_score(_spec(f"score + ({text})"))
    cells = [n for n in ir.walk(stmt) if {"q", "k"} <= ir.free_vars(n)]
    assert not [n for n in cells if n.type.integer], ir.format_expr(stmt)  # no integer work per cell either
    assert len(cells) <= 3, ir.format_expr(stmt)  # the combination (two parts, or three), then + score
