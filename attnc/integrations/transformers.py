"""attnc as a Hugging Face transformers attention implementation: ``attn_implementation="attnc"``.

    import attnc.integrations.transformers          # registers "attnc" (importing is enough)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnc")

Importing this module registers an attention function under the name ``"attnc"`` in transformers'
``AttentionInterface`` and a mask function under the same name in its ``AttentionMaskInterface``.
Each attention call is run by a spec generated from what transformers passes (``spec_text``), one
compiled ``attnc.Attention`` per distinct spec (so one per model, two for models that alternate
sliding and full layers), shape-generic in heads, head dim and dtype:

- **causal** (``module.is_causal``, or the ``is_causal`` keyword): ``mask = causal``; a
  non-causal module gets ``mask = true`` (or ``abs(q - k) <= n`` with a sliding window, as
  transformers' bidirectional sliding window);
- **sliding window** (the ``sliding_window`` keyword: Mistral's config value, Gemma-2's on its
  sliding layers, ``None`` on full layers): ``& window(n)``, i.e. ``q - k < n``, transformers'
  ``kv_idx > q_idx - sliding_window``;
- **softcap** (the ``softcap`` keyword, Gemma-2's ``attn_logit_softcapping``):
  ``score = softcap(score, cap)`` on the scaled score, as transformers' eager path;
- **scaling** (the ``scaling`` keyword: ``head_dim ** -0.5`` for Llama and gpt-oss, Gemma-2's
  ``query_pre_attn_scalar ** -0.5``): ``scale = <the value>``, a constant in the spec;
- **attention sinks** (the ``s_aux`` keyword: gpt-oss's ``module.sinks``, one learned logit per
  query head): ``tensor sinks: f32[h]`` and ``sink = sinks[h]``, the logit that joins each row's
  softmax denominator and carries no value (transformers' eager path appends it to the scores as
  one more column and drops that column after the softmax; the same). The parameter is passed as a
  float32 tensor, so under autograd its gradient (dSink) comes back through attnc's backward, cast
  to the parameter's dtype. A gpt-oss model runs two specs, one per layer kind (``spec_text``, its
  comments left out)::

      attention transformers {                 attention transformers {
          scale = 0.125                            scale = 0.125
          tensor sinks: f32[h]                     tensor sinks: f32[h]
          mask = causal & window(128)              mask = causal
          sink = sinks[h]                          sink = sinks[h]
      }                                        }

  (``"sliding_attention"`` layers, left; ``"full_attention"`` layers, right);
- **padding** (a 2D ``attention_mask`` with a padded token, e.g. batched generation with left
  padding): ``tensor pad: bool[b, s]`` and ``& pad[b, k]``, the key-padding mask transformers
  applies. The registered mask function hands the attention function that 2D mask (sliced to the
  layer's keys) and ``None`` when it has no padding, so no dense [B, 1, S_q, S_k] mask is ever
  built. Query rows that see no key (padding rows of a left-padded batch) come back as zeros,
  where eager returns an average over masked keys: neither is meaningful, the logits of real
  tokens agree;
- **documents** (packed sequences): with no padding mask, ``position_ids`` that do not increase
  by one from a token to the next start a new document (transformers'
  ``find_packed_sequence_indices`` rule, ``doc[b, s]`` = the number of such restarts up to ``s``),
  and the spec becomes ``causal & doc[b, q] == doc[b, k]`` with ``tensor doc: i32[b, s]``;
  flash-attention-style ``cu_seq_lens_q``/``cu_seq_lens_k`` keywords (batch 1) give the same
  tensor. Like transformers' ``flash_attention_2`` path, this is done whenever position ids
  restart, with or without a cache object, for any batch size. The check costs one host
  synchronisation per forward for a multi-token call (decode steps skip it; the result is cached
  per ``position_ids`` tensor, so the layers of one forward share it and the doc tensor's plan).
  ``register(packed_sequences=False)`` turns it off.

Refused with an error that says why (never silently wrong): ``dropout`` other than 0, a sink that is
not one value per query head, ``position_bias``, a 4D or BlockMask ``attention_mask`` (a custom mask: write
it as a spec), a model that adds its own mask function (``or_mask_function``/``and_mask_function``,
e.g. image tokens that attend bidirectionally), a static cache (its keys are not bottom-right
aligned: the unwritten slots follow the written ones; use the default ``DynamicCache``), packed
sequences over earlier cache content.  Training works through attnc's backward pass (q, k, v and
sink gradients; masks read from the position ids have none).

Under ``torch.compile`` (``fullgraph=True`` too) the spec's handle is a constant of the trace and
the call is attnc's custom op.  Host checks cannot run inside a graph, so there a multi-token call
that holds every token reads its position ids as documents without looking (one document when
nothing restarts: the causal mask, through a tensor), and a padding mask is passed on as it is
(all-visible included).

Decode and generation with a ``DynamicCache`` work as they are: attnc's masks are bottom-right
aligned (query row ``i`` of ``S_q`` over ``S_k`` keys is at position ``S_k - S_q + i``), which is
where the cache puts the new tokens, also in a sliding-window layer whose cache keeps only the
last ``window - 1`` keys.  Attention weights are never returned (``output_attentions`` gives
``None``, as with ``sdpa`` and flash attention).

transformers' continuous batching (``generate_batch``) runs on attnc's paged append through
``continuous_batching(model)`` and the name ``CONTINUOUS_BATCHING`` (``continuous_batching.py``).
"""
from __future__ import annotations

