"""Bound backward calls (``backends/triton/bound_backward.py``): the backward of an eager autograd
call whose forward's signature ran before skips the validating layers, and gives exactly the
gradients the validating path gives; what reads values still runs per call (a mask tensor changed
in place, a plan the cache dropped).  On the CPU the kernels run in Triton's interpreter (its
Triton passes); the Gluon passes' host side, which an H200 takes, is checked with their launches
stood in for; with ATTNC_TEST_GPU=1 on the GPU the real passes run."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc import api  # noqa: E402
from attnc.backends.triton import bound_backward, runtime  # noqa: E402
from attnc.backends.triton import gluon_backward as GB  # noqa: E402
from attnc.backends.triton import launch as L  # noqa: E402
from attnc.backends.triton import plans as P  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402

from tests.conftest import bound_answers, triton_setting  # noqa: E402

DEV, GPU, DT, DTS, KW = triton_setting()
S, D = (384, 64) if GPU else (40, 16)


@pytest.fixture
def answered(monkeypatch):
    """The backward calls the bound backward answered (True per call it took, False per one it
    declined), the calls on a GPU call's non-finite path."""
    return bound_answers(monkeypatch, bound_backward.BoundBackward)


def unbound(monkeypatch):
    """Every call from here on takes the validating path (no call finds a bound call or binds one)."""
    monkeypatch.setattr(api.Attention, "_bound_forward", lambda self, q, k, v, tensors, backend: (None, None, None))


