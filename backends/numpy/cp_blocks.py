"""The numpy backend's blocks of a multi-rank context-parallel call (``attnc.distributed``,
the backend protocol's ``block_runner``): CPU float32 containers, the numpy block programs."""
from __future__ import annotations

import numpy as np
import torch

from attnc.compiler import ir

_TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


class NumpyBlocks:
    """Blocks on the numpy backend: CPU float32 containers, partial O unrounded, O rounded once to
    the call's dtype; the backward's blocks in float64 (the numpy backward module at the block's
    offsets), their shares accumulated in float32."""

    acc = torch.float32

    def __init__(self, attn, cp, device=None, dtype=None):
        self.cp = cp
        self.kernel = attn.kernel("numpy", cp.program)
        self.bshd = cp.program.cache.layout is ir.Layout.BSHD
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = _TORCH_DTYPES[cp.program.dtype] if dtype is None else dtype

    @staticmethod
    def prepare(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32)

    def _spec(self, t: torch.Tensor) -> np.ndarray:  # bhsd torch -> the kernel's layout, numpy
        a = t.numpy()
        return a.transpose(0, 2, 1, 3) if self.bshd else a

    def _bhsd(self, a: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        a = a.transpose(0, 2, 1, 3) if self.bshd else a
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    def forward(self, q, k, v, args):
        o, lse = self.kernel.block(*(self._spec(x) for x in (q, k, v)), args, self.cp.tensors)
        return self._bhsd(o), torch.from_numpy(np.asarray(lse, np.float32))

    def backward(self, q, k, v, o, lse, do, dlse, args):
        grads = self.kernel.block_backward(*(self._spec(x) for x in (q, k, v, o)), lse.numpy(), self._spec(do),
                                           None if dlse is None else dlse.numpy(), args, self.cp.tensors)
        return tuple(self._bhsd(g, self.acc) for g in grads)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(device=self.device, dtype=self.dtype)
