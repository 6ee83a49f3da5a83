"""Tuning the numpy backend (``attnc tune --backend numpy``): its search space over the tiled
program's tile sizes, its untuned default (the emitter's tiles) and its runner."""
from __future__ import annotations

import numpy as np

from attnc.compiler import inputs, ir
from attnc.compiler.dispatch import DispatchKey
from attnc.compiler.errors import TuneError
from attnc.compiler.tune import Runner, Shape, Space, reference_for, tile_fits_keys, tile_fits_rows

from .emit import BLOCK_M, BLOCK_N
from .runtime import load


def _default(key: DispatchKey) -> dict:
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}


# family -> Space: one tiled program serves every phase
SPACES: dict[str, Space] = {
    "prefill": Space({"BLOCK_M": (8, 16, 32, 64), "BLOCK_N": (8, 16, 32, 64)}, _default,
                     (tile_fits_rows, tile_fits_keys)),
}


def family_of(key: DispatchKey) -> str:
    """Every phase tunes the one tiled program (its ``prefill`` family)."""
    return "prefill"


class NumpyRunner(Runner):
    """The tiled program on a contiguous call's host arrays, one tile plan per candidate."""

    def __init__(self, program: ir.Program, shape: Shape, key: DispatchKey, seed: int, max_cells: int):
        if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
            raise TuneError(f"the numpy search space tiles the contiguous program; spec '{program.name}' "
                            f"declares a {program.cache.kind.value} cache")
        self.program = program
        self.arrays = inputs.sample(program, shape.batch, shape.s_q, shape.s_k, seed)
        self.call = inputs.validate(program, self.arrays)
        self.reference = reference_for(program, self.call, max_cells)
        self.kernel = load(program)
        self.tensors = {t.name: self.arrays[t.name] for t in program.tensors}

    def prepare(self, cfg: dict):
        c, a = self.call, self.arrays
        plan = self.kernel.plan(c.batch, c.s_q, c.s_k, c.tensors, cfg["BLOCK_M"], cfg["BLOCK_N"])

        def launch():
            return self.kernel(a["q"], a["k"], a["v"], plan=plan, return_lse=True, **self.tensors)

        def host(result):
            o, lse = result
            return inputs.output_bhsd(self.program, o), np.asarray(lse)
        return launch, host


RUNNER = NumpyRunner
