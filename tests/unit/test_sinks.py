"""Learned attention sinks (``sink = expr``, compiler/sinks.py) on the host paths: the float64
oracle against a brute force with the sink as one more key of value 0, numpy (tiled prefill,
split decode with an empty request and a mixed batch), the AHBM programs (prefill, decode, its
tree over 2 PEs, the ring), dSink (finite differences, the numpy float64 backward, gradcheck
through attnc.compile), a NaN sink reported like a NaN score, and the checker's errors (their
goldens: tests/golden/diagnostics/sink_*).  Triton: tests/numerics/test_triton_sinks.py;
context parallelism: tests/integrations/test_distributed.py (case 'sinks')."""
from __future__ import annotations

import numpy as np
import pytest

from attnc.backends.ahbm import runtime as ahbm
from attnc.backends.numpy import runtime as numpy_backend
from attnc.compiler import inputs, numerics, oracle
from attnc.compiler.errors import PlanError, SpecError
from attnc.compiler.lower import compile_spec
from attnc.compiler.printer import print_program

# GQA, and rows that see nothing: position 0 (its only key, k = 0, is hidden) and position 4
SPEC = ("attention s {{ heads = 4 / 2 head_dim = 8 dtype = f32 tensor sinks: f32[h] ~ uniform(-2.0, 2.0) "
        "mask = causal & (k > 0 | q > 2) & (q != 4) sink = {sink} }}")


def program(sink: str = "sinks[h] * 0.5 + b"):
    return compile_spec(SPEC.format(sink=sink), "s.attn")


