"""transformers' continuous batching on attnc's paged append (attnc.integrations.continuous_batching):
a tiny random Llama (2 layers, hidden 64, 4/2 heads) serves requests of different prompt lengths
with chunked prefill and mixed prefill/decode steps; its tokens against transformers' own paged
implementation ("paged|eager"), one append per layer per step, and the cache read and written in
place (no gather).  ATTNC_TEST_GPU=1 runs the same on CUDA (the Triton kernels) at 64 requests."""
import copy
import gc
import os
import weakref

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration takes torch tensors")
try:
    import transformers
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
except ImportError as e:
    pytest.skip(f"transformers is not importable ({e}); pip install -e '.[test]' installs it", allow_module_level=True)

import attnc.integrations.continuous_batching as cb  # noqa: E402
import attnc.integrations.transformers as hf  # noqa: E402
import attnc.serving  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402

if not cb.api():
    pytest.skip(f"transformers {transformers.__version__} has no paged cache attnc drives", allow_module_level=True)

VOCAB = 128
PROMPTS = (5, 17, 33, 9)  # 33 > MAX_BATCH_TOKENS: chunked prefill, mixed with the others' decode steps
MAX_BATCH_TOKENS = 24
NEW_TOKENS = 5
GPU = os.environ.get("ATTNC_TEST_GPU") == "1" and torch.cuda.is_available()
transformers.logging.set_verbosity_error()


def _config(page_size=8, max_batch_tokens=MAX_BATCH_TOKENS, num_blocks=24):
    size = "page_size" if hasattr(ContinuousBatchingConfig(), "page_size") else "block_size"  # (5.17: block_size)
    return ContinuousBatchingConfig(**{size: page_size}, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    use_cuda_graph=False, allow_block_sharing=False)


def _llama(device="cpu"):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                                   initializer_range=0.3)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="paged|eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="attnc")
    ours.load_state_dict(theirs.state_dict())
    return theirs.to(device).eval(), hf.continuous_batching(ours.to(device).eval())


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _generate(model, prompts, **config):
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with pytest.MonkeyPatch.context() as mp:
        # (the manager's stop() runs gc.collect() over the whole heap, a second per run here: its
        # clean-up, not what is tested; the in-place test collects explicitly)
        mp.setattr(gc, "collect", lambda generation=2: 0)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=_config(**config),
                                   progress_bar=False)
    return list(out.values())


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def reference(llama):
    """transformers' own paged implementation ("paged|eager") on the same requests."""
    return _generate(llama[0], _prompts(PROMPTS))


@pytest.fixture(scope="module")
def served(llama):
    """One continuous-batching run through attnc, watched: every layer call's step (T, C) and the
    storage every append read and wrote; and whether transformers' own cache update ever ran."""
    theirs, ours = llama
    calls, appends, updates = [], [], []
    attend, append = cb.attend, attnc.serving.append
    if cb.api() == "model":
        from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator as owner
    else:
        from transformers.generation.continuous_batching import PagedAttentionCache as owner
    update = owner.update

    def watch_attend(module, query, key, value, step, **kw):
        c = step.cache
        pools = [c.cache_tensor] if cb.api() == "model" else c.key_cache + c.value_cache
        calls.append((id(step), module.layer_idx, step, {t.untyped_storage().data_ptr() for t in pools},
                      weakref.ref(c)))
        return attend(module, query, key, value, step, **kw)

    def watch_append(attn, q, k_new, v_new, **kw):
        appends.append((kw["k_cache"], kw["v_cache"], kw["block_table"].clone()))
        return append(attn, q, k_new, v_new, **kw)

    def watch_update(self, *a, **kw):
        updates.append(self)
        return update(self, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(cb, "attend", watch_attend)
    mp.setattr(attnc.serving, "append", watch_append)
    mp.setattr(owner, "update", watch_update)
    try:
        out = _generate(ours, _prompts(PROMPTS))
    finally:
        mp.undo()
    return out, calls, appends, updates


def test_tokens_match_transformers_paged_attention(reference, served):
    want, got = reference, served[0]
    assert [o.error for o in got] == [None] * len(PROMPTS)
    assert [len(o.generated_tokens) for o in got] == [NEW_TOKENS] * len(PROMPTS)
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]


