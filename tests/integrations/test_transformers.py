"""attnc as a Hugging Face transformers attention implementation (attnc.integrations.transformers):
tiny random-initialised models on the CPU in float32 (the numpy backend), attn_implementation=
"attnc" against "eager": logits, packed sequences, padding, greedy generation; the refusals.  gpt-oss (attention
sinks) is in test_transformers_gpt_oss.py."""
import copy
import types
import os

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration takes torch tensors")
try:  # (pytest.importorskip, also when an installed transformers fails to import, e.g. a dependency's version)
    import transformers
except ImportError as e:
    pytest.skip(f"transformers is not importable ({e}); pip install -e '.[test]' installs it", allow_module_level=True)

import attnc.integrations.transformers as hf  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402

VOCAB = 128
TOL = dict(rtol=1e-4, atol=1e-4)
GPU = os.environ.get("ATTNC_TEST_GPU") == "1" and torch.cuda.is_available()


def _pair(config):
    """The same random weights under "eager" and "attnc" (each model gets its own config: from_config
    writes the implementation into the config object)."""
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnc").eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "attnc" and eager.config._attn_implementation == "eager"
    return eager, ours


@pytest.fixture(scope="module")
def llama():
    # initializer_range 0.3: scores of order one, so the softmax is far from uniform
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                                   initializer_range=0.3)
    return _pair(cfg)


@pytest.fixture(scope="module")
def gemma2():
    # alternating sliding (window 8) and full layers, softcap 5 on the scores, scaling from
    # query_pre_attn_scalar (24 ** -0.5, not head_dim ** -0.5)
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                    sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                    query_pre_attn_scalar=24, max_position_embeddings=256, initializer_range=0.3)
    return _pair(cfg)


def _ids(*shape, seed=1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_llama_logits_match_eager(llama):
    eager, ours = llama
    ids = _ids(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, **TOL)


def test_gemma2_trains_like_eager(gemma2):
    """A training step: the loss's gradients through attnc's backward (sliding window, softcap,
    GQA) against eager attention's, parameter by parameter."""
    eager, ours = gemma2
    ids = _ids(2, 20, seed=3)
    grads = []
    for model in (eager, ours):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-4, rtol=1e-3, msg=n)


def test_gemma2_sliding_window_softcap_and_scaling_match_eager(gemma2, monkeypatch):
    eager, ours = gemma2
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [8, None]
    used = []
    compiled = hf.attention_for
    monkeypatch.setattr(hf, "attention_for", lambda *key: used.append(key) or compiled(*key))
    ids = _ids(2, 20)  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, **TOL)
    # (causal, window, softcap, scale, padding, documents, sinks): the sliding layer, then the full one
    assert used == [(True, 8, 5.0, 24 ** -0.5, False, False, False),
                    (True, None, 5.0, 24 ** -0.5, False, False, False)]


def test_mistral_sliding_window_from_the_config_matches_eager():
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB, sliding_window=6,
                                     max_position_embeddings=256, initializer_range=0.3)
    eager, ours = _pair(cfg)
    ids = _ids(2, 16, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, **TOL)


def test_packed_sequences_through_restarting_position_ids_match_each_sequence_alone(llama):
    eager, ours = llama
    lengths = [(7, 9, 8), (12, 12)]
    rows = [[_ids(1, n, seed=10 * r + i) for i, n in enumerate(row)] for r, row in enumerate(lengths)]
    ids = torch.cat([torch.cat(row, dim=1) for row in rows])
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    with torch.no_grad():
        packed = ours(ids, position_ids=position_ids).logits
        for r, row in enumerate(rows):
            start = 0
            for seq in row:
                alone = eager(seq).logits[0]
                torch.testing.assert_close(packed[r, start:start + seq.shape[1]], alone, **TOL)
                start += seq.shape[1]
    assert hf.document_ids(position_ids[:1]).tolist() == [[0] * 7 + [1] * 9 + [2] * 8]


def test_padding_mask_matches_eager_on_real_tokens(llama):
    eager, ours = llama
    ids = _ids(2, 16, seed=3)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        e = eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0, 5:], e[0, 5:], **TOL)
    torch.testing.assert_close(a[1], e[1], **TOL)