def qkv(b=2, hq=2, hkv=2, s=S, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    return [torch.randn(*shape, generator=g).to(device=DEV, dtype=DT).requires_grad_(True) for shape in make]


def grads(attn, q, k, v, do, lse_weight=None, **tensors):
    """dQ, dK, dV of (O . dO) [+ LSE . lse_weight] through autograd, on fresh leaves of q, k, v."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o, lse = attn(*leaves, return_lse=True, **tensors, **KW)
    loss = (o.float() * do.float()).sum()
    if lse_weight is not None:
        loss = loss + (lse * lse_weight).sum()
    return torch.autograd.grad(loss, leaves)


def same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_bound_backward_gradients_are_the_validating_paths_bit_for_bit(answered, monkeypatch, heads):
    spec = f"attention bb_causal {{ dtype = {DTS} mask = causal }}"
    attn = attnc.compile(spec)
    q, k, v = qkv(hq=heads[0], hkv=heads[1])
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEV, DT)
    first = grads(attn, q, k, v, do)  # validated, planned, launched: then bound
    assert answered == []
    second, third = grads(attn, q, k, v, do), grads(attn, q, k, v, do)
    assert answered == [True, True]
    unbound(monkeypatch)
    reference = grads(attnc.compile(spec), q, k, v, do)
    for got in (first, second, third):
        same(got, reference)
    assert [g.shape for g in second] == [x.shape for x in (q, k, v)]


def test_the_gradient_of_lse_takes_its_own_bound_backward(answered, monkeypatch):
    spec = f"attention bb_lse {{ dtype = {DTS} mask = causal & window(9) }}"
    attn = attnc.compile(spec)
    q, k, v = qkv()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEV, DT)
    w = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(3)).to(DEV)
    grads(attn, q, k, v, do)
    grads(attn, q, k, v, do)  # bound without dLSE
    with_lse = [grads(attn, q, k, v, do, w) for _ in range(2)]  # validated (dLSE's own key), then bound
    assert answered == [True, True]
    unbound(monkeypatch)
    reference = grads(attnc.compile(spec), q, k, v, do, w)
    for got in with_lse:
        same(got, reference)
    assert not torch.equal(with_lse[0][0], grads(attnc.compile(spec), q, k, v, do)[0])


def test_another_signature_is_validated_first_and_bad_inputs_raise_as_before(answered):
    attn = attnc.compile(f"attention bb_sig {{ dtype = {DTS} mask = causal }}")
    q, k, v = qkv()
    do = torch.ones(q.shape, device=DEV, dtype=DT)
    grads(attn, q, k, v, do)
    grads(attn, q, k, v, do)
    q2, k2, v2 = qkv(s=S // 2 + 3)  # a new length: its own validation, plan and binding
    grads(attn, q2, k2, v2, do[:, :, : S // 2 + 3])
    assert answered == [True]
    with torch.no_grad():
        o, lse = attn(q, k, v, return_lse=True, **KW)
    route, key = attn._routed_forward(q.detach(), k.detach(), v.detach(), {}, KW.get("backend"))[2:]
    assert attn._bound_backward and key is not None
    bad = do[:, :, :-1]  # dO of another shape: never a bound backward's; the validating path's located error
    with pytest.raises(InputError, match="'do' has shape"):
        attn._eager_backward(route, key, q, k, v, o, lse, bad, None, [], [])
    with pytest.raises(InputError, match="'do' has shape"):
        attn.backward(q, k, v, o, lse, bad, None, {}, KW.get("backend"))
    assert answered == [True]


def test_a_mask_tensor_changed_in_place_is_planned_again(answered, monkeypatch):
    spec = f"attention bb_doc {{ dtype = {DTS} tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }}"
    attn = attnc.compile(spec)
    q, k, v = qkv()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(DEV, DT)
    doc = (torch.arange(S) // (S // 3)).to(torch.int32).expand(2, S).contiguous().to(DEV)
    grads(attn, q, k, v, do, doc=doc)
    before = grads(attn, q, k, v, do, doc=doc)
    assert answered == [True]
    doc[:, : S // 2] = 7  # the same tensor, new values (its version moves)
    after = grads(attn, q, k, v, do, doc=doc)  # the forward re-plans; the bound backward declines
    assert answered == [True, False]
    again = grads(attn, q, k, v, do, doc=doc)
    assert answered == [True, False, True]  # bound again
    same(after, again)
    assert not torch.equal(before[0], after[0])
    unbound(monkeypatch)
    same(after, grads(attnc.compile(spec), q, k, v, do, doc=doc))


def test_a_plan_the_cache_dropped_is_made_again(answered):
    import gc
    attn = attnc.compile(f"attention bb_drop {{ dtype = {DTS} mask = causal & window(8) }}")
    q, k, v = qkv()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEV, DT)
    g1 = grads(attn, q, k, v, do)
    grads(attn, q, k, v, do)
    P.PLANS.clear()
    gc.collect()
    assert all(b.launch() is None for b in attn._bound_backward.values() if b)  # (nothing bound keeps a plan)
    g2, g3 = grads(attn, q, k, v, do), grads(attn, q, k, v, do)
    assert answered == [True, False, True]
    same(g1, g2)
    same(g1, g3)


def test_token_major_views_and_tensor_gradients(answered, monkeypatch):
    """q, k, v as token-major views (transformers') are bound like any layout; a call asking a
    score tensor's gradient takes the validating path (its own passes)."""
    spec = f"attention bb_tm {{ dtype = {DTS} mask = causal }}"
    attn = attnc.compile(spec)
    q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(hq=4, hkv=2))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(DEV, DT)
    got = [grads(attn, q, k, v, do) for _ in range(2)]
    assert answered == [True]
    unbound(monkeypatch)
    same(got[1], grads(attnc.compile(spec), q, k, v, do))
    biased = attnc.compile(f"attention bb_bias {{ dtype = {DTS} tensor bias: f32[h, s, s] "
                           "mask = causal score = score + bias[h, q, k] }")
    bias = torch.randn(4, S, S, device=DEV).requires_grad_(True)
    qg = q.detach().requires_grad_(True)
    for _ in range(2):
        o = biased(qg, k, v, bias=bias, **KW)
        torch.autograd.grad(o.float().sum(), (qg, bias))
    assert answered == [True] and not biased._bound_backward


# ---------------------------------------------------------------- the Gluon passes' host side
@pytest.fixture
def gluon_host(monkeypatch):
    """The Gluon passes taken on the CPU as on an H200 (their refusal answering None, a stream 0):
    every launch recorded -- (kernel, grid, arguments) -- instead of run."""
    if GPU or not GB.HAS_GLUON or not runtime.interpreted():
        pytest.skip("the Gluon passes' host side on the CPU (the GPU runs them)")
    from types import SimpleNamespace
    from triton.runtime import driver
    from attnc.compiler import dispatch
    monkeypatch.setattr(runtime, "marks_on_device", lambda t: True)
    monkeypatch.setattr(dispatch, "device_default", lambda device: "triton")
    monkeypatch.setattr(GB, "refusal", lambda *a, **k: None)
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_stream=lambda device: 0,
                                                           get_current_device=lambda: 0))
    seen = []

    def launch(self, grid, args, key=None, stream=None):
        seen.append((getattr(self.fn, "__name__", "?"), tuple(grid), args + self.tail, key))
    monkeypatch.setattr(L.Launcher, "launch", launch)
    return seen