def test_one_append_per_layer_per_step_over_mixed_batches(served):
    """Every step calls each layer once; the steps include a chunked prefill (T > 0, C > 1) in the
    same batch as another request's decode token (T > 0, C = 1)."""
    _, calls, _, _ = served
    steps = {}
    for sid, layer, step, _, _ in calls:
        steps.setdefault(sid, (step, []))[1].append(layer)
    assert len(steps) >= NEW_TOKENS and all(layers == [0, 1] for _, layers in steps.values())
    mixes = [(step.T[0].tolist(), step.C.tolist()) for step, _ in steps.values()]
    assert any(any(t > 0 and c > 1 for t, c in zip(T, C)) and any(t > 0 and c == 1 for t, c in zip(T, C))
               for T, C in mixes), mixes
    assert sum(sum(C) for _, C in mixes) == sum(PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1)


def test_cache_is_read_and_written_in_place(served):
    """Every append gets views of transformers' K/V pool (the same storage across steps), and
    transformers' own update, which gathers K/V with index_select, never runs; once the run is
    over, nothing of attnc's keeps transformers' cache alive."""
    _, calls, appends, updates = served
    pools = set.union(*(ptrs for *_, ptrs, _ in calls))
    assert pools == calls[0][3] and len(pools) == (1 if cb.api() == "model" else 4)  # (5.17: K and V per layer)
    assert {t.untyped_storage().data_ptr() for k, v, _ in appends for t in (k, v)} == pools
    assert len(appends) == len(calls) and updates == []
    gc.collect()
    assert all(ref() is None for *_, ref in calls)
    # the K and V pages of a layer are distinct pages of that storage, never overlapping
    k, v, table = appends[0]
    assert k.data_ptr() != v.data_ptr() and k.shape == v.shape and k.stride() == v.stride()
    assert bool((table[table >= 0] >= 0).all()) and int(table.max()) < k.shape[0]


def test_outside_continuous_batching_the_name_runs_attncs_attention(llama):
    theirs, ours = llama
    eager = copy.deepcopy(theirs)
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)


def test_learned_sinks_join_the_paged_spec():
    """gpt-oss's s_aux (one learned logit per head) becomes ``sink = sinks[h]`` of the layer's paged
    spec: a tiny gpt-oss with full-attention layers only (its sliding layers are refused, below)."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                                    max_position_embeddings=256, initializer_range=0.3)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="paged|eager")
    for layer in theirs.model.layers:
        layer.self_attn.sinks.data.normal_(0.0, 2.0)  # (initialised to zero, where a sink is already felt)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="attnc")
    ours.load_state_dict(theirs.state_dict())
    prompts = _prompts((5, 17))
    want, got = _generate(theirs.eval(), prompts), _generate(hf.continuous_batching(ours.eval()), prompts)
    assert [o.error for o in got] == [None, None]
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]


def _sliding_pair(cfg):
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="paged|eager")
    for layer in theirs.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data.normal_(0.0, 2.0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="attnc")
    ours.load_state_dict(theirs.state_dict())
    return theirs.eval(), hf.continuous_batching(ours.eval())


def test_sliding_window_layers_read_what_transformers_gathers():
    """Mistral with a window of 16 (every layer sliding: transformers keeps each request's last
    keys in a ring buffer): prompts shorter and longer than the window, chunked prefill (33 rows over
    steps of 24 tokens) and decode past the window; the tokens are transformers' own."""
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB, sliding_window=16,
                                     max_position_embeddings=256, initializer_range=0.3)
    theirs, ours = _sliding_pair(cfg)
    prompts = _prompts((6, 33, 17))
    want, got = _generate(theirs, prompts), _generate(ours, prompts)
    assert [o.error for o in got] == [None] * 3
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]


