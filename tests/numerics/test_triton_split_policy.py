"""The seeds' split contracts on the Triton split path (issue 18; CPU interpreter unless
ATTNC_TEST_GPU=1):

* the spec's ``split =`` policy is what the GPU runs: the Triton plan's slots and per-request
  bounds are ``attnc plan``'s (balanced, chunk, capacity, heuristic), each slot reads exactly its
  keys, and the answer is the oracle's and the numpy backend's; ``auto`` keeps the fast route;
* the workspace the Triton launch allocates is the ledger's (the (LSE, O) partial O in the
  storage dtype): the seed's 33,408 / 66,688 bytes for the split_launch fixture;
* the capacity-tail fixture (T = [3, 0], S = 5, S_cap = 8) on the kernel: 64 states written,
  52 of them identities the combine passes over, and the empty request's row gives O = 0,
  LSE = -inf;
* the combine merges more slots than one pass holds, and a CUDA graph replays a policy's plan.
"""
import hashlib
from functools import lru_cache

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.numpy import runtime as numpy_runtime  # noqa: E402
from attnc.backends.triton import decode as D  # noqa: E402
from attnc.backends.triton import launch as L  # noqa: E402
from attnc.backends.triton import runtime, workspace  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from attnc.compiler.plan import logical_layout, plan_split  # noqa: E402
from tests.conftest import seed_contracts  # noqa: E402

FIX = seed_contracts()["split_launch"]
MAIN, TAIL = FIX["ragged_balanced"], FIX["capacity_tail"]
BN = 8 if runtime.interpreted() else runtime.GPU_MIN_TILE
PAGED = "paged(page_size = 8, layout = nhd, table = csr)"


@lru_cache(maxsize=None)
def program(split="auto", heads="4 / 2", head_dim=16, dtype="f16", cache=PAGED, state="lse_o",
            mask="causal & q - k < 40"):
    name = "policy_" + hashlib.sha256(repr((split, heads, head_dim, dtype, cache, state, mask)).encode()).hexdigest()[:8]
    return compile_spec(f"attention {name} {{ heads = {heads} head_dim = {head_dim} dtype = {dtype} mask = {mask} "
                        f"cache = {cache} split = {split} state = {state} }}")


