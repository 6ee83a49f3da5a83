"""compiler.analysis.phases reproduces the `phase` fixture (M4.5 §0x08C, §0x08E, §0x08F), and
its closed forms agree with brute-force counting and with the dense mask reference."""
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attnc.compiler import oracle
from attnc.compiler.analysis.phases import (
    PHASES, Ledger, Manifest, Request, causal_ledger, causal_masked_cells, causal_visible_cells,
    phase_of, rect_cells, visible_cells,
)
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_spec
from tests.conftest import seed_contracts

# shared/fixtures/seed_contracts.json (/work/shared beside the checkout, i.e.
# Path(__file__).resolve().parents[3] / "shared"), else the vendored copy kept identical to it
FIXTURE = seed_contracts()["phase"]
CASES = [c for c in FIXTURE["cases"] if c["name"] != "training"]
TRAINING = next(c for c in FIXTURE["cases"] if c["name"] == "training")
MIXED = FIXTURE["mixed_batch"]

CAUSAL = compile_spec("attention c { heads = 4 / 2 head_dim = 8 dtype = f32 mask = causal }")
DOCUMENT = compile_spec("attention d { heads = 2 head_dim = 8 dtype = f32 tensor doc: i32[b, s] "
                        "mask = causal & doc[b, q] == doc[b, k] }")
EVICTION = compile_spec("attention e { heads = 3 head_dim = 8 dtype = f32 tensor evict: i32[b, h, s] "
                        "mask = causal & q < evict[b, h, k] }")

requests = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=7)
small_requests = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5)


def brute(T: int, C: int) -> np.ndarray:
    """The bottom-right causal visibility of one request, materialized: bool [C, T + C]."""
    q = T + np.arange(C)[:, None]
    k = np.arange(T + C)[None, :]
    return k <= q


# ---------------------------------------------------------------- the fixture, exactly
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_phase_cases_match_the_fixture(case):
    T, C = case["T"], case["C"]
    assert phase_of(T, C) == case["name"]
    assert (rect_cells(T, C), causal_visible_cells(T, C), causal_masked_cells(T, C)) == \
        (case["rect"], case["visible"], case["masked"])
    m = Manifest.from_requests([Request(T, C)])
    totals = causal_ledger(m).totals()
    for key in ("rect", "visible", "masked"):
        assert totals[key] == case[key]
    assert m.post_commit.tolist() == [case["post"]]
    assert m.q_offset.tolist() == [T]


def test_training_is_prefill_visibility_over_s_by_s():
    S = TRAINING["S"]
    r = Request.training(S)
    assert (r.T, r.C) == (0, S)
    ledger = causal_ledger(Manifest.from_requests([r]))
    assert ledger.rect.tolist() == [S * S] == [TRAINING["rect"]]
    assert ledger.visible.tolist() == [TRAINING["visible"]]
    assert ledger.masked.tolist() == [TRAINING["masked"]]
    assert phase_of(r.T, r.C) == "prefill"  # same visibility; training's owned state is not in (T, C)


def test_mixed_batch_matches_the_fixture():
    m = Manifest.from_requests(MIXED["requests"])
    ledger = causal_ledger(m)
    totals = ledger.totals()
    assert m.qo_indptr.tolist() == MIXED["qo_indptr"]
    assert totals["visible"] == MIXED["visible"]
    assert totals["rect"] == MIXED["rect"]
    assert totals["padded_envelope"] == m.padded_envelope == MIXED["padded_envelope"]
    assert totals["cells_beyond_request_rectangles"] == MIXED["cells_beyond_request_rectangles"]
    assert ledger.cells_beyond_request_rectangles == MIXED["cells_beyond_request_rectangles"]
    assert m.rows_appended == MIXED["rows_appended"]
    # §0x08F's per-request table: phases, visible / rectangle, cache length transitions
    assert m.phases == ("prefill", "append", "decode")
    assert ledger.visible.tolist() == [10, 15, 10] and ledger.rect.tolist() == [16, 16, 10]
    assert m.T.tolist() == [0, 6, 9] and m.post_commit.tolist() == [4, 8, 10]
    # the envelope is B x max C x max (T + C), not a constant
    assert MIXED["padded_envelope"] == len(MIXED["requests"]) * max(c for _, c in MIXED["requests"]) \
        * max(t + c for t, c in MIXED["requests"])


