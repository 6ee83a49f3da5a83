"""The Triton backend's launch mechanics: the one place kernels are launched (``Launcher``,
``PrefillLaunch``, ``SplitLaunch``, ``CacheLaunch``) with the configuration ``choice.py`` chose.

A launch binds everything a call's key fixes once; a later call with the same key pays a
dictionary lookup, two allocations (O, LSE) and the launch.  ``Launcher`` launches a kernel
through Triton's JIT the first time (compile, specialization) and, after that, through the
compiled kernel's own launcher with the argument tuple, which skips the JIT's per-call binding --
on Triton 3.6 straight to its C function (``raw_launch.py``: TMA descriptors encoded once per
address, no launch metadata while no tool hooks launches).
That is exact only while the arguments' specialization is unchanged (which ints are 1 or
multiples of 16, which pointers are 16-byte aligned): the caller's key must fix them, and
``spec_key`` computes the part a call can change.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import triton.language as tl

from attnc.compiler.fast_score import FAST_POSITIONS
from attnc.layouts import token_rows
from attnc.compiler.separable import COLUMN_BLOCK
from attnc.compiler.errors import PlanError

from . import choice, raw_launch
from . import workspace as W
from .plans import Key
from .choice import (PrefillConfig, default_walk, fp8_key_order, gluon_box, gluon_consumers,
                     gluon_overlap, gluon_pingpong, gluon_q_buffers, gluon_regs, gluon_stages)
from .device import interpreted, sm_count, tma_ready
from .kernels import gluon_engine, prefill, split

COMBINE_SLOTS = 128  # split slots the combine merges per pass (the untuned rule makes at most MAX_SPLITS = 128)


def job_order(bh: int, q_tiles: int, head_group: int) -> np.ndarray:
    """``prefill._job`` in numpy: row t = (query tile rank, b * H_q + h) of the launch's t-th job."""
    t = np.arange(bh * q_tiles)
    base = (t // (head_group * q_tiles)) * head_group
    g = np.minimum(bh - base, head_group)
    r = t - base * q_tiles
    return np.stack([r // g, base + r % g], axis=1)


def tile_origin(bh: int, s: int, heads: int, cols: int, layout: str) -> tuple[int, int]:
    """``gluon_engine._tile_origin`` in Python: (row, column) of head ``bh``'s (b * heads + h) first
    row in the 2-D view of ``tma_geometry``; its row r is at row + r."""
    if layout == "bshd":
        return (bh // heads) * s, (bh % heads) * cols
    return bh * s, 0


def tma_geometry(shape, strides, d: int, rows: int, layout: str) -> tuple[list, list, list]:
    """(shape, strides, box) in elements of the 2-D view through which the Gluon engine's TMA
    copies a logical bhsd tensor [B, H, S, d] with these strides, in boxes of ``rows`` rows: bhsd,
    [B * H * S, d] in [rows, gluon_box(d)] boxes (a 192-wide head loaded as 256 columns, the rest
    zero-filled); bshd (``attnc.layouts.token_rows``: R apart), [B * S, H * d] with rows R apart, in
    [rows, d] boxes (``choice.tensor_layout``: d a power of two)."""
    b, h, s, _ = (int(x) for x in shape)
    if layout == "bshd":
        return [b * s, h * d], [token_rows(shape, strides), 1], [rows, d]
    return [b * h * s, d], [d, 1], [rows, gluon_box(d)]


# ---------------------------------------------------------------- launching
def spec_key(args) -> tuple:
    """The part of Triton's specialization an argument list carries: for each int whether it is
    1 or a multiple of 16, for each tensor whether its address is 16-byte aligned."""
    out = []
    for a in args:
        if isinstance(a, bool) or a is None or isinstance(a, float):
            out.append(None)
        elif isinstance(a, int):
            out.append(1 if a == 1 else (16 if a % 16 == 0 else 0))
        elif isinstance(a, tuple):
            out.append(spec_key(a))
        elif hasattr(a, "data_ptr"):
            out.append((str(a.dtype), a.data_ptr() % 16 == 0))
        else:
            out.append(type(a).__name__)
    return tuple(out)


class Launcher:
    """One kernel with fixed constexprs and launch options.  ``launch(grid, args, key)``: the
    first launch under a ``key`` goes through the JIT (compiling if needed) and keeps the
    compiled kernel; later launches under that key call the compiled kernel's launcher with the
    argument tuple (its C function where ``raw_launch`` knows it and no launch hook is set).
    ``key`` must determine the arguments' specialization (``spec_key``); key None always takes the
    JIT."""

    def __init__(self, fn, constexprs: dict, **options):
        self.fn = fn
        self.constexprs = constexprs
        self.options = options
        names = [p.name for p in fn.params] if hasattr(fn, "params") else list(constexprs)
        self.tail = tuple(constexprs[n] for n in names if n in constexprs)
        self.compiled: dict = {}
        self.raw: dict = {}  # key -> raw_launch.raw_launch(compiled kernel), or None where it does not apply
        self.fast = not interpreted()
        self.launches = {"jit": 0, "direct": 0, "raw": 0}

    def launch(self, grid, args: tuple, key=None, stream=None):
        kernel = self.compiled.get(key) if key is not None else None
        if kernel is not None:
            knobs = _knobs()
            stream = _stream() if stream is None else stream
            g = tuple(grid) + (1,) * (3 - len(grid))
            enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            # (Triton 3.6's hooks are chains, empty unless a tool adds one: no launch metadata then)
            if not (raw_launch.hooked(enter) or raw_launch.hooked(leave)):
                raw = self.raw.get(key)
                if raw is not None:
                    raw(g, stream, args + self.tail)
                    self.launches["raw"] += 1
                    return
                enter = leave = None
            meta = kernel.launch_metadata(g, stream, *args, *self.tail) if enter is not None else None
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, enter, leave,
                       *args, *self.tail)
            self.launches["direct"] += 1
            return
        compiled = self.fn[grid](*args, **self.constexprs, **self.options)
        self.launches["jit"] += 1
        if key is not None and self.fast and compiled is not None and hasattr(compiled, "packed_metadata"):
            compiled._init_handles()  # (the launch above did it; this makes .function and .run ready)
            self.compiled[key] = compiled
            self.raw[key] = raw_launch.raw_launch(compiled)
        elif key is not None and self.fast:  # (recorded for the host-time study)
            self.launches["not_kept"] = type(compiled).__name__

    def output_descriptor(self, key, out, cols: int, make):
        """The TMA descriptor argument of a tensor new each call (O; the backward's dO): where this
        key's launches go raw, a per-call view of its [-1, cols] rows (``raw_launch.TensorView``: no
        descriptor object made, nothing kept that would hold the caller's tensor); else ``make()``'s
        descriptor."""
        if key is not None and self.raw.get(key) is not None:
            return raw_launch.TensorView(out, cols)
        return make()


_KNOBS = []


def _knobs():
    """``triton.knobs`` (imported once: every launch reads its hooks)."""
    if not _KNOBS:
        from triton import knobs
        _KNOBS.append(knobs)
    return _KNOBS[0]


def _stream():
    from triton.runtime import driver
    d = driver.active
    return d.get_current_stream(d.get_current_device())


def fast_scores(end: int | None) -> bool:
    """Whether a call whose positions all lie below ``end`` takes the spec's fast score functions
    (``score_program_fast``, ``score_grad_fast``: the exact ones, bit for bit, on positions below
    fast_score.FAST_POSITIONS; compiler/fast_score.py).  None: the launch does not know its
    positions (split calls: a captured decode graph replays with longer requests)."""
    return end is not None and end <= FAST_POSITIONS


def score_functions(module, end: int | None) -> tuple:
    """(SCORE, SCORE_GRAD): the spec's score program and its derivative for a call whose
    positions all lie below ``end`` -- the fast forms where ``fast_scores`` allows them."""
    if fast_scores(end):
        return module.score_program_fast, getattr(module, "score_grad_fast", module.score_program_fast)
    return module.score_program, getattr(module, "score_grad", module.score_program)


def separable_mode(module, end: int | None, block_n: int = 128) -> int:
    """How a call whose positions all lie below ``end`` takes the spec's separable form on the
    Gluon engine (compiler/separable.py; the module's ``score_scale``, ``score_row`` and
    ``score_column``): with its column part per block (gluon_engine.COLUMN_PER_BLOCK) below the
    module's SEPARABLE_BLOCK_POSITIONS, per key (COLUMN_PER_KEY) below its SEPARABLE_POSITIONS
    (the precision rule's bounds; per block only on blocks of at most separable.COLUMN_BLOCK keys,
    the offsets the rule allows for), else not at all (0).  A module without them (f32 specs, specs
    with no separable form or none precise enough on any call) never does; nor a call whose
    positions are unknown (``end`` None)."""
    if end is None:
        return 0
    if end <= getattr(module, "SEPARABLE_BLOCK_POSITIONS", 0) and block_n <= COLUMN_BLOCK:
        return int(gluon_engine.COLUMN_PER_BLOCK)
    if end <= getattr(module, "SEPARABLE_POSITIONS", 0):
        return int(gluon_engine.COLUMN_PER_KEY)
    return 0


def separable_constexprs(module, end: int | None, block_n: int = 128) -> dict:
    """The Gluon engine's SEPARABLE (``separable_mode``) and the form's functions for a call whose
    positions all lie below ``end`` (None in their place where it does not take the form)."""
    mode = separable_mode(module, end, block_n)
    return {"SEPARABLE": mode, **{n: getattr(module, f) if mode else None for n, f in
                                  (("SCORE_SCALE", "score_scale"), ("SCORE_ROW", "score_row"),
                                   ("SCORE_COLUMN", "score_column"))}}


def position_end(s_q: int, s_k: int, offsets: tuple[int, int] | None) -> int:
    """One past the largest position of a call (rows at Q_OFF.., keys at K_OFF..; ``offsets``
    None: a whole call, bottom-right)."""
    q_off, k_off = offsets if offsets is not None else (s_k - s_q, 0)
    return max(q_off + s_q, k_off + s_k)


def spec_constexprs(module, end: int | None = None) -> dict:
    """What a generated spec module gives the kernels as constexpr arguments, for a call whose
    positions all lie below ``end`` (``score_functions``)."""
    return {"VISIBLE": module.visible, "SCORE": score_functions(module, end)[0], **module.SPEC}


def sink_constexprs(module, partial: bool = False) -> dict:
    """HAS_SINK and SINK of a kernel that finishes rows: the spec module's ``sink_value`` where
    the spec has a sink (``sink = ...``), unless the launch writes a ``partial`` state (a block of
    a larger call: the merge adds the sink once per row)."""
    sink = getattr(module, "sink_value", None)
    return {"HAS_SINK": sink is not None and not partial, "SINK": None if partial else sink}


def row_sinks(module, launchers: dict, total_q: int, arrays: dict, ts: tuple, unused):
    """Every packed row's sink [total_q * H_q] float32 (``split._sink_rows``), for a split call's
    combine to join once per row; ``unused`` (returned as is) where the spec has no sink.
    ``launchers`` keeps the launcher (the caller's cache)."""
    if not sink_constexprs(module)["HAS_SINK"]:
        return unused
    import torch
    h_q = module.SPEC["H_Q"]
    lz = launchers.get("sink_rows")
    if lz is None:
        lz = launchers["sink_rows"] = Launcher(split._sink_rows, dict(SINK=module.sink_value, H_Q=h_q,
                                                                      H_PAD=W.next_power_of_2(h_q)), num_warps=1)
    out = torch.empty(total_q * h_q, device=unused.device, dtype=torch.float32)
    lz.launch((arrays["kv_lens"].numel(),), (out, arrays["qo_indptr"], ts), ("sink_rows", spec_key(ts)))
    return out


def tensor_args(module, tensors: dict, lengths=None) -> tuple:
    """TS: the spec's tensors, each followed by its strides and sizes, in the module's order;
    then, for a spec that reads S_q or S_k (``module.LENGTHS``), the call's ``lengths``:
    (kv_lens [B], qo_indptr [B + 1]) int32 device tensors."""
    ts = []
    for name in module.TENSORS:
        t = tensors[name]
        ts.append(t)
        for i in range(t.dim()):
            ts += [t.stride(i), t.shape[i]]
    if module.LENGTHS:
        ts += list(lengths)
    return tuple(ts)


def call_tensor_args(module, tensors: dict, batch: int, s_q: int, s_k: int, device) -> tuple:
    """TS of a call whose requests all have S_q rows over S_k keys (the lengths only where the
    spec reads them)."""
    if not module.LENGTHS and not module.TENSORS:
        return ()
    return tensor_args(module, tensors, uniform_lengths(batch, s_q, s_k, device) if module.LENGTHS else None)


def uniform_lengths(batch: int, s_q: int, s_k: int, device) -> tuple:
    """(kv_lens, qo_indptr) of a call whose requests all have S_q rows over S_k keys."""
    import torch
    return (torch.full((batch,), s_k, dtype=torch.int32, device=device),
            torch.arange(batch + 1, dtype=torch.int32, device=device) * s_q)


def qk_scale(module) -> float:
    """The factor from q.k (or the score program's output, in natural units) to base-2 logits."""
    return prefill.LOG2E if module.SPEC["HAS_SCORE"] else module.SPEC["SCALE"] * prefill.LOG2E


_COUNTERS: dict = {}


def _counter(device, stream=None):
    """The Gluon engine's job counter for this device and stream (zero between launches)."""
    import torch
    key = (str(device), _stream() if stream is None else stream)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


class _GluonDescriptors:
    """TMA descriptors for the Gluon programs, made once per tensor (address, shape, strides)."""

    def _cached(self, t, role, make):
        """``make()``'s descriptor of ``t`` for ``role``, reused while the tensor (address, shape,
        strides) is the one it was made for: a descriptor holds nothing else of the tensor."""
        key = (t.data_ptr(), t.shape, t.stride())
        hit = self._descs.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        desc = make()
        self._descs[role] = (key, desc)
        return desc

    def _gluon_layout(self, block: list, dtype):
        key = (*block, str(dtype))
        layout = self._layouts.get(key)
        if layout is None:
            gl = gluon_engine.gl
            gl_dtype = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16,
                        "torch.float8_e4m3fn": gl.float8e4nv}[str(dtype)]
            layout = self._layouts[key] = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return layout


class PrefillLaunch(_GluonDescriptors):
    """A prefill launch bound to a spec, a config, a plan's device arrays and one call shape
    (B, H_q, S_q, S_k, strides, dtypes, alignments): ``__call__(q, k, v, ts, out, lse)``."""

    marks = True  # it sets a ``flag`` it is given where a row's LSE is NaN (both engines do)

    def __init__(self, module, config: PrefillConfig, arrays: dict, shape: tuple, device,
                 offsets: tuple[int, int] | None = None, fp8: bool = False):
        """``offsets``: the absolute positions (Q_OFF, K_OFF) of the first row and key, for one block
        of a larger call (context parallelism); None: a whole call, bottom-right (S_k - S_q, 0).
        ``fp8``: float8 e4m3 Q, K and V (V transposed: ``__call__``) with descales (the Gluon
        engine only)."""
        self.module, self.config, self.arrays = module, config, arrays
        self.batch, self.s_q, self.s_k = shape
        self.offsets = offsets
        self.fp8 = fp8
        self.p_perm = False
        self.bound_runs: dict = {}  # MARK -> bound.BoundLaunch of the key its bound call launches under
        self.device = device
        end = position_end(self.s_q, self.s_k, offsets)
        spec = spec_constexprs(module, end)
        self.bh = self.batch * module.SPEC["H_Q"]
        self.jobs = arrays["q_tiles"] * self.bh
        c = config
        self._descs = {}  # role -> ((address, shape, strides), TMA descriptor): reused while the tensor is
        q_off, k_off = offsets if offsets is not None else (self.s_k - self.s_q, 0)
        self.ints = (self.s_q, self.s_k, q_off, k_off, arrays["plan_b"], arrays["plan_h"],
                     arrays["q_tiles"], qk_scale(module), self.bh)
        if c.engine == "gluon":
            self.schedule = gluon_engine.SCHEDULES[c.schedule]
            self.grid = (self.jobs,) if self.schedule == 0 else (min(self.jobs, sm_count(device)),)
            d_qk, d_v, bn = module.SPEC["D_QK"], module.SPEC["D_V"], c.block_n
            same = d_qk == d_v
            stages = gluon_stages(d_qk, d_v, bn, c.num_stages, self.schedule, fp8, c.block_m)
            q_bufs = gluon_q_buffers(d_qk, d_v, bn, stages, self.schedule, fp8, c.block_m)
            consumers = gluon_consumers(c.block_m)
            self.p_perm = fp8 and fp8_key_order(self.s_k)
            maxnreg, consumer, producer = gluon_regs(d_qk, d_v, consumers)
            keep = {n: spec[n] for n in ("VISIBLE", "SCORE", "HAS_SCORE", "SCALE", "H_Q", "H_KV", "GROUP")}
            from_rows = c.mask_source == "rows"
            bshd = tuple(lay == "bshd" for lay in c.layouts)
            self.o_cols = d_v * (module.SPEC["H_Q"] if bshd[3] else 1)  # O's 2-D view's columns (tma_geometry)
            self.launcher = Launcher(gluon_engine._attn_fwd_ws, dict(
                MASK_FROM_ROWS=from_rows, EVEN_Q=self.s_q % c.block_m == 0, EVEN_K=self.s_k % bn == 0,
                ROWS_=gluon_engine.ROWS, BLOCK_N=bn, D=d_v, SAME_D=same, STAGES=stages,
                HEAD_GROUP=c.head_group, CONSUMER_REGS=consumer, PRODUCER_REGS=producer, SCHEDULE=self.schedule,
                FP8=fp8, OVERLAP=gluon_overlap(d_qk, d_v, fp8), ZERO_TAIL=not fp8 and self.s_k % bn != 0,
                PINGPONG=consumers == 2 and gluon_pingpong(d_qk, d_v, fp8),
                CONSUMERS=consumers, P_PERM=self.p_perm, Q_BUFS=q_bufs, Q_BSHD=bshd[0], K_BSHD=bshd[1],
                V_BSHD=bshd[2], O_BSHD=bshd[3], **keep,
                **separable_constexprs(module, end, bn), **sink_constexprs(module, partial=offsets is not None)),
                num_warps=4, maxnreg=maxnreg)
            unused = arrays["merged_partial"]
            rows = (arrays["KS"], arrays["KE"]) if from_rows else (unused, unused)
            self._layouts = {}
            self.fixed_tail = (arrays["q_tile_order"], arrays["merged_indptr"], arrays["merged_indices"],
                               arrays["merged_partial"], *rows)
            self.no_descales = (unused, unused, unused)
        else:
            walk = c.walk or default_walk(arrays["mean_merged_run_blocks"], c.mask_source)
            self.config = replace(c, walk=walk)
            self.grid = (self.jobs,)
            from_intervals = c.mask_source == "intervals"
            self.launcher = Launcher(prefill._attn_fwd, dict(
                MASK_FROM_INTERVALS=from_intervals, EVEN_N=(self.s_k % c.block_n == 0), USE_TMA=c.use_tma,
                WALK=prefill.WALKS[walk], BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_GROUP=c.head_group, **spec,
                **sink_constexprs(module, partial=offsets is not None)),
                num_warps=c.num_warps, num_stages=c.num_stages)
            vecs = [arrays.get(n, arrays["partial_indptr"]) for n in ("UTS", "UTE", "LTS", "LTE")]
            self.plan_args = (arrays["q_tile_order"], arrays["full_run_ptr"], arrays["full_run_lo"],
                              arrays["full_run_hi"], arrays["partial_indptr"], arrays["partial_indices"],
                              arrays["full_indptr"], arrays["full_indices"], arrays["merged_run_ptr"],
                              arrays["merged_run_lo"], arrays["merged_run_hi"], arrays["merged_run_base"],
                              arrays["merged_partial"], arrays["merged_indptr"], arrays["merged_indices"], *vecs)

    def __call__(self, q, k, v, ts: tuple, out, lse, key=None, descales: tuple | None = None, flag=None):
        """Launch on bhsd views (strides carry the layout).  ``key``: the caller's binding key, which
        fixes every argument's specialization (None: through the JIT).  FP8 launches: ``v`` is V^T,
        a [B, H_kv, d_v, S_k] view with unit stride along S_k and 16-byte aligned rows, and
        ``descales`` (q [B * H_q], k [B * H_kv], v [B * H_kv]) float32.  ``flag``: the call's
        non-finite flag (int32 [1]), set where a row's LSE is NaN where ``marks``; None: not marked."""
        if self.config.engine == "gluon":
            desc = self._gluon_descriptor
            stream = _stream()
            counter = _counter(self.device, stream) if self.schedule == 1 else self.arrays["merged_partial"]
            rows, bn = gluon_engine.ROWS, self.config.block_n
            v_desc = self._fp8_v_descriptor(v) if self.fp8 else desc(v, bn, "v")
            k_desc = self._fp8_k_descriptor(k) if self.p_perm else desc(k, bn, "k")
            key = None if key is None else (key, 0 if flag is None else 1)  # (O's descriptor asks under it too)
            o_desc = self.launcher.output_descriptor(key, out, self.o_cols,
                                                     lambda: self._gluon_descriptor(out, rows, "o", keep=False))
            args = self.gluon_args(desc(q, rows, "q"), k_desc, v_desc, o_desc, out, lse, counter, ts, flag, descales)
            self.launcher.launch(self.grid, args, key, stream)
            return
        desc_k = desc_v = k
        if self.config.use_tma:  # Hopper bulk copies of K/V tiles from a [B * H_kv * S_k, d] view
            desc_k, desc_v = self._tma_descriptor(k, "k"), self._tma_descriptor(v, "v")
        args = self.triton_args(q, k, v, out, lse, desc_k, desc_v, ts, flag)
        self.launcher.launch(self.grid, args, None if key is None else (key, 0 if flag is None else 1))

    # (the one order of each engine's arguments: ``__call__`` and the bound launch, ``bound.py``)
    def gluon_args(self, q_desc, k_desc, v_desc, o_desc, out, lse, counter, ts, flag, descales=None) -> tuple:
        """The Gluon engine's arguments; ``flag`` None: LSE stands in, and MARK (an int of 1 is
        specialized: the launch's key says which) is 0."""
        return (q_desc, k_desc, v_desc, o_desc, out, lse, counter, *self.fixed_tail,
                *(descales if self.fp8 else self.no_descales), ts, *self.ints, lse if flag is None else flag,
                0 if flag is None else 1)

    def triton_args(self, q, k, v, out, lse, desc_k, desc_v, ts, flag) -> tuple:
        """The Triton prefill kernel's arguments (``gluon_args``' ``flag`` rule)."""
        return (q, k, v, out, lse, desc_k, desc_v, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *self.plan_args, ts, *self.ints, lse if flag is None else flag, 0 if flag is None else 1)

    def _tma_descriptor(self, t, role):
        """The Triton kernel's K or V descriptor over a [-1, d] view in BLOCK_N-row blocks."""
        from triton.tools.tensor_descriptor import TensorDescriptor
        d = t.shape[-1]
        return self._cached(t, role, lambda: TensorDescriptor.from_tensor(t.reshape(-1, d), [self.config.block_n, d]))

    def _gluon_descriptor(self, t, rows, role, keep=True):
        """The Gluon engine's descriptor of the logical bhsd ``t`` in ``rows``-row blocks, in the
        layout the config gives its role (``tma_geometry``: bhsd, [-1, d]; bshd, [B * S, H * d]; d:
        q and k's head dim, or v and o's); kept for the next call unless not ``keep`` (an output: a
        kept descriptor would hold the caller's last O, and the next O could not take its memory)."""
        def make():
            d = self.module.SPEC["D_QK" if role in ("q", "k") else "D_V"]
            layout_name = self.config.layouts["qkvo".index(role)]
            shape, strides, box = tma_geometry(t.shape, t.stride(), d, rows, layout_name)
            layout = self._gluon_layout(box, t.dtype)
            if layout_name == "bshd":
                return gluon_engine.TensorDescriptor(t, shape, strides, box, layout)
            # (a 192-wide head is loaded as 256 columns, the last 64 zero-filled by TMA)
            return gluon_engine.TensorDescriptor.from_tensor(t.view(-1, d), box, layout)
        return self._cached(t, role, make) if keep else make()

    def _fp8_k_descriptor(self, k):
        """K's descriptor for an FP8 launch with P_PERM: the [B * H_kv * S_k, d] view as 5-d
        [rows / 16, 2, 4, 2, d] with strides [16, 2, 4, 1, -] rows, in [BLOCK_N / 16, 2, 4, 2, d]
        boxes: within each 32 rows, TMA writes key 16 a1 + 4 q + 2 a0 + b to row 16 a1 + 8 a0 + 2 q + b
        of the block (``gluon_engine._key_cols``)."""
        d, bn = self.module.SPEC["D_QK"], self.config.block_n
        block = [bn // 16, 2, 4, 2, d]
        layout = self._gluon_layout(block, k.dtype)
        rows = k.numel() // d
        return self._cached(k, "k16", lambda: gluon_engine.TensorDescriptor(
            k, [rows // 16, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], block, layout))

    def _fp8_v_descriptor(self, vt):
        """V^T's descriptor for an FP8 launch: [B * H_kv * d_v, S_k] in [d_v, BLOCK_N] blocks; its row
        stride may exceed S_k (a padded copy), and TMA zero-fills the columns past S_k."""
        d, bn = self.module.SPEC["D_V"], self.config.block_n
        layout = self._gluon_layout([d, bn], vt.dtype)
        rows = vt.shape[0] * vt.shape[1] * d
        return self._cached(vt, "vt", lambda: gluon_engine.TensorDescriptor(vt, [rows, self.s_k], [vt.stride(3), 1],
                                                                           [d, bn], layout))


# ---------------------------------------------------------------- split calls
class SplitLaunch:
    """The split-K/V producer and the combine of one spec with one launch config (warps, stages):
    ``__call__(q, k_cache, v_cache, plan, arrays, ts, out, lse, workspace)``, or ``bind(...)`` once
    and the bound call per call.  The combine marks the call's non-finite flag (``marks``)."""

    marks = True

    def __init__(self, module, num_warps: int = 4, num_stages: int = 2):
        self.module = module
        self.num_warps, self.num_stages = num_warps, num_stages
        self._launchers: dict = {}
        self._static: dict = {}  # (total_q, q's strides, the plan's launch fields) -> SplitLaunch._derive's

    def _launcher(self, which, constexprs):
        key = (which, tuple(sorted((n, v) for n, v in constexprs.items() if n not in ("VISIBLE", "SCORE"))))
        lz = self._launchers.get(key)
        if lz is None:
            spec = spec_constexprs(self.module)
            if which == "split":
                lz = Launcher(split._split_at, {**constexprs, **spec}, num_warps=self.num_warps,
                              num_stages=self.num_stages)
            else:
                keep = {n: spec[n] for n in ("H_Q", "D_V", "D_V_PAD")}
                has_sink = sink_constexprs(self.module)["HAS_SINK"]
                lz = Launcher(split._combine_at, {**constexprs, **keep, "HAS_SINK": has_sink}, num_warps=4)
            self._launchers[key] = lz
        return lz

    def __call__(self, q, k_cache, v_cache, plan: dict, arrays: dict, ts: tuple, out, lse, workspace, flag=None):
        """Both launches of one split call (``bind``, then the bound call); ``flag``: the call's
        non-finite flag (int32 [1]), which the combine sets where a row's LSE is NaN (None: not marked)."""
        if q.shape[0] == 0:
            return out, lse
        self.bind(q.shape[0], q.stride(), plan, arrays, ts)(q, k_cache, v_cache, out, lse, workspace, flag)
        return out, lse

    def bind(self, total_q: int, q_stride: tuple, plan: dict, arrays: dict, ts: tuple) -> "SplitCall":
        """The call of this plan's arrays and mask tensors for q of ``total_q`` rows (> 0) and strides
        ``q_stride``: everything but the per-call tensors fixed once."""
        ks, vs = plan["k_strides"], plan["v_strides"]
        # what the launch derives from the plan and q's shape and strides, derived once per their values
        memo_key = (total_q, q_stride, plan["splits"], plan["abi"], plan["block_q"], plan["cache"],
                    plan["page_size"], plan["one_row"], plan["block_n"], plan["bounded"], plan["table_stride"],
                    tuple(ks), tuple(vs), plan["tiles"])
        st = self._static.get(memo_key)
        if st is None:
            if len(self._static) >= 256:  # (a server's batch sizes vary: bounded)
                self._static.clear()
            st = self._static[memo_key] = self._derive(total_q, q_stride, plan, ks, vs)
        size, offsets, producer, combine, grid, static_key = st
        middle = (*q_stride, *ks, *vs, arrays["kv_lens"], arrays["qo_indptr"], arrays["tile_req"], arrays["tile_row0"],
                  arrays["base"], arrays["table"], plan["table_stride"], arrays["entry_ptr"], arrays["blocks"],
                  arrays["partial"], ts, plan["splits"], qk_scale(self.module), arrays["split_bounds"])
        sinks = (lambda lse: row_sinks(self.module, self._launchers, total_q, arrays, ts, lse)) \
            if sink_constexprs(self.module)["HAS_SINK"] else None
        return SplitCall(size, offsets, middle, producer, combine, grid, (total_q * self.module.SPEC["H_Q"],),
                         Key((static_key, spec_key(ts))), plan["splits"], sinks)

    def _derive(self, total_q: int, q_stride: tuple, plan: dict, ks, vs) -> tuple:
        """(workspace bytes, the fields' byte offsets (O, m, l, valid), the producer and combine
        launchers, the producer's grid, the strides' and offsets' part of its key) of a call of this
        plan and q layout."""
        spec = self.module.SPEC
        s_cap = plan["splits"]
        abi_mlu = plan["abi"] == "mlu"
        vec = W.vector_torch_dtype(self.module, plan["abi"])
        n, fields, size = W.split_layout(total_q, s_cap, plan["abi"], spec["H_Q"], spec["D_V"], vec.itemsize)
        # (the (LSE, O) ABI has no l: the combine reads m in its place, unused)
        offsets = (fields["o"][0], fields["m"][0], fields["l" if abi_mlu else "m"][0], fields["valid"][0])
        block_q = plan["block_q"]
        g_pad = max(W.next_power_of_2(spec["GROUP"]), 16 // block_q)
        p_vec = TL_DTYPES[str(vec)]
        producer = self._launcher("split", dict(
            P_VEC=p_vec, CACHE=plan["cache"], PAGE_SIZE=plan["page_size"], ABI_MLU=abi_mlu,
            ONE_ROW=bool(plan["one_row"]), BLOCK_Q=block_q, BLOCK_N=plan["block_n"], G_PAD=g_pad,
            BOUNDED=bool(plan["bounded"])))
        pad = max(2, W.next_power_of_2(min(s_cap, COMBINE_SLOTS)))
        combine = self._launcher("combine", dict(P_VEC=p_vec, ABI_MLU=abi_mlu, SPLITS_PAD=pad))
        static_key = spec_key(offsets + tuple(q_stride) + tuple(ks) + tuple(vs) + (plan["table_stride"], s_cap))
        return size, offsets, producer, combine, (s_cap, plan["tiles"] * spec["H_KV"]), static_key


class SplitCall:
    """A split call bound once (``SplitLaunch.bind``): ``call(q, k_cache, v_cache, out, lse,
    workspace, flag=None)`` launches the producer and the combine over the one uint8 workspace,
    its fields at fixed byte offsets.  The plan's arrays and the workspace's fields are 16-byte
    aligned by construction, so the arguments' specialization is fixed by the strides and offsets
    (the bound key), the caller's pointers and whether the combine marks."""

    __slots__ = ("size", "offsets", "middle", "producer", "combine", "grid", "combine_grid", "key", "s_cap",
                 "sinks", "uint8")

    def __init__(self, size, offsets, middle, producer, combine, grid, combine_grid, key, s_cap, sinks):
        import torch
        self.uint8 = torch.uint8
        self.size, self.offsets, self.middle = size, offsets, middle
        self.producer, self.combine, self.grid, self.combine_grid = producer, combine, grid, combine_grid
        self.key, self.s_cap, self.sinks = key, s_cap, sinks

    def __call__(self, q, k_cache, v_cache, out, lse, workspace, flag=None):
        if workspace.dtype is not self.uint8 or workspace.numel() < self.size:
            raise PlanError(f"workspace: {workspace.numel()} {workspace.dtype} elements; this call needs "
                            f"{self.size} uint8")
        ws_aligned = workspace.data_ptr() % 16 == 0
        aligned = (q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0, ws_aligned)
        stream = _stream() if self.producer.fast else None  # (one stream query for both launches)
        self.producer.launch(self.grid, (q, k_cache, v_cache, workspace, *self.offsets, *self.middle),
                             (aligned, self.key), stream)
        mark = 0 if flag is None else 1  # (an int argument of 1 is specialized: the key says which)
        sinks = lse if self.sinks is None else self.sinks(lse)  # (lse: unread where the spec has no sink)
        self.combine.launch(self.combine_grid, (workspace, *self.offsets, out, lse, *out.stride(), self.s_cap, sinks,
                                                lse if flag is None else flag, mark),
                            (ws_aligned, out.data_ptr() % 16 == 0, _int_spec_key(out.stride() + (self.s_cap,)), mark),
                            stream)


TL_DTYPES = {"torch.float32": tl.float32, "torch.float16": tl.float16, "torch.bfloat16": tl.bfloat16}


@functools.lru_cache(maxsize=1024)
def _int_spec_key(ints: tuple) -> tuple:
    """``spec_key`` of a tuple of ints (strides, counts), remembered."""
    return spec_key(ints)


class CacheLaunch(_GluonDescriptors):
    """The Gluon engine over a cache (``gluon_paged._paged_fwd_ws``) for one spec and one cache
    shape (page size, layout): ``__call__(q, k_cache, v_cache, plan, arrays, ts, out, lse,
    workspace)`` as ``SplitLaunch``'s (the workspace is unused: no split)."""

    def __init__(self, module, block_n: int, paged: bool, page_size: int, device):
        self.module, self.device = module, device
        spec = module.SPEC
        d_qk, d_v = spec["D_QK"], spec["D_V"]
        self.block_n = block_n
        page = page_size if paged else block_n
        maxnreg, consumer, producer = gluon_regs(d_qk, d_v)
        stages = gluon_stages(d_qk, d_v, block_n, choice.GLUON_STAGES)
        q_bufs = gluon_q_buffers(d_qk, d_v, block_n, stages)
        keep = {n: spec[n] for n in ("HAS_SCORE", "SCALE", "H_Q", "GROUP")}
        self.sms = sm_count(device)
        self._descs, self._layouts = {}, {}
        self._constexprs = dict(
            ROWS_=gluon_engine.ROWS, BLOCK_N=block_n, D=d_v, STAGES=stages, CONSUMER_REGS=consumer,
            PRODUCER_REGS=producer, D_QK=d_qk, PAGED=paged, PAGE=page, CHUNK=min(page, block_n),
            OVERLAP=gluon_overlap(d_qk, d_v, False), PINGPONG=gluon_pingpong(d_qk, d_v, False), Q_BUFS=q_bufs,
            **keep)
        self._maxnreg = maxnreg
        self._launchers: dict = {}

    def _launcher(self, end: int | None) -> Launcher:
        """The launch for calls whose positions lie below ``end`` (the fast score forms or not, the
        separable form or not: ``separable_mode``; None, unknown positions: neither)."""
        fast, mode = fast_scores(end), separable_mode(self.module, end, self.block_n)
        lz = self._launchers.get((fast, mode))
        if lz is None:
            from .kernels import gluon_paged
            score, _ = score_functions(self.module, end)
            lz = self._launchers[(fast, mode)] = Launcher(gluon_paged._paged_fwd_ws, dict(
                self._constexprs, VISIBLE=self.module.visible, SCORE=score, **sink_constexprs(self.module),
                **separable_constexprs(self.module, end, self.block_n)), num_warps=4, maxnreg=self._maxnreg)
        return lz

    marks = False  # (the Gluon engine: its caller marks the non-finite flag with a launch of its own)

    def __call__(self, q, k_cache, v_cache, plan: dict, arrays: dict, ts: tuple, out, lse, workspace, flag=None):
        spec = self.module.SPEC
        h_q, h_kv, d_qk, d_v = spec["H_Q"], spec["H_KV"], spec["D_QK"], spec["D_V"]
        jobs = plan["tiles"] * h_q
        if jobs == 0:
            return out, lse
        if not tma_ready(q):  # (a fresh copy: a contiguous view at an odd address stays one under .contiguous())
            import torch
            q = torch.empty_like(q, memory_format=torch.contiguous_format).copy_(q)
        if not tma_ready(k_cache, v_cache):
            raise PlanError("the plan runs on the Gluon engine, which reads contiguous K/V storage at 16-byte "
                            "aligned addresses (TMA); this cache is not: make the plan for it (decode_plan) or pass "
                            "engine='split'")
        rows = gluon_engine.ROWS
        token_major = plan["kind"] == "ragged" or plan["order"] in ("nhd", "bshd")
        if token_major:  # [rows, H_kv * d]: a head's keys in its columns
            k2, v2 = k_cache.view(-1, h_kv * d_qk), v_cache.view(-1, h_kv * d_v)
            page_rows, head_rows, k_col, v_col = plan["page_size"], 0, d_qk, d_v
        else:  # [rows, d]: a head's keys in its rows (hnd pages: H_kv * page rows; bhsd: T rows per head)
            k2, v2 = k_cache.view(-1, d_qk), v_cache.view(-1, d_v)
            per_head = plan["page_size"] if plan["kind"] == "paged" else k_cache.shape[2]
            page_rows, head_rows, k_col, v_col = h_kv * per_head, per_head, 0, 0
        bn = self.block_n
        chunk = self._constexprs["CHUNK"]
        desc = gluon_engine.TensorDescriptor.from_tensor

        def make(t, block):
            return lambda: desc(t, block, self._gluon_layout(block, t.dtype))
        ints = (plan["table_stride"], page_rows, head_rows, k_col, v_col)
        key = (spec_key(ints + (jobs,)), spec_key(ts))
        launcher = self._launcher(plan["position_end"])
        q_desc = self._cached(q, "q", make(q.view(-1, h_q * d_qk), [rows, d_qk]))
        o_desc = launcher.output_descriptor(key, out, h_q * d_v, make(out.view(-1, h_q * d_v), [rows, d_v]))
        k_desc = self._cached(k_cache, "k", make(k2, [chunk, d_qk]))
        v_desc = self._cached(v_cache, "v", make(v2, [chunk, d_v]))
        stream = _stream()
        args = (q_desc, k_desc, v_desc, o_desc, out, lse, _counter(self.device, stream), arrays["jobs"],
                arrays["entry_ptr"], arrays["blocks"], arrays["partial"], arrays["kv_lens"], arrays["qo_indptr"],
                arrays["tile_req"], arrays["tile_row0"], arrays["base"], arrays["table"], *ints, ts, jobs,
                qk_scale(self.module))
        launcher.launch((min(jobs, self.sms),), args, key, stream)
        return out, lse
