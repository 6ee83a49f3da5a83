"""The numpy backend behind the backend protocol (``compiler/dispatch/protocol.py``): torch
tensors are copied to host arrays (float32: bf16 and f16 are exact in it; float64 runs the
float64 reference path), the numpy programs run, and O / LSE / gradients come back as torch
tensors on the inputs' device and in their dtype."""
from __future__ import annotations

import numpy as np

from attnc.compiler.dispatch.protocol import BackendBase


def host(tensors: dict) -> dict:
    """Torch tensors as numpy arrays on the host (other values as they are)."""
    return {n: t.detach().cpu().numpy() if hasattr(t, "detach") else t for n, t in tensors.items()}


def f32(t) -> np.ndarray:
    """A torch tensor's values as a float32 numpy array (a view when it already is one on the CPU)."""
    import torch
    return t.detach().to("cpu", torch.float32).numpy()


class NumpyAppend:
    """An append transaction's attend step (``attnc.serving``): the split program over the
    post-commit view (``Kernel.run``)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def _arrays(self, txn) -> dict:
        return {"q": f32(txn.q), txn.k_key: f32(txn.k), txn.v_key: f32(txn.v), **txn.call.view, **host(txn.tensors)}

    def plan(self, txn):
        from attnc.compiler.plan import plan_split
        return plan_split(txn.program, txn.call.layout, txn.call.manifest.C, num_sms=self.kernel.num_sms)

    def run(self, txn, plan):
        torch = txn.torch
        o, lse = self.kernel.run(self._arrays(txn), plan=plan, return_lse=True)
        return torch.from_numpy(o).to(txn.q.device, txn.q.dtype), torch.from_numpy(lse).to(txn.q.device)


class NumpyBackend(BackendBase):
    name = "numpy"
    capabilities = frozenset({"forward", "run", "plan", "backward", "tensor_grads", "decode", "append", "block"})

    def forward(self, kernel, q, k, v, tensors, plan=None):
        """A call on torch tensors: float32 copies in, O back as q's dtype on q's device.  float64
        inputs run the float64 reference path."""
        import torch
        arrays = host(tensors)
        if q.dtype == torch.float64:
            o, lse = kernel.forward64(*(x.detach().cpu().numpy() for x in (q, k, v)), **arrays)
            return torch.from_numpy(np.ascontiguousarray(o)), torch.from_numpy(np.ascontiguousarray(lse))
        qkv = [x.detach().to("cpu", torch.float32).numpy() for x in (q, k, v)]
        o, lse = kernel(*qkv, return_lse=True, plan=plan, **arrays)
        return (torch.from_numpy(o).to(device=q.device, dtype=q.dtype),
                torch.from_numpy(lse).to(device=q.device, dtype=torch.float32))

    def backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, want, deterministic=True):
        """The float64 backward module on host copies; gradients in their inputs' dtype and device
        (always deterministic: ``deterministic`` changes nothing here)."""
        import torch
        wide = torch.float64
        arrays = [x.detach().to("cpu", wide).numpy() for x in (q, k, v, o, lse, do)]
        wide_dlse = dlse.detach().to("cpu", wide).numpy() if dlse is not None else None
        dq, dk, dv, dts = kernel.backward(*arrays, dlse=wide_dlse, **host(tensors))
        back = [torch.from_numpy(np.ascontiguousarray(g)).to(device=x.device, dtype=x.dtype)
                for g, x in ((dq, q), (dk, k), (dv, v))]
        dtensors = {n: torch.from_numpy(np.ascontiguousarray(dts[n])).to(device=tensors[n].device,
                                                                          dtype=tensors[n].dtype) for n in want}
        return (*back, dtensors)

    def decode(self, kernel, q, return_lse, cache):
        """The split program on host copies (float inputs as float32)."""
        import torch
        arrays = {n: (t.detach().to("cpu", torch.float32).numpy() if t.dtype.is_floating_point else t.cpu().numpy())
                  if isinstance(t, torch.Tensor) else t for n, t in cache.items()}
        o, lse = kernel.run({"q": q.detach().float().cpu().numpy(), **arrays}, return_lse=True)
        o = torch.from_numpy(o).to(q.device, q.dtype)
        lse = torch.from_numpy(lse).to(q.device)
        return (o, lse) if return_lse else o

    def append_runner(self, kernel_of, program):
        return NumpyAppend(kernel_of(program))

    def block_runner(self, attn, cp, device, dtype):
        from .cp_blocks import NumpyBlocks
        return NumpyBlocks(attn, cp, device, dtype)


BACKEND = NumpyBackend()
