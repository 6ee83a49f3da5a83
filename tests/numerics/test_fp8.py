"""FP8 (e4m3) calls (``attnc.fp8``): quantization, the dequantizing path every backend takes
off Hopper (CPU: the numpy backend and the Triton interpreter), their refusals, and on an sm_90
GPU (ATTNC_TEST_GPU=1) the Gluon engine's FP8 tensor-core path against the float64 oracle of
the dequantized inputs (``numerics.compare_fp8_outputs``)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="FP8 calls take torch tensors (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc import fp8  # noqa: E402
from attnc.backends.triton import choice, launch, runtime  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from tests.conftest import prefill_launches  # noqa: E402

HOPPER = (not runtime.interpreted() and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))
hopper = pytest.mark.skipif(not HOPPER, reason="the FP8 engine runs on an sm_90 GPU (ATTNC_TEST_GPU=1)")
DEVICE = "cuda" if not runtime.interpreted() and torch.cuda.is_available() else "cpu"

CAUSAL_GQA = "attention c { heads = 4 / 2 head_dim = 64 dtype = bf16 mask = causal }"


def _qkv(b, hq, hk, s_q, s_k, d, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(device) for h, s in ((hq, s_q), (hk, s_k), (hk, s_k)))


def _quantized(q, k, v):
    (q8, dq), (k8, dk), (v8, dv) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v, transposed=True)
    return (q8, k8, v8), {"q_descale": dq, "k_descale": dk, "v_descale": dv}


# ---------------------------------------------------------------- quantization
def test_quantize_per_head_round_trips_within_e4m3():
    q = _qkv(2, 3, 3, 50, 50, 32)[0] * torch.tensor([1.0, 1e-3, 300.0]).view(1, 3, 1, 1)
    q8, dq = fp8.quantize(q)
    assert q8.dtype == torch.float8_e4m3fn and dq.shape == (2, 3) and dq.dtype == torch.float32
    # each head's largest magnitude maps to 448; every value within e4m3's half spacing (2^-4 relative,
    # or the subnormal step 2^-9 * descale near zero)
    assert torch.allclose(q8.float().abs().amax(dim=(2, 3)), torch.full((2, 3), 448.0))
    back = fp8.dequantize(q8, dq, torch.float32)
    bound = (q.abs() * 2.0 ** -4).maximum(dq.view(2, 3, 1, 1) * 2.0 ** -10)
    assert ((back - q).abs() <= bound).all()


def test_transposed_storage_is_read_in_place_and_other_layouts_are_copied():
    v = _qkv(2, 2, 2, 48, 48, 16)[2]
    v8, _ = fp8.quantize(v, transposed=True)
    assert v8.shape == v.shape and v8.stride() == (2 * 16 * 48, 16 * 48, 1, 48)
    assert fp8.is_v_transposed(v8) and fp8.v_transposed(v8) is v8
    plain = v8.contiguous()
    assert not fp8.is_v_transposed(plain)
    vt = fp8.v_transposed(plain)
    assert fp8.is_v_transposed(vt) and torch.equal(vt.float(), plain.float())
    odd = fp8.quantize(_qkv(1, 2, 2, 40, 40, 16)[2])[0]  # S = 40: rows padded to 48 bytes (TMA: 16-byte rows)
    vt = fp8.v_transposed(odd)
    assert vt.stride(3) == 48 and torch.equal(vt.float(), odd.float())
    assert (vt.transpose(2, 3).contiguous().view(-1).float().abs().sum() > 0)


def test_quantize_refuses_what_it_cannot_scale():
    with pytest.raises(ValueError, match=r"x\[0, 1, 2, 3\] = inf is not finite"):
        x = torch.zeros(1, 2, 4, 8)
        x[0, 1, 2, 3] = float("inf")
        fp8.quantize(x)
    with pytest.raises(ValueError, match="4-d float tensor"):
        fp8.quantize(torch.zeros(2, 4, 8))


# ---------------------------------------------------------------- the dequantizing path (CPU)
@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_an_fp8_call_is_the_call_on_its_dequantized_inputs(backend):
    """Off the FP8 engine, every backend computes the attention of x8 * descale in the spec's dtype:
    the same O as the call on those values, bit for bit."""
    attn = attnc.compile(CAUSAL_GQA)
    device = DEVICE if backend == "triton" else "cpu"
    (q8, k8, v8), d = _quantized(*_qkv(2, 4, 2, 24, 40, 64, seed=1))
    q8, k8, v8 = (x.to(device) for x in (q8, k8, v8))
    d = {n: t.to(device) for n, t in d.items()}
    deq = [fp8.dequantize(x, d[n], torch.bfloat16) for x, n in ((q8, "q_descale"), (k8, "k_descale"),
                                                              (v8, "v_descale"))]
    if backend == "triton" and HOPPER:  # (on Hopper the call takes the FP8 engine: the Triton kernel asked for)
        kernel = attn.kernel("triton", attn.specialize(4, 2, 64, 64, "bf16"))
        o, lse = kernel(q8, k8, v8, return_lse=True, engine="triton", **d)
        ref_o, ref_lse = kernel(*deq, return_lse=True, engine="triton")
    else:
        o, lse = attn(q8, k8, v8, return_lse=True, backend=backend, **d)
        ref_o, ref_lse = attn(*deq, return_lse=True, backend=backend)
    assert o.dtype == torch.bfloat16 and o.device.type == device
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)


def test_fp8_against_the_unquantized_oracle_within_fp8_error():
    """What quantizing the inputs costs, end to end (numpy backend): O within e4m3's input rounding
    of the float64 attention of the original values."""
    attn = attnc.compile(CAUSAL_GQA)
    q, k, v = _qkv(1, 4, 2, 64, 64, 64, seed=2)
    (q8, k8, v8), d = _quantized(q, k, v)
    o = attn(q8, k8, v8, **d).double()
    ref = attn(q.double(), k.double(), v.double())
    rel = float((o - ref).norm() / ref.norm())
    assert rel < 0.06, rel


def test_fp8_refusals_name_the_input():
    attn = attnc.compile(CAUSAL_GQA)
    q, k, v = _qkv(1, 4, 2, 16, 16, 64)
    (q8, k8, v8), d = _quantized(q, k, v)
    with pytest.raises(InputError, match=r"'k_descale' has shape \[1, 4\]; this call's is \[B, H\] = \[1, 2\]"):
        attn(q8, k8, v8, **{**d, "k_descale": torch.ones(1, 4)})
    with pytest.raises(InputError, match="an FP8 call takes all three as float8_e4m3fn"):
        attn(q8, k8, v.bfloat16(), **d)
    with pytest.raises(InputError, match="must be a float tensor"):
        attn(q8, k8, v8, q_descale="2")
    kernel = runtime.load(attn.specialize(4, 2, 64, 64, "bf16"))  # (the interpreter, or ATTNC_TEST_GPU=1's GPU)
    with pytest.raises(InputError, match="'q_descale' is given but q is torch.bfloat16"):
        kernel(*(x.bfloat16().to(DEVICE) for x in (q, k, v)), q_descale=d["q_descale"].to(DEVICE))
    with pytest.raises(InputError, match="forward only"):
        attn(q8.clone().requires_grad_(True), k8, v8, **d)


def test_descales_default_to_one_and_take_numbers():
    attn = attnc.compile(CAUSAL_GQA)
    q, k, v = (x.clamp(-4, 4).to(torch.float8_e4m3fn) for x in _qkv(1, 4, 2, 16, 16, 64, seed=5))
    plain = attn(q, k, v)
    assert torch.equal(plain, attn(q.float().bfloat16(), k.float().bfloat16(), v.float().bfloat16()))
    scaled = attn(q, k, v, v_descale=2.0)
    assert torch.allclose(scaled.float(), 2 * plain.float(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- the FP8 engine (Hopper)
FP8_SPECS = {
    "causal_gqa_d128": ("attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }", 256, 256),
    "causal_d64_tails": ("attention c { heads = 4 head_dim = 64 dtype = bf16 mask = causal }", 200, 200),
    "append_tails": ("attention c { heads = 4 head_dim = 128 dtype = f16 mask = causal }", 77, 333),
    "full_d256": ("attention f { heads = 2 head_dim = 256 dtype = bf16 mask = true }", 256, 384),
    "documents": ("attention d { heads = 4 head_dim = 128 dtype = bf16 tensor doc: i32[b, s] ~ segments(16, 200) "
                  "mask = causal & doc[b, q] == doc[b, k] }", 256, 384),
    "softcap_window": ("attention w { heads = 4 / 4 head_dim = 128 dtype = bf16 mask = causal & q - k < 100 "
                       "score = softcap(score, 30.0) }", 256, 256),
    # the separable form (compiler/separable.py): q.k's descales join its per-job factor on q.k
    "alibi_separable": ("attention a { heads = 4 / 2 head_dim = 128 dtype = bf16 mask = causal "
                        "score = score - exp(-(h + 1) * log(2.0)) * (q - k) }", 200, 333),
    "key_bias_separable": ("attention k { heads = 4 head_dim = 64 dtype = f16 tensor kb: f32[b, s] ~ uniform(-4, 4) "
                           "mask = causal score = 2.0 * score + kb[b, k] }", 256, 384),
}


@hopper
@pytest.mark.parametrize("name", FP8_SPECS)
def test_fp8_engine_matches_the_oracle_of_its_dequantized_inputs(name):
    text, s_q, s_k = FP8_SPECS[name]
    program = compile_spec(text)
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, s_q, s_k, seed=7)
    call = inputs.validate(program, arrays)
    tensors = {t.name: torch.as_tensor(arrays[t.name]).cuda() for t in program.tensors}
    q, k, v = (torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32).cuda() for x in (call.q, call.k, call.v))
    (q8, k8, v8), d = _quantized(q, k, v)
    o, lse = kernel(q8, k8, v8, return_lse=True, **d, **tensors)
    launch_ = next(iter(kernel._bound.values()))
    assert launch_[1], "the FP8 call did not take the engine"
    deq = [fp8.dequantize(x, d[n], torch.float64).cpu().numpy() for x, n in
           ((q8, "q_descale"), (k8, "k_descale"), (v8, "v_descale"))]
    ref_o, ref_lse = oracle.reference(program, *deq, call.tensors)
    co, cl = numerics.compare_fp8_outputs(o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    # a plain contiguous V (copied to V^T by the call) gives the same O
    o2 = kernel(q8, k8, v8.contiguous(), **d, **tensors)
    assert torch.equal(o, o2)


@hopper
def test_fp8_calls_the_engine_refuses_are_dequantized():
    program = compile_spec("attention m { heads = 2 head_dim = 192 / 128 dtype = bf16 mask = causal }")
    kernel = runtime.load(program)
    q, k, v = (x.cuda() for x in _qkv(1, 2, 2, 128, 128, 192))
    v = v[..., :128].contiguous()
    (q8, k8, v8), d = _quantized(q, k, v)
    o = kernel(q8, k8, v8, **d)
    assert not next(iter(kernel._bound.values()))[1]
    deq = [fp8.dequantize(x, d[n], torch.bfloat16) for x, n in ((q8, "q_descale"), (k8, "k_descale"),
                                                              (v8, "v_descale"))]
    assert torch.equal(o, kernel(*deq))


def test_fp8_smem_budget_counts_one_byte_operands():
    assert choice.gluon_smem(128, 128, 128, 2, fp8=True) == 128 * 128 + 2 * 128 * 256 + 2 * 128 * 128 + 1024
    assert choice.gluon_smem(128, 128, 128, 2) == 2 * (128 * 128 + 128 * 128 + 2 * 128 * 256) + 1024


@hopper
@pytest.mark.parametrize("s_k", [1008, 1000])
def test_fp8_key_order_is_the_shuffle_free_operand_and_changes_nothing(s_k, monkeypatch):
    """Where S_k is a multiple of 16 (1008: also across the 256-key tile), the FP8 engine loads K's
    rows in P_PERM's order (a 5-d TMA box; masks and positions read sigma(c)), so that P's FP8
    operand is its accumulator's registers; elsewhere (1000) the plain order.  Both against the
    oracle, and the same O as the plain order."""
    program = compile_spec("attention c { heads = 4 / 2 head_dim = 128 dtype = bf16 mask = causal & q - k < 700 }")
    kernel = runtime.load(program)
    q, k, v = (x.cuda() for x in _qkv(2, 4, 2, s_k, s_k, 128, seed=11))
    (q8, k8, v8), d = _quantized(q, k, v)
    made = prefill_launches(monkeypatch)
    o, lse = kernel(q8, k8, v8, return_lse=True, **d)
    assert made[-1].config.block_n == 256 and made[-1].p_perm == (s_k % 16 == 0)
    deq = [fp8.dequantize(x, d[n], torch.float64).cpu().numpy() for x, n in
           ((q8, "q_descale"), (k8, "k_descale"), (v8, "v_descale"))]
    ref_o, ref_lse = oracle.reference(program, *deq, {})
    co, cl = numerics.compare_fp8_outputs(o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    monkeypatch.setattr(launch, "fp8_key_order", lambda s: False)
    plain, plain_lse = kernel(q8, k8, v8, return_lse=True, block_n=256, **d)  # (options: a launch of its own)
    assert not made[-1].p_perm
    assert torch.allclose(o.float(), plain.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(lse, plain_lse, atol=1e-4, rtol=1e-5)
