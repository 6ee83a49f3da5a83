"""Split calls on the host: the plan a split-K/V launch reads (decode, append, mixed batches
over any cache layout), and its arrays on the device.

``decode_plan`` validates the cache through the layout analysis (``layout.quick_layout``'s few
reductions for the common layouts, ``from_inputs`` for the rest and for every contract break),
cuts every request's query rows into tiles of ``block_q`` rows, takes the launch (the engine,
the split slots, tiles, warps, stages) from ``split_choice.choose`` -- the caller's options,
the spec's split policy, `attnc tune`'s winner, else the untuned rule of
:func:`default_decode_config`, the decision `attnc plan` reports --, lists every (tile, split)'s K/V blocks
(``compiler.plan.split_blocks``: from the rows' cached key runs where it can, see
``compiler.analysis.decode_rows``) and records what the generated ``decode`` launcher needs:
cache kind, strides, per-request bases, page table.  A decode plan for 64 requests is some tens
of microseconds of host time (``bench/plan_decode_cost.py``).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from attnc.compiler import inputs, ir, sinks
from attnc.compiler.analysis import layout as kvl
from attnc.compiler.analysis.decode_rows import constant
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.analysis import splits as policies
from attnc.compiler.plan import DEFAULT_SMS, split_blocks

from . import device, split_choice
from .device import interpreted


KV_KEYS = ("k", "v", "k_cache", "v_cache")


def decode_plan(program, arrays: dict, *, block_n: int | None = None, splits: int | None = None,
                num_sms: int | None = None, tensors: dict | None = None, block_q: int | None = None,
                total_q: int | None = None, engine: str | None = None) -> dict:
    """The split-K/V plan for a call given by DESIGN §5's cache keys (numpy or torch
    metadata; K/V arrays are only measured), with optional ``q_lens`` / ``qo_indptr`` (default:
    one query row per request, decode), ``total_q`` (q's packed rows, when known) and the spec's
    declared tensors by name among the arrays (or apart in ``tensors``, as before): validates
    the cache (page ids, lengths, indptr...) through the layout analysis and the query rows
    as ``compiler.inputs.validate_cache`` does, cuts every request's rows into query tiles of
    ``block_q`` rows, then lists every (tile, split)'s blocks (``compiler.plan.split_blocks``, the
    checked half of ``decode_blocks``).
    Options left out are ``split_choice.choose``'s (`attnc tune`'s winner for the call, else
    :func:`default_decode_config`'s rule on the SMs of the cache's device, or ``num_sms``); the
    plan records the launch's ``num_warps`` / ``num_stages``.
    ``engine``: "split" (the split producer and combine), "gluon" (the Gluon engine over the
    cache, one launch; refused with the reason where it cannot run) or None: the engine where an
    untuned, unconstrained call's rows fill its tiles (``split_choice.choose``), else the split."""
    if engine not in (None, "split", "gluon"):
        raise ValueError(f"engine must be None, 'split' or 'gluon', not {engine!r}")
    if engine == "gluon" and (block_n is not None or splits is not None or block_q is not None):
        raise ValueError("engine='gluon': block_n, splits and block_q are the split producer's options (the "
                         "engine takes 128-row tiles of one request, unsplit)")
    p = program
    arrays, tensors = _split_tensors(p, arrays, tensors) if (p.tensors or tensors) else (arrays, {})
    meta = {n: (a if n in KV_KEYS else _to_numpy(a)) for n, a in arrays.items()}
    lay = kvl.quick_layout(p.cache, meta, heads_q=p.heads_q, heads_kv=p.heads_kv)
    if lay is None:  # something the quick checks do not cover, or a contract break: the full checks say which
        meta = {n: (_shape_only(a) if n in KV_KEYS else a) for n, a in meta.items()}
        lay = kvl.from_inputs(p.cache, meta, heads_q=p.heads_q, heads_kv=p.heads_kv, copy=False)
        kvl.check_arrays(lay, meta)
    if (lay.d_qk, lay.d_v) != (p.d_qk, p.d_v):
        raise InputError(f"inputs: the cache has head_dim {lay.d_qk}/{lay.d_v}; spec '{p.name}' "
                         f"declares {p.d_qk}/{p.d_v}")
    kv_lens = lay.kv_lens  # int64, read-only
    batch = kv_lens.size
    if p.sink is not None and all(n in tensors for n in ir.loads(p.sink)):  # the kernels clamp their reads:
        sinks.check_reads(p, batch, {n: np.shape(tensors[n]) for n in ir.loads(p.sink)})  # refuse one outside
    longest = int(kv_lens.max()) if batch else 0
    q_lens, qo_indptr = _query_rows(meta, batch, total_q)
    one_row = q_lens is None  # decode: one row per request (q_lens and qo_indptr not given)
    if one_row:
        q_lens = constant("ones", batch)
    # a request with no keys may have query rows (they see nothing); else kv_len >= q_len
    empty = bool(batch and kv_lens.min() < 1)
    if not one_row and batch and ((kv_lens < q_lens) & (kv_lens > 0)).any():
        raise inputs.short_request(int(np.flatnonzero((kv_lens < q_lens) & (kv_lens > 0))[0]), q_lens, kv_lens)
    one_row = one_row or bool((q_lens == 1).all())
    k_key = "k_cache" if lay.kind == "paged" else "k"
    v_key = "v_cache" if lay.kind == "paged" else "v"
    # the engine, the slots, the tiles: split_choice.choose, the one decision `attnc plan` reports
    facts = device.facts(getattr(arrays[k_key], "device", None))
    if num_sms is not None:
        facts = replace(facts, num_sms=num_sms)
    launch = split_choice.choose(p, kv_lens, q_lens, facts, one_row=one_row, cache=(arrays[k_key], arrays[v_key]),
                                 asked={"engine": engine, "splits": splits, "block_n": block_n, "block_q": block_q})
    if launch.refusal:
        raise PlanError(launch.refusal)
    engine = None if launch.engine == "split" else launch.engine
    block_n, block_q, splits, bounds = launch.block_n, launch.block_q, launch.splits, launch.bounds
    if block_n < GPU_MIN_TILE:
        _check_gpu_tile(None, block_n, facts.interpreter)
    blocks = split_blocks(p, kv_lens, tensors, block_n, splits, None if one_row else q_lens, block_q,
                          longest=longest, nonempty=one_row and not empty, bounds=bounds)
    k_str, v_str = cache_strides(lay.kind, lay.order, arrays[k_key], arrays[v_key])
    rows = (np.asarray(lay.cache_batch_idx, np.int64) if lay.cache_batch_idx is not None
            else constant("arange", batch))  # the cache row of each request
    if lay.kind == "paged":
        if lay.table == "csr":  # (copies: the plan keeps the call's pages, not the caller's arrays)
            cache, table, base, tstride = 2, np.array(lay.kv_indices), lay.kv_indptr[:-1], 0
        else:  # the table's rows in request order (cache_batch_idx gathered here, not in the kernel)
            table = (np.array(lay.block_table[:batch]) if lay.cache_batch_idx is None
                     else np.ascontiguousarray(lay.block_table[rows]))
            cache, base, tstride = 1, constant("zeros", batch), table.shape[1]
        page_size = lay.page_size
    else:
        if lay.kind == "ragged":
            base = lay.indptr[:-1]
        else:  # request b starts cache_row(b) * (batch stride / token stride) token rows in
            base = rows * _rows_per_batch(lay.order, arrays[k_key])
        cache, table, tstride, page_size = 0, np.zeros(1), 0, 1
    return {"cache": cache, "page_size": int(page_size), "k_strides": k_str, "v_strides": v_str,
            "kv_lens": kv_lens, "q_lens": q_lens, "qo_indptr": qo_indptr, "total_q": int(qo_indptr[-1]),
            "cache_rows": rows, "base": base, "table": table, "table_stride": int(tstride),
            "tiles": blocks.tiles, "tile_req": blocks.tile_req, "tile_row0": blocks.tile_row0,
            "block_q": int(block_q), "one_row": bool(one_row and block_q == 1),
            "entry_ptr": blocks.entry_ptr, "blocks": blocks.blocks,
            "partial": blocks.partial, "splits": blocks.splits, "block_n": block_n,
            "policy": bounds.policy if bounds is not None else f"{blocks.splits} balanced block shares",
            "bounded": bounds is not None,
            "split_bounds": blocks.split_bounds if bounds is not None else constant("zeros32", 2),
            "num_warps": launch.num_warps, "num_stages": launch.num_stages,
            "abi": p.state.value, "skipped_blocks": blocks.skipped, "engine": engine or "split",
            "kind": lay.kind, "order": lay.order, "position_end": longest,
            "jobs": engine_jobs(blocks.tile_req, np.diff(blocks.entry_ptr), p.heads_q, p.group) if engine
            else constant("zeros32", 1)}


