"""The Triton kernel's split-K/V calls (decode, append, mixed batches) over any cache layout:
``run``, ``decode``, ``decode_graph`` and their plans; a mixin of ``runtime.Kernel``."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnc.compiler import inputs, ir
from attnc.compiler.errors import InputError

from . import device, split_choice, workspace
from . import launch as L
from . import plans as P
from .decode import DECODE_ARRAYS, KV_KEYS, _rows_per_batch, _to_numpy, cache_strides, decode_plan, device_tensor
from .device import interpreted
from .graph import DecodeGraph
from .shift import ShiftLaunch


class SplitCalls:
    def decode_plan(self, arrays: dict, **options) -> dict:
        """The split-K/V plan of a call (``backends.triton.decode.decode_plan``)."""
        return decode_plan(self.program, arrays, **options)

    @staticmethod
    def decode_args(plan: dict, device) -> dict:
        """A decode plan with its arrays on ``device`` in one copy (upload once, launch many times)."""
        host = {n: np.asarray(_to_numpy(plan[n])) for n in DECODE_ARRAYS}
        return {**plan, **P.upload(host, device, DECODE_ARRAYS)}

    def split_launch(self, num_warps: int = 4, num_stages: int = 2) -> L.SplitLaunch:
        key = (num_warps, num_stages)
        if key not in self._splits:
            if isinstance(self.program.state, ir.SharedShift):  # FlashDecoding++'s guarded shared frame
                self._splits[key] = ShiftLaunch(self.module, self.program.state, num_warps, num_stages)
            else:
                self._splits[key] = L.SplitLaunch(self.module, num_warps, num_stages)
        return self._splits[key]

    def cache_launch(self, plan: dict, device) -> L.CacheLaunch:
        """The Gluon engine's launch over this plan's cache shape (block, pages), made once."""
        key = ("cache", plan["block_n"], plan["cache"] != 0, plan["page_size"], str(device))
        if key not in self._splits:
            self._splits[key] = L.CacheLaunch(self.module, plan["block_n"], plan["cache"] != 0, plan["page_size"],
                                              device)
        return self._splits[key]

    def workspace(self, total_q: int, splits: int, device):
        """The split workspace (partial O, m, l, valid flags) in one allocation."""
        n = split_choice.launch_workspace_bytes(self.program, "split", total_q, splits, self._vector_bytes())
        return self._torch.empty(n, device=device, dtype=self._torch.uint8)

    def _vector_bytes(self) -> int:
        """The width of the workspace's vector field the split launch's views take."""
        return workspace.vector_torch_dtype(self.module, self.program.state.value).itemsize

    def split_tensors(self, arrays: dict) -> dict:
        """Pop the spec's declared tensors out of a split call's keyword arrays (all must be there)."""
        names = set(self._tensor_names)
        tensors = {n: arrays.pop(n) for n in list(arrays) if n in names}
        missing = names - set(tensors)
        if missing:
            raise InputError(f"inputs: missing key '{sorted(missing)[0]}'")
        return tensors

    def run(self, arrays: dict, *, return_lse=False, cuda_graph=False, **options):
        """A split call given by DESIGN §5's keys (what `attnc run` reads from an npz): packed
        q [total_q, H_q, d_qk] with ``q_lens`` / ``qo_indptr`` (default: one query row per
        request, decode) over any cache; returns packed o [total_q, H_q, d_v] (and
        lse [total_q, H_q]).  ``cuda_graph``: capture the call (``decode_graph``) and replay it."""
        arrays = dict(arrays)
        if "q" not in arrays:
            raise InputError("inputs: missing key 'q'")
        required, optional = inputs.cache_keys(self.program)
        unknown = sorted(set(arrays) - {*required, *optional, *self._tensor_names})
        if unknown:
            raise InputError(f"inputs: unknown key '{unknown[0]}' for a {inputs.cache_description(self.program)} "
                             f"(expected keys: {', '.join(sorted([*required, *self._tensor_names]))}; optional: "
                             f"{', '.join(optional)})")
        q = arrays.pop("q")
        if cuda_graph:
            return self._run_graph(q, arrays, return_lse, options)
        return self.decode(q, return_lse=return_lse, **arrays, **options)

    def _run_graph(self, q, arrays: dict, return_lse: bool, options: dict):
        """``run`` through a captured graph: host arrays go to the GPU in the spec's dtype (the
        cache the graph reads, the query rows it copies in), metadata stays on the host."""
        torch = self._torch

        def dev(a):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a, np.float32))
            return t.to(self.device, self._dtype)
        kv = {n: dev(a) for n, a in arrays.items() if n in ("k", "v", "k_cache", "v_cache")}
        meta = {n: a for n, a in arrays.items() if n not in kv}
        q_t = dev(q)
        graph = self.decode_graph(q_t, **kv, **meta, capture=True, **options)
        o, lse = graph(q_t)
        if isinstance(q, np.ndarray):
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o

    def decode_graph(self, q, *, max_kv_len: int | None = None, block_n: int | None = None,
                     splits: int | None = None, block_q: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, capture: bool | None = None, **arrays):
        """The split call ``decode(q, **arrays)`` captured as a CUDA graph over buffers it owns
        (``graph.DecodeGraph``): ``g.update(kv_lens=..., block_table=...)`` plans the next step,
        ``g(q)`` replays and returns (O, LSE)."""
        return DecodeGraph(self, q, max_kv_len=max_kv_len, block_n=block_n, splits=splits, block_q=block_q,
                           num_warps=num_warps, num_stages=num_stages, capture=capture, **arrays)

    def _bind_split(self, plan: dict, q, k_cache, v_cache, tensors: dict, num_warps, num_stages) -> "_Split":
        """A split call's plan bound to the K/V tensors it reads (their strides, a contiguous cache's
        row bases) and to q's rows and strides, uploaded to q's device in one copy, with its launch."""
        device = q.device
        p = self.program
        kind, order = p.cache.kind.value, p.cache.layout.value
        plan = dict(plan)
        plan["k_strides"], plan["v_strides"] = cache_strides(kind, order, k_cache, v_cache)
        if kind == "contiguous":
            plan["base"] = np.asarray(_to_numpy(plan["cache_rows"]), np.int64) * _rows_per_batch(order, k_cache)
        arrays = self.decode_args(plan, device)
        if plan.get("engine") == "gluon":  # the Gluon engine over the cache: one launch, no workspace
            if num_warps is not None or num_stages is not None:
                raise ValueError("num_warps and num_stages are the split producer's options; this plan runs on "
                                 "the Gluon engine (make it with engine='split' to set them)")
            launch = self.cache_launch(plan, device)
            arrays["jobs"] = self._torch.as_tensor(plan["jobs"]).to(device)
        else:
            launch = self.split_launch(num_warps or plan.get("num_warps", 4), num_stages or plan.get("num_stages", 2))
        # (none on the Gluon engine: split_choice's one account of what a split launch allocates)
        ws = split_choice.launch_workspace_bytes(p, plan.get("engine", "split"), plan["total_q"], plan["splits"],
                                                 self._vector_bytes())
        ts = L.tensor_args(self.module, {n: device_tensor(t, device, n) for n, t in tensors.items()},
                           (arrays["kv_lens"], arrays["qo_indptr"]))
        bound = getattr(launch, "bind", None) if q.shape[0] else None  # (SplitLaunch: its arguments fixed once)
        call = bound(q.shape[0], q.stride(), plan, arrays, ts) if bound is not None else None
        return _Split(plan, arrays, ts, launch, ws, call, (q.shape[0], q.stride()), {})

    def _launch_split(self, bound: "_Split", q, k_cache, v_cache, flag=None):
        """Allocate O, LSE and the workspace; launch the producer and the combine (the bound call
        where q has the rows and strides it was bound for).  Returns (O, LSE, whether the launch
        marked the non-finite ``flag``)."""
        torch = self._torch
        total_q = q.shape[0]
        out = q.new_empty((total_q, self.program.heads_q, self.program.d_v))  # (q's dtype and device)
        lse = q.new_empty((total_q, self.program.heads_q), dtype=torch.float32)
        ws = q.new_empty(bound.workspace_bytes, dtype=torch.uint8) if bound.workspace_bytes else None
        if bound.call is not None and bound.q_layout == (total_q, q.stride()):
            bound.call(q, k_cache, v_cache, out, lse, ws, flag)
        else:
            bound.launch(q, k_cache, v_cache, bound.plan, bound.arrays, bound.ts, out, lse, ws, flag)
        return out, lse, flag is not None and bound.launch.marks

    def prepare_decode(self, q, plan: dict, *, num_warps: int | None = None, num_stages: int | None = None,
                       **arrays):
        """A split call with its plan uploaded once: returns ``run()`` -> (O, LSE) (torch inputs on
        the kernel's device)."""
        tensors = self.split_tensors(arrays)
        k_cache, v_cache = arrays.get("k_cache", arrays.get("k")), arrays.get("v_cache", arrays.get("v"))
        bound = self._bind_split(plan, q, k_cache, v_cache, tensors, num_warps, num_stages)
        return lambda: self._launch_split(bound, q, k_cache, v_cache)[:2]

    # A split call's plan depends on its metadata (lengths, page tables, query rows, mask tensors);
    # a call whose inputs are all torch tensors is cached under their identity and version, as a
    # prefill call's mask tensors are: the layers of a model's decode step share one plan, and a
    # step that changes the metadata in place (kv_lens += 1) makes a new one.
    def _split_key(self, q, arrays: dict):
        parts, objects = [], []
        for n, t in arrays.items():  # (in the caller's order: each part names its input)
            part = _split_key_part(n, t)
            if part is None:
                return None, None
            parts.append(part)
            objects.append(None if n in KV_KEYS else t)
        return (self.digest, "split", q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
                tuple(parts)), objects

    def bind_decode(self, cache: dict):
        """The bound split call (``bound_decode.BoundDecode``) of calls with the signature of
        ``decode(q, **cache)``, which just ran: None where calls like it are not cached (an input
        the plan cache does not key on, an option)."""
        required, optional = inputs.cache_keys(self.program)
        if not set(cache) <= {*required, *optional, *self._tensor_names} - {"q"}:
            return None
        if any(not hasattr(t, "is_inference") or t.is_inference() for t in cache.values()):
            return None
        from .bound_decode import BoundDecode
        return BoundDecode(self, tuple(cache))

    def decode(self, q, *, plan: dict | None = None, return_lse=False, block_n: int | None = None,
               splits: int | None = None, block_q: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, engine: str | None = None, **arrays):
        """One split call: packed q [total_q, H_q, d_qk] (decode: [B, H_q, d_qk], the new token of
        every request), the cache by DESIGN §5's keys (k/v, k_cache/v_cache, block_table + kv_lens,
        kv_indptr + kv_indices + kv_last_page_len, kv_indptr for ragged, cache_batch_idx),
        optional ``q_lens`` / ``qo_indptr`` (request b's rows are q[qo_indptr[b]:qo_indptr[b+1]],
        at positions kv_lens[b] - q_lens[b] + i) and declared tensors by name.  Returns O
        [total_q, H_q, d_v] (and LSE [total_q, H_q]).  Appends whose rows fill 128-row tiles run
        on the Gluon engine over the cache on an H100/H200 (``decode.decode_plan``'s ``engine``:
        "split" or "gluon" forces one)."""
        torch = self._torch
        p = self.program
        from_numpy = isinstance(q, np.ndarray)
        cache_key = cache_objects = None
        if plan is None and block_n is None and splits is None and block_q is None and num_warps is None \
                and num_stages is None and not from_numpy:
            cache_key, cache_objects = self._split_key(q, arrays)
            if cache_key is not None:  # (a Key: its hash made once, kept by the cache for the bound calls' lookups)
                cache_key = P.Key(cache_key if engine is None else (*cache_key, engine))
            bound = P.PLANS.get(cache_key, cache_objects) if cache_key is not None else None
            if bound is not None:  # the plan for this metadata, made and uploaded by an earlier call
                check = self._row_check(q)
                o, lse, marked = self._launch_split(bound, q, arrays.get("k_cache", arrays.get("k")),
                                                    arrays.get("v_cache", arrays.get("v")), check[1])
                self._check_scores(lse, check, plan=bound.plan, marked=marked)
                return (o, lse) if return_lse else o
        tensors = self.split_tensors(arrays)
        if not from_numpy:
            device.check_device({"q": q, **{n: a for n, a in arrays.items() if n in KV_KEYS}, **tensors}, self.device)
        if len(q.shape) != 3 or tuple(q.shape[1:]) != (p.heads_q, p.d_qk):
            raise InputError(f"inputs: 'q' has shape {list(q.shape)}; a split call packs its query rows "
                             f"as [total_q, H_q={p.heads_q}, d_qk={p.d_qk}]")
        if plan is None:
            options = {n: x for n, x in (("block_n", block_n), ("splits", splits), ("block_q", block_q),
                                         ("engine", engine)) if x is not None}
            plan = self.decode_plan(arrays, tensors=tensors, total_q=int(q.shape[0]), **options)
        elif int(q.shape[0]) != plan["total_q"]:
            raise InputError(f"inputs: 'q' has {int(q.shape[0])} packed rows; the plan was made for "
                             f"{plan['total_q']} (q_lens {np.asarray(_to_numpy(plan['q_lens'])).tolist()})")
        # numpy inputs are copied to the kernel's device in the spec's dtype (bf16 carried in
        # float32 under the interpreter, which reads bf16 as garbage)
        carry = torch.float32 if interpreted() and self._dtype == torch.bfloat16 else self._dtype
        dev = self.device if from_numpy else q.device

        def on_device(a):
            if not isinstance(a, np.ndarray):
                return a
            return torch.as_tensor(np.ascontiguousarray(a, np.float32)).to(dev, self._dtype).to(carry)

        k_cache = on_device(arrays.get("k_cache", arrays.get("k")))
        v_cache = on_device(arrays.get("v_cache", arrays.get("v")))
        q_t = on_device(q)
        bound = self._bind_split(plan, q_t, k_cache, v_cache, tensors, num_warps, num_stages)
        self._at_call.on = from_numpy  # (numpy in: the rows come back to the host, checked at the call)
        try:
            check = self._row_check(q_t)
        finally:
            self._at_call.on = False
        o, lse, marked = self._launch_split(bound, q_t, k_cache, v_cache, check[1])
        self._check_scores(lse, check, plan=bound.plan, marked=marked)
        if cache_key is not None:
            P.PLANS.put(cache_key, bound, P.nbytes_of(bound.arrays), cache_objects)
        o = o.to(self._dtype) if carry != self._dtype else o
        if from_numpy:
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o


class _Split(NamedTuple):
    """A split call bound once: its plan (with the K/V strides), the plan's arrays on the device,
    the mask tensors' argument tuple, the launch, the workspace's size, the bound call and the
    bound calls' launches (``bound_decode``: kept here, they go with the plan)."""

    plan: dict
    arrays: dict
    ts: tuple
    launch: L.SplitLaunch
    workspace_bytes: int
    call: L.SplitCall | None  # (SplitLaunch.bind's, for q of q_layout: its rows and strides)
    q_layout: tuple
    runs: dict  # mark -> bound_decode.BoundSplit: the bound calls' launches of this plan


def _split_key_part(n, t):
    """A split call's input as a plan-cache key part: metadata and mask tensors by identity and
    version (and layout: ``plans.tensor_key``); the K/V tensors by layout and address only (the plan
    never reads their values, and a step writes new tokens into them); anything else (numpy
    arrays, inference tensors) makes the call uncacheable."""
    if not hasattr(t, "is_inference") or t.is_inference():  # (plans._tracked, inlined: per call)
        return None
    if n in KV_KEYS:
        return (n, t.shape, t.stride(), t.dtype, t.device, t.data_ptr())
    return (n, t.shape, t.stride(), t.dtype, t.device, id(t), t._version, t.data_ptr())
