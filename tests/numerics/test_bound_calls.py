"""Bound calls (``backends/triton/bound.py``): a prefill call whose signature ran before skips the
layers between the front door and the launch, and answers exactly what the validating path
answers; every check that reads values still runs per call (a mask tensor changed in place, a
plan the cache dropped, the rows' non-finite rule).  On the CPU the kernels run in Triton's
interpreter with the calls on a GPU call's path for the non-finite rule (``runtime.
marks_on_device``); with ATTNC_TEST_GPU=1 on the GPU, where the bound launch goes straight to the
C launcher."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.backends.triton import bound  # noqa: E402
from attnc.backends.triton import plans as P  # noqa: E402
from attnc.compiler.errors import AttncError, PlanError  # noqa: E402

from tests.conftest import bound_answers, triton_setting  # noqa: E402

DEV, GPU, DT, DTS, KW = triton_setting()
S, D = (384, 64) if GPU else (40, 16)  # (a GPU's Gluon engine takes d 64; 384 rows: tiles past S)


@pytest.fixture
def answered(monkeypatch):
    """The calls the bound path answered (a list of True per bound call that took its call, False
    per one that declined), the calls on a GPU call's non-finite path (``bound_answers``)."""
    return bound_answers(monkeypatch, bound.BoundPrefill)


