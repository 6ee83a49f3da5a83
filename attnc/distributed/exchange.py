"""The K/V messages of a call (one ``batch_isend_irecv`` of every send and receive) and the
reversed messages of its backward (the dK/dV shares back to their owners)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..compiler.cp import CPPlan
from .shards import ShardPlan


@dataclass
class _Message:
    runs: list  # (first tile, end tile) in tile order
    tokens: int
    buffer: torch.Tensor
    work: object = None
    done: bool = False  # waited for


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
        msg.done = True
        nk = self._numel(self.k_shape, msg.tokens)
        k = self._shaped(msg.buffer[:nk], self.k_shape, msg.tokens)
        v = self._shaped(msg.buffer[nk:], self.v_shape, msg.tokens)
        if self.axis == 1:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k.to(self.device), v.to(self.device)

    def finish(self) -> None:
        """Wait for the sends and for any receive not fetched (a rank whose blocks failed: a
        receive let go of unwaited leaves its sender blocked), then let go of every message's work
        handle (a handle kept alive until the interpreter's exit can outlive its process group)."""
        for msg in (*self.sends, *self.recvs.values()):
            if not msg.done:
                msg.work.wait()
                msg.done = True
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
