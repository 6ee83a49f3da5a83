"""Learned attention sinks (``sink = expr``) on the Triton kernels (CPU interpreter unless
ATTNC_TEST_GPU=1) against the float64 oracle: prefill with rows that see nothing (LSE = sink),
a paged mixed batch through the split producer and combine (the combine adds the sink once, not
per split; an empty request's row gets the sink; every state ABI, the shared shift's guard
included), a NaN sink and a read outside the sink's
tensor (the oracle's errors), dQ, dK, dV and the sink's tensor gradient through attnc.compile's
autograd, and the path that refuses a sink with the reason (a sink whose reads depend on tensor
values).  The Gluon engines' sinks: tests/numerics/test_gluon_sinks.py; the host backends:
tests/unit/test_sinks.py."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.errors import PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

DEVICE = "cpu" if runtime.interpreted() else "cuda"
# GQA; positions 0 and 4 see no key (their rows get O = 0 and LSE = the sink)
SPEC = ("attention s {{ heads = 4 / 2 head_dim = 16 dtype = {dtype} tensor sinks: f32[h] ~ uniform(-2.0, 2.0) "
        "mask = causal & (k > 0 | q > 2) & (q != 4) sink = {sink} {extra} }}")


def program(sink="sinks[h] * 0.5 + b", dtype="f32", extra=""):
    return compile_spec(SPEC.format(sink=sink, dtype=dtype, extra=extra), "s.attn")


def _dev(arrays):
    return {n: torch.from_numpy(np.asarray(a)).to(DEVICE) for n, a in arrays.items()}


def _prefill(p, arrays):
    t = _dev(arrays)
    if p.dtype == "bf16":
        t.update({n: t[n].to(torch.bfloat16) for n in "qkv"})
    return runtime.load(p)(t["q"], t["k"], t["v"], return_lse=True, **{x.name: t[x.name] for x in p.tensors})


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_prefill_and_append_match_the_oracle(dtype):
    p = program(dtype=dtype)
    for batch, s_q, s_k in ((2, 6, 9), (1, 20, 20)):
        arrays = inputs.sample(p, batch, s_q, s_k, seed=s_k)
        call = inputs.validate(p, arrays)
        want = oracle.reference(p, call.q, call.k, call.v, call.tensors)
        o, lse = _prefill(p, arrays)
        for c in numerics.compare_outputs(dtype, o.float().cpu().numpy(), lse.cpu().numpy(), *want):
            assert c.ok, f"{dtype} {s_q}x{s_k}: {c}"


@pytest.mark.parametrize("state", ["lse_o", "mlu", "shared_shift(0.0, -30.0, 30.0)", "shared_shift(0.0, -2.5, 2.5)"],
                         ids=["lse_o", "mlu", "shift", "shift_fallback"])
def test_split_decode_adds_the_sink_once_per_row(state):
    """The shared shift adds exp(sink - phi) to its sums under the guard; a sink of 3.0 leaves the
    window (-2.5, 2.5) and its rows take the fallback, whose combine joins it exactly."""
    split = "" if "shift" in state else "split = balanced(3)"  # (the shared frame's kernels take split = auto)
    p = program("sinks[h]", extra=f"cache = paged(page_size = 4) {split} state = {state}")
    arrays = inputs.sample_cache(p, [13, 0, 6], q_lens=[3, 1, 1], seed=3)
    arrays["sinks"] = np.array([0.5, -1.0, 3.0, -np.inf], np.float32)
    want = oracle.reference_cache(p, inputs.validate_cache(p, arrays))
    o, lse = runtime.load(p).run(_dev(arrays), return_lse=True)
    for c in numerics.compare_outputs("f32", o.cpu().numpy(), lse.cpu().numpy(), *want):
        assert c.ok, f"{state}: {c}"
    # the empty request's row: O = 0, LSE = the sinks (the shared frame's phi + log exp(sink - phi) rounds)
    np.testing.assert_allclose(lse[3].cpu().numpy(), arrays["sinks"], rtol=0, atol=1e-6)
    assert not o[3].any()


def test_a_bad_sink_is_the_oracles_error(monkeypatch):
    # (a GPU call whose score program cannot fail only marks a device flag; ATTNC_CHECK_FINITE=1
    # makes it raise at the call, naming the row, as the host paths do)
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "1")
    p = program("sinks[h]")
    arrays = inputs.sample(p, 1, 5, 5, seed=0)
    call = inputs.validate(p, arrays)
    arrays["sinks"] = np.array([0.0, np.nan, 0.0, 0.0], np.float32)
    with pytest.raises(PlanError) as want:
        oracle.reference(p, call.q, call.k, call.v, {"sinks": arrays["sinks"]})
    with pytest.raises(PlanError) as got:
        _prefill(p, arrays)
    assert str(got.value) == str(want.value) and "or the row's sink is NaN or +inf" in str(want.value)
    shifted = program("sinks[h + 1]")
    with pytest.raises(PlanError) as want:
        oracle.reference(shifted, call.q, call.k, call.v, call.tensors)
    with pytest.raises(PlanError) as got:
        _prefill(shifted, {**arrays, "sinks": call.tensors["sinks"]})
    assert str(got.value) == str(want.value) and "tensor 'sinks' read out of range" in str(want.value)
    paged = program("sinks[h + 1]", extra="cache = paged(page_size = 4)")  # the split calls check it too
    cache = inputs.sample_cache(paged, [9, 5], seed=1)
    with pytest.raises(PlanError) as got:
        runtime.load(paged).run(_dev(cache))
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("body", ["sink = sinks[h] * 2.0", "score = score + sinks[h] sink = sinks[h] * 2.0"],
                         ids=["sink", "score_and_sink"])
def test_backward_gives_dq_dk_dv_and_the_sinks_gradient(body):
    """The sink's tensor gets dL/dsink through the sink's derivative; read by the score program too,
    the two gradients add."""
    attn = attnc.compile("attention g { heads = 4 / 2 head_dim = 16 dtype = f32 tensor sinks: f32[h] "
                         f"mask = causal & (k > 0 | q > 1) {body} }}")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(2, 2, 7, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    s = torch.randn(4, generator=gen).to(DEVICE).requires_grad_()
    o, lse = attn(q, k, v, sinks=s, return_lse=True, backend="triton")
    g_o, g_lse = torch.randn(o.shape, generator=gen).to(DEVICE), torch.randn(lse.shape, generator=gen).to(DEVICE)
    ((o * g_o).sum() + (lse * g_lse).sum()).backward()
    f64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    want = oracle.reference_backward(attn.program, *(f64(x) for x in (q, k, v)), f64(g_o), {"sinks": f64(s)},
                                     dlse=f64(g_lse))
    for name, got, ref in (("dQ", q.grad, want[0]), ("dK", k.grad, want[1]), ("dV", v.grad, want[2]),
                           ("dsinks", s.grad, want[3]["sinks"])):
        c = numerics.compare_gradient(name, "f32", f64(got), ref)
        assert c.ok, str(c)


def test_a_sink_read_chosen_by_a_tensor_value_is_refused():
    with pytest.raises(PlanError, match="reads a tensor element chosen by a tensor's value"):
        runtime.load(program("sinks[slot[h]]", extra="tensor slot: i32[h] ~ randint(0, 4)"))


@pytest.mark.parametrize("sink, at_call", [("sinks[h]", False), ("sinks[h] * 0.5 + b", False),
                                           ("exp(sinks[h])", True), ("sinks[h] * 1e30", True)])
def test_a_gpu_call_checks_its_rows_at_the_call_only_where_the_sink_can_make_a_non_finite_value(
        sink, at_call, monkeypatch):
    """A tensor's values are inputs, as q and K are: ``sinks[h]`` makes nothing non-finite from finite
    ones, so a GPU call marks its rows on the device (no host sync); ``exp`` or a product that may
    overflow checks at the call, as a score program that can does.  (The device flag's own test:
    test_gluon_sinks.py, on an H200.)"""
    monkeypatch.setattr(runtime, "marks_on_device", lambda t: True)
    monkeypatch.delenv(runtime.CHECK_FINITE_VAR, raising=False)
    kernel = runtime.load(program(sink))
    q = torch.zeros(1, 4, 2, 16)
    assert kernel._row_check(q)[0] is at_call
