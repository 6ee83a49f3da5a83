"""The numpy split program (templates/numpy/decode_split.py.j2) over every K/V cache layout x
split policy x state ABI x {MHA, GQA} against the float64 oracle on each request's gathered
logical K/V; NaN-poisoned storage past every request's length; requests of length 0; mixed
prefill/append/decode batches; and the PlanErrors / InputErrors raised before any arithmetic.

The policy for empty requests: a request with ``q_len = 0`` produces no output rows (it may
have any ``kv_len``); a query row is a token whose own key is in the cache (bottom-right
positions, ``kv_len >= q_len``), except that a request with no keys at all may have rows (a
decode step over an empty context, M4.5 §0x03G): they see nothing, O = 0 and LSE = -inf.
"""
import hashlib
from functools import lru_cache

import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.backends.numpy import runtime
from attnc.compiler import inputs, numerics
from attnc.compiler.analysis import layout as lay
from attnc.compiler.analysis import splits as sp
from attnc.compiler.errors import InputError, PlanError, SpecError
from attnc.compiler.lower import compile_spec
from attnc.compiler.plan import plan_split, split_occupancy

LAYOUTS = {
    "contiguous_bhsd": "contiguous(layout = bhsd)",
    "contiguous_bshd": "contiguous(layout = bshd)",
    "ragged": "ragged",
    "paged_dense_nhd": "paged(page_size = 8, layout = nhd, table = dense)",
    "paged_dense_hnd": "paged(page_size = 8, layout = hnd, table = dense)",
    "paged_csr_nhd": "paged(page_size = 8, layout = nhd, table = csr)",
    "paged_csr_hnd": "paged(page_size = 8, layout = hnd, table = csr)",
}
POLICIES = {"balanced": "balanced(3)", "chunk": "chunk(16)", "capacity": "capacity(3, 5)",
            "heuristic": "heuristic(0.85)", "auto": "auto"}
ABIS = ("lse_o", "mlu")
HEADS = {"mha": (4, 4), "gqa": (8, 2)}
WINDOW = "causal & q - k < 40"   # early splits of long requests see nothing: invalid states
DOC = "causal & doc[b, q] == doc[b, k]"

# lengths: an idle request (0, 0), one shorter than a page, multiples of the page size and not
KV_LENS = [45, 0, 70, 17, 8, 2]
DECODE = [1, 0, 1, 1, 1, 1]


@lru_cache(maxsize=None)
def program(cache="ragged", split="balanced(3)", state="lse_o", heads=(4, 4), mask=WINDOW, dtype="bf16",
            head_dim=16):
    tensor = "tensor doc: i32[b, s] ~ segments(4, 12)\n" if "doc" in mask else ""
    name = "split_" + hashlib.sha256(repr((cache, split, state, heads, mask, dtype)).encode()).hexdigest()[:8]
    return compile_spec(f"""attention {name} {{
        heads = {heads[0]} / {heads[1]}
        head_dim = {head_dim}
        dtype = {dtype}
        {tensor}score = softcap(score, 20.0)
        mask = {mask}
        cache = {cache}
        split = {split}
        state = {state}
    }}""")


@lru_cache(maxsize=None)
def kernel(p):
    return runtime.load(p)


def occupancy_for(p, q_lens):
    """A small device (64 SMs, 16-row K/V blocks) so heuristic/auto split these short requests."""
    return split_occupancy(p, q_lens, num_sms=64, block_n=16)


