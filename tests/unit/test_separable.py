"""The separable form of score programs (compiler/separable.py): which programs have one, that
its parts add up to the program (the IR interpreter, float64), the precision rule that bounds
where a kernel takes it, the generated module's part of it, and the launch layer's decision
(backends/triton/launch.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnc.backends.triton import choice, launch
from attnc.backends.triton.kernels import gluon_engine
from attnc.backends.triton.emit import emit
from attnc.compiler import ir, separable
from attnc.compiler.interp import evaluate
from attnc.compiler.lower import compile_file, compile_spec
from attnc.compiler.ranges import MAX_LENGTH
from tests.conftest import ROOT

TENSORS = ("tensor w: f32[h] ~ uniform(0, 1) tensor qb: f32[b, s] ~ uniform(-2, 2) "
           "tensor kb: f32[b, s] ~ uniform(-2, 2) tensor ib: i32[b, s] ~ randint(-5, 5)")
LENGTH = 4096  # the tensors' positions
ALIBI = "score - exp(-(h + 1) * log(2.0)) * (q - k)"


def _spec(*scores: str, dtype: str = "bf16", heads: str = "8 / 2") -> ir.Program:
    body = " ".join(f"score = {s}" for s in scores)
    return compile_spec(f"attention a {{ heads = {heads} head_dim = 64 dtype = {dtype} {TENSORS} {body} "
                        "mask = causal }")


def _example(stem: str) -> ir.Program:
    return compile_file(ROOT / "examples" / f"{stem}.attn")


def _reads(e: ir.Expr) -> set[str]:
    return set(ir.free_vars(e) & {"q", "k", "o", "score"}) | {f"{t}[]" for t in ir.loads(e)}


# ---------------------------------------------------------------- the analysis
def test_alibi_is_separable_its_parts_read_from_the_origin():
    form = separable.analyze(_example("alibi"))
    assert isinstance(form, separable.Separable)
    assert form.scale == separable.ONE
    assert _reads(form.row) == {"q", "o"} and _reads(form.column) == {"k", "o"}
    assert form.relative and form.affine_column
    assert ir.format_expr(form.row) == "-(exp(-(h + 1) * 0.6931471824645996) * (q - o))"
    assert ir.format_expr(form.column) == "exp(-(h + 1) * 0.6931471824645996) * (k - o)"


def test_softcap_documents_and_plain_masks_have_no_separable_form():
    assert "tanh()" in separable.analyze(_example("softcap"))
    assert "tanh()" in separable.analyze(_example("causal_document_gqa"))
    assert separable.analyze(_example("causal")) == "the spec has no score program"
    assert separable.separable(_example("causal")) is None


@pytest.mark.parametrize("score, scale, row, column", [
    ("score + qb[b, q]", "1.0", {"q", "qb[]"}, set()),  # a row-only bias: c = 0
    ("score + kb[b, k]", "1.0", set(), {"k", "kb[]"}),  # a key-only bias: r = 0
    ("score - w[h] * (q - k)", "1.0", {"q", "o", "w[]"}, {"k", "o", "w[]"}),  # per-head slopes from a tensor
    ("score * 0.5 + 3.0", "0.5", set(), set()),  # constants: a scale, and a row term (the LSE's)
    ("score * w[h]", "w[h]", set(), set()),  # a per-head scale
    ("(score - 0.25 * (q - k + 5)) / 2.0", "0.5", {"q", "o"}, {"k", "o"}),
    ("2.0 * score + 0.5 * q - 0.5 * k", "2.0", {"q", "o"}, {"k", "o"}),  # written apart, still a pair
    ("score + 0.5 * q - 0.25 * k", "1.0", {"q"}, {"k"}),  # no pair: absolute positions
    ("score - h * (q - k)", "1.0", {"q", "o"}, {"k", "o"}),  # an integer factor distributed
    ("where(h < 4, score - 0.5 * (q - k), score)", "1.0", {"q", "o"}, {"k", "o"}),
    ("where(h < 4, 2.0 * score, score)", "where(h < 4, 2.0, 1.0)", set(), set()),
    ("score + ib[b, k] * 0.125 + sin(q * 0.01)", "1.0", {"q"}, {"k", "ib[]"}),
])
def test_hand_written_programs_and_their_parts(score, scale, row, column):
    form = separable.analyze(_spec(score))
    assert isinstance(form, separable.Separable), form
    assert ir.format_expr(form.scale) == scale
    assert _reads(form.row) == row and _reads(form.column) == column
    if not row:
        assert not {"q", "k"} & ir.free_vars(form.row)
    if not column:
        assert form.column == separable.ZERO


def test_statements_compose():
    form = separable.analyze(_spec("score * 2.0", "score - 0.5 * (q - k)", "score / 4.0 + kb[b, k]"))
    assert ir.format_expr(form.scale) == "0.5"
    assert _reads(form.row) == {"q", "o"} and _reads(form.column) == {"k", "o", "kb[]"}
    assert not form.affine_column  # the key tensor


@pytest.mark.parametrize("score, why", [
    ("softcap(score, 30.0)", "reads the score under tanh()"),
    ("score - abs(q - k)", "abs(q - k) reads q and k together"),
    ("score + q * k", "q * k reads q and k together"),
    ("score * q", "a product of two factors that read q, k or the score"),
    ("score * score", "a product of two factors"),
    ("score + min(q, k)", "min(q, k) reads q and k together"),
    ("max(score, k * 0.5)", "reads the score under max()"),
    ("where(q > k, score, score - 1.0)", "a where() whose condition reads q, k or the score"),
    ("where(h < 2, score, q * k * 0.5)", "q * k reads q and k together"),
    ("score + kb[b, q - k + 100]", "under a read of tensor 'kb'"),
    ("score + (q - k) // 4", "(q - k) // 4 reads q and k together"),
    ("score + sin(q - k)", "reads q and k together under sin()"),
    ("exp(score)", "reads the score under exp()"),
    ("score / (h + 1.0 + score)", "reads the score under a division"),
])
def test_programs_without_a_separable_form_are_refused_with_the_reason(score, why):
    reason = separable.analyze(_spec(score))
    assert isinstance(reason, str) and why in reason, reason


# ---------------------------------------------------------------- property: the parts add up to the program
FACTORS = st.sampled_from(["0.5", "0.3", "2.0", "h", "w[h]", "exp(-(h + 1) * 0.5)", "(h + 1) * 0.25", "S_k * 0.001"])
ROW_TERMS = st.sampled_from(["q", "qb[b, q]", "(q // 3)", "sin(q * 0.01)", "w[h] * q", "ib[b, q]", "(q + h)"])
COLUMN_TERMS = st.sampled_from(["k", "kb[b, k]", "abs(k - 7)", "(k % 5)", "cos(k * 0.1)", "ib[b, k]"])
CELL_TERMS = st.sampled_from(["(q - k)", "(q - k + 5)", "(2 * q - 2 * k)", "(k - q) * h", "(q - 3 - k) * 2",
                              "(q + h - k)", "(q - k) * (h + 1)"])
DIVISORS = st.sampled_from(["4.0", "3.0", "(h + 1)", "w[h] + 1.0"])
NOT_SEPARABLE = st.sampled_from(["tanh(score)", "score * q", "(q * k)", "abs(q - k)", "min(score, 1.0)",
                                 "where(q > k, score, 0.0)", "kb[b, q - k + 2048]", "score * score"])


@st.composite
def affine(draw, depth=0, mixed=False):
    """A score expression: separable by construction (``mixed``: with non-separable pieces too)."""
    kinds = 10 if mixed else 9
    kind = draw(st.integers(0, kinds - 1)) if depth < 3 else 0
    sub = lambda: draw(affine(depth + 1, mixed))  # noqa: E731
    if kind == 0:
        return "score"
    if kind == 1:
        return f"({sub()} + {draw(FACTORS)} * {draw(ROW_TERMS)})"
    if kind == 2:
        return f"({sub()} - {draw(FACTORS)} * {draw(COLUMN_TERMS)})"
    if kind == 3:
        return f"({sub()} - {draw(FACTORS)} * {draw(CELL_TERMS)})"
    if kind == 4:
        return f"({draw(FACTORS)} * {sub()})"
    if kind == 5:
        return f"({sub()} / {draw(DIVISORS)})"
    if kind == 6:
        return f"where(h < 2, {sub()}, {sub()})"
    if kind == 7:
        return f"-({sub()} + {sub()})"
    if kind == 8:
        return f"({draw(FACTORS)} * {draw(CELL_TERMS)} + {draw(COLUMN_TERMS)})"  # no score
    return f"({sub()} + {draw(NOT_SEPARABLE)})"


def _direct(program: ir.Program, env: dict, tensors: dict, s0: np.ndarray) -> np.ndarray:
    s = s0
    for stmt in program.score:
        s = evaluate(stmt, {**env, "score": s}, tensors, wide=True)
    return np.broadcast_to(s, s0.shape)


def _parts(form: separable.Separable, env: dict, tensors: dict, s0: np.ndarray, origin: int) -> np.ndarray:
    env = {**env, "o": np.asarray(origin)}
    a, row, column = (evaluate(e, env, tensors, wide=True) for e in (form.scale, form.row, form.column))
    return np.broadcast_to(a * s0 + row + column, s0.shape)


def _agree(program: ir.Program, form: separable.Separable, seed: int) -> None:
    """The parts' sum against the program, in float64 on random tiles, origins and heads."""
    rng = np.random.default_rng(seed)
    tensors = {"w": rng.uniform(0, 1, 8).astype(np.float32), "qb": rng.uniform(-2, 2, (2, LENGTH)).astype(np.float32),
               "kb": rng.uniform(-2, 2, (2, LENGTH)).astype(np.float32),
               "ib": rng.integers(-5, 6, (2, LENGTH)).astype(np.int64)}
    q = rng.integers(0, LENGTH, (7, 1))
    k = rng.integers(0, LENGTH, (1, 9))
    s0 = rng.standard_normal((7, 9)) * 4
    for b, h in ((0, 0), (1, 3), (0, 7)):
        env = {"q": q, "k": k, "b": np.asarray(b), "h": np.asarray(h), "S_q": np.asarray(LENGTH),
               "S_k": np.asarray(LENGTH)}
        want = _direct(program, env, tensors, s0)
        for origin in (0, int(q[0, 0]) + 17, int(rng.integers(0, 2**30))):
            got = _parts(form, env, tensors, s0, origin)
            magnitude = np.abs(want).max() + np.abs(_parts(form, env, tensors, np.abs(s0), 0)).max() + 1.0
            assert np.abs(got - want).max() <= 1e-9 * magnitude, [ir.format_expr(s) for s in program.score]


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(affine(), min_size=1, max_size=3), st.integers(0, 2**16))
def test_separable_programs_are_found_and_their_parts_add_up(scores, seed):
    program = _spec(*scores)
    form = separable.analyze(program)
    assert isinstance(form, separable.Separable), (scores, form)
    _agree(program, form, seed)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(affine(mixed=True), min_size=1, max_size=2), st.integers(0, 2**16))
