"""Errors the simulator raises. Every message names the PE (rank and mesh coordinate)."""
from __future__ import annotations


class SimError(Exception):
    """Base class of every simulator error."""


class TopologyError(SimError):
    """A send/recv names a neighbour or a PE that does not exist on the mesh."""


class HbmError(SimError):
    """An HBM access outside a buffer, to an unknown buffer or to another PE's HBM."""


class ScratchOverflowError(SimError):
    """The bump allocator ran past the PE's scratch capacity."""


class ScratchUseAfterFreeError(SimError):
    """A tensor handle was used after the scratch_scope that allocated it exited."""


class ShapeError(SimError):
    """Operand shapes or dtypes that a tl op does not accept."""


class DeadlockError(SimError):
    """Every remaining PE kernel is blocked on a recv that no PE can satisfy any more."""
