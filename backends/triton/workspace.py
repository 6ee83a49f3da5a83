"""The split-K/V workspace's layout (host side): the fields of the states a split call's
producer writes and its combine reads, for the (m, l, u) / (LSE, O) ABIs (``kernels/split.py``)
and the shared shift's (``kernels/shared_shift.py``), and the bytes a call needs."""
from __future__ import annotations

import functools

import triton

from attnc.compiler.analysis.ledger import allocation, vector_dtype


def split_layout(total_q: int, splits: int, abi: str, heads_q: int, d_v: int,
                 vector_bytes: int = 4) -> tuple[int, dict, int]:
    """(states, {field: (byte offset, elements)}, bytes) of the (m, l, u) / (LSE, O) workspace:
    ``compiler.analysis.ledger.allocation``, the layout ``attnc plan`` reports."""
    return allocation(abi, total_q, heads_q, splits, d_v, vector_bytes)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


def shift_layout(total_q: int, splits: int, heads_q: int, d_v: int) -> tuple[int, dict, int]:
    """(states, {field: (byte offset, elements)}, bytes) of the shared shift's workspace: the
    numerator ``o`` (float32 x d_v; the fallback's u), ``m`` (the fallback's), ``l``, ``valid``
    and ``guard`` per state, one ``need`` byte per (row, head) (``ledger.allocation``)."""
    return allocation("shared_shift", total_q, heads_q, splits, d_v)


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