def test_what_the_analysis_accepts_adds_up(scores, seed):
    program = _spec(*scores)
    form = separable.analyze(program)
    if isinstance(form, separable.Separable):
        _agree(program, form, seed)


def test_affine_columns_step_from_any_key():
    """An affine column part is 0 at the origin and column(k) = column(m) + column(o + k - m): what
    the Gluon engine's per-block form takes (float64)."""
    form = separable.separable(_spec("score - exp(-(h + 1) * 0.5) * (q - k + 3)", "score * w[h] - 0.25 * (k - q)"))
    assert form.affine_column
    rng = np.random.default_rng(1)
    tensors = {"w": rng.uniform(0, 1, 8)}
    k, m, o = rng.integers(0, 2**30, 50), rng.integers(0, 2**30, 50), rng.integers(0, 2**30, 50)
    col = lambda pos: evaluate(form.column, {"k": pos, "o": o, "h": np.asarray(3)}, tensors, wide=True)  # noqa: E731
    assert np.all(col(o) == 0)
    np.testing.assert_allclose(col(k), col(m) + col(o + k - m), rtol=0, atol=1e-6 * np.abs(col(k)).max())
    for score in ("score + kb[b, k]", "score + 0.5 * k", "score - 0.5 * (q - k) + cos(k * 0.1)"):
        assert not separable.separable(_spec(score)).affine_column, score