def shape_only(p, kv_lens):
    """A paged call's metadata with stand-in caches (a plan reads only their shapes and strides)."""
    kv = np.asarray(kv_lens)
    pages = -(-kv // 16)
    table = np.zeros((len(kv), max(int(pages.max()), 1)), np.int32)
    first = np.r_[0, np.cumsum(pages)]
    for b in range(len(kv)):
        table[b, :pages[b]] = np.arange(first[b], first[b + 1])
    cache = np.broadcast_to(np.zeros((), np.float16), (max(int(first[-1]), 1), 16, p.heads_kv, p.d_qk))
    return {"k_cache": cache, "v_cache": cache, "block_table": table, "kv_lens": kv.astype(np.int32)}


# ---------------------------------------------------------------- the plan the GPU runs
@pytest.mark.parametrize("split", ["balanced(8)", "chunk(512)", "capacity(5, 8)", "heuristic(0.85)"])
def test_triton_plan_is_the_plan_attnc_plan_describes(split):
    """For the split_launch fixture's call (plus an empty request): the Triton plan's slots and
    bounds are the split plan's (what `attnc plan` prints), and every slot's block list covers
    its [start, end) and nothing else."""
    p = program(split, heads="8 / 2", head_dim=128, dtype="bf16", cache="paged(page_size = 16, layout = nhd)",
                mask="causal")
    kv = [*MAIN["T"], 0]
    plan = D.decode_plan(p, shape_only(p, kv), num_sms=132)
    ref = plan_split(p, logical_layout(p, kv), num_sms=132, block_rows=None)
    assert plan["bounded"] and plan["policy"] == ref.bounds.policy
    assert plan["splits"] == ref.capacity
    bounds = plan["split_bounds"].reshape(len(kv), ref.capacity, 2)
    np.testing.assert_array_equal(bounds[..., 0], ref.bounds.starts)
    np.testing.assert_array_equal(bounds[..., 1], ref.bounds.ends)
    if split == "balanced(8)":
        assert ref.bounds.split_lengths()[:2] == MAIN["split_lengths"]
    ptr, blocks, bn = plan["entry_ptr"], plan["blocks"], plan["block_n"]
    for b in range(len(kv)):  # decode: tile b is request b; slot s reads blocks meeting [start, end)
        for s in range(ref.capacity):
            lo, hi = (int(x) for x in bounds[b, s])
            got = blocks[ptr[b * ref.capacity + s]:ptr[b * ref.capacity + s + 1]].tolist()
            assert got == (list(range(lo // bn, -(-hi // bn))) if hi > lo else []), (b, s)


def test_auto_keeps_the_fast_route_and_a_callers_splits_override_a_policy():
    p = program("auto", heads="8 / 2", head_dim=128, dtype="bf16", cache="paged(page_size = 16, layout = nhd)")
    plan = D.decode_plan(p, shape_only(p, MAIN["T"]), num_sms=132)
    default = D.default_decode_config(p, MAIN["T"], [1, 1], 132)
    assert not plan["bounded"] and plan["splits"] == default["splits"]
    assert plan["policy"] == f"{default['splits']} balanced block shares"
    p8 = program("balanced(8)", heads="8 / 2", head_dim=128, dtype="bf16", cache="paged(page_size = 16, layout = nhd)")
    forced = D.decode_plan(p8, shape_only(p8, MAIN["T"]), splits=3)
    assert not forced["bounded"] and forced["splits"] == 3


@pytest.mark.parametrize("state", ["lse_o", "mlu"])
def test_workspace_is_the_ledgers(state):
    """One truth: the Triton launch allocates the bytes the ledger reports, the seed's 33,408 B
    for (LSE, O) with bf16 partial O and 66,688 B for f32 (m, l, u) (split_launch fixture)."""
    p = program("balanced(8)", heads="8 / 2", head_dim=128, dtype="bf16", cache="contiguous(layout = bhsd)",
                state=state)
    plan = D.decode_plan(p, {"k": np.zeros((2, 2, 4096, 128), np.float16), "v": np.zeros((2, 2, 4096, 128), np.float16),
                             "kv_lens": np.array(MAIN["T"])})
    module = runtime.load(p).module
    allocated = workspace.workspace_bytes(module, plan["total_q"], plan["splits"], state)
    report = plan_split(p, logical_layout(p, MAIN["T"]), block_rows=None).report()
    key = {"lse_o": "lse_o_bf16O_fp32lse_u8valid", "mlu": "mlu_fp32_u8valid"}[state]
    assert allocated == report["workspace_bytes"]["capacity"] == MAIN["workspace_bytes"][key]["configured"]
    assert workspace.vector_torch_dtype(module, state) == (torch.bfloat16 if state == "lse_o" else torch.float32)


# ---------------------------------------------------------------- what the kernel computes
def _check(p, arrays, **options):
    """Triton against the oracle and the numpy backend; returns (o, lse)."""
    o, lse = runtime.load(p).run(arrays, return_lse=True, **options)
    call = inputs.validate_cache(p, arrays)
    ref_o, ref_lse = oracle.reference_cache(p, call)
    co, cl = numerics.compare_outputs(p.dtype, o, lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    n_o, n_lse = numpy_runtime.load(p).run(arrays, return_lse=True)
    co, cl = numerics.compare_outputs(p.dtype, o, lse, n_o, n_lse)
    assert co.ok and cl.ok, ("numpy", str(co), str(cl))
    return o, lse


@pytest.mark.parametrize("split", ["balanced(3)", "chunk(16)", "capacity(3, 5)"])
def test_policies_run_on_the_kernel(split):
    """Decode (with an empty request) and a mixed batch under the policy, block_n 8 so bounds
    cut blocks (45 / 3 = 15 keys a slot): the oracle's and numpy's answer."""
    p = program(split)
    arrays = inputs.sample_cache(p, [45, 0, 70, 17], [1, 1, 1, 1], seed=3)
    del arrays["q_lens"]  # decode: one row per request, the kernels' default
    plan = runtime.load(p).decode_plan({n: a for n, a in arrays.items() if n != "q"}, block_n=BN)
    assert plan["bounded"] and plan["policy"] == split
    o, lse = _check(p, arrays, block_n=BN)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()  # the empty request's row sees nothing
    _check(p, inputs.sample_cache(p, [45, 30, 17], [6, 0, 17], seed=4), block_n=BN)


def test_capacity_tail_on_the_kernel():
    """M4.5 §0x03G: B = 2, H_q = 4, T = [3, 0], capacity(5, 8).  The producer writes all 64
    states of the capacity envelope (the workspace starts poisoned: a slot left unwritten would
    read as valid), 52 of them the identity, and the combine reads the whole envelope."""
    p = program(f"capacity({TAIL['splits']}, {TAIL['split_capacity']})", heads=str(TAIL["H_q"]), mask="causal")
    arrays = inputs.sample_cache(p, TAIL["T"], [1, 1], seed=5)
    del arrays["q_lens"]
    kernel = runtime.load(p)
    meta = {n: a for n, a in arrays.items() if n != "q"}
    plan = kernel.decode_plan(meta, block_n=BN)
    assert plan["splits"] == TAIL["split_capacity"]
    dev = kernel.device
    q, k_cache, v_cache = (torch.as_tensor(arrays[n]).to(dev, torch.float16) for n in ("q", "k_cache", "v_cache"))
    bound = kernel._bind_split(plan, q, k_cache, v_cache, {}, None, None)
    ws = torch.full((bound.workspace_bytes,), 0xFF, dtype=torch.uint8, device=dev)
    out = torch.empty(2, p.heads_q, p.d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(2, p.heads_q, dtype=torch.float32, device=dev)
    bound.launch(q, k_cache, v_cache, bound.plan, bound.arrays, bound.ts, out, lse, ws)
    states, fields, _ = workspace.split_layout(2, plan["splits"], "lse_o", p.heads_q, p.d_v, 2)
    off, count = fields["valid"]
    valid = ws[off:off + count].cpu().numpy()
    assert states == TAIL["producer_owners"] and set(valid.tolist()) <= {0, 1}
    assert int((valid == 1).sum()) == TAIL["active_owners"]
    assert int((valid == 0).sum()) == TAIL["identity_bypasses"]
    lse = lse.cpu().numpy()
    assert np.isneginf(lse[1]).all() and (out[1].cpu().numpy() == 0).all() and np.isfinite(lse[0]).all()
    _check(p, arrays, block_n=BN)


def test_combine_in_several_passes(monkeypatch):
    """More slots than one combine pass holds: the same answer as one pass."""
    p = program("chunk(4)", mask="causal")
    arrays = inputs.sample_cache(p, [29, 0, 11], [1, 1, 1], seed=6)
    del arrays["q_lens"]
    one_o, one_lse = _check(p, arrays, block_n=BN)
    monkeypatch.setattr(L, "COMBINE_SLOTS", 2)  # 8 slots: four passes
    o, lse = _check(p, arrays, block_n=BN)
    np.testing.assert_allclose(o.astype(np.float32), one_o.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse, one_lse, atol=1e-5)


def test_a_graph_replays_a_policys_plan():
    """DecodeGraph over a balanced(3) spec: steps with new lengths (bounds move, cut blocks are
    listed twice) give the eager call's answer."""
    p = program("balanced(3)", dtype="f32", mask="causal", cache="paged(page_size = 8, layout = nhd, table = dense)")
    kernel = runtime.load(p)
    arrays = inputs.sample_cache(p, [40, 17, 0], [1, 1, 1], seed=7)
    del arrays["q_lens"]
    dev = kernel.device
    t = {n: (torch.as_tensor(a).to(dev) if a.dtype.kind == "f" else a) for n, a in arrays.items()}
    q = t.pop("q")
    graph = kernel.decode_graph(q, max_kv_len=40, block_n=BN, capture=dev == "cuda", **t)
    for lens in ([40, 17, 0], [33, 9, 0], [25, 16, 0]):  # (within each request's pages)
        step = dict(t, kv_lens=np.array(lens, np.int32))
        graph.update(kv_lens=step["kv_lens"])
        o, lse = graph(q)
        want_o, want_lse = kernel.decode(q, return_lse=True, block_n=BN, **step)
        np.testing.assert_allclose(o.cpu().numpy(), want_o.cpu().numpy(), atol=1e-6)
        np.testing.assert_allclose(lse.cpu().numpy(), want_lse.cpu().numpy(), atol=1e-6)
