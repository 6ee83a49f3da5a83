"""Timers (M4.5 §0x0BH): ``timer(fn, warmup, repeats)`` returns raw samples in ms; each names
how it synchronizes (``.synchronization``), which a benchmark row records."""
from __future__ import annotations

import time
from typing import Callable

Timer = Callable[[Callable[[], object], int, int], list]  # timer(fn, warmup, repeats) -> samples (ms)


def wall_timer(fn: Callable[[], object], warmup: int, repeats: int, sync: Callable[[], None] = lambda: None) -> list:
    """perf_counter around each call, ``sync`` before the clock stops (host code: nothing)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


wall_timer.synchronization = "perf_counter; the call returns host arrays (synchronous)"


def cuda_event_timer(fn: Callable[[], object], warmup: int, repeats: int) -> list:
    """CUDA events on the current stream around each call; each end event synchronized before
    the sample is read (§0x0BH).  The device is synchronized after warmup."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)))
    return samples


cuda_event_timer.synchronization = "torch.cuda.Event per sample, end event synchronized"


def do_bench_timer(fn: Callable[[], object], warmup: int, repeats: int) -> list:
    """triton.testing.do_bench's raw samples (it flushes L2 between samples)."""
    import triton.testing
    return [float(s) for s in triton.testing.do_bench(fn, warmup=warmup, rep=repeats, return_mode="all")]


do_bench_timer.synchronization = "triton.testing.do_bench (CUDA events, L2 flushed), return_mode=all"