# ---------------------------------------------------------------- precision
def test_tolerance_is_an_eighth_of_the_tighter_of_o_and_lse():
    assert separable.tolerance("bf16") == separable.tolerance("f16") == 1e-4 / 8  # LSE's absolute tolerance
    assert separable.tolerance("f32") == 2e-5 / 8


def test_f32_specs_never_take_the_form():
    program = _example("alibi")  # f32
    assert program.dtype == "f32" and separable.separable(program) is not None
    assert separable.usable_positions(program) == 0 and separable.usable_positions(program, per_block=True) == 0
    assert "SEPARABLE_POSITIONS" not in emit(program).text


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_alibi_takes_the_form_at_every_length(dtype):
    """With the origin the cancelled magnitude is the row part's over half a run of rows: 16 for
    slopes up to 1/2, whatever the positions; per block, plus the column part over half a block."""
    program = _spec(ALIBI, dtype=dtype)
    form = separable.separable(program)
    assert separable.excess(form, 8, MAX_LENGTH) == pytest.approx(16, rel=1e-6)
    assert separable.excess(form, 8, MAX_LENGTH, per_block=True) == pytest.approx(48, rel=1e-6)
    assert separable.usable_positions(program) == separable.usable_positions(program, per_block=True) == MAX_LENGTH