def test_runtime_lengths_give_the_same_manifest():
    m = Manifest.from_requests(MIXED["requests"])
    r = Manifest.from_lens(kv_lens=m.kv_lens, q_lens=m.q_lens)
    assert r.T.tolist() == m.T.tolist() and r.C.tolist() == m.C.tolist()
    assert r.kv_indptr.tolist() == [0, 4, 12, 22]
    assert r.qo_indptr.dtype == r.kv_indptr.dtype == np.int64


# ---------------------------------------------------------------- phases and errors
@pytest.mark.parametrize("T, C, phase", [
    (0, 1, "prefill"), (0, 7, "prefill"), (3, 2, "append"), (3, 1, "decode"), (0, 0, "idle"), (9, 0, "idle"),
])
def test_phase_of(T, C, phase):
    assert phase_of(T, C) == phase and phase in PHASES


def test_idle_request_keeps_its_slot_and_counts_nothing():
    m = Manifest.from_lens(kv_lens=[5, 3, 4], q_lens=[1, 0, 4])
    assert m.phases == ("decode", "idle", "prefill")
    assert m.qo_indptr.tolist() == [0, 1, 1, 5]
    ledger = causal_ledger(m)
    assert ledger.rect.tolist()[1] == ledger.visible.tolist()[1] == 0
    assert visible_cells(CAUSAL, m).tolist()[1] == [0] * CAUSAL.heads_q


def test_a_request_with_no_keys_may_have_rows_that_see_nothing():
    """M4.5 §0x03G's capacity tail: a decode step over an empty context (T = -C marks it)."""
    m = Manifest.from_lens(kv_lens=[5, 0, 0], q_lens=[1, 2, 0])
    assert m.phases == ("decode", "empty", "idle") and "empty" in PHASES
    assert m.T.tolist() == [4, -2, 0] and m.kv_lens.tolist() == [5, 0, 0]
    assert m.qo_indptr.tolist() == [0, 1, 3, 3]
    ledger = causal_ledger(m)
    assert ledger.rect.tolist() == [5, 0, 0] and ledger.visible.tolist() == [5, 0, 0]
    assert ledger.masked.tolist() == [0, 0, 0]
    assert visible_cells(CAUSAL, m)[:, 0].tolist() == [5, 0, 0]
    assert Manifest([-1], [1]).phases == ("empty",)


def test_empty_batch():
    m = Manifest([], [])
    assert len(m) == 0 and m.qo_indptr.tolist() == m.kv_indptr.tolist() == [0]
    assert causal_ledger(m).totals() == dict.fromkeys(
        ["rect", "visible", "masked", "padded_envelope", "cells_beyond_request_rectangles"], 0)
    assert visible_cells(CAUSAL, m).shape == (0, CAUSAL.heads_q)


