"""Device facts for the Triton backend: whether kernels run in Triton's CPU interpreter, the GPU's
compute capability and SM count, which tensors TMA can copy, and whether the inputs are where a
kernel runs; :func:`facts` gathers what a split call's launch decision reads (``split_choice``).

Importing it imports neither torch nor triton (``attnc plan`` reads :class:`DeviceFacts`)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from attnc.compiler.dispatch.environment import device_capability
from attnc.compiler.errors import InputError
from attnc.compiler.plan import DEFAULT_SMS


@dataclass(frozen=True)
class DeviceFacts:
    """What a split call's launch decision reads from the device (``split_choice.choose``).

    ``interpreter``: Triton's CPU interpreter runs the kernels; ``capability``: 10 * major + minor
    (0: no GPU); ``num_sms``: the SMs ``split = auto``'s rule fills; ``gluon``: this Triton has
    Gluon (``triton.experimental.gluon``).  ``here``: read on this host, so its tuning cache's
    entries apply; ``assumed``: the facts no device gave (a plan made without one says which)."""

    interpreter: bool
    capability: int
    num_sms: int
    gluon: bool
    here: bool = True
    assumed: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {**asdict(self), "assumed": list(self.assumed)}


# Triton's interpreter: no GPU, so no SM count to read; `split = auto` counts the SMs of the H200
# the untuned rule was measured on (compiler.plan.DEFAULT_SMS), as a GPU launch there does.
INTERPRETER = DeviceFacts(interpreter=True, capability=0, num_sms=DEFAULT_SMS, gluon=False, assumed=("num_sms",))
_FACTS: dict = {}


def facts(device=None) -> DeviceFacts:
    """The facts of the device a split call runs on: ``device`` (a torch device; None: the current
    CUDA device), read once per device; :data:`INTERPRETER` under ``TRITON_INTERPRET=1``; without
    a GPU, capability 0 (nothing Triton runs there)."""
    if interpreted():
        return INTERPRETER
    # a torch device's index; numpy arrays have a ``device`` too (the string "cpu", whose ``index``
    # is str.index): numpy inputs, or a device named without its index, mean the current one
    index = getattr(device, "index", None) if not isinstance(device, str) else None
    if not isinstance(index, int):
        import torch
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    hit = _FACTS.get(index)
    if hit is None:
        cap = capability(device if index == -1 else _cuda(index))
        if cap == 0:
            hit = DeviceFacts(interpreter=False, capability=0, num_sms=DEFAULT_SMS, gluon=False, assumed=("num_sms",))
        else:
            from .kernels.gluon_sync import HAS_GLUON
            hit = DeviceFacts(interpreter=False, capability=cap, num_sms=sm_count(_cuda(index)), gluon=HAS_GLUON)
        _FACTS[index] = hit
    return hit


def _cuda(index: int):
    import torch
    return torch.device("cuda", index)


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