@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_greedy_generation_matches_eager(model, request):
    """Decode over a DynamicCache: S_q = 1 over S_k keys, bottom-right aligned; for gemma2 the
    12 + 5 tokens run past its window of 8, so its sliding layers' cache is cropped."""
    eager, ours = request.getfixturevalue(model)
    ids = _ids(1, 12, seed=5)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    for g, w in zip(got.logits, want.logits, strict=True):  # every step's logits, not only the argmax
        torch.testing.assert_close(g, w, **TOL)


def test_left_padded_batch_generation_matches_eager(llama):
    eager, ours = llama
    ids = _ids(2, 10, seed=7)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        want = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert got.tolist() == want.tolist()


def test_the_triton_backend_under_inference_mode(llama):
    """The GPU path: attnc's Triton backend (its interpreter on the CPU; CUDA with ATTNC_TEST_GPU=1)
    under torch.inference_mode(), where the model makes its position ids and padding masks as
    inference tensors: causal, padded, packed, and a padded batch's generation."""
    device = "cuda" if GPU else "cpu"
    eager, ours = (copy.deepcopy(m).to(device) for m in llama)
    tol = dict(rtol=1e-3, atol=1e-3) if GPU else TOL
    ids = _ids(2, 24, seed=11).to(device)
    mask = torch.ones(2, 24, dtype=torch.long, device=device)
    mask[0, :5] = 0
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None].expand(2, -1).to(device)
    hf.register(backend="triton")
    try:
        with torch.inference_mode():
            torch.testing.assert_close(ours(ids).logits, eager(ids).logits, **tol)
            a, e = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
            torch.testing.assert_close(a[0, 5:], e[0, 5:], **tol)
            torch.testing.assert_close(a[1], e[1], **tol)
            packed = ours(ids, position_ids=position_ids).logits
            alone = torch.cat([eager(ids[:, :10]).logits, eager(ids[:, 10:]).logits], dim=1)
            torch.testing.assert_close(packed, alone, **tol)
            kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
            assert ours.generate(ids, **kw).tolist() == eager.generate(ids, **kw).tolist()
    finally:
        hf.register()


def test_the_attention_function_compiles_with_fullgraph(llama):
    """Under torch.compile the spec's handle is a traced constant and the call attnc's custom op;
    position ids become a doc tensor without a host check (one document when nothing restarts)."""
    module = llama[1].model.layers[0].self_attn
    q, k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    position_ids = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])

    def attention(q, k, v, position_ids):
        return hf.attnc_attention_forward(module, q, k, v, None, scaling=0.3, softcap=2.0, sliding_window=6,
                                          position_ids=position_ids)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, position_ids), attention(q, k, v, position_ids))


# ---------------------------------------------------------------- specs and refusals
def test_spec_text_maps_window_softcap_scaling_padding_and_documents():
    text = hf.spec_text(causal=True, window=4096, softcap=50.0, scale=0.0625, padding=True)
    assert "scale = 0.0625" in text and "score = softcap(score, 50.0)" in text
    assert "tensor pad: bool[b, s]" in text and "mask = causal & window(4096) & pad[b, k]" in text
    assert "mask = causal & doc[b, q] == doc[b, k]" in hf.spec_text(documents=True)
    assert "mask = true" in hf.spec_text(causal=False)
    assert "mask = abs(q - k) <= 3" in hf.spec_text(causal=False, window=3)
    for kw in ({"window": 0}, {"softcap": -1.0}, {"scale": float("nan")}):
        with pytest.raises(InputError):
            hf.spec_text(**kw)


def _qkv(s_q=6, s_k=6):
    return torch.randn(1, 4, s_q, 16), torch.randn(1, 2, s_k, 16), torch.randn(1, 2, s_k, 16)


def test_refusals_say_why(llama):
    module = llama[1].model.layers[0].self_attn
    q, k, v = _qkv()
    with pytest.raises(InputError, match="dropout"):
        hf.attnc_attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(InputError, match="4D mask"):
        hf.attnc_attention_forward(module, q, k, v, torch.zeros(1, 1, 6, 6))
    with pytest.raises(InputError, match="position_bias"):
        hf.attnc_attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 6, 6))
    q2, k2, v2 = _qkv(3, 6)  # packed sequences over earlier cache content
    with pytest.raises(InputError, match="position_ids restart"):
        hf.attnc_attention_forward(module, q2, k2, v2, None, position_ids=torch.tensor([[3, 0, 1]]))
    # a static cache: keys beyond the written ones, not bottom-right aligned
    with pytest.raises(InputError, match="static cache"):
        hf.attnc_mask(1, 4, 32, q_offset=0, kv_offset=0, mask_function=transformers.masking_utils.causal_mask_function)
    # an all-visible padding mask builds nothing
    assert hf.attnc_mask(1, 4, 4, attention_mask=torch.ones(1, 4, dtype=torch.bool)) is None