def check(p, arrays, **kw):
    """Run the split program and compare with the oracle; returns (o, lse, stats, plan)."""
    k = kernel(p)
    call = inputs.validate_cache(p, arrays)
    plan = k.plan_split(arrays, occupancy=occupancy_for(p, call.q_lens), **kw)
    stats = {}
    o, lse = k.run(arrays, plan=plan, return_lse=True, stats=stats)
    assert o.shape == (call.q.shape[0], p.heads_q, p.d_v) and lse.shape == o.shape[:2]
    assert np.isfinite(o).all(), "a NaN-poisoned row was read"
    ref_o, ref_lse = oracle.reference_cache(p, call)
    co, cl = numerics.compare_outputs(p.dtype, o, lse, ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    assert (o[np.isneginf(ref_lse)] == 0).all()          # the all-masked policy
    return o, lse, stats, plan


def sample(p, kv_lens, q_lens, seed=0, **kw):
    return inputs.sample_cache(p, kv_lens, q_lens, seed, cache_rows=len(kv_lens) + 2, **kw)


# ---------------------------------------------------------------- the cross product (decode)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("abi", ABIS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", LAYOUTS)
def test_decode_matches_oracle(cache, policy, abi, heads):
    p = program(LAYOUTS[cache], POLICIES[policy], abi, HEADS[heads])
    arrays = sample(p, KV_LENS, DECODE, seed=len(cache) + len(policy))
    o, lse, stats, plan = check(p, arrays)
    assert o.shape[0] == sum(DECODE)                    # the idle request has no output row
    if policy in ("heuristic", "auto"):
        assert plan.capacity > 1, "the heuristic should split on this device"
    if policy == "capacity":
        assert stats["identity_writes"] > 0              # inactive capacity slots get the identity
    assert stats["invalid_states"] > 0                   # window-masked or empty splits
    if cache.startswith("paged"):
        for b, s in zip(*np.nonzero(plan.bounds.nonempty)):
            slot = b * plan.capacity + s
            segs = list(zip(*(x[plan.seg_ptr[slot]:plan.seg_ptr[slot + 1]].tolist()
                              for x in (plan.seg_block, plan.seg_offset, plan.seg_count))))
            assert segs == [tuple(g) for g in lay.page_segments(plan.layout, b, plan.bounds.starts[b, s],
                                                                plan.bounds.ends[b, s])]


# ---------------------------------------------------------------- appends and mixed batches
MIXED = {  # (T, C) per request: prefill, append, decode, idle, a prefill shorter than a page
    "kv_lens": [20, 36, 42, 10, 5],
    "q_lens": [20, 6, 1, 0, 5],
}


@pytest.mark.parametrize("mask", [WINDOW, DOC], ids=["causal_window", "causal_document"])
@pytest.mark.parametrize("abi", ABIS)
@pytest.mark.parametrize("cache", LAYOUTS)
def test_mixed_batch_matches_oracle(cache, abi, mask):
    heads = HEADS["gqa"] if abi == "lse_o" else HEADS["mha"]
    p = program(LAYOUTS[cache], "balanced(3)", abi, heads, mask)
    arrays = sample(p, MIXED["kv_lens"], MIXED["q_lens"], seed=3)
    o, lse, stats, plan = check(p, arrays)
    assert list(plan.manifest.phases) == ["prefill", "append", "decode", "idle", "prefill"]
    assert plan.qo_indptr.tolist() == [0, 20, 26, 27, 27, 32]
    if mask == DOC:
        assert stats["segments_skipped"] > 0            # other documents' segments are never loaded


@pytest.mark.parametrize("cache", ["paged_csr_hnd", "ragged", "contiguous_bshd"])
def test_qo_indptr_and_q_lens_scatter_rows_to_their_requests(cache):
    p = program(LAYOUTS[cache], "chunk(16)", "mlu", HEADS["gqa"], "causal")
    arrays = sample(p, MIXED["kv_lens"], MIXED["q_lens"], seed=4)
    o, lse, _, _ = check(p, arrays)
    by_ptr = dict(arrays, qo_indptr=np.concatenate([[0], np.cumsum(MIXED["q_lens"])]))
    del by_ptr["q_lens"]
    np.testing.assert_array_equal(kernel(p).run(by_ptr), o)
    # request 1's rows are rows 20:26, whatever the other requests hold
    call = inputs.validate_cache(p, arrays)
    k1, v1 = call.kv(1)
    ref1, _ = oracle.reference_request(p, 1, call.q_rows(1), k1, v1)
    assert numerics.compare("O", o[20:26], ref1, *numerics.O_TOLERANCE["bf16"]).ok


def test_positional_call_api():
    p = program(LAYOUTS["paged_dense_nhd"], "balanced(2)", "lse_o", HEADS["gqa"], "causal")
    a = sample(p, [30, 9], [4, 1], seed=5)
    o = kernel(p)(a["q"], a["k_cache"], a["v_cache"], block_table=a["block_table"], kv_lens=a["kv_lens"],
                  q_lens=a["q_lens"])
    np.testing.assert_array_equal(o, kernel(p).run(a))
    p = program(LAYOUTS["ragged"], "balanced(2)", "lse_o", HEADS["gqa"], "causal")
    a = sample(p, [30, 9], None, seed=5)               # default q_lens: one row per request
    o, lse = kernel(p)(a["q"], a["k"], a["v"], kv_indptr=a["kv_indptr"], return_lse=True)
    assert o.shape == (2, 8, 16) and lse.shape == (2, 8)


@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("abi", ABIS)
def test_storage_dtypes(dtype, abi):
    p = program(LAYOUTS["paged_csr_nhd"], "capacity(3, 4)", abi, HEADS["gqa"], WINDOW, dtype)
    o, _, _, _ = check(p, sample(p, MIXED["kv_lens"], MIXED["q_lens"], seed=6))
    assert o.dtype == (np.float16 if dtype == "f16" else np.float32)


def test_contiguous_spec_with_a_cache_batch_idx():
    """Active request b lives in cache row cache_batch_idx[b]; spare rows are NaN."""
    p = program(LAYOUTS["contiguous_bhsd"], "balanced(2)", "lse_o", HEADS["mha"], "causal")
    a = inputs.sample_cache(p, [12, 30, 7], [2, 1, 7], 8, cache_rows=6)
    assert a["k"].shape[0] == 6 and len(set(a["cache_batch_idx"].tolist())) == 3
    check(p, a)


# ---------------------------------------------------------------- reading only what is visible
def test_gqa_reads_each_kv_row_once_per_group():
    p = program(LAYOUTS["paged_csr_nhd"], "balanced(3)", "mlu", HEADS["gqa"], "true")
    _, _, stats, plan = check(p, sample(p, KV_LENS, DECODE, seed=9))
    assert stats["kv_rows_read"] == sum(KV_LENS) * 2      # each visible row once per K/V head
    assert stats["producers"] == int(plan.bounds.nonempty.sum()) * 2


def test_unwritten_workspace_slots_would_poison_the_output(monkeypatch):
    """The workspace starts as NaN with validity 0xFF: skipping the identity writes of the
    capacity slots the reducer consumes turns into NaN, so the tests above see every write."""
    p = program(LAYOUTS["ragged"], "capacity(2, 4)", "mlu", HEADS["mha"], "causal")
    k = kernel(p)
    a = sample(p, [9, 4], [1, 1], seed=10)
    assert np.isfinite(k.run(a)).all()
    monkeypatch.setattr(k.split_module, "_write_identity", lambda *args: None)
    with pytest.raises(PlanError, match="NaN"):  # a NaN row is reported (the non-finite-score policy)
        k.run(a)


def test_masked_rows_give_zero_and_minus_inf():
    p = program(LAYOUTS["paged_dense_hnd"], "balanced(2)", "lse_o", HEADS["gqa"], "causal & q >= 12")
    o, lse, _, _ = check(p, sample(p, [20, 9], [10, 1], seed=11))
    assert np.isneginf(lse[:2]).all() and (o[:2] == 0).all()   # rows at q = 10, 11 see nothing
    assert np.isneginf(lse[10]).all()                           # request 1's row at q = 8


# ---------------------------------------------------------------- empty requests
def test_requests_without_query_rows_produce_nothing():
    p = program(LAYOUTS["paged_csr_nhd"], "balanced(3)", "lse_o", HEADS["mha"], "causal")
    o, lse, stats, _ = check(p, sample(p, [0, 25, 0, 3], [0, 0, 0, 2], seed=12))
    assert o.shape == (2, 4, 16)
    assert stats["kv_rows_read"] == 3 * 4                 # request 1's 25 rows are never read


def test_more_query_rows_than_keys_is_an_input_error_unless_there_are_no_keys():
    p = program(LAYOUTS["paged_csr_nhd"])
    a = sample(p, [5, 2], [1, 2])
    a["q_lens"] = np.array([0, 3], np.int32)
    with pytest.raises(InputError, match=r"request 1 has q_lens\[1\] = 3 query rows but only kv_len = 2"):
        kernel(p).run(a)
    # no keys at all (M4.5 §0x03G's capacity tail): the rows see nothing, O = 0 and LSE = -inf
    o, lse, stats, plan = check(p, sample(p, [5, 0], [1, 2]))
    assert (o[1:] == 0).all() and np.isneginf(lse[1:]).all() and np.isfinite(lse[0]).all()
    assert list(plan.manifest.phases) == ["decode", "empty"]


# ---------------------------------------------------------------- plans
def test_a_plan_for_other_inputs_is_refused():
    p = program(LAYOUTS["paged_dense_nhd"])
    k = kernel(p)
    a, b = sample(p, [20, 9], [1, 1], seed=1), sample(p, [20, 10], [1, 1], seed=1)
    plan = k.plan_split(a)
    np.testing.assert_array_equal(k.run(a, plan=plan), k.run(a))
    with pytest.raises(PlanError, match="plan was made for another kv_lens"):
        k.run(b, plan=plan)
    b["block_table"] = a["block_table"].copy()
    b["kv_lens"], b["block_table"][0, 0] = a["kv_lens"], (a["block_table"][0, 0] + 1) % 5
    with pytest.raises(PlanError, match="plan was made for another block_table"):
        k.run(b, plan=plan)


def test_plan_schedule_matches_the_program():
    p = program(LAYOUTS["paged_csr_hnd"], "capacity(3, 5)", "mlu", HEADS["gqa"], "true")
    a = sample(p, KV_LENS, DECODE, seed=2)
    call = inputs.validate_cache(p, a)
    plan = plan_split(p, call.layout, call.q_lens)
    ws = plan.kernel_args()["workspace"]
    assert list(ws) == ["partial_u", "partial_m", "partial_l", "partial_valid"]
    assert ws["partial_u"] == ((6, 8, 5, 16), "f32") and ws["partial_valid"][1] == "u8"
    _, _, stats, _ = check(p, a)
    own = plan.report()["owners"]
    # every consumed empty slot of a request with a query row is one identity write per K/V head
    empty = (~plan.bounds.nonempty & (call.q_lens[:, None] > 0)).sum()
    assert stats["identity_writes"] == empty * 2
    assert stats["merges"] == own["nonempty_binary_merges"]


# ---------------------------------------------------------------- contract breaks
def layout_case(cache, kv_lens=(20, 9), q_lens=(1, 1), **kw):
    p = program(LAYOUTS[cache])
    return p, sample(p, list(kv_lens), list(q_lens), seed=13, **kw)


def replace_rows(**keys):
    """Name the query rows by other keys than the sampled q_lens."""
    def f(a):
        a.pop("q_lens")
        a.update(keys)
    return f


def _breaks():
    def set_(key, index, value):
        def f(a):
            a[key] = a[key].copy()
            a[key][index] = value
        return f
    return [
        ("page_id_outside_pool_dense", "paged_dense_nhd", set_("block_table", (0, 1), 99),
         r"block_table\[0, 1\] = 99 is outside the page pool \[0, 8\)"),
        ("page_id_outside_pool_csr", "paged_csr_hnd", set_("kv_indices", 2, -1),
         r"kv_indices\[2\] = -1 is outside the page pool \[0, 8\)"),
        ("last_page_len_0", "paged_csr_nhd", set_("kv_last_page_len", 1, 0),
         r"kv_last_page_len\[1\] = 0 is outside \[1, page_size = 8\]"),
        ("last_page_len_past_page", "paged_csr_nhd", set_("kv_last_page_len", 0, 9),
         r"kv_last_page_len\[0\] = 9 is outside \[1, page_size = 8\]"),
        ("csr_indptr_not_monotone", "paged_csr_nhd", set_("kv_indptr", 1, 6),
         r"kv_indptr is not monotone: kv_indptr\[2\] = 5 < kv_indptr\[1\] = 6"),
        ("ragged_indptr_not_monotone", "ragged", set_("kv_indptr", 1, 30),
         r"kv_indptr is not monotone: kv_indptr\[2\] = 29 < kv_indptr\[1\] = 30"),
        ("request_longer_than_its_table", "paged_dense_nhd", set_("kv_lens", 1, 33),
         r"kv_lens\[1\] = 33 exceeds its block_table row \(cache row 1\): 4 pages x page_size 8 = 32 rows"),
        ("request_longer_than_contiguous_capacity", "contiguous_bshd", set_("kv_lens", 0, 24),
         r"kv_lens\[0\] = 24 exceeds the cache's token capacity T_c = 23"),
        ("cache_batch_idx_duplicate", "paged_dense_hnd", lambda a: a.update(cache_batch_idx=np.array([1, 1])),
         r"cache_batch_idx\[1\] = 1 duplicates cache_batch_idx\[0\]"),
        ("cache_batch_idx_out_of_range", "contiguous_bhsd", lambda a: a.update(cache_batch_idx=np.array([0, 5])),
         r"cache_batch_idx\[1\] = 5 is outside the cache rows \[0, 4\)"),
        ("qo_indptr_not_monotone", "ragged", replace_rows(qo_indptr=np.array([0, 2, 1])),
         r"qo_indptr is not monotone: qo_indptr\[2\] = 1 < qo_indptr\[1\] = 2"),
    ]


@pytest.mark.parametrize("cache, mutate, message", [pytest.param(*case[1:], id=case[0]) for case in _breaks()])
def test_contract_breaks_are_plan_errors_before_any_arithmetic(cache, mutate, message, monkeypatch):
    p, a = layout_case(cache)
    k = kernel(p)
    mutate(a)
    monkeypatch.setattr(k.split_module, "attention", lambda *args, **kw: pytest.fail("ran the program"))
    with pytest.raises(PlanError, match=message):
        k.run(a)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.pop("kv_indices"), "missing key 'kv_indices' for a paged nhd cache"),
    (lambda a: a.update(block_table=np.zeros((2, 2), np.int32)), "unknown key 'block_table'"),
    (lambda a: a.update(q=a["q"][None]), r"'q' has shape \[1, 2, 4, 16\]; a split call packs its query rows"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :8]), r"'k_cache' has shape \[8, 8, 4, 8\]; expected "
                                                        r"\[pages, page_size=8, H_kv=4, d_qk=16\]"),
    (lambda a: a.update(v_cache=a["v_cache"].astype(np.int32)), "'v_cache' has dtype int32"),
    (lambda a: a.update(q_lens=np.array([2, 1])), "'q' has 2 packed rows but q_lens sums to 3"),
    (replace_rows(q=np.zeros((4, 4, 16), np.float32)),
     "'q' has 4 packed rows for B = 2 requests; give 'q_lens' or 'qo_indptr'"),
])
def test_malformed_inputs_are_input_errors(mutate, message):
    p, a = layout_case("paged_csr_nhd")
    mutate(a)
    with pytest.raises(InputError, match=message):
        kernel(p).run(a)


def test_split_counts_below_one_are_rejected():
    for make, text in ((lambda: sp.balanced(0), "splits = 0 must be at least 1"),
                       (lambda: sp.chunk(0), "chunk = 0 must be at least 1"),
                       (lambda: sp.capacity(0, 3), "splits = 0 must be at least 1"),
                       (lambda: sp.Heuristic(0.85).choose([5], split_occupancy(program(), [1], num_sms=0)),
                        "num_sms = 0 must be at least 1")):
        with pytest.raises(PlanError, match=text):
            make()
    with pytest.raises(SpecError, match="must be at least 1, got 0"):
        compile_spec("attention s { heads = 2 head_dim = 8 split = balanced(0) }")
