"""Training through the front door: ``attnc.compile(spec)(q, k, v)`` is differentiable.

gradcheck in float64 on the numpy path (q, k, v and a learned bias), the float32 call against
torch's dense autograd (GQA, empty rows, a document mask read from a tensor), the Triton kernel
(interpreter) against the numpy path, torch.compile through the custom op's autograd, refusals,
and a 50-step training run that follows the same model with eager attention."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attnc.compile runs on torch tensors")

import attnc  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402

# the Triton backend's device: the GPU under ATTNC_TEST_GPU=1, else the CPU interpreter
TRITON_DEVICE = "cuda" if os.environ.get("ATTNC_TEST_GPU") == "1" and torch.cuda.is_available() else "cpu"
DOC = "attention d { heads = 4 / 2 head_dim = 8 tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"
BIAS = ("attention lb { heads = 2 head_dim = 4 tensor bias: f32[h, s, s] score = score + bias[h, q, k] "
        "score = softcap(score, 5.0) mask = causal }")


def _dense(q, k, v, visible, scale, bias=None):
    """Eager attention: dense masked softmax (empty rows give 0), GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = 5.0 * torch.tanh((s + bias) / 5.0)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def test_gradcheck_float64_numpy_path():
    attn = attnc.compile(DOC)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, doc=doc), (q, k, v))


def test_gradcheck_learned_bias_and_lse():
    attn = attnc.compile(BIAS)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(q, k, v, bias):
        o, lse = attn(q, k, v, bias=bias, return_lse=True)
        return o, torch.where(torch.isfinite(lse), lse, 0.0)
    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_float32_call_matches_dense_autograd_with_gqa_and_empty_rows():
    attn = attnc.compile("attention e { heads = 4 / 2 head_dim = 8 mask = causal & q >= 5 }")
    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(2, h, 9, 8, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    do = torch.randn(2, 4, 9, 8, generator=gen)
    (attn(*leaves) * do).sum().backward()
    got = [x.grad.clone() for x in leaves]
    ref = [x.detach().double().requires_grad_() for x in leaves]
    pos = torch.arange(9)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] >= 5)
    (_dense(*ref, visible, 8 ** -0.5) * do.double()).sum().backward()
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all()
        assert torch.allclose(g.double(), r.grad, atol=1e-5, rtol=1e-4)
    assert (got[0][:, :, :5] == 0).all()  # rows that see no key get no gradient


def test_triton_kernel_gradients_match_the_numpy_path():
    pytest.importorskip("triton")
    attn = attnc.compile(DOC)
    gen = torch.Generator().manual_seed(3)
    doc = torch.tensor([[0] * 7 + [1] * 9], dtype=torch.int32)
    base = [torch.randn(1, h, 16, 8, generator=gen) for h in (4, 2, 2)]
    do = torch.randn(1, 4, 16, 8, generator=gen)
    grads = {}
    for backend, dev in (("numpy", "cpu"), ("triton", TRITON_DEVICE)):
        leaves = [x.clone().to(dev).requires_grad_() for x in base]
        (attn(*leaves, doc=doc.to(dev), backend=backend) * do.to(dev)).sum().backward()
        grads[backend] = [x.grad.cpu() for x in leaves]
    for a, b in zip(grads["numpy"], grads["triton"]):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)


def test_an_unordered_backward_is_asked_at_compile_and_reaches_the_engine_choice(monkeypatch):
    """``attnc.compile(spec, deterministic=False)``: its own handle (the same spec compiled twice,
    both registered), the flag handed to the Triton backend's backward (whose choice of passes gives
    it to ``gluon_backward.default_config``: the Gluon passes take dQ unordered), the same gradients
    where no pass adds out of order (the CPU's numpy and interpreted Triton backwards)."""
    pytest.importorskip("triton")
    from attnc.backends.triton import backward_calls, gluon_backward as GB
    asked = []
    backward = backward_calls.BackwardCalls._backward

    def spy(self, *args):
        asked.append(args[-1])  # (its last argument: deterministic)
        return backward(self, *args)
    monkeypatch.setattr(backward_calls.BackwardCalls, "_backward", spy)
    ordered, unordered = attnc.compile(DOC), attnc.compile(DOC, deterministic=False)
    assert ordered.deterministic and not unordered.deterministic and ordered.handle != unordered.handle
    gen = torch.Generator().manual_seed(4)
    doc = torch.tensor([[0] * 9 + [1] * 7], dtype=torch.int32)
    base = [torch.randn(1, h, 16, 8, generator=gen) for h in (4, 2, 2)]
    grads = {}
    for attn in (ordered, unordered):
        for backend, dev in (("numpy", "cpu"), ("triton", TRITON_DEVICE)):
            leaves = [x.clone().to(dev).requires_grad_() for x in base]
            attn(*leaves, doc=doc.to(dev), backend=backend).square().sum().backward()
            grads[attn.deterministic, backend] = [x.grad.cpu() for x in leaves]
    assert asked == [True, False]  # (one Triton backward per compiled spec: its flag reaches the choice)
    for backend in ("numpy", "triton"):
        for a, b in zip(grads[True, backend], grads[False, backend]):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)
    assert GB.default_config(128, deterministic=False).dq == GB.default_config(64, deterministic=False).dq \
        == "fused_atomic"


