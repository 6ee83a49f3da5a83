"""Correctness before timing (M4.5 §0x0BH): the float64 oracle's answer for a tuning shape, and
the comparison every candidate must pass before it is timed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import inputs, ir, numerics, oracle

ORACLE_CELLS = 1 << 22  # above this many score cells, the oracle checks a sample of rows


@dataclass
class Reference:
    """The oracle's answer and how to cut the candidate's output down to what it covers."""

    o: np.ndarray
    lse: np.ndarray
    take: Callable[[np.ndarray, np.ndarray], tuple]
    description: str


def _slice_tensors(program: ir.Program, tensors: dict, b: slice) -> dict:
    out = {}
    for t in program.tensors:
        idx = tuple(b if ax == "b" else slice(None) for ax in t.axes)
        out[t.name] = tensors[t.name][idx]
    return out


def reference_for(program: ir.Program, call: inputs.Call, max_cells: int = ORACLE_CELLS) -> Reference:
    """The float64 oracle on a contiguous call: every cell when it is small, else the last
    rows of request 0 (bottom-right positions keep their absolute q when leading rows drop)."""
    batch, heads, s_q, s_k = call.batch, program.heads_q, call.s_q, call.s_k
    if batch * heads * s_q * s_k <= max_cells:
        o, lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
        return Reference(o, lse, lambda o, lse: (o, lse), "float64 oracle, every cell")
    rows = max(1, min(s_q, max_cells // (heads * s_k)))
    b = slice(0, 1)
    o, lse = oracle.reference(program, call.q[b, :, s_q - rows:], call.k[b], call.v[b],
                              _slice_tensors(program, call.tensors, b))
    return Reference(o, lse, lambda o, lse: (o[b, :, s_q - rows:], lse[b, :, s_q - rows:]),
                     f"float64 oracle on request 0, query rows [{s_q - rows}, {s_q}) of {s_q}")


def check_against(program: ir.Program, ref: Reference, o: np.ndarray, lse: np.ndarray):
    o, lse = ref.take(np.asarray(o), np.asarray(lse))
    return numerics.compare_outputs(program.dtype, o, lse, ref.o, ref.lse)
