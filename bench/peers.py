"""Peers that are not part of torch: FlashAttention-4 (``flash_attn.cute``), as the prefill and
backward benches call it on the bench masks.

FlashAttention-4 takes bshd tensors: the adapter makes its own bshd copies of q, k, v once, outside
the timed call, and hands back a converter of its outputs to the bench's bhsd.  The documents run
``flash_attn_varlen_func`` over the packed rows of every request, split where ``doc`` changes; the
other masks ``flash_attn_func`` with ``causal`` and ``window_size``."""
from __future__ import annotations

import importlib.util

# bench mask -> (causal, window_size) of flash_attn_func; the documents are varlen and causal
FA4_MASKS = {"causal": (True, (None, None)), "full": (False, (None, None)),
             "sliding_window_1024": (True, (1023, 0)), "causal_document": (True, (None, None))}


def flash_importable() -> bool:
    """Whether ``flash_attn`` can be imported: FlashAttention-4 and Flex's ``BACKEND="FLASH"`` need it."""
    return importlib.util.find_spec("flash_attn") is not None


def fa4(name, q, k, v, tensors, grad: bool = False, softcap: float = 0.0):
    """FlashAttention-4 on bench mask ``name``: ``(forward, (its q, k, v), to_bhsd)``, or a string
    saying why it cannot run.  ``forward()`` returns O in bshd; ``to_bhsd(x)`` turns one of its
    bshd tensors (O or a gradient) back into the bench's layout (a view).  With ``grad`` its q, k, v
    copies require grad (the leaves to differentiate).  GQA: k, v have fewer heads than q."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError as e:
        return f"flash_attn.cute is not importable: {e}"
    import torch
    if name not in FA4_MASKS:
        return f"FlashAttention-4 has no '{name}' mask"
    causal, window = FA4_MASKS[name]
    qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_(grad) for x in (q, k, v))
    batch, seq = qs.shape[:2]
    extra = {"softcap": softcap} if softcap else {}

    def first(r):
        return r[0] if isinstance(r, tuple) else r
    if name == "causal_document":
        doc = tensors["doc"]
        starts = [torch.nonzero(torch.diff(doc[b].long(), prepend=doc[b, :1].long() - 1)).flatten() + b * seq
                  for b in range(batch)]
        cu = torch.cat([*starts, torch.tensor([batch * seq], device=q.device)]).to(torch.int32)
        longest = int(torch.diff(cu).max())

        def forward():
            flat = [x.view(batch * seq, *x.shape[2:]) for x in (qs, ks, vs)]
            o = first(flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                             max_seqlen_k=longest, causal=True, **extra))
            return o.view(batch, seq, *o.shape[1:])
    else:
        def forward():
            return first(flash_attn_func(qs, ks, vs, causal=causal, window_size=window, **extra))
    return forward, (qs, ks, vs), (lambda x: x.transpose(1, 2))
