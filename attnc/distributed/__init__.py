"""Context parallelism on torch.distributed: one spec over many ranks, balanced by the mask.

::

    import torch.distributed as dist
    import attnc, attnc.distributed

    dist.init_process_group("gloo")                      # every rank, as torchrun starts them
    attn = attnc.compile("examples/causal_document.attn")
    cp = attnc.distributed.ContextParallel(attn)         # the default group's ranks
    plan = cp.plan(batch=B, seq_len=S, doc=doc)          # every rank, the whole sequence's tensors
    q_l, k_l, v_l = plan.shard(q), plan.shard(k), plan.shard(v)   # this rank's tokens
    o_l = cp(q_l, k_l, v_l, plan=plan)                   # this rank's rows of O
    o = plan.gather(o_l)                                 # or cp(..., gather=True)

The plan (``compiler.cp``) gives every rank whole tiles of tokens so that the *computed* cells
(the mask's non-SKIP tiles), not the tokens, are balanced, and lists for each rank the key tiles
its rows compute against.  A call then

1. posts, with ``torch.distributed.batch_isend_irecv``, one message per (owner, rank) pair that
   the plan connects: the owner's K/V tiles the rank needs, exactly those (a rank whose rows need
   nothing of another rank never receives from it);
2. computes its rows against its own K/V while the messages travel, then against each owner's
   tiles as they arrive, one block (query segment x run of key tiles) at a time, each block at its
   true positions (the mask is evaluated at absolute q and k; the tensors are the whole
   sequence's);
3. merges the blocks' partial (O, LSE) states with the split-state algebra on torch tensors
   (:func:`merge_states`, the twin of ``backends.numpy.state.merge_output_state``, M4.5 §0x02F:
   a row is valid where its LSE is not -inf, so a NaN row propagates and is reported) and
   rounds O once.

**Agreement.**  ``plan`` and every multi-rank call first run ``agree.agree``: one small
collective of the call's signature and the rank's local verdict, before any K/V message, so a
rank-local refusal is every rank's error and calls that differ are refused on every rank.
The package: ``shards`` (:class:`ShardPlan`), ``agree``, ``blocks`` (the block backends and a
rank's merged rows), ``exchange`` (the K/V messages).

**Blocks and devices.**  A block backend (a backend's ``block_runner``: ``NumpyBlocks``,
``TritonBlocks``; or ``_ReferenceBlocks``) has ``prepare(t)`` (a bhsd torch tensor -> its container: CPU float32,
the storage dtype on the call's device, CPU float64), ``forward(q, k, v, args)`` (a partial O,
LSE), ``backward(q, k, v, o, lse, do, dlse, args)`` (the block's dQ, dK, dV shares) and
``output(o)``; ``args`` is ``CPPlan.block_args`` (tile lists, ``classes``, offsets, the whole
call's ``lengths``).  CUDA tensors run Triton, CPU tensors numpy (``backend=`` forces one;
"triton" on CPU tensors needs ``TRITON_INTERPRET=1``; "reference" is the float64 oracle per
block, forward and backward, a check, and the default for float64 shards).  The messages are
buffers on the tensors' device over NCCL; over gloo, CUDA tensors are staged through host memory.
A one-rank plan runs the plain call (``attn(q, k, v, **tensors)``) whatever the device.

**The backward pass.**  The call is a ``torch.autograd.Function`` (``_ContextParallelFn``) that
saves this rank's q, k, v shards and its O and LSE.  Its backward posts the same K/V messages
again rather than keeping the received K/V from the forward: keeping them would hold up to the
whole sequence's K/V on a rank (causal's last rank needs every earlier tile), which is the memory
context parallelism exists to save, and the messages overlap the own-K/V blocks as in the
forward.  Every block the forward computed runs its backward with its rows' *final* O and LSE
(P = exp(S - LSE), D = rowsum(dO * O) - dLSE), so the blocks' shares add up to the exact
gradient: dQ sums over the rank's blocks, dK/dV of its own keys over its own rows' blocks, and
the shares of another owner's keys go back to it along the reversed messages (one
``batch_isend_irecv`` after the blocks, in float32, float64 on the reference path), where the
owner adds them.  GQA's dK/dV sum over each K/V head's query group inside the blocks; LSE in the
loss (dLSE) is differentiated.  ``gather=True`` is differentiable: the gathered O is taken as
replicated (every rank computes the same loss from it, as DTensor's ``Replicate``), so a rank's
gradient is the incoming gradient at its own positions.  Spec tensors are the plan's values: one
that requires grad is refused on more than one rank (one rank runs the plain call, which
differentiates score tensors on the numpy backend).
"""
from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist

