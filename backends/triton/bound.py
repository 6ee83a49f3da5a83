"""Bound calls: the path of a prefill call whose signature ran before (issue 34: host time per call).

A call's first run validates it, plans it and binds its launch (``prefill_calls``, ``launch``); a
later call with the same signature (``compiler.dispatch.signature``: shapes, strides, dtypes,
devices, alignments) would still walk every layer between the front door and Triton's C launcher,
each repeating a lookup the signature already settled.  Two objects skip them:

* :class:`BoundPrefill` -- the front door's bound call (``Attention``'s table of them, by
  signature): per call only what reads values -- the rows' non-finite rule
  (``Kernel._row_check``), the plan cache's entry for the call (a mask tensor's identity and
  version; a plan the cache dropped), the spec's tensor arguments -- then O and LSE and the
  launch.  It answers None where a check wants the validating path (rows checked at the host, a
  plan not in the cache): the caller takes that path, which raises what is wrong or re-plans.
  Its plan lookup and tensor arguments are :class:`BoundCall`'s, which the bound backward
  (``bound_backward.py``) shares.
* :class:`BoundLaunch` -- one launch key bound to its compiled kernel's C launcher
  (``raw_launch``): the arguments the key fixes made once and the TMA descriptors of q, k, v and
  O encoded once per address, so a call pays the stream, four lookups and the C call.  Where
  the launch cannot go raw (not compiled under the key yet, a Triton whose launcher
  ``raw_launch`` does not know, a tool hooking launches), it launches as ``PrefillLaunch`` does.

Neither holds a caller's tensor or a reference to its launch (the bound call's is weak; the
bound launches live on their launch): the plan cache owns plans and their device arrays.
"""
from __future__ import annotations

import weakref

from . import launch as L
from . import plans as P
from .raw_launch import RAW_DESCRIPTORS, TensorView, launches_hooked

_ROLES = {"q": 0, "k": 1, "v": 2, "o": 3}  # the Gluon engine's descriptor arguments (PrefillLaunch.gluon_args)


class BoundCall:
    """What a bound call of the front door (``BoundPrefill``, ``bound_backward.BoundBackward``) does per
    call before its launch: find its plan in the plan cache (``_launch_of``) and make the spec's tensor
    arguments (``_tensor_args``).  ``plan_key``: the plan cache's key where the mask reads no tensor;
    None where the plan is found by the mask tensors' identities and versions, per call
    (``_tensor_plan_key``, the subclass's)."""

    def __init__(self, kernel, bound, launch, plan_key):
        self.kernel, self.bound, self.plan_key = kernel, bound, plan_key
        self.launch = weakref.ref(launch)
        module = kernel.module
        self.ts = None if (module.LENGTHS or module.TENSORS) else ()
        self.lengths = None  # (kv_lens, qo_indptr) of the signature's lengths, where the spec reads them
        self.last = None  # (the mask tensors' ids and versions, the plan cache's key for them) of the last call
        self.stale = False  # whether a call found another plan (or none) in the cache than this one's

    def _launch_of(self, tensors: dict):
        """The launch of this call's plan, or None (``stale``: the plan cache holds another plan, or
        none, for it; the validating path re-plans and the front door binds again)."""
        pkey, named = self.plan_key, ()
        if pkey is None:  # (the plan's key by the mask tensors' identities and versions: made again when they move)
            kernel = self.kernel
            ids = kernel._tensor_ids(tensors)
            last = self.last
            if last is None or last[0] != ids:  # (the cache's own key object: later lookups match it by identity)
                last = self.last = (ids, P.PLANS.stored_key(self._tensor_plan_key(tensors)))
            named, pkey = [tensors[n] for n in kernel._tensor_names if n in tensors], last[1]
        launch = P.PLANS.get(pkey, named)
        if launch is None or launch is not self.launch():
            self.stale = True
            return None
        return launch

    def _tensor_args(self, tensors: dict, device):
        """The spec's tensor arguments: ``ts`` where the spec reads no tensor and no length, else made
        per call; the lengths of a spec that reads S_q or S_k are the signature's, made once."""
        ts = self.ts
        if ts is None:
            module = self.kernel.module
            if module.LENGTHS and self.lengths is None:
                b = self.bound
                self.lengths = L.uniform_lengths(b.batch, b.s_q, b.s_k, device)
            ts = L.tensor_args(module, tensors, self.lengths)
        return ts


