"""The Gluon engine over a K/V cache (``backends/triton/gluon_paged.py``): append calls whose
query rows fill 128-row tiles, on every cache layout the split path reads, against the float64
oracle on an sm_90 GPU (ATTNC_TEST_GPU=1 on an H100 / H200); and the rule that sends a call
there or to the split producer, everywhere.  Every stored element no request owns is NaN
(``inputs.sample_cache``'s poison): page tails the engine copies must not reach O."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.triton import device, launch, runtime, split_choice  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

HOPPER = (not runtime.interpreted() and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon engine runs on an sm_90 GPU (ATTNC_TEST_GPU=1)")

# a long append, a short one whose tile crosses its end, an idle request, an append over no history
KV_LENS = [700, 333, 0, 129]
Q_LENS = [300, 200, 0, 129]
LAYOUTS = {
    "paged16_dense_nhd": "paged(page_size = 16, layout = nhd, table = dense)",
    "paged16_csr_hnd": "paged(page_size = 16, layout = hnd, table = csr)",
    "paged256_dense_hnd": "paged(page_size = 256, layout = hnd, table = dense)",
    "paged128_csr_nhd": "paged(page_size = 128, layout = nhd, table = csr)",
    "ragged": "ragged",
    "contiguous_bshd": "contiguous(layout = bshd)",
    "contiguous_bhsd": "contiguous(layout = bhsd)",
}


def _program(cache, heads="8 / 2", d="128", dtype="bf16", mask="causal", extra=""):
    return compile_spec(f"attention c {{ heads = {heads} head_dim = {d} dtype = {dtype} {extra} mask = {mask} "
                        f"cache = {cache} }}")


def _on_gpu(arrays: dict, dtype) -> dict:
    out = {}
    for n, a in arrays.items():
        a = np.asarray(a)
        out[n] = (torch.from_numpy(np.ascontiguousarray(a, np.float32)).to("cuda", dtype) if a.dtype.kind == "f"
                  else torch.from_numpy(np.ascontiguousarray(a, np.int32)).to("cuda"))
    return out


def _check(program, kv_lens=KV_LENS, q_lens=Q_LENS, seed=0, engine=None, want="gluon"):
    arrays = inputs.sample_cache(program, kv_lens, q_lens, seed, cache_rows=len(kv_lens) + 1)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[program.dtype]
    kernel = runtime.load(program)
    dev = _on_gpu(arrays, dtype)
    q = dev.pop("q")
    options = {} if engine is None else {"engine": engine}
    plan = kernel.decode_plan(dict(dev), total_q=int(q.shape[0]), **options)
    assert plan["engine"] == want
    o, lse = kernel.decode(q, return_lse=True, **options, **dev)
    ref_o, ref_lse = oracle.reference_cache(program, inputs.validate_cache(program, arrays))
    o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
    assert np.isfinite(o).all()
    co, cl = numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    return o, lse


@hopper
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_appends_on_the_engine_match_the_oracle(layout):
    _check(_program(LAYOUTS[layout]), seed=len(layout))


@hopper
@pytest.mark.parametrize("d, dtype", [("64", "f16"), ("256", "bf16"), ("128 / 64", "bf16")])
def test_head_dims(d, dtype):
    _check(_program(LAYOUTS["paged16_dense_nhd"], heads="4 / 2", d=d, dtype=dtype), seed=7)


@hopper
def test_documents_and_a_score_program_through_the_page_table():
    p = _program(LAYOUTS["paged16_csr_hnd"], heads="4 / 1", dtype="f16",
                 mask="causal & doc[b, q] == doc[b, k]",
                 extra="tensor doc: i32[b, s] ~ segments(16, 200) score = softcap(score, 30.0)")
    _check(p, seed=3)


@hopper
@pytest.mark.parametrize("layout, d", [("paged16_csr_hnd", "128"), ("contiguous_bshd", "64")])
def test_alibi_through_the_page_table_takes_the_separable_form(layout, d, monkeypatch):
    """ALiBi on appends: the separable form (its column part per block) on the engine, against the
    oracle and against the split producer, which takes the score program per cell."""
    p = _program(LAYOUTS[layout], heads="8 / 2", d=d, extra="score = score - exp(-(h + 1) * log(2.0) * 0.5) * (q - k)")
    taken, launcher = [], launch.CacheLaunch._launcher

    def spy(self, end):
        taken.append(launch.separable_mode(self.module, end, self.block_n))
        return launcher(self, end)
    monkeypatch.setattr(launch.CacheLaunch, "_launcher", spy)
    got, lse = _check(p, seed=13)
    assert taken == [int(launch.gluon_engine.COLUMN_PER_BLOCK)]
    split, split_lse = _check(p, seed=13, engine="split", want="split")
    assert np.abs(got - split).max() < 2e-2 and np.abs(lse - split_lse).max() < 1e-3


@hopper
def test_the_engine_agrees_with_the_split_producer():
    p = _program(LAYOUTS["paged16_dense_nhd"])
    got, lse = _check(p, seed=11)
    split, split_lse = _check(p, seed=11, engine="split", want="split")
    assert np.abs(got - split).max() < 2e-2 and np.abs(lse - split_lse).max() < 1e-3


@hopper
def test_decode_rows_and_small_pages_keep_the_split_producer():
    _check(_program(LAYOUTS["paged16_dense_nhd"]), q_lens=[1, 1, 0, 1], want="split")  # decode
    _check(_program(LAYOUTS["paged16_dense_nhd"]), q_lens=[40, 3, 0, 60], want="split")  # tiles mostly empty
    small = _program("paged(page_size = 4, layout = nhd, table = dense)")
    _check(small, want="split")
    with pytest.raises(ValueError, match="pages of at least 8 rows"):
        _check(small, engine="gluon")


def test_the_rule_refuses_what_the_engine_cannot_read():
    p = _program(LAYOUTS["paged16_dense_nhd"])
    k = np.zeros((4, 16, 2, 128), np.float32)
    sm90 = split_choice.device_facts("sm_90")
    assert "not on a GPU" in split_choice.engine_refusal(p, sm90, k, k)
    fill = split_choice.CACHE_ENGINE_FILL
    assert not split_choice.fills_engine_tiles(p, np.array([1, 1, 1]))  # decode rows
    assert 0 < fill <= 1
    if HOPPER:
        here = device.facts(torch.device("cuda"))
        kt = torch.zeros((4, 16, 2, 128), device="cuda", dtype=torch.bfloat16)
        assert split_choice.engine_refusal(p, here, kt, kt) is None
        assert "16-byte" in split_choice.engine_refusal(p, here, kt[:, :, :1], kt)
        assert "not the spec's" in split_choice.engine_refusal(p, here, kt.half(), kt.half())
        for d in ("96", "192 / 128"):
            assert "head dims" in split_choice.engine_refusal(_program(LAYOUTS["ragged"], d=d), here, kt, kt)
        assert split_choice.fills_engine_tiles(p, np.array([128, 64]))  # 192 of 256 rows
        assert not split_choice.fills_engine_tiles(p, np.array([1, 129]))  # 130 of 384


@hopper
def test_contiguous_engine_zeroes_the_next_heads_v_rows():
    """The K/V block across S_k reads the next head's first rows; a non-finite value there (the
    caller's garbage, not this head's keys) must not reach this head's O through P = 0."""
    program = compile_spec("attention t { heads = 2 head_dim = 128 dtype = bf16 mask = causal }")
    kernel = runtime.load(program)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    v[0, 1, :8] = float("inf")  # head 1's first keys: head 0's tail block reads them
    v[0, 1, 8:16] = float("nan")
    o = kernel(q, k, v, engine="gluon")
    assert torch.isfinite(o[0, 0]).all()
    head0 = compile_spec("attention t { heads = 1 head_dim = 128 dtype = bf16 mask = causal }")
    call = inputs.validate(head0, {"q": q[:, :1].float().cpu().numpy(), "k": k[:, :1].float().cpu().numpy(),
                                   "v": v[:, :1].float().cpu().numpy()})
    ref_o, _ = oracle.reference(head0, call.q, call.k, call.v, {})
    assert np.abs(o[:, :1].float().cpu().numpy() - ref_o).max() < 2e-2


