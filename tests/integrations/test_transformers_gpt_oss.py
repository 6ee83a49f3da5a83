"""gpt-oss under attn_implementation="attnc" (issue 36): learned attention sinks (``module.sinks``,
passed as ``s_aux``), alternating sliding-window and full layers, GQA and head_dim ** -0.5 scaling.
Tiny random-initialised GptOssConfig models against "eager": logits, greedy generation past the
window, and every parameter's gradient (each layer's sinks included) -- float32 on the CPU (the
numpy backend), and bf16 on CUDA (the Triton backend) with ATTNC_TEST_GPU=1."""
import copy

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration takes torch tensors")
try:
    import transformers
except ImportError as e:
    pytest.skip(f"transformers is not importable ({e}); pip install -e '.[test]' installs it", allow_module_level=True)

import attnc.integrations.transformers as hf  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402
from tests.integrations.test_transformers import GPU, TOL, VOCAB, _ids, _pair  # noqa: E402

WINDOW = 8  # gpt-oss's is 128; 8 makes the window matter at these test lengths


def _config(*, init: float = 0.3, experts: int = 4, top_k: int = 2) -> "transformers.GptOssConfig":
    """gpt-oss at its smallest: 2 layers (its default layer_types: sliding, then full), 4 query and
    2 key-value heads of 16, window 8, a mixture of ``experts`` experts of width 64 (``top_k`` per
    token), yarn RoPE (factor 32 = 512 / 16 positions, as gpt-oss's 131072 / 4096)."""
    return transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, sliding_window=WINDOW, num_local_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=512, initializer_range=init,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})


def _set_sinks(models, seed: int = 4) -> None:
    """The same sinks in every model, in [-1, 2): large enough that a sink takes a good share of
    each row's softmax (the initializer's N(0, 0.3) ones take little), so a sink attnc dropped or
    misapplied shows in the logits and the gradients."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.rand(layer.self_attn.sinks.shape, generator=g) * 3 - 1 for layer in models[0].model.layers]
    with torch.no_grad():
        for model in models:
            for layer, v in zip(model.model.layers, values, strict=True):
                layer.self_attn.sinks.copy_(v)


@pytest.fixture(scope="module")
def gpt_oss():
    pair = _pair(_config())
    _set_sinks(pair)
    return pair


def _gradients(model, ids) -> dict:
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


# ---------------------------------------------------------------- float32 on the CPU
def test_gpt_oss_logits_match_eager_with_one_spec_per_layer_kind(gpt_oss, monkeypatch):
    eager, ours = gpt_oss
    assert ours.config.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW, None]
    used = []
    compiled = hf.attention_for
    monkeypatch.setattr(hf, "attention_for", lambda *key: used.append(key) or compiled(*key))
    ids = _ids(2, 20)  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, **TOL)
    # (causal, window, softcap, scale, padding, documents, sinks): the sliding layer, then the full one
    assert used == [(True, WINDOW, None, 0.25, False, False, True), (True, None, None, 0.25, False, False, True)]


def test_gpt_oss_trains_like_eager_and_its_sinks_get_their_gradient(gpt_oss):
    """A training step: every parameter's gradient through attnc's backward against eager's,
    each layer's ``sinks`` (dSink) included."""
    eager, ours = gpt_oss
    ids = _ids(2, 20, seed=3)
    want, got = _gradients(eager, ids), _gradients(ours, ids)
    assert want.keys() == got.keys()
    sinks = [f"model.layers.{i}.self_attn.sinks" for i in range(2)]
    assert all(n in got for n in sinks)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, atol=1e-4, rtol=1e-3, msg=n)
    for n in sinks:  # (not a vacuous match of two zeros)
        assert float(want[n].abs().max()) > 1e-3, n


def test_gpt_oss_greedy_generation_past_the_window_matches_eager(gpt_oss):
    """Decode over a DynamicCache: 12 + 6 tokens run past the window of 8, so the sliding layer's
    cache is cropped; every step's logits, not only the argmax."""
    eager, ours = gpt_oss
    ids = _ids(1, 12, seed=5)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_gpt_oss_left_padded_batch_generation_matches_eager(gpt_oss):
    """Sinks with a key-padding mask: the padded row's real tokens decode as eager's."""
    eager, ours = gpt_oss
    ids = _ids(2, 10, seed=7)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert ours.generate(ids, **kw).tolist() == eager.generate(ids, **kw).tolist()