def test_the_rule_bounds_the_positions_where_parts_cancel_absolutely():
    """Parts with no origin pair (``q // 2`` cannot be shifted) cancel by up to min(|row|, |column|),
    which grows with the positions: the form holds below a bound and not above it."""
    program = _spec("score + 0.01 * (q // 2) - 0.01 * k")
    form = separable.separable(program)
    end = separable.usable_positions(program)
    assert 1000 < end < MAX_LENGTH
    assert separable.holds(form, program, end) and not separable.holds(form, program, end + 1)
    assert 2 * separable.excess(form, 8, end) * separable.ULP <= separable.tolerance("bf16")
    assert 2 * separable.excess(form, 8, end + 1) * separable.ULP > separable.tolerance("bf16")
    assert separable.usable_positions(program, per_block=True) == 0  # q // 2: not a column from the origin


def test_what_the_rule_refuses():
    steep = _spec("score - 8.0 * (q - k)")  # the row part reaches 256 over half a run of rows
    assert separable.usable_positions(steep) == 0
    medium = _spec("score - 1.5 * (q - k)")  # 48 per key; 48 + 96 per block
    assert separable.usable_positions(medium) == MAX_LENGTH and separable.usable_positions(medium, per_block=True) == 0
    rows = _spec("score + qb[b, q]")  # an f32 tensor may hold -inf or NaN: the row part must be finite
    assert separable.separable(rows) is not None and separable.usable_positions(rows) == 0
    keys = _spec("score + kb[b, k]")  # a column value of any kind reaches the cell as the program's would
    assert separable.usable_positions(keys) == MAX_LENGTH and separable.usable_positions(keys, per_block=True) == 0
    huge = _spec("score * exp(h * 100.0)")  # the per-job factor a * SCALE * log2 e would overflow
    assert separable.usable_positions(huge) == 0


# ---------------------------------------------------------------- the generated module and the launch layer
def _function(text: str, name: str) -> str:
    start = text.index(f"def {name}(")
    end = text.find("\n\n\n", start)
    return text[start:] if end < 0 else text[start:end]


def test_the_module_of_a_separable_spec_has_its_parts():
    text = emit(_spec(ALIBI)).text
    assert f"SEPARABLE_POSITIONS = {MAX_LENGTH}" in text and f"SEPARABLE_BLOCK_POSITIONS = {MAX_LENGTH}" in text
    assert "return 1.0" in _function(text, "score_scale")
    assert "((q - o)).to(tl.float32)" in _function(text, "score_row")
    assert "((k - o)).to(tl.float32)" in _function(text, "score_column")
    text = emit(_spec("score + kb[b, k]")).text
    assert "SEPARABLE_BLOCK_POSITIONS = 0" in text and "tl.load(_t2 + " in _function(text, "score_column")
    for program in (_spec("softcap(score, 30.0)"), _spec("score + qb[b, q]"), _example("causal")):
        assert "SEPARABLE" not in emit(program).text and "score_row" not in emit(program).text


class _Module:
    score_scale, score_row, score_column = "scale", "row", "column"
    SEPARABLE_POSITIONS, SEPARABLE_BLOCK_POSITIONS = 5000, 3000


def test_the_launch_layer_takes_the_form_below_the_modules_bounds():
    mode = launch.separable_mode
    assert mode(_Module, 3000) == gluon_engine.COLUMN_PER_BLOCK and mode(_Module, 1) == gluon_engine.COLUMN_PER_BLOCK
    assert mode(_Module, 3001) == gluon_engine.COLUMN_PER_KEY and mode(_Module, 5000) == gluon_engine.COLUMN_PER_KEY
    assert mode(_Module, 5001) == 0 and mode(_Module, None) == 0
    assert mode(object(), 16) == 0  # a module without the form (f32 specs among them)
    assert launch.separable_constexprs(_Module, 4000) == {"SEPARABLE": 1, "SCORE_SCALE": "scale", "SCORE_ROW": "row",
                                                           "SCORE_COLUMN": "column"}
    assert launch.separable_constexprs(object(), 16) == {"SEPARABLE": 0, "SCORE_SCALE": None, "SCORE_ROW": None,
                                                         "SCORE_COLUMN": None}


def test_the_engine_places_origins_and_blocks_as_the_rule_assumes():
    assert gluon_engine.ROWS == separable.ORIGIN_ROWS  # one origin per consumer's rows, in their middle
    assert max(choice.GLUON_TILES[1], choice.GLUON_WIDE_TILES[1]) <= separable.COLUMN_BLOCK
    # wider blocks (FP8's 256 keys) take the column part per key: per block, the offsets pass the rule's
    class M:
        SEPARABLE_BLOCK_POSITIONS = SEPARABLE_POSITIONS = 1 << 20
    assert launch.separable_mode(M, 4096, 256) == gluon_engine.COLUMN_PER_KEY
    assert launch.separable_mode(M, 4096, separable.COLUMN_BLOCK) == gluon_engine.COLUMN_PER_BLOCK
    assert choice.gluon_default_tiles(128, 128, fp8=True)[1] > separable.COLUMN_BLOCK  # (why the rule is needed)
