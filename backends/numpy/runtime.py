"""Load generated numpy modules and call them with validated inputs and a tile plan."""
from __future__ import annotations

import numpy as np

from compiler import inputs, ir
from compiler.errors import PlanError
from compiler.plan import Plan, plan as make_plan
from backends.common import load_module
from .emit import Source, emit


class Kernel:
    """A callable attention kernel for one program (DESIGN §5)."""

    def __init__(self, program: ir.Program, source: Source):
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None, method: str = "auto") -> Plan:
        return make_plan(self.program, batch, s_q, s_k, tensors, block_m or self.module.BLOCK_M,
                         block_n or self.module.BLOCK_N, method)

    def __call__(self, q, k, v, *, cache=None, lengths=None, plan: Plan | None = None, return_lse=False,
                 block_m: int | None = None, block_n: int | None = None, stats: dict | None = None,
                 **tensors):
        if cache is not None or lengths is not None:
            raise PlanError("the numpy tiled program takes contiguous q/k/v; paged and ragged "
                            "caches go through the split planner")
        call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors})
        if plan is None:
            plan = self.plan(call.batch, call.s_q, call.s_k, call.tensors, block_m, block_n)
        plan.check_call(self.program, call.batch, call.s_q, call.s_k)
        fn = getattr(self.module, self.source.entry)
        try:
            o, lse = fn(np.asarray(q), np.asarray(k), np.asarray(v), plan=plan.kernel_args(),
                        return_lse=True, stats=stats, **call.tensors)
        except self.module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None
        if self.program.dtype == "f16":
            o = o.astype(np.float16)
        return (o, lse) if return_lse else o


def load(program: ir.Program, **options) -> Kernel:
    return Kernel(program, emit(program, **options))
