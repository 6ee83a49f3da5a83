"""The Triton kernel's prefill / append calls over contiguous K/V (``Kernel.__call__``, ``prepare``,
FP8 inputs, ``config_for``): a mixin of ``runtime.Kernel``."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from attnc import fp8 as F, layouts
from attnc.compiler import inputs, ir
from attnc.compiler.dispatch.signature import NO_ADDRESS
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.plan import Plan, plan as make_plan

from . import choice, device, tile_classes
from . import launch as L
from . import plans as P
from .args import FP8_INPUTS, PREFILL_OPTIONS, _Bound
from .decode import GPU_MIN_TILE, _check_gpu_tile, device_tensor


def runnable_tiles(tuned: dict | None) -> dict | None:
    """A tuned config, or None where this machine cannot launch its tiles (a hand-edited cache's
    8-row tile on a GPU): then the untuned default runs, never an error."""
    if tuned and not device.interpreted() and min(tuned.get("BLOCK_M", GPU_MIN_TILE),
                                                  tuned.get("BLOCK_N", GPU_MIN_TILE)) < GPU_MIN_TILE:
        return None
    return tuned


class PrefillCalls:
    def __call__(self, q, k, v, *, plan: Plan | None = None, return_lse=False, **kwargs):
        """Prefill / append over contiguous K/V in the spec's layout (bhsd or bshd): returns O in
        q's layout (and LSE [B, H_q, S_q], natural log).  Keyword arguments are the spec's tensors
        and, optionally, launch options (PREFILL_OPTIONS: tiles, warps, stages, TMA, walk, mask
        source, head group, engine, schedule) that override the launch layer's choice."""
        options = {n: kwargs.pop(n) for n in PREFILL_OPTIONS if n in kwargs} \
            if kwargs and not kwargs.keys().isdisjoint(PREFILL_OPTIONS) else {}
        if isinstance(q, np.ndarray):
            return self._numpy_call(q, k, v, kwargs, plan, options, return_lse)
        if not isinstance(q, self._torch.Tensor):
            raise InputError(f"inputs: 'q' is a {type(q).__name__}; the Triton backend takes torch tensors (or q, k, v "
                             "and every tensor as numpy arrays)")
        if q.dtype is self._fp8:
            o, lse = self._fp8_call(q, k, v, kwargs, plan, options)
            return (o, lse) if return_lse else o
        check = self._row_check(q)
        if plan is None and (not options or not any(v is not None for v in options.values())):
            try:
                key = self._key(q, k, v, kwargs)
            except NO_ADDRESS:
                key = None  # e.g. a meta tensor has no address: the validating path names what is wrong
            bound = self._bound.get(key)
            if bound is not None:
                o, lse, marked = self._launch(bound, key, q, k, v, kwargs, None, check[1])
                self._check_scores(lse, check, k, marked=marked)
                return (o, lse) if return_lse else o
        o, lse, marked = self._call_slow(q, k, v, kwargs, plan, options, check[1])
        self._check_scores(lse, check, k, marked=marked)
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
        if not engine:  # (the dequantized call checks its own rows)
            axis = 2 if bound.bshd else 1
            qd, kd, vd = (F.dequantize(x, s.view(bound.batch, -1), self._dtype, heads_axis=axis)
                          for x, s in zip((q, k, v), d))
            return self(qd, kd, vd, plan=plan, return_lse=True, **tensors, **options)
        vt = F.v_transposed(v)
        launch = self._cached_launch(bound, key, q, k, vt, tensors, fp8=True) if key is not None else \
            self._make_launch(bound, q, k, vt, tensors, plan, options, fp8=True)
        o, lse = self._fp8_launch(launch, bound, key, q, k, vt, tensors, d)
        self._check_scores(lse, self._row_check(q), k)
        return o, lse

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
        contiguous = device.tma_ready(q, k) and not bound.bshd
        refusal = None if p.d_qk == p.d_v and p.d_qk in (64, 128, 256) else \
            f"FP8 runs on the Gluon engine with equal q.k and v head dims of 64, 128 or 256, not {p.d_qk} / {p.d_v}"
        layouts_ = choice.BHSD_LAYOUTS if contiguous else choice.FP8_LAYOUT_REFUSAL
        refusal = refusal or choice.gluon_call_refusal(p, bound.s_q, bound.s_k, layouts_, device.capability(q.device),
                                                       choice.gluon_default_tiles(p.d_qk, p.d_v, fp8=True))
        asked = options.get("engine")
        if asked == "gluon" and refusal:
            raise ValueError(f"engine='gluon': {refusal}")
        return bound, refusal is None and asked != "triton" and plan is None

    def _fp8_descales(self, descales: list, bound: _Bound, device) -> tuple:
        """The three descales as flat float32 device tensors [B * H] (``attnc.fp8.descale``)."""
        p = self.program
        return tuple(F.descale(name, d, (bound.batch, heads), device, self._unit_descales).view(-1)
                     for name, d, heads in zip(FP8_INPUTS, descales, (p.heads_q, p.heads_kv, p.heads_kv)))

    def _call_slow(self, q, k, v, tensors: dict, plan, options: dict, flag=None):
        """Validate the call, then bind it (no options, no plan given) or run it once as asked:
        (O, LSE, whether the launch marked ``flag``)."""
        bound = self._validate(q, k, v, tensors)
        if plan is None and not any(v is not None for v in options.values()):
            key = self._key(q, k, v, tensors)
            named, plan_key = self._plan_key(key, tensors=tensors)
            bound = self._bound[key] = bound._replace(plan_key=None if named else plan_key)
            return self._launch(bound, key, q, k, v, tensors, None, flag)
        if plan is not None:
            plan.check_call(self.program, bound.batch, bound.s_q, bound.s_k)
        return self._launch(bound, None, q, k, v, tensors, (plan, options), flag)

    def _launch(self, bound: _Bound, key, q, k, v, tensors: dict, asked, flag=None):
        """Find (or make) the launch for this call's plan and run it: (O, LSE, whether the launch
        marked the non-finite ``flag``).  ``asked``: (plan, options) of a call that overrides the
        launch layer: with options alone they are cached under the call's key and the options (a
        plan given is the caller's: not cached)."""
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
        elif asked[0] is None and (okey := self._options_key(q, k, v, tensors, asked[1])) is not None:
            key = okey  # launch options, no plan: cached like any call, keyed with them
            launch = self._cached_launch(bound, key, qb, kb, vb, tensors, options=asked[1])
        else:
            launch = self._make_launch(bound, qb, kb, vb, tensors, *asked)
        out = self._new_out(qb, bound)
        lse = qb.new_empty((bound.batch, self.program.heads_q, bound.s_q), dtype=torch.float32)
        ob = out.transpose(1, 2) if bound.bshd else out
        # (the launch's key fixes the arguments' specialization: the plan key, hashed once, holds the call's)
        self._run_launch(launch, qb, kb, vb, ts, ob, lse, self._launch_key(bound, key), flag)
        if bound.emulate:
            out = out.to(torch.bfloat16)
        return out, lse, flag is not None and launch.marks

    def bind_call(self, key, tensors: dict):
        """The bound call (``bound.BoundPrefill``) of calls whose ``_key`` is ``key``, once a call with
        it ran here (validated, planned, launched); None where there is none to bind: no such call
        yet, a carried dtype (the interpreter's bf16), an FP8 launch, or its plan no longer cached."""
        bound = self._bound.get(key)
        if bound is None or bound.emulate:
            return None
        named, pkey = ((), bound.plan_key) if bound.plan_key is not None else self._plan_key(key, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None or launch.fp8:
            return None
        from .bound import BoundPrefill
        return BoundPrefill(self, key, bound, launch)

    @staticmethod
    def _launch_key(bound: _Bound, key):
        """The key a bound call's launch goes under: the plan key where the mask reads no tensor (made
        once), else the call's key (it fixes every argument's specialization either way)."""
        return key if bound.plan_key is None else bound.plan_key

    @staticmethod
    def _new_out(qb, bound: _Bound):
        """O in the spec's layout and the order the call returns it in (``attnc.layouts.out_order``:
        token-major where a bhsd spec's q is a token-major view); qb's dtype and device."""
        if bound.out_order == layouts.BSHD:
            return layouts.new_out(qb, bound.out_shape, layouts.BSHD)
        return qb.new_empty(bound.out_shape)  # (new_empty: the cheapest allocation call)

    @staticmethod
    def _o_order(bound: _Bound) -> str:
        """The order of the launch's logical bhsd O (``_new_out``'s, a bshd spec's transposed)."""
        if not bound.bshd:
            return bound.out_order
        b, s, h, d = bound.out_shape
        return layouts.order_of((b, h, s, d), layouts.out_strides((b, h, s, d), layouts.BSHD))

    def _run_launch(self, launch, qb, kb, vb, ts, ob, lse, key, flag=None):
        self._check_values(vb)  # (after the checks and the plan, as on numpy; vb is logical bhsd)
        try:
            launch(qb, kb, vb, ts, ob, lse, key, flag=flag)
        except Exception as e:  # the default may not fit a mask's extra loads: one stage fewer
            c = launch.config
            if c.origin != "default" or c.num_stages <= 1 or type(e).__name__ != "OutOfResources":
                raise
            launch.__init__(launch.module, replace(c, num_stages=c.num_stages - 1), launch.arrays,
                            (launch.batch, launch.s_q, launch.s_k), launch.device, launch.offsets, fp8=launch.fp8)
            self._run_launch(launch, qb, kb, vb, ts, ob, lse, key, flag)

    def _plan_key(self, *key, tensors: dict) -> tuple[list, object]:
        """(the tensors the plan cache watches, the plan cache's key): the spec and ``key`` and,
        for a mask that reads tensors, each tensor's identity and version (plans.tensor_key).  A
        mask that reads no tensor watches none; the key is a ``plans.Key`` (its hash made once: a
        binding, or a bound call while the tensors stay the same, keeps it)."""
        if not (self._mask_reads or self._index_reads):  # (a subscript that reads a tensor: its reads' check)
            return [], P.Key((self.digest, *key))
        named = [tensors[n] for n in self._tensor_names if n in tensors]
        return named, P.Key((self.digest, *key, self._tensor_ids(tensors)))

    def _tensor_ids(self, tensors: dict) -> tuple:
        """The mask tensors' identities and versions (``plans.tensor_key``), in the spec's order."""
        return tuple(P.tensor_key(n, tensors[n]) for n in self._tensor_names if n in tensors)

    def _options_key(self, q, k, v, tensors: dict, options: dict):
        """The key of a validated call with launch ``options`` (and no plan): its call key and the
        options given, or None where an option's value cannot be a key (the call runs uncached)."""
        asked = tuple(sorted((n, x) for n, x in options.items() if x is not None))
        try:
            hash(asked)
        except TypeError:
            return None
        return ("options", self._key(q, k, v, tensors), asked)

    def _cached_launch(self, bound: _Bound, key, qb, kb, vb, tensors: dict, fp8: bool = False, options=None):
        if bound.plan_key is not None:
            named, pkey = (), bound.plan_key
        else:
            named, pkey = self._plan_key(key, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None:
            import torch
            if qb.is_cuda and torch.cuda.is_current_stream_capturing():
                raise PlanError("a prefill call is being captured in a CUDA graph but its plan is not made yet: "
                                "run the call once before capture (its plan is then reused), and for a mask that "
                                "reads tensors, capture with the same tensors (a graph replays its plan)")
            launch = self._make_launch(bound, qb, kb, vb, tensors, None, dict(options or {}), fp8=fp8)
            P.PLANS.put(pkey, launch, P.nbytes_of(launch.arrays), named)
        return launch

    def _make_launch(self, bound: _Bound, qb, kb, vb, tensors: dict, plan, options: dict, fp8: bool = False):
        """Choose the config and plan for this call and bind a launch (``choice.choose_prefill``);
        ``fp8``: an FP8 call the Gluon engine takes (``_fp8_bind``)."""
        from attnc.compiler import tune
        p = self.program
        asked = dict(options)
        tuned = None
        if plan is None and asked.get("block_m") is None and asked.get("block_n") is None and not fp8:
            tuned = runnable_tiles(tune.tuned_tiles(p, bound.batch, bound.s_q, bound.s_k, "triton"))
        if fp8:
            asked["engine"] = "gluon"
        host = {n: (t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)) for n, t in tensors.items()}
        host = {n: a.astype(np.int64) if a.dtype.kind in "iu" else a for n, a in host.items()}
        made: dict = {}
        evaluator = tile_classes.tile_evaluator(self.module, tensors, bound.batch, bound.s_q, bound.s_k, qb.device)

        def plan_for(bm, bn):
            _check_gpu_tile(bm, bn)
            if not made:  # (tiles an inexact analysis leaves undecided: classified on the GPU)
                made[(bm, bn)] = make_plan(p, bound.batch, bound.s_q, bound.s_k, host, bm, bn,
                                           tile_evaluator=evaluator)
            elif (bm, bn) not in made:  # the mask analysis is reused; only the tiles change
                made[(bm, bn)] = next(iter(made.values())).retile(bm, bn)
            return made[(bm, bn)]

        # (an FP8 call's V is V^T, whose layout _fp8_bind checked, and it reads bhsd q and k; other calls'
        # q, k, v and O are read and written contiguous or token-major: choice.gluon_layouts)
        contiguous = device.tma_ready(qb, kb, vb if not fp8 else qb) and not bound.bshd
        layouts_ = None if fp8 else choice.gluon_layouts(qb, kb, vb, self._o_order(bound))
        config, plan = choice.choose_prefill(p, bound.s_q, bound.s_k, plan_for, asked=asked, tuned=tuned,
                                             contiguous=contiguous, device_capability=device.capability(qb.device),
                                             given_plan=plan, fp8=fp8, layouts=layouts_)
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
            out = self._new_out(q, bound)
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

    def config_for(self, q, k, v, **tensors) -> choice.PrefillConfig:
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
        ts = {n: device_tensor(t, dev, n) for n, t in call.tensors.items()}
        self._at_call.on = True  # (the rows come back to the host: non-finite rows raise at the call)
        try:
            if plan is not None or any(v is not None for v in options.values()):
                o, lse, _ = self._call_slow(q_t, k_t, v_t, ts, plan, options)
                self._check_scores(lse, self._row_check(q_t), k_t)
            else:
                o, lse = self(q_t, k_t, v_t, return_lse=True, **ts)
        finally:
            self._at_call.on = False
        o = o.float().cpu().numpy()
        lse = lse.cpu().numpy()
        return (o, lse) if return_lse else o