def _described(a):
    """A launch argument as a comparison sees it: a tensor by layout (and by address where it is a
    plan's array or an input), a TMA descriptor by its tensor's layout and box."""
    if hasattr(a, "block_shape"):
        return ("desc", tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.base.data_ptr())
    if hasattr(a, "data_ptr"):
        return ("tensor", tuple(a.shape), a.stride(), a.dtype)
    return a


def test_the_gluon_passes_get_the_validating_paths_arguments(gluon_host, monkeypatch):
    attn = attnc.compile("attention bb_gluon { dtype = f16 mask = causal }")
    q, k, v = qkv(b=1, hq=2, hkv=2, s=128, d=128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(DEV, DT)
    o = attn(q, k, v, **KW)
    for _ in range(3):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    names = [n for n, *_ in gluon_host]
    assert names[-3:] == ["_bwd_delta", "_bwd_dkdv_ws", "_bwd_dq_ws"] and len(names) == 10  # (1 forward)
    assert len(attn._bound_backward) == 1 and all(attn._bound_backward.values())
    validating, bound = gluon_host[1:4], gluon_host[-3:]
    for (n1, g1, a1, k1), (n2, g2, a2, k2) in zip(validating, bound):
        assert (n1, g1, k1) == (n2, g2, k2) and len(a1) == len(a2)
        assert [_described(x) for x in a1] == [_described(x) for x in a2]


def test_the_gluon_passes_take_inputs_encoded_where_they_launch_raw(gluon_host, monkeypatch):
    """Where a pass launches raw (``raw_launch``), q, k and v go to it encoded once per address
    (``raw_launch.Encoded``: no tensor kept); a launch hook turns that off (the launch then takes
    TensorDescriptors, as ``Launcher.launch`` does with hooks)."""
    from attnc.backends.triton.raw_launch import Encoded
    attn = attnc.compile("attention bb_enc { dtype = f16 mask = causal }")
    q, k, v = qkv(b=1, hq=2, hkv=2, s=128, d=128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEV, DT)
    o = attn(q, k, v, **KW)
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # validated, then bound
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    gluon = next(b for b in attn._bound_backward.values() if b).launch()
    key = gluon_host[-1][3]
    encoded = []

    class FakeRaw:
        positions = (0, 1, 2, 3)

        def encode(self, p, desc):
            encoded.append((p, desc.base.data_ptr()))
            return Encoded([p])
    for lz in (gluon.dkdv, gluon.dq):
        lz.raw[key] = FakeRaw()
    gluon_host.clear()
    for _ in range(2):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    dkdv, dq = gluon_host[1][2], gluon_host[2][2]
    assert [type(a) for a in dkdv[:3]] == [Encoded] * 3 and [type(a) for a in dq[:3]] == [Encoded] * 3
    assert sorted(encoded) == sorted([(0, q.data_ptr()), (1, k.data_ptr()), (2, v.data_ptr())] * 2)  # once each
    assert not any(hasattr(desc, "base") for _, desc in gluon.descs.values())  # (no input's tensor kept)
    runtime_knobs = L._knobs().runtime
    monkeypatch.setattr(runtime_knobs, "launch_enter_hook", lambda *a: None)
    gluon_host.clear()
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    assert all(hasattr(a, "block_shape") for a in gluon_host[1][2][:3])


@pytest.mark.skipif(not GPU, reason="the real passes (ATTNC_TEST_GPU=1 on a GPU)")
def test_gpu_bound_backward_is_bit_identical_and_deterministic(answered, monkeypatch):
    spec = f"attention bb_gpu {{ dtype = {DTS} mask = causal }}"
    attn = attnc.compile(spec)
    q, k, v = qkv(b=1, hq=4, hkv=2, s=512, d=128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEV, DT)
    got = [grads(attn, q, k, v, do) for _ in range(3)]
    assert answered == [True, True]
    unbound(monkeypatch)
    reference = grads(attnc.compile(spec), q, k, v, do)
    for g in got:
        same(g, reference)
