"""Append as a transaction (M4.5 §0x08C, §0x08E, §0x08H): what an append call may write, checked
before anything is.

An append call brings, per request b, ``C_b`` new query rows with their K and V rows; the cache
holds ``T_b`` committed rows (``kv_lens``).  Query row i sits at absolute position ``T_b + i``
and sees the committed rows ``[0, T_b)`` and the staged rows ``[T_b, T_b + i]`` (bottom-right).
The rows are committed to the request's cache row (not its position in the batch) only after
the output exists, and ``kv_lens`` then advances to ``T + C``.

This module owns the host-side half, on numpy metadata and the storage tensors' shapes:
:func:`validate_append` checks capacity, page ids, cache-row identity and metadata, and returns
an :class:`AppendCall` with the storage coordinates of every new row and the post-commit view
of the cache (the split call the attention runs: ``kv_lens = T + C``, ``q_lens = C``).  A
contract break is an InputError/PlanError naming the key, the request and the value, raised
before the caller writes a byte.  ``attnc.serving`` stages, attends and commits.

The cache keys of an append (DESIGN §5's, with ``kv_lens`` always the *committed* rows and the
layout metadata describing what is *allocated*):

=================  =========================  ==========================================
cache              storage                    metadata
=================  =========================  ==========================================
contiguous         ``k``, ``v``               ``kv_lens``, optional ``cache_batch_idx``
ragged             ``k``, ``v``               ``kv_indptr`` (each request's region), ``kv_lens``
paged, dense       ``k_cache``, ``v_cache``   ``block_table``, ``kv_lens``, optional ``cache_batch_idx``
paged, CSR         ``k_cache``, ``v_cache``   ``kv_indptr``, ``kv_indices`` (allocated pages), ``kv_lens``
=================  =========================  ==========================================

plus ``q_lens`` or ``qo_indptr`` (default: one row per request, decode).  Pages must be
allocated before the call, as FlashInfer's ``append_paged_kv_cache`` requires.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from . import inputs, ir
from .analysis import layout as lay
from .analysis.ledger import dtype_bytes
from .analysis.microbatch import MicrobatchManifest
from .errors import InputError, PlanError

ROW_KEYS = ("q_lens", "qo_indptr")


def append_keys(program: ir.Program) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) cache keys of an append over ``program``'s cache."""
    c = program.cache
    if c.kind is ir.CacheKind.CONTIGUOUS:
        return ("k", "v", "kv_lens"), ("cache_batch_idx", *ROW_KEYS)
    if c.kind is ir.CacheKind.RAGGED:
        return ("k", "v", "kv_indptr", "kv_lens"), ROW_KEYS
    if (c.table or "dense") == "csr":
        return ("k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_lens"), ROW_KEYS
    return ("k_cache", "v_cache", "block_table", "kv_lens"), ("cache_batch_idx", *ROW_KEYS)