def engine_jobs(tile_req: np.ndarray, counts: np.ndarray, heads_q: int, group: int) -> np.ndarray:
    """The Gluon engine's jobs over a cache, tile * H_q + h, in launch order: request by
    request, K/V head by K/V head, the tiles longest first, each tile's GQA group of query heads
    together.  The jobs running at once then read one K/V head's blocks, which L2 keeps (all
    heads of a tile after one another, longest tiles first, measured 513 TFLOP/s against this
    order's 552 at B4 T8K C2K, page 16: its working set was several times L2), and the longest
    tiles of each head start first."""
    tiles = np.arange(len(counts))
    tile = np.repeat(tiles, heads_q)
    h = np.tile(np.arange(heads_q), len(counts))
    order = np.lexsort((h, -counts[tile], h // group, tile_req[tile]))
    return (tile[order] * heads_q + h[order]).astype(np.int32)


# ---------------------------------------------------------------- the untuned launch
# Programs a split launch aims for, per SM (see default_decode_config), and the most splits: the
# `split = auto` rule's, declared once in compiler/analysis/splits.py
MAX_SPLITS = policies.MAX_SPLITS
PROGRAMS_PER_SM = policies.PROGRAMS_PER_SM


def default_decode_config(program, kv_lens, q_lens, num_sms: int | None = None, *,
                          block_n: int | None = None, block_q: int | None = None) -> dict:
    """The untuned split launch (the plan's split count and tiles, the producer's warps and
    stages) for a call's lengths, from the H200 decode rows under ``bench/results/``
    (GQA 32/8, d = 128, bf16, paged page 16, 132 SMs; GPU time from CUDA-graph replays, or
    ``do_bench`` where the host kept up):

    * **splits**: about ``PROGRAMS_PER_SM`` = 4 programs per SM, counting a program per
      (query tile, K/V head, split): ``round(4 * num_sms / (tiles * H_kv))``, at least 1, at
      most the longest request's blocks and ``MAX_SPLITS``.  ``decode_h200_r28_graph.jsonl`` /
      ``decode_h200_r30_recheck.jsonl``: B=8 T=8K (64 tile-heads) 10 splits = 640 programs
      84.3-84.9 µs against 5 splits (the old rule, two waves) 96.6-96.9 µs and 2 splits 167 µs;
      B=32 T=8K (256) 2 splits = 512 programs 260.7-264 µs against 4 splits 282.8-286 µs and
      1 split 380 µs; B=1 T=128K (8) 66 splits = 528 programs 141.8-144.3 µs against 33 splits
      194-197 µs (``decode_h200_r10_evidence.jsonl``: 142.0 against 194.3).  The rule gives 8,
      2 and 66 there (8 splits at B=8 was not measured: 512 programs, between the measured 5
      and 10); B=64 T=2K (512 tile-heads, no recorded row) gets 1 split, 512 programs of 32
      blocks, like B=32's best (512 programs of 64 blocks).
    * **block_n** 64: 128 loses or ties wherever both ran — B=32 (2 splits) 314.5 against
      260.7 µs, B=1 (33 splits) 146-149 against 66 splits of 64 at 142-144, B=8 (5 splits)
      83.3-87.1 against 10 splits of 64 at 84.3-84.9 (r28, r30).
    * **num_warps** 4, **num_stages** 2: every recorded best ran them; 3 stages tie or lose
      at the same splits (B=32 266.0 against 260.7 µs, B=8 96.1 against 96.9) except B=1 with
      33 splits (175.6 against 194.4), which the 66-split launch beats at 2 stages.
    * **block_q**: ``splits.auto_block_q`` (1 for decode; enough rows to fill a 16-row dot for
      several rows per request, 64 on a GPU).

    ``block_n`` / ``block_q`` given: the split count follows them.  ``num_sms`` defaults to
    ``compiler.plan.DEFAULT_SMS``."""
    kv_lens = np.asarray(kv_lens, np.int64)
    q_lens = np.asarray(q_lens, np.int64)
    facts = device.DeviceFacts(interpreter=interpreted(), capability=0, num_sms=num_sms or DEFAULT_SMS, gluon=False)
    c = split_choice.choose(program, kv_lens, q_lens, facts, one_row=bool(q_lens.size and (q_lens == 1).all()),
                            asked={"engine": "split", "block_n": block_n, "block_q": block_q}, tuned={})
    return {"block_n": c.block_n, "splits": c.splits, "num_warps": c.num_warps, "num_stages": c.num_stages,
            "block_q": c.block_q}


def _split_tensors(program, arrays: dict, tensors: dict | None) -> tuple[dict, dict]:
    """(cache arrays, the mask's tensors as numpy): declared tensors are taken out of ``arrays``
    by name and joined with ``tensors``; one the mask reads must be given, once."""
    names = _declared(program)
    given = dict(tensors or {})
    if names[0] and any(n in arrays for n in names[0]):
        arrays = dict(arrays)
        for n in names[0]:
            if n in arrays:
                if n in given:
                    raise InputError(f"inputs: tensor '{n}' is given twice (in the arrays and in tensors=)")
                given[n] = arrays.pop(n)
    missing = [n for n in names[1] if n not in given]
    if missing:
        raise InputError(f"inputs: missing key '{missing[0]}' (a tensor the mask of spec '{program.name}' reads)")
    given = {n: _to_numpy(t) for n, t in given.items()}
    for t in program.tensors:
        if t.dtype is ir.I32 and t.name in given:
            inputs.check_i32_values(t.name, given[t.name])
    return arrays, given


_DECLARED: dict = {}


def _declared(program) -> tuple[frozenset, tuple]:
    """(declared tensor names, the names the mask reads, sorted), remembered per program object."""
    hit = _DECLARED.get(id(program))
    if hit is None or hit[0] is not program:
        if len(_DECLARED) > 256:
            _DECLARED.clear()
        hit = _DECLARED[id(program)] = (program, (frozenset(t.name for t in program.tensors),
                                                  tuple(sorted(ir.loads(program.mask)))))
    return hit[1]


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
                 "entry_ptr": "int32", "base": "int64", "blocks": "int32", "partial": "int8", "table": "int32",
                 "split_bounds": "int32"}


def device_tensor(t, device, name: str = "?"):
    """A declared tensor (numpy or torch) as the kernels read it: integers as int32 (values outside
    i32 refused: ``inputs.check_i32_values``), on ``device``."""
    import torch
    a = _to_numpy(t)
    if a.dtype.kind in "iu":
        inputs.check_i32_values(name, a)
        a = a.astype(np.int32)
    return torch.as_tensor(np.ascontiguousarray(a)).to(device)


GPU_MIN_TILE = 16  # tl.dot on a GPU multiplies at least 16 x 16 x 16; the interpreter takes any size


def _check_gpu_tile(block_m: int | None, block_n: int, interpreter: bool | None = None) -> None:
    """Refuse, before any compile, tiles a GPU's tl.dot cannot take (the interpreter can);
    ``interpreter``: the call's device facts' word (None: this process's TRITON_INTERPRET)."""
    if interpreted() if interpreter is None else interpreter:
        return
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v is not None and v < GPU_MIN_TILE:
            raise PlanError(f"{name} = {v}: on a GPU a tile needs at least {GPU_MIN_TILE} rows and keys "
                            f"(tl.dot's smallest shape); smaller tiles run only under TRITON_INTERPRET=1")


def _query_rows(meta: dict, batch: int, total_q: int | None) -> tuple[np.ndarray | None, np.ndarray]:
    """(q_lens, qo_indptr) of a split call (q_lens None: one row per request, no key names
    them), checked as ``compiler.inputs.validate_cache`` does:
    q_lens / qo_indptr agree with each other and with q's packed rows, and no request has more
    query rows than keys (an InputError naming the request)."""
    rows = {n: meta[n] for n in ("q_lens", "qo_indptr") if n in meta}
    if not rows and total_q in (None, batch):  # decode: one row per request (q_lens None: all ones)
        return None, constant("arange", batch + 1)
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
    return _cache_strides(kind, order, _strides(k), _strides(v))


@functools.lru_cache(maxsize=256)
def _cache_strides(kind: str, order: str, k_st: tuple, v_st: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out = []
    for st in (k_st, v_st):
        if kind == "paged":
            out.append(tuple(st[i] for i in {"nhd": (0, 1, 2, 3), "hnd": (0, 2, 1, 3)}[order]))
        elif kind == "ragged":  # [total, H_kv, d]
            out.append((0, st[0], st[1], st[2]))
        else:
            t_ax, h_ax = (2, 1) if order == "bhsd" else (1, 2)
            if st[0] % st[t_ax]:
                raise PlanError("contiguous K/V: the batch stride must be a multiple of the token stride")
            out.append((0, st[t_ax], st[h_ax], st[3]))
    if kind == "contiguous" and k_st[0] * out[1][1] != v_st[0] * out[0][1]:
        raise PlanError("contiguous K and V must have the same batch/token stride ratio")
    return out[0], out[1]


def _to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    return a.numpy(force=True) if hasattr(a, "detach") else np.asarray(a)


def _shape_only(a):
    """A zero-cost stand-in with the array's shape and dtype (validation reads only those)."""
    if hasattr(a, "detach"):
        return _stand_in(tuple(a.shape), {1: "int8", 2: "float16", 4: "float32", 8: "float64"}[a.dtype.itemsize])
    return _stand_in(tuple(np.shape(a)), np.asarray(a).dtype.str)


@functools.lru_cache(maxsize=64)
def _stand_in(shape: tuple, dtype: str):
    return np.broadcast_to(np.zeros((), dtype), shape)


def _strides(a) -> tuple[int, ...]:
    if hasattr(a, "stride") and callable(a.stride):
        return tuple(a.stride())
    a = np.asarray(a)
    return tuple(s // a.itemsize for s in a.strides)