def test_refusals():
    attn = attnc.compile(DOC)
    q = torch.randn(1, 4, 6, 8, requires_grad=True)
    k = torch.randn(1, 2, 6, 8)
    doc = torch.zeros(1, 6)
    with pytest.raises(InputError, match="tensor 'doc' requires grad.*only float tensors read by the score"):
        attn(q, k, k, doc=doc.requires_grad_())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float64_on_the_gpu_is_refused():
    attn = attnc.compile(DOC)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, device="cuda")
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, device="cuda")
    with pytest.raises(InputError, match="float64 runs on the CPU only"):
        attn(q, k, k, doc=torch.zeros(1, 6, dtype=torch.int32, device="cuda"))


LEARNED = ("attention lt { heads = 2 / 1 head_dim = 4 tensor bias: f32[h, s, s] tensor slope: f32[h] "
           "tensor kb: f32[b, s] tensor rb: f32[b, h, s] tensor doc: i32[b, s] "
           "score = score + bias[h, q, k] - slope[h] * (q - k) + kb[b, k] + rb[b, h, q] "
           "score = softcap(score, 5.0) mask = causal & doc[b, q] == doc[b, k] }")


def test_triton_score_tensor_gradients_match_the_float64_reference_and_repeat_bit_for_bit(monkeypatch):
    """dBias [h, q, k], dSlope [h], dKeyBias [b, k] and a row bias [b, h, q] through the Triton
    backward of O and LSE (GQA, S_q < S_k: bottom-right rows; 24 x 40 positions: SKIP, PARTIAL and
    FULL tiles of the interpreter's 16 x 16, lengths not multiples of them) against the numpy
    backend's float64 backward, within the declared f32 gradient tolerance (documents: each request
    its own tile classes); a second run gives the same bits (no atomics).  Each load's launch writes a buffer the size of its gradient over the call (kb: per
    head), never times the batch: bias [H, S_q, S_k], slope one float per (head, query tile)."""
    pytest.importorskip("triton")
    from attnc.backends.triton import score_grads
    from attnc.compiler import numerics
    shapes = []
    allocate = score_grads._workspace
    monkeypatch.setattr(score_grads, "_workspace", lambda shape, device: shapes.append(shape) or
                        allocate(shape, device))
    attn = attnc.compile(LEARNED)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 2, 24, 4, generator=gen)
    k, v = (torch.randn(2, 1, 40, 4, generator=gen) for _ in range(2))
    tensors = {"bias": torch.randn(2, 40, 40, generator=gen), "slope": torch.rand(2, generator=gen) * 0.1,
               "kb": torch.randn(2, 40, generator=gen), "rb": torch.randn(2, 2, 40, generator=gen)}
    do, dlse = torch.randn(2, 2, 24, 4, generator=gen), torch.randn(2, 2, 24, generator=gen)
    doc = torch.tensor([[0] * 40, [0] * 12 + [1] * 28], dtype=torch.int32)
    runs = []
    for backend, dt, dev in (("numpy", torch.float64, "cpu"), ("triton", torch.float32, TRITON_DEVICE),
                             ("triton", torch.float32, TRITON_DEVICE)):
        leaves = [x.to(dev, dt).clone().requires_grad_() for x in (q, k, v, *tensors.values())]
        named = dict(zip(tensors, leaves[3:]))
        o, lse = attn(*leaves[:3], backend=backend, return_lse=True, doc=doc.to(dev), **named)
        ((o * do.to(dev, dt)).sum() + (lse * dlse.to(dev, dt)).sum()).backward()
        runs.append([x.grad.cpu() for x in leaves])
    reference, first, again = runs
    for name, want, got in zip(("dq", "dk", "dv", *tensors), reference, first):
        c = numerics.compare_gradient(name, "f32", got.double().numpy(), want.numpy())
        assert c.ok, str(c)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    if TRITON_DEVICE == "cpu":  # the interpreter's 16 x 16 tiles: 2 query tiles
        assert shapes == [(2, 24, 40), (2, 2), (2, 2, 40), (2, 2, 24)] * 2


