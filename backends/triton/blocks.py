"""One block of a larger contiguous call on the Triton kernels (context parallelism).

``attnc.distributed`` cuts a call into blocks -- a segment of query tiles against a run of key
tiles, both at their absolute positions in the whole sequence -- and merges the blocks' partial
(O, LSE) states.  ``compiler.cp`` classifies the whole call's tiles once (``CPPlan.classes``, on
its own tile size); a block's plan is the rectangle of those classes regridded to the kernel's
tiles (:func:`regrid`: a kernel tile is FULL where every plan tile it overlaps is, SKIP where
every one is, else PARTIAL), so a block is never re-analysed.  The prefill kernel and the
backward kernels take the rectangle's first row and key positions (Q_OFF, K_OFF) and the whole
call's lengths (the spec's S_q and S_k); partial O and the gradients are written in float32, so
that merging and summing blocks rounds once, at the end.

A block's launches are kept on its ``block_args`` dict (the CP plan caches one per block), under
``"_triton"``: the second call of a training step or of a repeated shape plans nothing.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP, TilePlan
from attnc.compiler.errors import InputError
from attnc.compiler.plan import Plan

from . import choice, device
from . import grad as G
from . import launch as L


def regrid(classes: np.ndarray, block: int, length: int, tile: int, axis: int) -> np.ndarray:
    """Tile classes on ``block``-token tiles along ``axis`` (covering ``length`` tokens), on
    ``tile``-token tiles instead: FULL where every overlapped tile is FULL, SKIP where every one
    is SKIP, else PARTIAL (the kernel then applies the predicate, which is always exact)."""
    if block == tile:
        return classes
    out = []
    for t in range(-(-length // tile)):
        lo, hi = t * tile // block, -(-min((t + 1) * tile, length) // block)
        part = np.take(classes, np.arange(lo, hi), axis=axis)
        full = (part == FULL).all(axis=axis)
        some = (part != SKIP).any(axis=axis)
        out.append(np.where(full, FULL, np.where(some, PARTIAL, SKIP)))
    shape = list(classes.shape)
    shape[axis] = 0
    return np.stack(out, axis=axis).astype(classes.dtype) if out else np.zeros(shape, classes.dtype)


def block_plan(digest: str, args: dict, batch: int, rows: int, keys: int, block_m: int, block_n: int) -> Plan:
    """The plan of one block on (block_m, block_n) tiles from its rectangle of the CP plan's
    classes (``args["classes"]`` on ``args["block_m"] x args["block_n"]`` tiles)."""
    c = regrid(args["classes"], args["block_m"], rows, block_m, 2)
    c = regrid(c, args["block_n"], keys, block_n, 3)
    return Plan(digest, batch, rows, keys, None, TilePlan.from_classes(np.ascontiguousarray(c), block_m, block_n,
                                                                       "cp"), mask_from_intervals=False)


def _tensor_args(kernel, cache: dict, tensors: dict, batch: int, lengths: tuple[int, int], device) -> tuple:
    """TS of a block: the whole call's tensors and, where the spec reads them, its lengths (made
    once per block and device, kept in the block's cache)."""
    lens = None
    if kernel.module.LENGTHS:
        key = ("lengths", batch, tuple(lengths), str(device))
        lens = cache.get(key)
        if lens is None:
            lens = cache[key] = L.uniform_lengths(batch, lengths[0], lengths[1], device)
    return L.tensor_args(kernel.module, tensors, lens)


def _check(kernel, q, k, v, args: dict) -> tuple[int, int, int]:
    p = kernel.program
    want = ((p.heads_q, p.d_qk), (p.heads_kv, p.d_qk), (p.heads_kv, p.d_v))
    for n, t, (h, d) in zip("qkv", (q, k, v), want):
        if t.dim() != 4 or t.shape[1] != h or t.shape[3] != d or t.shape[0] != q.shape[0]:
            raise InputError(f"block: '{n}' has shape {list(t.shape)}; a block takes bhsd [B, {h}, tokens, {d}]")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"block: k has {k.shape[2]} keys, v {v.shape[2]}")
    for n in ("classes", "q_offset", "k_offset", "block_m", "block_n"):
        if n not in args:
            raise InputError(f"block: the block's arguments lack '{n}' (CPPlan.block_args gives them)")
    return q.shape[0], q.shape[2], k.shape[2]


