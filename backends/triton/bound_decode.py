"""Bound split calls: the path of a decode call whose signature ran before (issue 34: host time per
call), as ``bound.py`` is prefill's.

A split call (``Attention.decode``) goes through the front door's route, the backend's ``decode``
and ``SplitCalls.decode``: its keyword handling, the plan cache's key for its metadata, the plan
cache, the row check, three allocations and the two launches (``SplitCall``: the producer and the
combine, each through ``Launcher.launch``).  Once a call of a given signature
(``compiler.dispatch.signature.split_signature``: the shapes, strides, dtypes, devices and
alignments of q and of every cache input, in the caller's order) has run, two objects skip the
layers:

* :class:`BoundDecode` -- the front door's bound split call (``Attention``'s table of them, by
  signature).  The plan depends on the metadata's values (kv_lens, the page table): it is found
  as the validating path finds it, in the plan cache under the metadata tensors' identities and
  versions and the K/V tensors' addresses (``SplitCalls._split_key``), and where a call's
  metadata is not the one a cached plan was made from (a new tensor, one changed in place, one
  the cache dropped), the bound call answers None: the validating path plans it, which checks
  the values (kv_lens within the cache, the table's entries in range) and raises what is wrong.
  Per call, then, only what reads values: the tensors' identities, versions and addresses (the
  plan cache's key for them kept, by them), the plan cache's entry, the rows' non-finite rule
  (``Kernel._row_check``); then O, LSE and the workspace and the launches, and the non-finite
  rule applied to LSE as the validating path applies it (``Kernel._check_scores``).
* :class:`BoundSplit` -- one plan's producer and combine bound to their compiled kernels' C
  launchers (``raw_launch``): the arguments the plan fixes made once, so a call pays the stream,
  two argument tuples and the two C calls.  Where the launches cannot go raw (not compiled under
  their keys yet, a Triton whose launcher ``raw_launch`` does not know, a tool hooking launches,
  a sink the combine reads per call, a workspace or O off 16 bytes), it launches as
  ``SplitCall`` does.  Kept on its plan (``_Split.runs``, by whether the combine marks the
  non-finite flag), so that a plan the cache drops goes with it.

O, LSE and the workspace stay three allocations, as the validating path makes them: carving
them out of one (views by byte offset) costs as many tensor objects as it saves allocations
(on the CPU three allocations took 3.0 us, one carved by ``split_with_sizes`` and views 5.6 us),
and O would then hold the workspace's bytes (splits x rows x heads x (d_v + 2) floats: 130 KiB
at bench.host_time's stub shape, 4 splits) as long as the caller holds O.  Neither object holds
a caller's tensor: the bound call keeps ids, versions and addresses, and the plan cache's own
key objects.
"""
from __future__ import annotations

from . import launch as L
from . import plans as P
from .decode import KV_KEYS
from .raw_launch import launches_hooked

KEYS = 64  # plan keys a bound split call keeps, by its inputs' addresses, ids and versions (then it starts over)


class BoundSplit:
    """``__call__(split, q, k_cache, v_cache, out, lse, workspace, flag)``: ``split.call(q, k_cache,
    v_cache, out, lse, workspace, flag)`` (``launch.SplitCall``), through the C launchers where it
    can.  Made per plan and mark (``_Split.runs``) and handed its plan per call: it holds no
    reference to it."""

    def __init__(self, split, mark: int):
        call = split.call
        self.producer, self.combine = call.producer, call.combine
        self.grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
        self.combine_grid = tuple(call.combine_grid) + (1,) * (3 - len(call.combine_grid))
        self.mark = mark
        self.sinks = call.sinks is not None  # (the combine's sink row, made per call by a launch of its own)
        self.key = call.key
        self.offsets = tuple(call.offsets)
        self.producer_tail = (*call.offsets, *call.middle, *call.producer.tail)
        self.s_cap = call.s_cap
        self.o_stride = None  # (O's strides: fixed by the signature, taken from the first call's O)
        self.combine_mid = self.combine_tail = None
        self.raws = None  # (the producer's and the combine's raw launches, once both have one)
        self.aligned = None  # (q, k, v: the plan's key fixes their addresses' alignment)
        self.runtime = L._knobs().runtime
        self.stream_of = self.device_of = None  # (Triton's active driver, asked once the launches go raw)

    def __call__(self, split, q, k_cache, v_cache, out, lse, ws, flag):
        raws = self.raws
        if raws is None:
            raws = self.raws = self._raws(q, k_cache, v_cache, out)
        if raws is None or launches_hooked(self.runtime) or ws.data_ptr() % 16 or out.data_ptr() % 16:
            split.call(q, k_cache, v_cache, out, lse, ws, flag)
            return
        stream = self.stream_of(self.device_of())
        self._go(self.producer, raws[0], self.grid, stream, (q, k_cache, v_cache, ws, *self.producer_tail))
        self._go(self.combine, raws[1], self.combine_grid, stream,
                 (ws, *self.offsets, out, lse, *self.combine_mid, lse, lse if flag is None else flag,
                  *self.combine_tail))

    @staticmethod
    def _go(launcher, raw, grid, stream, args) -> None:
        raw(grid, stream, args)
        launcher.launches["raw"] += 1

    def _raws(self, q, k_cache, v_cache, out):
        """(the producer's, the combine's) raw launch under the keys ``SplitCall`` launches them with
        (a 16-byte aligned workspace and O), once both launchers have one; None until then, or where
        either has none or the combine reads a sink."""
        if self.sinks:
            return None
        aligned = (q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0, True)
        o_stride = tuple(out.stride())
        producer = self.producer.raw.get((aligned, self.key))
        combine = self.combine.raw.get((True, True, L._int_spec_key(o_stride + (self.s_cap,)), self.mark))
        if producer is None or combine is None:
            return None
        from triton.runtime import driver
        active = driver.active
        self.stream_of, self.device_of = active.get_current_stream, active.get_current_device
        self.combine_mid = (*o_stride, self.s_cap)
        self.combine_tail = (self.mark, *self.combine.tail)
        return producer, combine


