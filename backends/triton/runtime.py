"""Load generated Triton modules and launch them: on a GPU, or on the CPU under
``TRITON_INTERPRET=1`` (set before triton is imported; the tests do)."""
from __future__ import annotations

import os

import numpy as np

from attnc.compiler import inputs, ir
from attnc.compiler.errors import BackendUnavailable, InputError
from attnc.compiler.plan import Plan, plan as make_plan
from attnc.backends.common import load_module
from .emit import Source, emit
from .decode import (DECODE_ARRAYS, GPU_MIN_TILE, _check_gpu_tile, _rows_per_batch, _to_numpy,  # noqa: F401
                     cache_strides, decode_args, decode_plan, default_block_q, device_tensor)

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
DEFAULT_TILES = {"gpu": (128, 128), "interpreter": (16, 16)}


def default_prefill_config(d_qk: int, d_v: int, interpreter: bool, capability: int | None = None,
                           reads_tensors: bool = False) -> dict:
    """The untuned prefill launch, as measured on the H200 (bench/results/prefill_h200_r12_*,
    r13_*, r15_*): up to head dim 128, 128x128 tiles, 8 warps, 3 stages, TMA bulk copies
    (causal 499, full 535 TFLOP/s) — but 64x64, 4 warps, 3 stages, TMA for masks that read
    tensors (documents: 296 against 251 at 128x128, their rows are short); above 128, 64x64, 4 warps,
    3 stages without TMA (d=256: causal 431, full 458).  TMA needs Hopper (capability >= 90)
    and power-of-two head dims; the call drops it for strided K/V."""
    if interpreter:
        bm, bn = DEFAULT_TILES["interpreter"]
        return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "use_tma": False}
    tma = all(d & (d - 1) == 0 for d in (d_qk, d_v)) and (capability or 0) >= 90
    if max(d_qk, d_v) > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "use_tma": False}
    if reads_tensors:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "use_tma": tma}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "use_tma": tma}


# Rows this short (computed K/V blocks per 128-row query tile, on average) run faster on 64x64
# tiles, whose CTAs share an SM and hide each other's prologue and epilogue.  Measured on the H200
# (bench/results/prefill_h200_r16_*, r17_*): sliding window 1024 (8.4 blocks) 376 vs 365 TFLOP/s,
# tile-aligned 1024-token chunks (4.5) 337 vs 310, documents (5.8) 297 vs 251; causal (32.5)
# stays at 128x128, 503 vs 448.
SHORT_ROW_BLOCKS = 16
SHORT_ROW_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3}  # warps follow the tile: 4


def mean_row_blocks(plan: Plan) -> float:
    """Computed (FULL or PARTIAL) K/V blocks per query tile, averaged over the plan's tiles."""
    counts = plan.tiles.counts()
    rows = int(np.prod(plan.tiles.classes.shape[:3]))
    return (counts["full"] + counts["partial"]) / rows if rows else 0.0


# The Gluon engine (the generated module's ``_attn_fwd_ws``: warp-specialized, Hopper only) takes
# f16 / bf16 specs with one head dim of 64 or 128, on 128-row tiles; measured on the H200
# (bench/results/studies/gluon_engine_h200_r30.jsonl, 4 rounds in turns) full 549, causal 558,
# prefix-LM 565, sliding window 1024 392, documents 279 TFLOP/s against the Triton kernel's default
# 509 / 486 / 489 / 354 / 278, on 128x128 tiles (128x64: 367-504).  K/V stages: 2 (r30: 3 led by
# 0.4-1.8%; r33, gluon_persistent_h200_r33.jsonl: 2 led by 0.4-2.1%, and the persistent program,
# which also stages O, has room for 2 only at d = 128).  Short rows take it too since its programs
# draw tiles from a counter and the producer hands the plan over (r37, gluon_engine_h200_r37.jsonl:
# documents 317.5 TFLOP/s against 288.2 on the Triton kernel's 64x64 short-row tiles).
GLUON_STAGES = 2
GLUON_TILES = (128, 128)


def gluon_program(program) -> bool:
    """Whether a spec is one the Gluon engine can run (the call's shapes are checked at launch)."""
    return program.dtype in ("f16", "bf16") and program.d_qk == program.d_v and program.d_qk in (64, 128)


def short_row_config(plan: Plan) -> dict | None:
    """The untuned GPU default's second look, once the 128x128 plan exists: SHORT_ROW_CONFIG
    when its rows are short, else None (keep 128x128)."""
    if (plan.block_m, plan.block_n) == (128, 128) and mean_row_blocks(plan) < SHORT_ROW_BLOCKS:
        return dict(SHORT_ROW_CONFIG)
    return None


