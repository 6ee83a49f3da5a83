"""Per-PE HBM (named buffers in a byte address space, data on numpy) and per-PE scratch
(a bump allocator with scopes).

HBM is byte-conserving: a DMA moves exactly `numel * itemsize` bytes of the buffer's dtype,
and the bytes counted here are the bytes of the arrays copied. Host reads and writes
(`read`, `write`, `alloc`) set up inputs and fetch outputs and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .errors import HbmError, ScratchOverflowError

_HBM_ALIGN = 4096


@dataclass(frozen=True)
class Ptr:
    """An element address in one PE's HBM: buffer name + element offset. `ptr + n` advances
    by n elements (the ADR's `K_base + j*TILE*d`)."""

    pe: int
    buffer: str
    offset: int = 0

    def __add__(self, n: int) -> Ptr:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            return NotImplemented
        return replace(self, offset=self.offset + int(n))

    __radd__ = __add__

    def __sub__(self, n: int) -> Ptr:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            return NotImplemented
        return replace(self, offset=self.offset - int(n))

    def __repr__(self) -> str:
        return f"Ptr(PE {self.pe}: {self.buffer}+{self.offset})"


class HbmBuffer:
    def __init__(self, name: str, address: int, data: np.ndarray):
        self.name = name
        self.address = address  # byte address of element 0
        self.shape = data.shape
        self.dtype = data.dtype
        self.flat = np.ascontiguousarray(data).reshape(-1).copy()

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes


class Hbm:
    """One PE's HBM: named buffers at 4 KiB-aligned byte addresses."""

    def __init__(self, pe: int, label: str, capacity: int):
        self.pe, self.label, self.capacity = pe, label, capacity
        self.buffers: dict[str, HbmBuffer] = {}
        self._next = 0
        self.bytes_read = 0
        self.bytes_written = 0

    # ---- host side (not timed, not counted) ---------------------------------------------
    def alloc(self, name: str, data=None, *, shape=None, dtype=np.float32) -> Ptr:
        """Create buffer `name` holding `data` (or zeros of shape/dtype); returns its Ptr."""
        if name in self.buffers:
            raise HbmError(f"{self.label}: HBM buffer {name!r} already exists")
        arr = np.zeros(shape, dtype) if data is None else np.asarray(data)
        size = -(-arr.nbytes // _HBM_ALIGN) * _HBM_ALIGN
        if self._next + size > self.capacity:
            raise HbmError(f"{self.label}: HBM full: buffer {name!r} needs {arr.nbytes} B, "
                           f"{self.capacity - self._next} B of {self.capacity} B left")
        self.buffers[name] = HbmBuffer(name, self._next, arr)
        self._next += size
        return Ptr(self.pe, name, 0)

    def ptr(self, name: str) -> Ptr:
        self._buffer(name)
        return Ptr(self.pe, name, 0)

    def read(self, name: str) -> np.ndarray:
        buf = self._buffer(name)
        return buf.flat.reshape(buf.shape).copy()

    def write(self, name: str, data) -> None:
        buf = self._buffer(name)
        arr = np.asarray(data, dtype=buf.dtype)
        if arr.size != buf.flat.size:
            raise HbmError(f"{self.label}: host write of {arr.size} elements to buffer {name!r} "
                           f"of {buf.flat.size}")
        buf.flat[:] = arr.reshape(-1)

    # ---- DMA side (counted) -------------------------------------------------------------
    def dma_read(self, ptr: Ptr, shape: tuple[int, ...], who: str) -> np.ndarray:
        buf, lo, hi = self._range(ptr, shape, who, "load")
        out = buf.flat[lo:hi].reshape(shape).copy()
        self.bytes_read += out.nbytes
        return out

    def dma_write(self, ptr: Ptr, data: np.ndarray, who: str) -> int:
        buf, lo, hi = self._range(ptr, data.shape, who, "store")
        chunk = np.asarray(data).astype(buf.dtype, copy=False).reshape(-1)
        buf.flat[lo:hi] = chunk
        self.bytes_written += chunk.nbytes
        return chunk.nbytes

    def _buffer(self, name: str) -> HbmBuffer:
        try:
            return self.buffers[name]
        except KeyError:
            raise HbmError(f"{self.label}: no HBM buffer {name!r} (have: "
                           f"{', '.join(sorted(self.buffers)) or 'none'})") from None

    def _range(self, ptr: Ptr, shape, who: str, op: str):
        if not isinstance(ptr, Ptr):
            raise HbmError(f"{who}: {op} needs an HBM Ptr, got {type(ptr).__name__}")
        if ptr.pe != self.pe:
            raise HbmError(f"{who}: {op} of {ptr!r}: a PE's DMA reaches only its own HBM")
        buf = self._buffer(ptr.buffer)
        n = int(np.prod(shape, dtype=np.int64))
        lo, hi = ptr.offset, ptr.offset + n
        if lo < 0 or hi > buf.flat.size:
            raise HbmError(f"{who}: {op} of {n} elements at {ptr!r} is outside buffer "
                           f"{buf.name!r} ({buf.flat.size} elements, shape {buf.shape})")
        return buf, lo, hi


class Allocation:
    """A range of scratch [offset, offset + nbytes) owned by one tensor (views share it)."""

    __slots__ = ("offset", "nbytes", "label", "alive", "freed_at")

    def __init__(self, offset: int, nbytes: int, label: str):
        self.offset, self.nbytes, self.label = offset, nbytes, label
        self.alive = True
        self.freed_at: float | None = None

    def __repr__(self) -> str:
        state = "live" if self.alive else "recycled"
        return f"<scratch {self.offset}..{self.offset + self.nbytes} {self.label} {state}>"


class Scratch:
    """Bump allocator over `capacity` bytes. `push_scope`/`pop_scope` bracket a
    tl.scratch_scope(): everything allocated after the push is recycled by the pop."""

    def __init__(self, capacity: int, align: int, label: str):
        self.capacity, self.align, self.label = capacity, align, label
        self.top = 0
        self.peak = 0
        self._live: list[Allocation] = []
        self._marks: list[tuple[int, int]] = []  # (live count, top) at each push

    @property
    def used(self) -> int:
        return self.top

    @property
    def depth(self) -> int:
        return len(self._marks)

    def alloc(self, nbytes: int, op: str, label: str) -> Allocation:
        size = -(-nbytes // self.align) * self.align
        if self.top + size > self.capacity:
            raise ScratchOverflowError(
                f"{self.label}: scratch overflow in {op}: {label} needs {nbytes} B "
                f"({size} B aligned) but only {self.capacity - self.top} B of the "
                f"{self.capacity} B scratch are free ({self.top} B in use by "
                f"{len(self._live)} allocations, scratch_scope depth {self.depth}); wrap "
                f"per-tile temporaries in `with tl.scratch_scope():`")
        a = Allocation(self.top, nbytes, label)
        self.top += size
        self.peak = max(self.peak, self.top)
        self._live.append(a)
        return a

    def push_scope(self) -> None:
        self._marks.append((len(self._live), self.top))

    def pop_scope(self, now: float) -> list[Allocation]:
        mark, self.top = self._marks.pop()
        freed, self._live = self._live[mark:], self._live[:mark]
        for a in freed:
            a.alive, a.freed_at = False, now
        return freed
