"""K/V address translation (M4.5 §0x04): logical ``(request, t, h_q, x, K|V)`` -> bytes.

A split owner receives a request-local logical range ``[start, end)`` (§0x03); this module
turns it into storage coordinates.  Two identities are resolved first (§0x04A): the cache
row ``c = cache_batch_idx[b]`` (active batch order is not storage order) and the K/V head
``h_kv = h_q // G``.  Then one of four representations applies:

=================  ======================================  ==================================
representation     storage tensor (per K and per V)        row of request-local token ``t``
=================  ======================================  ==================================
contiguous bshd    ``[B_c, T_c, H_kv, d]``   (NHD)         ``(c, t)``
contiguous bhsd    ``[B_c, H_kv, T_c, d]``   (HND)         ``(c, t)``
ragged             ``[sum T_r, H_kv, d]``    (packed NHD)  ``p = indptr[b] + t``
paged nhd / hnd    ``[pages, P, H_kv, d]`` / ``[pages, H_kv, P, d]``
                                                           ``(pi, t % P)``, ``pi`` = the table's
                                                           page for logical block ``t // P``
=================  ======================================  ==================================

The paged table is either dense, ``block_table[c, j]`` indexed by *cache row* (§0x04D), or
CSR, ``kv_indices[kv_indptr[b] + j]`` with ``kv_last_page_len[b]`` indexed by *active
request*, FlashInfer's order (the seed's fixture has four dense rows for three requests but
four CSR row pointers).  Packed ragged ``indptr`` is also in active-request order; a
``cache_batch_idx`` is therefore only meaningful for contiguous and dense-table caches.

Every layout validates its metadata when it is built, before any address arithmetic: a
contract break is a :class:`~compiler.errors.PlanError` naming the tensor, the index and the
value (DESIGN §3.4).  Only *visible* logical blocks are checked against the page pool, so a
dense table may hold sentinels (say ``-1``) past a request's last page; reads never go
there, because every function here bounds ``t`` by the request's exact length (§0x04F).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import numpy as np

from attnc.compiler import resources
from attnc.compiler.errors import PlanError

CONTIGUOUS, RAGGED, PAGED = "contiguous", "ragged", "paged"
ORDERS = {CONTIGUOUS: ("bhsd", "bshd"), RAGGED: ("nhd",), PAGED: ("nhd", "hnd")}
TABLES = ("dense", "csr")
# the seed's names for the contiguous orders (§0x04B): token-major = NHD, head-major = HND
AXIS_NAMES = {"bshd": "NHD", "bhsd": "HND", "nhd": "NHD", "hnd": "HND"}


# ---------------------------------------------------------------- validation helpers
def _ints(name: str, values, ndim: int, copy: bool = True) -> np.ndarray:
    """``values`` as a read-only int64 array of rank ``ndim`` (a PlanError names ``name``).
    ``copy=False``: an integer array keeps its dtype and is only viewed read-only (for a caller
    that holds the layout no longer than the call: the view follows the caller's array)."""
    a = np.asarray(values)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != ndim or a.dtype.kind not in "iu":
        raise PlanError(f"{name} must be a {ndim}-D integer array, got {a.dtype} {list(a.shape)}")
    out = a.astype(np.int64, copy=True) if copy or a.dtype.kind != "i" else a.view()
    out.setflags(write=False)
    return out


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PlanError(f"{name} = {value!r} must be a positive integer")
    return int(value)


def _idx(index) -> str:
    return ", ".join(str(int(i)) for i in np.atleast_1d(index))


def _no_negatives(name: str, a: np.ndarray) -> None:
    if not a.size or a.min() >= 0:
        return
    bad = np.argwhere(a < 0)
    if len(bad):
        i = tuple(bad[0])
        raise PlanError(f"{name}[{_idx(i)}] = {int(a[i])} is negative")


def _check_indptr(name: str, indptr: np.ndarray, nnz: int | None, nnz_name: str) -> np.ndarray:
    """``indptr[0] == 0``, non-decreasing, ``indptr[-1] == nnz``; returns the row lengths."""
    if indptr.size == 0:
        raise PlanError(f"{name} is empty; it needs B + 1 entries, starting at 0")
    if indptr[0] != 0:
        raise PlanError(f"{name}[0] = {int(indptr[0])}, must be 0")
    step = np.diff(indptr)
    drop = np.flatnonzero(step < 0) if step.size and step.min() < 0 else ()
    if len(drop):
        i = int(drop[0]) + 1
        raise PlanError(f"{name} is not monotone: {name}[{i}] = {int(indptr[i])} < "
                        f"{name}[{i - 1}] = {int(indptr[i - 1])}")
    if nnz is not None and indptr[-1] != nnz:
        last = indptr.size - 1
        raise PlanError(f"{name}[{last}] = {int(indptr[-1])} must equal {nnz_name} = {nnz}")
    return step


def _check_cache_batch_idx(idx: np.ndarray, batch: int, rows: int) -> None:
    if idx.size != batch:
        raise PlanError(f"cache_batch_idx has {idx.size} entries, the call has B = {batch} requests")
    if idx.size and (idx.min() < 0 or idx.max() >= rows):
        b = int(np.flatnonzero((idx < 0) | (idx >= rows))[0])
        raise PlanError(f"cache_batch_idx[{b}] = {int(idx[b])} is outside the cache rows [0, {rows})")
    if idx.size and np.bincount(idx, minlength=rows).max() > 1:
        first: dict[int, int] = {}
        for b, c in enumerate(idx.tolist()):
            if c in first:
                raise PlanError(f"cache_batch_idx[{b}] = {c} duplicates cache_batch_idx[{first[c]}]: two "
                                "active requests would share one cache row")
            first[c] = b


def kv_head_of(h_q, heads_q: int, heads_kv: int):
    """The trained K/V head of query head ``h_q``: ``h_q // (H_q / H_kv)`` (§0x04A)."""
    if heads_q % heads_kv:
        raise PlanError(f"H_q = {heads_q} is not a multiple of H_kv = {heads_kv}")
    return h_q // (heads_q // heads_kv)


# ---------------------------------------------------------------- the layout
@dataclass(frozen=True, eq=False)
class KVLayout:
    """One K/V cache representation with its validated, read-only metadata.

    Build it with :func:`contiguous`, :func:`ragged`, :func:`paged_dense`,
    :func:`paged_csr` or :func:`from_inputs`; they validate before returning.
    ``kv_lens`` is always per active request (the exact visible context length)."""

    kind: str                         # contiguous | ragged | paged
    order: str                        # bhsd | bshd | nhd | hnd
    heads_q: int
    heads_kv: int
    d_qk: int
    d_v: int
    elem_bytes: int                   # bytes per stored K/V element
    kv_lens: np.ndarray               # [B]
    cache_batch_idx: np.ndarray | None = None   # [B]: active request -> cache row
    batch_capacity: int | None = None           # B_c: cache rows (contiguous, dense table)
    token_capacity: int | None = None           # T_c (contiguous)
    indptr: np.ndarray | None = None            # ragged [B + 1]
    page_size: int | None = None
    num_pages: int | None = None                # the physical page pool
    table: str | None = None                    # dense | csr
    block_table: np.ndarray | None = None       # dense [B_c, max_pages]
    kv_indptr: np.ndarray | None = None         # csr [B + 1]
    kv_indices: np.ndarray | None = None        # csr [nnz]
    kv_last_page_len: np.ndarray | None = None  # csr [B]

    # ------------------------------------------------------------ identities
    @property
    def batch(self) -> int:
        return int(self.kv_lens.size)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def kv_head(self, h_q):
        return kv_head_of(h_q, self.heads_q, self.heads_kv)

    def cache_row(self, b: int) -> int:
        """The storage row of active request ``b`` (contiguous and dense-table caches)."""
        b = self._request(b)
        return int(self.cache_batch_idx[b]) if self.cache_batch_idx is not None else b

    def head_dim(self, z: str = "k") -> int:
        if z not in ("k", "v"):
            raise ValueError(f"z must be 'k' or 'v', got {z!r}")
        return self.d_qk if z == "k" else self.d_v

    def _request(self, b) -> int:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.batch:
            raise PlanError(f"request {b!r} is outside the batch [0, {self.batch})")
        return int(b)

    # ------------------------------------------------------------ storage ABI
    def tensor_shape(self, z: str = "k") -> tuple[int, ...]:
        """The storage shape of the K (``z='k'``) or V tensor."""
        d, h = self.head_dim(z), self.heads_kv
        if self.kind == CONTIGUOUS:
            bc, tc = self.batch_capacity, self.token_capacity
            return (bc, tc, h, d) if self.order == "bshd" else (bc, h, tc, d)
        if self.kind == RAGGED:
            return (int(self.indptr[-1]), h, d)
        p = self.page_size
        return (self.num_pages, p, h, d) if self.order == "nhd" else (self.num_pages, h, p, d)

    def strides(self, z: str = "k") -> tuple[int, ...]:
        """Contiguous element strides of :meth:`tensor_shape` (row-major)."""
        shape = self.tensor_shape(z)
        out, acc = [], 1
        for n in reversed(shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))

    @property
    def array_keys(self) -> tuple[str, str]:
        """The input keys of the K and V tensors (DESIGN §5)."""
        return ("k_cache", "v_cache") if self.kind == PAGED else ("k", "v")


