"""A call's signature: everything of its tensors a bound call depends on, except their values.

One function, asked by the front door (``Attention``'s bound calls, keyed by it) and by the Triton
kernel (its bound launches): shapes, strides, dtypes, devices and whether each address is 16-byte
aligned (Triton specializes on it), of q, k, v and of every named tensor.  Two calls with equal
signatures pass the same shape, layout and device checks, so a call bound under one signature
repeats only the checks that read values (a mask tensor's identity and version, the rows' non-finite
rule).  A tensor without an address (meta, fake) raises one of ``NO_ADDRESS``: the caller
takes the validating path."""
from __future__ import annotations

# What asking a tensor for its address or layout raises where it has none (a meta or fake tensor):
# the call keys that ask fall back to the validating path, which names what is wrong.
NO_ADDRESS = (NotImplementedError, RuntimeError, AttributeError)


def call_signature(q, k, v, tensors: dict) -> tuple:
    ts = tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
               if hasattr(t, "data_ptr") else (n, id(t)) for n, t in tensors.items()) if tensors else ()
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0,
            v.data_ptr() % 16 == 0, ts)


def split_signature(q, cache: dict) -> tuple:
    """The signature of a split call (``Attention.decode``): q's and every cache input's as
    :func:`call_signature` takes a tensor's, the inputs named in the caller's order.  Only torch
    tensors have one: an option (``engine=``, ``plan=``) or a numpy array raises one of
    ``NO_ADDRESS`` (AttributeError), and the call takes the validating path."""
    return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
            tuple([(n, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for n, t in cache.items()]))
