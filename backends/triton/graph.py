"""Split calls replayed from a CUDA graph (the dispatch key's ``graph_mode``).

A decode call at small batch is host-bound: two Triton launches cost 94-170 us of host time
on the H200 machine against 84-93 us of GPU work, while SDPA's one launch costs 24-42 us
(bench/results/studies/decode_launch_h200_r25.jsonl, r26).  Serving engines capture a decode
step once and replay it.  ``DecodeGraph`` does that for attnc's split kernels:

* every array the two launches read or write lives in a buffer the graph owns, sized at
  capture: the query rows, O and LSE, the workspace, and the plan's arrays (lengths, bases,
  page table, the block lists with room for ``max_kv_len`` keys per request, the PARTIAL
  flags) and the declared mask tensors;
* the K/V cache is read where it lies: the caller writes new tokens into the same tensors;
* ``update(**cache keys)`` plans the next step on the host (new lengths, new pages) and copies
  the plan into the buffers; it refuses a plan the captured launch cannot run (another batch,
  more blocks than the capacity, a wider page table, another cache tensor), naming the array,
  the index and the value;
* ``__call__(q)`` copies q into the graph's query buffer (unless it is that buffer) and
  replays; O and LSE come back as the graph's buffers, overwritten by the next replay.

Where CUDA graphs do not exist (the Triton interpreter on CPU) ``capture=False`` runs the same
launch on the same buffers directly: the tests check the buffer plumbing there and the captured
graph on a GPU.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler.errors import InputError, PlanError

from .args import TORCH_DTYPES
from .decode import DECODE_ARRAYS, device_tensor
from .device import interpreted
from .launch import tensor_args


def capture(fn):
    """``fn`` captured in a CUDA graph on the current device: one call on a side stream first (it
    compiles the kernels and warms the allocator outside the capture), then the captured call.
    Returns (graph, what the captured call returned: its outputs, rewritten by every replay)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out

# plan fields the captured launch bakes in: an update must keep them
_FIXED = ("cache", "page_size", "splits", "block_n", "block_q", "one_row", "tiles", "total_q", "abi",
          "k_strides", "v_strides", "table_stride", "bounded")


