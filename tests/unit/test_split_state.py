"""The split-state algebra reproduces shared/fixtures/seed_contracts.json `split_state`."""
import itertools
import numpy as np
import pytest

from tests.conftest import seed_contracts
from attnc.backends.numpy.state import (
    OutputState, State, empty_state, finalize, merge_output_state, merge_state, reduce_balanced, reduce_sequential,
    summarize, to_output_state,
)

FIXTURE = seed_contracts()["split_state"]


def _num(x):
    return {"-inf": -np.inf}.get(x, x) if isinstance(x, str) else x


def test_worked_empty_middle_split_states():
    w = FIXTURE["worked_empty_middle"]
    states = [summarize(s, v) for s, v in zip(w["scores"], w["values"])]
    for got, want in zip(states, w["split_states"]):
        assert got.valid == want["valid"]
        assert got.m == _num(want["m"])
        assert got.l == pytest.approx(want["l"], abs=1e-12)
        np.testing.assert_allclose(got.u, want["u"], atol=1e-12, rtol=0)


def test_worked_empty_middle_merged_output_and_lse():
    w = FIXTURE["worked_empty_middle"]
    states = [summarize(s, v) for s, v in zip(w["scores"], w["values"])]
    merged = reduce_sequential(states)
    assert merged.m == w["merged"]["m"]
    assert merged.l == pytest.approx(w["merged"]["l"], abs=1e-12)
    np.testing.assert_allclose(merged.u, w["merged"]["u"], atol=1e-12, rtol=0)
    o, lse = finalize(merged)
    np.testing.assert_allclose(o, w["O"], atol=1e-12, rtol=0)
    assert lse == pytest.approx(w["LSE"], abs=1e-12)
    # the unsplit dense reference agrees
    flat_scores = [s for split in w["scores"] for s in split]
    flat_values = [v for split in w["values"] for v in split]
    o_dense, lse_dense = finalize(summarize(flat_scores, flat_values))
    np.testing.assert_allclose(o_dense, w["O"], atol=1e-12, rtol=0)
    assert lse_dense == pytest.approx(w["LSE"], abs=1e-12)


def test_every_order_and_tree_agrees_within_the_fixture_spread():
    w = FIXTURE["worked_empty_middle"]
    states = [summarize(s, v) for s, v in zip(w["scores"], w["values"])]
    outs = [finalize(reduce_sequential(p))[0] for p in itertools.permutations(states)]
    outs += [finalize(reduce_balanced(p))[0] for p in itertools.permutations(states)]
    spread = max(np.abs(a - b).max() for a in outs for b in outs)
    assert spread <= w["max_order_spread_float64"]


def test_lse_o_abi_merges_to_the_same_row():
    w = FIXTURE["worked_empty_middle"]
    states = [to_output_state(summarize(s, v)) for s, v in zip(w["scores"], w["values"])]
    acc = states[0]
    for s in states[1:]:
        acc = merge_output_state(acc, s)
    np.testing.assert_allclose(acc.o, w["O"], atol=1e-12, rtol=0)
    assert acc.lse == pytest.approx(w["LSE"], abs=1e-12)


def test_empty_state_is_the_identity_and_never_nan():
    a = summarize([1.0, 2.0], [[1.0], [3.0]])
    e = empty_state(1)
    for merged in (merge_state(e, a), merge_state(a, e)):
        assert merged == a
    ee = merge_state(e, e)
    assert not ee.valid and np.isneginf(ee.m) and ee.l == 0 and not np.isnan(ee.u).any()


def test_averaging_normalized_outputs_fails_and_lse_recovers_the_exact_row():
    f = FIXTURE["averaging_failure"]
    a = to_output_state(summarize(f["split_A"]["scores"], f["split_A"]["values"]))
    b = to_output_state(summarize(f["split_B"]["scores"], f["split_B"]["values"]))
    assert (a.o[0] + b.o[0]) / 2 == f["naive_average"]
    assert merge_output_state(a, b).o[0] == pytest.approx(f["exact_O"], abs=1e-10)
    assert finalize(merge_state(summarize(f["split_A"]["scores"], f["split_A"]["values"]),
                                summarize(f["split_B"]["scores"], f["split_B"]["values"])))[0][0] == \
        pytest.approx(f["exact_O"], abs=1e-10)


