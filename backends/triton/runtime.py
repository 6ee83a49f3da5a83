"""The Triton backend's kernel object: a spec's generated module plus the library kernels, called
on torch tensors (or numpy arrays, copied to the device and back).

``kernel(q, k, v, **tensors)`` runs prefill / append over contiguous K/V; ``kernel.decode(q, ...)``
and ``kernel.run(arrays)`` run split-K/V calls (decode, append, mixed batches) over any cache
layout.  What a call runs with is the launch layer's decision (``launch.choose_prefill``); plans
come from the process's plan cache (``plans.PLANS``).

A prefill call's host path: the first call with a given key (shapes, strides, dtypes, device,
pointer alignments, the names and layouts of the mask's tensors) validates the call, chooses
the config, plans, uploads the plan and binds the launch; every later call with that key looks
the bound launch up (for masks reading tensors, by the tensors' identity and version), allocates
O and LSE and launches.  On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported; the tests do).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnc import fp8 as F
from attnc.compiler import inputs, ir, numerics
from attnc.compiler.ranges import may_be_nonfinite
from attnc.compiler.errors import BackendUnavailable, InputError, PlanError
from attnc.compiler.plan import Plan, plan as make_plan
from attnc.backends.common import load_module

from . import launch as L
from . import plans as P
from .decode import (DECODE_ARRAYS, GPU_MIN_TILE, KV_KEYS, _check_gpu_tile, _rows_per_batch,  # noqa: F401
                     _to_numpy, cache_strides, decode_plan, device_tensor, interpreted)
from .emit import Source, emit

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
# keyword options of a prefill call that are the launch layer's (everything else is a mask tensor)
PREFILL_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "use_tma", "walk", "mask_source", "head_group",
                   "engine", "schedule")
FP8_INPUTS = F.DESCALES  # an FP8 call's descales (attnc.fp8)


def _kind(t) -> str:
    import torch
    if t.dtype.is_floating_point:
        return "f"
    return "b" if t.dtype == torch.bool else "i"


class _Bound(NamedTuple):
    """What one prefill key fixes once it is validated: the call's lengths, O's shape in q's
    layout, whether that layout is bshd, and whether bf16 is carried in float32 (interpreter)."""

    batch: int
    s_q: int
    s_k: int
    out_shape: tuple
    bshd: bool
    emulate: bool


class Kernel:
    def __init__(self, program: ir.Program, source: Source):
        import torch  # (the launcher needs it; fail here with a clear import error)
        if not interpreted() and not torch.cuda.is_available():
            raise BackendUnavailable("the Triton backend runs on a CUDA GPU; on this machine (no CUDA device) "
                                     "set TRITON_INTERPRET=1 to run its kernels in Triton's CPU interpreter")
        self.program = program
        self.source = source
        self.module = load_module(source.text, source.module_stem)
        self.digest = ir.digest(program)
        self._tensor_names = tuple(t.name for t in program.tensors)
        self._mask_reads = bool(ir.loads(program.mask))
        self._scores_may_fail = may_be_nonfinite(program)
        self._bound: dict = {}
        self._splits: dict = {}
        self._torch = torch
        self._dtype = getattr(torch, TORCH_DTYPES[program.dtype])
        self._fp8 = getattr(torch, "float8_e4m3fn", None)
        self._unit_descales: dict = {}
        self._device = "cpu" if interpreted() or not torch.cuda.is_available() else "cuda"

    @property
    def device(self) -> str:
        return self._device

    # ------------------------------------------------------------ plans
    def default_config(self, capability: int | None = None) -> dict:
        """The Triton kernel's untuned prefill launch for this spec, before planning."""
        p = self.program
        return L.default_prefill_config(p.d_qk, p.d_v, interpreted(), capability, self._mask_reads)

    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None) -> Plan:
        """A plan made by the caller (FlashInfer's plan/run, Flex's BlockMask): pass it back as
        ``kernel(q, k, v, plan=...)``; its device arrays are kept on it."""
        default = self.default_config()
        bm, bn = block_m or default["BLOCK_M"], block_n or default["BLOCK_N"]
        _check_gpu_tile(bm, bn)
        host = {n: (t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t))
                for n, t in (tensors or {}).items()}
        host = {n: t.astype(np.int64) if t.dtype.kind in "iu" else t for n, t in host.items()}
        return make_plan(self.program, batch, s_q, s_k, host, bm, bn)

    def device_plan(self, plan: Plan, device) -> dict:
        """The plan's walk arrays on ``device`` (cached on the plan)."""
        cache = plan.__dict__.setdefault("_device_args", {})
        key = str(device)
        if key not in cache:
            cache[key] = P.upload(P.walk_arrays(plan), device)
        return cache[key]

    # ------------------------------------------------------------ prefill / append
    def __call__(self, q, k, v, *, plan: Plan | None = None, return_lse=False, **kwargs):
        """Prefill / append over contiguous K/V in the spec's layout (bhsd or bshd): returns O in
        q's layout (and LSE [B, H_q, S_q], natural log).  Keyword arguments are the spec's tensors
        and, optionally, launch options (PREFILL_OPTIONS: tiles, warps, stages, TMA, walk, mask
        source, head group, engine, schedule) that override the launch layer's choice."""
        options = {n: kwargs.pop(n) for n in PREFILL_OPTIONS if n in kwargs}
        if isinstance(q, np.ndarray):
            return self._numpy_call(q, k, v, kwargs, plan, options, return_lse)
        if q.dtype is self._fp8:
            o, lse = self._fp8_call(q, k, v, kwargs, plan, options)
            self._check_scores(lse, k)
            return (o, lse) if return_lse else o
        if plan is None and not any(v is not None for v in options.values()):
            try:
                key = self._key(q, k, v, kwargs)
            except (NotImplementedError, RuntimeError, AttributeError):
                key = None  # e.g. a meta tensor has no address: the validating path names what is wrong
            bound = self._bound.get(key)
            if bound is not None:
                o, lse = self._launch(bound, key, q, k, v, kwargs, None)
                self._check_scores(lse, k)
                return (o, lse) if return_lse else o
        o, lse = self._call_slow(q, k, v, kwargs, plan, options)
        self._check_scores(lse, k)
        return (o, lse) if return_lse else o

    # ------------------------------------------------------------ FP8 (e4m3) inputs
    def _fp8_call(self, q, k, v, tensors: dict, plan, options: dict):
        """An FP8 call (``attnc.fp8``): float8_e4m3fn q, k, v with per-(request, head) descales.  On
        the Gluon engine where it takes the call (Hopper, f16 / bf16 spec, bhsd, q.k and v head
        dims equal and 64 / 128 / 256): Q.K^T and P.V on FP8 tensor cores, V read transposed;
        elsewhere (or ``engine="triton"``) the inputs are dequantized to the spec's dtype and the
        call runs as usual -- the same attention of the same dequantized values.  O comes back in
        the spec's dtype."""
        descales = [tensors.pop(n, None) for n in FP8_INPUTS]
        key, bound, engine = self._fp8_route(q, k, v, tensors, descales, plan, options)
        d = self._fp8_descales(descales, bound, q.device)
        if not engine:
            axis = 2 if bound.bshd else 1
            qd, kd, vd = (F.dequantize(x, s.view(bound.batch, -1), self._dtype, heads_axis=axis)
                          for x, s in zip((q, k, v), d))
            return self(qd, kd, vd, plan=plan, return_lse=True, **tensors, **options)
        vt = F.v_transposed(v)
        launch = self._cached_launch(bound, key, q, k, vt, tensors, fp8=True) if key is not None else \
            self._make_launch(bound, q, k, vt, tensors, plan, options, fp8=True)
        return self._fp8_launch(launch, bound, key, q, k, vt, tensors, d)

    def _fp8_route(self, q, k, v, tensors: dict, descales: list, plan, options: dict, cache: bool = True):
        """(the call's key, or None for a call with a plan or options or not to ``cache``; what the
        key fixes; whether the FP8 engine runs it), validated once per key."""
        aligned = tuple(d.data_ptr() % 16 == 0 if hasattr(d, "data_ptr") else None for d in descales)
        key = ("fp8", self._key(q, k, v, tensors), aligned) if plan is None and not options and cache else None
        hit = self._bound.get(key) if key is not None else None
        if hit is None:
            hit = self._fp8_bind(q, k, v, tensors, plan, options)
            if key is not None:
                self._bound[key] = hit
        return (key, *hit)

    def _fp8_launch(self, launch, bound: _Bound, key, q, k, vt, tensors: dict, descales: tuple):
        out = self._torch.empty(bound.out_shape, device=q.device, dtype=self._dtype)
        lse = self._torch.empty((bound.batch, self.program.heads_q, bound.s_q), device=q.device,
                                dtype=self._torch.float32)
        ts = L.call_tensor_args(self.module, tensors, bound.batch, bound.s_q, bound.s_k, q.device)
        launch(q, k, vt, ts, out, lse, key, descales=descales)
        return out, lse

    def _fp8_bind(self, q, k, v, tensors: dict, plan, options: dict):
        """(what the call's key fixes, whether the Gluon engine runs it): validated once per key."""
        F.check_inputs(q, k, v)
        bound = self._validate(q, k, v, tensors, storage=False)._replace(emulate=False)
        p = self.program
        contiguous = L.tma_ready(q, k) and not bound.bshd
        refusal = None if p.d_qk == p.d_v and p.d_qk in (64, 128, 256) else \
            f"FP8 runs on the Gluon engine with equal q.k and v head dims of 64, 128 or 256, not {p.d_qk} / {p.d_v}"
        refusal = refusal or L.gluon_call_refusal(p, bound.s_q, bound.s_k, contiguous, L.capability(q.device),
                                                  L.gluon_default_tiles(p.d_qk, p.d_v, fp8=True))
        asked = options.get("engine")
        if asked == "gluon" and refusal:
            raise ValueError(f"engine='gluon': {refusal}")
        return bound, refusal is None and asked != "triton" and plan is None

    def _fp8_descales(self, descales: list, bound: _Bound, device) -> tuple:
        """The three descales as flat float32 device tensors [B * H] (``attnc.fp8.descale``)."""
        p = self.program
        return tuple(F.descale(name, d, (bound.batch, heads), device, self._unit_descales).view(-1)
                     for name, d, heads in zip(FP8_INPUTS, descales, (p.heads_q, p.heads_kv, p.heads_kv)))

    def _check_scores(self, lse, k=None, plan: dict | None = None):
        """The non-finite-score policy (compiler.numerics.check_rows): the kernels mark a row whose
        visible score was NaN or +inf with LSE NaN; a spec whose score program can produce one
        (compiler.ranges.may_be_nonfinite) pays one reduction and a host sync to raise it (a
        DecodeGraph checks after each replay; nothing is checked while a graph is captured)."""
        if not self._scores_may_fail or (lse.is_cuda and self._torch.cuda.is_current_stream_capturing()):
            return
        if plan is None:
            s_k = k.shape[1 if self.program.cache.layout is ir.Layout.BSHD else 2]
            numerics.check_rows(lse, s_q=lse.shape[2], s_k=s_k)
        else:
            numerics.check_rows(lse, qo_indptr=plan["qo_indptr"], kv_lens=plan["kv_lens"])

    def _key(self, q, k, v, tensors: dict) -> tuple:
        ts = tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                   if hasattr(t, "data_ptr") else (n, id(t)) for n, t in tensors.items())
        return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device, q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0,
                v.data_ptr() % 16 == 0, ts)

    def _validate(self, q, k, v, tensors: dict, *, storage: bool = True) -> _Bound:
        """Check a prefill call's devices, keys, shapes (and, ``storage``, that q/k/v are in the
        spec's dtype); what the call's key then fixes."""
        torch = self._torch
        stray = [n for n in FP8_INPUTS if n in tensors]
        if stray:
            raise InputError(f"inputs: '{stray[0]}' is given but q is {q.dtype}: descales go with float8_e4m3fn q, k "
                             "and v (attnc.fp8.quantize)")
        L.check_device({"q": q, "k": k, "v": v, **tensors}, self.device)
        metas = {n: (tuple(t.shape), _kind(t), str(t.dtype)) for n, t in {"q": q, "k": k, "v": v, **tensors}.items()}
        batch, s_q, s_k = inputs.check_shapes(self.program, metas)
        if storage and any(x.dtype != self._dtype for x in (q, k, v)):
            raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; "
                             f"the spec stores {self.program.dtype}")
        p = self.program
        bshd = p.cache.layout is ir.Layout.BSHD
        out_shape = (batch, s_q, p.heads_q, p.d_v) if bshd else (batch, p.heads_q, s_q, p.d_v)
        # The Triton interpreter (3.9) reads bf16 tensors as garbage: on the CPU, bf16 specs carry
        # their (already bf16-rounded) values in float32 and O is rounded to bf16 after.
        emulate = storage and self.emulates(self._dtype)
        return _Bound(batch, s_q, s_k, out_shape, bshd, emulate)

    def emulates(self, dtype) -> bool:
        """Whether tensors of ``dtype`` run as float32 here: the Triton interpreter (3.9) reads bf16
        tensors as garbage, so on the CPU bf16 values (already bf16-rounded) are carried in float32."""
        return interpreted() and dtype == self._torch.bfloat16

    def _call_slow(self, q, k, v, tensors: dict, plan, options: dict):
        """Validate the call, then bind it (no options, no plan given) or run it once as asked."""
        bound = self._validate(q, k, v, tensors)
        if plan is None and not any(v is not None for v in options.values()):
            key = self._key(q, k, v, tensors)
            self._bound[key] = bound
            return self._launch(bound, key, q, k, v, tensors, None)
        if plan is not None:
            plan.check_call(self.program, bound.batch, bound.s_q, bound.s_k)
        return self._launch(bound, None, q, k, v, tensors, (plan, options))

    def _launch(self, bound: _Bound, key, q, k, v, tensors: dict, asked):
        """Find (or make) the launch for this call's plan and run it.  ``asked``: (plan, options)
        of a call that overrides the launch layer; such calls are not cached by key."""
        torch = self._torch
        if bound.emulate:
            q, k, v = (x.float() for x in (q, k, v))
        if bound.bshd:  # strides carry the layout; the kernels index logical bhsd
            qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
        else:
            qb, kb, vb = q, k, v
        try:
            ts = L.call_tensor_args(self.module, tensors, bound.batch, bound.s_q, bound.s_k, q.device)
        except KeyError as e:
            raise InputError(f"inputs: missing key '{e.args[0]}'") from None
        if asked is None:
            launch = self._cached_launch(bound, key, qb, kb, vb, tensors)
        else:
            launch = self._make_launch(bound, qb, kb, vb, tensors, *asked)
        out = torch.empty(bound.out_shape, device=q.device, dtype=qb.dtype)
        lse = torch.empty((bound.batch, self.program.heads_q, bound.s_q), device=q.device, dtype=torch.float32)
        ob = out.transpose(1, 2) if bound.bshd else out
        self._run_launch(launch, qb, kb, vb, ts, ob, lse, key)
        if bound.emulate:
            out = out.to(torch.bfloat16)
        return out, lse

    def _run_launch(self, launch, qb, kb, vb, ts, ob, lse, key):
        try:
            launch(qb, kb, vb, ts, ob, lse, key)
        except Exception as e:  # the default may not fit a mask's extra loads: one stage fewer
            c = launch.config
            if c.origin != "default" or c.num_stages <= 1 or type(e).__name__ != "OutOfResources":
                raise
            launch.__init__(launch.module, L.replace(c, num_stages=c.num_stages - 1), launch.arrays,
                            (launch.batch, launch.s_q, launch.s_k), launch.device, launch.offsets, fp8=launch.fp8)
            self._run_launch(launch, qb, kb, vb, ts, ob, lse, key)

    def _plan_key(self, *key, tensors: dict) -> tuple[list, tuple]:
        """(the tensors the plan cache watches, the plan cache's key): the spec and ``key`` and,
        for a mask that reads tensors, each tensor's identity and version (plans.tensor_key)."""
        if not self._mask_reads:
            return [], (self.digest, *key)
        named = [tensors[n] for n in self._tensor_names if n in tensors]
        return named, (self.digest, *key, tuple(P.tensor_key(n, tensors[n]) for n in self._tensor_names if n in tensors))

    def _cached_launch(self, bound: _Bound, key, qb, kb, vb, tensors: dict, fp8: bool = False):
        named, pkey = self._plan_key(key, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None:
            import torch
            if qb.is_cuda and torch.cuda.is_current_stream_capturing():
                raise PlanError("a prefill call is being captured in a CUDA graph but its plan is not made yet: "
                                "run the call once before capture (its plan is then reused), and for a mask that "
                                "reads tensors, capture with the same tensors (a graph replays its plan)")
            launch = self._make_launch(bound, qb, kb, vb, tensors, None, {}, fp8=fp8)
            P.PLANS.put(pkey, launch, P.nbytes_of(launch.arrays), named)
        return launch

    def _make_launch(self, bound: _Bound, qb, kb, vb, tensors: dict, plan, options: dict, fp8: bool = False):
        """Choose the config and plan for this call and bind a launch (``launch.choose_prefill``);
        ``fp8``: an FP8 call the Gluon engine takes (``_fp8_bind``)."""
        from attnc.compiler import tune
        p = self.program
        asked = dict(options)
        tuned = None
        if plan is None and asked.get("block_m") is None and asked.get("block_n") is None and not fp8:
            tuned = tune.tuned_tiles(p, bound.batch, bound.s_q, bound.s_k, "triton")
        if fp8:
            asked["engine"] = "gluon"
        host = {n: (t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)) for n, t in tensors.items()}
        host = {n: a.astype(np.int64) if a.dtype.kind in "iu" else a for n, a in host.items()}
        made: dict = {}

        def plan_for(bm, bn):
            _check_gpu_tile(bm, bn)
            if not made:
                made[(bm, bn)] = make_plan(p, bound.batch, bound.s_q, bound.s_k, host, bm, bn)
            elif (bm, bn) not in made:  # the mask analysis is reused; only the tiles change
                made[(bm, bn)] = next(iter(made.values())).retile(bm, bn)
            return made[(bm, bn)]

        # (the Gluon engine writes O through a bhsd view: bshd outputs take the Triton kernel; an FP8
        # call's V is V^T, whose layout _fp8_bind checked)
        contiguous = L.tma_ready(qb, kb, vb if not fp8 else qb) and not bound.bshd
        config, plan = L.choose_prefill(p, bound.s_q, bound.s_k, plan_for, asked=asked, tuned=tuned,
                                        contiguous=contiguous, device_capability=L.capability(qb.device),
                                        given_plan=plan, fp8=fp8)
        arrays = self.device_plan(plan, qb.device)
        return L.PrefillLaunch(self.module, config, arrays, (bound.batch, bound.s_q, bound.s_k), qb.device, fp8=fp8)

    def prepare(self, q, k, v, *, plan: Plan | None = None, **kwargs):
        """A prefill call bound once and run many times (the tuner's and the studies' timing
        loop): returns ``run()`` -> (O, LSE), each run allocating O and LSE and launching with the
        config ``kwargs``' options select (torch inputs in the spec's layout)."""
        options = {n: kwargs.pop(n) for n in PREFILL_OPTIONS if n in kwargs}
        tensors = kwargs
        if q.dtype is self._fp8:
            return self._fp8_prepare(q, k, v, tensors, plan, options)
        # (the tuner carries bf16 values in float32 under the interpreter: no storage check)
        bound = self._validate(q, k, v, tensors, storage=False)
        qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v)) if bound.bshd else (q, k, v)
        launch = self._make_launch(bound, qb, kb, vb, tensors, plan, options)
        ts = L.call_tensor_args(self.module, tensors, bound.batch, bound.s_q, bound.s_k, q.device)
        torch = self._torch
        key = ("prepared", id(launch))  # one binding: the arguments' specialization is fixed

        def run():
            out = torch.empty(bound.out_shape, device=q.device, dtype=q.dtype)
            lse = torch.empty((bound.batch, self.program.heads_q, bound.s_q), device=q.device, dtype=torch.float32)
            self._run_launch(launch, qb, kb, vb, ts, out.transpose(1, 2) if bound.bshd else out, lse, key)
            return out, lse
        run.config = launch.config
        run.launch = launch
        return run

    def _fp8_prepare(self, q, k, v, tensors: dict, plan, options: dict):
        """``prepare`` of an FP8 call: its launch bound once (the dequantizing path: the call)."""
        descales = [tensors.pop(n, None) for n in FP8_INPUTS]
        _, bound, engine = self._fp8_route(q, k, v, tensors, descales, plan, options, cache=False)
        if not engine:
            run = lambda: self._fp8_call(q, k, v, dict(zip(FP8_INPUTS, descales), **tensors), plan, options)  # noqa: E731
            run.config = None
            return run
        d = self._fp8_descales(descales, bound, q.device)
        vt = F.v_transposed(v)
        launch = self._make_launch(bound, q, k, vt, tensors, plan, options, fp8=True)
        key = ("prepared", id(launch))

        def run():
            return self._fp8_launch(launch, bound, key, q, k, vt, tensors, d)
        run.config = launch.config
        run.launch = launch
        return run

    def config_for(self, q, k, v, **tensors) -> L.PrefillConfig:
        """The config an untuned call with these inputs runs (binds it if needed)."""
        if q.dtype is self._fp8:
            self(q, k, v, **tensors)  # binds
            descales = [tensors.pop(n, None) for n in FP8_INPUTS]
            key, bound, engine = self._fp8_route(q, k, v, tensors, descales, None, {})
            if not engine:
                return self.config_for(*(x.to(self._dtype) for x in (q, k, v)), **tensors)
                return self._cached_launch(bound, key, q, k, F.v_transposed(v), tensors, fp8=True).config
        self(q, k, v, **tensors)  # binds
        key = self._key(q, k, v, tensors)
        bound = self._bound[key]
        launch = self._cached_launch(bound, key, *(x.transpose(1, 2) if bound.bshd else x for x in (q, k, v)),
                                     tensors)
        return launch.config

    def _numpy_call(self, q, k, v, tensors: dict, plan, options: dict, return_lse: bool):
        """numpy inputs: validated, copied to the kernel's device in the spec's dtype, and back."""
        torch = self._torch
        call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors})
        dev = self.device
        q_t, k_t, v_t = (torch.as_tensor(np.ascontiguousarray(x), device=dev).to(self._dtype)
                         for x in (call.q, call.k, call.v))
        if self.program.cache.layout is ir.Layout.BSHD:  # validate gave bhsd; the call takes the spec's layout
            q_t, k_t, v_t = (x.transpose(1, 2) for x in (q_t, k_t, v_t))
        ts = {n: device_tensor(t, dev) for n, t in call.tensors.items()}
        o, lse = self._call_slow(q_t, k_t, v_t, ts, plan, options) if plan is not None or any(
            v is not None for v in options.values()) else self(q_t, k_t, v_t, return_lse=True, **ts)
        o = o.float().cpu().numpy()
        lse = lse.cpu().numpy()
        return (o, lse) if return_lse else o

    # ------------------------------------------------------------ blocks of a larger call
    def block(self, q, k, v, args: dict, tensors: dict, lengths: tuple[int, int]):
        """Partial (O float32, LSE) of one block of a larger call at its absolute positions
        (context parallelism: ``blocks.forward``); bhsd q, k, v."""
        from . import blocks
        return blocks.forward(self, q, k, v, args, tensors, lengths)

    def block_backward(self, q, k, v, o, lse, do, dlse, args: dict, tensors: dict, lengths: tuple[int, int]):
        """Partial (dQ, dK, dV) float32 of one block of a larger call (``blocks.backward``)."""
        from . import blocks
        return blocks.backward(self, q, k, v, o, lse, do, dlse, args, tensors, lengths)

    # ------------------------------------------------------------ backward
    def backward(self, q, k, v, o, lse, do, dlse=None, *, config=None, **tensors):
        """dQ, dK, dV of a prefill call from its saved O and LSE and the gradient of O (``dlse``: of
        LSE, optional).  Inputs in the spec's layout as for the forward; gradients come back in
        the layout and dtype of q, k and v.  Planned from the same mask analysis as the forward and
        cached like it (``grad.BackwardLaunch``)."""
        return self._backward(q, k, v, o, lse, do, dlse, config, tensors, ())[:3]

    def backward_with_tensors(self, q, k, v, o, lse, do, dlse, tensors: dict, want: tuple[str, ...],
                              config=None):
        """(dQ, dK, dV, {name: gradient}) with the gradients of the score tensors named in ``want``
        (``score_grads``: each must be a float tensor the score program reads by plain positions)."""
        from . import score_grads
        for n in want:
            why = score_grads.refusal(self.program, n)
            if why is not None:
                raise InputError(f"inputs: tensor '{n}' requires grad: {why}")
        return self._backward(q, k, v, o, lse, do, dlse, config, tensors, tuple(want))

    def _backward(self, q, k, v, o, lse, do, dlse, config, tensors: dict, want: tuple):
        from . import grad as G
        torch = self._torch
        try:  # everything the checks, the config and the launch's specialization depend on
            key = (self._key(q, k, v, tensors), o.shape, o.stride(), do.shape, do.stride(), lse.shape,
                   o.data_ptr() % 16 == 0, do.data_ptr() % 16 == 0, None if dlse is None else dlse.shape)
        except (NotImplementedError, RuntimeError, AttributeError):
            key = None  # (e.g. a meta tensor has no address: the checks name what is wrong)
        hit = self._bound.get(("backward", key, config)) if key is not None else None
        if hit is None:  # validated once per key, as the forward's calls are
            bound, cfg = self._backward_bind(q, k, v, o, lse, do, dlse, tensors, config)
            hit = (bound, cfg, None if self._mask_reads else self._plan_key("backward", key, cfg, tensors=tensors))
            if key is not None:
                self._bound[("backward", key, config)] = hit
        bound, cfg, fixed = hit  # (a mask that reads no tensor: its plan key is the call key's)
        named, pkey = fixed if fixed is not None else self._plan_key("backward", key, cfg, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None:
            (bm1, bn1), (bm2, bn2) = cfg.tiles()
            for bm, bn in cfg.tiles():
                _check_gpu_tile(bm, bn)
            dq_plan = self.plan(bound.batch, bound.s_q, bound.s_k, tensors, bm2, bn2)
            dkdv_plan = dq_plan.retile(bm1, bn1)
            launch = G.BackwardLaunch(self.module, cfg, dkdv_plan, dq_plan, (bound.batch, bound.s_q, bound.s_k),
                                      q.device)
            P.PLANS.put(pkey, launch, launch.nbytes, named)
        if bound.emulate:
            q, k, v, o, do = (x.float() for x in (q, k, v, o, do))
        dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
        views = (q, k, v, o, do, dq, dk, dv)
        if bound.bshd:
            views = tuple(x.transpose(1, 2) for x in views)
        qb, kb, vb, ob, dob, dqb, dkb, dvb = views
        lse = lse.contiguous()
        dlse = dlse.contiguous() if dlse is not None else None
        ts = L.call_tensor_args(self.module, tensors, bound.batch, bound.s_q, bound.s_k, q.device)
        launch(qb, kb, vb, ob, lse, dob, dlse, ts, dqb, dkb, dvb,
               key if not bound.emulate else None)
        dts = {}
        if want:
            from . import score_grads
            dts = score_grads.tensor_gradients(self, launch, qb, kb, vb, ob, lse, dob, dlse, ts, tensors, want)
        if bound.emulate:
            dq, dk, dv = (x.to(torch.bfloat16) for x in (dq, dk, dv))
        return dq, dk, dv, dts

    def _backward_bind(self, q, k, v, o, lse, do, dlse, tensors: dict, config):
        """(what a backward call's key fixes, its config): the call's checks, once per key."""
        from . import grad as G
        bound = self._validate(q, k, v, tensors)
        for n, t, shape in (("o", o, bound.out_shape), ("do", do, bound.out_shape),
                            ("lse", lse, (bound.batch, self.program.heads_q, bound.s_q))):
            if tuple(t.shape) != tuple(shape):
                raise InputError(f"inputs: '{n}' has shape {list(t.shape)}; this call's is {list(shape)}")
        if dlse is not None and tuple(dlse.shape) != tuple(lse.shape):
            raise InputError(f"inputs: 'dlse' has shape {list(dlse.shape)}; LSE's is {list(lse.shape)}")
        p = self.program
        return bound, config or G.default_backward_config(p.d_qk, p.d_v, interpreted())

    # ------------------------------------------------------------ split calls (decode, append, mixed)
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
                from .shared_shift import ShiftLaunch
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
        n = L.workspace_bytes(self.module, total_q, splits, self.program.state.value)
        return self._torch.empty(n, device=device, dtype=self._torch.uint8)

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
        from .graph import DecodeGraph
        return DecodeGraph(self, q, max_kv_len=max_kv_len, block_n=block_n, splits=splits, block_q=block_q,
                           num_warps=num_warps, num_stages=num_stages, capture=capture, **arrays)

    def _bind_split(self, plan: dict, device, k_cache, v_cache, tensors: dict, num_warps, num_stages) -> "_Split":
        """A split call's plan bound to the K/V tensors it reads (their strides, a contiguous cache's
        row bases), uploaded to ``device`` in one copy, with its launch."""
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
            ws = 0
        else:
            launch = self.split_launch(num_warps or plan.get("num_warps", 4), num_stages or plan.get("num_stages", 2))
            ws = L.workspace_bytes(self.module, plan["total_q"], plan["splits"], p.state.value)
        ts = L.tensor_args(self.module, {n: device_tensor(t, device) for n, t in tensors.items()},
                           (arrays["kv_lens"], arrays["qo_indptr"]))
        return _Split(plan, arrays, ts, launch, ws)

    def _launch_split(self, bound: "_Split", q, k_cache, v_cache):
        """Allocate O, LSE and the workspace; launch the producer and the combine."""
        torch = self._torch
        total_q = q.shape[0]
        out = torch.empty(total_q, self.program.heads_q, self.program.d_v, device=q.device, dtype=q.dtype)
        lse = torch.empty(total_q, self.program.heads_q, device=q.device, dtype=torch.float32)
        ws = torch.empty(bound.workspace_bytes, device=q.device, dtype=torch.uint8)
        return bound.launch(q, k_cache, v_cache, bound.plan, bound.arrays, bound.ts, out, lse, ws)

    def prepare_decode(self, q, plan: dict, *, num_warps: int | None = None, num_stages: int | None = None,
                       **arrays):
        """A split call with its plan uploaded once: returns ``run()`` -> (O, LSE) (torch inputs on
        the kernel's device)."""
        tensors = self.split_tensors(arrays)
        k_cache, v_cache = arrays.get("k_cache", arrays.get("k")), arrays.get("v_cache", arrays.get("v"))
        bound = self._bind_split(plan, q.device, k_cache, v_cache, tensors, num_warps, num_stages)
        return lambda: self._launch_split(bound, q, k_cache, v_cache)

    # A split call's plan depends on its metadata (lengths, page tables, query rows, mask tensors);
    # a call whose inputs are all torch tensors is cached under their identity and version, as a
    # prefill call's mask tensors are: the layers of a model's decode step share one plan, and a
    # step that changes the metadata in place (kv_lens += 1) makes a new one.
    def _split_key(self, q, arrays: dict):
        parts, objects = [], []
        for n in sorted(arrays):
            part = _split_key_part(n, arrays[n])
            if part is None:
                return None, None
            parts.append(part)
            objects.append(None if n in KV_KEYS else arrays[n])
        return (self.digest, "split", q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
                tuple(parts)), objects

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
            cache_key = cache_key if cache_key is None or engine is None else (*cache_key, engine)
            bound = P.PLANS.get(cache_key, cache_objects) if cache_key is not None else None
            if bound is not None:  # the plan for this metadata, made and uploaded by an earlier call
                o, lse = self._launch_split(bound, q, arrays.get("k_cache", arrays.get("k")),
                                            arrays.get("v_cache", arrays.get("v")))
                self._check_scores(lse, plan=bound.plan)
                return (o, lse) if return_lse else o
        tensors = self.split_tensors(arrays)
        if not from_numpy:
            L.check_device({"q": q, **{n: a for n, a in arrays.items() if n in KV_KEYS}, **tensors}, self.device)
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
        bound = self._bind_split(plan, dev, k_cache, v_cache, tensors, num_warps, num_stages)
        o, lse = self._launch_split(bound, q_t, k_cache, v_cache)
        self._check_scores(lse, plan=bound.plan)
        if cache_key is not None:
            P.PLANS.put(cache_key, bound, P.nbytes_of(bound.arrays), cache_objects)
        o = o.to(self._dtype) if carry != self._dtype else o
        if from_numpy:
            o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        return (o, lse) if return_lse else o


class _Split(NamedTuple):
    """A split call bound once: its plan (with the K/V strides), the plan's arrays on the device,
    the mask tensors' argument tuple, the launch and the workspace's size."""

    plan: dict
    arrays: dict
    ts: tuple
    launch: L.SplitLaunch
    workspace_bytes: int


def _split_key_part(n, t):
    """A split call's input as a plan-cache key part: metadata and mask tensors by identity and
    version (and layout); the K/V tensors by layout and address only (the plan never reads their
    values, and a step writes new tokens into them); anything else makes the call uncacheable."""
    if not P._tracked(t):
        return None
    if n in KV_KEYS:
        return (n, tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr())
    return (n, tuple(t.shape), t.stride(), t.dtype, t.device, *P.tensor_key(n, t))


def load(program: ir.Program) -> Kernel:
    """The kernel of a spec: ``kernel(q, k, v, ...)`` for prefill/append over contiguous K/V,
    ``kernel.decode(q, ...)`` / ``kernel.run(arrays)`` for split-K/V calls (decode, append, mixed
    batches: packed query rows with q_lens / qo_indptr) over any cache layout."""
    return Kernel(program, emit(program))
