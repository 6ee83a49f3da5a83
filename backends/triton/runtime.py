"""The Triton backend's kernel object: a spec's generated module plus the library kernels, called
on torch tensors (or numpy arrays, copied to the device and back).

``kernel(q, k, v, **tensors)`` runs prefill / append over contiguous K/V; ``kernel.decode(q, ...)``
and ``kernel.run(arrays)`` run split-K/V calls (decode, append, mixed batches) over any cache
layout.  What a call runs with is ``choice.choose_prefill``'s decision; plans
come from the process's plan cache (``plans.PLANS``).

A prefill call's host path: the first call with a given key (shapes, strides, dtypes, device,
pointer alignments, the names and layouts of the mask's tensors) validates the call, chooses
the config, plans, uploads the plan and binds the launch; every later call with that key looks
the bound launch up (for masks reading tensors, by the tensors' identity and version), allocates
O and LSE and launches.  On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported; the tests do).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from attnc import layouts
from attnc.compiler import inputs, ir, numerics, reads, resources, sinks
from attnc.compiler.ranges import may_be_nonfinite
from attnc.compiler.errors import BackendUnavailable, InputError, PlanError
from attnc.compiler.plan import Plan, plan as make_plan
from attnc.compiler.dispatch.signature import call_signature
from attnc.backends.common import load_module

from . import choice, device, tile_classes
from . import plans as P
from .args import FP8_INPUTS, TORCH_DTYPES, _Bound, _kind  # noqa: F401  (FP8_INPUTS)
from .backward_calls import BackwardCalls
from .decode import GPU_MIN_TILE, _check_gpu_tile  # noqa: F401  (GPU_MIN_TILE: the tests')
from .device import interpreted
from .emit import Source, emit
from .prefill_calls import PrefillCalls

from .kernels.numerics import _mark_nan
from .launch import Launcher
from .split_calls import SplitCalls

CHECK_FINITE_VAR = "ATTNC_CHECK_FINITE"  # "1": GPU calls check their rows at the call (a host sync each); "0": no mark
_MARK_BLOCK = 1024



def marks_on_device(t) -> bool:
    """Whether a call on ``t``'s device checks its rows on the device (a flag marked without a host
    sync, ``Kernel._row_check``) rather than at the host: CUDA tensors.  (bench/host_time.py and
    tests/numerics/test_launch_counts.py replace it to take a GPU call's path on the CPU.)"""
    return t.is_cuda


def _flag_outside_pools(torch, device):
    """A zeroed int32[1] on ``device``, made on a thread of its own: during torch.compile's CUDA-graph
    warm-up ("reduce-overhead") the calling thread's allocations go to the graphs' private pool, and
    a flag that outlives the call there is an allocation the graphs did not make, which they refuse.
    Once per device; the thread waits for the zeros before the calling stream reads them."""
    made: list = []

    def make():
        try:
            made.append(torch.zeros(1, dtype=torch.int32, device=device))
            if made[0].is_cuda:
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 (raised on the calling thread below)
            made.append(e)
    worker = threading.Thread(target=make, name="attnc-flag")
    worker.start()
    worker.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]

