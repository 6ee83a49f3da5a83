"""How many kernels a call of the public API launches once its plan is made (issues 33, 34: on a
GPU each launch costs host time), counted on the CPU with the kernels running in Triton's
interpreter and the calls on the GPU's path for their non-finite check (``runtime.
marks_on_device``: a device flag marked by the kernels, no host check): ``Launcher.launch`` calls
(stubbed: nothing runs), plus the torch operations that would launch a kernel on a GPU (a memset,
a copy) and host syncs, read from the profiler (``bench.host_time``).  The same calls, run, still
bring their non-finite rows to ``check_numerics`` without a launch of their own."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.bench.host_time import Launches, torch_ops  # noqa: E402
from attnc.compiler.errors import PlanError  # noqa: E402

DT = torch.float16  # (bf16 is carried in float32 under the interpreter: extra conversions a GPU has not)
GPU = not runtime.interpreted() and torch.cuda.is_available()


@pytest.fixture
def gpu_path(monkeypatch):
    """Calls on CPU tensors take a GPU call's path for the non-finite rule; split calls run Triton."""
    if not runtime.interpreted():
        pytest.skip("CPU tensors through Triton's interpreter (TRITON_INTERPRET=1); test_gpu_* run on a GPU")
    from attnc.compiler import dispatch
    monkeypatch.setattr(runtime, "marks_on_device", lambda t: True)
    monkeypatch.setattr(dispatch, "device_default", lambda device: "triton")


def per_call(fn) -> tuple[dict, dict, float]:
    """(launches by kernel, kernel-launching torch ops, host syncs) of a call of ``fn`` after a
    first call (plan made, launch bound), with the launches counted instead of run (a count is the
    same either way; the interpreter's own copies are no GPU launch's)."""
    with Launches(stub=True) as counter:
        fn()
        counter.take()
        fn()
        counts, _ = counter.take()
        ops, syncs = torch_ops(fn, calls=1)
    return counts, ops, syncs


def qkv(grad=False, s=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, s, 16, generator=g, dtype=DT).requires_grad_(grad) for _ in range(3)]