from ..api import Attention, BackendRefused, compile as compile_spec
from ..compiler import numerics
from ..compiler.dispatch import device_default, torch_backend, with_capability
from ..compiler.cp import DEFAULT_BLOCK, CPPlan, plan_cp
from ..compiler.errors import InputError, PlanError
from .agree import agree
from .blocks import (_DTYPES, _ReferenceBlocks, merge_states, rank_attention,
                     rank_attention_backward)
from .exchange import _Exchange, _return_gradients
from .shards import ShardPlan, _pair

__all__ = ["BACKENDS", "ContextParallel", "ShardPlan", "merge_states", "rank_attention", "rank_attention_backward"]
# what a multi-rank call runs its blocks with: the backends with blocks, and the float64 oracle
BACKENDS = (*with_capability("block"), "reference")
CALL_KEYWORDS = ("plan", "return_lse", "gather", "backend")


class ContextParallel:
    """Context-parallel attention of one spec over a process group (module docstring)."""

    def __init__(self, attn: Attention | str, *, group=None, block: int = DEFAULT_BLOCK, strategy: str = "auto"):
        self.attn = attn if isinstance(attn, Attention) else compile_spec(attn)
        self.group = group
        self.block = block
        self.strategy = strategy
        if dist.is_available() and dist.is_initialized():
            self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        elif group is not None:
            raise InputError("ContextParallel: a group was given but torch.distributed is not initialized")
        else:
            self.ranks, self.rank = 1, 0

    def __repr__(self) -> str:
        return f"attnc.distributed.ContextParallel({self.attn.name}, rank {self.rank} of {self.ranks})"

    # ------------------------------------------------------------ plans
    def plan(self, *, batch: int, seq_len: int, heads=None, head_dim=None, dtype=None, **tensors) -> ShardPlan:
        """Plan B requests of ``seq_len`` tokens over this group's ranks.  Every rank calls it
        with the same arguments: the mask's tensors for the whole sequence (they are checked to
        agree).  ``heads`` (H or (H_q, H_kv)), ``head_dim`` (d or (d_qk, d_v)) and ``dtype``
        (a torch dtype) default to the spec's; a shape-generic spec needs them.  The ranks agree
        first (``agree``): a refusal on one rank is every rank's error."""
        cp, error = None, None
        try:
            cp = self._plan(batch, seq_len, heads, head_dim, dtype, tensors)
        except Exception as e:  # noqa: BLE001 (every rank raises it: agree)
            error = e
        signature = {} if cp is None else {
            "batch": cp.batch, "seq_len": cp.seq_len, "block": self.block, "strategy": self.strategy,
            "tensors": sorted(tensors), "plan (heads, head_dim, dtype or the tensors' values)": cp.digest()[:16]}
        agree(self.group, self.ranks, "context-parallel plan", signature, error)
        return ShardPlan(cp, self.rank, self.group, dict(tensors))

    def _plan(self, batch, seq_len, heads, head_dim, dtype, tensors: dict) -> CPPlan:
        p = self.attn.program
        heads = _pair(heads, "heads") or (p.heads_q, p.heads_kv)
        dims = _pair(head_dim, "head_dim") or (p.d_qk, p.d_v)
        name = _DTYPES.get(dtype, dtype) if dtype is not None else p.dtype
        if None in (*heads, *dims, name):
            raise InputError(f"spec '{p.name}' leaves {', '.join(p.open_fields)} to the call: pass heads=, "
                             "head_dim= and dtype= to plan()")
        program = self.attn.specialize(*heads, *dims, name)
        unknown = sorted(set(tensors) - set(self.attn.tensor_names))
        if unknown:
            raise InputError(f"inputs: unknown keyword '{unknown[0]}' (spec '{p.name}' reads "
                             f"{', '.join(self.attn.tensor_names) or 'no tensors'})")
        host = {n: (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t))
                for n, t in tensors.items()}
        return plan_cp(program, batch, seq_len, self.ranks, host, block=self.block, strategy=self.strategy)

    # ------------------------------------------------------------ the call
    def __call__(self, q, k, v, *, plan: ShardPlan, return_lse: bool = False, gather: bool = False,
                 backend: str | None = None, **unknown):
        """This rank's rows of O (and LSE [B, H_q, tokens]) from its shards of q, k, v (the
        spec's layout, :meth:`ShardPlan.shard`); ``gather=True`` returns the whole sequence's on
        every rank.  ``backend``: None (the device's: Triton on CUDA, numpy on CPU), "numpy",
        "triton" or "reference" (the float64 oracle per block: a check).  Differentiable in q, k
        and v (module docstring, "The backward pass").  On more than one rank, the ranks agree on
        the call before any K/V message (``agree``): one rank's refusal, or calls that differ,
        are every rank's error."""
        error, blocks = None, None
        try:
            blocks = self._check(q, k, v, plan, backend, unknown)
        except Exception as e:  # noqa: BLE001 (every rank raises it: agree)
            error = e
        grad = error is None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if self.ranks > 1:
            signature = {}
            try:
                signature = {} if error is not None else self._signature(q, k, v, plan, blocks, grad, gather,
                                                                         return_lse)
            except Exception as e:  # noqa: BLE001 (every rank raises it: agree)
                error = e
            agree(self.group, self.ranks, "context-parallel call", signature, error)
        elif error is not None:
            raise error
        if blocks is None:  # one rank: the plain (differentiable) call, as the user makes it (gather: the same)
            options = {} if backend is None else {"backend": backend}
            return self.attn(q, k, v, return_lse=return_lse, **options, **plan.tensors)
        call = _Call(self, plan, blocks)
        error = None
        try:
            o, lse = _ContextParallelFn.apply(call, q, k, v) if grad else call.forward(q, k, v)
        except Exception as e:  # noqa: BLE001 (with gather, every rank raises it: agree)
            error = e
        if gather:  # a rank whose rows failed (a NaN row) must not leave its peers blocked in the gather
            agree(self.group, self.ranks, "context-parallel call", {}, error, verb="failed computing its rows")
        elif error is not None:
            raise error
        if gather:
            if plan.ranks > 1 and (o.requires_grad or lse.requires_grad):
                o, lse = _Gather.apply(o, plan, None), _Gather.apply(lse, plan, 2)
            else:
                o, lse = plan.gather(o), plan.gather(lse, dim=2)
        return (o, lse) if return_lse else o

    def _check(self, q, k, v, plan, backend, unknown: dict) -> str | None:
        """Every check of a call this rank can make alone; the backend its blocks run on (None:
        the plain one-rank call)."""
        if unknown:
            raise InputError(f"ContextParallel: unknown keyword '{sorted(unknown)[0]}' (a call takes q, k, v and "
                             f"{', '.join(n + '=' for n in CALL_KEYWORDS)})")
        if not isinstance(plan, ShardPlan):
            raise InputError("ContextParallel: plan= takes the ShardPlan of cp.plan(...)")
        if plan.rank != self.rank or plan.ranks != self.ranks:
            raise PlanError(f"the plan was made for rank {plan.rank} of {plan.ranks}; this is rank {self.rank} "
                            f"of {self.ranks}")
        for n, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InputError(f"inputs: '{n}' must be a 4-D torch tensor in the spec's layout")
            if t.shape[0] != plan.cp.batch or t.shape[plan.seq_axis] != plan.tokens:
                raise InputError(f"inputs: '{n}' has shape {list(t.shape)}; rank {plan.rank}'s shard holds "
                                 f"B = {plan.cp.batch} requests of {plan.tokens} tokens (plan.shard(...))")
        if backend not in (None, *BACKENDS):
            raise InputError(f"unknown backend {backend!r}; expected {', '.join(sorted(BACKENDS))}")
        if plan.ranks == 1 and backend != "reference":
            return None
        if backend is None:  # the device's backend; float64 CPU tensors: the float64 oracle
            backend = "reference" if not q.is_cuda and q.dtype == torch.float64 else device_default(q.device.type)
        self._check_call(q, k, v, plan, backend)
        if torch.is_grad_enabled():
            asked = [n for n, t in plan.tensors.items() if getattr(t, "requires_grad", False)]
            if asked:
                raise InputError(f"inputs: tensor '{asked[0]}' requires grad; a multi-rank context-parallel "
                                 "call reads the plan's values of the spec's tensors and differentiates q, k "
                                 "and v only: pass it detached to cp.plan(...)")
        return backend

    @staticmethod
    def _signature(q, k, v, plan: ShardPlan, backend, grad: bool, gather: bool, return_lse: bool) -> dict:
        """What every rank's call must share: all but the shards' token counts (which the plan
        gives each rank)."""
        def shape(t):
            s = list(t.shape)
            s[plan.seq_axis] = "tokens"
            return s
        return {"plan": plan.cp.digest()[:16], "backend": str(backend), "device type": q.device.type,
                "dtypes of q/k/v": [str(t.dtype) for t in (q, k, v)], "shapes of q/k/v": [shape(t) for t in (q, k, v)],
                "gather": bool(gather), "return_lse": bool(return_lse), "requires_grad": bool(grad),
                "transport": plan.transport(q.device)}

    def _check_call(self, q, k, v, plan: ShardPlan, backend: str) -> None:
        cp = plan.cp
        h = 2 if plan.seq_axis == 1 else 1
        for n, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise InputError(f"inputs: '{n}' is on {t.device}, q on {q.device}: q, k and v live on one device")
        p = cp.program
        wide = q.dtype == torch.float64  # float64 end to end: the reference blocks only
        if wide and backend != "reference":
            raise InputError(f"inputs: q is float64, which runs on backend 'reference' only (float64 end to end); "
                             f"backend {backend!r} takes the plan's dtype {p.dtype}")
        shape = (q.shape[h], k.shape[h], q.shape[3], v.shape[3], p.dtype if wide else _DTYPES.get(q.dtype))
        if shape != (p.heads_q, p.heads_kv, p.d_qk, p.d_v, p.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise InputError(f"inputs: q/k/v have heads {shape[0]}/{shape[1]}, head_dim {shape[2]}/{shape[3]}, "
                             f"dtype {q.dtype}/{k.dtype}/{v.dtype}; the plan is for heads {p.heads_q}/{p.heads_kv}, "
                             f"head_dim {p.d_qk}/{p.d_v}, {p.dtype}")
        refusal = None if backend == "reference" else torch_backend(backend).device_refusal(q.device)
        if refusal:
            raise BackendRefused(f"attnc.distributed: {refusal}")
        if plan.ranks > 1:
            plan.transport(q.device)  # refuses a group that cannot move this device's tensors

    def _blocks(self, cp: CPPlan, backend: str, device, dtype):
        if backend == "reference":
            return _ReferenceBlocks(cp, device)
        return torch_backend(backend).block_runner(self.attn, cp, device, dtype)


class _Call:
    """One multi-rank call's settings, shared by its forward and its backward."""

    def __init__(self, cpar: ContextParallel, plan: ShardPlan, backend: str):
        self.cpar, self.plan, self.backend = cpar, plan, backend

    def _bhsd(self, t):
        return t.transpose(1, 2) if self.plan.seq_axis == 1 else t

    def forward(self, q, k, v):
        """(O in the spec's layout, q's dtype and device; LSE [B, H_q, tokens]) of this rank."""
        plan = self.plan
        exchange = _Exchange(plan, k, v, plan.transport(q.device))  # first: a failure below still sends our K/V
        try:
            blocks = self.cpar._blocks(plan.cp, self.backend, q.device, q.dtype)
            o, lse = rank_attention(plan.cp, plan.rank, blocks, *(blocks.prepare(self._bhsd(t)) for t in (q, k, v)),
                                    lambda src: tuple(blocks.prepare(t) for t in exchange.fetch(src)))
        finally:
            exchange.finish()
        _check_rows(lse, plan)
        return self._bhsd(blocks.output(o)), lse.to(q.device)

    def backward(self, q, k, v, o, lse, do, dlse):
        """(dQ, dK, dV) of this rank's shards, in their layouts, dtypes and device.  The K/V messages
        are posted again (the forward keeps nothing but O and LSE); dK/dV of other ranks' tiles go
        back to their owners along the reversed messages, and theirs of ours are added here.  The
        ranks agree before the reversed messages: a rank whose blocks failed makes every rank
        raise its error instead of leaving the others waiting for its shares."""
        plan, cp = self.plan, self.plan.cp
        transport = plan.transport(q.device)
        exchange = _Exchange(plan, k, v, transport)  # first: a failure below still sends our K/V
        error, do = None, torch.zeros_like(o) if do is None else do
        try:
            blocks = self.cpar._blocks(cp, self.backend, q.device, q.dtype)
            prep = lambda t: None if t is None else blocks.prepare(self._bhsd(t) if t.dim() == 4 else t)  # noqa: E731
            dq, dk, dv, remote = rank_attention_backward(
                cp, plan.rank, blocks, *(prep(t) for t in (q, k, v, o, lse, do, dlse)),
                lambda src: tuple(blocks.prepare(t) for t in exchange.fetch(src)))
        except Exception as e:  # noqa: BLE001 (every rank raises it: agree)
            error = e
        finally:
            exchange.finish()
        agree(plan.group, plan.ranks, "context-parallel backward", {}, error, verb="failed its gradients")
        _return_gradients(plan, transport, dk, dv, remote)
        return tuple(self._bhsd(g).to(device=x.device, dtype=x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))


class _ContextParallelFn(torch.autograd.Function):
    """The multi-rank call as one autograd node: saves this rank's q, k, v shards and its O, LSE."""

    @staticmethod
    def forward(ctx, call: _Call, q, k, v):
        o, lse = call.forward(q, k, v)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(q, k, v, o, lse, do, dlse)
        return None, dq, dk, dv


class _Gather(torch.autograd.Function):
    """``plan.gather`` with a gradient: every rank holds the whole sequence, and its consumers are
    taken to be replicated (every rank computes the same loss from it, as DTensor's Replicate),
    so the gradient of this rank's shard is the incoming gradient at this rank's positions."""

    @staticmethod
    def forward(ctx, x, plan: ShardPlan, dim):
        ctx.plan, ctx.dim = plan, dim
        return plan.gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.shard(grad, ctx.dim), None, None


def _check_rows(lse: torch.Tensor, plan: ShardPlan) -> None:
    """A row whose visible score was NaN or +inf (its merged LSE is NaN) is an error, as in the
    single-process call; the message names the row's absolute position."""
    bad = numerics.bad_rows(lse)
    if not bool(bad.any()):
        return
    b, h, i = (int(x[0]) for x in torch.nonzero(bad.cpu(), as_tuple=True))
    raise PlanError(numerics.nonfinite_message(b, h, int(plan.positions[i]), plan.cp.program.sink is not None))
