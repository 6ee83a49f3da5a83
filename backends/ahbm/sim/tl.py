"""The `tl` API a PE kernel is written against (ADR-0060 §3-§5), one `Tl` object per PE.

Every op executes on numpy at once (data mode) and is charged on the PE's engines by the
latency model: load/load_async/store on DMA, dot on GEMM, every other computing op on MATH,
send/recv on the IPCQ links. Blocking ops advance the PE's clock to their end and yield to
the scheduler; `load_async`, `recv_async` and `send` do not block.

Tensor handles wrap numpy arrays that live in the PE's scratch: each result allocates its
bytes from the bump allocator (views - `trans`, `reshape`, indexing - share their source's
allocation and cost nothing). Compute is float32: float inputs are upcast, float results
are float32, integer results int32 (int64 where an operand is: `cast` makes one), comparisons bool. Loads keep the HBM dtype.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import HbmError, ScratchUseAfterFreeError, ShapeError, TopologyError
from .memory import Ptr
from .tensor import AsyncHandle, TensorHandle

_SCALARS = (int, float, bool, np.integer, np.floating, np.bool_)
_erf64 = np.frompyfunc(math.erf, 1, 1)
_TRANSCENDENTAL = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "sin": np.sin, "cos": np.cos,
                   "erf": lambda x: np.asarray(_erf64(x), np.float64).astype(np.float32)}
_UNARY = {"abs": np.abs, "neg": np.negative, "invert": np.invert, "floor": np.floor, **_TRANSCENDENTAL}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.mod, "maximum": np.maximum, "minimum": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or,
    "xor": np.bitwise_xor, "shl": np.left_shift, "shr": np.right_shift,
}
_CASTS = {"int32": np.int32, "int64": np.int64, "float32": np.float32}
_REDUCE = {"max": np.max, "min": np.min, "sum": np.sum}


def _normalise(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype == np.bool_:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        return arr.astype(np.float32, copy=False)
    if arr.dtype == np.int64:  # an i64 value stays i64 (tl.cast makes one); other integers are int32
        return arr
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int32, copy=False)
    raise ShapeError(f"unsupported dtype {arr.dtype}")


class _ScratchScope:
    def __init__(self, tl: Tl):
        self._tl = tl

    def __enter__(self):
        self._tl.pe.scratch.push_scope()
        return self

    def __exit__(self, *exc):
        self._tl.pe.scratch.pop_scope(self._tl.pe.now)
        return False


class Tl:
    """The tl namespace of one PE kernel (passed as the `tl` keyword argument)."""

    def __init__(self, pe, num_programs: int, topology, latency, ipcq, scheduler, oplog):
        self.pe, self._n, self._topo, self._lat = pe, num_programs, topology, latency
        self._ipcq, self._sched, self._log = ipcq, scheduler, oplog
        self._count = 0

    # ---- identity ----------------------------------------------------------------------------
    def program_id(self, axis: int = 0) -> int:
        """This PE's rank (its logical id, placed on the mesh by MeshConfig.placement)."""
        if axis != 0:
            raise ShapeError(f"{self.pe.label}: the AHBM launch grid is 1-D; program_id(axis="
                             f"{axis}) does not exist")
        return self.pe.rank

    def num_programs(self, axis: int = 0) -> int:
        if axis != 0:
            raise ShapeError(f"{self.pe.label}: the AHBM launch grid is 1-D")
        return self._n

    def coord(self) -> tuple[int, int]:
        """(row, col) of this PE on the mesh."""
        return self._topo.coord(self.pe.rank)

    def direction_to(self, rank: int) -> str:
        """The N/S/E/W direction of physical neighbour `rank`; an error if it is not one."""
        d = self._topo.direction(self.pe.rank, rank)
        if d is None:
            self._topo.check_rank(rank)
            raise TopologyError(f"{self.pe.label}: {self._topo.describe(rank)} is not an "
                                f"N/S/E/W neighbour; choose a placement that makes it one "
                                f"(tree_placement) or send by rank, which routes over hops")
        return d

    def now(self) -> float:
        """This PE's clock in ns (for tests and traces; costs nothing)."""
        return self.pe.now

    # ---- scratch -----------------------------------------------------------------------------
    def scratch_scope(self) -> _ScratchScope:
        """Context manager: every scratch allocation made inside is recycled on exit
        (ADR-0063). Tensors allocated inside must not be used afterwards; carry running
        state in tensors allocated outside and update them with tl.assign."""
        return _ScratchScope(self)

    def _new(self, data: np.ndarray, op: str) -> TensorHandle:
        self._count += 1
        name = f"%{self._count}"
        alloc = self.pe.scratch.alloc(data.nbytes, op,
                                      f"{name} = {op}(...) {list(data.shape)} {data.dtype}")
        return TensorHandle(self, data, alloc, name)

    def _new_like(self, shape, dtype, op: str) -> TensorHandle:
        return self._new(np.zeros(shape, dtype), op)

    def _arg(self, x, op: str) -> TensorHandle:
        if not isinstance(x, TensorHandle):
            raise ShapeError(f"{self.pe.label}: {op} expects a tensor handle, got "
                             f"{type(x).__name__}")
        if x._tl is not self:
            raise ShapeError(f"{self.pe.label}: {op} uses {x.name}, a tensor in PE "
                             f"{x._tl.pe.rank}'s scratch; move data between PEs with send/recv")
        if not x.alloc.alive:
            raise ScratchUseAfterFreeError(
                f"{self.pe.label}: {op} uses tensor {x.name} {list(x.shape)} whose scratch "
                f"was recycled when its tl.scratch_scope() exited at t={x.alloc.freed_at:g} ns; "
                f"keep state that outlives a scope in a tensor allocated outside it "
                f"(tl.assign(state, value))")
        if x.pending is not None:
            raise ShapeError(f"{self.pe.label}: {op} reads {x.name} while a load_async/"
                             f"recv_async into it is in flight; tl.wait on it first")
        return x

    def _operand(self, x, op: str):
        if isinstance(x, _SCALARS):
            return x
        t = self._arg(x, op)
        return t.data.astype(np.float32) if np.issubdtype(t.dtype, np.floating) else t.data

    # ---- engine accounting ---------------------------------------------------------------
    def _record(self, engine: str, op: str, duration: float, **fields):
        start, end = self.pe.engines[engine].reserve(self.pe.now, duration)
        return self._log.add(pe=self.pe.rank, engine=engine, op=op, start=start, end=end,
                             **fields)

    def _block_until(self, t: float) -> None:
        self.pe.now = max(self.pe.now, t)
        self._sched.sleep_until(self.pe.rank, self.pe.now)

    def _math(self, op: str, result: np.ndarray, flops: float) -> TensorHandle:
        out = self._new(result, op)
        flops = float(flops)
        rec = self._record("MATH", op, self._lat.math_time(flops), flops=flops,
                           shape=out.shape)
        self._block_until(rec.end)
        return out

    # ---- HBM <-> scratch (DMA) -------------------------------------------------------------
    def _load_target(self, ptr: Ptr, shape, out, op: str):
        if not isinstance(ptr, Ptr):
            raise HbmError(f"{self.pe.label}: {op} needs an HBM Ptr, got {type(ptr).__name__}")
        buf = self.pe.hbm._buffer(ptr.buffer) if ptr.pe == self.pe.rank else None
        if shape is None:
            if out is not None:
                shape = out.shape
            elif buf is not None and ptr.offset == 0:
                shape = buf.shape
            else:
                raise ShapeError(f"{self.pe.label}: {op} at {ptr!r} needs a shape")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if out is not None:
            self._arg(out, op)
            if out.shape != shape or (buf is not None and out.dtype != buf.dtype):
                raise ShapeError(f"{self.pe.label}: {op} into {out.name} {list(out.shape)} "
                                 f"{out.dtype} of {list(shape)} "
                                 f"{buf.dtype if buf is not None else ''} elements")
        return shape, buf

    def _dma_in(self, ptr, shape, out, op) -> tuple[TensorHandle, object]:
        shape, buf = self._load_target(ptr, shape, out, op)
        dtype = buf.dtype if buf is not None else np.float32
        dst = out if out is not None else self._new_like(shape, dtype, op)
        data = self.pe.hbm.dma_read(ptr, shape, self.pe.label)
        dst.data[...] = data
        rec = self._record("DMA", op, self._lat.dma_time(data.nbytes), nbytes=data.nbytes,
                           shape=shape, buffer=ptr.buffer)
        return dst, rec

    def load(self, ptr: Ptr, shape=None, *, out: TensorHandle | None = None) -> TensorHandle:
        """Blocking HBM -> scratch copy of prod(shape) contiguous elements at ptr (shape
        defaults to the buffer's shape when ptr is a buffer base). `out=` lands the data in
        an existing tensor instead of allocating."""
        dst, rec = self._dma_in(ptr, shape, out, "load")
        self._block_until(rec.end)
        return dst

    def load_async(self, ptr: Ptr, shape=None, *, out: TensorHandle | None = None) -> AsyncHandle:
        """Non-blocking load (ADR-0062): the DMA runs while the kernel goes on; tl.wait(h)
        returns the tensor. The destination is allocated now, in the current scope; for
        prefetches that outlive the scope, pass a persistent buffer as `out=`."""
        dst, rec = self._dma_in(ptr, shape, out, "load_async")
        h = AsyncHandle("load", dst, issued=self.pe.now, ready=rec.end)
        dst.pending = h
        return h

    def store(self, ptr: Ptr, x: TensorHandle) -> None:
        """Blocking scratch -> HBM copy of x, cast to the buffer's dtype."""
        x = self._arg(x, "store")
        nbytes = self.pe.hbm.dma_write(ptr, x.data, self.pe.label)
        rec = self._record("DMA", "store", self._lat.dma_time(nbytes), nbytes=nbytes,
                           shape=x.shape, buffer=ptr.buffer)
        self._block_until(rec.end)

    def wait(self, handle: AsyncHandle) -> TensorHandle:
        """Block until a load_async / recv_async has landed; returns its tensor."""
        if not isinstance(handle, AsyncHandle):
            raise ShapeError(f"{self.pe.label}: tl.wait expects a load_async/recv_async handle")
        if handle.kind == "load":
            t = handle.tensor
            if not t.alloc.alive:
                raise ScratchUseAfterFreeError(
                    f"{self.pe.label}: tl.wait on a load_async whose destination {t.name} was "
                    f"recycled by a scratch_scope exit at t={t.alloc.freed_at:g} ns before the "
                    f"wait; prefetch into a persistent buffer with load_async(..., out=buf)")
            if t.pending is handle:
                t.pending = None
            self._block_until(handle.ready)
            return t
        return self._finish_recv(handle)

    # ---- creation ----------------------------------------------------------------------------
    def full(self, shape, value, dtype=np.float32) -> TensorHandle:
        arr = np.full(shape, value, dtype=dtype)
        return self._math("full", arr, arr.size)

    def zeros(self, shape, dtype=np.float32) -> TensorHandle:
        return self.full(shape, 0, dtype)

    def empty(self, shape, dtype=np.float32) -> TensorHandle:
        """Allocate without initialising (no op is issued; the data reads as zeros)."""
        return self._new(np.zeros(shape, dtype), "empty")

    def arange(self, start: int, stop: int | None = None) -> TensorHandle:
        """int32 iota [start, stop) (or [0, start)) for building masks from positions."""
        arr = np.arange(start, stop, dtype=np.int32) if stop is not None else \
            np.arange(start, dtype=np.int32)
        return self._math("arange", arr, arr.size)

    def assign(self, dst: TensorHandle, value) -> TensorHandle:
        """Copy value (tensor or scalar, broadcast to dst's shape) into dst in place and
        return dst: how running state allocated outside a scratch_scope is updated."""
        dst = self._arg(dst, "assign")
        src = self._operand(value, "assign")
        try:
            dst.data[...] = np.broadcast_to(np.asarray(src, dtype=dst.dtype), dst.shape)
        except ValueError:
            raise ShapeError(f"{self.pe.label}: assign of shape {list(np.shape(src))} into "
                             f"{dst.name} {list(dst.shape)}") from None
        rec = self._record("MATH", "assign", self._lat.math_time(dst.size), flops=float(dst.size),
                           shape=dst.shape)
        self._block_until(rec.end)
        return dst

    # ---- views (free) ----------------------------------------------------------------------
    def _view(self, x: TensorHandle, data: np.ndarray, tag: str) -> TensorHandle:
        return TensorHandle(self, data, x.alloc, f"{x.name}{tag}")

    def trans(self, x: TensorHandle, axes=None) -> TensorHandle:
        """Transpose (the last two axes, or `axes`): a free view, the GEMM engine reads either
        operand order."""
        x = self._arg(x, "trans")
        data = np.swapaxes(x.data, -1, -2) if axes is None else np.transpose(x.data, axes)
        return self._view(x, data, ".T")

    def reshape(self, x: TensorHandle, shape) -> TensorHandle:
        x = self._arg(x, "reshape")
        if not x.data.flags.c_contiguous:
            raise ShapeError(f"{self.pe.label}: reshape of the strided view {x.name}; a copy "
                             f"would be needed")
        return self._view(x, x.data.reshape(shape), ".reshape")

    def _index(self, x: TensorHandle, key) -> TensorHandle:
        x = self._arg(x, "index")
        parts = key if isinstance(key, tuple) else (key,)
        if not all(p is None or p is Ellipsis or isinstance(p, (slice, int, np.integer))
                   for p in parts):
            raise ShapeError(f"{self.pe.label}: only basic indexing (ints, slices, None, ...) "
                             f"makes a view of {x.name}")
        return self._view(x, x.data[key], "[...]")

    # ---- MATH ----------------------------------------------------------------------------------
    def _broadcast_shape(self, op: str, *xs) -> tuple[int, ...]:
        tensors = [np.shape(x) for x in xs if not isinstance(x, _SCALARS)]
        ranks = {len(s) for s in tensors if len(s)}
        if len(ranks) > 1:
            raise ShapeError(f"{self.pe.label}: {op} of shapes "
                             f"{' and '.join(str(list(s)) for s in tensors)}: operands must have "
                             f"the same rank (index a reduced tensor with [:, None] to keep "
                             f"its axis)")
        try:
            return np.broadcast_shapes(*tensors)
        except ValueError:
            raise ShapeError(f"{self.pe.label}: {op} of shapes "
                             f"{' and '.join(str(list(s)) for s in tensors)} do not "
                             f"broadcast") from None

    def _binary(self, op: str, a, b, operator: bool = False):
        allowed = (TensorHandle, *_SCALARS)
        if operator and not (isinstance(a, allowed) and isinstance(b, allowed)):
            return NotImplemented
        x, y = self._operand(a, op), self._operand(b, op)
        shape = self._broadcast_shape(op, x, y)
        with np.errstate(all="ignore"):
            result = _normalise(_BINARY[op](x, y))
        return self._math(op, np.broadcast_to(result, shape).copy(), int(np.prod(shape)))

    def _unary(self, op: str, x) -> TensorHandle:
        v = self._operand(x, op)
        with np.errstate(all="ignore"):
            result = _normalise(_UNARY[op](np.asarray(v)))
        per = self._lat.math_transcendental_flops if op in _TRANSCENDENTAL else 1.0
        return self._math(op, result, result.size * per)

    def exp(self, x):
        return self._unary("exp", x)

    def erf(self, x):
        return self._unary("erf", x)

    def sin(self, x):
        return self._unary("sin", x)

    def cos(self, x):
        return self._unary("cos", x)

    def floor(self, x):
        return self._unary("floor", x)

    def cast(self, x, dtype: str) -> TensorHandle:
        """x converted to "int32", "int64" or "float32" (a MATH op over its elements)."""
        v = np.asarray(self._operand(x, "cast"))
        result = v.astype(_CASTS[dtype])
        return self._math("cast", result, result.size)

    def log(self, x):
        return self._unary("log", x)

    def sqrt(self, x):
        return self._unary("sqrt", x)

    def tanh(self, x):
        return self._unary("tanh", x)

    def abs(self, x):
        return self._unary("abs", x)

    def maximum(self, a, b):
        return self._binary("maximum", a, b)

    def minimum(self, a, b):
        return self._binary("minimum", a, b)

    def where(self, cond, a, b) -> TensorHandle:
        c, x, y = (self._operand(v, "where") for v in (cond, a, b))
        shape = self._broadcast_shape("where", c, x, y)
        result = _normalise(np.where(np.asarray(c, dtype=bool), x, y))
        return self._math("where", np.broadcast_to(result, shape).copy(), int(np.prod(shape)))

    def _reduce(self, op: str, x, axis, keepdims: bool) -> TensorHandle:
        x = self._arg(x, op)
        v = self._operand(x, op)
        try:
            result = _normalise(_REDUCE[op](v, axis=axis, keepdims=keepdims))
        except ValueError as e:  # numpy AxisError is a ValueError
            raise ShapeError(f"{self.pe.label}: {op} of {x.name} {list(x.shape)} over axis "
                             f"{axis}: {e}") from None
        return self._math(op, np.asarray(result), x.size)

    def max(self, x, axis=None, keepdims: bool = False) -> TensorHandle:
        return self._reduce("max", x, axis, keepdims)

    def min(self, x, axis=None, keepdims: bool = False) -> TensorHandle:
        return self._reduce("min", x, axis, keepdims)

    def sum(self, x, axis=None, keepdims: bool = False) -> TensorHandle:
        return self._reduce("sum", x, axis, keepdims)

    def broadcast(self, x, shape) -> TensorHandle:
        """Materialise x broadcast (numpy rules, leading axes may be added) to `shape`
        (ADR-0061: data-faithful GQA head reuse). Keeps x's dtype; one MATH copy."""
        x = self._arg(x, "broadcast")
        try:
            arr = np.broadcast_to(x.data, tuple(shape)).copy()
        except ValueError:
            raise ShapeError(f"{self.pe.label}: broadcast of {x.name} {list(x.shape)} to "
                             f"{list(shape)}") from None
        return self._math("broadcast", arr, arr.size)

    # ---- GEMM ----------------------------------------------------------------------------------
    def dot(self, a: TensorHandle, b: TensorHandle) -> TensorHandle:
        """Matrix product on the GEMM engine (numpy matmul rules: [..., M, K] x [..., K, N];
        a 2-D operand is shared by every batch of the other). float32 result; 2*M*N*K FLOPs
        per batch element."""
        a, b = self._arg(a, "dot"), self._arg(b, "dot")
        if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"{self.pe.label}: dot of {a.name} {list(a.shape)} and {b.name} "
                             f"{list(b.shape)}: need [..., M, K] x [..., K, N]")
        try:
            result = np.matmul(a.data.astype(np.float32), b.data.astype(np.float32))
        except ValueError:
            raise ShapeError(f"{self.pe.label}: dot batch shapes {list(a.shape)} and "
                             f"{list(b.shape)} do not broadcast") from None
        out = self._new(result, "dot")
        flops = 2.0 * result.size * a.shape[-1]
        rec = self._record("GEMM", "dot", self._lat.gemm_time(flops), flops=flops,
                           shape=out.shape)
        self._block_until(rec.end)
        return out

    # ---- IPCQ ------------------------------------------------------------------------------
    def _peer(self, where, op: str) -> tuple[int, str | None]:
        if isinstance(where, str):
            nb = self._topo.neighbour(self.pe.rank, where)
            if nb is None:
                r, c = self.coord()
                raise TopologyError(
                    f"{self.pe.label}: {op}({where!r}): there is no PE to the {where} of "
                    f"(row {r}, col {c}) on the {self._topo.rows}x{self._topo.cols} mesh, so "
                    f"this PE has no {where} IPCQ queue pair")
            return nb, where
        if isinstance(where, (int, np.integer)) and not isinstance(where, bool):
            self._topo.check_rank(int(where))
            if int(where) == self.pe.rank:
                raise TopologyError(f"{self.pe.label}: {op} to itself")
            return int(where), self._topo.direction(self.pe.rank, int(where))
        raise TopologyError(f"{self.pe.label}: {op} needs a direction 'N'/'S'/'E'/'W' or a "
                            f"PE rank, got {where!r}")

    def send(self, dst, x: TensorHandle) -> None:
        """Post x to the IPCQ towards `dst`: a direction N/S/E/W (the physical neighbour,
        one hop) or a PE rank (routed X-then-Y over as many hops as it takes). Does not block
        the sender; the message is delivered after hop latency + bytes / link bandwidth."""
        peer, direction = self._peer(dst, "send")
        x = self._arg(x, "send")
        msg = self._ipcq.send(self.pe.rank, peer, x.data.copy(), self.pe.now)
        self._log.add(pe=self.pe.rank, engine="IPCQ", op="send", start=self.pe.now,
                      end=msg.delivered_at, nbytes=msg.nbytes, shape=x.shape, peer=peer,
                      direction=direction, hops=msg.hops)
        channel = self._ipcq.channel(self.pe.rank, peer)
        waiter = channel.waiters.pop(len(channel.messages) - 1, None)
        if waiter is not None:
            self._sched.wake(waiter, msg.delivered_at)

    def _recv_handle(self, src, shape, dtype, out, op: str) -> AsyncHandle:
        peer, direction = self._peer(src, op)
        channel = self._ipcq.channel(peer, self.pe.rank)
        h = AsyncHandle("recv", None, issued=self.pe.now, channel=channel,
                        index=channel.claimed, src=peer, direction=direction,
                        spec=(None if shape is None else tuple(shape), dtype, op, src))
        channel.claimed += 1
        if out is not None:
            h.tensor = self._arg(out, op)
        elif shape is not None:
            h.tensor = self._new_like(tuple(shape), dtype or np.float32, op)
        if h.tensor is not None and op == "recv_async":
            h.tensor.pending = h
        return h

    def _finish_recv(self, h: AsyncHandle) -> TensorHandle:
        if h.done:
            return h.tensor
        shape, dtype, op, src = h.spec
        ch = h.channel
        while len(ch.messages) <= h.index:
            ch.waiters[h.index] = self.pe.rank
            self._sched.block(self.pe.rank, (
                f"waits in {op}({src!r}) for message #{h.index} from {self._topo.describe(h.src)} "
                f"(issued at t={h.issued:g} ns; {len(ch.messages)} sent on that channel so far)"))
        msg = ch.messages[h.index]
        want_shape = shape
        if want_shape is None and h.tensor is not None:
            want_shape = h.tensor.shape
        if want_shape is not None and tuple(want_shape) != msg.payload.shape or (
                dtype is not None and np.dtype(dtype) != msg.payload.dtype):
            raise ShapeError(f"{self.pe.label}: {op} from {self._topo.describe(h.src)} expected "
                             f"{list(want_shape or ())} {dtype or ''}, message #{h.index} is "
                             f"{list(msg.payload.shape)} {msg.payload.dtype}")
        if h.tensor is None:
            h.tensor = self._new_like(msg.payload.shape, msg.payload.dtype, op)
        elif not h.tensor.alloc.alive:
            raise ScratchUseAfterFreeError(
                f"{self.pe.label}: {op} destination {h.tensor.name} was recycled by a "
                f"scratch_scope exit before the message landed; pass a persistent out=")
        h.tensor.data[...] = msg.payload
        if h.tensor.pending is h:
            h.tensor.pending = None
        end = max(h.issued, msg.delivered_at)
        self._log.add(pe=self.pe.rank, engine="IPCQ", op=op, start=h.issued, end=end,
                      nbytes=msg.nbytes, shape=msg.payload.shape, peer=h.src,
                      direction=h.direction, hops=msg.hops)
        h.done = True
        self._block_until(end)
        return h.tensor

    def recv(self, src, shape=None, dtype=None, *, out: TensorHandle | None = None) -> TensorHandle:
        """Blocking receive of the next message from `src` (direction or rank). shape/dtype,
        when given, are checked against the message (the ADR's tl.recv(dir, shape, dtype))."""
        return self._finish_recv(self._recv_handle(src, shape, dtype, out, "recv"))

    def recv_async(self, src, shape=None, dtype=None, *,
                   out: TensorHandle | None = None) -> AsyncHandle:
        """Claim the next message from `src` without blocking; tl.wait(h) returns it.
        The destination is `out`, or allocated now when shape is given, else at the wait."""
        return self._recv_handle(src, shape, dtype, out, "recv_async")