_LAYOUT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVLayout)
                    if f.default is not dataclasses.MISSING}


# ---------------------------------------------------------------- constructors
def _memo(fn):
    """``fn`` remembered per (typed) arguments, for checks every split call repeats; unhashable
    arguments go straight to ``fn`` (which reports them)."""
    memo = functools.lru_cache(maxsize=256, typed=True)(fn)  # typed: True is not a valid 1

    @functools.wraps(fn)
    def call(*args):
        try:
            return memo(*args)
        except TypeError:
            return fn(*args)
    return call


@_memo
def _heads(heads_q, heads_kv) -> tuple[int, int]:
    hq, hkv = _positive("H_q", heads_q), _positive("H_kv", heads_kv)
    if hq % hkv:
        raise PlanError(f"H_q = {hq} is not a multiple of H_kv = {hkv}")
    return hq, hkv


@_memo
def _dims(d_qk, d_v, elem_bytes) -> tuple[int, int, int]:
    d_qk = _positive("d_qk", d_qk)
    d_v = d_qk if d_v is None else _positive("d_v", d_v)
    return d_qk, d_v, _positive("elem_bytes", elem_bytes)


def contiguous(kv_lens, *, order: str = "bhsd", heads_q: int, heads_kv: int, d_qk: int,
               d_v: int | None = None, elem_bytes: int = 2, batch_capacity: int | None = None,
               token_capacity: int | None = None, cache_batch_idx=None) -> KVLayout:
    """A padded contiguous cache, ``bshd`` (NHD) or ``bhsd`` (HND), with ``B_c`` rows of
    ``T_c`` token slots; ``cache_batch_idx[b]`` picks the row of active request ``b``."""
    if order not in ORDERS[CONTIGUOUS]:
        raise PlanError(f"contiguous layout must be one of {ORDERS[CONTIGUOUS]}, got {order!r}")
    hq, hkv = _heads(heads_q, heads_kv)
    d_qk, d_v, eb = _dims(d_qk, d_v, elem_bytes)
    lens = _ints("kv_lens", kv_lens, 1)
    _no_negatives("kv_lens", lens)
    resources.check_lengths("kv_lens", lens)
    idx = None if cache_batch_idx is None else _ints("cache_batch_idx", cache_batch_idx, 1)
    if batch_capacity is None:
        batch_capacity = lens.size if idx is None or idx.size == 0 else max(lens.size, int(idx.max()) + 1)
    if isinstance(batch_capacity, bool) or not isinstance(batch_capacity, (int, np.integer)) \
            or batch_capacity < 0:
        raise PlanError(f"batch_capacity = {batch_capacity!r} must be a non-negative integer")
    bc = int(batch_capacity)
    if idx is None and lens.size > bc:
        raise PlanError(f"kv_lens has {lens.size} requests but the cache has B_c = {bc} rows")
    if idx is not None:
        _check_cache_batch_idx(idx, lens.size, bc)
    tc = int(lens.max(initial=0)) if token_capacity is None else int(token_capacity)
    if tc < 0:
        raise PlanError(f"token_capacity = {tc} is negative")
    over = np.flatnonzero(lens > tc)
    if len(over):
        b = int(over[0])
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])} exceeds the cache's token capacity T_c = {tc}")
    return KVLayout(CONTIGUOUS, order, hq, hkv, d_qk, d_v, eb, lens, idx, bc, tc)


