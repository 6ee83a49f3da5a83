"""Split calls on the host: the plan a split-K/V launch reads (decode, append, mixed batches
over any cache layout), and its arrays on the device.

``decode_plan`` validates the cache through the layout analysis, cuts every request's query
rows into tiles of ``block_q`` rows, chooses the split count, lists every (tile, split)'s K/V
blocks (``compiler.plan.decode_blocks``) and records what the generated ``decode`` launcher
needs: cache kind, strides, per-request bases, page table.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler import inputs, tune
from attnc.compiler.analysis import layout as kvl
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.plan import decode_blocks


def interpreted() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def decode_plan(program, arrays: dict, *, block_n: int = 64, splits: int | None = None,
                num_sms: int | None = None, tensors: dict | None = None, block_q: int | None = None,
                total_q: int | None = None) -> dict:
    """The split-K/V plan for a call given by DESIGN §5's cache keys (numpy or torch
    metadata; K/V arrays are only measured), with optional ``q_lens`` / ``qo_indptr`` (default:
    one query row per request, decode) and ``total_q`` (q's packed rows, when known): validates
    the cache (page ids, lengths, indptr...) through the layout analysis and the query rows
    as ``compiler.inputs.validate_cache`` does, cuts every request's rows into query tiles of
    ``block_q`` rows, then lists every (tile, split)'s blocks."""
    p = program
    meta = {n: (_shape_only(a) if n in ("k", "v", "k_cache", "v_cache") else _to_numpy(a))
            for n, a in arrays.items()}
    lay = kvl.from_inputs(p.cache, meta, heads_q=p.heads_q, heads_kv=p.heads_kv)
    kvl.check_arrays(lay, meta)
    if (lay.d_qk, lay.d_v) != (p.d_qk, p.d_v):
        raise InputError(f"inputs: the cache has head_dim {lay.d_qk}/{lay.d_v}; spec '{p.name}' "
                         f"declares {p.d_qk}/{p.d_v}")
    kv_lens = np.asarray(lay.kv_lens, np.int64)
    batch = len(kv_lens)
    q_lens, qo_indptr = _query_rows(meta, batch, total_q)
    short = np.flatnonzero(kv_lens < q_lens)
    if len(short):  # compiler.inputs.validate_cache's words
        b = int(short[0])
        raise InputError(f"inputs: request {b} has q_lens[{b}] = {int(q_lens[b])} query rows but only "
                         f"kv_len = {int(kv_lens[b])} keys; a query row is a token whose own key is "
                         "in the cache, so kv_len >= q_len (a request with no keys has no query rows)")
    one_row = bool(np.all(q_lens == 1))
    if splits is None:  # `attnc tune`'s winner for this dispatch key, if the cache has it
        s_q = 1 if one_row else [int(x) for x in q_lens]
        tuned = tune.tuned_tiles(p, batch, s_q, [int(x) for x in kv_lens], "triton") or {}
        splits, block_n = tuned.get("splits"), tuned.get("BLOCK_N", block_n)
        block_q = block_q if block_q is not None else tuned.get("BLOCK_Q")
    if block_q is None:
        block_q = default_block_q(p.group, q_lens, interpreted())
    if block_q < 1 or block_q & (block_q - 1):
        raise PlanError(f"block_q = {block_q} must be a positive power of two")
    _check_gpu_tile(None, block_n)
    n_tiles = int((-(-q_lens // block_q)).sum())
    if splits is None:  # the heuristic: enough programs for two waves, never more splits than blocks
        most = int(-(-kv_lens.max(initial=1) // block_n))
        splits = int(np.clip(-(-2 * (num_sms or 132) // max(n_tiles * p.heads_kv, 1)), 1, min(most, 64)))
    tensors = {n: _to_numpy(t) for n, t in (tensors or {}).items()}
    blocks = decode_blocks(p, kv_lens, {n: t.astype(np.int64) if t.dtype.kind in "iu" else t
                                        for n, t in tensors.items()}, block_n, splits, q_lens, block_q)
    k_key = "k_cache" if lay.kind == "paged" else "k"
    v_key = "v_cache" if lay.kind == "paged" else "v"
    k_str, v_str = cache_strides(lay.kind, lay.order, arrays[k_key], arrays[v_key])
    rows = (np.asarray(lay.cache_batch_idx, np.int64) if lay.cache_batch_idx is not None
            else np.arange(batch, dtype=np.int64))  # the cache row of each request
    if lay.kind == "paged":
        if lay.table == "csr":
            cache, table, base, tstride = 2, lay.kv_indices, lay.kv_indptr[:-1], 0
        else:  # the table's rows in request order (cache_batch_idx gathered here, not in the kernel)
            cache, table, base = 1, np.ascontiguousarray(lay.block_table[rows]), np.zeros(batch)
            tstride = table.shape[1]
        page_size = lay.page_size
    else:
        if lay.kind == "ragged":
            base = lay.indptr[:-1]
        else:  # request b starts cache_row(b) * (batch stride / token stride) token rows in
            base = rows * _rows_per_batch(lay.order, arrays[k_key])
        cache, table, tstride, page_size = 0, np.zeros(1), 0, 1
    return {"cache": cache, "page_size": int(page_size), "k_strides": k_str, "v_strides": v_str,
            "kv_lens": kv_lens, "q_lens": q_lens, "qo_indptr": qo_indptr, "total_q": int(qo_indptr[-1]),
            "cache_rows": rows, "base": np.asarray(base, np.int64), "table": np.asarray(table),
            "table_stride": int(tstride),
            "tiles": blocks.tiles, "tile_req": blocks.tile_req, "tile_row0": blocks.tile_row0,
            "block_q": int(block_q), "one_row": bool(one_row and block_q == 1),
            "entry_ptr": blocks.entry_ptr, "blocks": blocks.blocks,
            "partial": blocks.partial, "splits": blocks.splits, "block_n": block_n,
            "abi": program.state.value, "skipped_blocks": blocks.skipped}


def decode_args(plan: dict, device) -> dict:
    """A decode plan with its arrays as torch tensors on ``device``: what the generated
    ``decode`` launcher reads (upload once, launch many times)."""
    import torch

    def up(a, dtype):
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.array(a, copy=True, order="C"))
        return t.to(device=device, dtype=dtype).contiguous()

    return {**plan, **{n: up(plan[n], getattr(torch, dt)) for n, dt in DECODE_ARRAYS.items()}}


# the decode plan's arrays the generated ``decode`` launcher reads, with their device dtypes
DECODE_ARRAYS = {"kv_lens": "int32", "qo_indptr": "int32", "tile_req": "int32", "tile_row0": "int32",
                 "entry_ptr": "int32", "base": "int64", "blocks": "int32", "partial": "int8", "table": "int32"}


def device_tensor(t, device):
    """A declared tensor (numpy or torch) as the kernels read it: integers as int32, on ``device``."""
    import torch
    a = _to_numpy(t)
    a = a.astype(np.int32) if a.dtype.kind in "iu" else a
    return torch.as_tensor(np.ascontiguousarray(a)).to(device)


GPU_MIN_TILE = 16  # tl.dot on a GPU multiplies at least 16 x 16 x 16; the interpreter takes any size


def _check_gpu_tile(block_m: int | None, block_n: int) -> None:
    """Refuse, before any compile, tiles a GPU's tl.dot cannot take (the interpreter can)."""
    if interpreted():
        return
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v is not None and v < GPU_MIN_TILE:
            raise PlanError(f"{name} = {v}: on a GPU a tile needs at least {GPU_MIN_TILE} rows and keys "
                            f"(tl.dot's smallest shape); smaller tiles run only under TRITON_INTERPRET=1")


def default_block_q(group: int, q_lens, interpreter: bool = False) -> int:
    """Query rows per tile of a split call: 1 when every request has one row (decode: the tile
    is the request); else enough rows that a tile of rows x the G heads of a K/V head fills a
    16-row dot (64 rows on a GPU, so each K/V block serves more queries), never more than the
    longest request needs."""
    q_lens = np.asarray(q_lens, np.int64)
    if q_lens.size and np.all(q_lens == 1):
        return 1
    g_pad = 1 << max(int(group) - 1, 0).bit_length()
    target = 16 if interpreter else 64
    longest = 1 << max(int(q_lens.max(initial=1)) - 1, 0).bit_length()
    return max(16 // g_pad, 1, min(target // g_pad, longest))


def _query_rows(meta: dict, batch: int, total_q: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(q_lens, qo_indptr) of a split call, checked as ``compiler.inputs.validate_cache`` does:
    q_lens / qo_indptr agree with each other and with q's packed rows, and no request has more
    query rows than keys (an InputError naming the request)."""
    rows = {n: meta[n] for n in ("q_lens", "qo_indptr") if n in meta}
    if total_q is None:  # q is not at hand: the metadata says how many rows it packs
        if "qo_indptr" in rows and np.asarray(rows["qo_indptr"]).size:
            total_q = int(np.asarray(rows["qo_indptr"]).reshape(-1)[-1])
        elif "q_lens" in rows:
            total_q = int(np.asarray(rows["q_lens"]).sum())
        else:
            total_q = batch
    q_lens, qo_indptr = inputs.query_rows(rows, batch, total_q)
    return q_lens, qo_indptr


def _rows_per_batch(order: str, k) -> int:
    """Token rows between two cache rows of a contiguous K (its batch stride / token stride)."""
    st = _strides(k)
    return st[0] // st[2 if order == "bhsd" else 1]


def cache_strides(kind: str, order: str, k, v) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K and V element strides in the decode kernel's (page, token, head, dim) order."""
    out = []
    for a in (k, v):
        st = _strides(a)
        if kind == "paged":
            out.append(tuple(st[i] for i in {"nhd": (0, 1, 2, 3), "hnd": (0, 2, 1, 3)}[order]))
        elif kind == "ragged":  # [total, H_kv, d]
            out.append((0, st[0], st[1], st[2]))
        else:
            t_ax, h_ax = (2, 1) if order == "bhsd" else (1, 2)
            if st[0] % st[t_ax]:
                raise PlanError("contiguous K/V: the batch stride must be a multiple of the token stride")
            out.append((0, st[t_ax], st[h_ax], st[3]))
    if kind == "contiguous" and _strides(k)[0] * out[1][1] != _strides(v)[0] * out[0][1]:
        raise PlanError("contiguous K and V must have the same batch/token stride ratio")
    return out[0], out[1]


def _to_numpy(a):
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def _shape_only(a):
    """A zero-cost stand-in with the array's shape and dtype (validation reads only those)."""
    if hasattr(a, "detach"):
        import torch
        itemsize = torch.empty((), dtype=a.dtype).element_size()
        return np.broadcast_to(np.zeros((), {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}[itemsize]),
                               tuple(a.shape))
    return np.broadcast_to(np.zeros((), np.asarray(a).dtype), np.shape(a))


def _strides(a) -> tuple[int, ...]:
    if hasattr(a, "stride") and callable(a.stride):
        return tuple(a.stride())
    a = np.asarray(a)
    return tuple(s // a.itemsize for s in a.strides)