def _brute(p, q, k, v, tensors):
    """O and LSE with the sink as one more key whose value is 0 (float64, row by row)."""
    from attnc.compiler import sinks
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, hq, s_q, _ = q.shape
    s_k = k.shape[2]
    sink = sinks.values(p, batch, tensors).astype(np.float64)
    o, lse = np.zeros((batch, hq, s_q, v.shape[3])), np.zeros((batch, hq, s_q))
    for b in range(batch):
        for h in range(hq):
            for i in range(s_q):
                pos = s_k - s_q + i
                keys = [j for j in range(s_k) if j <= pos and (j > 0 or pos > 2) and pos != 4]
                s = np.array([q[b, h, i] @ k[b, h // p.group, j] * p.scale for j in keys] + [sink[b, h]])
                lse[b, h, i] = np.log(np.exp(s).sum())
                w = np.exp(s[:-1] - lse[b, h, i])
                o[b, h, i] = w @ v[b, h // p.group, keys] if keys else 0.0
    return o, lse


def _call(p, batch, s_q, s_k, seed=0):
    arrays = inputs.sample(p, batch, s_q, s_k, seed=seed)
    return arrays, {t.name: arrays[t.name] for t in p.tensors}, inputs.validate(p, arrays)


def test_the_oracle_is_the_sink_as_one_more_key():
    p = program()
    arrays, tensors, call = _call(p, 2, 6, 9)
    o, lse = oracle.reference(p, call.q, call.k, call.v, call.tensors)
    want_o, want_lse = _brute(p, call.q, call.k, call.v, call.tensors)
    assert np.abs(o - want_o).max() < 1e-12 and np.abs(lse - want_lse).max() < 1e-12
    empty = ~oracle.dense_mask(p, 2, 6, 9, call.tensors).any(-1)
    assert empty.any() and (o[empty] == 0).all()  # a row that sees no key: O = 0, LSE = the sink
    sink = (np.float32(0.5) * tensors["sinks"][None, :] + np.arange(2)[:, None]).astype(np.float32)
    assert np.array_equal(lse[empty], np.broadcast_to(sink[..., None], lse.shape)[empty])


def test_a_sink_of_minus_infinity_is_no_sink_and_nan_is_reported():
    p, plain = program("sinks[h]"), compile_spec(SPEC.format(sink="0.0").replace(" sink = 0.0", ""))
    arrays, tensors, call = _call(p, 1, 5, 5)
    none = {"sinks": np.full(4, -np.inf, np.float32)}
    o, lse = oracle.reference(p, call.q, call.k, call.v, none)
    want_o, want_lse = oracle.reference(plain, call.q, call.k, call.v, none)
    assert np.array_equal(o, want_o) and np.array_equal(lse, want_lse)
    assert np.isneginf(lse).any()  # rows that see nothing, with no sink
    bad = {"sinks": np.array([0.0, np.nan, 0.0, 0.0], np.float32)}
    kernels = {"numpy": lambda: numpy_backend.load(p)(arrays["q"], arrays["k"], arrays["v"], **bad),
               "ahbm": lambda: ahbm.load(p)(arrays["q"], arrays["k"], arrays["v"], **bad),
               "oracle": lambda: oracle.reference(p, call.q, call.k, call.v, bad)}
    for name, run in kernels.items():
        with pytest.raises(PlanError, match=r"query row \(b=0, h=1, q=0\) is NaN: .* or the row's sink is NaN"):
            run()


@pytest.mark.parametrize("shape", [(2, 6, 9), (2, 1, 7), (1, 20, 20)], ids=["append", "decode", "prefill"])
def test_numpy_and_ahbm_match_the_oracle(shape):
    batch, s_q, s_k = shape
    p = program()
    arrays, tensors, call = _call(p, batch, s_q, s_k, seed=s_k)
    want = oracle.reference(p, call.q, call.k, call.v, call.tensors)
    qkv = (arrays["q"], arrays["k"], arrays["v"])
    packed = arrays["q"].transpose(0, 2, 1, 3).reshape(batch * s_q, p.heads_q, p.d_qk)
    o, lse = numpy_backend.load(p, family="decode_split").run(
        {"q": packed, "k": arrays["k"], "v": arrays["v"], "kv_lens": np.full(batch, s_k),
         "q_lens": np.full(batch, s_q), **tensors}, return_lse=True)
    got = {"numpy": numpy_backend.load(p, block_m=4, block_n=4)(*qkv, return_lse=True, **tensors),
           "numpy-split": (o.reshape(batch, s_q, p.heads_q, -1).transpose(0, 2, 1, 3),
                           lse.reshape(batch, s_q, p.heads_q).transpose(0, 2, 1)),
           "ahbm": ahbm.load(p)(*qkv, return_lse=True, **tensors),
           "ahbm-sp": ahbm.load(p, sp=2)(*qkv, return_lse=True, **tensors)}
    for name, (o, lse) in got.items():
        for c in numerics.compare_outputs("f32", o, lse, *want):
            assert c.ok, f"{name}: {c}"


def test_split_decode_adds_the_sink_once_per_row():
    """A paged mixed batch with an empty request (its row sees nothing: LSE = sink) and a split
    policy of 3 splits: the combine adds the sink once, not once per split."""
    text = SPEC.format(sink="sinks[h]").replace("dtype = f32", "dtype = f32 cache = paged(page_size = 4) "
                                                "split = balanced(3)")
    p = compile_spec(text)
    arrays = inputs.sample_cache(p, [13, 0, 6], q_lens=[3, 1, 1], seed=3)
    arrays["sinks"] = np.array([0.5, -1.0, 3.0, -np.inf], np.float32)
    o, lse = numpy_backend.load(p).run(arrays, return_lse=True)
    want_o, want_lse = oracle.reference_cache(p, inputs.validate_cache(p, arrays))
    for c in numerics.compare_outputs("f32", o, lse, want_o, want_lse):
        assert c.ok, str(c)
    assert np.array_equal(lse[3], arrays["sinks"]) and not o[3].any()  # request 1: no keys


def test_dsink_is_the_derivative():
    """dL/dsink against central differences of the float64 oracle (L = <O, g_o> + <LSE, g_lse>),
    through a sink that reads its tensor twice; the numpy float64 backward agrees."""
    p = program("sinks[h] * sinks[h // 2] + 0.25")
    arrays, tensors, call = _call(p, 2, 5, 7)
    s0 = call.tensors["sinks"].astype(np.float64)
    rng = np.random.default_rng(1)
    g_o, g_lse = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 4, 5))

    def loss(s):
        o, lse = oracle.reference(p, call.q, call.k, call.v, {"sinks": s}, wide=True)
        return (o * g_o).sum() + (lse * g_lse).sum()

    eps, numeric = 1e-6, np.zeros(4)
    for i in range(4):
        e = np.eye(4)[i] * eps
        numeric[i] = (loss(s0 + e) - loss(s0 - e)) / (2 * eps)
    ref = oracle.reference_backward(p, call.q, call.k, call.v, g_o, {"sinks": s0}, dlse=g_lse)
    assert np.abs(ref[3]["sinks"] - numeric).max() < 1e-6
    kernel = numpy_backend.load(p)
    o, lse = kernel.forward64(arrays["q"], arrays["k"], arrays["v"], sinks=s0)
    got = kernel.backward(arrays["q"], arrays["k"], arrays["v"], o, lse, g_o, g_lse, sinks=s0)
    for g, want in zip((*got[:3], got[3]["sinks"]), (*ref[:3], ref[3]["sinks"])):
        assert np.abs(g - want).max() < 1e-12


def test_gradcheck_through_attnc_compile():
    torch = pytest.importorskip("torch")
    import attnc
    attn = attnc.compile("attention g { heads = 4 / 2 head_dim = 8 tensor sinks: f32[h] "
                         "mask = causal & (k > 0 | q > 1) sink = sinks[h] }")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    s = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, s: attn(q, k, v, sinks=s, return_lse=True), (q, k, v, s))


def test_the_ir_and_its_digest_carry_the_sink():
    a, b = program("sinks[h]"), program("sinks[h] + 1.0")
    from attnc.compiler import ir
    assert ir.digest(a) != ir.digest(b)
    assert '"attn.sink_program"() ({\n    ^bb0(%b: i32, %h: i32):' in print_program(a)


@pytest.mark.parametrize("sink, message", [
    ("sinks[q]", "'q' is the query position; a sink depends only on the request 'b' and the query head 'h'"),
    ("S_k * 0.5", "'S_k' is the request's length"),
    ("where(window(4), 1.0, 0.0)", "'window' is a condition on q and k"),
    ("score", "'score' is not available in the sink"),
    ("ids[h]", "sink is i32; a sink is an f32 logit"),
    ("h > 1", "sink is a condition"),
])
def test_the_checker_refuses_what_a_sink_cannot_be(sink, message):
    text = SPEC.format(sink=sink).replace("tensor sinks", "tensor ids: i32[h] tensor sinks")
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compile_spec(text)


@pytest.mark.parametrize("decl, sink, on_device", [
    ("tensor sinks: f32[h]", "sinks[h]", True), ("tensor sinks: f32[h]", "2.0 * sinks[h] - 1.0", True),
    ("tensor sk: f32[b, h]", "sk[b, h]", True), ("tensor sk: f32[h] tensor tb: f32[b]", "sk[h] * 3.0 + tb[b]", True),
    ("tensor sk: f32[h]", "sk[h // 2]", True),
    ("tensor sk: f32[h]", "sk[h] * sk[h]", False), ("tensor sk: f32[h]", "exp(sk[h])", False),
    ("tensor sk: f32[h]", "sk[h % 3]", False)])  # (elements read by 3, 3 and 2 heads)
def test_the_sink_tensor_gradients_reduce_without_tensor_values_where_they_can(decl, sink, on_device):
    """``sinks.reduction`` (the Triton backward's device path: a gather and a fixed-order sum, no
    host sync) gives what the host's evaluation gives, and declines what needs tensor values or
    reads elements unevenly."""
    from attnc.compiler import sinks
    p = compile_spec(f"attention t {{ heads = 8/2 head_dim = 8 dtype = f32 {decl} mask = causal sink = {sink} }}")
    batch, rng = 3, np.random.default_rng(0)
    shapes = {t.name: tuple(batch if a == "b" else 8 for a in t.axes) for t in p.tensors}
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    dsink = rng.standard_normal((batch, 8))
    want = sinks.tensor_gradients(p, dsink, tensors)
    red = sinks.reduction(p, batch, shapes)
    assert (red is not None) == on_device
    if red is None:
        return
    assert set(red.parts) == set(want)
    for n, (scale, order, targets, count) in red.parts.items():
        got = np.zeros(int(np.prod(shapes[n])))
        got[targets] = (dsink * scale).reshape(-1)[order].reshape(-1, count).sum(1)
        np.testing.assert_allclose(got.reshape(shapes[n]), want[n], rtol=1e-12, atol=1e-12)