@dataclass(frozen=True, eq=False)
class AppendCall:
    """A validated append: its manifest, the post-commit view and where each new row goes.

    ``targets`` index the K (and V) storage tensor for the packed new rows: ``(block, offset)``
    with ``head_major`` telling whether the offset axis comes after the head axis
    (``k[block, :, offset]``: bhsd, hnd) or before it (``k[block, offset]``: bshd, nhd); a ragged
    cache has one index, the packed row."""

    manifest: MicrobatchManifest
    layout: lay.KVLayout            # the post-commit view: kv_lens = T + C
    view: dict                      # its metadata as split-call keys (numpy), q_lens included
    targets: tuple[np.ndarray, ...]
    head_major: bool
    storage_keys: tuple[str, str]
    device_targets: dict = field(default_factory=dict, repr=False)  # device -> targets as its tensors (serving)

    @property
    def committed(self) -> np.ndarray:
        """``kv_lens`` after the commit: ``T + C`` per request."""
        return self.manifest.post_length

    @property
    def view_digest(self) -> str:
        """sha256 of the view's metadata (what a plan of this call depends on)."""
        h = hashlib.sha256()
        for n in sorted(self.view):
            a = np.ascontiguousarray(self.view[n])
            h.update(f"{n}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()


def validation_key(program: ir.Program, arrays: dict, new_rows: int, manifest: MicrobatchManifest | None,
                   request_ids) -> str:
    """sha256 of everything :func:`validate_append` reads: the program, each key's dtype, shape and
    (for metadata) values, the new rows, the manifest and the request ids.  Equal keys validate
    alike, so a plan keeps its validated call for calls with the same key (the layers of one
    serving step: other storage tensors of the same shapes, the same metadata)."""
    # (inputs of the wrong kind key by identity: validate_append names what is wrong with them)
    m = manifest.digest if isinstance(manifest, MicrobatchManifest) else None if manifest is None else id(manifest)
    try:
        ids = None if request_ids is None else [int(i) for i in request_ids]
    except (TypeError, ValueError):
        ids = id(request_ids)
    h = hashlib.sha256(f"{ir.digest(program)}:{new_rows}:{m}:{ids}".encode())
    for n in sorted(arrays):
        a = arrays[n]
        if hasattr(a, "untyped_storage"):  # a storage tensor: its shape only is read
            h.update(f"{n}:{tuple(a.shape)}:{a.dtype}".encode())
            continue
        a = np.ascontiguousarray(a)
        h.update(f"{n}:{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _meta(arrays: dict, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(arrays[name])
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != ndim or a.dtype.kind not in "iu":
        raise InputError(f"inputs: '{name}' must be a {ndim}-D integer array, got {a.dtype} {list(a.shape)}")
    return a.astype(np.int64)


def _capacity_error(b: int, T: int, C: int, where: str, capacity: int) -> PlanError:
    return PlanError(f"append: request {b} has T = {T} committed + C = {C} new rows = {T + C}, more than "
                     f"{where} holds ({capacity} rows)")


def validate_append(program: ir.Program, arrays: dict, new_rows: int, *, manifest: MicrobatchManifest | None = None,
                    request_ids=None) -> AppendCall:
    """Check an append call's cache keys (``arrays``: the storage tensors, anything with a shape,
    and numpy metadata) for ``new_rows`` packed query rows; optional ``manifest`` (else one is
    frozen: ``request_ids`` or 0..B-1, the cache rows of the metadata)."""
    p = program
    if manifest is not None and not isinstance(manifest, MicrobatchManifest):
        raise InputError(f"inputs: manifest is a {type(manifest).__name__}; give an attnc.MicrobatchManifest "
                         "(MicrobatchManifest.freeze(...)) or leave it out")
    if manifest is not None and request_ids is not None:
        raise InputError("inputs: give request_ids or a manifest (which names the requests), not both")
    required, optional = append_keys(p)
    desc = inputs.cache_description(p)
    for n in required:
        if n not in arrays:
            raise InputError(f"inputs: an append over a {desc} needs '{n}' (cache keys: {', '.join(required)}; "
                             f"optional: {', '.join(optional)})")
    unknown = sorted(set(arrays) - {*required, *optional})
    if unknown:
        raise InputError(f"inputs: unknown key '{unknown[0]}' for an append over a {desc} (cache keys: "
                         f"{', '.join(required)}; optional: {', '.join(optional)})")
    kind, order = p.cache.kind.value, p.cache.layout.value
    k_key, v_key = required[:2]
    shapes = {n: tuple(arrays[n].shape) for n in (k_key, v_key)}
    T = _meta(arrays, "kv_lens", 1)
    neg = np.flatnonzero(T < 0)
    if len(neg):
        raise PlanError(f"kv_lens[{neg[0]}] = {int(T[neg[0]])} is negative")
    batch = T.size
    if batch == 0:
        raise InputError("inputs: an append needs at least one request (kv_lens is empty)")
    given_rows = any(n in arrays for n in ROW_KEYS)
    if manifest is not None and not given_rows:
        C = np.asarray(manifest.C, np.int64)
        if C.size != batch or int(C.sum()) != new_rows:
            raise PlanError(f"manifest {manifest.digest[:12]} has {len(manifest)} requests and {int(C.sum())} new "
                            f"rows; the call has {batch} requests (kv_lens) and {new_rows} rows of q")
    else:
        C, _ = inputs.query_rows(arrays, batch, new_rows)
    rows = np.arange(batch, dtype=np.int64)
    if "cache_batch_idx" in arrays:
        rows = _meta(arrays, "cache_batch_idx", 1)
    dims = dict(heads_q=p.heads_q, heads_kv=p.heads_kv, d_qk=p.d_qk, d_v=p.d_v, elem_bytes=dtype_bytes(p.dtype))
    post = T + C
    _check_length_dtype(np.asarray(arrays["kv_lens"]).dtype, T, C)
    view: dict = {"kv_lens": post, "q_lens": C}
    if kind == "contiguous":
        if len(shapes[k_key]) != 4:
            raise InputError(f"inputs: '{k_key}' has shape {list(shapes[k_key])}; a contiguous {order} cache is 4-D")
        t_c = shapes[k_key][1 if order == "bshd" else 2]
        for b in np.flatnonzero(post > t_c)[:1]:
            raise _capacity_error(int(b), int(T[b]), int(C[b]), f"cache row {int(rows[b])}'s token capacity T_c", t_c)
        layout = lay.contiguous(post, order=order, batch_capacity=shapes[k_key][0], token_capacity=t_c,
                                cache_batch_idx=arrays.get("cache_batch_idx"), **dims)
        if "cache_batch_idx" in arrays:
            view["cache_batch_idx"] = rows
    elif kind == "ragged":
        ptr = _meta(arrays, "kv_indptr", 1)
        if ptr.size != batch + 1:
            raise InputError(f"inputs: 'kv_indptr' has {ptr.size} entries; kv_lens has B = {batch}, so B + 1")
        region = lay._check_indptr("kv_indptr", ptr, shapes[k_key][0], "the packed K/V rows")
        for b in np.flatnonzero(post > region)[:1]:
            raise _capacity_error(int(b), int(T[b]), int(C[b]), f"its region kv_indptr[{b + 1}] - kv_indptr[{b}]",
                                  int(region[b]))
        layout = lay.ragged(ptr, total_rows=shapes[k_key][0], kv_lens=post, **dims)
        view["kv_indptr"] = ptr
    elif (p.cache.table or "dense") == "csr":
        layout, view = _csr_view(p, arrays, T, C, shapes[k_key], dims, view)
    else:
        P = p.cache.page_size
        table = _meta(arrays, "block_table", 2)
        width = table.shape[1]
        for b in np.flatnonzero(post > width * P)[:1]:
            raise _capacity_error(int(b), int(T[b]), int(C[b]), f"its block_table row (cache row {int(rows[b])}: "
                                  f"{width} pages x page_size {P})", width * P)
        layout = lay.paged_dense(table, post, page_size=P, num_pages=shapes[k_key][0], order=order,
                                 cache_batch_idx=arrays.get("cache_batch_idx"), **dims)
        view["block_table"] = table
        if "cache_batch_idx" in arrays:
            view["cache_batch_idx"] = rows
    _check_storage(layout, shapes, (k_key, v_key))
    frozen = MicrobatchManifest.freeze(range(batch) if request_ids is None else request_ids, rows, T, C)
    if manifest is not None:
        _check_manifest(manifest, frozen)
        frozen = manifest
    targets = _targets(layout, T, C, rows)
    if layout.kind == lay.PAGED:
        _check_page_writes(layout, targets[0], C)
        if layout.table == "dense":
            _check_unscheduled_rows(view["block_table"], rows, targets[0], C, shapes[k_key][0])
    return AppendCall(frozen, layout, view, targets, order in ("bhsd", "hnd"), (k_key, v_key))


def _check_length_dtype(dtype: np.dtype, T: np.ndarray, C: np.ndarray) -> None:
    """``kv_lens`` advances in place, in its own dtype: every ``T + C`` must fit that dtype."""
    if dtype.kind not in "iu" or dtype.itemsize >= 8:
        return
    top = int(np.iinfo(dtype).max)
    for b in np.flatnonzero(T + C > top)[:1]:
        raise PlanError(f"append: kv_lens is {dtype}, and request {b} would commit T = {int(T[b])} + C = {int(C[b])} "
                        f"= {int(T[b] + C[b])} rows, more than {dtype} holds ({top}): kv_lens advances in place in "
                        "its own dtype; pass it as int32 or int64")


def _check_unscheduled_rows(table: np.ndarray, rows: np.ndarray, written: np.ndarray, C, num_pages: int) -> None:
    """A dense page table: a page the call writes is listed by no row of the table that the call
    does not schedule (``cache_batch_idx``, or rows 0..B-1; that row's committed K/V would be
    overwritten).  An
    unscheduled row's committed length is not in the call, so every page id it lists counts."""
    if not written.size:
        return
    idle = np.setdiff1d(np.arange(table.shape[0]), rows)
    if not idle.size:
        return
    listed = table[idle]
    hit = np.isin(listed, np.unique(written)) & (listed >= 0) & (listed < num_pages)
    if hit.any():
        r, j = (int(x[0]) for x in np.nonzero(hit))
        page = int(listed[r, j])
        writer = int(np.repeat(np.arange(len(C)), C)[np.flatnonzero(written == page)[0]])
        raise PlanError(f"append: page {page} receives request {writer}'s new rows but is listed by block_table"
                        f"[{int(idle[r])}, {j}], a row this call does not schedule (cache_batch_idx): its "
                        "committed K/V would be overwritten; a page an append writes must belong to one request "
                        "(clear a free row's entries to -1)")


def _csr_view(p, arrays, T, C, k_shape, dims, view):
    """The post-commit CSR view: each request's allocated page list cut to the pages its
    ``T + C`` rows fill, with the matching ``kv_last_page_len``."""
    P = p.cache.page_size
    ptr = _meta(arrays, "kv_indptr", 1)
    ind = _meta(arrays, "kv_indices", 1)
    batch = T.size
    if ptr.size != batch + 1:
        raise InputError(f"inputs: 'kv_indptr' has {ptr.size} entries; kv_lens has B = {batch}, so B + 1")
    allocated = lay._check_indptr("kv_indptr", ptr, ind.size, "len(kv_indices)")
    post = T + C
    need = -(-post // P)
    for b in np.flatnonzero(need > allocated)[:1]:
        raise _capacity_error(int(b), int(T[b]), int(C[b]), f"its {int(allocated[b])} allocated page(s) "
                              f"(kv_indptr[{b + 1}] - kv_indptr[{b}], page_size {P})", int(allocated[b]) * P)
    keep = np.concatenate([ind[ptr[b]:ptr[b] + need[b]] for b in range(batch)]) if batch else ind[:0]
    new_ptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int64)
    last = np.where(need > 0, post - P * (need - 1), 0).astype(np.int64)
    layout = lay.paged_csr(new_ptr, keep, last, page_size=P, num_pages=k_shape[0], order=p.cache.layout.value,
                           **dims)
    view = {"q_lens": view["q_lens"], "kv_indptr": new_ptr, "kv_indices": keep, "kv_last_page_len": last}
    return layout, view


def _check_storage(layout, shapes: dict, keys) -> None:
    for z, key in zip(("k", "v"), keys):
        want = layout.tensor_shape(z)
        if shapes[key] != want:
            raise InputError(f"inputs: '{key}' has shape {list(shapes[key])}; the {layout.kind} {layout.order} "
                             f"cache of this call is {list(want)}")


def _check_manifest(manifest: MicrobatchManifest, call: MicrobatchManifest) -> None:
    """The caller's manifest must describe this cache: same requests' cache rows, T and C."""
    if len(manifest) != len(call):
        raise PlanError(f"manifest {manifest.digest[:12]} has {len(manifest)} requests, the cache metadata "
                        f"{len(call)}")
    for b, (m, c) in enumerate(zip(manifest.entries, call.entries)):
        for field, key in (("cache_row", "cache_batch_idx"), ("T", "kv_lens"), ("C", "q_lens")):
            if getattr(m, field) != getattr(c, field):
                raise PlanError(f"manifest {manifest.digest[:12]} is stale: request {m.request_id!r} (packed "
                                f"position {b}) has {field} = {getattr(m, field)}, the call has {key}[{b}] = "
                                f"{getattr(c, field)}")


def _targets(layout, T, C, rows) -> tuple[np.ndarray, ...]:
    """Storage coordinates of the packed new rows (request b's row i at position T_b + i)."""
    owner = np.repeat(np.arange(T.size), C)
    first = np.concatenate([[0], np.cumsum(C)])[:-1]
    t = T[owner] + np.arange(int(C.sum())) - first[owner]
    if layout.kind == lay.CONTIGUOUS:
        return rows[owner], t
    if layout.kind == lay.RAGGED:
        return (layout.indptr[owner] + t,)
    P = layout.page_size
    if layout.table == "dense":
        pages = layout.block_table[rows[owner], t // P]
    else:
        pages = layout.kv_indices[layout.kv_indptr[owner] + t // P]
    return pages.astype(np.int64), t % P


def _check_page_writes(layout, written: np.ndarray, C) -> None:
    """A page that receives new rows belongs to one request: it is in no other request's pages
    (prefix pages may be shared, read-only) and not twice in its own."""
    if not written.size:
        return
    pages, owners = [], []
    for b in range(layout.batch):
        mine = lay.pages_of(layout, b)
        pages.append(mine)
        owners.append(np.full(mine.size, b))
    pages, owners = np.concatenate(pages), np.concatenate(owners)
    ids, counts = np.unique(pages, return_counts=True)
    shared = set(ids[counts > 1].tolist()) & set(np.unique(written).tolist())
    if shared:
        page = min(shared)
        who = sorted(set(owners[pages == page].tolist()))
        writer = int(np.repeat(np.arange(len(C)), C)[np.flatnonzero(written == page)[0]])
        where = "request " + " and ".join(str(b) for b in who) if len(who) > 1 else f"request {who[0]} twice"
        raise PlanError(f"append: page {page} receives request {writer}'s new rows but is listed by {where}: "
                        "a page an append writes must belong to one request")


@dataclass(frozen=True, eq=False)
class AppendPlan:
    """An append planned once (``Attention.plan_append``): the backend's split plan of the
    post-commit view, bound to the spec, the backend, the manifest and the view's metadata.
    A call with another manifest or other metadata is refused (§0x08H)."""

    program_digest: str
    backend: str
    manifest: MicrobatchManifest
    view_digest: str
    inner: object
    call: AppendCall | None = None      # the validated call, reused by calls with the same key
    validation_key: str | None = None   # (validation_key of the planned call)

    def check(self, program: ir.Program, backend: str, call: AppendCall) -> None:
        if ir.digest(program) != self.program_digest:
            raise PlanError("the append plan was made for a different spec")
        if backend != self.backend:
            raise PlanError(f"the append plan was made for backend {self.backend}, the call runs {backend}")
        self.manifest.check_same(call.manifest, "append plan")
        if call.view_digest != self.view_digest:
            raise PlanError("the append plan was made for other cache metadata (page table, regions or lengths) "
                            "than the call's; plan it again")
