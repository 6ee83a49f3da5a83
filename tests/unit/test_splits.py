"""compiler.analysis.splits: per-request split bounds (M4.5 §0x03B, §0x03G) and
FlashAttention's split heuristic (§0x0AB), against the `split_launch` fixture."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attnc.compiler import ir
from attnc.compiler.analysis import splits as sp
from attnc.compiler.errors import PlanError
from tests.conftest import seed_contracts

FIX = seed_contracts()["split_launch"]
MAIN, TAIL = FIX["ragged_balanced"], FIX["capacity_tail"]
HEURISTIC_TEXT = seed_contracts()["schedules"]["fa_split_heuristic"]


def test_ragged_balanced_split_lengths():
    b = sp.balanced(MAIN["splits"]).bounds(MAIN["T"])
    assert b.split_lengths() == MAIN["split_lengths"]
    assert b.capacity == b.num_splits == MAIN["splits"]
    T1 = MAIN["T"][1]
    assert (T1 // MAIN["splits"], T1 % MAIN["splits"]) == (448, 3)       # q_1, r_1 of §0x03B
    sp.check_coverage(b.kv_lens, b.starts, b.ends, b.active)


def test_capacity_tail_request_lengths_and_inactive_slots():
    b = sp.capacity(TAIL["splits"], TAIL["split_capacity"]).bounds(TAIL["T"])
    assert b.capacity == TAIL["split_capacity"]
    assert b.split_lengths(0) == TAIL["request0_split_lengths"]
    assert int((~b.active[0]).sum()) == TAIL["request0_inactive_slots"]
    assert b.split_lengths(1) == [0] * TAIL["splits"] and not b.nonempty[1].any()
    assert (b.lengths[~b.active] == 0).all()


def test_chunk_policy_final_chunk_is_shorter():
    b = sp.chunk(512).bounds(MAIN["T"])
    assert b.split_lengths(0) == [512] * 8
    assert b.split_lengths(1) == [512] * 7 + [3587 - 7 * 512]
    assert b.capacity == 8
    b = sp.chunk(1000).bounds([0, 2500])
    assert b.split_lengths() == [[], [1000, 1000, 500]] and b.capacity == 3
    assert b.num_splits is None


# ---------------------------------------------------------------- the heuristic
def reference_heuristic(G, n_sm, n_k, max_splits, f):
    """The fixture's sentence, literally (no float32, no early exit)."""
    cap = min(max_splits, n_sm, n_k)
    eligible = [s for s in range(1, cap + 1) if s == 1 or math.ceil(n_k / s) != math.ceil(n_k / (s - 1))]
    eff = {s: (G * s / n_sm) / math.ceil(G * s / n_sm) for s in eligible}
    best = max(eff.values(), default=0)
    return next((s for s in eligible if eff[s] >= f * best), 1)


def test_heuristic_text_is_what_is_implemented():
    assert "smallest s with eff(s) >= 0.85*max eff" in HEURISTIC_TEXT
    assert "skip s when ceil(N_K/s)==ceil(N_K/(s-1))" in HEURISTIC_TEXT


def test_heuristic_flashattention_comment_example():
    """FlashAttention's comment: B*H = 48 on 108 SMs -> 2 splits (eff 0.89), not 3 (0.67)."""
    table = {s: eff for s, ok, eff in sp.split_efficiencies(48, 108, 64)}
    assert round(table[2], 2) == 0.89 and round(table[3], 2) == 0.67
    assert sp.num_splits_heuristic(48, 108, 64) == 2


def test_heuristic_skips_splits_with_unchanged_blocks_per_split():
    table = {s: ok for s, ok, _ in sp.split_efficiencies(1, 264, 64)}
    assert table[11] and not table[12]              # 64 blocks: 11 and 12 splits both give 6 per split
    assert not any(s > 64 for s in table)           # capped by N_K


def test_heuristic_early_exit_and_caps():
    assert sp.num_splits_heuristic(212, 264, 64) == 1            # G >= 0.8 N_SM: already fills
    assert sp.num_splits_heuristic(212, 264, 64, fill_exit=None) >= 1
    assert sp.num_splits_heuristic(4, 264, 3) <= 3                # N_K caps s
    assert sp.num_splits_heuristic(4, 264, 1000, max_splits=5) <= 5
    assert sp.num_splits_heuristic(4, 264, 0) == 1                # nothing to split


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.integers(1, 300), st.integers(0, 300), st.integers(1, 128),
       st.sampled_from([0.5, 0.85, 0.9, 1.0]))