def test_triton_refuses_a_tensor_read_at_a_computed_index():
    pytest.importorskip("triton")
    attn = attnc.compile("attention rp { heads = 2 head_dim = 4 tensor rel: f32[s] score = score + rel[abs(q - k)] "
                         "mask = causal }")
    q = torch.randn(1, 2, 6, 4, device=TRITON_DEVICE, requires_grad=True)
    rel = torch.zeros(6, device=TRITON_DEVICE, requires_grad=True)
    with pytest.raises(attnc.api.BackendRefused, match=r"tensor 'rel' requires grad: the Triton backward "
                                                       r"differentiates tensors indexed by distinct positions.*rel\[abs\(q - k\)\]"):
        attn(q, q.detach(), q.detach(), rel=rel, backend="triton")
    attn(q, q.detach(), q.detach(), rel=rel.detach(), backend="triton").sum().backward()  # detached: runs
    assert q.grad is not None


def test_torch_compile_traces_the_backward():
    attn = attnc.compile(DOC)
    doc = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)

    def loss(q, k, v):
        return (attn(q, k, v, doc=doc) ** 2).sum()
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(1, h, 12, 8, generator=gen) for h in (4, 2, 2)]
    eager = [x.clone().requires_grad_() for x in base]
    loss(*eager).backward()
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in base]
    compiled(*leaves).backward()
    for a, b in zip(eager, leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


SINK = ("attention sk { heads = 4 / 2 head_dim = 8 scale = 0.25 tensor sinks: f32[h] mask = causal & window(5) "
        "sink = sinks[h] }")


def test_torch_compile_trains_a_sink_tensor():
    """gpt-oss's learned sinks under torch.compile(fullgraph=True): a tensor the sink reads requires
    grad (the checks that run before an eager forward are host code dynamo does not trace; the
    backward runs them), and its gradient matches the eager call's."""
    attn = attnc.compile(SINK)

    def loss(q, k, v, sinks):
        return (attn(q, k, v, sinks=sinks) ** 2).sum()
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(1, h, 12, 8, generator=gen) for h in (4, 2, 2)] + [torch.randn(4, generator=gen)]
    eager = [x.clone().requires_grad_() for x in base]
    loss(*eager).backward()
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in base]
    compiled(*leaves).backward()
    assert float(eager[3].grad.abs().min()) > 0
    for a, b in zip(eager, leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_torch_compile_refuses_a_tensor_gradient_when_the_backward_runs():
    """Under torch.compile the refusal of a gradient the spec has no formula for (a float tensor
    read by the mask only) comes when the backward runs, with the eager call's message."""
    attn = attnc.compile("attention m { heads = 2 head_dim = 4 tensor w: f32[b, s] mask = causal & w[b, k] > 0.0 }")
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    w = torch.ones(1, 6, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, w: attn(q, q, q, w=w).sum(), fullgraph=True, backend="aot_eager")
    out = compiled(q, w)  # (the forward runs: dynamo cannot ask the backend before it)
    with pytest.raises(InputError, match="tensor 'w' requires grad, but spec 'm' has no gradient for it"):
        out.backward()


def _fused(gen, b=2, s=12, heads=2, d=8):
    """q, k, v as transformers make them: views permuted out of one fused [B, S, 3, H, d] projection."""
    return torch.randn(b, s, 3, heads, d, generator=gen)


def test_torch_compile_inductor_through_backward_on_permuted_views():
    """The default backend (inductor) checks every custom op's output strides against its fake:
    the backward's gradients of q, k, v permuted out of a fused qkv must be declared as produced."""
    import torch._inductor.config as inductor
    attn = attnc.compile("attention c { heads = 2 head_dim = 8 mask = causal }")

    def loss(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return (attn(q, k, v) ** 2).sum()
    base = _fused(torch.Generator().manual_seed(6))
    eager = base.clone().requires_grad_()
    loss(eager).backward()
    torch._dynamo.reset()
    leaf = base.clone().requires_grad_()
    with inductor.patch(compile_threads=1):
        torch.compile(loss, fullgraph=True)(leaf).backward()
    assert torch.allclose(leaf.grad, eager.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_backward_fake_declares_the_real_gradient_layout(backend):
    """``attnc::attention_backward``'s fake and real implementations agree on every output's shape,
    dtype and strides (api.gradient_buffer), for permuted q/k/v and a learned bias, per backend."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    if backend == "triton":
        pytest.importorskip("triton")
    attn = attnc.compile(BIAS)
    gen = torch.Generator().manual_seed(7)
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = _fused(gen, s=6, d=4).to(dev).permute(2, 0, 3, 1, 4)
    bias = torch.randn(2, 6, 6, generator=gen).to(dev)
    o, lse = attn(q, k, v, bias=bias, return_lse=True, backend=backend)
    args = (attn.handle, q, k, v, o, lse, torch.randn_like(o), None, [bias], [0], backend)
    real = torch.ops.attnc.attention_backward(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.attnc.attention_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                                                    [mode.from_tensor(t) for t in a] if a and isinstance(a, list)
                                                    and isinstance(a[0], torch.Tensor) else a for a in args))
    flat = lambda outs: [*outs[:3], *outs[3]]  # noqa: E731
    assert len(flat(real)) == len(flat(fake)) == 4  # dQ, dK, dV, dBias
    for r, f in zip(flat(real), flat(fake)):
        assert (tuple(r.shape), r.stride(), r.dtype) == (tuple(f.shape), f.stride(), f.dtype)


class _TinyLM(torch.nn.Module):
    """Embedding, two causal attention blocks, a head: with attnc's attention or eager attention;
    ``seq``: each block learns a score bias [heads, seq, seq] (the attnc spec reads it as ``bias``)."""

    def __init__(self, attn=None, vocab=32, d=16, heads=2, seq=None):
        super().__init__()
        self.attn, self.heads = attn, heads
        self.emb = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(2))
        self.out = torch.nn.Linear(d, vocab)
        self.bias = None if seq is None else torch.nn.ParameterList(
            torch.nn.Parameter(0.5 * torch.randn(heads, seq, seq)) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            tensors = {} if self.bias is None else {"bias": self.bias[i]}
            if self.attn is not None:
                a = self.attn(q, k, v, **tensors)
            else:
                scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5 + tensors.get("bias", 0.0)
                visible = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                a = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
            x = x + a.transpose(1, 2).reshape(b, s, d)
        return self.out(x)


def _train(attn, data, seq=None, steps=50) -> tuple:
    """(losses of ``steps`` Adam steps, the model) from the same initialisation."""
    torch.manual_seed(0)
    model = _TinyLM(attn, seq=seq).to(data.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses), model


def test_fifty_training_steps_follow_eager_attention():
    data = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(5))
    ours, eager = (_train(attn, data)[0] for attn in (attnc.compile("attention c { mask = causal }"), None))
    assert ours[-1] < 0.5 * ours[0]  # it learns
    assert np.abs(ours - eager).max() < 1e-3 * eager.max()


LEARNED_BIAS = ("attention lb2 { heads = 2 head_dim = 8 tensor bias: f32[h, s, s] score = score + bias[h, q, k] "
                "mask = causal }")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    TRITON_DEVICE != "cuda", reason="the Triton backend's dBias on the GPU (ATTNC_TEST_GPU=1)"))])
def test_a_learned_bias_trains_fifty_steps_as_eager_attention(device):
    """A model whose attention blocks learn bias[h, q, k] follows eager attention's loss curve for 50
    Adam steps: on the CPU through the numpy backend, on the GPU through the Triton backward's
    in-kernel dBias; the biases move (their gradient is not dropped)."""
    data = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(5)).to(device)
    (ours, model), (eager, _) = (_train(attn, data, seq=16) for attn in (attnc.compile(LEARNED_BIAS), None))
    torch.manual_seed(0)
    start = _TinyLM(seq=16).bias
    assert all((b.detach().cpu() - s).abs().max() > 0.1 for b, s in zip(model.bias, start))
    assert ours[-1] < 0.5 * ours[0]  # it learns
    assert np.abs(ours - eager).max() < 1e-3 * eager.max()
