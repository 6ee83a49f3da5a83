"""The Triton backend's blocks of a multi-rank context-parallel call (``attnc.distributed``,
the backend protocol's ``block_runner``): ``Kernel.block`` / ``Kernel.block_backward``."""
from __future__ import annotations

import torch

from .decode import device_tensor


class TritonBlocks:
    """Blocks on the Triton backend (``Kernel.block`` / ``Kernel.block_backward``): containers in
    the storage dtype on the call's device, float32 partial O and LSE, float32 gradient shares;
    the spec's tensors (the whole call's) are uploaded once per call."""

    acc = torch.float32

    def __init__(self, attn, cp, device, dtype):
        self.cp = cp
        self.kernel = attn.kernel("triton", cp.program)
        self.device, self.dtype = torch.device(device), dtype
        self.tensors = {n: device_tensor(t, self.device) for n, t in cp.tensors.items()}

    def prepare(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if t.dim() == 3 else self.dtype  # LSE and dLSE stay float32
        return t.detach().to(device=self.device, dtype=dtype).contiguous()

    def forward(self, q, k, v, args):
        return self.kernel.block(q, k, v, args, self.tensors, self.cp.lengths)

    def backward(self, q, k, v, o, lse, do, dlse, args):
        return self.kernel.block_backward(q, k, v, o, lse, do, dlse, args, self.tensors, self.cp.lengths)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(device=self.device, dtype=self.dtype)