def ragged(indptr, *, heads_q: int, heads_kv: int, d_qk: int, d_v: int | None = None,
           elem_bytes: int = 2, total_rows: int | None = None, kv_lens=None) -> KVLayout:
    """Packed ragged rows ``[sum T_r, H_kv, d]``; ``indptr`` in active-request order.
    ``total_rows`` (the packed tensor's first dimension) must equal ``indptr[-1]``.  With
    ``kv_lens``, request b's region ``[indptr[b], indptr[b+1])`` has room: only its first
    ``kv_lens[b]`` rows are visible (an append fills the rest, ``compiler.append``)."""
    hq, hkv = _heads(heads_q, heads_kv)
    d_qk, d_v, eb = _dims(d_qk, d_v, elem_bytes)
    ptr = _ints("kv_indptr", indptr, 1)
    regions = _check_indptr("kv_indptr", ptr, total_rows, "the packed K/V rows")
    if kv_lens is None:
        lens = regions
    else:
        lens = _ints("kv_lens", kv_lens, 1)
        _no_negatives("kv_lens", lens)
        if lens.size != regions.size:
            raise PlanError(f"kv_lens has {lens.size} entries, kv_indptr describes {regions.size} requests")
        over = np.flatnonzero(lens > regions)
        if len(over):
            b = int(over[0])
            raise PlanError(f"kv_lens[{b}] = {int(lens[b])} exceeds request {b}'s region of the packed rows: "
                            f"kv_indptr[{b + 1}] - kv_indptr[{b}] = {int(regions[b])}")
    resources.check_lengths("kv_lens (from kv_indptr)" if kv_lens is None else "kv_lens", lens)
    lens.setflags(write=False)
    return KVLayout(RAGGED, "nhd", hq, hkv, d_qk, d_v, eb, lens, indptr=ptr)


def _check_pages(name: str, pages: np.ndarray, where: np.ndarray, num_pages: int) -> None:
    """Page ids at the (visible) positions ``where`` of ``pages`` are inside the pool."""
    bad = where & ((pages < 0) | (pages >= num_pages))
    hit = np.argwhere(bad) if bad.any() else ()
    if len(hit):
        i = tuple(hit[0])
        raise PlanError(f"{name}[{_idx(i)}] = {int(pages[i])} is outside the page pool [0, {num_pages})")


