"""Memory orders of a prefill call's q, k, v and O, read from shapes and strides alone (no torch
import: the front door, the custom op's fake and the backends ask the same functions).

Shapes and strides here are a tensor's *logical* bhsd ones, [B, H, S, d] (a bshd spec's tensors
transposed).  Two orders matter:

* ``"bhsd"``: contiguous [B, H, S, d] (torch's rule: the strides of size-1 axes do not count);
* ``"bshd"``: token-major, the layout transformers hands over (``x.view(B, S, H, d).transpose(1, 2)``
  of its projections): element (b, h, s, i) at ``(b * S + s) * R + h * d + i``, with every row's
  H * d values packed and rows ``R >= H * d`` apart (``token_rows``; R > H * d: a slice of a fused
  projection).

O's order (:func:`out_order`) is the one rule of the public call: O is stored token-major where q
is a token-major view (so that ``o.transpose(1, 2)`` is contiguous and transformers needs no copy),
else contiguous in the spec's layout.
"""
from __future__ import annotations

import functools

BHSD, BSHD = "bhsd", "bshd"


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def is_contiguous(shape, strides) -> bool:
    """torch's ``is_contiguous``: every axis longer than one has the contiguous stride (an empty
    tensor is contiguous)."""
    if any(int(n) == 0 for n in shape):
        return True
    return all(int(n) == 1 or int(s) == int(c) for n, s, c in zip(shape, strides, contiguous_strides(shape)))


def token_rows(shape, strides) -> int | None:
    """R, the elements from one token row to the next, where a logical bhsd tensor [B, H, S, d] is
    stored token-major (module docstring: (b, h, s, i) at (b * S + s) * R + h * d + i, R >= H * d);
    else None.  The strides of size-1 axes do not count, as in torch."""
    b, h, s, d = (int(x) for x in shape)
    sb, sh, ss, sd = (int(x) for x in strides)
    if d > 1 and sd != 1:
        return None
    if h > 1 and sh != d:
        return None
    rows = ss if s > 1 else sb if b > 1 else h * d
    if rows < h * d:
        return None
    if b > 1 and s > 1 and sb != s * rows:
        return None
    return rows


def _order(shape, strides) -> str | None:
    if is_contiguous(shape, strides):
        return BHSD
    return BSHD if token_rows(shape, strides) is not None else None


_cached_order = functools.lru_cache(maxsize=1024)(_order)


def order_of(shape, strides) -> str | None:
    """``"bhsd"`` (contiguous), ``"bshd"`` (token-major, not contiguous) or None (neither) of a
    logical bhsd tensor's shape and strides."""
    try:
        return _cached_order(tuple(shape), tuple(strides))
    except TypeError:  # (symbolic sizes under torch.compile's dynamic shapes are not hashable)
        return _order(shape, strides)


def out_order(q_shape, q_strides) -> str:
    """O's order for a bhsd spec's call with this q (module docstring): ``"bshd"`` where q is a
    token-major view, else ``"bhsd"``."""
    return BSHD if order_of(q_shape, q_strides) == BSHD else BHSD


def out_strides(shape, order: str) -> tuple[int, ...]:
    """The strides of a logical bhsd O of ``shape`` stored in ``order`` (token-major: rows of
    H * d_v, packed)."""
    if order == BHSD:
        return contiguous_strides(shape)
    b, h, s, d = shape
    sb, ss, sh, sd = contiguous_strides((b, s, h, d))
    return (sb, sh, ss, sd)


def new_out(q, shape, order: str | None = None):
    """A new O of logical bhsd ``shape`` on q's device and dtype, stored in ``order`` (default: the
    order :func:`out_order` gives q)."""
    order = order or out_order(q.shape, q.stride())
    if order == BHSD:
        return q.new_empty(shape)
    b, h, s, d = shape
    return q.new_empty((b, s, h, d)).transpose(1, 2)
