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

**Blocks and devices.**  A block backend (``_NumpyBlocks``, ``_TritonBlocks``,
``_ReferenceBlocks``) has ``prepare(t)`` (a bhsd torch tensor -> its container: CPU float32,
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

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .api import Attention, BackendRefused, compile as compile_spec
from .backends.numpy.state import OutputState
from .compiler import ir, numerics, oracle, sinks
from .compiler.cp import DEFAULT_BLOCK, CPPlan, plan_cp
from .compiler.errors import InputError, PlanError

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
BACKENDS = ("numpy", "triton", "reference")  # what a multi-rank call runs its blocks with


def _backend_config(group) -> dict[str, str]:
    """The group's backend per device type, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    get = getattr(dist, "get_backend_config", None)
    text = str(get(group) if get is not None else dist.get_backend(group)).lower()
    if ":" in text:
        return dict(part.split(":", 1) for part in text.split(","))
    return {"cuda": text} if text == "nccl" else {"cpu": text, "cuda": text}


def _pair(x, what: str) -> tuple[int, int] | None:
    if x is None:
        return None
    pair = tuple(x) if isinstance(x, (tuple, list)) else (x, x)
    if len(pair) != 2 or not all(isinstance(n, int) and n > 0 for n in pair):
        raise InputError(f"{what} takes a positive int or a pair of them, got {x!r}")
    return pair


class ShardPlan:
    """A context-parallel plan as one rank holds it: :class:`compiler.cp.CPPlan` plus this rank,
    its group and the mask's tensors; shards inputs and gathers outputs."""

    def __init__(self, cp: CPPlan, rank: int, group, tensors: dict):
        self.cp = cp
        self.rank = rank
        self.group = group
        self.tensors = tensors  # as the caller gave them (the one-rank plain call reads these)
        self.program = cp.program
        self.seq_axis = 1 if cp.program.cache.layout is ir.Layout.BSHD else 2  # of 4-D q, k, v, O
        self._positions = torch.from_numpy(cp.positions(rank))
        self._whole = cp.ranks == 1

    @property
    def ranks(self) -> int:
        return self.cp.ranks

    @property
    def tokens(self) -> int:
        """This rank's tokens (per request)."""
        return int(self._positions.numel())

    @property
    def positions(self) -> torch.Tensor:
        """The absolute positions of this rank's tokens, in shard order (e.g. for rotary embeddings)."""
        return self._positions

    def report(self) -> dict:
        """Per-rank tokens, computed cells and K/V bytes (``CPPlan.report``: ``attnc plan --ranks``)."""
        return self.cp.report()

    def _dim(self, x, dim: int | None) -> int:
        d = (self.seq_axis if x.dim() == 4 else 1) if dim is None else dim
        if not -x.dim() <= d < x.dim():
            raise InputError(f"dim {dim} is outside a tensor of shape {list(x.shape)}")
        return d % x.dim()

    def shard(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor, along ``dim`` (default: the spec
        layout's sequence axis for 4-D q/k/v, else axis 1 as in [B, S, ...] and doc ids [B, S])."""
        d = self._dim(x, dim)
        if x.shape[d] != self.cp.seq_len:
            raise InputError(f"shard: the tensor has {x.shape[d]} entries along dim {d} (shape {list(x.shape)}); "
                             f"the plan is for S = {self.cp.seq_len} tokens")
        if self._whole:
            return x
        return x.index_select(d, self._positions.to(x.device))

    def transport(self, device) -> str:
        """How the group moves tensors of ``device``: "device" (NCCL for CUDA tensors, gloo for CPU
        tensors) or "host" (CUDA tensors over gloo, staged through host memory).  A group that
        can do neither is refused."""
        device = torch.device(device)
        if self._whole:
            return "device"
        config = _backend_config(self.group)
        if device.type == "cuda" and config.get("cuda") == "nccl":
            return "device"
        if config.get("cpu") == "gloo":
            return "host" if device.type != "cpu" else "device"
        raise BackendRefused(f"attnc.distributed: the process group's backend is "
                             f"{','.join(f'{d}:{b}' for d, b in config.items())!r} and q, k, v are on {device}; a "
                             "multi-rank call moves CUDA tensors over NCCL and CPU tensors (or CUDA tensors staged "
                             "through host memory) over gloo: create the group with 'nccl', 'gloo' or "
                             "'cpu:gloo,cuda:nccl'")

    def gather(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """The whole sequence from every rank's shard along ``dim`` (as :meth:`shard`; LSE
        [B, H, S] shards take dim=2), on every rank."""
        d = self._dim(x, dim)
        if x.shape[d] != self.tokens:
            raise InputError(f"gather: the shard has {x.shape[d]} entries along dim {d}; rank {self.rank} owns "
                             f"{self.tokens} tokens")
        if self._whole:
            return x
        longest = int(self.cp.tokens.max())
        pad = list(x.shape)
        pad[d] = longest - self.tokens
        padded = torch.cat([x, x.new_zeros(pad)], dim=d).contiguous()
        if self.transport(x.device) == "host":
            padded = padded.cpu()
        # gloo gathers no bfloat16 in some torch builds ("unsupported ScalarType"): 2-byte floats go
        # over it as float32 (exact); P2P messages are bytes and need no such care
        wire = padded.float() if padded.device.type == "cpu" and padded.element_size() == 2 else padded
        parts = [torch.empty_like(wire) for _ in range(self.ranks)]
        dist.all_gather(parts, wire, group=self.group)
        shape = list(x.shape)
        shape[d] = self.cp.seq_len
        out = x.new_empty(shape)
        for r, part in enumerate(parts):
            n = int(self.cp.tokens[r])
            if n:
                out.index_copy_(d, torch.from_numpy(self.cp.positions(r)).to(x.device),
                                part.narrow(d, 0, n).to(x.device, x.dtype))
        return out


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
        (a torch dtype) default to the spec's; a shape-generic spec needs them."""
        p = self.attn.program
        heads = _pair(heads, "heads") or (p.heads_q, p.heads_kv)
        dims = _pair(head_dim, "head_dim") or (p.d_qk, p.d_v)
        name = _DTYPES.get(dtype, dtype) if dtype is not None else p.dtype
        if None in (*heads, *dims, name):
            raise InputError(f"spec '{p.name}' leaves {', '.join(p.open_fields)} to the call: pass heads=, "
                             "head_dim= and dtype= to plan()")
        program = self.attn.specialize(*heads, *dims, name)
        host = {n: (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t))
                for n, t in tensors.items()}
        unknown = sorted(set(tensors) - set(self.attn.tensor_names))
        if unknown:
            raise InputError(f"inputs: unknown keyword '{unknown[0]}' (spec '{p.name}' reads "
                             f"{', '.join(self.attn.tensor_names) or 'no tensors'})")
        cp = plan_cp(program, batch, seq_len, self.ranks, host, block=self.block, strategy=self.strategy)
        if self.ranks > 1:
            digests = [None] * self.ranks
            dist.all_gather_object(digests, cp.digest(), group=self.group)
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            if differ:
                raise PlanError(f"context-parallel plan: rank(s) {differ} planned differently from rank 0 (other "
                                "lengths, tensors, block or strategy); every rank must plan the same call")
        return ShardPlan(cp, self.rank, self.group, dict(tensors))

    # ------------------------------------------------------------ the call
    def __call__(self, q, k, v, *, plan: ShardPlan, return_lse: bool = False, gather: bool = False,
                 backend: str | None = None):
        """This rank's rows of O (and LSE [B, H_q, tokens]) from its shards of q, k, v (the
        spec's layout, :meth:`ShardPlan.shard`); ``gather=True`` returns the whole sequence's on
        every rank.  ``backend``: None (the device's: Triton on CUDA, numpy on CPU), "numpy",
        "triton" or "reference" (the float64 oracle per block: a check).  Differentiable in q, k
        and v (module docstring, "The backward pass")."""
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
            raise InputError(f"unknown backend {backend!r}; expected numpy, triton or reference")
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if plan.ranks == 1 and backend != "reference":  # the plain (differentiable) call, as the user makes it
            options = {} if backend is None else {"backend": backend}
            return self.attn(q, k, v, return_lse=return_lse, **options, **plan.tensors)  # (gather: the same)
        else:
            backend = backend or ("triton" if q.is_cuda else "reference" if q.dtype == torch.float64 else "numpy")
            self._check_call(q, k, v, plan, backend)
            if torch.is_grad_enabled():
                asked = [n for n, t in plan.tensors.items() if getattr(t, "requires_grad", False)]
                if asked:
                    raise InputError(f"inputs: tensor '{asked[0]}' requires grad; a multi-rank context-parallel "
                                     "call reads the plan's values of the spec's tensors and differentiates q, k "
                                     "and v only: pass it detached to cp.plan(...)")
            call = _Call(self, plan, backend)
            o, lse = _ContextParallelFn.apply(call, q, k, v) if grad else call.forward(q, k, v)
        if gather:
            if plan.ranks > 1 and (o.requires_grad or lse.requires_grad):
                o, lse = _Gather.apply(o, plan, None), _Gather.apply(lse, plan, 2)
            else:
                o, lse = plan.gather(o), plan.gather(lse, dim=2)
        return (o, lse) if return_lse else o

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
        if backend == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendRefused(f"attnc.distributed: backend 'triton' on CPU tensors (q is on {q.device}) runs in "
                                 "Triton's interpreter: set TRITON_INTERPRET=1 before importing triton, or pass CUDA "
                                 "tensors, or use backend='numpy'")
        if plan.ranks > 1:
            plan.transport(q.device)  # refuses a group that cannot move this device's tensors

    def _blocks(self, cp: CPPlan, backend: str, device, dtype):
        if backend == "numpy":
            return _NumpyBlocks(self.attn, cp, device, dtype)
        if backend == "reference":
            return _ReferenceBlocks(cp, device)
        return _TritonBlocks(self.attn, cp, device, dtype)


class _Call:
    """One multi-rank call's settings, shared by its forward and its backward."""

    def __init__(self, cpar: ContextParallel, plan: ShardPlan, backend: str):
        self.cpar, self.plan, self.backend = cpar, plan, backend

    def _bhsd(self, t):
        return t.transpose(1, 2) if self.plan.seq_axis == 1 else t

    def forward(self, q, k, v):
        """(O in the spec's layout, q's dtype and device; LSE [B, H_q, tokens]) of this rank."""
        plan = self.plan
        blocks = self.cpar._blocks(plan.cp, self.backend, q.device, q.dtype)
        exchange = _Exchange(plan, k, v, plan.transport(q.device))
        try:
            o, lse = rank_attention(plan.cp, plan.rank, blocks, *(blocks.prepare(self._bhsd(t)) for t in (q, k, v)),
                                    lambda src: tuple(blocks.prepare(t) for t in exchange.fetch(src)))
        finally:
            exchange.finish()
        _check_rows(lse, plan)
        return self._bhsd(blocks.output(o)), lse.to(q.device)

    def backward(self, q, k, v, o, lse, do, dlse):
        """(dQ, dK, dV) of this rank's shards, in their layouts, dtypes and device.  The K/V messages
        are posted again (the forward keeps nothing but O and LSE); dK/dV of other ranks' tiles go
        back to their owners along the reversed messages, and theirs of ours are added here."""
        plan, cp = self.plan, self.plan.cp
        blocks = self.cpar._blocks(cp, self.backend, q.device, q.dtype)
        transport = plan.transport(q.device)
        exchange = _Exchange(plan, k, v, transport)
        prep = lambda t: None if t is None else blocks.prepare(self._bhsd(t) if t.dim() == 4 else t)  # noqa: E731
        if do is None:
            do = torch.zeros_like(o)
        try:
            dq, dk, dv, remote = rank_attention_backward(
                cp, plan.rank, blocks, *(prep(t) for t in (q, k, v, o, lse, do, dlse)),
                lambda src: tuple(blocks.prepare(t) for t in exchange.fetch(src)))
        finally:
            exchange.finish()
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
    if not bool(lse.isnan().any()):
        return
    b, h, i = (int(x[0]) for x in torch.nonzero(lse.isnan().cpu(), as_tuple=True))
    raise PlanError(numerics.nonfinite_message(b, h, int(plan.positions[i]), plan.cp.program.sink is not None))


# ---------------------------------------------------------------- one rank's blocks
class _NumpyBlocks:
    """Blocks on the numpy backend: CPU float32 containers, partial O unrounded, O rounded once to
    the call's dtype; the backward's blocks in float64 (the numpy backward module at the block's
    offsets), their shares accumulated in float32."""

    acc = torch.float32

    def __init__(self, attn: Attention, cp: CPPlan, device=None, dtype=None):
        self.cp = cp
        self.kernel = attn.kernel("numpy", cp.program)
        self.bshd = cp.program.cache.layout is ir.Layout.BSHD
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = _TORCH_DTYPES[cp.program.dtype] if dtype is None else dtype

    @staticmethod
    def prepare(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32)

    def _spec(self, t: torch.Tensor) -> np.ndarray:  # bhsd torch -> the kernel's layout, numpy
        a = t.numpy()
        return a.transpose(0, 2, 1, 3) if self.bshd else a

    def _bhsd(self, a: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        a = a.transpose(0, 2, 1, 3) if self.bshd else a
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    def forward(self, q, k, v, args):
        o, lse = self.kernel.block(*(self._spec(x) for x in (q, k, v)), args, self.cp.tensors)
        return self._bhsd(o), torch.from_numpy(np.asarray(lse, np.float32))

    def backward(self, q, k, v, o, lse, do, dlse, args):
        grads = self.kernel.block_backward(*(self._spec(x) for x in (q, k, v, o)), lse.numpy(), self._spec(do),
                                           None if dlse is None else dlse.numpy(), args, self.cp.tensors)
        return tuple(self._bhsd(g, self.acc) for g in grads)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(device=self.device, dtype=self.dtype)


class _ReferenceBlocks:
    """Blocks on the float64 oracle (dense per block), forward and backward: the check of the
    plan, the messages and the merges without float32 rounding in the way.  Float64 end to end:
    the score program too (the oracle's ``wide``, as the float64 single-process call computes
    it), so the backward's P matches the forward's LSE; O and LSE are float64."""

    acc = torch.float64

    def __init__(self, cp: CPPlan, device=None):
        self.cp = cp
        self.device = torch.device("cpu") if device is None else torch.device(device)

    @staticmethod
    def prepare(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float64)

    def _where(self, args) -> dict:
        return {"q_offset": args["q_offset"], "k_offset": args["k_offset"], "lengths": self.cp.lengths}

    def forward(self, q, k, v, args):
        o, lse = oracle.reference(self.cp.program, q.numpy(), k.numpy(), v.numpy(), self.cp.tensors, wide=True,
                                  sink=False, **self._where(args))  # a partial state: the merge adds the sink
        return torch.from_numpy(o), torch.from_numpy(lse)

    def backward(self, q, k, v, o, lse, do, dlse, args):
        dq, dk, dv, _ = oracle.reference_backward(self.cp.program, q.numpy(), k.numpy(), v.numpy(), do.numpy(),
                                                  self.cp.tensors, o=o.numpy(), lse=lse.numpy(),
                                                  dlse=None if dlse is None else dlse.numpy(), **self._where(args))
        return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in (dq, dk, dv))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(self.device)


class _TritonBlocks:
    """Blocks on the Triton backend (``Kernel.block`` / ``Kernel.block_backward``): containers in
    the storage dtype on the call's device, float32 partial O and LSE, float32 gradient shares;
    the spec's tensors (the whole call's) are uploaded once per call."""

    acc = torch.float32

    def __init__(self, attn: Attention, cp: CPPlan, device, dtype):
        self.cp = cp
        self.kernel = attn.kernel("triton", cp.program)
        self.device, self.dtype = torch.device(device), dtype
        from .backends.triton.decode import device_tensor
        self.tensors = {n: device_tensor(t, self.device) for n, t in cp.tensors.items()}

    def prepare(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if t.dim() == 3 else self.dtype  # LSE and dLSE stay float32
        return t.detach().to(device=self.device, dtype=dtype).contiguous()

    def forward(self, q, k, v, args):
        return self.kernel.block(q, k, v, args, self.tensors, self.cp.lengths)

    def backward(self, q, k, v, o, lse, do, dlse, args):
        return self.kernel.block_backward(q, k, v, o, lse, do, dlse, args, self.tensors, self.cp.lengths)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(device=self.device, dtype=self.dtype)


def merge_states(a: OutputState, b: OutputState) -> OutputState:
    """:func:`backends.numpy.state.merge_output_state` on torch tensors (many rows at once:
    ``valid``/``lse`` of any shape, ``o`` with one more axis of d): validity decides first, so a
    row invalid on one side takes the other side as it is, and only rows valid on both reach the
    exponentials, weighted exp(LSE_x - LSE).  A state's rows are valid where ``lse != -inf``: a
    NaN LSE (a visible NaN or +inf score) is valid and propagates to the merged row."""
    va, vb = a.valid, b.valid
    both = va & vb
    la, lb = a.lse, b.lse
    zero = la.new_zeros(())
    sa, sb = torch.where(both, la, zero), torch.where(both, lb, zero)  # finite stand-ins off the merged rows
    p = torch.maximum(sa, sb)
    lse = p + torch.log(torch.exp(sa - p) + torch.exp(sb - p))
    o = torch.exp(sa - lse)[..., None] * a.o + torch.exp(sb - lse)[..., None] * b.o
    lse = torch.where(both, lse, torch.where(va, la, lb))
    o = torch.where(both[..., None], o, torch.where(va[..., None], a.o, b.o))
    return OutputState(va | vb, lse, o)


def _partial(lse: torch.Tensor, o: torch.Tensor, dtype) -> OutputState:
    lse = lse.to(dtype)
    return OutputState(lse != -torch.inf, lse, o.to(dtype))


def _segment_rows(cp: CPPlan, rank: int) -> list[tuple[int, int]]:
    """Where each of rank's segments lies in its shard: (first row, end row)."""
    rows, at = [], 0
    for a, b in cp.segments(rank):
        rows.append((at, at + cp.tile_tokens(a, b)))
        at += cp.tile_tokens(a, b)
    return rows


def _schedule(cp: CPPlan, rank: int):
    """(owner, [(first tile, end tile, start in the owner's K/V as this rank holds it)]) of every
    owner rank computes against: its own K/V first (starts in its shard), then each owner's in
    the order of their distance (starts in the message: the runs concatenated in tile order)."""
    runs = cp.runs(rank)
    for src in sorted({r for r, _, _ in runs}, key=lambda s: (s - rank) % cp.ranks):
        mine = [(a, b) for r, a, b in runs if r == src]
        if src == rank:
            starts = [cp.shard_offset(rank, a) for a, _ in mine]
        else:
            starts = np.concatenate([[0], np.cumsum([cp.tile_tokens(a, b) for a, b in mine])[:-1]]).tolist()
        yield src, [(a, b, int(s)) for (a, b), s in zip(mine, starts)]


def rank_attention(cp: CPPlan, rank: int, blocks, q, k, v, fetch):
    """Rank ``rank``'s rows of (O, LSE), bhsd torch tensors in the blocks' containers (O unrounded:
    ``blocks.output`` rounds it): ``q``, ``k``, ``v`` its shard (``blocks.prepare``d),
    ``fetch(src)`` the K and V of the runs ``src`` sends it (concatenated in tile order, bhsd,
    prepared; it waits for them), ``blocks.forward(q, k, v, args)`` one block's partial (O, LSE).
    Own K/V first, then each owner's, nearest first; each query segment's partial states merge
    as they come (:func:`merge_states`)."""
    segments, rows = cp.segments(rank), _segment_rows(cp, rank)
    batch, heads, dtype = q.shape[0], q.shape[1], blocks.acc  # (merged in the blocks' accumulation dtype)
    dev = q.device
    states = [OutputState(torch.zeros((batch, heads, r1 - r0), dtype=torch.bool, device=dev),
                          torch.full((batch, heads, r1 - r0), -torch.inf, dtype=dtype, device=dev),
                          torch.zeros((batch, heads, r1 - r0, v.shape[3]), dtype=dtype, device=dev))
              for r0, r1 in rows]
    for src, runs in _schedule(cp, rank):
        kb, vb = (k, v) if src == rank else fetch(src)
        for j0, j1, start in runs:
            n = cp.tile_tokens(j0, j1)
            k_run, v_run = kb[:, :, start:start + n], vb[:, :, start:start + n]
            for i, (i0, i1) in enumerate(segments):
                args = cp.block_args((i0, i1), (j0, j1))
                if args is None:
                    continue
                r0, r1 = rows[i]
                o_p, lse_p = blocks.forward(q[:, :, r0:r1], k_run, v_run, args)
                states[i] = merge_states(states[i], _partial(lse_p, o_p, dtype))
    if not states:
        return (q.new_zeros((batch, heads, 0, v.shape[3]), dtype=dtype), q.new_zeros((batch, heads, 0), dtype=dtype))
    if cp.program.sink is not None:  # once per row, after all its blocks: one more state, O = 0 and LSE = sink
        sink = torch.as_tensor(sinks.values(cp.program, batch, cp.tensors), dtype=dtype, device=dev)[..., None]
        states = [merge_states(s, _partial(sink.expand_as(s.lse), torch.zeros_like(s.o), dtype)) for s in states]
    o = torch.cat([torch.where(s.valid[..., None], s.o, 0) for s in states], dim=2)
    lse = torch.cat([torch.where(s.valid, s.lse, -torch.inf) for s in states], dim=2)
    return o, lse


def rank_attention_backward(cp: CPPlan, rank: int, blocks, q, k, v, o, lse, do, dlse, fetch):
    """Rank ``rank``'s share of the gradients, from its shard (``q``, ``k``, ``v``, bhsd, prepared
    as for :func:`rank_attention`), its rows' final O and LSE (the merged forward's), the incoming
    dO and dLSE (or None) of those rows, and ``fetch`` as in :func:`rank_attention`.  Every block
    the forward computed runs ``blocks.backward`` with the rows' final O and LSE (the exact
    blockwise backward: P = exp(S - LSE), D = rowsum(dO * O) - dLSE).  Returns ``(dq, dk, dv,
    remote)`` in ``blocks.acc``: dQ of its rows (summed over its blocks), dK/dV of its own keys
    from its own rows, and ``remote[src] = (dk, dv)``, the shares of ``src``'s keys as
    ``fetch(src)`` gave them (its runs concatenated), which go back to ``src``."""
    segments, rows = cp.segments(rank), _segment_rows(cp, rank)
    acc = blocks.acc
    zeros = lambda x: torch.zeros(x.shape, dtype=acc, device=x.device)  # noqa: E731
    dq, dk, dv = zeros(q), zeros(k), zeros(v)
    remote = {}
    for src, runs in _schedule(cp, rank):
        if src == rank:
            kb, vb, dkb, dvb = k, v, dk, dv
        else:
            kb, vb = fetch(src)
            dkb, dvb = zeros(kb), zeros(vb)
            remote[src] = (dkb, dvb)
        for j0, j1, start in runs:
            n = cp.tile_tokens(j0, j1)
            keys = slice(start, start + n)
            for i, (i0, i1) in enumerate(segments):
                args = cp.block_args((i0, i1), (j0, j1))
                if args is None:
                    continue
                r = slice(*rows[i])
                gq, gk, gv = blocks.backward(q[:, :, r], kb[:, :, keys], vb[:, :, keys], o[:, :, r], lse[:, :, r],
                                             do[:, :, r], None if dlse is None else dlse[:, :, r], args)
                dq[:, :, r] += gq.to(acc)
                dkb[:, :, keys] += gk.to(acc)
                dvb[:, :, keys] += gv.to(acc)
    return dq, dk, dv, remote


# ---------------------------------------------------------------- the messages
@dataclass
class _Message:
    runs: list  # (first tile, end tile) in tile order
    tokens: int
    buffer: torch.Tensor
    work: object = None


def _peer(plan: ShardPlan):
    return (lambda r: r) if plan.group is None else (lambda r: dist.get_global_rank(plan.group, r))


class _Exchange:
    """One call's K/V messages: every send and receive posted at once (batch_isend_irecv), each
    receive waited for when its blocks are next.  ``transport`` "device": the buffers live on the
    tensors' device (NCCL, or CPU tensors over gloo); "host": CUDA tensors over gloo, staged in
    host memory (sent from a CPU copy, received into a CPU buffer; ``fetch`` moves them back)."""

    def __init__(self, plan: ShardPlan, k: torch.Tensor, v: torch.Tensor, transport: str):
        cp, rank, self.axis = plan.cp, plan.rank, plan.seq_axis
        self.device = k.device
        where = torch.device("cpu") if transport == "host" else k.device
        self.k_shape, self.v_shape = list(k.shape), list(v.shape)
        self.dtype = k.dtype
        peer = _peer(plan)
        ops = []
        self.sends: list[_Message] = []
        for dst, runs in cp.sends(rank).items():
            index = _token_index(cp, rank, runs, k.device)
            buf = torch.cat([k.detach().index_select(self.axis, index).reshape(-1),
                             v.detach().index_select(self.axis, index).reshape(-1)]).to(where)
            self.sends.append(_Message(runs, int(index.numel()), buf))
            ops.append(dist.P2POp(dist.isend, buf, peer(dst), group=plan.group))
        self.recvs: dict[int, _Message] = {}
        sources: dict[int, list] = {}
        for src, a, b in cp.runs(rank):
            if src != rank:
                sources.setdefault(src, []).append((a, b))
        for src, runs in sources.items():
            n = sum(cp.tile_tokens(a, b) for a, b in runs)
            buf = torch.empty(self._numel(self.k_shape, n) + self._numel(self.v_shape, n), dtype=self.dtype,
                              device=where)
            self.recvs[src] = _Message(runs, n, buf)
            ops.append(dist.P2POp(dist.irecv, buf, peer(src), group=plan.group))
        works = dist.batch_isend_irecv(ops) if ops else []
        for msg, work in zip([*self.sends, *self.recvs.values()], _per_op(works, len(ops))):
            msg.work = work

    def _numel(self, shape: list, n: int) -> int:
        s = list(shape)
        s[self.axis] = n
        return int(np.prod(s))

    def _shaped(self, flat: torch.Tensor, shape: list, n: int) -> torch.Tensor:
        s = list(shape)
        s[self.axis] = n
        return flat.reshape(s)

    def fetch(self, src: int):
        """K and V from ``src`` as bhsd torch tensors (on the tensors' device), waiting for them."""
        msg = self.recvs[src]
        msg.work.wait()
        nk = self._numel(self.k_shape, msg.tokens)
        k = self._shaped(msg.buffer[:nk], self.k_shape, msg.tokens)
        v = self._shaped(msg.buffer[nk:], self.v_shape, msg.tokens)
        if self.axis == 1:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k.to(self.device), v.to(self.device)

    def finish(self) -> None:
        """Wait for the sends, then let go of every message's work handle (a handle kept alive
        until the interpreter's exit can outlive its process group there)."""
        for msg in self.sends:
            msg.work.wait()
        for msg in (*self.sends, *self.recvs.values()):
            msg.work = None


class _Works:
    """Waits for every work of a batch (NCCL coalesces a batch into fewer works than ops)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def _per_op(works: list, ops: int) -> list:
    """One waitable per op: the works themselves, or (coalesced) the whole batch for each."""
    return list(works) if len(works) == ops else [_Works(works)] * ops


def _token_index(cp: CPPlan, rank: int, runs: list, device) -> torch.Tensor:
    """Where runs of rank's tiles lie in its shard, concatenated in order."""
    return torch.cat([torch.arange(cp.shard_offset(rank, a), cp.shard_offset(rank, a) + cp.tile_tokens(a, b))
                      for a, b in runs]).to(device)


def _return_gradients(plan: ShardPlan, transport: str, dk, dv, remote: dict) -> None:
    """The reversed messages, one batch: each owner gets the dK/dV shares of its runs this rank
    computed (``remote``: bhsd, in the order of the runs it sent), and this rank adds the shares
    every receiver of its K/V sends back into ``dk``/``dv`` (bhsd, in place).  The messages carry
    the accumulation dtype (float32; float64 on the reference path)."""
    cp, rank = plan.cp, plan.rank
    where = torch.device("cpu") if transport == "host" else dk.device
    peer = _peer(plan)
    ops, incoming = [], []
    for src, (gk, gv) in remote.items():
        buf = torch.cat([gk.reshape(-1), gv.reshape(-1)]).to(where)
        ops.append(dist.P2POp(dist.isend, buf, peer(src), group=plan.group))
    for dst, runs in cp.sends(rank).items():
        index = _token_index(cp, rank, runs, dk.device)
        n = int(index.numel())
        shape_k, shape_v = (*dk.shape[:2], n, dk.shape[3]), (*dv.shape[:2], n, dv.shape[3])
        buf = torch.empty(int(np.prod(shape_k)) + int(np.prod(shape_v)), dtype=dk.dtype, device=where)
        incoming.append((index, shape_k, shape_v, buf))
        ops.append(dist.P2POp(dist.irecv, buf, peer(dst), group=plan.group))
    works = dist.batch_isend_irecv(ops) if ops else []
    for work in works:
        work.wait()
    for index, shape_k, shape_v, buf in incoming:
        buf = buf.to(dk.device)
        nk = int(np.prod(shape_k))
        dk.index_add_(2, index, buf[:nk].reshape(shape_k))
        dv.index_add_(2, index, buf[nk:].reshape(shape_v))