@hopper
def test_attnc_plan_reports_the_engines_launch():
    """`attnc plan --device here` on the H100 / H200 reports the Gluon engine's launch of a long
    append (split_choice.choose, asked with this device's facts): one slot and the workspace the
    bound launch allocates, none."""
    from attnc.compiler.launch_plan import plan_launch
    from attnc.compiler.plan import logical_layout
    program = _program(LAYOUTS["paged16_dense_nhd"])
    arrays = inputs.sample_cache(program, KV_LENS, Q_LENS, 0)
    dev = _on_gpu(arrays, torch.bfloat16)
    q = dev.pop("q")
    kernel = runtime.load(program)
    plan = kernel.decode_plan(dict(dev), total_q=int(q.shape[0]))
    bound = kernel._bind_split(plan, q, dev["k_cache"], dev["v_cache"], {}, None, None)
    report = plan_launch(program, logical_layout(program, KV_LENS), Q_LENS, device="here").report()
    assert plan["engine"] == report["launch"]["engine"] == "gluon" and report["launch"]["device"]["here"]
    assert (plan["splits"], bound.workspace_bytes) == (report["capacity"], report["workspace_bytes"]["allocated"])
    assert bound.workspace_bytes == 0


def test_jobs_keep_a_kv_heads_tiles_together_longest_first():
    from attnc.backends.triton.decode import engine_jobs
    tile_req = np.array([0, 0, 0, 1])
    counts = np.array([1, 3, 2, 5])
    jobs = engine_jobs(tile_req, counts, 4, 2)  # H_q 4, GQA group 2
    tile, h = jobs // 4, jobs % 4
    assert sorted(jobs.tolist()) == list(range(16))
    assert tile.tolist() == [1, 1, 2, 2, 0, 0] * 2 + [3] * 4
    assert h.tolist() == [0, 1] * 3 + [2, 3] * 3 + [0, 1, 2, 3]