# ---------------------------------------------------------------- no copies of q, k, v and O
@pytest.mark.parametrize("backend", ["triton", "numpy"])
def test_the_attention_function_passes_views_through_and_copies_no_output(backend, monkeypatch):
    """transformers hands q, k, v over as transposed views of its [B, S, H, d] projections: the
    integration passes them to attnc as they are (the backend receives the very views: same address
    and strides), and returns the attention's O transposed, already contiguous (token-major: the
    public call's order for a token-major q), with no copy (the same address); the same values as
    contiguous inputs."""
    from attnc.compiler.dispatch import torch_backend
    module = types.SimpleNamespace(is_causal=True)
    b, s, h_q, h_kv, d = 2, 19, 4, 2, 16
    from tests.conftest import triton_device
    dev = triton_device() if backend == "triton" else "cpu"  # (a GPU runs Triton on CUDA tensors only)
    q, k, v = (torch.randn(b, s, h * d, device=dev).view(b, s, h, d).transpose(1, 2) for h in (h_q, h_kv, h_kv))
    seen = []
    be = torch_backend(backend)
    forward = type(be).forward

    def spy(self, kernel, q_, k_, v_, tensors, plan=None):
        out = forward(self, kernel, q_, k_, v_, tensors, plan)
        seen.append(((q_, k_, v_), out[0]))
        return out
    monkeypatch.setattr(type(be), "forward", spy)
    hf.register(backend=backend)
    try:
        with torch.no_grad():
            out, _ = hf.attnc_attention_forward(module, q, k, v, None, scaling=0.25)
            ref, _ = hf.attnc_attention_forward(module, q.contiguous(), k.contiguous(), v.contiguous(), None,
                                                scaling=0.25)
    finally:
        hf.register()
    (given, o), _ = seen
    for x, y in zip(given, (q, k, v)):
        assert x.data_ptr() == y.data_ptr() and x.stride() == y.stride() and not x.is_contiguous()
    assert out.shape == (b, s, h_q, d) and out.is_contiguous()
    if backend == "triton":  # the kernel wrote O token-major: returned as it is
        assert out.data_ptr() == o.data_ptr()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_llama_model_hands_the_kernel_views(llama, monkeypatch):
    """In a model's forward (no cache: q and k from RoPE, v the projection's view) every layer's q, k
    and v reach the Triton kernel's launch as token-major views (none copied)."""
    import copy
    from attnc.backends.triton import bound, launch
    from tests.conftest import triton_device
    dev = triton_device()
    ours = llama[1] if dev == "cpu" else copy.deepcopy(llama[1]).to(dev)  # (a GPU runs Triton on CUDA tensors)
    seen, inside = [], []
    call, bound_call = launch.PrefillLaunch.__call__, bound.BoundLaunch.__call__

    def spy(self, q_, k_, v_, *args, **kwargs):
        if not inside:  # (a bound launch that cannot go raw launches through here: seen once)
            seen.append((q_, k_, v_, args[1]))  # (q, k, v, O as the launch gets them: args = ts, out, lse)
        return call(self, q_, k_, v_, *args, **kwargs)

    def spy_bound(self, launch_, q_, k_, v_, ts, out, lse, flag):  # the layers after the first: their bound launch
        seen.append((q_, k_, v_, out))
        inside.append(1)
        try:
            return bound_call(self, launch_, q_, k_, v_, ts, out, lse, flag)
        finally:
            inside.pop()
    monkeypatch.setattr(launch.PrefillLaunch, "__call__", spy)
    monkeypatch.setattr(bound.BoundLaunch, "__call__", spy_bound)
    hf.register(backend="triton")
    try:
        with torch.no_grad():
            ours(_ids(2, 24).to(dev), use_cache=False)
    finally:
        hf.register()
    assert len(seen) == ours.config.num_hidden_layers
    for tensors in seen:
        for x in tensors:
            assert not x.is_contiguous() and x.transpose(1, 2).is_contiguous(), x.stride()
