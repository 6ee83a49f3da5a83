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
3. merges the blocks' partial (O, LSE) states with the split-state algebra
   (``backends.numpy.state.merge_output_state``, M4.5 §0x02F) and rounds O once.

Multi-rank runs take CPU tensors (the numpy backend; ``backend="reference"`` runs the float64
oracle per block, a check) over a gloo group.  The Triton kernels have no position offsets yet,
so a multi-rank call on CUDA tensors is refused; a one-rank plan runs the plain call
(``attn(q, k, v, **tensors)``) whatever the device.

Forward only.  A backward pass would be an ``autograd.Function`` around :meth:`ContextParallel.
__call__` that keeps the received K/V (or fetches it again by the same messages), runs each block's
backward with the merged LSE, and sends each owner the dK/dV of its tiles back along the reversed
messages, where the owner sums them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .api import Attention, BackendRefused, compile as compile_spec
from .backends.numpy.state import OutputState, merge_output_state
from .compiler import inputs, ir, oracle
from .compiler.cp import DEFAULT_BLOCK, CPPlan, plan_cp
from .compiler.errors import InputError, PlanError

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
BACKENDS = ("numpy", "reference")  # what a multi-rank call runs its blocks with


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
        parts = [torch.empty_like(padded) for _ in range(self.ranks)]
        dist.all_gather(parts, padded, group=self.group)
        shape = list(x.shape)
        shape[d] = self.cp.seq_len
        out = x.new_empty(shape)
        for r, part in enumerate(parts):
            n = int(self.cp.tokens[r])
            if n:
                out.index_copy_(d, torch.from_numpy(self.cp.positions(r)).to(x.device), part.narrow(d, 0, n))
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
        "triton" (one rank only) or "reference" (the float64 oracle per block: a check)."""
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
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            raise InputError("inputs: q, k or v requires grad, and attnc.distributed has no backward pass yet: "
                             "call it under torch.no_grad() or on detached tensors")
        if backend not in (None, "numpy", "triton", "reference"):
            raise InputError(f"unknown backend {backend!r}; expected numpy, triton or reference")
        if plan.ranks == 1 and backend != "reference":
            o, lse = self.attn.forward(q, k, v, plan.tensors, backend)
        else:
            o, lse = self._run(q, k, v, plan, backend or "numpy")
        if gather:
            o, lse = plan.gather(o), plan.gather(lse, dim=2)
        return (o, lse) if return_lse else o

    def _check_call(self, q, k, v, plan: ShardPlan, backend: str) -> None:
        cp = plan.cp
        if plan.ranks > 1 and (backend == "triton" or q.is_cuda):
            raise BackendRefused(
                "attnc.distributed: a multi-rank call on CUDA tensors needs query/key position offsets in the "
                "Triton kernels, which they do not have yet; run the ranks on CPU tensors (numpy backend over "
                "a gloo group) or plan with one rank")
        if plan.ranks > 1 and "gloo" not in str(dist.get_backend(plan.group)):
            raise BackendRefused(f"attnc.distributed: a multi-rank call moves CPU tensors; the process group's "
                                 f"backend is {dist.get_backend(plan.group)!r} (create it with 'gloo')")
        h = 2 if plan.seq_axis == 1 else 1
        shape = (q.shape[h], k.shape[h], q.shape[3], v.shape[3], _DTYPES.get(q.dtype))
        p = cp.program
        if shape != (p.heads_q, p.heads_kv, p.d_qk, p.d_v, p.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise InputError(f"inputs: q/k/v have heads {shape[0]}/{shape[1]}, head_dim {shape[2]}/{shape[3]}, "
                             f"dtype {q.dtype}/{k.dtype}/{v.dtype}; the plan is for heads {p.heads_q}/{p.heads_kv}, "
                             f"head_dim {p.d_qk}/{p.d_v}, {p.dtype}")

    def _run(self, q, k, v, plan: ShardPlan, backend: str):
        self._check_call(q, k, v, plan, backend)
        cp, axis = plan.cp, plan.seq_axis
        blocks = _NumpyBlocks(self.attn, cp) if backend == "numpy" else _ReferenceBlocks(cp)
        exchange = _Exchange(plan, k, v, blocks.host)
        as_bhsd = (lambda t: t.transpose(1, 2)) if axis == 1 else (lambda t: t)
        o, lse = rank_attention(cp, plan.rank, blocks, *(blocks.host(as_bhsd(t)) for t in (q, k, v)),
                                exchange.fetch)
        exchange.finish()
        o = torch.from_numpy(blocks.output(o))
        o = o.to(q.dtype) if backend == "numpy" else o
        return (o.transpose(1, 2) if axis == 1 else o), torch.from_numpy(lse)


# ---------------------------------------------------------------- one rank's blocks
class _NumpyBlocks:
    """Blocks on the numpy backend: float32 containers, partial O unrounded, O rounded once."""

    def __init__(self, attn: Attention, cp: CPPlan):
        self.cp = cp
        self.kernel = attn.kernel("numpy", cp.program)
        self.bshd = cp.program.cache.layout is ir.Layout.BSHD

    @staticmethod
    def host(t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).numpy()

    def __call__(self, q, k, v, args):
        if self.bshd:  # the kernel takes the spec's layout
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        o, lse = self.kernel.block(q, k, v, args, self.cp.tensors)
        return (o.transpose(0, 2, 1, 3) if self.bshd else o), lse

    def output(self, o: np.ndarray) -> np.ndarray:
        return np.asarray(inputs.to_storage(o, self.cp.program.dtype), np.float32)


class _ReferenceBlocks:
    """Blocks on the float64 oracle (dense per block): the check of the plan, the messages and
    the merges without float32 rounding in the way."""

    def __init__(self, cp: CPPlan):
        self.cp = cp

    @staticmethod
    def host(t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float64).numpy()

    def __call__(self, q, k, v, args):
        return oracle.reference(self.cp.program, q, k, v, self.cp.tensors, q_offset=args["q_offset"],
                                k_offset=args["k_offset"])

    @staticmethod
    def output(o: np.ndarray) -> np.ndarray:
        return o


def rank_attention(cp: CPPlan, rank: int, blocks, q, k, v, fetch):
    """Rank ``rank``'s rows of (O, LSE), bhsd numpy: ``q``, ``k``, ``v`` its shard, ``fetch(src)``
    the K and V of the runs ``src`` sends it (concatenated in tile order, bhsd; it waits for
    them), ``blocks(q, k, v, args)`` one block's partial (O, LSE).  Own K/V first, then each
    owner's, nearest first; each query segment's partial states merge as they come."""
    segments = cp.segments(rank)
    rows, at = [], 0
    for a, b in segments:
        rows.append((at, at + cp.tile_tokens(a, b)))
        at += cp.tile_tokens(a, b)
    batch, heads = q.shape[0], q.shape[1]
    states = [OutputState(np.zeros((batch, heads, r1 - r0), bool), np.full((batch, heads, r1 - r0), -np.inf, q.dtype),
                          np.zeros((batch, heads, r1 - r0, v.shape[3]), q.dtype)) for r0, r1 in rows]
    runs = cp.runs(rank)
    for src in sorted({r for r, _, _ in runs}, key=lambda s: (s - rank) % cp.ranks):
        mine = [(a, b) for r, a, b in runs if r == src]
        if src == rank:
            kb, vb, starts = k, v, [cp.shard_offset(rank, a) for a, _ in mine]
        else:
            kb, vb = fetch(src)
            starts = np.concatenate([[0], np.cumsum([cp.tile_tokens(a, b) for a, b in mine])[:-1]]).tolist()
        for (j0, j1), start in zip(mine, starts):
            n = cp.tile_tokens(j0, j1)
            k_run, v_run = kb[:, :, start:start + n], vb[:, :, start:start + n]
            for i, (i0, i1) in enumerate(segments):
                args = cp.block_args((i0, i1), (j0, j1))
                if args is None:
                    continue
                r0, r1 = rows[i]
                o_p, lse_p = blocks(q[:, :, r0:r1], k_run, v_run, args)
                states[i] = merge_output_state(states[i], OutputState(np.isfinite(lse_p), lse_p.astype(q.dtype),
                                                                      o_p.astype(q.dtype)))
    if not states:
        return (np.zeros((batch, heads, 0, v.shape[3]), q.dtype), np.zeros((batch, heads, 0), q.dtype))
    o = np.concatenate([np.where(s.valid[..., None], s.o, 0) for s in states], axis=2)
    lse = np.concatenate([np.where(s.valid, s.lse, -np.inf) for s in states], axis=2)
    return o, lse


# ---------------------------------------------------------------- the messages
@dataclass
class _Message:
    runs: list  # (first tile, end tile) in tile order
    tokens: int
    buffer: torch.Tensor
    work: object = None


class _Exchange:
    """One call's K/V messages: every send and receive posted at once (batch_isend_irecv), each
    receive waited for when its blocks are next."""

    def __init__(self, plan: ShardPlan, k: torch.Tensor, v: torch.Tensor, host):
        cp, rank, self.axis = plan.cp, plan.rank, plan.seq_axis
        self.host = host  # torch -> the blocks' numpy containers
        self.k_shape, self.v_shape = list(k.shape), list(v.shape)
        self.dtype = k.dtype
        peer = (lambda r: r) if plan.group is None else (lambda r: dist.get_global_rank(plan.group, r))
        ops = []
        self.sends: list[_Message] = []
        for dst, runs in cp.sends(rank).items():
            index = torch.cat([torch.arange(cp.shard_offset(rank, a), cp.shard_offset(rank, a) + cp.tile_tokens(a, b))
                               for a, b in runs])
            buf = torch.cat([k.index_select(self.axis, index).reshape(-1),
                             v.index_select(self.axis, index).reshape(-1)])
            self.sends.append(_Message(runs, int(index.numel()), buf))
            ops.append(dist.P2POp(dist.isend, buf, peer(dst), group=plan.group))
        self.recvs: dict[int, _Message] = {}
        sources: dict[int, list] = {}
        for src, a, b in cp.runs(rank):
            if src != rank:
                sources.setdefault(src, []).append((a, b))
        for src, runs in sources.items():
            n = sum(cp.tile_tokens(a, b) for a, b in runs)
            buf = torch.empty(self._numel(self.k_shape, n) + self._numel(self.v_shape, n), dtype=self.dtype)
            self.recvs[src] = _Message(runs, n, buf)
            ops.append(dist.P2POp(dist.irecv, buf, peer(src), group=plan.group))
        works = dist.batch_isend_irecv(ops) if ops else []
        for msg, work in zip([*self.sends, *self.recvs.values()], works):
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
        """K and V from ``src`` as bhsd numpy arrays (the blocks' containers), waiting for them."""
        msg = self.recvs[src]
        msg.work.wait()
        nk = self._numel(self.k_shape, msg.tokens)
        k = self._shaped(msg.buffer[:nk], self.k_shape, msg.tokens)
        v = self._shaped(msg.buffer[nk:], self.v_shape, msg.tokens)
        if self.axis == 1:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return self.host(k), self.host(v)

    def finish(self) -> None:
        for msg in self.sends:
            msg.work.wait()
