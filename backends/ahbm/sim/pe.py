"""A processing element: three engines (DMA, GEMM, MATH), its HBM, its scratch and its clock."""
from __future__ import annotations

from .memory import Hbm, Scratch

ENGINES = ("DMA", "GEMM", "MATH")
"""DMA: HBM <-> scratch (load, load_async, store). GEMM: tl.dot. MATH: every vector op."""


class Engine:
    """One engine of one PE. Ops on it run one at a time in issue order."""

    __slots__ = ("name", "free_at", "busy")

    def __init__(self, name: str):
        self.name = name
        self.free_at = 0.0
        self.busy = 0.0

    def reserve(self, ready: float, duration: float) -> tuple[float, float]:
        """Occupy the engine for `duration` from the later of `ready` and its last op's end."""
        start = max(ready, self.free_at)
        end = start + duration
        self.free_at = end
        self.busy += duration
        return start, end


class PE:
    """`now` is the kernel's issue clock: the time at which its next tl op is issued. A
    blocking op moves it to the op's end; load_async and send leave it where it is."""

    def __init__(self, rank: int, label: str, hbm: Hbm):
        self.rank, self.label, self.hbm = rank, label, hbm
        self.engines: dict[str, Engine] = {}
        self.scratch: Scratch | None = None
        self.now = 0.0

    def reset(self, scratch_bytes: int, scratch_align: int) -> None:
        """Fresh clock, engines and scratch for a new launch (HBM contents persist)."""
        self.engines = {name: Engine(name) for name in ENGINES}
        self.scratch = Scratch(scratch_bytes, scratch_align, self.label)
        self.now = 0.0
        self.hbm.bytes_read = self.hbm.bytes_written = 0
