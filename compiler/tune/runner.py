"""What a backend's tuning runner provides (``backends/<name>/tune.py: RUNNER``)."""
from __future__ import annotations

from .timers import Timer, wall_timer


class Runner:
    """Samples the shape's inputs and the oracle's answer once; ``prepare(cfg)`` builds one
    candidate's plan and device arguments outside the timed region and returns a
    zero-argument launch plus a converter of its result to host ``(o, lse)``."""

    synchronization = wall_timer.synchronization
    excluded = ("plan construction", "input upload")

    def default_timer(self) -> Timer:
        return wall_timer
