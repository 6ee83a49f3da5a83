"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) on attnc's
paged append: ``attnc.integrations.transformers.continuous_batching(model)``.

Each forward step of a continuous batch packs prefill chunks and decode tokens of many requests
into one row of queries.  Here every attention layer of the step is **one** ``attn.append`` call
over transformers' own paged K/V storage: the layer's new K/V rows are staged into the request's
pages, the queries attend over the committed rows and themselves, and nothing gathers the cache.
The step's manifest (``attnc.MicrobatchManifest``: each request's committed rows ``T`` and new rows
``C``) and its append plan are made once per step and shared by the layers.

**The way in, by transformers version** (``CONTINUOUS_BATCHING`` is the name this installation
uses; ``continuous_batching(model)`` sets it and whatever else the version needs):

- *The attention function updates the cache* (transformers 5.17: ``PagedAttentionCache.update``
  takes ``read_index``/``write_index``; continuous batching runs an implementation named
  ``paged|<name>`` and hands it the cache).  The name is ``"paged|attnc"``: the function receives
  the cache and writes nothing through ``update`` -- attnc's append writes the rows.  A model loaded
  with ``attn_implementation="attnc"`` is switched to it by transformers itself, unless a
  FlashAttention package is installed (then transformers prefers it: load with the name or call
  ``continuous_batching(model)``).
- *The model updates the cache* (transformers 5.24: the attention layer calls
  ``cache.update(k, v, layer_idx, kwargs=kwargs)`` before the attention function; continuous
  batching accepts ``paged|eager``, ``sdpa`` or a name containing "flash").  The name is
  ``"attnc_flash"``; ``update`` gathers every request's K/V with ``index_select`` (a copy of the
  cache read) unless the step carries a ``block_table``, in which case it writes nothing and
  passes the paged views on.  ``continuous_batching(model)`` therefore adds a forward pre-hook
  that gives every step (prefill chunks included, not only decode) the page table attnc's append
  reads, and sets the name on the config directly: ``set_attn_implementation`` would try to import
  a FlashAttention kernel of that name, which attnc is not.
- *Neither* (another API): ``continuous_batching(model)`` refuses, saying which.

**Layout.**  A page of transformers' pool is ``P = page_size`` consecutive token rows of one layer's
K (or V) ``[P, H_kv, d]``, attnc's ``paged(layout = nhd, table = dense)``.  transformers 5.17 keeps
one K and one V tensor per layer position, ``[(blocks + 2) * P, H_kv, d]``, viewed here as
``[blocks + 2, P, H_kv, d]`` (a view: page id = block id).  transformers 5.24 keeps one byte pool
where a block holds, for each layer of its group in turn, a K page then a V page; the layer's K and
V pages are the strided views ``pool.view(blocks, 2 * L, P, H_kv, d)[:, 2 i]`` and ``[:, 2 i + 1]``
(page id = block id, page stride ``2 L P H_kv d`` elements), so K and V share no element, as the
append's aliasing check requires.  The page table of request ``b`` is read off transformers' own
index tensors: its ``j``-th page is ``index[start_b + j P] // unit`` (the read indices, or the write
indices in a step with no cache reads), where ``unit`` is the physical rows per page id (``P``, or
the block stride ``2 L P``); a page start that is not on a unit boundary is refused, so a layout
change in transformers is an error, never a wrong answer.

