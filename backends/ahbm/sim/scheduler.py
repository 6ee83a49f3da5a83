"""Deterministic discrete-event loop over one greenlet per PE kernel.

The loop always resumes the kernel with the smallest (virtual time, rank). A kernel runs
until it issues a blocking op: the op's end time is pushed and control returns here
(`sleep_until`), unless the kernel is still the earliest, in which case it simply goes on.
A recv whose message has not been sent parks the kernel (`block`) until the sender's
`wake`. Because every kernel issues its ops at the global minimum time, shared resources
(IPCQ links) are claimed in time order and the schedule depends on nothing but the inputs.
When nothing is runnable but kernels are parked, that is a deadlock.
"""
from __future__ import annotations

import heapq
from typing import Callable

from greenlet import greenlet

from .errors import DeadlockError


class Scheduler:
    def __init__(self, describe: Callable[[int], str]):
        self._describe = describe
        self._heap: list[tuple[float, int]] = []
        self._greenlets: dict[int, greenlet] = {}
        self._blocked: dict[int, str] = {}
        self._main: greenlet | None = None
        self.now = 0.0
        self.returns: dict[int, object] = {}

    def spawn(self, rank: int, fn: Callable[[], object]) -> None:
        self._greenlets[rank] = greenlet(fn)
        heapq.heappush(self._heap, (0.0, rank))

    def run(self) -> dict[int, object]:
        self._main = greenlet.getcurrent()
        for g in self._greenlets.values():
            g.parent = self._main
        try:
            while self._heap:
                self.now, rank = heapq.heappop(self._heap)
                g = self._greenlets[rank]
                value = g.switch()
                if g.dead:
                    self.returns[rank] = value
            if self._blocked:
                raise DeadlockError(self._deadlock_message())
        finally:
            self._kill_remaining()
        return dict(sorted(self.returns.items()))

    # ---- called from inside a kernel greenlet ----------------------------------------------
    def sleep_until(self, rank: int, t: float) -> None:
        if not self._heap or (t, rank) < self._heap[0]:
            self.now = t  # still the earliest kernel: no switch needed
            return
        heapq.heappush(self._heap, (t, rank))
        self._main.switch()

    def block(self, rank: int, reason: str) -> None:
        self._blocked[rank] = reason
        self._main.switch()

    def wake(self, rank: int, t: float) -> None:
        del self._blocked[rank]
        heapq.heappush(self._heap, (t, rank))

    # ---- internals -------------------------------------------------------------------------
    def _deadlock_message(self) -> str:
        lines = [f"deadlock at t={self.now:g} ns: every unfinished PE kernel is blocked on an "
                 f"IPCQ receive that no PE can satisfy any more:"]
        for rank in sorted(self._blocked):
            lines.append(f"  {self._describe(rank)}: {self._blocked[rank]}")
        done = [self._describe(r) for r in sorted(self.returns)]
        lines.append(f"finished kernels: {', '.join(done) if done else 'none'}")
        return "\n".join(lines)

    def _kill_remaining(self) -> None:
        for g in self._greenlets.values():
            if not g.dead:
                g.throw()  # GreenletExit: unwinds the kernel's frames (and its scopes)