def paged_dense(block_table, kv_lens, *, page_size: int, num_pages: int, order: str = "nhd",
                heads_q: int, heads_kv: int, d_qk: int, d_v: int | None = None, elem_bytes: int = 2,
                cache_batch_idx=None, copy: bool = True) -> KVLayout:
    """A paged cache with a dense ``block_table [B_c, max_pages]`` indexed by cache row.
    Entries past a request's visible blocks are never read and may be sentinels.  ``copy=False``:
    the table is viewed, not copied (``_ints``)."""
    if order not in ORDERS[PAGED]:
        raise PlanError(f"page layout must be one of {ORDERS[PAGED]}, got {order!r}")
    hq, hkv = _heads(heads_q, heads_kv)
    d_qk, d_v, eb = _dims(d_qk, d_v, elem_bytes)
    p, pool = _positive("page_size", page_size), _positive("num_pages", num_pages)
    table = _ints("block_table", block_table, 2, copy)
    lens = _ints("kv_lens", kv_lens, 1)
    shortest, longest = (int(lens.min()), int(lens.max())) if lens.size else (0, 0)
    if shortest < 0:
        _no_negatives("kv_lens", lens)
    resources.check_lengths("kv_lens", lens)
    bc, width = table.shape
    idx = None if cache_batch_idx is None else _ints("cache_batch_idx", cache_batch_idx, 1)
    if idx is None:
        if lens.size > bc:
            raise PlanError(f"kv_lens has {lens.size} requests but block_table has {bc} rows")
        rows = np.arange(lens.size)
    else:
        _check_cache_batch_idx(idx, lens.size, bc)
        rows = idx
    if longest > width * p:
        b = int(np.flatnonzero(lens > width * p)[0])
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])} exceeds its block_table row "
                        f"(cache row {int(rows[b])}): {width} pages x page_size {p} = {width * p} rows")
    if not _prefixes_inside(table, rows if idx is not None else None, lens, p, pool):
        blocks = -(-lens // p)
        visible = np.zeros(table.shape, bool)
        visible[rows] = np.arange(width)[None, :] < blocks[:, None]
        _check_pages("block_table", table, visible, pool)
    return KVLayout(PAGED, order, hq, hkv, d_qk, d_v, eb, lens, idx, bc, None, None, p, pool,
                    "dense", table)


def _prefixes_inside(table: np.ndarray, rows, lens: np.ndarray, page_size: int, pool: int) -> bool:
    """Whether the first ``ceil(lens[b] / page_size)`` entries of table row ``rows[b]`` (default:
    row b) all lie in ``[0, pool)``: one max over the whole rows, viewed unsigned (a negative id
    wraps above the pool), and where that fails (sentinels), over the visible prefixes only
    (``np.maximum.reduceat`` over [start, end) pairs of the flattened rows)."""
    sub = table[:len(lens)] if rows is None else table[rows]
    if not sub.size:
        return True
    flat = _unsigned(np.ascontiguousarray(sub).reshape(-1))  # negative ids become huge: one max checks both ends
    if flat.max() < pool:  # the whole rows first: no sentinel, no more work
        return True
    blocks = -(-lens // page_size)
    bounds = np.empty(2 * len(blocks), np.int64)  # [start, end) of each row's prefix, flattened
    bounds[0::2] = _row_starts(len(blocks), sub.shape[1])
    bounds[1::2] = bounds[0::2] + blocks
    if bounds[-1] >= flat.size:  # the last prefix runs to the end: reduceat's last slice does too
        bounds = bounds[:-1]
    ends = np.maximum.reduceat(flat, bounds)[::2]  # (an empty prefix gives its first entry: left out)
    ends = ends if blocks.min() > 0 else ends[blocks > 0]
    return bool(not ends.size or ends.max() < pool)


@functools.lru_cache(maxsize=64)
def _row_starts(rows: int, width: int) -> np.ndarray:
    out = np.arange(0, rows * width, width, dtype=np.int64)
    out.setflags(write=False)
    return out


def _unsigned(a: np.ndarray) -> np.ndarray:
    """A signed integer array viewed as unsigned (negatives wrap above every valid id)."""
    return a.view(a.dtype.str.replace("i", "u")) if a.dtype.kind == "i" else a


def paged_csr(kv_indptr, kv_indices, kv_last_page_len, *, page_size: int, num_pages: int,
              order: str = "nhd", heads_q: int, heads_kv: int, d_qk: int, d_v: int | None = None,
              elem_bytes: int = 2, copy: bool = True) -> KVLayout:
    """A paged cache with FlashInfer's CSR page lists in active-request order.  A non-empty
    request has ``T = P (n_pages - 1) + last_page_len`` with ``1 <= last_page_len <= P``; a
    request with no pages has ``T = 0`` and must say ``last_page_len = 0``."""
    if order not in ORDERS[PAGED]:
        raise PlanError(f"page layout must be one of {ORDERS[PAGED]}, got {order!r}")
    hq, hkv = _heads(heads_q, heads_kv)
    d_qk, d_v, eb = _dims(d_qk, d_v, elem_bytes)
    p, pool = _positive("page_size", page_size), _positive("num_pages", num_pages)
    ptr = _ints("kv_indptr", kv_indptr, 1)
    ind = _ints("kv_indices", kv_indices, 1, copy)
    last = _ints("kv_last_page_len", kv_last_page_len, 1)
    n_pages = _check_indptr("kv_indptr", ptr, ind.size, "len(kv_indices)")
    if last.size != ptr.size - 1:
        raise PlanError(f"kv_last_page_len has {last.size} entries, kv_indptr describes "
                        f"{ptr.size - 1} requests")
    has = n_pages > 0  # 1 <= last <= P where a request has pages, last == 0 where it has none
    if last.size and (np.minimum(last - has, p * has - last).min() < 0):
        bad = np.flatnonzero(np.where(n_pages > 0, (last < 1) | (last > p), last != 0))
        b = int(bad[0])
        want = f"[1, page_size = {p}]" if n_pages[b] else "0 (the request has no pages)"
        raise PlanError(f"kv_last_page_len[{b}] = {int(last[b])} is outside {want}")
    if ind.size and (ind.min() < 0 or ind.max() >= pool):
        _check_pages("kv_indices", ind, np.ones(ind.shape, bool), pool)
    lens = np.maximum(p * (n_pages - 1) + last, 0)  # a request without pages: -P + 0 -> 0
    resources.check_lengths("kv_lens (P * (pages - 1) + kv_last_page_len)", lens)
    lens.setflags(write=False)
    return KVLayout(PAGED, order, hq, hkv, d_qk, d_v, eb, lens, None, None, None, None, p, pool,
                    "csr", None, ptr, ind, last)


def from_inputs(cache, arrays: Mapping[str, np.ndarray], *, heads_q: int, heads_kv: int,
                elem_bytes: int | None = None, copy: bool = True) -> KVLayout:
    """The layout of an inputs dict with DESIGN §5's keys, for an ``ir.Cache``-like ``cache``
    (``kind``, ``layout``, ``page_size``, ``table`` as enums or strings).  Shapes come from the
    K/V arrays; a contiguous cache without ``kv_lens`` is full (``T_b = S_k``).  ``copy=False``:
    the page table / page list are viewed read-only, not copied, for a caller done with the
    layout before it returns (a split call's plan)."""
    kind = getattr(cache.kind, "value", cache.kind)
    order = getattr(cache.layout, "value", cache.layout)

    def need(key):
        if key not in arrays:
            raise PlanError(f"a {kind} cache needs the input '{key}'")
        return np.asarray(arrays[key])

    keys = ("k_cache", "v_cache") if kind == PAGED else ("k", "v")
    k, v = need(keys[0]), need(keys[1])
    eb = elem_bytes if elem_bytes is not None else k.dtype.itemsize
    cbi = arrays.get("cache_batch_idx")
    if kind == CONTIGUOUS:
        if k.ndim != 4:
            raise PlanError(f"'{keys[0]}' must be 4-D for a contiguous {order} cache, got {list(k.shape)}")
        bc, tc = k.shape[0], (k.shape[1] if order == "bshd" else k.shape[2])
        lens = arrays.get("kv_lens")
        if lens is None:
            batch = bc if cbi is None else np.asarray(cbi).size
            lens = np.full(batch, tc, np.int64)
        return contiguous(lens, order=order, heads_q=heads_q, heads_kv=heads_kv, d_qk=k.shape[-1],
                          d_v=v.shape[-1], elem_bytes=eb, batch_capacity=bc, token_capacity=tc,
                          cache_batch_idx=cbi)
    if kind == RAGGED:
        if cbi is not None:
            raise PlanError("cache_batch_idx does not apply to a ragged cache: kv_indptr is already "
                            "in active-request order")
        return ragged(need("kv_indptr"), heads_q=heads_q, heads_kv=heads_kv, d_qk=k.shape[-1],
                      d_v=v.shape[-1], elem_bytes=eb, total_rows=k.shape[0], kv_lens=arrays.get("kv_lens"))
    if k.ndim != 4:
        raise PlanError(f"'k_cache' must be 4-D for a paged {order} cache, got {list(k.shape)}")
    common = dict(page_size=cache.page_size, num_pages=k.shape[0], order=order, heads_q=heads_q,
                  heads_kv=heads_kv, d_qk=k.shape[-1], d_v=v.shape[-1], elem_bytes=eb, copy=copy)
    if (cache.table or "dense") == "csr":
        if cbi is not None:
            raise PlanError("cache_batch_idx does not apply to a CSR page table: kv_indptr is "
                            "already in active-request order")
        return paged_csr(need("kv_indptr"), need("kv_indices"), need("kv_last_page_len"), **common)
    return paged_dense(need("block_table"), need("kv_lens"), cache_batch_idx=cbi, **common)


def quick_layout(cache, arrays: Mapping[str, np.ndarray], *, heads_q: int, heads_kv: int) -> KVLayout | None:
    """:func:`from_inputs` (``copy=False``) and :func:`check_arrays` for the common calls, in a
    few reductions and no per-request work: a paged cache (dense table, or CSR), a contiguous
    cache, a ragged one, without ``cache_batch_idx``, with signed integer metadata and at least one
    request.  K and V may be any arrays with a shape and a dtype (torch tensors included: they are
    only measured); the metadata must be numpy.  It accepts only what those two accept and builds
    the same layout; anything else (every contract break included) gives None, and the caller
    runs :func:`from_inputs`, which says what is wrong.  A split call's plan runs it before every
    launch."""
    kind, order = getattr(cache.kind, "value", cache.kind), getattr(cache.layout, "value", cache.layout)
    if "cache_batch_idx" in arrays or order not in ORDERS.get(kind, ()) or (kind == RAGGED and "kv_lens" in arrays):
        return None
    hq, hkv = heads_q, heads_kv
    if not (type(hq) is int and type(hkv) is int and 0 < hkv <= hq and hq % hkv == 0):
        return None
    keys = ("k_cache", "v_cache") if kind == PAGED else ("k", "v")
    k, v = arrays.get(keys[0]), arrays.get(keys[1])
    if k is None or v is None:
        return None
    ks, vs = tuple(np.shape(k)), tuple(np.shape(v))
    if len(ks) != (3 if kind == RAGGED else 4) or len(vs) != len(ks) or min(ks) < 1 or min(vs) < 1:
        return None
    d_qk, d_v, eb = ks[-1], vs[-1], k.dtype.itemsize  # (numpy and torch dtypes both say)
    if kind == PAGED:
        p, pool = cache.page_size, ks[0]
        if type(p) is not int or p < 1:
            return None
        inner = (p, hkv) if order == "nhd" else (hkv, p)
        if ks[1:3] != inner or vs[:3] != ks[:3]:
            return None
        if (cache.table or "dense") == "csr":
            ptr, ind, last = (_signed(arrays.get(n), 1) for n in ("kv_indptr", "kv_indices", "kv_last_page_len"))
            if ptr is None or ind is None or last is None or ptr.size < 2 or last.size != ptr.size - 1:
                return None
            ptr = ptr.astype(np.int64)
            n_pages = ptr[1:] - ptr[:-1]
            # every request has pages (else from_inputs), its last page holds 1..P rows
            if ptr[0] != 0 or n_pages.min() < 1 or ptr[-1] != ind.size:
                return None
            if _unsigned(last - 1).max() >= p or _unsigned(ind).max() >= pool:  # (last - 1 wraps: still >= P)
                return None
            last = last.astype(np.int64)
            lens = p * (n_pages - 1) + last
            if lens.max() > resources.MAX_LENGTH:
                return None
            ind = ind.view()
            for a in (ptr, ind, last, lens):
                a.setflags(write=False)
            return _layout(kind=PAGED, order=order, heads_q=hq, heads_kv=hkv, d_qk=d_qk, d_v=d_v, elem_bytes=eb,
                           kv_lens=lens, page_size=p, num_pages=pool, table="csr", kv_indptr=ptr, kv_indices=ind,
                           kv_last_page_len=last)
        table, lens = _signed(arrays.get("block_table"), 2), _signed(arrays.get("kv_lens"), 1)
        if table is None or lens is None or not 0 < lens.size <= table.shape[0]:
            return None
        lens = lens.astype(np.int64)
        if _unsigned(lens).max() > min(table.shape[1] * p, resources.MAX_LENGTH):  # (negatives wrap above)
            return None
        if not _prefixes_inside(table, None, lens, p, pool):
            return None
        table = table.view()
        lens.setflags(write=False)
        table.setflags(write=False)
        return _layout(kind=PAGED, order=order, heads_q=hq, heads_kv=hkv, d_qk=d_qk, d_v=d_v, elem_bytes=eb,
                       kv_lens=lens, batch_capacity=table.shape[0], page_size=p, num_pages=pool, table="dense",
                       block_table=table)
    if ks[-2 if kind == RAGGED else (2 if order == "bshd" else 1)] != hkv:
        return None
    if kind == RAGGED:
        ptr = _signed(arrays.get("kv_indptr"), 1)
        if ptr is None or ptr.size < 2 or vs[:2] != ks[:2]:
            return None
        ptr = ptr.astype(np.int64)
        lens = ptr[1:] - ptr[:-1]
        if ptr[0] != 0 or lens.min() < 0 or ptr[-1] != ks[0] or lens.max() > resources.MAX_LENGTH:
            return None
        ptr.setflags(write=False)
        lens.setflags(write=False)
        return _layout(kind=RAGGED, order="nhd", heads_q=hq, heads_kv=hkv, d_qk=d_qk, d_v=d_v, elem_bytes=eb,
                       kv_lens=lens, indptr=ptr)
    bc, tc = ks[0], (ks[1] if order == "bshd" else ks[2])
    if vs[:3] != ks[:3]:
        return None
    if "kv_lens" in arrays:
        lens = _signed(arrays["kv_lens"], 1)
        if lens is None or not 0 < lens.size <= bc:
            return None
        lens = lens.astype(np.int64)
        if _unsigned(lens).max() > min(tc, resources.MAX_LENGTH):
            return None
    else:
        lens = np.full(bc, tc, np.int64)
    lens.setflags(write=False)
    return _layout(kind=CONTIGUOUS, order=order, heads_q=hq, heads_kv=hkv, d_qk=d_qk, d_v=d_v, elem_bytes=eb,
                   kv_lens=lens, batch_capacity=bc, token_capacity=tc)


def _layout(**fields) -> KVLayout:
    """A KVLayout of checked fields (the rest at their defaults) without the frozen dataclass's
    generated __init__, which sets each of its twenty fields through object.__setattr__."""
    out = object.__new__(KVLayout)
    out.__dict__.update(_LAYOUT_DEFAULTS)
    out.__dict__.update(fields)
    return out


def _signed(a, ndim: int) -> np.ndarray | None:
    """``a`` as an array if it is a non-empty signed integer array of rank ``ndim``."""
    if a is None:
        return None
    a = np.asarray(a)
    return a if a.ndim == ndim and a.dtype.kind == "i" and a.size else None


# ---------------------------------------------------------------- translation
class Segment(NamedTuple):
    """``count`` logical rows stored contiguously in physical ``page`` from row ``offset``."""

    page: int
    offset: int
    count: int


@dataclass(frozen=True)
class Address:
    """Every identity of one logical coordinate, up to its byte offset (§0x04 opening)."""

    request: int
    t: int
    h_q: int
    x: int
    z: str
    cache_row: int | None       # c (contiguous, dense table)
    kv_head: int
    packed_row: int | None      # p = indptr[b] + t (ragged)
    logical_block: int | None   # j = t // P (paged)
    page: int | None            # pi (paged)
    page_offset: int | None     # t % P (paged)
    coordinate: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    elem_offset: int
    byte_offset: int


def _check_range(layout: KVLayout, b: int, start: int, end: int) -> None:
    n = int(layout.kv_lens[b])
    if not 0 <= start <= end <= n:
        raise PlanError(f"range [{start}, {end}) of request {b} is outside its visible rows [0, {n})")


def _pages_row(layout: KVLayout, b: int) -> np.ndarray:
    """The table row (dense) or page list (CSR) of request ``b``: logical block -> page."""
    if layout.table == "dense":
        return layout.block_table[layout.cache_row(b)]
    return layout.kv_indices[layout.kv_indptr[b]:layout.kv_indptr[b + 1]]


def pages_of(layout: KVLayout, b: int) -> np.ndarray:
    """The physical pages of request ``b``'s visible logical blocks, in block order."""
    _require_paged(layout)
    b = layout._request(b)
    blocks = -(-int(layout.kv_lens[b]) // layout.page_size)
    return _pages_row(layout, b)[:blocks].copy()


def _require_paged(layout: KVLayout) -> None:
    if layout.kind != PAGED:
        raise ValueError(f"a {layout.kind} cache has no pages")


def _coordinates(layout: KVLayout, b: int, t: np.ndarray, h_kv, x):
    """Storage coordinate arrays (broadcast over t, h_kv, x), plus the side identities."""
    side: dict[str, object] = {}
    if layout.kind == CONTIGUOUS:
        c = layout.cache_row(b)
        side["cache_row"] = c
        coords = (c, t, h_kv, x) if layout.order == "bshd" else (c, h_kv, t, x)
    elif layout.kind == RAGGED:
        p = layout.indptr[b] + t
        side["packed_row"] = p
        coords = (p, h_kv, x)
    else:
        j, r = t // layout.page_size, t % layout.page_size
        page = _pages_row(layout, b)[j]
        if layout.table == "dense":
            side["cache_row"] = layout.cache_row(b)
        side.update(logical_block=j, page=page, page_offset=r)
        coords = (page, r, h_kv, x) if layout.order == "nhd" else (page, h_kv, r, x)
    return coords, side


def _check_coordinate(layout: KVLayout, b: int, t: np.ndarray, h_q, x, z: str) -> None:
    n, d = int(layout.kv_lens[b]), layout.head_dim(z)
    for name, v, hi in (("t", t, n), ("h_q", h_q, layout.heads_q), ("x", x, d)):
        v = np.asarray(v)
        bad = np.flatnonzero(((v < 0) | (v >= hi)).ravel())
        if len(bad):
            where = {"t": f"visible rows of request {b}", "h_q": "query heads",
                     "x": f"lanes of {z.upper()}"}[name]
            raise PlanError(f"{name} = {int(v.ravel()[bad[0]])} is outside the {where} [0, {hi})")


def elem_offsets(layout: KVLayout, b: int, t, h_q, x, z: str = "k") -> np.ndarray:
    """Element offsets from the K (or V) base, numpy-broadcast over ``t``, ``h_q``, ``x``.
    Every ``t`` must be a visible row of request ``b`` (``0 <= t < kv_lens[b]``)."""
    b = layout._request(b)
    t, h_q, x = (np.asarray(a, np.int64) for a in (t, h_q, x))
    _check_coordinate(layout, b, t, h_q, x, z)
    coords, _ = _coordinates(layout, b, t, layout.kv_head(h_q), x)
    strides = layout.strides(z)
    return sum(np.asarray(c, np.int64) * s for c, s in zip(coords, strides))


def address(layout: KVLayout, b: int, t: int, h_q: int, x: int, z: str = "k") -> Address:
    """The full translation of one logical coordinate ``(b, t, h_q, x, z)``."""
    b = layout._request(b)
    _check_coordinate(layout, b, np.int64(t), h_q, x, z)
    h_kv = int(layout.kv_head(h_q))
    coords, side = _coordinates(layout, b, int(t), h_kv, int(x))
    coords = tuple(int(c) for c in coords)
    strides = layout.strides(z)
    off = sum(c * s for c, s in zip(coords, strides))
    side = {k: int(v) for k, v in side.items()}
    return Address(b, int(t), int(h_q), int(x), z, side.get("cache_row"), h_kv, side.get("packed_row"),
                   side.get("logical_block"), side.get("page"), side.get("page_offset"), coords,
                   layout.tensor_shape(z), strides, off, off * layout.elem_bytes)


def segment_count(start: int, end: int, page_size: int) -> int:
    """Pages touched by ``[start, end)``: ``1 + floor((e-1)/P) - floor(a/P)`` (§0x04E), 0 if empty."""
    return 0 if end <= start else 1 + (end - 1) // page_size - start // page_size


def page_segments(layout: KVLayout, b: int, start: int, end: int) -> tuple[Segment, ...]:
    """The bounded page segments of request ``b``'s logical rows ``[start, end)`` (§0x04E):
    one table lookup per intersected page, rows contiguous within it."""
    _require_paged(layout)
    b = layout._request(b)
    start, end = int(start), int(end)
    _check_range(layout, b, start, end)
    if start == end:
        return ()
    p = layout.page_size
    j = np.arange(start // p, (end - 1) // p + 1)
    lo, hi = np.maximum(j * p, start), np.minimum((j + 1) * p, end)
    pages = _pages_row(layout, b)[j]
    return tuple(Segment(int(pg), int(o), int(n)) for pg, o, n in zip(pages, lo - j * p, hi - lo))


def storage_segments(layout: KVLayout, b: int, start: int, end: int,
                     max_rows: int | None = None) -> tuple[Segment, ...]:
    """Request ``b``'s logical rows ``[start, end)`` as the storage runs a kernel reads with
    one slice each, in logical order.  ``Segment.page`` names the storage *block* and
    ``offset`` the first row inside it:

    * paged: :func:`page_segments` (the physical page, the row inside the page);
    * contiguous: the cache row ``c`` and the token slot ``t``;
    * ragged: block 0 (the packed tensor) and the packed row ``indptr[b] + t``.

    ``max_rows`` caps every segment (a K/V tile width); pages are never merged.  The
    segments cover the range exactly, so a reader never touches a row past ``kv_lens[b]``."""
    b = layout._request(b)
    start, end = int(start), int(end)
    _check_range(layout, b, start, end)
    if layout.kind == PAGED:
        segs = page_segments(layout, b, start, end)
    elif start == end:
        segs = ()
    elif layout.kind == CONTIGUOUS:
        segs = (Segment(layout.cache_row(b), start, end - start),)
    else:
        segs = (Segment(0, int(layout.indptr[b]) + start, end - start),)
    if max_rows is None:
        return segs
    cap = _positive("max_rows", max_rows)
    return tuple(Segment(blk, off + i, min(cap, n - i)) for blk, off, n in segs for i in range(0, n, cap))


def slot_segments(layout: KVLayout, bounds, q_lens, max_rows: int | None = None) -> tuple[np.ndarray, ...]:
    """The storage runs of every producer slot ``(b, s)`` of split ``bounds`` (a
    ``splits.SplitBounds``) as flat read-only int64 arrays ``(ptr, block, offset, count, t0)``:
    slot ``(b, s)`` owns runs ``ptr[b * S_cap + s] .. ptr[b * S_cap + s + 1]``, each
    :func:`storage_segments` of its ``[start, end)`` with its first logical position ``t0``.
    A slot that is empty, or of a request with no query rows, owns none."""
    unit = min(layout.page_size or resources.MAX_LENGTH, max_rows or resources.MAX_LENGTH)
    runs = int((-(-np.asarray(layout.kv_lens, np.int64) // unit)).sum()) + bounds.batch * bounds.capacity
    resources.require(f"the split plan's storage runs (about {runs:,}: K/V rows in pieces of at most {unit})",
                      resources.split_plan_bytes(runs))
    ptr, cols = [0], [[], [], [], []]
    for b in range(bounds.batch):
        for s in range(bounds.capacity):
            if bounds.nonempty[b, s] and q_lens[b] > 0:
                a, e = int(bounds.starts[b, s]), int(bounds.ends[b, s])
                t = a
                for blk, off, n in storage_segments(layout, b, a, e, max_rows):
                    for col, x in zip(cols, (blk, off, n, t)):
                        col.append(x)
                    t += n
            ptr.append(len(cols[0]))
    arrays = tuple(np.asarray(c, np.int64) for c in [ptr, *cols])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def check_fits(layout: KVLayout, program) -> KVLayout:
    """``layout`` when its heads and head dims are the spec's; else a PlanError naming both."""
    p = program
    if (layout.heads_q, layout.heads_kv, layout.d_qk, layout.d_v) != (p.heads_q, p.heads_kv, p.d_qk, p.d_v):
        raise PlanError(f"the layout has heads {layout.heads_q}/{layout.heads_kv} and head_dim "
                        f"{layout.d_qk}/{layout.d_v}; spec '{p.name}' declares {p.heads_q}/{p.heads_kv} "
                        f"and {p.d_qk}/{p.d_v}")
    return layout


def invisible_tail(layout: KVLayout, b: int) -> tuple[int, tuple[int, ...]] | None:
    """The last page of request ``b`` and its allocated-but-invisible offsets (§0x04F), or
    None when the request is empty or its last page is full."""
    _require_paged(layout)
    b = layout._request(b)
    n, p = int(layout.kv_lens[b]), layout.page_size
    if n == 0 or n % p == 0:
        return None
    return int(pages_of(layout, b)[-1]), tuple(range(n % p, p))


# ---------------------------------------------------------------- reading
def check_arrays(layout: KVLayout, arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The K and V storage tensors of ``arrays``, checked against the layout's shapes."""
    out = []
    for z, key in zip(("k", "v"), layout.array_keys):
        if key not in arrays:
            raise PlanError(f"missing input '{key}' for a {layout.kind} cache")
        a = np.asarray(arrays[key])
        want = layout.tensor_shape(z)
        if tuple(a.shape) != want:
            raise PlanError(f"'{key}' has shape {list(a.shape)}, the {layout.kind} {layout.order} "
                            f"layout expects {list(want)}")
        out.append(a)
    return out[0], out[1]


def gather_kv(layout: KVLayout, arrays: Mapping[str, np.ndarray], b: int, start: int = 0,
              end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Request ``b``'s logical K and V rows ``[start, end)`` (default: all visible rows) as
    ``[n, H_kv, d_qk]`` and ``[n, H_kv, d_v]``, whatever the storage order.

    Only visible rows are indexed: paged reads gather exactly ``(page[t // P], t % P)`` for
    ``t`` in the range, so an allocated tail past ``kv_lens[b]`` is never touched (§0x04F)."""
    k, v = check_arrays(layout, arrays)
    b = layout._request(b)
    end = int(layout.kv_lens[b]) if end is None else int(end)
    start = int(start)
    _check_range(layout, b, start, end)
    if layout.kind == CONTIGUOUS:
        c = layout.cache_row(b)
        if layout.order == "bshd":
            return k[c, start:end], v[c, start:end]
        return k[c, :, start:end].transpose(1, 0, 2), v[c, :, start:end].transpose(1, 0, 2)
    if layout.kind == RAGGED:
        p0 = int(layout.indptr[b])
        return k[p0 + start:p0 + end], v[p0 + start:p0 + end]
    t = np.arange(start, end)
    page = _pages_row(layout, b)[t // layout.page_size]
    r = t % layout.page_size
    if layout.order == "nhd":
        return k[page, r], v[page, r]
    # advanced indices split by a slice: numpy puts the gathered axis first -> [n, H_kv, d]
    return k[page, :, r], v[page, :, r]


def gather_segments(layout: KVLayout, arrays: Mapping[str, np.ndarray], b: int, start: int,
                    end: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gather_kv` for a paged cache, walked segment by segment as a kernel would."""
    k, v = check_arrays(layout, arrays)
    ks, vs = [], []
    for page, off, n in page_segments(layout, b, start, end):
        if layout.order == "nhd":
            ks.append(k[page, off:off + n]), vs.append(v[page, off:off + n])
        else:
            ks.append(k[page, :, off:off + n].transpose(1, 0, 2))
            vs.append(v[page, :, off:off + n].transpose(1, 0, 2))
    empty_k = np.zeros((0, layout.heads_kv, layout.d_qk), k.dtype)
    empty_v = np.zeros((0, layout.heads_kv, layout.d_v), v.dtype)
    return (np.concatenate(ks) if ks else empty_k), (np.concatenate(vs) if vs else empty_v)
