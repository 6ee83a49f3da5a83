"""Plans made once: the Triton backend's plan cache and its device arrays.

A prefill call's plan depends on the spec, the call's lengths, the tiles and, for a mask that
reads tensors (document ids...), on those tensors' values.  ``PlanCache`` keeps each plan, with
its arrays already on the device, under a key of exactly those things, so a repeated call costs
a dictionary lookup instead of a mask analysis and an upload:

* masks that read no tensors: (spec digest, B, S_q, S_k, tiles);
* masks that read tensors: also each tensor's identity and version.  A torch tensor is known by
  ``id`` (checked through a weak reference, so a new tensor that reuses a dead one's id misses)
  and ``_version``, the counter torch's in-place operations bump: a document tensor changed in
  place (``doc[...] = ...``, ``doc.copy_(...)``) makes a new plan.  Writes that bypass the
  counter (a kernel writing through the tensor's pointer, ``.data``, a numpy view of a CPU
  tensor) are not seen: make the plan yourself (``Kernel.plan`` / ``Attention.plan``) or call
  ``PlanCache.clear``.  A numpy array is known by a digest of its bytes.

The cache is an LRU bounded by bytes (host and device arrays; ``ATTNC_PLAN_CACHE_BYTES``,
default 512 MiB); a plan larger than the budget is used once and not kept.

``walk_arrays`` builds, from a compiler ``Plan``, the arrays the Triton kernels walk (runs of
consecutive blocks, the merged block list with PARTIAL flags); ``upload`` puts them on a device
in one copy.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict

import numpy as np

from attnc.compiler import resources
from attnc.compiler.plan import Plan

DEFAULT_BUDGET = 512 << 20
BUDGET_ENV = "ATTNC_PLAN_CACHE_BYTES"


# ---------------------------------------------------------------- the arrays the kernels walk
def _block_runs(indptr: np.ndarray, indices: np.ndarray):
    """The CSR lists as runs of consecutive K/V blocks [lo, hi) per row: a kernel walks a run
    with a direct, pipelinable loop instead of one indirect load per block (a causal row is
    one FULL run and one PARTIAL run)."""
    rows = len(indptr) - 1
    row_of = np.repeat(np.arange(rows), np.diff(indptr))
    starts = np.ones(len(indices), bool)
    if len(indices):
        starts[1:] = (indices[1:] != indices[:-1] + 1) | (row_of[1:] != row_of[:-1])
    lo = indices[starts].astype(np.int32)
    ends = np.r_[np.flatnonzero(starts)[1:], len(indices)] - 1
    hi = (indices[ends] + 1).astype(np.int32) if len(indices) else np.zeros(0, np.int32)
    ptr = np.zeros(rows + 1, np.int32)
    np.cumsum(np.bincount(row_of[starts], minlength=rows), out=ptr[1:])
    return ptr, lo, hi


def _merged_runs(p_ptr: np.ndarray, p_idx: np.ndarray, f_ptr: np.ndarray, f_idx: np.ndarray) -> dict:
    """Every computed block of a row (FULL and PARTIAL together, ascending) as runs, with one
    PARTIAL flag per block: a kernel walks a row in one pipelined loop per run and applies the
    element mask only where the flag says so (a causal row is one run), or, when runs are short
    (documents), in one pipelined loop over the row's merged block list."""
    rows = len(p_ptr) - 1
    row_of = np.r_[np.repeat(np.arange(rows), np.diff(p_ptr)), np.repeat(np.arange(rows), np.diff(f_ptr))]
    idx = np.r_[p_idx, f_idx].astype(np.int64)
    flag = np.r_[np.ones(len(p_idx), np.int32), np.zeros(len(f_idx), np.int32)]
    order = np.lexsort((idx, row_of))
    ptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=rows), out=ptr[1:])
    run_ptr, lo, hi = _block_runs(ptr, idx[order])
    base = np.r_[0, np.cumsum(hi - lo)[:-1]].astype(np.int32) if len(lo) else np.zeros(0, np.int32)
    return {"merged_run_ptr": run_ptr, "merged_run_lo": lo, "merged_run_hi": hi, "merged_run_base": base,
            "merged_partial": flag[order], "merged_indptr": ptr.astype(np.int32),
            "merged_indices": idx[order].astype(np.int32),
            "mean_merged_run_blocks": len(idx) / len(lo) if len(lo) else 0.0}


