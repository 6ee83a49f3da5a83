"""Load generated Triton modules and launch them: on a GPU, or on the CPU under
``TRITON_INTERPRET=1`` (set before triton is imported; the tests do)."""
from __future__ import annotations

import os

import numpy as np

from compiler import inputs, ir
from compiler.errors import InputError, PlanError
from compiler.plan import Plan, decode_blocks, plan as make_plan
from backends.common import load_module
from .emit import Source, emit

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
DEFAULT_TILES = {"gpu": (128, 64), "interpreter": (16, 16)}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kind(t) -> str:
    import torch
    if t.dtype.is_floating_point:
        return "f"
    return "b" if t.dtype == torch.bool else "i"


class Kernel:
    def __init__(self, program: ir.Program, source: Source):
        import torch  # noqa: F401  (the launcher needs it; fail here with a clear import error)
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)

    @property
    def device(self) -> str:
        import torch
        return "cpu" if interpreted() or not torch.cuda.is_available() else "cuda"

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None) -> Plan:
        dm, dn = DEFAULT_TILES["interpreter" if interpreted() else "gpu"]
        tensors = {n: (t.cpu().numpy() if hasattr(t, "cpu") else np.asarray(t)) for n, t in (tensors or {}).items()}
        tensors = {n: t.astype(np.int64) if t.dtype.kind in "iu" else t for n, t in tensors.items()}
        return make_plan(self.program, batch, s_q, s_k, tensors, block_m or dm, block_n or dn)

    def device_plan(self, plan: Plan, device) -> dict:
        """The plan's arrays as int32 torch tensors on the kernel's device (cached on the plan)."""
        import torch
        cache = plan.__dict__.setdefault("_device_args", {})
        key = str(device)
        if key not in cache:
            args = plan.kernel_args()
            cache[key] = {n: torch.as_tensor(np.ascontiguousarray(v, np.int32), device=device)
                          if isinstance(v, np.ndarray) else v for n, v in args.items()}
        return cache[key]

    def __call__(self, q, k, v, *, plan: Plan | None = None, return_lse=False, block_m=None, block_n=None,
                 num_warps: int | None = None, num_stages: int | None = None, use_tma: bool | None = None,
                 use_runs: bool | None = None, **tensors):
        import torch
        from_numpy = isinstance(q, np.ndarray)
        device = self.device
        dtype = getattr(torch, TORCH_DTYPES[self.program.dtype])
        # The Triton interpreter (3.9) reads bf16 tensors as garbage: on the CPU, bf16 specs
        # carry their (already bf16-rounded) values in float32 and O is rounded to bf16 after.
        emulate_bf16 = interpreted() and dtype == torch.bfloat16
        if from_numpy:
            call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors})
            carry = torch.float32 if emulate_bf16 else dtype
            q, k, v = (torch.as_tensor(np.ascontiguousarray(x), device=device).to(dtype).to(carry)
                       for x in (call.q, call.k, call.v))
            tensors = {n: torch.as_tensor(np.ascontiguousarray(
                t.astype(np.int32) if t.dtype.kind in "iu" else t), device=device) for n, t in call.tensors.items()}
            bshd = False
        else:
            metas = {n: (tuple(t.shape), _kind(t), str(t.dtype)) for n, t in {"q": q, "k": k, "v": v, **tensors}.items()}
            inputs.check_shapes(self.program, metas)
            if any(x.dtype != dtype for x in (q, k, v)):
                raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; "
                                 f"the spec stores {self.program.dtype}")
            if emulate_bf16:
                q, k, v = (x.float() for x in (q, k, v))
            bshd = self.program.cache.layout is ir.Layout.BSHD
            if bshd:  # strides carry the layout; the kernel indexes logical bhsd
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        batch, _, s_q, _ = q.shape
        s_k = k.shape[2]
        tuned = {}
        if plan is None and block_m is None and block_n is None:  # `attnc tune`'s winner for this key
            from compiler import tune
            tuned = tune.tuned_tiles(self.program, batch, s_q, s_k, "triton") or {}
            block_m, block_n = tuned.get("BLOCK_M"), tuned.get("BLOCK_N")
        num_warps = num_warps if num_warps is not None else tuned.get("num_warps", 4)
        num_stages = num_stages if num_stages is not None else tuned.get("num_stages", 2)
        use_tma = use_tma if use_tma is not None else tuned.get("use_tma", False)
        if plan is None:
            plan = self.plan(batch, s_q, s_k, tensors, block_m, block_n)
        plan.check_call(self.program, batch, s_q, s_k)
        out = None
        if bshd:
            out = torch.empty(batch, s_q, self.program.heads_q, self.program.d_v, device=q.device,
                              dtype=q.dtype).transpose(1, 2)
        o, lse = self.module.attention(q, k, v, self.device_plan(plan, q.device), out=out,
                                       num_warps=num_warps, num_stages=num_stages, use_tma=use_tma,
                                       use_runs=use_runs, **tensors)
        if bshd:
            o = o.transpose(1, 2)
        if emulate_bf16:
            o = o.to(torch.bfloat16) if not from_numpy else o.to(torch.bfloat16).float()
        if from_numpy:
            o = o.float().cpu().numpy()
            lse = lse.cpu().numpy()
            if self.program.cache.layout is ir.Layout.BSHD:  # O comes back in q's layout
                o = o.transpose(0, 2, 1, 3)
        return (o, lse) if return_lse else o


    # ------------------------------------------------------------ decode
    def decode_plan(self, arrays: dict, *, block_n: int = 64, splits: int | None = None,
                    num_sms: int | None = None, tensors: dict | None = None) -> dict:
        """The split-K/V decode plan for a call given by DESIGN §5's cache keys (numpy or torch
        metadata; K/V arrays are only measured): validates the cache (page ids, lengths,
        indptr...) through the layout analysis, then lists every (request, split)'s blocks."""
        from compiler.analysis import layout as kvl
        p = self.program
        meta = {n: (_shape_only(a) if n in ("k", "v", "k_cache", "v_cache") else _to_numpy(a))
                for n, a in arrays.items()}
        lay = kvl.from_inputs(p.cache, meta, heads_q=p.heads_q, heads_kv=p.heads_kv)
        if lay.cache_batch_idx is not None:
            raise PlanError("the Triton decode kernel does not take cache_batch_idx yet")
        kv_lens = np.asarray(lay.kv_lens, np.int64)
        batch = len(kv_lens)
        if splits is None:  # `attnc tune`'s winner for this dispatch key, if the cache has it
            from compiler import tune
            tuned = tune.tuned_tiles(p, batch, 1, [int(x) for x in kv_lens], "triton") or {}
            splits, block_n = tuned.get("splits"), tuned.get("BLOCK_N", block_n)
        if splits is None:  # the heuristic: enough programs for two waves, never more splits than blocks
            most = int(-(-kv_lens.max(initial=1) // block_n))
            splits = int(np.clip(-(-2 * (num_sms or 132) // max(batch * p.heads_kv, 1)), 1, min(most, 64)))
        tensors = {n: _to_numpy(t) for n, t in (tensors or {}).items()}
        blocks = decode_blocks(p, kv_lens, {n: t.astype(np.int64) if t.dtype.kind in "iu" else t
                                            for n, t in tensors.items()}, block_n, splits)
        k_key = "k_cache" if lay.kind == "paged" else "k"
        v_key = "v_cache" if lay.kind == "paged" else "v"
        k_str, v_str = cache_strides(lay.kind, lay.order, arrays[k_key], arrays[v_key])
        if lay.kind == "paged":
            if lay.table == "csr":
                cache, table, base, tstride = 2, lay.kv_indices, lay.kv_indptr[:-1], 0
            else:
                cache, table, base, tstride = 1, lay.block_table, np.zeros(batch), lay.block_table.shape[1]
            page_size = lay.page_size
        else:
            if lay.kind == "ragged":
                base = lay.indptr[:-1]
            else:  # request b starts b * (batch stride / token stride) token rows in
                ks = _strides(arrays[k_key])
                t_ax = 2 if lay.order == "bhsd" else 1
                base = np.arange(batch) * (ks[0] // ks[t_ax])
            cache, table, tstride, page_size = 0, np.zeros(1), 0, 1
        return {"cache": cache, "page_size": int(page_size), "k_strides": k_str, "v_strides": v_str,
                "kv_lens": kv_lens, "base": np.asarray(base, np.int64), "table": np.asarray(table),
                "table_stride": int(tstride), "entry_ptr": blocks.entry_ptr, "blocks": blocks.blocks,
                "partial": blocks.partial, "splits": blocks.splits, "block_n": block_n,
                "abi": self.program.state.value, "skipped_blocks": blocks.skipped}

    @staticmethod
    def decode_args(plan: dict, device) -> dict:
        """A decode plan with its arrays as torch tensors on ``device``: what the generated
        ``decode`` launcher reads (upload once, launch many times)."""
        import torch

        def up(a, dtype):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a))
            return t.to(device=device, dtype=dtype)

        args = {n: up(plan[n], torch.int32) for n in ("kv_lens", "entry_ptr", "blocks", "table")}
        args["base"] = up(plan["base"], torch.int64)
        args["partial"] = up(plan["partial"], torch.int8)
        return {**plan, **args}

    def run(self, arrays: dict, *, return_lse=False, **options):
        """A split call given by DESIGN §5's keys (what `attnc run` reads from an npz): packed
        q [total_q, H_q, d_qk] with one query row per request, i.e. decode; returns packed
        o [B, H_q, d_v] (and lse [B, H_q]).  Mixed batches (several rows per request) run on
        the numpy backend."""
        arrays = dict(arrays)
        q = arrays.pop("q")
        q_lens = arrays.pop("q_lens", None)
        qo_indptr = arrays.pop("qo_indptr", None)
        if qo_indptr is not None:
            q_lens = np.diff(np.asarray(qo_indptr))
        if q_lens is not None and np.any(np.asarray(q_lens) != 1):
            raise InputError("the Triton backend runs split calls with one query row per request "
                             f"(decode); q_lens = {np.asarray(q_lens).tolist()} needs --backend numpy")
        return self.decode(q, return_lse=return_lse, **arrays, **options)

    def decode(self, q, *, plan: dict | None = None, return_lse=False, block_n: int = 64,
               splits: int | None = None, num_warps: int = 4, num_stages: int = 2, **arrays):
        """One decode step: q [B, H_q, d_qk] (the new token of every request), the cache by
        DESIGN §5's keys (k/v, k_cache/v_cache, block_table + kv_lens, kv_indptr + kv_indices +
        kv_last_page_len, kv_indptr for ragged) and declared tensors by name.  Returns O
        [B, H_q, d_v] (and LSE [B, H_q])."""
        import torch
        p = self.program
        names = {t.name for t in p.tensors}
        tensors = {n: arrays.pop(n) for n in list(arrays) if n in names}
        missing = names - set(tensors)
        if missing:
            raise InputError(f"inputs: missing key '{sorted(missing)[0]}'")
        from_numpy = isinstance(q, np.ndarray)
        if plan is None:
            plan = self.decode_plan(arrays, block_n=block_n, splits=splits, tensors=tensors)
        dtype = getattr(torch, TORCH_DTYPES[p.dtype])
        carry = torch.float32 if interpreted() and dtype == torch.bfloat16 else dtype
        dev = self.device if from_numpy else q.device
        if tuple(q.shape[1:]) != (p.heads_q, p.d_qk):
            raise InputError(f"inputs: 'q' has shape {list(q.shape)}; expected [B, H_q={p.heads_q}, d_qk={p.d_qk}]")

        def dev_tensor(a, dt=None):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a))
            return t.to(dev, dt) if dt is not None else t.to(dev)

        kv = {n: dev_tensor(np.asarray(a, np.float32), dtype).to(carry) if isinstance(a, np.ndarray) else a
              for n, a in arrays.items() if n in ("k", "v", "k_cache", "v_cache")}
        k_cache = kv.get("k_cache", kv.get("k"))
        v_cache = kv.get("v_cache", kv.get("v"))
        # strides of the tensors the kernel actually reads (numpy inputs were made contiguous)
        kind = p.cache.kind.value
        plan = dict(plan)
        plan["k_strides"], plan["v_strides"] = cache_strides(kind, p.cache.layout.value, k_cache, v_cache)
        if kind == "contiguous":
            st = _strides(k_cache)
            t_ax = 2 if p.cache.layout.value == "bhsd" else 1
            plan["base"] = np.arange(len(plan["kv_lens"])) * (st[0] // st[t_ax])
        q_t = dev_tensor(np.asarray(q, np.float32), dtype).to(carry) if from_numpy else q
        launch = self.decode_args(plan, dev)
        tens = {n: dev_tensor(_to_numpy(t).astype(np.int32) if _to_numpy(t).dtype.kind in "iu" else _to_numpy(t))
                for n, t in tensors.items()}
        o, lse = self.module.decode(q_t, k_cache, v_cache, launch, num_warps=num_warps, num_stages=num_stages,
                                    **tens)
        if carry != dtype:
            o = o.to(dtype)
        if from_numpy:
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o


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


def load(program: ir.Program) -> Kernel:
    """The kernel of a spec: ``kernel(q, k, v, ...)`` for prefill/append over contiguous K/V,
    ``kernel.decode(q, ...)`` for split-K/V decode over any cache layout."""
    return Kernel(program, emit(program))
