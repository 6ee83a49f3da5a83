"""The AHBM backend behind the backend protocol (``compiler/dispatch/protocol.py``): torch
tensors are copied to float32 host arrays for the mesh simulator, O and LSE come back on the
inputs' device.  Forward only: no backward, no split (decode) call outside an append."""
from __future__ import annotations

from attnc.compiler.dispatch.protocol import BackendBase


class AhbmBackend(BackendBase):
    name = "ahbm"
    capabilities = frozenset({"forward", "run", "plan", "append"})

    def forward(self, kernel, q, k, v, tensors, plan=None):
        import torch
        arrays = {n: t.detach().cpu().numpy() if hasattr(t, "detach") else t for n, t in tensors.items()}
        qkv = [x.detach().to("cpu", torch.float32).numpy() for x in (q, k, v)]
        o, lse = kernel(*qkv, return_lse=True, plan=plan, **arrays)
        return (torch.from_numpy(o).to(device=q.device, dtype=q.dtype),
                torch.from_numpy(lse).to(device=q.device, dtype=torch.float32))


BACKEND = AhbmBackend()
