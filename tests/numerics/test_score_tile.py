"""Score statements that do not read `score` (issue 35): `score = 7`, `score = q` are legal; every
backend broadcasts the program's result to the tile (ir.score_keeps_tile) and gives the oracle's
answer, in tiles of every class (FULL included: causal over 40 keys in 16-wide tiles)."""
import pytest

from tests.unit.test_language_semantics import assert_agree, run_all, spec

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.numerics.test_triton_language import assert_agree as triton_agree  # noqa: E402
from tests.numerics.test_triton_language import prefill_and_split  # noqa: E402

BODIES = [
    "score = 7 mask = causal",
    "score = q mask = causal",
    "score = score * 2.0 score = (q - 3) * 0.25 mask = causal",
    "score = k * 0.5 mask = window(8)",
    "tensor w: f32[h] ~ uniform(-1, 1) score = w[h] * 3.0 + h mask = causal",
]


@pytest.mark.parametrize("body", BODIES)
def test_numpy_and_ahbm_agree_with_the_oracle(body):
    assert_agree(run_all(spec(body), 40, 40))


@pytest.mark.parametrize("body", [BODIES[0], BODIES[2]])  # a constant; a q-only statement after one that reads score
def test_triton_prefill_and_split_agree_with_the_oracle(body):
    want, *got = prefill_and_split(body, 40, 40)
    triton_agree(want, *got)