def _capability() -> int:
    import torch
    if interpreted() or not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kind(t) -> str:
    import torch
    if t.dtype.is_floating_point:
        return "f"
    return "b" if t.dtype == torch.bool else "i"


class Kernel:
    def __init__(self, program: ir.Program, source: Source):
        import torch  # (the launcher needs it; fail here with a clear import error)
        if not interpreted() and not torch.cuda.is_available():
            raise BackendUnavailable("the Triton backend runs on a CUDA GPU; on this machine (no CUDA device) "
                             "set TRITON_INTERPRET=1 to run its kernels in Triton's CPU interpreter")
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)

    @property
    def device(self) -> str:
        import torch
        return "cpu" if interpreted() or not torch.cuda.is_available() else "cuda"

    def _check_device(self, named: dict) -> None:
        """Torch inputs must be where the kernel runs (numpy inputs are copied there for the caller)."""
        import torch
        for n, t in named.items():
            if isinstance(t, torch.Tensor) and t.device.type != self.device:
                raise InputError(f"inputs: '{n}' is a torch tensor on {t.device}; this Triton kernel runs on "
                                 f"{self.device}: move the torch inputs there (numpy inputs are copied for you)")

    def default_config(self, capability: int | None = None) -> dict:
        """The untuned prefill launch for this spec (``default_prefill_config``)."""
        p = self.program
        return default_prefill_config(p.d_qk, p.d_v, interpreted(), capability, bool(ir.loads(p.mask)))

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None) -> Plan:
        default = self.default_config()
        dm, dn = default["BLOCK_M"], default["BLOCK_N"]
        tensors = {n: (t.cpu().numpy() if hasattr(t, "cpu") else np.asarray(t)) for n, t in (tensors or {}).items()}
        tensors = {n: t.astype(np.int64) if t.dtype.kind in "iu" else t for n, t in tensors.items()}
        _check_gpu_tile(block_m or dm, block_n or dn)
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

    def prefill_launch(self, batch: int, s_q: int, s_k: int, tensors: dict, *, plan: Plan | None = None,
                       block_m=None, block_n=None, num_warps=None, num_stages=None, use_tma=None,
                       contiguous: bool = True, engine: str | None = None) -> tuple[Plan, dict, bool]:
        """The plan and launch options a prefill call runs with: what the caller gave, else
        `attnc tune`'s winner for the call's key, else the untuned default (``default_config``,
        then ``short_row_config`` once the plan's rows are known; warps follow the plan's tile).
        ``engine="triton"`` asks for the Triton kernel's default even where the Gluon engine would
        run, ``engine="gluon"`` for the Gluon engine's tiles whatever the rows.  Returns (plan,
        {num_warps, num_stages, use_tma, engine}, whether the stages were chosen)."""
        tuned = {}
        if plan is None and block_m is None and block_n is None:  # `attnc tune`'s winner for this key
            from attnc.compiler import tune
            tuned = tune.tuned_tiles(self.program, batch, s_q, s_k, "triton") or {}
            block_m, block_n = tuned.get("BLOCK_M"), tuned.get("BLOCK_N")
        default = self.default_config(_capability())
        chosen_stages = num_stages is not None or "num_stages" in tuned
        chosen_warps = num_warps is not None or "num_warps" in tuned
        num_warps = num_warps if num_warps is not None else tuned.get("num_warps", default["num_warps"])
        num_stages = num_stages if num_stages is not None else tuned.get("num_stages", default["num_stages"])
        if use_tma is None:
            use_tma = tuned.get("use_tma", default["use_tma"] and contiguous)
        # engine None: the Gluon engine where this machine and spec allow it, unless `attnc tune`
        # has a winner (measured on the Triton kernel); "gluon": asked for
        gluon = engine == "gluon" or (engine is None and not tuned and self.gluon_engine())
        if plan is None:
            untuned = block_m is None and block_n is None
            if gluon and untuned:  # the Gluon engine's tiles: 128 query rows (two warpgroups of 64)
                block_m, block_n = GLUON_TILES
            plan = self.plan(batch, s_q, s_k, tensors, block_m, block_n)
            short = short_row_config(plan) if untuned and not interpreted() and not gluon else None
            if short:  # the default's tiles, chosen again now that the rows' lengths are known
                plan = plan.retile(short["BLOCK_M"], short["BLOCK_N"])
                num_stages = num_stages if chosen_stages else short["num_stages"]
        if gluon and not chosen_stages:
            num_stages = GLUON_STAGES
        if not chosen_warps and not interpreted():  # warps follow the tile the plan has (given or chosen)
            num_warps = 8 if plan.block_m * plan.block_n >= 128 * 128 else 4
        # engine None: the module takes the Gluon engine where the call's shapes allow it (else Triton)
        launch = {"num_warps": num_warps, "num_stages": num_stages, "use_tma": use_tma,
                  "engine": (engine or None) if gluon else "triton"}
        return plan, launch, chosen_stages

    def gluon_engine(self) -> bool:
        """Whether untuned prefill calls of this spec go to the Gluon engine here: an sm_90 GPU,
        a Triton with Gluon, a spec ``gluon_program`` admits."""
        return (not interpreted() and _capability() == 90 and getattr(self.module, "HAS_GLUON", False)
                and gluon_program(self.program))

    def __call__(self, q, k, v, *, plan: Plan | None = None, return_lse=False, block_m=None, block_n=None,
                 num_warps: int | None = None, num_stages: int | None = None, use_tma: bool | None = None,
                 use_runs: bool | None = None, walk: str | None = None, mask_source: str | None = None,
                 programs: int | None = None, head_group: int | None = None, engine: str | None = None,
                 **tensors):
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
            self._check_device({"q": q, "k": k, "v": v, **tensors})
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
        if engine is None and self.module.triton_options(walk=walk, programs=programs,
                                                         warp_specialize=use_runs is not None,
                                                         mask_source=mask_source):
            engine = "triton"  # options of the Triton kernel: its defaults, not the Gluon engine's tiles
        plan, launch, chosen_stages = self.prefill_launch(
            batch, s_q, s_k, tensors, plan=plan, block_m=block_m, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, use_tma=use_tma, contiguous=k.is_contiguous() and v.is_contiguous(),
            engine=engine)
        num_warps, num_stages, use_tma = launch["num_warps"], launch["num_stages"], launch["use_tma"]
        engine = engine if engine is not None else launch["engine"]
        plan.check_call(self.program, batch, s_q, s_k)
        out = None
        if bshd:
            out = torch.empty(batch, s_q, self.program.heads_q, self.program.d_v, device=q.device,
                              dtype=q.dtype).transpose(1, 2)
        args = self.device_plan(plan, q.device)
        while True:
            try:
                o, lse = self.module.attention(q, k, v, args, out=out, num_warps=num_warps, num_stages=num_stages,
                                               use_tma=use_tma, walk=walk, use_runs=use_runs,
                                               mask_source=mask_source, programs=programs,
                                               head_group=head_group, engine=engine, **tensors)
                break
            except Exception as e:  # the untuned default may not fit a mask's extra loads: one stage fewer
                if chosen_stages or num_stages <= 1 or type(e).__name__ != "OutOfResources":
                    raise
                num_stages -= 1
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


    # ------------------------------------------------------------ split calls (decode, append, mixed)
    def decode_plan(self, arrays: dict, **options) -> dict:
        """The split-K/V plan of a call (``backends.triton.decode.decode_plan``)."""
        return decode_plan(self.program, arrays, **options)

    decode_args = staticmethod(decode_args)

    def split_tensors(self, arrays: dict) -> dict:
        """Pop the spec's declared tensors out of a split call's keyword arrays (all must be there)."""
        names = {t.name for t in self.program.tensors}
        tensors = {n: arrays.pop(n) for n in list(arrays) if n in names}
        missing = names - set(tensors)
        if missing:
            raise InputError(f"inputs: missing key '{sorted(missing)[0]}'")
        return tensors

    def run(self, arrays: dict, *, return_lse=False, cuda_graph=False, **options):
        """A split call given by DESIGN §5's keys (what `attnc run` reads from an npz): packed
        q [total_q, H_q, d_qk] with ``q_lens`` / ``qo_indptr`` (default: one query row per
        request, decode) over any cache; returns packed o [total_q, H_q, d_v] (and
        lse [total_q, H_q]).  Prefill, append, decode and mixed batches are one call.
        ``cuda_graph``: capture the call (``decode_graph``) and replay it."""
        arrays = dict(arrays)
        if "q" not in arrays:
            raise InputError("inputs: missing key 'q'")
        required, optional = inputs.cache_keys(self.program)
        names = {t.name for t in self.program.tensors}
        unknown = sorted(set(arrays) - {*required, *optional, *names})
        if unknown:
            raise InputError(f"inputs: unknown key '{unknown[0]}' for a {inputs.cache_description(self.program)} "
                             f"(expected keys: {', '.join(sorted([*required, *names]))}; optional: "
                             f"{', '.join(optional)})")
        q = arrays.pop("q")
        if cuda_graph:
            return self._run_graph(q, arrays, return_lse, options)
        return self.decode(q, return_lse=return_lse, **arrays, **options)

    def _run_graph(self, q, arrays: dict, return_lse: bool, options: dict):
        """``run`` through a captured graph: host arrays go to the GPU in the spec's dtype (the
        cache the graph reads, the query rows it copies in), metadata stays on the host."""
        import torch
        dtype = getattr(torch, TORCH_DTYPES[self.program.dtype])

        def dev(a):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(a, np.float32))
            return t.to(self.device, dtype)
        kv = {n: dev(a) for n, a in arrays.items() if n in ("k", "v", "k_cache", "v_cache")}
        meta = {n: a for n, a in arrays.items() if n not in kv}
        q_t = dev(q)
        graph = self.decode_graph(q_t, **kv, **meta, capture=True, **options)
        o, lse = graph(q_t)
        if isinstance(q, np.ndarray):
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o

    def decode_graph(self, q, *, max_kv_len: int | None = None, block_n: int = 64, splits: int | None = None,
                     block_q: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     capture: bool | None = None, **arrays):
        """The split call ``decode(q, **arrays)`` captured as a CUDA graph over buffers it owns
        (``graph.DecodeGraph``): ``g.update(kv_lens=..., block_table=...)`` plans the next step,
        ``g(q)`` replays and returns (O, LSE).  ``max_kv_len``: the longest request a later
        update may bring (default: this call's longest)."""
        from .graph import DecodeGraph
        return DecodeGraph(self, q, max_kv_len=max_kv_len, block_n=block_n, splits=splits, block_q=block_q,
                           num_warps=num_warps, num_stages=num_stages, capture=capture, **arrays)

    def decode(self, q, *, plan: dict | None = None, return_lse=False, block_n: int = 64,
               splits: int | None = None, block_q: int | None = None, num_warps: int = 4, num_stages: int = 2,
               **arrays):
        """One split call: packed q [total_q, H_q, d_qk] (decode: [B, H_q, d_qk], the new token of
        every request), the cache by DESIGN §5's keys (k/v, k_cache/v_cache, block_table + kv_lens,
        kv_indptr + kv_indices + kv_last_page_len, kv_indptr for ragged, cache_batch_idx),
        optional ``q_lens`` / ``qo_indptr`` (request b's rows are q[qo_indptr[b]:qo_indptr[b+1]],
        at positions kv_lens[b] - q_lens[b] + i) and declared tensors by name.  Returns O
        [total_q, H_q, d_v] (and LSE [total_q, H_q])."""
        import torch
        p = self.program
        tensors = self.split_tensors(arrays)
        from_numpy = isinstance(q, np.ndarray)
        if not from_numpy:
            self._check_device({"q": q, **{n: a for n, a in arrays.items() if n in ("k", "v", "k_cache", "v_cache")},
                                **tensors})
        if len(q.shape) != 3 or tuple(q.shape[1:]) != (p.heads_q, p.d_qk):
            raise InputError(f"inputs: 'q' has shape {list(q.shape)}; a split call packs its query rows "
                             f"as [total_q, H_q={p.heads_q}, d_qk={p.d_qk}]")
        if plan is None:
            plan = self.decode_plan(arrays, block_n=block_n, splits=splits, tensors=tensors, block_q=block_q,
                                    total_q=int(q.shape[0]))
        elif int(q.shape[0]) != plan["total_q"]:
            raise InputError(f"inputs: 'q' has {int(q.shape[0])} packed rows; the plan was made for "
                             f"{plan['total_q']} (q_lens {np.asarray(_to_numpy(plan['q_lens'])).tolist()})")
        dtype = getattr(torch, TORCH_DTYPES[p.dtype])
        carry = torch.float32 if interpreted() and dtype == torch.bfloat16 else dtype
        dev = self.device if from_numpy else q.device

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
            plan["base"] = np.asarray(_to_numpy(plan["cache_rows"]), np.int64) * _rows_per_batch(
                p.cache.layout.value, k_cache)
        q_t = dev_tensor(np.asarray(q, np.float32), dtype).to(carry) if from_numpy else q
        launch = self.decode_args(plan, dev)
        tens = {n: device_tensor(t, dev) for n, t in tensors.items()}
        o, lse = self.module.decode(q_t, k_cache, v_cache, launch, num_warps=num_warps, num_stages=num_stages,
                                    **tens)
        if carry != dtype:
            o = o.to(dtype)
        if from_numpy:
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o


def load(program: ir.Program) -> Kernel:
    """The kernel of a spec: ``kernel(q, k, v, ...)`` for prefill/append over contiguous K/V,
    ``kernel.decode(q, ...)`` / ``kernel.run(arrays)`` for split-K/V calls (decode, append,
    mixed batches: packed query rows with q_lens / qo_indptr) over any cache layout."""
    return Kernel(program, emit(program))
