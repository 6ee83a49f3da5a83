"""The latency model: every timing parameter of the simulator in one frozen dataclass.

Times are in nanoseconds, bandwidths in bytes per nanosecond (= GB/s), throughputs in
FLOPs per nanosecond (= GFLOP/s). The defaults are ILLUSTRATIVE, not measured: they are
plausible orders of magnitude for a PE on the logic die of an HBM cube, chosen as exact
binary fractions so that tests can compare times with `==`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    """Per-op cost = fixed latency + size / rate, per engine; IPCQ cost per hop.

    An op occupies its engine for its whole cost (engines are not pipelined): a second op
    on the same engine starts when the first ends.
    """

    dma_latency_ns: float = 64.0
    """Fixed cost of one DMA transfer between the PE's HBM and its scratch (descriptor
    set-up plus HBM access latency), paid by every load, load_async and store."""

    dma_bytes_per_ns: float = 64.0
    """HBM <-> scratch bandwidth of one PE's DMA engine (64 B/ns = 64 GB/s)."""

    gemm_latency_ns: float = 32.0
    """Fixed cost of one tl.dot on the GEMM engine (operand fetch, array fill/drain)."""

    gemm_flops_per_ns: float = 2048.0
    """GEMM engine throughput (2048 FLOP/ns = 2 TFLOP/s); a [M,K]x[K,N] dot is 2*M*N*K FLOPs
    per batch element."""

    math_latency_ns: float = 8.0
    """Fixed cost of one vector op on the MATH engine (element-wise, reduction, select,
    broadcast, fill, copy)."""

    math_flops_per_ns: float = 128.0
    """MATH engine throughput (128 FLOP/ns: 128 lanes at 1 GHz). An element-wise op costs
    1 FLOP per output element, a reduction 1 FLOP per input element."""

    math_transcendental_flops: float = 4.0
    """FLOPs charged per element by exp, log, sqrt and tanh (a transcendental takes
    several lane cycles)."""

    link_latency_ns: float = 16.0
    """IPCQ: latency of one mesh hop (router + wire), paid once per hop by each message."""

    link_bytes_per_ns: float = 32.0
    """IPCQ: bandwidth of one directed N/S/E/W link (32 GB/s). A message occupies each link
    on its route for bytes / link_bytes_per_ns (cut-through: the serialisation is paid once
    end to end, the hop latency per hop)."""

    cube_crossing_latency_ns: float = 48.0
    """IPCQ: extra latency of a hop whose two PEs sit in different CUBEs (the link leaves
    one logic die for another)."""

    # ---- costs -------------------------------------------------------------------------
    def dma_time(self, nbytes: int) -> float:
        return self.dma_latency_ns + nbytes / self.dma_bytes_per_ns

    def gemm_time(self, flops: float) -> float:
        return self.gemm_latency_ns + flops / self.gemm_flops_per_ns

    def math_time(self, flops: float) -> float:
        return self.math_latency_ns + flops / self.math_flops_per_ns

    def serialisation_time(self, nbytes: int) -> float:
        return nbytes / self.link_bytes_per_ns

    def hop_latency(self, crosses_cube: bool) -> float:
        return self.link_latency_ns + (self.cube_crossing_latency_ns if crosses_cube else 0.0)

    def message_time(self, nbytes: int, hops: int = 1, cube_crossings: int = 0) -> float:
        """Uncontended send-to-delivery time of one IPCQ message."""
        return (hops * self.link_latency_ns + cube_crossings * self.cube_crossing_latency_ns
                + self.serialisation_time(nbytes))