def forward(kernel, q, k, v, args: dict, tensors: dict, lengths: tuple[int, int]):
    """Partial (O float32 [B, H_q, rows, d_v], LSE [B, H_q, rows]) of one block: bhsd q, k, v in
    the spec's storage dtype, the whole call's tensors (as the kernels read them, on q's device:
    ``decode.device_tensor``) and lengths (S_q, S_k)."""
    import torch
    batch, rows, keys = _check(kernel, q, k, v, args)
    if kernel.emulates(q.dtype):
        q, k, v = (x.float() for x in (q, k, v))
    cache = args.setdefault("_triton", {})
    key = ("forward", q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, str(q.device))
    launch = cache.get(key)
    if launch is None:
        def plan_for(bm, bn):
            return block_plan(kernel.digest, args, batch, rows, keys, bm, bn)
        contiguous = all(x.is_contiguous() for x in (q, k, v))
        config, plan = choice.choose_prefill(kernel.program, rows, keys, plan_for, asked={"engine": "triton"},
                                             tuned=None, contiguous=contiguous,
                                             device_capability=device.capability(q.device))
        launch = L.PrefillLaunch(kernel.module, config, kernel.device_plan(plan, q.device), (batch, rows, keys),
                                 q.device, offsets=(args["q_offset"], args["k_offset"]))
        cache[key] = launch
    ts = _tensor_args(kernel, cache, tensors, batch, lengths, q.device)
    out = torch.empty((batch, kernel.program.heads_q, rows, kernel.program.d_v), device=q.device,
                      dtype=torch.float32)
    lse = torch.empty((batch, kernel.program.heads_q, rows), device=q.device, dtype=torch.float32)
    kernel._run_launch(launch, q, k, v, ts, out, lse, None)
    return out, lse


def backward(kernel, q, k, v, o, lse, do, dlse, args: dict, tensors: dict, lengths: tuple[int, int]):
    """Partial (dQ, dK, dV) in float32 of one block: bhsd q, k, v as for :func:`forward`, and the
    rows' final O, LSE (the merged ones: the block's P is exp(S - LSE)), dO and dLSE (or None)."""
    import torch
    batch, rows, keys = _check(kernel, q, k, v, args)
    p = kernel.program
    for n, t, shape in (("o", o, (batch, p.heads_q, rows, p.d_v)), ("do", do, (batch, p.heads_q, rows, p.d_v)),
                        ("lse", lse, (batch, p.heads_q, rows))):
        if tuple(t.shape) != shape:
            raise InputError(f"block backward: '{n}' has shape {list(t.shape)}; the block's is {list(shape)}")
    store = torch.float32 if kernel.emulates(q.dtype) else q.dtype
    q, k, v = (x.to(store) for x in (q, k, v))
    do = do.to(store)  # (the kernels' dO.V^T and P^T.dO run in the storage dtype)
    cfg = G.default_backward_config(p.d_qk, p.d_v, device.interpreted(), p.dtype == "f32")
    cache = args.setdefault("_triton", {})
    key = ("backward", q.shape, k.shape, cfg, str(q.device))
    launch = cache.get(key)
    if launch is None:
        (bm1, bn1), (bm2, bn2) = cfg.tiles()
        dq_plan = block_plan(kernel.digest, args, batch, rows, keys, bm2, bn2)
        dkdv_plan = block_plan(kernel.digest, args, batch, rows, keys, bm1, bn1)
        launch = G.BackwardLaunch(kernel.module, cfg, dkdv_plan, dq_plan, (batch, rows, keys), q.device,
                                  offsets=(args["q_offset"], args["k_offset"]))
        cache[key] = launch
    dq, dk, dv = (torch.empty(x.shape, device=x.device, dtype=torch.float32) for x in (q, k, v))
    ts = _tensor_args(kernel, cache, tensors, batch, lengths, q.device)
    launch(q, k, v, o, lse.float().contiguous(), do, None if dlse is None else dlse.float().contiguous(), ts,
           dq, dk, dv, None)
    return dq, dk, dv
