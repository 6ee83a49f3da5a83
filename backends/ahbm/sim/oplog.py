"""The op log: one record per engine op and per IPCQ message end, plus the counters and the
per-engine time breakdown derived from it (so they can never disagree with the log)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import astuple, dataclass

from .pe import ENGINES


@dataclass(frozen=True)
class OpRecord:
    """For DMA/GEMM/MATH records [start, end) is exactly the time the op occupied its
    engine. For IPCQ records: a `send` spans issue -> delivery at the peer; a `recv` or
    `recv_async` spans issue -> the time the data was in the receiver's scratch."""

    seq: int
    pe: int
    engine: str  # DMA | GEMM | MATH | IPCQ
    op: str  # the tl op: load, load_async, store, dot, exp, add, ..., send, recv, recv_async
    start: float
    end: float
    nbytes: int = 0  # bytes moved (DMA, IPCQ)
    flops: float = 0.0  # FLOPs charged (GEMM, MATH)
    shape: tuple = ()  # shape of the tensor produced / moved
    buffer: str | None = None  # HBM buffer of a DMA op
    peer: int | None = None  # the other PE of an IPCQ op
    direction: str | None = None  # N/S/E/W of a neighbour send/recv; None when routed
    hops: int = 0  # links an IPCQ message crossed

    @property
    def duration(self) -> float:
        return self.end - self.start


class OpLog:
    def __init__(self):
        self.records: list[OpRecord] = []

    def add(self, **fields) -> OpRecord:
        rec = OpRecord(seq=len(self.records), **fields)
        self.records.append(rec)
        return rec

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def select(self, op: str | tuple | None = None, engine: str | None = None,
               pe: int | None = None) -> list[OpRecord]:
        ops = (op,) if isinstance(op, str) else op
        return [r for r in self.records if (ops is None or r.op in ops)
                and (engine is None or r.engine == engine) and (pe is None or r.pe == pe)]

    def as_tuples(self) -> list[tuple]:
        return [astuple(r) for r in self.records]

    # ---- counters --------------------------------------------------------------------------
    @property
    def dma_read_count(self) -> int:
        """HBM -> scratch transfers (load + load_async): the K/V tile loads of ADR-0060 §11."""
        return len(self.select(("load", "load_async")))

    @property
    def dma_write_count(self) -> int:
        return len(self.select("store"))

    @property
    def gemm_count(self) -> int:
        return len(self.select(engine="GEMM"))

    @property
    def math_count(self) -> int:
        return len(self.select(engine="MATH"))

    @property
    def ipcq_send_count(self) -> int:
        return len(self.select("send"))

    @property
    def ipcq_recv_count(self) -> int:
        return len(self.select(("recv", "recv_async")))

    def dma_reads_by_buffer(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.select(("load", "load_async")):
            out[r.buffer] += 1
        return dict(sorted(out.items()))

    def bytes_by_engine(self) -> dict[str, int]:
        """DMA: bytes read + written; IPCQ: bytes sent (each message counted once)."""
        dma = sum(r.nbytes for r in self.select(engine="DMA"))
        return {"DMA": dma, "IPCQ": sum(r.nbytes for r in self.select("send"))}

    def flops_by_engine(self) -> dict[str, float]:
        return {e: sum(r.flops for r in self.select(engine=e)) for e in ("GEMM", "MATH")}

    @property
    def latency(self) -> float:
        """End-to-end latency: the last end time of any op."""
        return max((r.end for r in self.records), default=0.0)

    def busy_by_pe(self) -> dict[int, dict[str, float]]:
        """Busy time of each engine of each PE (sum of its ops' durations)."""
        out: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(ENGINES, 0.0))
        for r in self.records:
            if r.engine in ENGINES:
                out[r.pe][r.engine] += r.duration
        return {pe: out[pe] for pe in sorted(out)}

    def busy_by_engine(self) -> dict[str, float]:
        """Busy time per engine summed over PEs."""
        total = dict.fromkeys(ENGINES, 0.0)
        for per in self.busy_by_pe().values():
            for e, t in per.items():
                total[e] += t
        return total

    def counters(self) -> dict:
        return {
            "latency_ns": self.latency,
            "dma_read_count": self.dma_read_count,
            "dma_write_count": self.dma_write_count,
            "gemm_count": self.gemm_count,
            "math_count": self.math_count,
            "ipcq_send_count": self.ipcq_send_count,
            "ipcq_recv_count": self.ipcq_recv_count,
            "bytes": self.bytes_by_engine(),
            "flops": self.flops_by_engine(),
            "busy_ns": self.busy_by_engine(),
        }

    def breakdown(self) -> str:
        """A text table: busy ns per engine per PE, then the total."""
        lines = [f"{'PE':>4} " + " ".join(f"{e:>12}" for e in ENGINES)]
        for pe, per in self.busy_by_pe().items():
            lines.append(f"{pe:>4} " + " ".join(f"{per[e]:>12.1f}" for e in ENGINES))
        tot = self.busy_by_engine()
        lines.append(f"{'all':>4} " + " ".join(f"{tot[e]:>12.1f}" for e in ENGINES))
        lines.append(f"end-to-end latency {self.latency:.1f} ns")
        return "\n".join(lines)