def test_a_prefill_call_is_one_launch(gpu_path):
    """Closed-form and tensor masks: the kernel alone (it marks a NaN row itself), no memset, no sync."""
    causal = attnc.compile("attention c { dtype = f16 mask = causal }")
    q, k, v = qkv()
    assert per_call(lambda: causal(q, k, v, backend="triton")) == ({"_attn_fwd": 1}, {}, 0)
    docs = attnc.compile("attention d { dtype = f16 tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }")
    doc = (torch.arange(16) // 8).to(torch.int32)[None]
    assert per_call(lambda: docs(q, k, v, doc=doc, backend="triton")) == ({"_attn_fwd": 1}, {}, 0)


def test_a_sink_and_a_bias_tensor_cost_no_host_check(gpu_path):
    """``sink = sinks[h]`` and ``score + bias[...]`` make nothing non-finite from finite inputs: the
    kernel marks a NaN row itself, and the call neither syncs nor copies (r52: 456 us of host time
    per gpt-oss forward call when a tensor sink forced the host check)."""
    q, k, v = qkv()
    sinks = attnc.compile("attention s { dtype = f16 tensor sinks: f32[h] mask = causal & window(8) sink = sinks[h] }")
    s = torch.randn(2)
    assert per_call(lambda: sinks(q, k, v, sinks=s, backend="triton")) == ({"_attn_fwd": 1}, {}, 0)
    bias = attnc.compile("attention b { dtype = f16 tensor bias: f32[h, s, s] mask = causal score = score + bias[h, q, k] }")
    t = torch.randn(2, 16, 16)
    assert per_call(lambda: bias(q, k, v, bias=t, backend="triton")) == ({"_attn_fwd": 1}, {}, 0)


def test_a_call_with_launch_options_reuses_its_plan(gpu_path, monkeypatch):
    """Options (an engine, tiles) once made a plan and a launch per call (18-51 ms per call on the
    H200 at S = 8K in r52's sink study): now the launch is cached under the call and its options."""
    from tests.conftest import prefill_launches
    made = prefill_launches(monkeypatch)
    from attnc.compiler.lower import compile_spec
    kernel = runtime.load(compile_spec("attention c { heads = 2 head_dim = 16 dtype = f16 mask = causal & window(8) }"))
    q, k, v = qkv()
    first = kernel(q, k, v, engine="triton", block_m=16, block_n=16)
    for _ in range(2):
        again = kernel(q, k, v, engine="triton", block_m=16, block_n=16)
    assert len(made) == 1 and torch.equal(first, again)
    kernel(q, k, v, engine="triton", block_m=16, block_n=32)  # other options: their own
    kernel(q, k, v)
    assert len(made) == 3 and made[1].config.block_n == 32
    assert per_call(lambda: kernel(q, k, v, engine="triton"))[0] == {"_attn_fwd": 1}


def test_a_decode_call_is_the_split_and_the_combine(gpu_path):
    """Paged GQA decode: the producer and the combine, which marks the flag (no third launch)."""
    attn = attnc.compile("attention p { dtype = f16 mask = causal cache = paged(page_size = 4, layout = nhd) }")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, generator=g, dtype=DT)
    kc, vc = (torch.randn(8, 4, 2, 16, generator=g, dtype=DT) for _ in range(2))
    cache = {"k_cache": kc, "v_cache": vc, "block_table": torch.tensor([[3, 1, 6, 0], [2, 7, 5, 4]], dtype=torch.int32),
             "kv_lens": torch.tensor([13, 16], dtype=torch.int32)}
    assert per_call(lambda: attn.decode(q, **cache)) == ({"_split_at": 1, "_combine_at": 1}, {}, 0)


