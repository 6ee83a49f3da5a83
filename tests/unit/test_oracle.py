"""The float64 oracle: bottom-right positions (the `phase` fixture), GQA head mapping,
the all-masked policy, and agreement with the split-state algebra row by row."""
import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.backends.numpy.state import finalize, summarize
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_spec
from tests.conftest import seed_contracts

PHASES = seed_contracts()["phase"]
CAUSAL = compile_spec("attention c { heads = 4 / 2 head_dim = 8 dtype = f32 mask = causal }")


@pytest.mark.parametrize("case", PHASES["cases"], ids=lambda c: c["name"])
def test_bottom_right_causal_cells_match_the_phase_fixture(case):
    if case["name"] == "training":
        s_q = s_k = case["S"]
    else:
        s_q, s_k = case["C"], case["T"] + case["C"]
        assert case["post"] == s_k
    visible = oracle.dense_mask(CAUSAL, 1, s_q, s_k, {})[0, 0]
    assert visible.size == case["rect"]
    assert visible.sum() == case["visible"]
    assert (~visible).sum() == case["masked"]


def test_append_rows_see_old_rows_and_staged_rows_through_themselves():
    # M4.5 §0x08C: T = 5 old rows, C = 3 staged; query a5 sees [a0..a5], a7 sees [a0..a7]
    visible = oracle.dense_mask(CAUSAL, 1, 3, 8, {})[0, 0]
    assert [np.flatnonzero(r).tolist() for r in visible] == [list(range(6)), list(range(7)), list(range(8))]


def test_gqa_query_head_reads_kv_head_h_div_g():
    p = compile_spec("attention g { heads = 4 / 2 head_dim = 2 dtype = f32 }")
    q = np.zeros((1, 4, 1, 2))
    k = np.zeros((1, 2, 3, 2))
    v = np.stack([np.full((3, 2), 1.0), np.full((3, 2), 2.0)])[None]
    o, lse = oracle.reference(p, q, k, v)
    assert o[0, :, 0, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    np.testing.assert_allclose(lse, np.log(3))


def test_oracle_rows_equal_the_split_state_summary():
    p = compile_spec("attention s { heads = 2 head_dim = 4 dtype = f32 score = score - 0.25 * (q - k) "
                     "mask = causal & k % 3 != 1 }")
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 2, 5, 4)), rng.normal(size=(1, 2, 9, 4)), rng.normal(size=(1, 2, 9, 4))
    o, lse = oracle.reference(p, q, k, v)
    for h in range(2):
        for i in range(5):
            pos = 9 - 5 + i
            f32 = np.float32  # the score program computes in f32 from the float64 q.k (the language)
            scores = [None if (kk > pos or kk % 3 == 1) else float(f32(q[0, h, i] @ k[0, h, kk] * p.scale)
                                                                 - f32(0.25) * f32(pos - kk)) for kk in range(9)]
            ref_o, ref_lse = finalize(summarize(scores, v[0, h]))
            np.testing.assert_allclose(o[0, h, i], ref_o, atol=1e-12)
            assert lse[0, h, i] == pytest.approx(ref_lse, abs=1e-12)


def test_all_masked_rows_give_zero_and_minus_inf():
    p = compile_spec("attention e { heads = 1 head_dim = 2 dtype = f32 mask = q >= 3 & causal }")
    q, k, v = np.ones((1, 1, 5, 2)), np.ones((1, 1, 5, 2)), np.full((1, 1, 5, 2), 7.0)
    o, lse = oracle.reference(p, q, k, v)
    assert (o[0, 0, :3] == 0).all() and np.isneginf(lse[0, 0, :3]).all()
    np.testing.assert_allclose(o[0, 0, 3:], 7.0)


def test_more_query_rows_than_keys_is_a_plan_error():
    with pytest.raises(PlanError, match="exceed S_k"):
        oracle.reference(CAUSAL, np.zeros((1, 4, 6, 8)), np.zeros((1, 2, 5, 8)), np.zeros((1, 2, 5, 8)))
