"""Load generated numpy modules and call them with validated inputs."""
from __future__ import annotations

import numpy as np

from compiler import inputs, ir
from compiler.errors import PlanError
from backends.common import load_module
from .emit import Source, emit


class Kernel:
    """A callable attention kernel for one program (DESIGN §5)."""

    def __init__(self, program: ir.Program, source: Source):
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)

    def __call__(self, q, k, v, *, cache=None, lengths=None, plan=None, return_lse=False,
                 block_m: int | None = None, block_n: int | None = None, **tensors):
        if cache is not None or lengths is not None or plan is not None:
            raise PlanError("the numpy tiled program takes contiguous q/k/v; paged and ragged "
                            "caches go through the split planner")
        call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors})
        fn = getattr(self.module, self.source.entry)
        kwargs = {"block_m": block_m or self.module.BLOCK_M, "block_n": block_n or self.module.BLOCK_N}
        try:
            o, lse = fn(np.asarray(q), np.asarray(k), np.asarray(v), return_lse=True,
                        **kwargs, **call.tensors)
        except self.module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None
        if self.program.dtype == "f16":
            o = o.astype(np.float16)
        return (o, lse) if return_lse else o


def load(program: ir.Program, **options) -> Kernel:
    return Kernel(program, emit(program, **options))
