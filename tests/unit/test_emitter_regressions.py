"""Accepted specs that crashed the Triton emitter (issue 35, found by fuzzing the language's score
expressions): the range analysis the separable form asks raised OverflowError on exp past f32.
Each now emits, and the backends give the oracle's answer or its error."""
import pytest

from attnc.backends.triton.emit import emit as emit_triton
from attnc.compiler import ranges
from tests.unit.test_language_semantics import assert_agree, run_all, spec

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

SCORES = [
    "score = score + exp(exp(exp(2.0)))",       # exp of a constant past f32: the range is +inf
    "score = exp(exp(exp(2.0)))",               # (found with mask = false: the form's row part)
    "score = score + exp(100.0 * tanh(k * 1.0))",
    "score = exp(2147483647)",                  # an integer converted, then past exp's f32 range
]


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_the_triton_emitter_takes_them(score, dtype):
    source = emit_triton(spec(f"{score} mask = causal", f"heads = 2 head_dim = 16 dtype = {dtype}"))
    compile(source.text, "t_triton.py", "exec")


@pytest.mark.parametrize("score", SCORES)
def test_backends_agree_with_the_oracle(score):
    assert_agree(run_all(spec(f"{score} mask = causal"), 20, 20))


def test_float_ranges_saturate_instead_of_raising():
    assert ranges._exp(1618.0) == float("inf") and ranges._exp(-1e9) == 0.0
    assert ranges._floor(float("inf")) == float("inf") and ranges._floor(2.5) == 2.0
