"""The Triton backward pass (CPU interpreter unless ATTNC_TEST_GPU=1): every example's dQ, dK, dV
against the float64 reference backward (compiler.oracle.reference_backward), with the declared
gradient tolerances; GQA, empty rows, bottom-right (append) calls, dLSE, determinism."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

APPEND = ("causal", "causal_document_gqa", "softcap", "alibi")


def _torch_call(kernel, arrays):
    """The call's q, k, v (storage dtype; bf16 values carried exactly) and tensors as torch tensors."""
    program = kernel.program
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[program.dtype]
    dev = kernel.device
    q, k, v = (torch.as_tensor(np.ascontiguousarray(arrays[n]), device=dev).to(dt) for n in ("q", "k", "v"))
    tensors = {t.name: torch.as_tensor(np.ascontiguousarray(
        arrays[t.name].astype(np.int32) if arrays[t.name].dtype.kind in "iu" else arrays[t.name]), device=dev)
        for t in program.tensors}
    return q, k, v, tensors


def _check(kernel, s_q, s_k, seed=3, batch=2):
    program = kernel.program
    arrays = inputs.sample(program, batch, s_q, s_k, seed=seed)
    q, k, v, tensors = _torch_call(kernel, arrays)
    o, lse = kernel(q, k, v, return_lse=True, **tensors)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device)
    dq, dk, dv = kernel.backward(q, k, v, o, lse, do, **tensors)
    call = inputs.validate(program, {"q": q.float().cpu().numpy(), "k": k.float().cpu().numpy(),
                                     "v": v.float().cpu().numpy(), **{n: t.cpu().numpy() for n, t in tensors.items()}})
    do_bhsd = inputs.output_bhsd(program, do.float().cpu().numpy())
    ref = oracle.reference_backward(program, call.q, call.k, call.v, do_bhsd, call.tensors)
    for name, got, want in zip(("dQ", "dK", "dV"), (dq, dk, dv), ref[:3]):
        got = got.float().cpu().numpy()
        if program.cache.layout.value == "bshd":
            got = got.transpose(0, 2, 1, 3)
        c = numerics.compare_gradient(name, program.dtype, got, want)
        assert c.ok, str(c)
    return dq, dk, dv


def _small(program):
    """The example with at most two query heads per K/V head pair (its GQA group kept): the
    interpreter's time grows with heads, the kernel's paths do not."""
    from dataclasses import replace
    g = program.group
    h_kv = min(program.heads_kv, 2 if g == 1 else 1)
    return replace(inputs.contiguous_variant(program), heads_q=h_kv * g, heads_kv=h_kv)


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda p: p.stem)
def kernel(request):
    return runtime.load(_small(compile_file(request.param)))


def test_every_example_backward_matches_the_float64_reference(kernel):
    _check(kernel, 24, 24)


@pytest.mark.parametrize("name", APPEND)
def test_bottom_right_append_backward(name):
    kernel = runtime.load(_small(compile_file(next(p for p in EXAMPLES if p.stem == name))))
    _check(kernel, 9, 26, seed=5, batch=1)


def test_gqa_empty_rows_tails_and_determinism():
    program = compile_spec("attention e { heads = 4 / 2 head_dim = 24 / 40 dtype = f32 mask = q >= 14 & causal }")
    kernel = runtime.load(program)
    first = _check(kernel, 19, 21, seed=7, batch=1)
    again = _check(kernel, 19, 21, seed=7, batch=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # no atomics: the same bits every run
    dq = first[0]
    assert torch.isfinite(dq).all() and (dq[:, :, :12] == 0).all()  # rows 0..11 (q < 14) see no key


def test_gradient_of_lse_is_taken():
    program = compile_spec("attention l { heads = 2 head_dim = 16 dtype = f32 mask = causal }")
    kernel = runtime.load(program)
    q, k, v = (torch.randn(1, 2, 17, 16, device=kernel.device, dtype=torch.float64) for _ in range(3))
    do = torch.randn(1, 2, 17, 16, dtype=torch.float64)
    dlse = torch.randn(1, 2, 17, dtype=torch.float64)
    o, lse = kernel(*(x.float() for x in (q, k, v)), return_lse=True)
    got = kernel.backward(*(x.float() for x in (q, k, v)), o, lse, do.float().to(o.device), dlse.float().to(o.device))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    s = (qq @ kk.transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(17, 17, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ vv * do.to(s.device)).sum().add_((torch.logsumexp(s, -1) * dlse.to(s.device)).sum()).backward()
    for g, ref in zip(got, (qq.grad, kk.grad, vv.grad)):
        assert numerics.compare_gradient("g", "f32", g.cpu().double().numpy(), ref.cpu().numpy()).ok


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims_and_half_dtypes(head_dim, dtype):
    """The GPU's shapes: d = 64 and 128 in bf16 and f16, GQA, a length that is not a multiple of
    the tiles (the interpreter runs the same paths on a short one)."""
    program = compile_spec(f"attention t {{ heads = 4 / 2 head_dim = {head_dim} dtype = {dtype} "
                           "mask = causal & q - k < 100 }")
    kernel = runtime.load(program)
    s = 300 if kernel.device == "cuda" else 21
    _check(kernel, s, s, seed=9, batch=1)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("score", {"alibi": "score - exp(-(h + 1) * log(2.0)) * (q - k)",
                                   "softcap": "softcap(score, 30.0)"}.items(), ids=lambda s: s[0])
def test_score_programs_in_half_dtypes(score, dtype):
    """ALiBi's fast form (score_grad_fast) and softcap's tanh (the GPU's tanh.approx.f32 on a GPU)
    through the backward, at the GPU's head dim and a length across the tiles."""
    program = compile_spec(f"attention t {{ heads = 4 / 2 head_dim = 64 dtype = {dtype} mask = causal "
                           f"score = {score[1]} }}")
    kernel = runtime.load(program)
    s = 300 if kernel.device == "cuda" else 21
    _check(kernel, s, s, seed=4, batch=1)


def test_a_mask_reading_the_lengths():
    """S_k in the mask: the backward passes the call's lengths as the forward does."""
    kernel = runtime.load(compile_spec("attention e { heads = 2 head_dim = 16 dtype = f32 mask = causal & k < S_k - 3 }"))
    _check(kernel, 13, 20, seed=2, batch=1)