def test_float16_round_after_each_operation_is_order_sensitive():
    f = FIXTURE["float16_order_sensitivity"]
    single = [summarize([s], [v], np.float16) for s, v in zip(f["scores"], f["values"])]
    exact = finalize(reduce_sequential([summarize([s], [v]) for s, v in zip(f["scores"], f["values"])]))[0]
    assert exact[0] == f["exact_O"]
    table = f["round_after_each_op_float16"]
    assert finalize(reduce_sequential(single))[0][0] == table["sequential"]
    assert finalize(reduce_balanced(single))[0][0] == table["balanced"]
    permuted = [single[0], single[2], single[1], single[3]]  # values 2048, -2048, 1, 1
    assert [float(s.u[0]) for s in permuted] == [2048, -2048, 1, 1]
    assert finalize(reduce_sequential(permuted))[0][0] == table["permuted_2048_-2048_1_1"]
    assert all(type(s.m) is np.float16 for s in single)


def test_all_masked_row_policy():
    policy = FIXTURE["all_masked_row_policy"]
    assert policy == {"O": "zeros(d_v)", "LSE": "-inf"}
    o, lse = finalize(reduce_sequential([summarize([None, None], [[5.0, 6.0], [7.0, 8.0]]),
                                          summarize([None], [[1.0, 1.0]])]))
    assert o.tolist() == [0.0, 0.0] and np.isneginf(lse)


def test_merge_is_commutative_and_associative_on_random_splits():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=12) * 5
    values = rng.normal(size=(12, 3))
    masked = [None if i % 5 == 1 else s for i, s in enumerate(scores)]
    parts = [(0, 3), (3, 3), (3, 8), (8, 12)]  # includes an empty range
    states = [summarize(masked[a:b], values[a:b]) if b > a else empty_state(3) for a, b in parts]
    whole = finalize(summarize(masked, values))
    for p in itertools.permutations(states):
        o, lse = finalize(reduce_sequential(p))
        np.testing.assert_allclose(o, whole[0], atol=1e-12)
        assert lse == pytest.approx(whole[1], abs=1e-12)
    assert isinstance(states[1], State) and not states[1].valid


def test_lse_o_merge_of_many_rows_is_the_merge_of_each_row():
    """merge_output_state over arrays of rows (context parallelism merges whole blocks) gives each
    row's one-row merge, and rows invalid on either side pass through without a NaN."""
    rng = np.random.default_rng(5)
    rows, d = 7, 3
    valid_a, valid_b = rng.random(rows) < 0.6, rng.random(rows) < 0.6
    valid_a[0] = valid_b[0] = False  # neither side saw a key
    lse_a = np.where(valid_a, rng.normal(size=rows), -np.inf)
    lse_b = np.where(valid_b, rng.normal(size=rows) + 30, -np.inf)  # far apart: no overflow either
    o_a = np.where(valid_a[:, None], rng.normal(size=(rows, d)), 0)
    o_b = np.where(valid_b[:, None], rng.normal(size=(rows, d)), 0)
    merged = merge_output_state(OutputState(valid_a, lse_a, o_a), OutputState(valid_b, lse_b, o_b))
    assert not np.isnan(merged.o).any() and not np.isnan(merged.lse).any()
    for i in range(rows):
        one = merge_output_state(OutputState(bool(valid_a[i]), lse_a[i], o_a[i]),
                                 OutputState(bool(valid_b[i]), lse_b[i], o_b[i]))
        assert one.valid == merged.valid[i]
        assert one.lse == merged.lse[i] or (np.isneginf(one.lse) and np.isneginf(merged.lse[i]))
        np.testing.assert_array_equal(one.o, merged.o[i])
