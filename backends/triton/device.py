"""Device facts for the Triton backend: whether kernels run in Triton's CPU interpreter, the GPU's
compute capability and SM count, which tensors TMA can copy, and whether the inputs are where a
kernel runs."""
from __future__ import annotations

import os

from attnc.compiler.dispatch.environment import device_capability
from attnc.compiler.errors import InputError


def interpreted() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def capability(device=None) -> int:
    """The GPU's compute capability as 10 * major + minor; 0 under the interpreter or without CUDA
    (the dispatch key's own reading of the device, one place)."""
    return device_capability(device)


def sm_count(device) -> int:
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(*tensors) -> bool:
    """Whether TMA can copy blocks of these tensors: contiguous, at 16-byte aligned addresses (a
    contiguous view at an odd offset, ``x[1:]``, is not)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)

def check_device(named: dict, device: str) -> None:
    """Torch inputs must be where the kernel runs (numpy inputs are copied there for the caller)."""
    import torch
    for n, t in named.items():
        if isinstance(t, torch.Tensor) and t.device.type != device:
            raise InputError(f"inputs: '{n}' is a torch tensor on {t.device}; this Triton kernel runs on "
                             f"{device}: move the torch inputs there (numpy inputs are copied for you)")