def test_heuristic_matches_the_literal_rule(G, n_sm, n_k, max_splits, f):
    got = sp.num_splits_heuristic(G, n_sm, n_k, max_splits, f, fill_exit=None)
    want = reference_heuristic(G, n_sm, n_k, max_splits, f)
    if got != want:   # only a float32 rounding tie may differ from exact arithmetic
        table = {s: e for s, _, e in sp.split_efficiencies(G, n_sm, n_k, max_splits)}
        best = max(table.values())
        assert abs(table[want] - f * best) < 1e-6 or abs(table[got] - f * best) < 1e-6


def test_heuristic_policy_uses_the_call_occupancy():
    occ = sp.Occupancy(num_sms=132, heads_q=MAIN["H_q"], heads_kv=MAIN["H_kv"], head_dim=MAIN["d"])
    G = len(MAIN["T"]) * MAIN["H_q"] * 1                       # B H_q ceil(1 / 64)
    n_k = -(-max(MAIN["T"]) // 128)                            # d = 128 -> block_n 128
    assert occ.producer_blocks(len(MAIN["T"])) == G and occ.kv_blocks(max(MAIN["T"])) == n_k
    S = sp.num_splits_heuristic(G, 264, n_k)
    b = sp.heuristic(0.85).bounds(MAIN["T"], occ)
    assert b.capacity == S and b.policy == f"heuristic(0.85) -> balanced({S})"
    packed = sp.Occupancy(num_sms=132, heads_q=8, heads_kv=2, head_dim=128, pack_gqa=True)
    assert packed.producer_blocks(2) == 2 * 2 * 1
    # auto is not FlashAttention's heuristic: it is the untuned launch rule (about 4 programs per SM,
    # one per (request, K/V head, split)), capped by the longest request's 64-row blocks
    rule = sp.auto_splits(MAIN["H_kv"], len(MAIN["T"]), max(MAIN["T"]), 132)
    assert rule == min(round(4 * 132 / (len(MAIN["T"]) * MAIN["H_kv"])), -(-max(MAIN["T"]) // 64), sp.MAX_SPLITS)
    a = sp.auto().bounds(MAIN["T"], occ)
    assert a.capacity == rule and a.policy == f"auto -> balanced({rule})"
    assert a.split_lengths() == sp.balanced(rule).bounds(MAIN["T"]).split_lengths()
    with pytest.raises(PlanError, match="needs the launch occupancy"):
        sp.heuristic(0.85).bounds(MAIN["T"])


def test_policies_from_ir():
    assert sp.from_ir(ir.Split(ir.SplitKind.BALANCED, {"splits": 8})) == sp.Balanced(8)
    assert sp.from_ir(ir.Split(ir.SplitKind.CAPACITY, {"capacity": 8, "splits": 5})) == sp.Capacity(5, 8)
    assert sp.from_ir(ir.Split(ir.SplitKind.CHUNK, {"size": 512})) == sp.Chunk(512)
    assert sp.from_ir(ir.Split(ir.SplitKind.HEURISTIC, {"fraction": 0.9})) == sp.Heuristic(0.9)
    assert isinstance(sp.from_ir(ir.Split()), sp.Auto)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("make,msg", [
    (lambda: sp.balanced(0), "splits = 0 must be at least 1"),
    (lambda: sp.chunk(0), "chunk = 0 must be at least 1"),
    (lambda: sp.capacity(0, 8), "splits = 0 must be at least 1"),
    (lambda: sp.capacity(5, 4), "split capacity 4 is smaller than the split count 5"),
    (lambda: sp.heuristic(0.0), r"heuristic fraction = 0.0 must be in \(0, 1\]"),
    (lambda: sp.balanced(2.5), "splits = 2.5 is not an integer"),
    (lambda: sp.balanced(2).bounds([4, -1]), r"kv_lens\[1\] = -1 is negative"),
    (lambda: sp.chunk(2, capacity=2).bounds([5]), "needs 3 chunks of 2, more than the capacity 2"),
])
def test_bad_policies_are_plan_errors(make, msg):
    with pytest.raises(PlanError, match=msg):
        make()


@pytest.mark.parametrize("ranges,msg", [
    ([[(0, 5), (4, 10)]], r"request 0: split 0 \[0, 5\) and split 1 \[4, 10\) overlap on positions \[4, 5\)"),
    ([[(0, 4), (6, 10)]], r"request 0: positions \[4, 6\) are covered by no split"),
    ([[(1, 10)]], r"request 0: positions \[0, 1\) are covered by no split"),
    ([[(0, 8)]], r"request 0: positions \[8, 10\) are covered by no split \(T = 10\)"),
    ([[(0, 12)]], r"request 0: split 0 reads positions \[10, 12\) past the request's length T = 10"),
])
def test_check_coverage_names_request_and_positions(ranges, msg):
    b = sp.SplitBounds.from_ranges([10], ranges)
    with pytest.raises(PlanError, match=msg):
        sp.check_coverage(b.kv_lens, b.starts, b.ends, b.active)


# ---------------------------------------------------------------- properties
policies = st.one_of(
    st.integers(1, 12).map(sp.balanced),
    st.integers(1, 50).map(sp.chunk),
    st.tuples(st.integers(1, 8), st.integers(0, 6)).map(lambda t: sp.capacity(t[0], t[0] + t[1])),
    st.sampled_from([0.5, 0.85, 1.0]).map(sp.heuristic),
)
occupancies = st.builds(sp.Occupancy, num_sms=st.integers(1, 200), heads_q=st.integers(1, 16),
                        head_dim=st.sampled_from([64, 128, 256]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=8), policies, occupancies)
def test_split_bounds_cover_each_request_exactly_and_disjointly(T, policy, occ):
    b = sp.split_bounds(policy, T, occ)
    sp.check_coverage(b.kv_lens, b.starts, b.ends, b.active)
    for r, n in enumerate(T):
        covered = np.zeros(n, int)
        for a, e in b.ranges(r):
            assert 0 <= a <= e <= n
            covered[a:e] += 1
        assert (covered == 1).all()
        lens = b.split_lengths(r)
        assert sum(lens) == n
        if isinstance(policy, (sp.Balanced, sp.Capacity, sp.Heuristic)) and lens:
            assert max(lens) - min(lens) <= 1 and lens == sorted(lens, reverse=True)
        if isinstance(policy, sp.Chunk):
            assert all(x == policy.size for x in lens[:-1]) and (not lens or 0 < lens[-1] <= policy.size)
    assert (b.lengths[~b.active] == 0).all()


def test_every_declared_split_kind_is_a_policy_with_the_declared_parameter_names():
    """compiler/policies.py declares each split kind's parameters once; from_ir builds the policy
    from them by name, so a policy's fields are the table's names, in its order."""
    import dataclasses
    from attnc.compiler.policies import POLICIES
    assert set(sp.POLICY_CLASSES) == set(POLICIES["split"])
    for kind, params in POLICIES["split"].items():
        fields = [f.name for f in dataclasses.fields(sp.POLICY_CLASSES[kind])]
        assert fields[:len(params)] == [p.name for p in params], kind
    assert sp.from_ir(ir.Split(ir.SplitKind.CHUNK, {"size": 64})).size == 64


def test_the_ir_keeps_policy_arguments_by_name():
    """ir.Split keeps its arguments as a mapping by the table's names (its order, defaults filled
    in, hashable like every IR node); ir.Cache and ir.SharedShift have a field per declared name."""
    import dataclasses
    from attnc.compiler import policies
    s = ir.Split(ir.SplitKind.CAPACITY, {"capacity": 8, "splits": 5})
    assert list(s.params) == ["splits", "capacity"] and s.params == {"splits": 5, "capacity": 8}
    assert hash(s) == hash(ir.Split("capacity", {"splits": 5, "capacity": 8})) and s.kind is ir.SplitKind.CAPACITY
    assert repr(s.params) == "{'splits': 5, 'capacity': 8}"
    with pytest.raises(ValueError, match="has no parameter 'slots'"):
        ir.Split(ir.SplitKind.BALANCED, {"slots": 4})
    with pytest.raises(ValueError, match="needs 'capacity'"):
        ir.Split(ir.SplitKind.CAPACITY, {"splits": 4})
    cache_fields = {f.name for f in dataclasses.fields(ir.Cache)}
    for kind, params in policies.POLICIES["cache"].items():
        assert {p.name for p in params} <= cache_fields, kind
    shift = ir.SharedShift(phi=1.0, lower=-2.0, upper=3.0)
    assert [f.name for f in dataclasses.fields(ir.SharedShift)] == list(shift.params) == ["phi", "lower", "upper"]
    assert policies.text("capacity", s.params) == "capacity(5, 8)" and policies.text("auto", {}) == "auto"
