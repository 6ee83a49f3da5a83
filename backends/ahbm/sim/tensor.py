"""Tensor handles (a tensor in one PE's scratch) and async handles (load_async/recv_async)."""
from __future__ import annotations

import numpy as np

from .errors import ShapeError
from .memory import Allocation


class TensorHandle:
    """A tensor in one PE's scratch. Use it only through tl ops and Python operators;
    `.numpy()` is an untimed peek for tests and hosts."""

    __slots__ = ("_tl", "data", "alloc", "name", "pending")
    __array_ufunc__ = None  # numpy scalars defer to our reflected operators
    __hash__ = object.__hash__

    def __init__(self, tl, data: np.ndarray, alloc: Allocation, name: str):
        self._tl, self.data, self.alloc, self.name = tl, data, alloc, name
        self.pending = None  # the load_async/recv_async (out=self) not yet waited

    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: int(self.data.size))
    nbytes = property(lambda self: int(self.data.nbytes))

    def numpy(self) -> np.ndarray:
        self._tl._arg(self, "numpy")
        return self.data.copy()

    def __repr__(self) -> str:
        state = "" if self.alloc.alive else ", recycled"
        return (f"TensorHandle({self.name}, {list(self.shape)} {self.dtype}, PE {self._tl.pe.rank}"
                f", scratch@{self.alloc.offset}{state})")

    def __bool__(self):
        raise ShapeError(f"{self._tl.pe.label}: a tensor has no truth value inside a kernel; "
                         f"decide with Python values or select with tl.where")

    def __getitem__(self, key):
        return self._tl._index(self, key)

    def _bin(op, swap=False):
        if swap:
            return lambda self, other: self._tl._binary(op, other, self, operator=True)
        return lambda self, other: self._tl._binary(op, self, other, operator=True)

    __add__, __radd__ = _bin("add"), _bin("add", True)
    __sub__, __rsub__ = _bin("sub"), _bin("sub", True)
    __mul__, __rmul__ = _bin("mul"), _bin("mul", True)
    __truediv__, __rtruediv__ = _bin("div"), _bin("div", True)
    __floordiv__, __rfloordiv__ = _bin("floordiv"), _bin("floordiv", True)
    __mod__, __rmod__ = _bin("mod"), _bin("mod", True)
    __and__, __rand__ = _bin("and"), _bin("and", True)
    __or__, __ror__ = _bin("or"), _bin("or", True)
    __xor__, __rxor__ = _bin("xor"), _bin("xor", True)
    __lshift__, __rlshift__ = _bin("shl"), _bin("shl", True)
    __rshift__, __rrshift__ = _bin("shr"), _bin("shr", True)
    __lt__, __le__, __gt__, __ge__ = _bin("lt"), _bin("le"), _bin("gt"), _bin("ge")
    __eq__, __ne__ = _bin("eq"), _bin("ne")
    del _bin

    def __neg__(self):
        return self._tl._unary("neg", self)

    def __invert__(self):
        return self._tl._unary("invert", self)


class AsyncHandle:
    """What load_async / recv_async return; pass it to tl.wait."""

    __slots__ = ("kind", "tensor", "issued", "ready", "channel", "index", "src", "direction",
                 "spec", "done")

    def __init__(self, kind, tensor=None, issued=0.0, ready=None, channel=None, index=None,
                 src=None, direction=None, spec=None):
        self.kind, self.tensor, self.issued, self.ready = kind, tensor, issued, ready
        self.channel, self.index, self.src, self.direction = channel, index, src, direction
        self.spec, self.done = spec, False

    def __repr__(self) -> str:
        return f"AsyncHandle({self.kind}, issued at {self.issued:g} ns)"
