"""Load generated numpy modules and call them with validated inputs and a plan.

A :class:`Kernel` runs two kinds of call (DESIGN §5; keys are ``attnc run``'s npz keys):

**Contiguous calls** -- ``kernel(q, k, v, **tensors)`` with ``q [B, H_q, S_q, d_qk]``,
``k [B, H_kv, S_k, d_qk]``, ``v [B, H_kv, S_k, d_v]`` (bhsd; bshd specs swap the middle axes):
every request has the same ``S_q`` and ``S_k``; the tiled program walks the tile CSR
(:class:`compiler.plan.Plan`).  Returns ``o`` in ``q``'s layout and ``lse [B, H_q, S_q]``.

**Split calls** -- over a ragged or paged cache (always), or a contiguous cache with
per-request lengths.  The query is packed, the K/V arguments are the storage tensors, and
the cache metadata comes by keyword::

    kernel(q, k_cache, v_cache, block_table=..., kv_lens=...)            # paged, dense table
    kernel(q, k_cache, v_cache, kv_indptr=..., kv_indices=..., kv_last_page_len=...)  # paged, CSR
    kernel(q, k, v, kv_indptr=...)                                         # ragged
    kernel(q, k, v, kv_lens=..., cache_batch_idx=...)                      # contiguous, per request

    q        [total_q, H_q, d_qk]   request b's rows are qo_indptr[b]:qo_indptr[b+1]
    k_cache  [pages, P, H_kv, d_qk] (nhd) or [pages, H_kv, P, d_qk] (hnd); v_cache likewise
    k, v     ragged [sum kv_lens, H_kv, d]; contiguous [B_c, H_kv, T_c, d] (bhsd) / [B_c, T_c, H_kv, d]
    optional q_lens [B] or qo_indptr [B+1] (default: one query row per request: decode),
             cache_batch_idx [B] (contiguous and dense-table caches), every declared tensor
             (its ``s`` axis is max(kv_lens) long).

Request b's ``q_lens[b]`` query rows are the last of its ``kv_lens[b]`` keys (bottom-right), so
prefill (``q_len = kv_len``), append, decode (``q_len = 1``) and mixed batches are one call; a
request with ``q_len = 0`` produces no rows, and ``kv_len = 0`` with ``q_len > 0`` is an
InputError.  Returns ``o [total_q, H_q, d_v]`` and ``lse [total_q, H_q]`` (packed like ``q``).
The call is planned (:func:`compiler.plan.plan_split`: split bounds from the spec's ``split =``,
storage segments, workspace of its ``state =`` ABI, the validated schedule graph) before any
arithmetic; ``plan=`` reuses a :class:`compiler.plan.SplitPlan`, ``occupancy=`` sets what the
``heuristic``/``auto`` split policies read.  ``kernel.run(arrays)`` takes the same keys as a dict.

**The float64 reference and the backward pass** (contiguous calls only) --
``kernel.forward64(q, k, v, **tensors) -> (o, lse)`` and ``kernel.backward(q, k, v, o, lse, do,
**tensors) -> (dq, dk, dv, dtensors)``: a generated module (backends/numpy/backward.py), emitted
on first use, computes them densely in float64 from the score program and its derivatives.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler import inputs, ir, numerics, reads
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.plan import DEFAULT_SMS, Plan, SplitPlan, plan as make_plan, plan_split
from attnc.backends.common import load_module
from .backward import emit_backward
from .emit import Source, emit


class Kernel:
    """A callable attention kernel for one program (DESIGN §5)."""

    def __init__(self, program: ir.Program, source: Source, num_sms: int = DEFAULT_SMS):
        self.program = program
        self.source = source
        self.num_sms = num_sms
        self.module = load_module(source.text, source.module_stem)
        self._split_module = self.module if source.family == "decode_split" else None
        self._backward_module = None

    @property
    def split_module(self):
        """The two-launch split program (emitted on first use for a contiguous spec)."""
        if self._split_module is None:
            src = emit(self.program, family="decode_split")
            self._split_module = load_module(src.text, src.module_stem)
        return self._split_module

    @property
    def backward_module(self):
        """The float64 forward/backward reference (backends/numpy/backward.py), emitted on first use."""
        if self._backward_module is None:
            src = emit_backward(self.program)
            self._backward_module = load_module(src.text, src.module_stem)
        return self._backward_module

    # ------------------------------------------------------------ float64 reference and backward
    def forward64(self, q, k, v, **tensors):
        """``(o, lse)`` in float64 (the oracle's semantics) for a contiguous call in the spec's
        layout; q, k, v of any float dtype.  ``o`` is in q's layout."""
        inputs.contiguous_only(self.program, tensors)
        call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **tensors}, np.float64)
        module = self.backward_module
        try:
            return module.forward(*(np.asarray(x, np.float64) for x in (q, k, v)), **call.tensors)
        except module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None

    def backward(self, q, k, v, o, lse, do, dlse=None, **tensors):
        """``(dq, dk, dv, dtensors)`` in float64 for a contiguous call: the saved ``o`` (q's layout)
        and ``lse [B, H_q, S_q]`` of the forward and the incoming gradient ``do``; dq, dk, dv come
        in the layouts of q, k, v and ``dtensors`` maps every f32 tensor the score program reads
        to its gradient (masks and int/bool tensors get none)."""
        call, saved = inputs.validate_backward(self.program, {"q": q, "k": k, "v": v, "o": o, "lse": lse,
                                                              "do": do, **tensors})
        module = self.backward_module
        try:
            if dlse is not None and np.shape(dlse) != saved["lse"].shape:
                raise InputError(f"inputs: 'dlse' has shape {list(np.shape(dlse))}; LSE's is "
                                 f"{list(saved['lse'].shape)}")
            return module.backward(*(np.asarray(x, np.float64) for x in (q, k, v)), saved["o"], saved["lse"],
                                   saved["do"], dlse, **call.tensors)
        except module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None

    # ------------------------------------------------------------ plans
    def plan(self, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
             block_m: int | None = None, block_n: int | None = None, method: str = "auto") -> Plan:
        """The tile plan of a contiguous call."""
        if self.source.family != "attention":
            raise PlanError(f"spec '{self.program.name}' declares a {self.program.cache.kind.value} cache: "
                            "plan its calls with plan_split")
        return make_plan(self.program, batch, s_q, s_k, tensors, block_m or self.module.BLOCK_M,
                         block_n or self.module.BLOCK_N, method)

    def plan_split(self, arrays: dict, *, occupancy=None, policy=None) -> SplitPlan:
        """The split plan of a split call given as a dict of DESIGN §5 keys."""
        call = inputs.validate_cache(self.program, arrays)
        return self._plan_split(call, occupancy, policy)

    def _plan_split(self, call: inputs.CacheCall, occupancy=None, policy=None) -> SplitPlan:
        return plan_split(self.program, call.layout, call.q_lens, policy=policy, occupancy=occupancy,
                          num_sms=self.num_sms)

    # ------------------------------------------------------------ calls
    def __call__(self, q, k, v, *, cache=None, lengths=None, plan: Plan | SplitPlan | None = None,
                 return_lse=False, block_m: int | None = None, block_n: int | None = None,
                 stats: dict | None = None, occupancy=None, **keys):
        if cache is not None or lengths is not None:
            raise InputError("pass the cache metadata by its keys (README \"Serving\": block_table=, kv_lens=, "
                             "kv_indptr=, kv_indices=, kv_last_page_len=, q_lens=, ...), not cache=/lengths=")
        if inputs.is_split_call(self.program, keys) or isinstance(plan, SplitPlan):
            k_key, v_key = ("k_cache", "v_cache") if self.program.cache.kind is ir.CacheKind.PAGED else ("k", "v")
            return self.run({"q": q, k_key: k, v_key: v, **keys}, plan=plan, return_lse=return_lse,
                            stats=stats, occupancy=occupancy)
        call = inputs.validate(self.program, {"q": q, "k": k, "v": v, **keys})
        if plan is None:
            plan = self.plan(call.batch, call.s_q, call.s_k, call.tensors, block_m, block_n)
        plan.check_call(self.program, call.batch, call.s_q, call.s_k)
        numerics.check_values(call.v)  # (bhsd after validate)
        fn = getattr(self.module, self.source.entry)
        try:
            o, lse = fn(np.asarray(q), np.asarray(k), np.asarray(v), plan=plan.kernel_args(),
                        return_lse=True, stats=stats, **call.tensors)
        except self.module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None
        numerics.check_rows(lse, s_q=call.s_q, s_k=call.s_k, sink=self.program.sink is not None)
        if self.program.dtype == "f16":
            o = o.astype(np.float16)
        return (o, lse) if return_lse else o

    def block(self, q, k, v, block: dict, tensors: dict):
        """One block of a larger contiguous call (context parallelism, ``compiler.cp``): query
        rows and keys in the spec's layout, ``block`` the block's tile lists and the positions of
        its first row and key (``CPPlan.block_args``), ``tensors`` the whole call's, validated
        with its plan.  Returns the partial state: O [.., d_v] in float32 as computed (not
        rounded to the storage dtype) and LSE [B, H_q, rows]."""
        if self.source.family != "attention":
            raise PlanError(f"spec '{self.program.name}' declares a {self.program.cache.kind.value} cache: "
                            "a block of a contiguous call needs a contiguous one")
        fn = getattr(self.module, self.source.entry)
        try:
            return fn(np.asarray(q), np.asarray(k), np.asarray(v), plan=block, return_lse=True, **tensors)
        except self.module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None

    def block_backward(self, q, k, v, o, lse, do, dlse, block: dict, tensors: dict):
        """The float64 gradients of one block of a larger contiguous call (context parallelism):
        q, o, do [rows] and k, v [keys] in the spec's layout (as :meth:`block`), ``o``, ``lse``
        (and ``dlse``, or None) the rows' *final* values over the whole call's keys, ``block`` the
        block's ``CPPlan.block_args`` (its ``q_offset``, ``k_offset`` and ``lengths`` are read),
        ``tensors`` the whole call's, validated.  Returns this block's share of (dQ, dK, dV) in
        float64, in the spec's layout (dK, dV per K/V head: GQA's query group summed); the shares
        of every block add up to the call's gradients.  Gradients of score tensors are not
        returned (a block's share would be over the whole tensor: ``backward`` gives them)."""
        module = self.backward_module
        wide = [np.asarray(x, np.float64) for x in (q, k, v, o, lse, do)]
        try:
            dq, dk, dv, _ = module.backward(*wide, None if dlse is None else np.asarray(dlse, np.float64),
                                            q_offset=block["q_offset"], k_offset=block["k_offset"],
                                            lengths=block.get("lengths"), **tensors)
        except module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None
        return dq, dk, dv

    def run(self, arrays: dict, *, plan: Plan | SplitPlan | None = None, return_lse=False,
            stats: dict | None = None, occupancy=None):
        """A call given as a dict of DESIGN §5 keys (what ``attnc run`` reads from an npz)."""
        if not inputs.is_split_call(self.program, arrays) and not isinstance(plan, SplitPlan):
            rest = {n: a for n, a in arrays.items() if n not in ("q", "k", "v")}
            missing = [n for n in ("q", "k", "v") if n not in arrays]
            if missing:
                raise InputError(f"inputs: missing key '{missing[0]}'")
            return self(arrays["q"], arrays["k"], arrays["v"], plan=plan, return_lse=return_lse,
                        stats=stats, **rest)
        call = inputs.validate_cache(self.program, arrays)
        if plan is None:
            plan = self._plan_split(call, occupancy)
        elif not isinstance(plan, SplitPlan):
            raise PlanError("a split call needs a SplitPlan (Kernel.plan_split), not a tile plan")
        plan.check_call(self.program, call.layout, call.q_lens)
        reads.check_requests(self.program, call.tensors, call.kv_lens, call.q_lens)  # (the oracle's read errors)
        module = self.split_module
        try:
            o, lse = module.attention(call.q, call.k, call.v, plan=plan.kernel_args(), return_lse=True,
                                      stats=stats, **call.tensors)
        except module.AttncRuntimeError as e:
            raise PlanError(str(e)) from None
        numerics.check_rows(lse, qo_indptr=call.qo_indptr, kv_lens=call.kv_lens,
                            sink=self.program.sink is not None)
        if self.program.dtype == "f16":
            o = o.astype(np.float16)
        return (o, lse) if return_lse else o


def load(program: ir.Program, *, num_sms: int = DEFAULT_SMS, **options) -> Kernel:
    """The kernel of ``program``; ``options`` go to :func:`emit` (``block_m``, ``block_n``,
    ``family``), ``num_sms`` is the device the split heuristic plans for."""
    return Kernel(program, emit(program, **options), num_sms=num_sms)