def test_the_sink_attention_compiles_with_fullgraph_and_gives_dsink(gpt_oss):
    """Under torch.compile (fullgraph) the sinks parameter, requiring grad, is the spec's tensor and
    its gradient comes back through attnc's backward op, as outside the graph."""
    module = gpt_oss[1].model.layers[0].self_attn
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 12, 16, generator=gen) for h in (4, 2, 2))

    def attention(q, k, v):
        return hf.attnc_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=WINDOW,
                                          s_aux=module.sinks)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="eager")
    got, want = compiled(q, k, v), attention(q, k, v)
    torch.testing.assert_close(got, want)
    (dsink_got,), (dsink_want,) = (torch.autograd.grad(o.square().sum(), module.sinks) for o in (got, want))
    torch.testing.assert_close(dsink_got, dsink_want)


def test_sinks_spec_text_and_refusals(gpt_oss):
    text = hf.spec_text(window=128, scale=0.125, sinks=True)
    assert "tensor sinks: f32[h]" in text and "mask = causal & window(128)" in text
    assert text.rstrip().endswith("sink = sinks[h]\n}")
    assert "sink" not in hf.spec_text(window=128)
    module = gpt_oss[1].model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    for bad in (torch.zeros(2), torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), [0.0] * 4):
        with pytest.raises(InputError, match="s_aux"):
            hf.attnc_attention_forward(module, q, k, v, None, scaling=0.25, s_aux=bad)


# ---------------------------------------------------------------- bf16 on CUDA
def _relative(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@pytest.mark.skipif(not GPU, reason="bf16 gpt-oss on the Triton backend runs on a GPU (ATTNC_TEST_GPU=1)")
def test_gpt_oss_bf16_on_cuda_matches_eager():
    """The same checks in bf16 on CUDA (attnc's Triton backend).  bf16 rounding everywhere in the
    model makes eager's own bf16 results differ from float32 by a few percent, so the declared
    tolerance is relative to that: attnc's distance from the float32 eager reference is at most
    twice eager-bf16's plus 5% (logits: plus 1%), per parameter gradient (each layer's sinks
    included).  Every expert is active (top-k = all), so rounding cannot flip a routing choice."""
    cfg = _config(init=0.1, experts=2, top_k=2)
    reference, ours = (m.cuda() for m in _pair(cfg))
    _set_sinks((reference, ours))
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    ours = ours.to(torch.bfloat16)
    ids = _ids(2, 40, seed=3).cuda()  # 40 tokens: five windows
    with torch.no_grad():
        r, e, a = (m(ids).logits for m in (reference, eager, ours))
    assert _relative(a, r) <= 2 * _relative(e, r) + 0.01, (_relative(a, r), _relative(e, r))
    grads = [_gradients(m, ids) for m in (reference, eager, ours)]
    assert grads[0].keys() == grads[2].keys() and "model.layers.1.self_attn.sinks" in grads[2]
    for n, ref in grads[0].items():
        err, base = _relative(grads[2][n], ref), _relative(grads[1][n], ref)
        assert err <= 2 * base + 0.05, (n, err, base)
    # greedy tokens: equal to eager-bf16's up to the first step whose top-2 margin is within bf16's
    # reach (0.1 of a logit, where the two implementations' rounding may legitimately pick either;
    # this prompt's margins are 0.3 and more on the CPU, so every step should count)
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    prompt = _ids(1, 12, seed=5).cuda()
    with torch.no_grad():
        want, got = eager.generate(prompt, **kw), ours.generate(prompt, **kw)
    steps = 0
    for logits in want.logits:
        top = logits[0].float().topk(2).values
        if float(top[0] - top[1]) < 0.1:
            break
        steps += 1
    assert steps >= 3, f"only {steps} clear greedy steps: pick another prompt"
    assert got.sequences[:, :12 + steps].tolist() == want.sequences[:, :12 + steps].tolist()