def test_a_backward_through_autograd_is_two_launches(gpu_path):
    """torch.autograd.grad of O: the delta pass and the fused dK/dV + dQ pass; LSE's gradient is
    absent, not a zeroed tensor (no memset, no dLSE read)."""
    attn = attnc.compile("attention c { dtype = f16 mask = causal }")
    q, k, v = qkv(grad=True)
    o = attn(q, k, v, backend="triton")
    do = torch.randn_like(o)
    launches = per_call(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    assert launches == ({"_bwd_delta": 1, "_bwd_main": 1}, {}, 0)


def test_a_learned_bias_backward_adds_one_launch_and_no_host_work(gpu_path):
    """``score + bias[h, q, k]`` with bias requiring grad: the delta pass (once: the gradient's
    launch reads the backward's D), the main pass and the bias's reduction, bound like the others
    (not through the JIT per call); no copy, no sync."""
    attn = attnc.compile("attention b { dtype = f16 tensor bias: f32[h, s, s] mask = causal score = score + bias[h, q, k] }")
    q, k, v = qkv(grad=True)
    bias = torch.randn(2, 16, 16).requires_grad_()
    o = attn(q, k, v, bias=bias, backend="triton")
    do = torch.randn_like(o)
    launches = per_call(lambda: torch.autograd.grad(o, (q, k, v, bias), do, retain_graph=True))
    assert launches == ({"_bwd_delta": 1, "_bwd_main": 1, "_bwd_tensor_grad": 1}, {}, 0)


def test_the_kernels_mark_non_finite_rows_without_a_launch_of_their_own(gpu_path):
    """A NaN in q makes its rows' LSE NaN: the prefill kernel and the split combine set the device
    flag that check_numerics raises (and clears), with the launch counts above."""
    causal = attnc.compile("attention c { dtype = f16 mask = causal }")
    q, k, v = qkv()
    causal(q, k, v, backend="triton")
    causal.check_numerics()  # nothing marked
    q[0, 1, 5, 3] = float("nan")
    o = causal(q, k, v, backend="triton")
    assert torch.isnan(o[0, 1, 5]).all()
    with pytest.raises(PlanError, match="NaN or \\+inf at a visible key"):
        causal.check_numerics()
    causal.check_numerics()  # cleared
    attn = attnc.compile("attention p { dtype = f16 mask = causal cache = paged(page_size = 4, layout = nhd) }")
    g = torch.Generator().manual_seed(2)
    qd = torch.randn(2, 4, 16, generator=g, dtype=DT)
    kc, vc = (torch.randn(4, 4, 2, 16, generator=g, dtype=DT) for _ in range(2))
    cache = {"k_cache": kc, "v_cache": vc, "block_table": torch.tensor([[1, 0], [3, 2]], dtype=torch.int32),
             "kv_lens": torch.tensor([6, 8], dtype=torch.int32)}
    attn.decode(qd, **cache)
    attn.check_numerics()
    kc[3, 1, 0, 0] = float("nan")  # request 1's key 1 of K/V head 0: its query heads 0 and 1 see it
    attn.decode(qd, **cache)
    with pytest.raises(PlanError, match="NaN or \\+inf at a visible key"):
        attn.check_numerics()


@pytest.mark.skipif(not GPU, reason="counts the GPU's kernels (ATTNC_TEST_GPU=1 on a CUDA machine)")
def test_gpu_calls_launch_no_more_kernels_than_the_launch_layer_counts():
    """On a GPU, the profiler's kernels, memsets and copies per call equal the launch layer's
    launches (no torch operation launches one of its own), at most: prefill 1 (either engine marks a
    NaN row's non-finite flag itself), decode 2, backward through autograd 3 (delta, dK/dV, dQ)."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    causal = attnc.compile("attention c { dtype = bf16 mask = causal }")
    q, k, v = (torch.randn(1, 4, 512, 128, device=dev, dtype=dt, generator=g, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        prefill = lambda: causal(q, k, v)  # noqa: E731
        prefill()
        assert _gpu_per_call(prefill) <= 1
    o = causal(q, k, v)
    do = torch.randn_like(o)
    assert _gpu_per_call(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)) <= 3
    attn = attnc.compile("attention p { dtype = bf16 mask = causal cache = paged(page_size = 16, layout = nhd) }")
    qd = torch.randn(4, 32, 128, device=dev, dtype=dt, generator=g)
    kc, vc = (torch.randn(64, 16, 8, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    cache = {"k_cache": kc, "v_cache": vc, "block_table": torch.randperm(64).view(4, 16).to(torch.int32),
             "kv_lens": torch.full((4,), 256, dtype=torch.int32)}
    assert _gpu_per_call(lambda: attn.decode(qd, **cache)) == 2


def _gpu_per_call(fn) -> float:
    """The GPU work items per call of ``fn`` (after two calls), checked equal to its launches."""
    from attnc.bench.host_time import cuda_kernels
    fn()
    fn()
    with Launches(stub=False) as counter:
        kernels = sum(cuda_kernels(fn, calls=4).values())
        launches = sum(counter.take()[0].values()) / 4
    assert kernels == launches, (kernels, launches)
    return launches


def test_check_finite_0_neither_checks_nor_marks_and_1_checks_at_the_call(gpu_path, monkeypatch):
    """ATTNC_CHECK_FINITE on a GPU call's path: "0" runs the kernels unmarked (no error, no flag),
    "1" checks the rows at the call (the error names the row), whatever the calls before."""
    causal = attnc.compile("attention c { dtype = f16 mask = causal }")
    q, k, v = qkv()
    q[0, 0, 3, 0] = float("inf")
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "0")
    causal(q, k, v, backend="triton")
    causal.check_numerics()  # nothing marked
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "1")
    with pytest.raises(PlanError, match=r"query row \(b=0, h=0, q=3\)"):
        causal(q, k, v, backend="triton")
    causal.check_numerics()  # checked at the call, not marked