@pytest.mark.parametrize("make, message", [
    (lambda: Request(-1, 2), "T = -1 is negative"),
    (lambda: Request(2, -3), "C = -3 is negative"),
    (lambda: Request(2.5, 1), "T = 2.5 is not an integer"),
    (lambda: phase_of(4, -1), "C = -1 is negative"),
    (lambda: Manifest.from_lens(kv_lens=[4, 8, 10], q_lens=[4, 2, -1]), "q_lens[2] = -1 is negative"),
    (lambda: Manifest.from_lens(kv_lens=[4, -8], q_lens=[4, 2]), "kv_lens[1] = -8 is negative"),
    (lambda: Manifest.from_lens(kv_lens=[4, 2], q_lens=[4, 3]), "kv_lens[1] = 2 is less than q_lens[1] = 3"),
    (lambda: Manifest.from_lens(kv_lens=[4, 2], q_lens=[4]), "kv_lens has 2 entries but q_lens has 1"),
    (lambda: Manifest.from_lens(kv_lens=[4.0], q_lens=[1]), "kv_lens must be a 1-D integer array"),
    (lambda: Manifest.from_requests([(0, 4), (-2, 1)]), "T[1] = -2 is negative"),
    (lambda: Manifest([1, 2], [1]), "T has 2 entries but C has 1"),
    (lambda: Manifest([-2], [1]), "T[0] = -2 is negative"),  # only T = -C (no keys) is below 0
])
def test_bad_lengths_are_plan_errors_naming_argument_index_and_value(make, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        make()


def test_manifest_is_immutable():
    m = Manifest.from_requests(MIXED["requests"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.T = np.zeros(3, np.int64)
    with pytest.raises(ValueError):
        m.C[0] = 99


def test_closed_forms_never_materialize_the_rectangle():
    m = Manifest([10**12, 0], [10**6, 10**6])
    totals = causal_ledger(m).totals()
    assert totals["masked"] == 2 * (10**6 * (10**6 - 1) // 2)
    assert totals["padded_envelope"] == 2 * 10**6 * (10**12 + 10**6)


# ---------------------------------------------------------------- properties
@settings(max_examples=200, deadline=None)
@given(requests)
def test_closed_forms_equal_brute_force_counting(reqs):
    m = Manifest.from_requests(reqs)
    ledger = causal_ledger(m)
    for b, (T, C) in enumerate(reqs):
        dense = brute(T, C)
        assert ledger.rect[b] == dense.size
        assert ledger.visible[b] == dense.sum()
        assert ledger.masked[b] == (~dense).sum() == causal_masked_cells(T, C)
    # the padded envelope: every request padded to max C rows by max (T + C) columns
    rows, cols = max([c for _, c in reqs], default=0), max([t + c for t, c in reqs], default=0)
    inside = np.zeros((len(reqs), rows, cols), bool)
    for b, (T, C) in enumerate(reqs):
        inside[b, :C, :T + C] = True
    assert ledger.padded_envelope == inside.size
    assert ledger.cells_beyond_request_rectangles == (~inside).sum()


@settings(max_examples=200, deadline=None)
@given(requests)
def test_indptrs_are_monotone_prefix_sums(reqs):
    m = Manifest.from_requests(reqs)
    qo, kv = m.qo_indptr, m.kv_indptr
    assert qo.dtype == kv.dtype == np.int64 and qo.shape == kv.shape == (len(reqs) + 1,)
    assert qo[0] == kv[0] == 0
    assert (np.diff(qo) >= 0).all() and (np.diff(kv) >= 0).all()
    assert qo[-1] == m.rows_appended == sum(c for _, c in reqs)
    assert np.diff(qo).tolist() == [c for _, c in reqs]
    assert np.diff(kv).tolist() == [t + c for t, c in reqs]
    assert m.phases == tuple(phase_of(t, c) for t, c in reqs)


@settings(max_examples=100, deadline=None)
@given(small_requests)
def test_causal_mask_program_equals_the_closed_form(reqs):
    m = Manifest.from_requests(reqs)
    counts = visible_cells(CAUSAL, m, {})
    assert counts.shape == (len(reqs), CAUSAL.heads_q)
    assert (counts == causal_visible_cells(m.T, m.C)[:, None]).all()
    assert Ledger.of(m, counts[:, 0]).totals() == causal_ledger(m).totals()


@settings(max_examples=60, deadline=None)
@given(small_requests, st.integers(0, 2**32 - 1))
def test_mask_program_reads_each_request_row_like_the_oracle(reqs, seed):
    m = Manifest.from_requests(reqs)
    rng = np.random.default_rng(seed)
    width = max(1, int(m.post_commit.max()))
    tensors = {"doc": np.cumsum(rng.integers(0, 2, size=(len(reqs), width)), axis=1),
               "evict": rng.integers(0, width + 2, size=(len(reqs), EVICTION.heads_q, width))}
    for program in (DOCUMENT, EVICTION):
        counts = visible_cells(program, m, tensors)
        for b, (T, C) in enumerate(reqs):
            q, k = T + np.arange(C)[:, None], np.arange(T + C)[None, :]
            if program is DOCUMENT:
                want = [((k <= q) & (tensors["doc"][b, q] == tensors["doc"][b, k])).sum()] * program.heads_q
            else:
                want = [((k <= q) & (q < tensors["evict"][b, h, k])).sum() for h in range(program.heads_q)]
            assert counts[b].tolist() == want
            dense = oracle.dense_mask(program, len(reqs), C, T + C, tensors)[b]  # the oracle, row b
            assert counts[b].tolist() == dense.sum(axis=(1, 2)).tolist()