import functools
import math
import weakref

import torch

import attnc
from attnc.compiler.errors import InputError
from attnc.integrations import continuous_batching as _cb

NAME = "attnc"
_OPTIONS = {"packed_sequences": True, "backend": None}
_DOCS: list = []  # [(weakref to position_ids, version, batch, S_k, doc tensor or None)], newest last
_DOCS_KEPT = 4


# ---------------------------------------------------------------- specs
def spec_text(*, causal: bool = True, window: int | None = None, softcap: float | None = None,
              scale: float | None = None, padding: bool = False, documents: bool = False,
              sinks: bool = False) -> str:
    """The .attn spec of one kind of transformers attention call (shape-generic: heads, head dim
    and dtype come from each call)."""
    lines = ["attention transformers {"]
    if scale is not None:
        if not math.isfinite(scale) or scale <= 0:
            raise InputError(f"transformers: scaling {scale!r} is not a positive finite number")
        lines.append(f"    scale = {float(scale)!r}")
    if padding:
        lines.append("    tensor pad: bool[b, s]        # the 2D attention_mask: false = a padded key")
    if documents:
        lines.append("    tensor doc: i32[b, s]         # packed sequences: restarts of position_ids")
    if sinks:
        lines.append("    tensor sinks: f32[h]          # s_aux: the module's learned sink logit per query head")
    if softcap is not None:
        if not math.isfinite(softcap) or softcap <= 0:
            raise InputError(f"transformers: softcap {softcap!r} is not a positive finite number")
        lines.append(f"    score = softcap(score, {float(softcap)!r})")
    terms = []
    if causal:
        terms.append("causal")
    if window is not None:
        window = int(window)
        if window < 1:
            raise InputError(f"transformers: sliding_window {window} is not a positive window")
        terms.append(f"window({window})" if causal else f"abs(q - k) <= {window}")
    if documents:
        terms.append("doc[b, q] == doc[b, k]")
    if padding:
        terms.append("pad[b, k]")
    lines.append(f"    mask = {' & '.join(terms) or 'true'}")
    if sinks:
        lines.append("    sink = sinks[h]")
    lines.append("}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def attention_for(causal: bool = True, window: int | None = None, softcap: float | None = None,
                  scale: float | None = None, padding: bool = False, documents: bool = False,
                  sinks: bool = False) -> "attnc.Attention":
    """The compiled spec for one kind of call (cached: one per distinct spec in the process)."""
    return attnc.compile(spec_text(causal=causal, window=window, softcap=softcap, scale=scale, padding=padding,
                                   documents=documents, sinks=sinks), name="transformers")


_BY_HANDLE: dict = {}


@torch.compiler.assume_constant_result
def _handle_for(causal: bool, window: int | None, softcap: float | None, scale: float | None, padding: bool,
                documents: bool, sinks: bool) -> str:
    """attention_for's handle: under torch.compile, dynamo runs this once while tracing and keeps
    the string, so it never traces into the spec compiler; the call itself is attnc's custom op."""
    attn = attention_for(causal, window, softcap, scale, padding, documents, sinks)
    _BY_HANDLE[attn.handle] = attn
    return attn.handle


# ---------------------------------------------------------------- documents
def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """doc[b, s]: how many times ``position_ids[b]`` has restarted (not increased by exactly one)
    up to ``s``, as int32 -- transformers' ``find_packed_sequence_indices`` rule."""
    first = position_ids[:, :1] - 1
    diff = torch.diff(position_ids, prepend=first, dim=-1)
    return (diff != 1).cumsum(-1).to(torch.int32)


