"""The Triton backend behind the backend protocol (``compiler/dispatch/protocol.py``): the
``Kernel`` takes torch tensors on its device as they are.  Importing this module imports
neither torch nor triton."""
from __future__ import annotations

from attnc.compiler.dispatch.protocol import BackendBase, BackendRefused


class TritonBackend(BackendBase):
    name = "triton"
    capabilities = frozenset({"forward", "run", "plan", "backward", "decode", "append", "block", "fp8"})

    def forward(self, kernel, q, k, v, tensors, plan=None):
        return kernel(q, k, v, return_lse=True, plan=plan, **tensors)

    def forward_fp8(self, kernel, q, k, v, descales, tensors):
        return kernel(q, k, v, return_lse=True, **descales, **tensors)

    def backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, want):
        if want:
            raise BackendRefused(f"tensor '{want[0]}': the Triton backward gives dQ, dK, dV only")
        dq, dk, dv = kernel.backward(q, k, v, o, lse, do, dlse, **tensors)
        return dq, dk, dv, {}

    def decode(self, kernel, q, return_lse, cache):
        return kernel.decode(q, return_lse=return_lse, **cache)


BACKEND = TritonBackend()