class DecodeGraph:
    """One split call (decode, append or mixed batch) captured once and replayed; see the module
    docstring.  Built by ``Kernel.decode_graph``."""

    def __init__(self, kernel, q, *, max_kv_len: int | None = None, block_n: int | None = None, splits: int | None = None,
                 block_q: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 capture: bool | None = None,
                 **arrays):
        import torch

        self.kernel = kernel
        p = kernel.program
        if not isinstance(q, torch.Tensor):
            raise InputError("DecodeGraph: 'q' must be a torch tensor on the device the graph runs on")
        dtype = getattr(torch, TORCH_DTYPES[p.dtype])
        if q.dtype != dtype:
            raise InputError(f"DecodeGraph: 'q' is {q.dtype}; spec '{p.name}' stores {p.dtype} ({dtype})")
        self.device = q.device
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and (self.device.type != "cuda" or interpreted()):
            raise InputError(f"DecodeGraph: a CUDA graph needs a CUDA device and no TRITON_INTERPRET; q is on "
                             f"{self.device}" + (" under the interpreter" if interpreted() else "")
                             + " (capture=False runs the same launch without a graph)")
        if interpreted() and dtype == torch.bfloat16:
            raise InputError("DecodeGraph: the Triton interpreter has no bf16 loads; use an f16 or f32 spec there")
        tensors = kernel.split_tensors(arrays)
        self._kv_keys = [n for n in ("k", "v", "k_cache", "v_cache") if n in arrays]
        for n in self._kv_keys:
            t = arrays[n]
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                raise InputError(f"DecodeGraph: '{n}' must be a torch tensor on {self.device} (the graph reads "
                                 "the cache where it lies)")
            if t.dtype != q.dtype:
                raise InputError(f"DecodeGraph: '{n}' is {t.dtype}, q is {q.dtype}; K/V are stored in the "
                                 "query dtype")
        self.kv = {n: arrays[n] for n in self._kv_keys}
        # the plan reads the cache tensors themselves: strides and contiguous bases are theirs
        options = {n: x for n, x in (("block_n", block_n), ("splits", splits), ("block_q", block_q)) if x is not None}
        plan = kernel.decode_plan(arrays, tensors=tensors, total_q=int(q.shape[0]), engine="split", **options)
        self._call = {**{n: a for n, a in arrays.items() if n not in self._kv_keys}, **tensors}
        self._options = {"block_n": plan["block_n"], "splits": plan["splits"], "block_q": plan["block_q"]}
        if plan["bounded"]:  # the spec's split policy cuts every step's slots (its slot count must hold)
            del self._options["splits"]
        longest = int(np.max(plan["kv_lens"], initial=0))
        self.max_kv_len = longest if max_kv_len is None else int(max_kv_len)
        if self.max_kv_len < longest:
            raise PlanError(f"max_kv_len = {self.max_kv_len} but kv_lens holds {longest}: the block lists "
                            "could not hold this call")
        self.capacity = self._capacity(plan)
        self.plan = {n: plan[n] for n in _FIXED}
        # the buffers the launch reads and writes (contents replaced by update, addresses fixed)
        self.buffers = {}
        for n, dt in DECODE_ARRAYS.items():
            a = np.asarray(plan[n])
            size = self.capacity[n] if n in self.capacity else a.size
            shape = (size,) if a.ndim <= 1 or n != "table" else a.shape
            self.buffers[n] = torch.zeros(shape, dtype=getattr(torch, dt), device=self.device)
        self.tensors = {n: device_tensor(t, self.device, n) for n, t in tensors.items()}
        self._ts = None
        self.q = q.detach().clone()
        self.out = torch.empty(q.shape[0], p.heads_q, p.d_v, device=self.device, dtype=q.dtype)
        self.lse = torch.empty(q.shape[0], p.heads_q, device=self.device, dtype=torch.float32)
        self.workspace = kernel.workspace(int(q.shape[0]), plan["splits"], self.device)
        self._warps = num_warps or plan.get("num_warps", 4)
        self._stages = num_stages or plan.get("num_stages", 2)
        self._load(plan)
        self.graph = None
        if capture:
            self._capture()

    # ------------------------------------------------------------------ construction helpers
    def _capacity(self, plan) -> dict:
        """Entries of the variable-length arrays at ``max_kv_len`` keys per request: the tiles'
        block lists hold ceil(max_kv_len / block_n) blocks per tile, the CSR page list
        ceil(max_kv_len / page_size) pages per request, in total (one request may outgrow
        max_kv_len while the others are shorter).  Under a spec's split policy a block that a slot
        bound cuts is listed for both slots: up to splits - 1 more entries per tile."""
        per_tile = -(-self.max_kv_len // plan["block_n"]) + (plan["splits"] - 1 if plan["bounded"] else 0)
        cap = {"blocks": max(1, plan["tiles"] * per_tile)}
        cap["partial"] = cap["blocks"]
        if plan["cache"] == 2:  # paged, CSR table: kv_indices
            cap["table"] = max(1, len(plan["kv_lens"]) * -(-self.max_kv_len // plan["page_size"]))
        return cap

    def _load(self, plan) -> None:
        """Copy a plan's arrays into the buffers; refuse what the captured launch cannot run."""
        import torch
        for n in _FIXED:
            if n == "table_stride":  # a narrower dense table is padded to the captured width below
                continue
            if plan[n] != self.plan[n]:
                raise PlanError(f"DecodeGraph.update: the plan has {n} = {plan[n]}; the graph was captured "
                                f"with {n} = {self.plan[n]} (capture a new graph for this call)")
        staged = {}  # every array is checked before any is copied: a refused plan changes nothing
        for n in DECODE_ARRAYS:
            a = np.asarray(plan[n])
            buf = self.buffers[n]
            if n == "table" and buf.dim() == 2:
                if a.shape[0] != buf.shape[0] or a.shape[1] > buf.shape[1]:
                    raise PlanError(f"DecodeGraph.update: block_table has shape {list(a.shape)}; the graph holds "
                                    f"{list(buf.shape)} (batch rows must match, pages per request at most "
                                    f"{buf.shape[1]})")
                host = np.zeros(tuple(buf.shape), a.dtype)
                host[:, :a.shape[1]] = a
                a = host
            elif a.size > buf.numel():
                what = {"blocks": "block-list entries", "partial": "block-list entries",
                        "table": "kv_indices pages"}.get(n, "entries")
                b = int(np.argmax(plan["kv_lens"]))
                raise PlanError(f"DecodeGraph.update: '{n}' needs {a.size} {what}; the graph holds {buf.numel()} "
                                f"(max_kv_len = {self.max_kv_len} keys per request at capture); the longest "
                                f"request now: kv_lens[{b}] = {int(plan['kv_lens'][b])}")
            staged[n] = torch.as_tensor(np.ascontiguousarray(a.reshape(-1)).astype(str(buf.dtype).split(".")[1]))
        for n, src in staged.items():
            self.buffers[n].view(-1)[:src.numel()].copy_(src)

    def _launch(self):
        ts = tensor_args(self.kernel.module, self.tensors, (self.buffers["kv_lens"], self.buffers["qo_indptr"]))
        launch = self.kernel.split_launch(self._warps, self._stages)
        return launch(self.q, self.kv.get("k_cache", self.kv.get("k")), self.kv.get("v_cache", self.kv.get("v")),
                      self.plan, self.buffers, ts, self.out, self.lse, self.workspace)

    def _capture(self) -> None:
        self.graph, _ = capture(self._launch)

    # ------------------------------------------------------------------ use
    def update(self, **arrays) -> None:
        """Plan the next call over the same cache tensors (new ``kv_lens``, ``block_table`` /
        ``kv_indptr`` + ``kv_indices`` + ``kv_last_page_len``, ``q_lens``, declared tensors) and
        copy it into the graph's buffers.  Keys not given keep the values of the capture call."""
        names = {t.name for t in self.kernel.program.tensors}
        for n in self._kv_keys:
            if n in arrays and arrays[n] is not self.kv[n] and arrays[n].data_ptr() != self.kv[n].data_ptr():
                raise InputError(f"DecodeGraph.update: '{n}' is not the tensor the graph captured; write new "
                                 "tokens into the captured cache, or capture a new graph")
        call = {**self._call, **{n: a for n, a in arrays.items() if n not in self._kv_keys}}
        tensors = {n: a for n, a in call.items() if n in names}
        meta = {n: a for n, a in call.items() if n not in names}
        plan = self.kernel.decode_plan({**meta, **self.kv}, tensors=tensors, total_q=self.plan["total_q"],
                                       **self._options)
        new = {n: device_tensor(t, self.device, n) for n, t in tensors.items()}
        for n, t in new.items():
            if t.shape != self.tensors[n].shape:
                raise InputError(f"DecodeGraph.update: tensor '{n}' has shape {list(t.shape)}; the graph "
                                 f"holds {list(self.tensors[n].shape)}")
        self._load(plan)
        for n, t in new.items():
            self.tensors[n].copy_(t)
        self._call = call

    def __call__(self, q=None):
        """Replay (or, without a graph, launch) on the current buffers; ``q`` is copied into the
        graph's query buffer first unless it is that buffer.  Returns the graph's (O, LSE)."""
        if q is not None and q is not self.q:
            if tuple(q.shape) != tuple(self.q.shape) or q.dtype != self.q.dtype:
                raise InputError(f"DecodeGraph: 'q' is {list(q.shape)} {q.dtype}; the graph was captured for "
                                 f"{list(self.q.shape)} {self.q.dtype}")
            self.q.copy_(q)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._launch()
        self.kernel._check_scores(self.lse, self.kernel._row_check(self.lse),
                                  plan={n: self.buffers[n] for n in ("qo_indptr", "kv_lens")})
        return self.out, self.lse