@hopper
def test_odd_inputs_the_engine_copies_or_refuses():
    """q at an odd address is copied for TMA; a plan made for the engine refuses a cache it cannot read."""
    from attnc.compiler.errors import PlanError
    p = _program(LAYOUTS["paged16_dense_nhd"])
    arrays = inputs.sample_cache(p, KV_LENS, Q_LENS, 2, poison=False)
    dev = _on_gpu(arrays, torch.bfloat16)
    q = dev.pop("q")
    kernel = runtime.load(p)
    plan = kernel.decode_plan(dict(dev), total_q=int(q.shape[0]))
    assert plan["engine"] == "gluon"
    ref = kernel.decode(q, engine="split", **dev)
    odd = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    odd.copy_(q)
    assert odd.data_ptr() % 16 and torch.allclose(kernel.decode(odd, plan=plan, **dev).float(), ref.float(),
                                                  atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="split producer's options"):
        kernel.decode(q, plan=plan, num_warps=8, **dev)
    strided = dict(dev, k_cache=dev["k_cache"].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(PlanError, match="16-byte"):
        kernel.decode(q, plan=plan, **strided)


def test_engine_option_is_checked_before_planning():
    p = _program(LAYOUTS["paged16_dense_nhd"], dtype="f16" if runtime.interpreted() else "bf16")
    arrays = inputs.sample_cache(p, KV_LENS, Q_LENS, 4)
    kernel = runtime.load(p)
    plan_arrays = {n: a for n, a in arrays.items() if n != "q"}
    with pytest.raises(ValueError, match="engine must be None, 'split' or 'gluon'"):
        kernel.decode_plan(dict(plan_arrays), engine="cuda")
    with pytest.raises(ValueError, match="the split producer's options"):
        kernel.decode_plan(dict(plan_arrays), engine="gluon", block_n=64)
    if not HOPPER:  # host arrays (or no sm_90): the engine refuses, with the reason; the split producer plans
        with pytest.raises(ValueError, match="engine='gluon': "):
            kernel.decode_plan(dict(plan_arrays), engine="gluon")
        assert kernel.decode_plan(dict(plan_arrays))["engine"] == "split"


@hopper
def test_a_repeated_append_launches_raw_with_the_same_output():
    """Once a key's kernel is compiled, the engine over a cache launches straight through the C
    launcher (``raw_launch.raw_launch``; O, new each call, through a view of its address): the same O
    bit for bit as the call before."""
    program = _program(LAYOUTS["paged16_dense_nhd"])
    arrays = inputs.sample_cache(program, KV_LENS, Q_LENS, 5, cache_rows=len(KV_LENS) + 1)
    kernel = runtime.load(program)
    dev = _on_gpu(arrays, torch.bfloat16)
    q = dev.pop("q")

    def raw_launches():
        return sum(lz.launches["raw"] for c in kernel._splits.values() if isinstance(c, launch.CacheLaunch)
                   for lz in c._launchers.values())
    first = kernel.decode(q, **dev).clone()
    before = raw_launches()
    again = kernel.decode(q, **dev)
    assert raw_launches() == before + 1
    assert torch.equal(first, again)