def walk_arrays(plan: Plan) -> dict:
    """The plan's arrays and ints as the Triton kernels read them (``Plan.kernel_args`` plus the
    walks' runs and merged lists)."""
    args = plan.kernel_args()
    ptr, lo, hi = _block_runs(args["full_indptr"], args["full_indices"])
    args.update({"full_run_ptr": ptr, "full_run_lo": lo, "full_run_hi": hi})
    args.update(_merged_runs(args["partial_indptr"], args["partial_indices"], args["full_indptr"],
                             args["full_indices"]))
    return args


# Host bytes of building a plan's device arrays (walk_arrays, then upload's packed host buffer), on
# top of the plan's own arrays: per visited (PARTIAL or FULL) K/V block, per tile, and fixed.
# Measured with tracemalloc (tests/numerics/test_plan_memory.py): 54.0-54.1 B per visited block
# (int64 run temporaries, the merged lists, the int32 buffer), ~1 B per tile (the tile order's
# work counts), and a few tens of KiB whatever the size.
WALK_BYTES_PER_BLOCK = 54
WALK_BYTES_PER_TILE = 1
WALK_BYTES_FIXED = 32 << 10


def device_plan_bytes(plan: Plan) -> int:
    """The host memory a plan and the building of its device arrays peak at: the plan's arrays
    (``Plan.host_bytes``) plus the walk's and the upload's (within a few % of tracemalloc's peak)."""
    t = plan.tiles
    blocks = int(t.partial_indices.size + t.full_indices.size)
    return plan.host_bytes() + WALK_BYTES_PER_BLOCK * blocks + WALK_BYTES_PER_TILE * int(t.classes.size) \
        + WALK_BYTES_FIXED


_TORCH_DTYPES: dict = {}


def _torch_dtype(dt: np.dtype):
    t = _TORCH_DTYPES.get(dt)
    if t is None:
        import torch
        t = _TORCH_DTYPES[dt] = getattr(torch, dt.name)
    return t


_NP_DTYPES: dict = {}


def _np_dtype(name) -> np.dtype:
    d = _NP_DTYPES.get(name)
    if d is None:
        d = _NP_DTYPES[name] = np.dtype(name)
    return d


class Staging:
    """Pinned host buffers for plan uploads, used in turn: a plan's bytes are copied into the next
    buffer and sent with one asynchronous copy, so the host never waits for the GPU's queue (a
    copy from pageable memory would) and never pins memory per call.  Before a buffer is reused,
    the event recorded after its last copy is waited on (by then long done)."""

    def __init__(self, slots: int = 8):
        self.slots = slots
        self._buffers: list = []
        self._events: list = []
        self._next = 0

    def copy_to(self, host: np.ndarray, device):
        import torch
        i = self._next
        self._next = (i + 1) % self.slots
        if len(self._buffers) < self.slots:
            self._buffers.append(None)
            self._events.append(None)
        buf, event = self._buffers[i], self._events[i]
        if event is not None:
            event.synchronize()
        if buf is None or buf.numel() < host.size:
            buf = self._buffers[i] = torch.empty(max(host.size, 1 << 16), dtype=torch.uint8, pin_memory=True)
        staged = buf[:host.size]
        staged.numpy()[:] = host
        out = torch.empty(host.size, dtype=torch.uint8, device=device)
        out.copy_(staged, non_blocking=True)
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        event.record()
        return out


STAGING = Staging()


def upload(arrays: dict, device, dtypes: dict | None = None) -> dict:
    """The numpy arrays of ``arrays`` on ``device`` (int32 unless ``dtypes`` names another) in one
    host-to-device copy: they are packed into one buffer and handed back as views of it, each
    starting 16-byte aligned (Triton specializes on it); other values pass through."""
    import torch
    dtypes = dtypes or {}
    spans, offset = {}, 0
    for n, a in arrays.items():
        if not isinstance(a, np.ndarray):
            continue
        dt = _np_dtype(dtypes.get(n, "int32"))
        offset += (-offset) % 16
        size = a.size * dt.itemsize
        spans[n] = (offset, size, dt, a.shape)
        offset += size
    host = np.empty(offset, np.uint8)
    for n, (off, size, dt, shape) in spans.items():
        host[off:off + size].view(dt)[:] = arrays[n].reshape(-1)
    buf = torch.from_numpy(host)
    if str(device) != "cpu":
        buf = STAGING.copy_to(host, device) if torch.cuda.is_available() else buf.to(device)
    out = {n: a for n, a in arrays.items() if n not in spans}
    for n, (off, size, dt, shape) in spans.items():
        t = buf[off:off + size].view(_torch_dtype(dt))
        out[n] = t.view(shape) if len(shape) > 1 else t
    out["_buffer"] = buf
    return out


