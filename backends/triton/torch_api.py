"""The Triton backend behind the backend protocol (``compiler/dispatch/protocol.py``): the
``Kernel`` takes torch tensors on its device as they are.  Importing this module imports
neither torch nor triton."""
from __future__ import annotations

from attnc.compiler.dispatch.protocol import BackendBase


class TritonAppend:
    """An append transaction's attend step (``attnc.serving``): the split-K/V kernels over the
    post-commit view (``Kernel.decode`` with a plan)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def plan(self, txn):
        storage = {txn.k_key: txn.k, txn.v_key: txn.v}
        return self.kernel.decode_plan({**storage, **txn.call.view}, tensors=dict(txn.tensors),
                                       total_q=int(txn.q.shape[0]))

    def run(self, txn, plan):
        from .device import interpreted
        q, k, v = txn.q, txn.k, txn.v
        carry = interpreted() and q.dtype == txn.torch.bfloat16  # the interpreter reads bf16 as garbage
        if carry:
            q, k, v = q.float(), k.float(), v.float()
        o, lse = self.kernel.decode(q, plan=plan, return_lse=True, **{txn.k_key: k, txn.v_key: v}, **txn.tensors)
        return (o.to(txn.q.dtype) if carry else o), lse


class TritonBackend(BackendBase):
    name = "triton"
    capabilities = frozenset({"forward", "run", "plan", "backward", "tensor_grads", "decode", "append", "block",
                              "fp8"})

    def forward(self, kernel, q, k, v, tensors, plan=None):
        return kernel(q, k, v, return_lse=True, plan=plan, **tensors)

    def bound_forward(self, kernel, signature, tensors):
        return kernel.bind_call(signature, tensors)

    def forward_fp8(self, kernel, q, k, v, descales, tensors):
        return kernel(q, k, v, return_lse=True, **descales, **tensors)

    def backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, want, deterministic=True):
        if want:
            return kernel.backward_with_tensors(q, k, v, o, lse, do, dlse, tensors, want,
                                                deterministic=deterministic)
        dq, dk, dv = kernel.backward(q, k, v, o, lse, do, dlse, deterministic=deterministic, **tensors)
        return dq, dk, dv, {}

    def bound_backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, deterministic=True):
        return kernel.bind_backward(q, k, v, o, lse, do, dlse, tensors, deterministic)

    def tensor_grad_refusal(self, kernel, tensor):
        """Score tensors read at computed indices have no Triton gradient (``score_grads.refusal``)."""
        from .score_grads import refusal
        why = refusal(kernel.program, tensor)
        return None if why is None else f"inputs: tensor '{tensor}' requires grad: {why}; or pass it detached"

    def decode(self, kernel, q, return_lse, cache):
        return kernel.decode(q, return_lse=return_lse, **cache)

    def bound_decode(self, kernel, signature, cache):
        return kernel.bind_decode(cache)

    def append_runner(self, kernel_of, program):
        return TritonAppend(kernel_of(program))

    def block_runner(self, attn, cp, device, dtype):
        from .cp_blocks import TritonBlocks
        return TritonBlocks(attn, cp, device, dtype)

    def device_refusal(self, device):
        import os
        if getattr(device, "type", device) != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"backend 'triton' on CPU tensors (q is on {device}) runs in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before importing triton, or pass CUDA tensors, or use backend='numpy'")
        return None


BACKEND = TritonBackend()
