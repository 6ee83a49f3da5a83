"""FP8 (e4m3) attention inputs: per-head quantization, and the layout the FP8 engine reads.

An FP8 call passes float8_e4m3fn q, k and v with float32 *descales*, one per (request, head):
``x ~= x8.float() * descale[b, h]``, as FlashAttention-3's ``q_descale`` / ``k_descale`` /
``v_descale``::

    q8, dq = attnc.fp8.quantize(q)                      # [B, H_q, S, d], [B, H_q]
    k8, dk = attnc.fp8.quantize(k)
    v8, dv = attnc.fp8.quantize(v, transposed=True)     # stored as V^T (below)
    o = attn(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv)   # O in the spec's dtype

FP8 tensor-core products need both operands K-major, so P.V reads V transposed: V^T
[B, H_kv, d, S] with S contiguous.  ``quantize(v, transposed=True)`` returns such storage viewed
as [B, H_kv, S, d] (the call's usual shape); an ordinary contiguous V is transposed by the call
(a copy of V, in the call's time).  Any layout the spec declares is accepted; bshd tensors are
given in [B, S, H, d] and their descales are still [B, H].
"""
from __future__ import annotations

from attnc.compiler.errors import InputError

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
DESCALES = ("q_descale", "k_descale", "v_descale")  # an FP8 call's keywords
# descales of an all-zero head: any positive value quantizes it exactly; this one keeps 1/descale finite
_TINY = 1.0 / (1 << 20)


def _torch():
    import torch
    return torch


def quantize(x, *, transposed: bool = False, heads_axis: int = 1):
    """(x8, descale): ``x`` (float, [B, H, S, d] with the heads on ``heads_axis``) scaled per
    (request, head) so that its largest magnitude maps to e4m3's largest finite value 448, and
    rounded to float8_e4m3fn; descale [B, H] float32 with x ~= x8 * descale.  ``transposed``
    (bhsd only): x8's storage is [B, H, d, S], viewed as [B, H, S, d] (the FP8 engine's V)."""
    torch = _torch()
    if x.dim() != 4 or not x.dtype.is_floating_point or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"attnc.fp8.quantize takes a 4-d float tensor (bf16, f16 or f32), got "
                         f"{list(x.shape)} {x.dtype}")
    if transposed and heads_axis != 1:
        raise ValueError("attnc.fp8.quantize(transposed=True) takes bhsd tensors (heads_axis=1)")
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"attnc.fp8.quantize: x{bad} = {x[tuple(bad)].item()} is not finite")
    reduce = tuple(i for i in range(1, 4) if i != heads_axis)
    amax = x.detach().abs().float().amax(dim=reduce)  # [B, H]
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.full_like(amax, _TINY))
    shape = [x.shape[0], 1, 1, 1]
    shape[heads_axis] = x.shape[heads_axis]
    scaled = (x.float() / descale.view(shape)).clamp(-E4M3_MAX, E4M3_MAX)
    if transposed:
        return scaled.transpose(2, 3).contiguous().to(torch.float8_e4m3fn).transpose(2, 3), descale
    return scaled.to(torch.float8_e4m3fn), descale


def dequantize(x8, descale, dtype, *, heads_axis: int = 1):
    """x8 * descale (per (request, head)) in ``dtype``: what an FP8 call computes attention of."""
    torch = _torch()
    shape = [x8.shape[0], 1, 1, 1]
    shape[heads_axis] = x8.shape[heads_axis]
    return (x8.float() * descale.float().view(shape)).to(dtype)


def check_inputs(q, k, v) -> None:
    """An FP8 call takes q, k and v all as float8_e4m3fn."""
    f8 = _torch().float8_e4m3fn
    if not (q.dtype == k.dtype == v.dtype == f8):
        raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; an FP8 call takes all "
                         "three as float8_e4m3fn")


def descale(name: str, d, shape: tuple, device, cache: dict | None = None):
    """An FP8 call's descale ``d`` for ``name`` as a float32 tensor of ``shape`` [B, H] on
    ``device``: None means 1, a number or a 0-d tensor every head's value, else a float tensor
    [B, H].  ``cache`` keeps the tensors made for None and numbers (one allocation per shape)."""
    torch = _torch()
    if d is None or isinstance(d, (int, float)):
        value = 1.0 if d is None else float(d)
        key = (shape, str(device), value)
        t = cache.get(key) if cache is not None else None
        if t is None:
            t = torch.full(shape, value, dtype=torch.float32, device=device)
            if cache is not None:
                cache[key] = t
        return t
    if not isinstance(d, torch.Tensor) or not d.dtype.is_floating_point:
        raise InputError(f"inputs: '{name}' must be a float tensor [B, H] = {list(shape)} or a number, "
                         f"not {type(d).__name__}{'' if not isinstance(d, torch.Tensor) else ' ' + str(d.dtype)}")
    if d.device != torch.device(device):
        raise InputError(f"inputs: '{name}' is on {d.device}, q on {device}")
    if d.dim() == 0:
        d = d.expand(shape)
    if tuple(d.shape) != tuple(shape):
        raise InputError(f"inputs: '{name}' has shape {list(d.shape)}; this call's is [B, H] = {list(shape)}")
    return d.detach().to(torch.float32).contiguous()


def is_v_transposed(v) -> bool:
    """Whether bhsd ``v`` [B, H, S, d] is V^T storage the FP8 engine reads in place: S contiguous,
    heads packed, and rows of 16-byte multiples (TMA)."""
    b, h, s, d = v.shape
    return v.stride(2) == 1 and v.stride(3) % 16 == 0 and v.stride(3) >= s and v.stride(1) == d * v.stride(3) \
        and v.stride(0) == h * v.stride(1) and v.data_ptr() % 16 == 0


def v_transposed(v):
    """V^T for the FP8 engine: ``v`` itself where it already is such storage (``is_v_transposed``),
    else a copy [B, H, d, S_pad] (S rounded up to 16, the padding zero) viewed as [B, H, S, d]."""
    if is_v_transposed(v):
        return v
    torch = _torch()
    b, h, s, d = v.shape
    pad = -s % 16
    out = torch.empty((b, h, d, s + pad), dtype=v.dtype, device=v.device)
    if pad:
        out[..., s:].view(torch.uint8).zero_()
    out[..., :s].copy_(v.transpose(2, 3))
    return out[..., :s].transpose(2, 3)