# ---------------------------------------------------------------- keys
class Key:
    """A cache key made once and looked up many times (a bound call's plan key): its hash is
    computed once, not per lookup (a tuple's hash walks every element), and a dictionary finds
    the same object by identity before comparing."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts, self._hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Key and self._hash == other._hash and self.parts == other.parts)


def tensor_key(name: str, t) -> tuple:
    """What identifies a mask tensor's values for the cache (module docstring), beside its shape,
    strides, dtype and device (the caller's key holds those).  An inference tensor
    (``torch.inference_mode``) has no version counter: it is known by its bytes."""
    if _is_torch(t):
        if not t.is_inference():
            return (id(t), t._version, t.data_ptr())
        t = t.detach().cpu().numpy()
    a = np.ascontiguousarray(t)
    return (name, "numpy", a.dtype.str, a.shape, hashlib.blake2b(a.view(np.uint8).reshape(-1), digest_size=16).digest())


def _is_torch(t) -> bool:
    return hasattr(t, "is_inference")  # (torch tensors; numpy arrays have no such method)


def _tracked(t) -> bool:
    """A torch tensor whose identity and version the cache can key on."""
    return _is_torch(t) and not t.is_inference()


class _Entry:
    __slots__ = ("value", "nbytes", "refs", "key")

    def __init__(self, value, nbytes: int, refs: tuple, key):
        self.value, self.nbytes, self.refs, self.key = value, nbytes, refs, key


class PlanCache:
    """An LRU of plans (with their device arrays) bounded by bytes; thread-safe."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def budget(self) -> int:
        """The given budget, else ``ATTNC_PLAN_CACHE_BYTES`` (a size such as ``512MiB``; 0 keeps
        nothing), read when a plan is stored: a bad value is the call's located error, not the
        import's."""
        if self._budget is not None:
            return self._budget
        return resources.env_size(BUDGET_ENV, DEFAULT_BUDGET, minimum=0)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, tensors=()):
        """The value under ``key`` if every torch tensor it was made from is still the same object."""
        with self._lock:
            e = self._items.get(key)
            if e is not None:
                for r, t in zip(e.refs, tensors):
                    if r is not None and r() is not t:  # an id reused by another tensor: not the plan's tensor
                        self._drop(key)
                        break
                else:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return e.value
            self.misses += 1
            return None

    def stored_key(self, key):
        """The key object an entry equal to ``key`` is stored under (else ``key``): a caller that
        keeps it is found by identity, without comparing the key's parts."""
        with self._lock:
            e = self._items.get(key)
            return key if e is None else e.key

    def put(self, key, value, nbytes: int, tensors=()) -> None:
        budget = self.budget
        if nbytes > budget:
            return
        refs = tuple(weakref.ref(t) if t is not None and _tracked(t) else None for t in tensors)
        with self._lock:
            if key in self._items:
                self._drop(key)
            self._items[key] = _Entry(value, nbytes, refs, key)
            self._bytes += nbytes
            while self._bytes > budget and self._items:
                self._drop(next(iter(self._items)))

    def _drop(self, key) -> None:
        e = self._items.pop(key)
        self._bytes -= e.nbytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


PLANS = PlanCache()  # the process's plan cache (every Triton kernel shares its budget)


def nbytes_of(*values) -> int:
    """Bytes held by numpy arrays and torch tensors among ``values`` (dicts are walked)."""
    total = 0
    for v in values:
        if isinstance(v, dict):
            total += nbytes_of(*v.values())
        elif isinstance(v, np.ndarray):
            total += v.nbytes
        elif hasattr(v, "element_size") and hasattr(v, "numel"):
            total += v.element_size() * v.numel()
    return total