def qkv(b=2, hq=2, hkv=2, s=S, d=D, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    make = [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    return [torch.randn(*shape, generator=g).to(device=DEV, dtype=DT).requires_grad_(grad) for shape in make]


def reference(spec: str, q, k, v, **tensors):
    """O by the numpy backend (float64 inside) on the same inputs."""
    attn = attnc.compile(spec)
    cpu = {n: t.cpu() for n, t in tensors.items()}
    return attn(*(x.detach().cpu() for x in (q, k, v)), backend="numpy", **cpu).float()


def close(o, ref):
    assert torch.allclose(o.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_a_repeated_call_is_answered_by_its_bound_call_bit_for_bit(answered):
    spec = f"attention bc_causal {{ dtype = {DTS} mask = causal }}"
    attn = attnc.compile(spec)
    q, k, v = qkv()
    o1, lse1 = attn(q, k, v, return_lse=True, **KW)  # validated, planned, launched: then bound
    assert answered == []
    o2, lse2 = attn(q, k, v, return_lse=True, **KW)
    o3 = attn(*(x.clone() for x in (q, k, v)), **KW)  # other tensors, the same signature
    assert answered == [True, True]
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2) and torch.equal(o1, o3)
    close(o2, reference(spec, q, k, v))


def test_another_signature_is_validated_first(answered):
    attn = attnc.compile(f"attention bc_sig {{ dtype = {DTS} mask = causal }}")
    q, k, v = qkv()
    attn(q, k, v, **KW)
    attn(q, k, v, **KW)
    q2, k2, v2 = qkv(s=S // 2 + 3)  # a new length: its own validation, plan and binding
    attn(q2, k2, v2, **KW)
    assert answered == [True]
    with pytest.raises(AttncError, match="head_dim|d_qk|head dim|shape"):
        attn(q, k[..., :-1].contiguous(), v, **KW)  # a bad call is never a bound call's: the located error
    assert answered == [True]


def test_a_mask_tensor_changed_in_place_is_planned_again(answered):
    spec = f"attention bc_doc {{ dtype = {DTS} tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }}"
    attn = attnc.compile(spec)
    q, k, v = qkv()
    doc = (torch.arange(S) // (S // 3)).to(torch.int32).expand(2, S).contiguous().to(DEV)
    attn(q, k, v, doc=doc, **KW)
    o_before = attn(q, k, v, doc=doc, **KW)
    assert answered == [True]
    doc[:, : S // 2] = 7  # the same tensor, new values (its version moves)
    o_after = attn(q, k, v, doc=doc, **KW)
    assert answered == [True, False]  # declined: the validating path re-planned
    close(o_after, reference(spec, q, k, v, doc=doc))
    assert not torch.equal(o_before, o_after)
    attn(q, k, v, doc=doc, **KW)
    assert answered == [True, False, True]  # bound again


def test_a_plan_the_cache_dropped_is_made_again(answered):
    import gc
    import weakref
    spec = f"attention bc_drop {{ dtype = {DTS} mask = causal & window(8) }}"
    attn = attnc.compile(spec)
    q, k, v = qkv()
    o1 = attn(q, k, v, **KW)
    attn(q, k, v, **KW)
    dropped = weakref.ref(next(b for b in attn._bound.values() if b)[0].launch())
    P.PLANS.clear()
    gc.collect()
    assert dropped() is None  # (nothing bound keeps a plan the cache let go: its device arrays are freed)
    o2 = attn(q, k, v, **KW)
    o3 = attn(q, k, v, **KW)
    assert answered == [True, False, True]
    assert torch.equal(o1, o2) and torch.equal(o1, o3)


def test_the_non_finite_rule_holds_on_bound_calls(answered, monkeypatch):
    attn = attnc.compile(f"attention bc_nan {{ dtype = {DTS} mask = causal }}")
    q, k, v = qkv()
    attn(q, k, v, **KW)
    attn(q, k, v, **KW)
    bad = q.clone()
    bad[1, 0, 5, 0] = float("nan")
    attn(bad, k, v, **KW)  # bound: the kernel marks the row, the check raises it
    assert answered == [True, True]
    with pytest.raises(PlanError, match="NaN or \\+inf"):
        attn.check_numerics()
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "1")  # rows checked at the call: the bound call declines
    with pytest.raises(PlanError, match="NaN or \\+inf"):
        attn(bad, k, v, **KW)
    assert answered == [True, True, False]


def test_gqa_token_major_views_and_training_forwards_are_bound(answered):
    spec = f"attention bc_gqa {{ dtype = {DTS} mask = causal }}"
    attn = attnc.compile(spec)
    q, k, v = qkv(hq=4, hkv=2)
    tq, tk, tv = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # token-major views
    o1 = attn(tq, tk, tv, **KW)
    o2 = attn(tq, tk, tv, **KW)
    assert answered == [True] and torch.equal(o1, o2) and o2.stride() == o1.stride()
    close(o2, reference(spec, q, k, v))
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    grads = []
    for _ in range(2):
        o = attn(qg, kg, vg, **KW)
        grads.append(torch.autograd.grad(o.float().square().sum(), (qg, kg, vg)))
    assert answered[1:] == [True]  # the second training forward: bound, and its backward the same
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_a_spec_that_reads_the_lengths_keeps_them_per_signature(answered):
    """S_q and S_k as the mask reads them (a top-left causal over fewer rows than keys): the bound
    call's lengths are its signature's, the same answer as the validating path's."""
    spec = f"attention bc_len {{ dtype = {DTS} mask = k <= q - (S_k - S_q) }}"
    attn = attnc.compile(spec)
    q, _, _ = qkv(s=S // 2)
    _, k, v = qkv(seed=1)
    o1 = attn(q, k, v, **KW)
    o2 = attn(q, k, v, **KW)
    assert answered == [True] and torch.equal(o1, o2)
    close(o2, reference(spec, q, k, v))


def test_the_raw_branch_hands_the_c_launcher_the_launchs_own_arguments(answered, monkeypatch):
    """The bound launch's C-launcher branch, on the CPU with a stand-in C launcher (a GPU runs the
    real one below): the grid, the current stream and the same arguments, in the same order, as
    the launch layer hands the kernel on the validating path."""
    if GPU:
        pytest.skip("the GPU test below runs the real C launcher")
    from types import SimpleNamespace
    from triton.runtime import driver
    from attnc.backends.triton import launch as L
    attn = attnc.compile(f"attention bc_fake {{ dtype = {DTS} mask = causal & window(9) }}")
    q, k, v = qkv()
    attn(q, k, v, **KW)
    seen = []
    original = L.Launcher.launch

    def spy(self, grid, args, key=None, stream=None):
        seen.append((tuple(grid), args + self.tail, key))
        return original(self, grid, args, key, stream)
    monkeypatch.setattr(L.Launcher, "launch", spy)
    attn(q, k, v, **KW)  # bound, not raw here: through the launch layer
    assert answered == [True] and len(seen) == 1
    grid, want, key = seen[0]
    launch = next(b for b in attn._bound.values() if b)[0].launch()
    calls = []

    class FakeRaw:
        positions = ()

        def __call__(self, g, stream, args):
            calls.append((g, stream, args))
    launch.launcher.raw[key] = FakeRaw()
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_stream=lambda device: 1234,
                                                           get_current_device=lambda: 0))
    attn(q, k, v, **KW)
    assert answered == [True, True] and len(seen) == 1 and len(calls) == 1  # (not through the launch layer)
    g, stream, got = calls[0]
    assert g == grid + (1,) * (3 - len(grid)) and stream == 1234 and len(got) == len(want)
    for a, b in zip(got, want):
        if hasattr(a, "data_ptr"):  # O and LSE are new each call: their layout; the rest the same tensors
            assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
            if a.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()):
                assert a.data_ptr() == b.data_ptr()
        else:
            assert a == b
    assert launch.launcher.launches["raw"] >= 1


@pytest.mark.skipif(not GPU, reason="the C launcher (ATTNC_TEST_GPU=1 on a GPU)")
def test_gpu_a_bound_call_launches_through_the_c_launcher(answered):
    attn = attnc.compile(f"attention bc_raw {{ dtype = {DTS} mask = causal }}")
    q, k, v = qkv()
    o1 = attn(q, k, v, **KW)
    o2 = attn(q, k, v, **KW)
    runs = [r for b in attn._bound.values() if b for r in b[0].launch().bound_runs.values()]
    assert answered == [True] and runs and all(r.raw is not None for r in runs)
    before = sum(r.launcher.launches["raw"] for r in runs)
    o3 = attn(q, k, v, **KW)
    assert sum(r.launcher.launches["raw"] for r in runs) == before + 1
    assert torch.equal(o1, o2) and torch.equal(o1, o3)