class Kernel(PrefillCalls, BackwardCalls, SplitCalls):
    """A spec's kernel: its construction, plans and argument checks here; its calls in
    ``prefill_calls``, ``backward_calls`` and ``split_calls``."""

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
        self._index_reads = reads.index_reads_tensor(program)
        self._scores_may_fail = may_be_nonfinite(program) or (program.sink is not None and sinks.may_be_nonfinite(program))
        if program.sink is not None and sinks.reads_by_value(program):
            raise PlanError(f"spec '{program.name}': the Triton kernels take a sink whose reads are fixed by b and h "
                            f"({ir.format_expr(program.sink)} reads a tensor element chosen by a tensor's value); "
                            "use the numpy backend")
        self._bound: dict = {}
        self._nonfinite: dict = {}  # device -> int32 flag: a call marked a non-finite row (_mark_rows)
        self._mark = None  # the marking launch (kernels.numerics._mark_nan), made at the first GPU mark
        self._sink_grad_launcher = None  # BackwardCalls._dsink's, made at the first sink backward
        self._sink_reductions: dict = {}  # BackwardCalls._sink_reduction's, by batch and tensor shapes
        self._at_call = threading.local()  # .on: this thread's call returns host arrays (numpy in): check now
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
        return choice.default_prefill_config(p.d_qk, p.d_v, interpreted(), capability, self._mask_reads)

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
        given = dict(tensors or {})
        on_gpu = self._device == "cuda" and all(getattr(t, "is_cuda", False) for t in given.values())
        evaluator = (tile_classes.tile_evaluator(self.module, given, batch, s_q, s_k, self._torch.device("cuda"))
                     if on_gpu else None)
        return make_plan(self.program, batch, s_q, s_k, host, bm, bn, tile_evaluator=evaluator)

    def device_plan(self, plan: Plan, device) -> dict:
        """The plan's walk arrays on ``device`` (cached on the plan)."""
        cache = plan.__dict__.setdefault("_device_args", {})
        key = str(device)
        if key not in cache:  # (the plan's arrays stay alive meanwhile: the limit counts them too)
            t = plan.tiles
            resources.require(f"the plan's device arrays ({t.partial_indices.size + t.full_indices.size:,} K/V blocks "
                              f"of {t.classes.size:,} tiles)", P.device_plan_bytes(plan))
            cache[key] = P.upload(P.walk_arrays(plan), device)
        return cache[key]

    def _row_check(self, t) -> tuple[bool, object]:
        """How a call on ``t``'s device applies the non-finite-score rule (README "Limits and
        failures"; compiler.numerics.check_rows): (whether the call's rows are checked at the host
        after it, the device flag the call marks or None).  The kernels mark a row whose visible
        score was NaN or +inf (the score program, NaN or inf in q or K, a scale that overflows q.k)
        with LSE NaN.  Host LSE (the CPU, the interpreter) and specs whose score program can produce
        one (compiler.ranges.may_be_nonfinite) raise at the call; elsewhere on a GPU the call only
        marks the kernel's device flag, asynchronously (no host sync): in the kernel that writes
        LSE (the Triton prefill kernel, the split combine) or by one launch after it (the Gluon
        engine's calls: :meth:`_mark_rows`), and :meth:`check_numerics` raises it
        (ATTNC_CHECK_FINITE=1: GPU calls check at the call too; "0": they neither check nor mark).  While a CUDA graph is captured the marking is captured
        (each replay marks) once an uncaptured call made the flag; DecodeGraph checks after each
        replay.  A call given numpy arrays copies its rows back to the host anyway: it checks at the
        call (``_at_call``), as the CPU does."""
        if not marks_on_device(t):
            return True, None
        if t.is_cuda and self._torch.cuda.is_current_stream_capturing():
            return False, self._nonfinite.get(str(t.device))  # (made by an uncaptured call, not in the graph's pool)
        check = os.environ.get(CHECK_FINITE_VAR)
        if self._scores_may_fail or check == "1" or getattr(self._at_call, "on", False):
            return True, None
        if check == "0":  # GPU calls neither check nor mark
            return False, None
        key = str(t.device)
        flag = self._nonfinite.get(key)
        if flag is None:
            flag = self._nonfinite[key] = _flag_outside_pools(self._torch, t.device)
        return False, flag

    def _check_scores(self, lse, check: tuple[bool, object], k=None, plan: dict | None = None,
                      marked: bool = False):
        """Apply ``check`` (:meth:`_row_check` of the call) to the call's LSE: mark its flag where the
        launch did not (``marked``), check the rows at the host where asked."""
        host, flag = check
        if flag is not None and not marked:
            self._mark_rows(lse, flag)
        if not host:
            return
        if plan is None:
            s_k = k.shape[1 if self.program.cache.layout is ir.Layout.BSHD else 2]
            numerics.check_rows(lse, s_q=lse.shape[2], s_k=s_k, sink=self.program.sink is not None)
        else:
            numerics.check_rows(lse, qo_indptr=plan["qo_indptr"], kv_lens=plan["kv_lens"],
                                sink=self.program.sink is not None)

    def _check_values(self, v) -> None:  # v: logical bhsd
        """V must be finite (compiler.numerics.check_values): checked at the call where V is on the
        host or the rows come back to it (the CPU, numpy inputs), and on a GPU with
        ATTNC_CHECK_FINITE=1 (a pass over V and a host sync); a plain GPU call does not look."""
        if not marks_on_device(v) or os.environ.get(CHECK_FINITE_VAR) == "1" or getattr(self._at_call, "on", False):
            numerics.check_values(v)  # (v: the launch's logical bhsd view)

    def _mark_rows(self, lse, flag) -> None:
        """flag = 1 where any LSE is NaN, on lse's device and stream: one launch (``kernels.numerics``),
        no host sync."""
        n = lse.numel()
        if n:
            lse = lse if lse.is_contiguous() else lse.contiguous()
            if self._mark is None:
                self._mark = Launcher(_mark_nan, dict(BLOCK=_MARK_BLOCK), num_warps=4)
            key = ("mark", lse.data_ptr() % 16 == 0, n % 16 == 0, n == 1)  # (what Triton specializes on)
            self._mark.launch(((n + _MARK_BLOCK - 1) // _MARK_BLOCK,), (lse, flag, n), key)

    def check_numerics(self) -> None:
        """Raise (and clear) what GPU calls since the last check marked without a host sync: a
        PlanError saying that a call of this kernel had a visible NaN or +inf score.  Waits for
        those calls (one host sync).  ATTNC_CHECK_FINITE=1 checks every call instead, naming the
        call's first such row."""
        for key, flag in self._nonfinite.items():
            if bool(flag.any()):
                flag.zero_()
                sink = " or a NaN or +inf sink" if self.program.sink is not None else ""
                raise PlanError(f"a call of '{self.program.name}' on {key} since the last check had NaN or +inf "
                                f"at a visible key{sink} (NaN or inf in q, K or a tensor, a scale that overflows "
                                "q.k, or the score program): its LSE and O rows are NaN; set ATTNC_CHECK_FINITE=1 "
                                "to raise at that call, naming the row")

    def _key(self, q, k, v, tensors: dict) -> tuple:
        return call_signature(q, k, v, tensors)

    def _validate(self, q, k, v, tensors: dict, *, storage: bool = True) -> _Bound:
        """Check a prefill call's devices, keys, shapes (and, ``storage``, that q/k/v are in the
        spec's dtype); what the call's key then fixes."""
        torch = self._torch
        stray = [n for n in FP8_INPUTS if n in tensors]
        if stray:
            raise InputError(f"inputs: '{stray[0]}' is given but q is {q.dtype}: descales go with float8_e4m3fn q, k "
                             "and v (attnc.fp8.quantize)")
        given = {"q": q, "k": k, "v": v, **tensors}
        stray = next((n for n, t in given.items() if not isinstance(t, torch.Tensor)), None)
        if stray is not None:
            raise InputError(f"inputs: '{stray}' is a {type(given[stray]).__name__}; the Triton backend takes torch "
                             "tensors (or q, k, v and every tensor as numpy arrays)")
        device.check_device(given, self.device)
        metas = {n: (tuple(t.shape), _kind(t), str(t.dtype)) for n, t in given.items()}
        batch, s_q, s_k = inputs.check_shapes(self.program, metas)
        if self.program.sink is not None:  # the kernels clamp their reads: a sink's read outside a tensor is refused
            sinks.check_reads(self.program, batch, {n: metas[n][0] for n in self._tensor_names})
        if storage and any(x.dtype != self._dtype for x in (q, k, v)):
            raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; "
                             f"the spec stores {self.program.dtype}")
        p = self.program
        bshd = p.cache.layout is ir.Layout.BSHD
        out_shape = (batch, s_q, p.heads_q, p.d_v) if bshd else (batch, p.heads_q, s_q, p.d_v)
        # The Triton interpreter (3.9) reads bf16 tensors as garbage: on the CPU, bf16 specs carry
        # their (already bf16-rounded) values in float32 and O is rounded to bf16 after.
        emulate = storage and self.emulates(self._dtype)
        # O in q's order (attnc.layouts.out_order): a bshd spec's O is contiguous [B, S, H, d] as it was
        out_order = layouts.BHSD if bshd else layouts.out_order(q.shape, q.stride())
        return _Bound(batch, s_q, s_k, out_shape, bshd, emulate, out_order=out_order)

    def emulates(self, dtype) -> bool:
        """Whether tensors of ``dtype`` run as float32 here: the Triton interpreter (3.9) reads bf16
        tensors as garbage, so on the CPU bf16 values (already bf16-rounded) are carried in float32."""
        return interpreted() and dtype == self._torch.bfloat16


def load(program: ir.Program) -> Kernel:
    """The kernel of a spec: ``kernel(q, k, v, ...)`` for prefill/append over contiguous K/V,
    ``kernel.decode(q, ...)`` / ``kernel.run(arrays)`` for split-K/V calls (decode, append, mixed
    batches: packed query rows with q_lens / qo_indptr) over any cache layout."""
    return Kernel(program, emit(program))