class BoundLaunch:
    """``__call__(launch, q, k, v, ts, out, lse, flag)``: ``launch(q, k, v, ts, out, lse, key,
    flag=flag)`` of a ``PrefillLaunch`` with the same arguments, through the C launcher where it
    can.  Kept on its launch (``PrefillLaunch.bound_runs``, by MARK) and handed it per call: it
    holds no reference to the launch, so a plan the cache drops goes with its bound launches."""

    def __init__(self, launch, key, mark: int):
        self.key = key
        self.launcher = launch.launcher
        self.lkey = (key, mark)
        self.gluon = launch.config.engine == "gluon"
        self.grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        self.raw = None
        self.encoded = {role: {} for role in _ROLES}  # role -> {address: raw_launch.Encoded}
        self.counters: dict = {}  # stream -> the Gluon engine's job counter (launch._counter)
        self.runtime = L._knobs().runtime
        self.stream_of = self.device_of = None  # (Triton's active driver, asked once the launch goes raw)

    def __call__(self, launch, q, k, v, ts, out, lse, flag):
        raw = self.raw
        if raw is None:
            raw = self.raw = self._raw(launch)
        rt = self.runtime
        if raw is None or launches_hooked(rt):
            launch(q, k, v, ts, out, lse, self.key, flag=flag)
            return
        stream = self.stream_of(self.device_of())
        if self.gluon:
            counter = self._counter(launch, stream) if launch.schedule == 1 else launch.arrays["merged_partial"]
            args = launch.gluon_args(self._encoded(launch, "q", q), self._encoded(launch, "k", k),
                                     self._encoded(launch, "v", v), self._encoded(launch, "o", out), out, lse,
                                     counter, ts, flag)
        else:
            desc_k = desc_v = k
            if launch.config.use_tma:
                desc_k, desc_v = launch._tma_descriptor(k, "k"), launch._tma_descriptor(v, "v")
            args = launch.triton_args(q, k, v, out, lse, desc_k, desc_v, ts, flag)
        self._go(raw, stream, args)

    def _go(self, raw, stream, args) -> None:
        raw(self.grid, stream, args + self.launcher.tail)
        self.launcher.launches["raw"] += 1

    def _raw(self, launch):
        """The key's raw launch once the launcher has one (Gluon: with its four descriptors where
        ``gluon_args`` puts them); None until then, or where it has none."""
        raw = self.launcher.raw.get(self.lkey)
        if raw is None or (self.gluon and (launch.fp8 or launch.p_perm
                                           or tuple(raw.positions) != tuple(_ROLES.values()))):
            return None
        from triton.runtime import driver
        active = driver.active
        self.stream_of, self.device_of = active.get_current_stream, active.get_current_device
        return raw

    def _encoded(self, launch, role: str, t):
        """``t``'s descriptor for ``role``, encoded (the key fixes its shape and strides: its address
        tells encodings apart)."""
        table = self.encoded[role]
        address = t.data_ptr()
        hit = table.get(address)
        if hit is None:
            if role == "o":
                desc = TensorView(t, launch.o_cols)
            else:
                bn = launch.config.block_n
                desc = launch._gluon_descriptor(t, L.gluon_engine.ROWS if role == "q" else bn, role, keep=False)
            if len(table) >= RAW_DESCRIPTORS:
                table.clear()
            hit = table[address] = self.raw.encode(_ROLES[role], desc)
        return hit

    def _counter(self, launch, stream):
        c = self.counters.get(stream)
        if c is None:
            c = self.counters[stream] = L._counter(launch.device, stream)
        return c


class BoundPrefill(BoundCall):
    """A prefill call of one signature (``Kernel._key``'s), bound after it ran once:
    ``__call__(q, k, v, tensors)`` -> (O, LSE), or None where the call must take the validating path
    (``stale`` once that was because the plan cache holds another plan, or none, for it)."""

    def __init__(self, kernel, key, bound, launch):
        super().__init__(kernel, bound, launch, bound.plan_key)
        self.key = key
        self.lse_shape = (bound.batch, kernel.program.heads_q, bound.s_q)
        self.lkey = kernel._launch_key(bound, key)

    def _tensor_plan_key(self, tensors: dict):
        return self.kernel._plan_key(self.key, tensors=tensors)[1]

    def __call__(self, q, k, v, tensors: dict):
        kernel, bound = self.kernel, self.bound
        host, flag = kernel._row_check(q)
        if host:
            return None
        launch = self._launch_of(tensors)
        if launch is None:
            return None
        ts = self._tensor_args(tensors, q.device)
        if bound.bshd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = kernel._new_out(q, bound)
        lse = q.new_empty(self.lse_shape, dtype=kernel._torch.float32)
        mark = 0 if flag is None else 1
        runs = launch.bound_runs
        run = runs.get(mark)
        if run is None:
            run = runs[mark] = BoundLaunch(launch, self.lkey, mark)
        run(launch, q, k, v, ts, out.transpose(1, 2) if bound.bshd else out, lse, flag)
        return out, lse
