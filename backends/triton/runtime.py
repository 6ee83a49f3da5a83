"""Load generated Triton modules and launch them: on a GPU, or on the CPU under
``TRITON_INTERPRET=1`` (set before triton is imported; the tests do)."""
from __future__ import annotations

import os

import numpy as np

from compiler import inputs, ir
from compiler.errors import InputError, PlanError
from compiler.plan import Plan, plan as make_plan
from backends.common import load_module
from .emit import Source, emit

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
DEFAULT_TILES = {"gpu": (128, 64), "interpreter": (16, 16)}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kind(t) -> str:
    import torch
    if t.dtype.is_floating_point:
        return "f"
    return "b" if t.dtype == torch.bool else "i"


class Kernel:
    def __init__(self, program: ir.Program, source: Source):
        import torch  # noqa: F401  (the launcher needs it; fail here with a clear import error)
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)

    @property
    def device(self) -> str:
        import torch
        return "cpu" if interpreted() or not torch.cuda.is_available() else "cuda"

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None) -> Plan:
        dm, dn = DEFAULT_TILES["interpreter" if interpreted() else "gpu"]
        tensors = {n: (t.cpu().numpy() if hasattr(t, "cpu") else np.asarray(t)) for n, t in (tensors or {}).items()}
        tensors = {n: t.astype(np.int64) if t.dtype.kind in "iu" else t for n, t in tensors.items()}
        return make_plan(self.program, batch, s_q, s_k, tensors, block_m or dm, block_n or dn)

    def device_plan(self, plan: Plan, device) -> dict:
        """The plan's arrays as int32 torch tensors on the kernel's device (cached on the plan)."""
        import torch
        cache = plan.__dict__.setdefault("_device_args", {})
        key = str(device)
        if key not in cache:
            args = plan.kernel_args()
            cache[key] = {n: torch.as_tensor(np.ascontiguousarray(v, np.int32), device=device)
                          if isinstance(v, np.ndarray) else v for n, v in args.items()}
        return cache[key]

    def __call__(self, q, k, v, *, plan: Plan | None = None, return_lse=False, block_m=None, block_n=None,
                 num_warps: int = 4, num_stages: int = 2, **tensors):
        import torch
        from_numpy = isinstance(q, np.ndarray)
        device = self.device
        dtype = getattr(torch, TORCH_DTYPES[self.program.dtype])
        # The Triton interpreter (3.9) reads bf16 tensors as garbage: on the CPU, bf16 specs
        # carry their (already bf16-rounded) values in float32 and O is rounded to bf16 after.
        emulate_bf16 = interpreted() and dtype == torch.bfloat16
        if from_numpy:
            call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors})
            carry = torch.float32 if emulate_bf16 else dtype
            q, k, v = (torch.as_tensor(np.ascontiguousarray(x), device=device).to(dtype).to(carry)
                       for x in (call.q, call.k, call.v))
            tensors = {n: torch.as_tensor(np.ascontiguousarray(
                t.astype(np.int32) if t.dtype.kind in "iu" else t), device=device) for n, t in call.tensors.items()}
            bshd = False
        else:
            metas = {n: (tuple(t.shape), _kind(t), str(t.dtype)) for n, t in {"q": q, "k": k, "v": v, **tensors}.items()}
            inputs.check_shapes(self.program, metas)
            if any(x.dtype != dtype for x in (q, k, v)):
                raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; "
                                 f"the spec stores {self.program.dtype}")
            if emulate_bf16:
                q, k, v = (x.float() for x in (q, k, v))
            bshd = self.program.cache.layout is ir.Layout.BSHD
            if bshd:  # strides carry the layout; the kernel indexes logical bhsd
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        batch, _, s_q, _ = q.shape
        s_k = k.shape[2]
        if plan is None:
            plan = self.plan(batch, s_q, s_k, tensors, block_m, block_n)
        plan.check_call(self.program, batch, s_q, s_k)
        out = None
        if bshd:
            out = torch.empty(batch, s_q, self.program.heads_q, self.program.d_v, device=q.device,
                              dtype=q.dtype).transpose(1, 2)
        o, lse = self.module.attention(q, k, v, self.device_plan(plan, q.device), out=out,
                                       num_warps=num_warps, num_stages=num_stages, **tensors)
        if bshd:
            o = o.transpose(1, 2)
        if emulate_bf16:
            o = o.to(torch.bfloat16) if not from_numpy else o.to(torch.bfloat16).float()
        if from_numpy:
            o = o.float().cpu().numpy()
            lse = lse.cpu().numpy()
            if self.program.cache.layout is ir.Layout.BSHD:  # O comes back in q's layout
                o = o.transpose(0, 2, 1, 3)
        return (o, lse) if return_lse else o


def load(program: ir.Program) -> Kernel:
    if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
        raise PlanError(f"spec '{program.name}': the Triton prefill kernel reads contiguous K/V; "
                        f"{program.cache.kind.value} caches are read by the split-K/V decode kernel")
    return Kernel(program, emit(program))
