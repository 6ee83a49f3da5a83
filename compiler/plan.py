"""Plan time (DESIGN §1): everything that depends on concrete lengths and runtime tensors.

``plan()`` runs the mask analyses for one call shape and freezes what a kernel needs:
the tile CSR (PARTIAL then FULL K/V blocks per (b', h', q-tile)) and, when the mask is
FlashMask-representable and reads tensors, the four interval vectors so PARTIAL tiles
test rows against intervals instead of re-reading the tensors.  A kernel refuses a
plan made for another shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ir
from .analysis.intervals import MaskIntervals, analyze
from .analysis.tiles import TilePlan, plan_tiles
from .errors import PlanError


@dataclass(frozen=True)
class Plan:
    program_digest: str
    batch: int
    s_q: int
    s_k: int
    intervals: MaskIntervals
    tiles: TilePlan
    mask_from_intervals: bool

    @property
    def block_m(self) -> int:
        return self.tiles.block_m

    @property
    def block_n(self) -> int:
        return self.tiles.block_n

    def kernel_args(self) -> dict[str, object]:
        """The plan as the plain arrays and ints a generated kernel reads."""
        b_, h_, _ = self.intervals.shape
        args = {
            "block_m": self.block_m, "block_n": self.block_n, "plan_b": b_, "plan_h": h_,
            "q_tiles": self.tiles.classes.shape[2],
            "partial_indptr": self.tiles.partial_indptr, "partial_indices": self.tiles.partial_indices,
            "full_indptr": self.tiles.full_indptr, "full_indices": self.tiles.full_indices,
            "mask_from_intervals": self.mask_from_intervals,
            "q_tile_order": self.q_tile_order(),
        }
        for cls in ("partial", "full"):
            ptr, lo, hi = _block_runs(args[f"{cls}_indptr"], args[f"{cls}_indices"])
            args.update({f"{cls}_run_ptr": ptr, f"{cls}_run_lo": lo, f"{cls}_run_hi": hi})
        if self.mask_from_intervals:
            args.update({n: v for n, v in self.intervals.vectors().items()})
        return args

    def q_tile_order(self) -> np.ndarray:
        """Query tiles by descending work (computed K/V blocks summed over (b', h')): launched
        first, the longest rows finish with the rest instead of after them (LPT)."""
        work = (self.tiles.classes != 0).sum(axis=(0, 1, 3))
        return np.argsort(-work, kind="stable").astype(np.int32)

    def check_call(self, program: ir.Program, batch: int, s_q: int, s_k: int) -> None:
        if ir.digest(program) != self.program_digest:
            raise PlanError("plan was made for a different spec")
        got, want = (batch, s_q, s_k), (self.batch, self.s_q, self.s_k)
        if got != want:
            names = ("B", "S_q", "S_k")
            field = next(n for n, g, w in zip(names, got, want) if g != w)
            raise PlanError(f"plan was made for {field} = {want[names.index(field)]}, "
                            f"the call has {field} = {got[names.index(field)]}")


def _block_runs(indptr: np.ndarray, indices: np.ndarray):
    """The CSR lists as runs of consecutive K/V blocks [lo, hi) per row: a kernel walks a run
    with a direct, pipelinable loop instead of one indirect load per block (a causal row is
    one FULL run and one PARTIAL run)."""
    rows = len(indptr) - 1
    row_of = np.repeat(np.arange(rows), np.diff(indptr))
    starts = np.ones(len(indices), bool)
    if len(indices):
        starts[1:] = (indices[1:] != indices[:-1] + 1) | (row_of[1:] != row_of[:-1])
    lo = indices[starts].astype(np.int32)
    ends = np.r_[np.flatnonzero(starts)[1:], len(indices)] - 1
    hi = (indices[ends] + 1).astype(np.int32) if len(indices) else np.zeros(0, np.int32)
    ptr = np.zeros(rows + 1, np.int32)
    np.cumsum(np.bincount(row_of[starts], minlength=rows), out=ptr[1:])
    return ptr, lo, hi


def plan(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
         block_m: int = 64, block_n: int = 64, method: str = "auto") -> Plan:
    tensors = tensors or {}
    intervals = analyze(program, batch, s_q, s_k, tensors)
    tiles = plan_tiles(intervals, block_m, block_n, method)
    reads_tensors = bool(ir.loads(program.mask))
    return Plan(ir.digest(program), batch, s_q, s_k, intervals, tiles,
                mask_from_intervals=intervals.representable and reads_tensors)