def test_gpt_oss_alternating_sliding_and_full_layers_with_sinks():
    """gpt-oss's layout: sliding (window 8) and full layers alternating, learned sinks on both; the
    full layers read their pages in place (one append each), the sliding ones what transformers gathers."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=8, max_position_embeddings=256, initializer_range=0.3)
    theirs, ours = _sliding_pair(cfg)
    prompts = _prompts((5, 17, 30))
    want, got = _generate(theirs, prompts), _generate(ours, prompts)
    assert [o.error for o in got] == [None] * 3
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]


def test_an_unknown_transformers_api_is_refused(monkeypatch, llama):
    monkeypatch.setattr(cb, "api", lambda: "")
    with pytest.raises(InputError, match="no paged continuous-batching cache"):
        cb.continuous_batching(llama[1])


def test_a_page_table_that_does_not_start_on_page_boundaries_is_refused():
    """The layout guard: index tensors whose page starts are not multiples of the page unit (a
    transformers version laying its cache out otherwise) are an error, not a wrong answer."""
    class Pool:
        page_size, unit, group = 4, 4, 0
    step = cb._Step(None, torch.tensor([0, 3]), torch.tensor([0, 3]), [torch.empty(0, dtype=torch.long)],
                    [torch.tensor([5, 6, 7])])
    with pytest.raises(InputError, match="do not start pages"):
        step._table(Pool(), 0)
    step = cb._Step(None, torch.tensor([0, 3]), torch.tensor([0, 3]), [torch.empty(0, dtype=torch.long)],
                    [torch.tensor([8, 9, 10])])
    table, T = step._table(Pool(), 0)
    assert table.tolist() == [[2]] and T.tolist() == [0]


def test_padded_steps_are_refused_saying_what_pads_them():
    """CUDA graphs and torch.compile make continuous batching pad a step's query rows; an append
    takes exactly the scheduled rows, so it is refused naming the setting."""
    step = cb._Step(None, torch.tensor([0, 3]), torch.tensor([0, 3]), [torch.empty(0, dtype=torch.long)],
                    [torch.arange(3)])
    rows = torch.zeros(1, 4, 4, 16)
    with pytest.raises(InputError, match=r"4 query rows for 3 scheduled tokens.*use_cuda_graph=False"):
        cb.attend(None, rows, rows[:, :2], rows[:, :2], step)


@pytest.mark.skipif(not GPU, reason="ATTNC_TEST_GPU=1 and a CUDA device")
@pytest.mark.parametrize("requests", [4, 64])
def test_tokens_match_transformers_paged_attention_on_gpu(requests):
    """On CUDA the appends run attnc's Triton kernels over transformers' pages: 64 concurrent
    requests of 8 to 70 prompt tokens, chunked prefill mixed with decode."""
    theirs, ours = _llama("cuda")
    lengths = [8 + (37 * i) % 63 for i in range(requests)]
    prompts = _prompts(lengths, seed=requests)
    config = dict(page_size=16, max_batch_tokens=256, num_blocks=requests * 8)
    want, got = _generate(theirs, prompts, **config), _generate(ours, prompts, **config)
    assert [o.error for o in got] == [None] * requests
    same = sum(g.generated_tokens == w.generated_tokens for g, w in zip(got, want))
    assert same == requests, f"{requests - same} of {requests} requests differ"


@pytest.mark.skipif(not GPU, reason="ATTNC_TEST_GPU=1 and a CUDA device")
def test_gpt_oss_sliding_and_full_layers_on_gpu():
    """gpt-oss's layout on CUDA (float32 weights: the comparison is of attention, not of rounding):
    16 requests past the window of 8, the sliding layers' ragged decode and the full layers' appends
    on the Triton kernels."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=8, max_position_embeddings=256, initializer_range=0.3)
    theirs, ours = (m.to("cuda") for m in _sliding_pair(cfg))
    prompts = _prompts([8 + (29 * i) % 41 for i in range(16)], seed=16)
    config = dict(page_size=16, max_batch_tokens=128, num_blocks=128)
    want, got = _generate(theirs, prompts, **config), _generate(ours, prompts, **config)
    assert [o.error for o in got] == [None] * 16
    assert [g.generated_tokens for g in got] == [w.generated_tokens for w in want]