class BoundDecode:
    """A split call of one signature (``split_signature``), bound after it ran once:
    ``__call__(q, cache)`` -> (O, LSE), or None where the call must take the validating path (its
    metadata has no plan in the cache: new, changed, dropped, or an inference tensor's)."""

    def __init__(self, kernel, names: tuple):
        self.kernel = kernel
        self.names = names  # (the inputs in the caller's order: the plan cache's tensors follow it)
        self.kv_names = tuple(n for n in names if n in KV_KEYS)  # (known by address)
        self.meta_names = tuple(n for n in names if n not in KV_KEYS)  # (known by identity and version)
        self.k_name = next(n for n in ("k_cache", "k") if n in names)
        self.v_name = next(n for n in ("v_cache", "v") if n in names)
        p = kernel.program
        self.heads_q, self.d_v = p.heads_q, p.d_v
        self.uint8, self.float32 = kernel._torch.uint8, kernel._torch.float32
        self.keys: dict = {}  # the inputs' addresses, ids and versions -> the plan cache's key for them

    def __call__(self, q, cache: dict):
        kernel = self.kernel
        values = []
        for n in self.kv_names:
            t = cache[n]
            if t.is_inference():  # (as the validating path: no plan is cached for inference tensors)
                return None
            values.append(t.data_ptr())
        try:
            for n in self.meta_names:
                t = cache[n]
                values += (id(t), t._version, t.data_ptr())
        except RuntimeError:  # (an inference tensor: no version counter)
            return None
        values = tuple(values)
        pkey = self.keys.get(values)
        if pkey is None:  # (the validating path's key, made again for values not seen: a model's layers
            key, _ = kernel._split_key(q, cache)  # share the metadata, each with its own K/V: a key each)
            if key is None:
                return None
            if len(self.keys) >= KEYS:
                self.keys.clear()
            pkey = self.keys[values] = P.PLANS.stored_key(P.Key(key))  # (as SplitCalls.decode keys it)
        split = P.PLANS.get(pkey, [None if n in KV_KEYS else cache[n] for n in self.names])
        if split is None:  # (the validating path plans it, checking the metadata's values, and stores it
            self.keys.pop(values, None)  # under a key object of its own: the next call asks for that one)
            return None
        k_cache, v_cache = cache[self.k_name], cache[self.v_name]
        check = kernel._row_check(q)
        call = split.call
        if call is None:  # (the Gluon engine over the cache, or no rows: the launch layer's path)
            o, lse, marked = kernel._launch_split(split, q, k_cache, v_cache, check[1])
        else:
            total_q = q.shape[0]
            o = q.new_empty((total_q, self.heads_q, self.d_v))  # (q's dtype and device, as _launch_split's)
            lse = q.new_empty((total_q, self.heads_q), dtype=self.float32)
            ws = q.new_empty(split.workspace_bytes, dtype=self.uint8) if split.workspace_bytes else None
            flag = check[1]
            mark = 0 if flag is None else 1
            run = split.runs.get(mark)
            if run is None:
                run = split.runs[mark] = BoundSplit(split, mark)
            run(split, q, k_cache, v_cache, o, lse, ws, flag)
            marked = flag is not None and split.launch.marks
        kernel._check_scores(lse, check, plan=split.plan, marked=marked)
        return o, lse
