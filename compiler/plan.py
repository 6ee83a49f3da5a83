"""Plan time (DESIGN §1): everything that depends on concrete lengths and runtime tensors.

``plan()`` runs the mask analyses for one call shape and freezes what a kernel needs:
the tile CSR (PARTIAL then FULL K/V blocks per (b', h', q-tile)) and, when the mask is
FlashMask-representable and reads tensors, the four interval vectors so PARTIAL tiles
test rows against intervals instead of re-reading the tensors.  A kernel refuses a
plan made for another shape.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        }
        if self.mask_from_intervals:
            args.update({n: v for n, v in self.intervals.vectors().items()})
        return args

    def check_call(self, program: ir.Program, batch: int, s_q: int, s_k: int) -> None:
        if ir.digest(program) != self.program_digest:
            raise PlanError("plan was made for a different spec")
        got, want = (batch, s_q, s_k), (self.batch, self.s_q, self.s_k)
        if got != want:
            names = ("B", "S_q", "S_k")
            field = next(n for n, g, w in zip(names, got, want) if g != w)
            raise PlanError(f"plan was made for {field} = {want[names.index(field)]}, "
                            f"the call has {field} = {got[names.index(field)]}")


def plan(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
         block_m: int = 64, block_n: int = 64, method: str = "auto") -> Plan:
    tensors = tensors or {}
    intervals = analyze(program, batch, s_q, s_k, tensors)
    tiles = plan_tiles(intervals, block_m, block_n, method)
    reads_tensors = bool(ir.loads(program.mask))
    return Plan(ir.digest(program), batch, s_q, s_k, intervals, tiles,
                mask_from_intervals=intervals.representable and reads_tensors)