**Sliding-window layers** (Mistral, gpt-oss's sliding layers): transformers keeps them in a ring
buffer (the token at position ``t`` in slot ``t mod window``), which attnc's page layout (position
``t`` at page ``t // P``) cannot address, and a step's new rows overwrite keys its earlier queries
still see, so the cache must be read before it is written.  transformers' cache update does exactly
that for them -- called by the attention function here on the 5.17 API, by the model on 5.24
(``_gather_sliding_layers`` sends those layers down its index path while the full layers keep the
page table) -- and hands over each request's last ``window - 1`` cached rows and its new rows,
which one ragged ``attn.decode`` with ``causal & window(n)`` attends over.

**Refused, saying why:** CUDA-graph capture (an append validates on the host: pass
``ContinuousBatchingConfig(use_cuda_graph=False)``), softcap, dropout, position bias.  Learned
sinks (``s_aux``, gpt-oss) join the spec as ``sink = sinks[h]``.
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref

import torch

import attnc
from attnc.compiler.errors import InputError

_STEPS: list = []  # [(weakref to the step's cu_seq_lens_q, _Step)], newest last
_STEPS_KEPT = 4
_HOOKED = "_attnc_cb_hook"
_REGISTERED: dict = {}  # "fallback": attnc's ordinary attention function, "options": its options (register())


# ---------------------------------------------------------------- the installed transformers' API
@functools.lru_cache(maxsize=None)
def api() -> str:
    """"attention" when the attention function updates the paged cache (5.17), "model" when the
    model does (5.24), or "" when this transformers has no paged cache attnc can drive."""
    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
    except ImportError:
        return ""
    params = inspect.signature(PagedAttentionCache.update).parameters
    if "read_index" in params and "write_index" in params:
        return "attention"
    if "kwargs" in params:
        return "model"
    return ""


def name_for(kind: str) -> str | None:
    """The implementation name continuous batching runs attnc under, for an API kind."""
    return {"attention": "paged|attnc", "model": "attnc_flash"}.get(kind)


CONTINUOUS_BATCHING = name_for(api())


# ---------------------------------------------------------------- the spec
def paged_spec_text(page_size: int, scale: float | None = None, sinks: bool = False) -> str:
    """The spec of a continuous-batching layer: causal over transformers' nhd pages (shape-generic
    in heads, head dim and dtype), with ``sink = sinks[h]`` for models with learned sinks."""
    return _spec_text("transformers_paged", "causal",
                      f"paged(page_size = {int(page_size)}, layout = nhd, table = dense)", scale, sinks)


def _spec_text(name: str, mask: str, cache: str, scale: float | None, sinks: bool) -> str:
    lines = [f"attention {name} {{"]
    if scale is not None:
        if not math.isfinite(scale) or scale <= 0:
            raise InputError(f"transformers: scaling {scale!r} is not a positive finite number")
        lines.append(f"    scale = {float(scale)!r}")
    if sinks:
        lines += ["    tensor sinks: f32[h]          # the layer's learned sink logits (s_aux)",
                  "    sink = sinks[h]"]
    lines += [f"    mask = {mask}", f"    cache = {cache}", "}"]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def paged_attention_for(page_size: int, scale: float | None, sinks: bool) -> "attnc.Attention":
    return attnc.compile(paged_spec_text(page_size, scale, sinks), name="transformers_paged")


def window_spec_text(window: int, scale: float | None = None, sinks: bool = False) -> str:
    """The spec of a sliding-window layer's step: ``causal & window(n)`` (transformers'
    ``kv_idx > q_idx - sliding_window``) over the ragged K/V transformers gathers for it (each
    request's last ``window - 1`` cached rows, then its new rows)."""
    return _spec_text("transformers_window", f"causal & window({int(window)})", "ragged", scale, sinks)


@functools.lru_cache(maxsize=None)
def window_attention_for(window: int, scale: float | None, sinks: bool) -> "attnc.Attention":
    return attnc.compile(window_spec_text(window, scale, sinks), name="transformers_window")


def _sliding(window) -> bool:
    """Whether transformers' ``cache.sliding_windows`` entry names a sliding-window layer (the
    attention API's 5.17 cache: 1 or None for full attention)."""
    return window not in (None, 1)


# ---------------------------------------------------------------- one attention group's pages
class _Pool:
    """One attention group's pages in attnc's layout: ``unit`` physical rows per page id in
    transformers' index tensors, and each layer's (K pages, V pages) views."""

    def __init__(self, cache, layer_idx: int):
        if api() == "attention":
            window = cache.sliding_windows.get(layer_idx, 1)
            self.sliding = _sliding(window)
            self.window = window if self.sliding else None
            self.group = cache.layer_index_to_group_indices[layer_idx][0]
            self.page_size = self.unit = int(cache.block_size)
        else:
            allocator = cache.layer_to_allocator[layer_idx]
            self.sliding = getattr(allocator, "layer_type", "") != "full_attention"
            self.group = allocator.index
            self.page_size = int(allocator.tokens_per_page)
            self.unit = int(allocator.block_physical_stride)
            self.window = getattr(allocator, "sliding_window", None) if self.sliding else None
        if self.sliding and not (isinstance(self.window, int) and self.window > 0):
            raise InputError(f"transformers: layer {layer_idx} has sliding window {self.window!r}; attnc's integration "
                             "knows full and sliding-window layers with a positive window")

    def pages(self, c, layer_idx: int):
        """(K pages, V pages) of a layer of cache ``c``, each [pages, P, H_kv, d]: views of
        transformers' storage."""
        P = self.page_size
        if api() == "attention":
            j = c.layer_index_to_group_indices[layer_idx][1]
            k, v = c.key_cache[j], c.value_cache[j]
            return k.view(-1, P, *k.shape[1:]), v.view(-1, P, *v.shape[1:])
        allocator = c.layer_to_allocator[layer_idx]
        i, L = allocator.layer_indices.index(layer_idx), allocator.pages_per_block
        pool = allocator.cache_tensor
        blocks = pool.view(-1, 2 * L, P, *pool.shape[2:])
        return blocks[:, 2 * i], blocks[:, 2 * i + 1]


# ---------------------------------------------------------------- one forward step
class _Step:
    """What every layer of one forward step shares: per request the committed rows ``T`` and new
    rows ``C`` (host), per attention group the page table (host, int32, -1 past the request's
    pages), the frozen manifest and, once the group's first layer has planned, its append plan."""

    def __init__(self, cache, cu_q, cu_k, read_index, write_index):
        # (weakly: the process keeps its last steps, and a finished run's cache must be freed)
        self._cache = (lambda: None) if cache is None else weakref.ref(cache)
        cu_q_host = cu_q.detach().to("cpu", torch.int64)
        self.C = torch.diff(cu_q_host)
        self.tables, self.T, self.manifests, self.plans, self.pools = {}, {}, {}, {}, {}
        self._gathered: dict = {}  # layer type -> (kv_indptr, qo_indptr) of a sliding group's gathered K/V
        self._cu = (cu_q_host, cu_k, read_index, write_index)

    @property
    def cache(self):
        """transformers' PagedAttentionCache of the step (None once it is freed)."""
        return self._cache()

    def group(self, layer_idx: int):
        """(pool, page table, T, manifest) of the layer's attention group, made on its first layer."""
        pool = _Pool(self.cache, layer_idx)
        g = pool.group
        if pool.sliding:  # (the model gathers its K/V: no table, no manifest)
            self.pools[g] = pool
            return pool, None, None, None
        if g not in self.tables:
            self.pools[g] = pool
            self.tables[g], self.T[g] = self._table(pool, g)
            self.manifests[g] = attnc.MicrobatchManifest.freeze(range(len(self.C)), range(len(self.C)),
                                                               self.T[g].numpy(), self.C.numpy())
        return self.pools[g], self.tables[g], self.T[g], self.manifests[g]

    def gathered_indptr(self, layer_type: str):
        """(kv_indptr, qo_indptr) host int32 of a sliding group's gathered K/V (made once per step)."""
        made = self._gathered
        if layer_type not in made:
            cu_q, cu_k = self._cu[0], self._cu[1]
            cu_k = cu_k[layer_type] if isinstance(cu_k, dict) else cu_k
            made[layer_type] = (cu_k.detach().to("cpu", torch.int32), cu_q.to(torch.int32))
        return made[layer_type]

    def _table(self, pool: _Pool, g: int):
        cu_q, cu_k, read_index, write_index = self._cu
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        k_lens = torch.diff(cu_k.detach().to("cpu", torch.int64))
        if k_lens.shape != self.C.shape:
            raise InputError(f"transformers: cu_seq_lens_k describes {k_lens.numel()} requests, cu_seq_lens_q "
                             f"{self.C.numel()}")
        T = k_lens - self.C
        if bool((T < 0).any()):
            b = int(torch.nonzero(T < 0)[0, 0])
            raise InputError(f"transformers: request {b} has {int(k_lens[b])} keys for {int(self.C[b])} new tokens")
        P = pool.page_size
        index = read_index[g]
        starts = torch.cumsum(k_lens, 0) - k_lens
        if index.numel() == 0:  # no cache reads this step: every request is a first chunk, written from 0
            if bool(T.any()):
                raise InputError("transformers: a step with no cache reads has a request with committed rows")
            index = write_index[g]
            starts = cu_q[:-1]
        width = max(1, int((k_lens.max() + P - 1) // P)) if k_lens.numel() else 1
        j = torch.arange(width)
        used = j[None, :] * P < k_lens[:, None]
        at = (starts[:, None] + j[None, :] * P).clamp(max=max(int(index.numel()) - 1, 0))
        rows = index.detach()[at.to(index.device)].to("cpu", torch.int64) if index.numel() else torch.zeros_like(at)
        if bool((rows[used] % pool.unit).any()):
            raise InputError(f"transformers: the paged cache's index tensors do not start pages on multiples of "
                             f"{pool.unit} rows: this transformers version lays its cache out differently from what "
                             "attnc's integration reads")
        table = torch.where(used, rows // pool.unit, torch.full_like(rows, -1)).to(torch.int32)
        return table, T.to(torch.int32)


def _step_for(cu_q, make) -> _Step:
    """The step of ``cu_q`` (the tensor transformers passes to every layer of one forward)."""
    for ref, step in _STEPS:
        if ref() is cu_q:
            return step
    step = make()
    _STEPS[:] = [(ref, s) for ref, s in _STEPS if ref() is not None][-(_STEPS_KEPT - 1):]
    _STEPS.append((weakref.ref(cu_q), step))
    return step


def _refuse_capture():
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError("transformers: continuous batching is capturing a CUDA graph; attnc's append validates each "
                         "step on the host and cannot be captured: pass ContinuousBatchingConfig(use_cuda_graph=False)")


# ---------------------------------------------------------------- the attention function
def attend(module, query, key, value, step: _Step, *, scaling=None, s_aux=None, backend=None):
    """One layer of one step: query [1, H_q, N, d], key/value [1, H_kv, N, d] (the step's new rows,
    request by request) -> [1, N, H_q, d], through one ``attn.append`` over the layer's pages."""
    if query.shape[2] != int(step.C.sum()):
        raise InputError(f"transformers: the step has {query.shape[2]} query rows for {int(step.C.sum())} scheduled "
                         "tokens: continuous batching padded its inputs (CUDA graphs or torch.compile), which attnc's "
                         "append cannot take: pass ContinuousBatchingConfig(use_cuda_graph=False) and no compile "
                         "config")
    pool, table, T, manifest = step.group(module.layer_idx)
    if pool.sliding:
        return _attend_gathered(query, key, value, step, pool, scaling, s_aux)
    k_pages, v_pages = pool.pages(step.cache, module.layer_idx)
    attn = paged_attention_for(pool.page_size, None if scaling is None else float(scaling), s_aux is not None)
    q = query[0].transpose(0, 1).contiguous()
    k_new, v_new = (t[0].transpose(0, 1).contiguous() for t in (key, value))
    extra = {} if s_aux is None else {"sinks": s_aux.detach().float().contiguous()}
    cache = dict(k_cache=k_pages, v_cache=v_pages, block_table=table, q_lens=step.C.to(torch.int32), **extra)
    key_ = (pool.group, attn.handle)
    if key_ not in step.plans:
        step.plans[key_] = attn.plan_append(q, k_new, v_new, manifest=manifest, backend=backend, kv_lens=T.clone(),
                                            **cache)
    o = attn.append(q, k_new, v_new, manifest=manifest, plan=step.plans[key_], backend=backend, kv_lens=T.clone(),
                    **cache)
    return o.unsqueeze(0)


def _attend_gathered(query, key, value, step: _Step, pool: _Pool, scaling, s_aux):
    """A sliding-window layer of one step: transformers' cache update read the layer's ring buffer
    before writing it (the new rows may overwrite keys the older queries still see) and handed over
    each request's last ``window - 1`` cached rows then its new ones, key/value [1, H_kv, rows, d];
    one ragged ``attn.decode`` over them (the window is short: this is a copy of at most
    ``window - 1 + C`` rows per request, what transformers' own paged path reads)."""
    kv_indptr, qo_indptr = step.gathered_indptr("sliding_attention")
    if key.shape[2] != int(kv_indptr[-1]):
        raise InputError(f"transformers: a sliding-window layer was handed {key.shape[2]} key rows for "
                         f"{int(kv_indptr[-1])} in cu_seq_lens_k")
    attn = window_attention_for(pool.window, None if scaling is None else float(scaling), s_aux is not None)
    q = query[0].transpose(0, 1).contiguous()
    k, v = (t[0].transpose(0, 1).contiguous() for t in (key, value))
    extra = {} if s_aux is None else {"sinks": s_aux.detach().float().contiguous()}
    o = attn.decode(q, k=k, v=v, kv_indptr=kv_indptr, qo_indptr=qo_indptr, **extra)  # (the device's backend)
    return o.unsqueeze(0)


def _check_kwargs(dropout, kwargs):
    if dropout:
        raise InputError(f"transformers: attention dropout {dropout} is not supported by attnc (inference only)")
    for name in ("softcap", "position_bias"):
        if kwargs.get(name):
            raise InputError(f"transformers: '{name}' is not supported under continuous batching with attnc")


def attention_forward_attention_api(module, query, key, value, attention_mask, cache=None, cu_seq_lens_q=None,
                                    cu_seq_lens_k=None, read_index=None, write_index=None, dropout: float = 0.0,
                                    scaling=None, s_aux=None, **kwargs):
    """``paged|attnc`` (transformers whose attention function updates the cache): one append per
    layer over the cache it is handed; without a paged cache, attnc's ordinary attention."""
    if cache is None or read_index is None:
        return _REGISTERED["fallback"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       s_aux=s_aux, **kwargs)
    _check_kwargs(dropout, kwargs)
    _refuse_capture()
    if kwargs.get("block_table") is not None:
        raise InputError("transformers: this step uses transformers' decode fast path (block_table), which calls a "
                         "FlashAttention kernel; attnc's name should not be given a fast path")
    step = _step_for(cu_seq_lens_q, lambda: _Step(cache, cu_seq_lens_q, cu_seq_lens_k, read_index, write_index))
    if _sliding(cache.sliding_windows.get(module.layer_idx, 1)):  # read the ring, then write it
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, read_index=read_index,
                            write_index=write_index)  # [rows, H_kv, d]
        key, value = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
    return attend(module, query, key, value, step, scaling=scaling, s_aux=s_aux, backend=_backend()), None


def _backend():
    return _REGISTERED["options"].get("backend")


def attention_forward_model_api(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                                s_aux=None, **kwargs):
    """``attnc_flash`` (transformers whose model updates the cache): the step made by the forward
    pre-hook, one append per layer; without one (no continuous batching), attnc's ordinary attention."""
    cu_q = kwargs.get("cu_seq_lens_q")
    step = None
    if cu_q is not None:
        step = next((s for ref, s in _STEPS if ref() is cu_q), None)
    if step is None:
        if kwargs.get("k_cache") is not None:
            raise InputError("transformers: a paged step reached attnc without its page table: call "
                             "attnc.integrations.transformers.continuous_batching(model) before generate_batch")
        kwargs.pop("block_table", None)
        return _REGISTERED["fallback"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       s_aux=s_aux, **kwargs)
    _check_kwargs(dropout, kwargs)
    _refuse_capture()
    return attend(module, query, key, value, step, scaling=scaling, s_aux=s_aux, backend=_backend()), None


def _pre_hook(model, args, kwargs):
    """Forward pre-hook (transformers whose model updates the cache): give a continuous-batching step
    the page table, so ``PagedAttentionCache.update`` hands the pages on instead of gathering them."""
    from transformers.generation.continuous_batching import PagedAttentionCache
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PagedAttentionCache) or model.config._attn_implementation != CONTINUOUS_BATCHING:
        return None
    if kwargs.get("block_table") is not None:
        raise InputError("transformers: this step uses transformers' decode fast path (block_table), which calls a "
                         "FlashAttention kernel; attnc's name should not be given a fast path")
    _refuse_capture()
    cu_q = kwargs["cu_seq_lens_q"]
    step = _step_for(cu_q, lambda: _Step(cache, cu_q, kwargs["cu_seq_lens_k"], kwargs["read_index"],
                                         kwargs["write_index"]))
    for layer_idx in cache.layer_to_allocator:
        step.group(layer_idx)  # (each group's table, and the refusals, before any layer runs)
    if not step.tables:  # sliding-window layers only: the model gathers every layer's K/V
        return None
    _gather_sliding_layers(cache)
    groups = len(cache.cache_allocators)
    width = max(t.shape[1] for t in step.tables.values())
    table = torch.full((groups, len(step.C), width), -1, dtype=torch.int32)
    for g, t in step.tables.items():
        table[g, :, :t.shape[1]] = t
    kwargs["block_table"] = table.to(cache.device if hasattr(cache, "device") else "cpu")
    return args, kwargs


def _gather_sliding_layers(cache) -> None:
    """Make ``cache.update`` take its index path (read the ring buffer, then write it) on sliding-window
    layers while the step carries a page table for the full-attention ones: transformers' sliding
    allocator has no page-table path, and its ring (position t in slot t mod window) is not attnc's
    page layout.  Once per cache; the wrapper holds the cache weakly."""
    if getattr(cache, "_attnc_gathers_sliding", False):
        return
    ref, update = weakref.ref(cache), type(cache).update

    def sliding_aware_update(key_states, value_states, layer_idx, kwargs):
        c = ref()
        if c.layer_to_allocator[layer_idx].layer_type != "full_attention":
            kwargs.pop("block_table", None)  # (this layer's kwargs: each layer is called with its own)
        return update(c, key_states, value_states, layer_idx, kwargs=kwargs)
    cache.update = sliding_aware_update
    cache._attnc_gathers_sliding = True


def continuous_batching(model):
    """Make ``model`` run transformers' continuous batching (``generate_batch``,
    ``init_continuous_batching``) on attnc's paged append; returns the model."""
    kind = api()
    if not kind:
        raise InputError("transformers: this transformers version has no paged continuous-batching cache that attnc's "
                         "integration can drive (it supports the 5.17 API, where the attention function updates "
                         "the cache, and the 5.24 API, where the model does)")
    if not _REGISTERED:
        raise InputError("transformers: import attnc.integrations.transformers first (it registers attnc's "
                         f"continuous-batching name {CONTINUOUS_BATCHING!r})")
    if kind == "attention":
        model.set_attn_implementation(CONTINUOUS_BATCHING)
        return model
    # the flash-named entry is attnc's function, not a FlashAttention kernel: set it on the config,
    # where set_attn_implementation would try to import a kernel of that name
    model.config._attn_implementation = CONTINUOUS_BATCHING
    if not getattr(model, _HOOKED, None):
        setattr(model, _HOOKED, model.register_forward_pre_hook(_pre_hook, with_kwargs=True))
    return model


def register(fallback, mask, options: dict) -> None:
    """Register the continuous-batching name for this transformers: its attention function (with
    ``fallback``, attnc's ordinary attention function, for calls outside continuous batching, and
    its ``options``) and ``mask`` (attnc's mask function).  attnc.integrations.transformers calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if CONTINUOUS_BATCHING is None:
        return
    _REGISTERED.update(fallback=fallback, options=options)
    fn = attention_forward_attention_api if api() == "attention" else attention_forward_model_api
    AttentionInterface.register(CONTINUOUS_BATCHING, fn)
    AttentionMaskInterface.register(CONTINUOUS_BATCHING, mask)
