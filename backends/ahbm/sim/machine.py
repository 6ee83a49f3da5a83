"""The machine: a mesh of PEs with their HBM, and `run`, which launches one kernel on every PE."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from .ipcq import Ipcq
from .latency import LatencyModel
from .memory import Hbm
from .mesh import MeshConfig, Topology
from .oplog import OpLog
from .pe import PE
from .scheduler import Scheduler
from .tl import Tl


class PerPE:
    """A launch argument that differs per PE: a sequence indexed by rank, a dict keyed by
    rank, or a callable rank -> value (e.g. each PE's K_base)."""

    def __init__(self, values):
        self._values = values

    def for_rank(self, rank: int):
        if callable(self._values):
            return self._values(rank)
        return self._values[rank]


def _resolve(value, rank: int):
    return value.for_rank(rank) if isinstance(value, PerPE) else value


@dataclass
class RunResult:
    latency: float
    """End-to-end latency in ns: the latest end of any op."""
    oplog: OpLog
    returns: dict[int, object]
    """What each PE's kernel returned."""
    scratch_peak: dict[int, int]
    """High-water mark of each PE's scratch in bytes."""
    link_busy: dict[tuple[int, int], float] = field(default_factory=dict)
    """Busy ns of each directed link (from_rank, to_rank) that carried a message."""
    hbm_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)
    """(bytes read, bytes written) by each PE's DMA as counted by its HBM."""
    unconsumed_messages: int = 0
    """Messages sent but never received."""

    def counters(self) -> dict:
        return self.oplog.counters()


class Machine:
    """An AHBM mesh. Put inputs in `hbm(rank)`, call `run(kernel, *args)`, read outputs back
    from `hbm(rank)`. HBM persists across runs; clocks, engines, scratch, queues and the op
    log start fresh on every run."""

    def __init__(self, config: MeshConfig | None = None, latency: LatencyModel | None = None):
        self.config = config or MeshConfig()
        self.latency = latency or LatencyModel()
        self.topology = Topology(self.config)
        self.pes = [PE(rank, self.topology.describe(rank),
                       Hbm(rank, self.topology.describe(rank), self.config.hbm_bytes))
                    for rank in range(self.topology.size)]

    @property
    def size(self) -> int:
        return self.topology.size

    def hbm(self, rank: int) -> Hbm:
        self.topology.check_rank(rank)
        return self.pes[rank].hbm

    def run(self, kernel: Callable, *args, **kwargs) -> RunResult:
        """Run `kernel(*args, tl=..., **kwargs)` on every PE (PerPE arguments resolved per
        rank) until all kernels return; raises DeadlockError if they cannot."""
        oplog = OpLog()
        ipcq = Ipcq(self.topology, self.latency)
        sched = Scheduler(self.topology.describe)
        for pe in self.pes:
            pe.reset(self.config.scratch_bytes, self.config.scratch_align)
            tl = Tl(pe, self.size, self.topology, self.latency, ipcq, sched, oplog)
            sched.spawn(pe.rank, functools.partial(
                kernel, *(_resolve(a, pe.rank) for a in args), tl=tl,
                **{k: _resolve(v, pe.rank) for k, v in kwargs.items()}))
        returns = sched.run()
        latency = max([oplog.latency] + [pe.now for pe in self.pes])
        return RunResult(
            latency=latency, oplog=oplog, returns=returns,
            scratch_peak={pe.rank: pe.scratch.peak for pe in self.pes},
            link_busy=dict(sorted(ipcq.link_busy.items())),
            hbm_bytes={pe.rank: (pe.hbm.bytes_read, pe.hbm.bytes_written) for pe in self.pes},
            unconsumed_messages=ipcq.unconsumed())
