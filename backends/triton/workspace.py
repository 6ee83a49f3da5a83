"""The split-K/V workspace's layout (host side): the fields of the states a split call's
producer writes and its combine reads, for the (m, l, u) / (LSE, O) ABIs (``kernels/split.py``)
and the shared shift's (``kernels/shared_shift.py``), and the bytes a call needs."""
from __future__ import annotations

import functools

import triton

from attnc.compiler.analysis.ledger import vector_dtype


def split_layout(total_q: int, splits: int, abi: str, heads_q: int, d_v: int,
                 vector_bytes: int = 4) -> tuple[int, dict, int]:
    """(states, {field: (byte offset, elements)}, bytes) of the workspace: ``states`` (row, head,
    split) slots, each a partial O or u (d_v elements of ``vector_bytes``, the declared vector
    dtype: ``compiler.analysis.ledger.vector_dtype``), m or LSE, and l when the ABI is (m, l, u)
    (float32), then one valid byte each; every field starts 16-byte aligned (the kernels'
    pointer specialization then never changes with the call's size)."""
    n = total_q * heads_q * splits
    fields, offset = {}, 0
    for name, count, size in (("o", n * d_v, vector_bytes), ("m", n, 4), ("l", n if abi == "mlu" else 0, 4),
                              ("valid", n, 1)):
        fields[name] = (offset, count)
        offset += -(-count * size // 16) * 16
    return n, fields, offset


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


def shift_layout(total_q: int, splits: int, heads_q: int, d_v: int) -> tuple[int, dict, int]:
    """(states, {field: (byte offset, elements)}, bytes): per (row, head, split) state the
    numerator ``o`` (float32 x d_v; the fallback's u), ``m`` (the fallback's), ``l``, ``valid``
    and ``guard``, then one ``need`` byte per (row, head); 16-byte aligned fields."""
    n = total_q * heads_q * splits
    fields, offset = {}, 0
    for name, count, size in (("o", n * d_v, 4), ("m", n, 4), ("l", n, 4), ("valid", n, 1), ("guard", n, 1),
                              ("need", total_q * heads_q, 1)):
        fields[name] = (offset, count)
        offset += -(-count * size // 16) * 16
    return n, fields, offset


def workspace_bytes(module, total_q: int, splits: int, abi: str) -> int:
    if abi == "shared_shift":
        return shift_layout(total_q, splits, module.SPEC["H_Q"], module.SPEC["D_V"])[2]
    return split_layout(total_q, splits, abi, module.SPEC["H_Q"], module.SPEC["D_V"],
                        vector_torch_dtype(module, abi).itemsize)[2]


def vector_torch_dtype(module, abi: str):
    """The workspace's partial O / u dtype: the ledger's declared one for the spec's storage."""
    return _vector_torch_dtype(abi, module.DTYPE)


@functools.lru_cache(maxsize=None)
def _vector_torch_dtype(abi: str, storage: str):
    import torch
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[vector_dtype(abi, storage)]