def _documents_from_cu_seqlens(cu_q, cu_k, batch: int, s_q: int, s_k: int):
    if cu_k is not None and (cu_k.shape != cu_q.shape or not torch.equal(cu_q, cu_k)):
        raise InputError("transformers: cu_seq_lens_q and cu_seq_lens_k differ; attnc's integration runs packed "
                         "self-attention, where both are the same")
    if batch != 1 or s_q != s_k or int(cu_q[-1]) != s_q:
        raise InputError(f"transformers: cu_seq_lens_q (ending at {int(cu_q[-1])}) must describe one packed row "
                         f"of all {s_q} tokens (batch 1, no earlier cache content); got batch {batch}, "
                         f"S_q {s_q}, S_k {s_k}")
    if cu_q.numel() <= 2:
        return None
    steps = torch.arange(s_q, device=cu_q.device)
    return _tracked(torch.searchsorted(cu_q[1:-1].to(steps.dtype), steps, right=True).to(torch.int32)[None])


def _documents(kwargs: dict, batch: int, s_q: int, s_k: int):
    """The doc tensor of a packed call, or None when its sequences are not packed."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        return _documents_from_cu_seqlens(cu_q, kwargs.get("cu_seq_lens_k"), batch, s_q, s_k)
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] != s_q or pos.shape[0] not in (1, batch):
        return None  # (absent, or multimodal 3D rope positions: no packing information)
    if torch.compiler.is_compiling():
        # no host check inside a compiled graph: a call holding every token reads its position ids
        # as documents (one document when nothing restarts: the causal mask, through a tensor)
        return document_ids(pos).expand(batch, -1).contiguous() if s_q == s_k else None
    version = None if pos.is_inference() else pos._version  # (inference tensors have no version counter)
    for ref, v, b, k, doc in _DOCS:
        if ref() is pos and v == version and b == batch and k == s_k:
            return doc
    doc = document_ids(pos)
    if not bool(doc[:, -1].any()):  # (the one host synchronisation)
        doc = None
    elif s_q != s_k:
        raise InputError(f"transformers: position_ids restart inside a call of {s_q} new tokens over {s_k} keys; "
                         "packed sequences are supported when the call holds every token (no earlier cache "
                         "content): pass use_cache=False, or one sequence per batch row")
    else:
        doc = _tracked(doc.expand(batch, -1).contiguous())
    _DOCS.append((weakref.ref(pos), version, batch, s_k, doc))
    del _DOCS[:-_DOCS_KEPT]
    return doc


# ---------------------------------------------------------------- sinks
def _sinks(s_aux, query: torch.Tensor) -> torch.Tensor:
    """The ``sinks`` tensor of the spec: ``s_aux`` (gpt-oss's ``module.sinks``, [H_q]) as float32 on
    the query's device.  The cast is differentiable, so the parameter's gradient flows back."""
    heads = query.shape[1]
    if not isinstance(s_aux, torch.Tensor) or s_aux.dim() != 1 or s_aux.shape[0] != heads:
        shape = list(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise InputError(f"transformers: the attention sinks (s_aux) must be one logit per query head, a tensor of "
                         f"shape [{heads}]; got {shape}")
    if not s_aux.is_floating_point():
        raise InputError(f"transformers: the attention sinks (s_aux) are {s_aux.dtype}; a sink is a float logit")
    return s_aux.to(device=query.device, dtype=torch.float32).contiguous()


# ---------------------------------------------------------------- padding
def _padding(mask, batch: int, s_k: int):
    """The key-padding mask [B, S_k] (bool, true = visible), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = list(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        raise InputError(f"transformers: attnc takes the 2D padding attention_mask [batch, keys] (or none); got "
                         f"{shape}. A custom 4D mask is not read: write the mask as an attnc spec instead")
    if mask.shape[1] > s_k:
        mask = mask[:, -s_k:]
    if mask.shape[0] != batch or mask.shape[1] != s_k:
        raise InputError(f"transformers: the padding attention_mask has shape {list(mask.shape)}, the call has batch "
                         f"{batch} and {s_k} keys")
    if mask.dtype != torch.bool:
        mask = mask != 0
    return _tracked(mask if mask.is_contiguous() else mask.contiguous())


def _tracked(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it made outside inference mode when it is an inference tensor: attnc's
    plan cache keys a mask tensor by identity and version counter, which inference tensors lack
    (a forward under ``torch.inference_mode()`` makes its position ids and masks in it)."""
    if torch.compiler.is_compiling() or not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


# ---------------------------------------------------------------- the attention function
def attnc_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            is_causal: bool | None = None, **kwargs):
    """transformers' attention interface: query [B, H_q, S_q, d], key/value [B, H_kv, S_k, d]
    (bhsd shapes; usually [B, S, H, d] memory) in, (attn_output [B, S_q, H_q, d] contiguous, None)
    out, with no copy of q, k, v or O where q is token-major."""
    if dropout:
        raise InputError(f"transformers: attention dropout {dropout} is not supported by attnc (model.eval(), or "
                         "attention_dropout=0 to train)")
    if kwargs.get("position_bias") is not None:
        raise InputError("transformers: 'position_bias' is not supported by attnc's integration")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, s_q, s_k = query.shape[0], query.shape[2], key.shape[2]
    tensors = {}
    if kwargs.get("s_aux") is not None:
        tensors["sinks"] = _sinks(kwargs["s_aux"], query)
    pad = _padding(attention_mask, batch, s_k)
    if pad is not None:
        tensors["pad"] = pad
    elif causal and _OPTIONS["packed_sequences"] and s_q > 1:
        doc = _documents(kwargs, batch, s_q, s_k)
        if doc is not None:
            tensors["doc"] = doc
    # transformers hands q, k and v over as transposed views of its [B, S, H, d] projections (RoPE's
    # output keeps that order; a cache's concatenation is contiguous): passed on as they are -- the
    # Gluon engine reads token-major views in place, the Triton kernel takes strides, the numpy
    # backend copies to the host anyway -- and O comes back token-major for a token-major q
    # (attnc.layouts.out_order), so the transpose below is contiguous and .contiguous() copies nothing
    attn = _BY_HANDLE[_handle_for(bool(causal), None if sliding_window is None else int(sliding_window),
                                  float(softcap) if softcap else None, None if scaling is None else float(scaling),
                                  "pad" in tensors, "doc" in tensors, "sinks" in tensors)]
    o = attn(query, key, value, backend=_OPTIONS["backend"], **tensors)
    return o.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------- the mask function
def attnc_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask interface for "attnc": the 2D padding mask sliced to the layer's keys
    ([B, kv_length] bool), or None when nothing is padded.  The causal, sliding-window and document
    structure is the spec's; no dense mask is built."""
    if kwargs.get("use_vmap"):
        raise InputError("transformers: this model adds its own mask function (or_mask_function / "
                         "and_mask_function, e.g. image tokens attending bidirectionally); attnc's integration "
                         "expresses causal, sliding-window, padding and packed-document masks only")
    if isinstance(q_offset, torch.Tensor) or (q_offset + q_length - kv_offset != kv_length
                                              and not _sees_everything(mask_function, q_offset, kv_offset, kv_length)):
        raise InputError(f"transformers: the cache gives {kv_length} keys for {q_length} queries at offset "
                         f"{int(q_offset)}: its keys are not bottom-right aligned (a static cache?). attnc's masks "
                         "put the last query on the last key; use the default DynamicCache")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling():  # (no host check in a graph: the mask goes to the spec as it is)
        return attention_mask.contiguous()
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return _tracked(attention_mask.contiguous())  # (one tensor for every layer: their plans are shared)


def _sees_everything(mask_function, q_offset: int, kv_offset: int, kv_length: int) -> bool:
    """Whether a mask function lets the first query see the last key (a bidirectional or
    cross-attention mask, where bottom-right alignment does not matter)."""
    if mask_function is None:
        return False
    try:
        t = functools.partial(torch.tensor, dtype=torch.long)
        return bool(mask_function(t(0), t(0), t(int(q_offset)), t(int(kv_offset) + kv_length - 1)))
    except Exception:  # noqa: BLE001 - a mask function we cannot evaluate is not known to be full
        return False


# ---------------------------------------------------------------- registration
def register(name: str = NAME, *, packed_sequences: bool = True, backend: str | None = None) -> str:
    """Register the attention and mask functions under ``name`` (importing this module does it
    with the defaults).  ``packed_sequences=False`` turns the position_ids document detection off;
    ``backend`` forces an attnc backend ("triton", "numpy") instead of the device's choice (CUDA
    tensors: Triton, CPU tensors: numpy).  The options hold for every name.  Returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    _OPTIONS["packed_sequences"] = bool(packed_sequences)
    _OPTIONS["backend"] = backend or None
    AttentionInterface.register(name, attnc_attention_forward)
    AttentionMaskInterface.register(name, attnc_mask)
    _cb.register(attnc_attention_forward, attnc_mask, _OPTIONS)
    return name


# ---------------------------------------------------------------- continuous batching
CONTINUOUS_BATCHING = _cb.CONTINUOUS_BATCHING  # the implementation name of continuous batching on attnc
continuous_batching = _cb.continuous_batching

register()
