"""Bound backward calls: the backward of an eager autograd call whose signature ran before (issue 33:
host time per call).

The backward an eager call's autograd formula runs (``attnc.api``'s ``_EagerAttention``) is the
kernel's validating backward (``backward_calls``): per call it makes its key again (the forward's
signature, O's, dO's and LSE's layouts, the choice's inputs), looks up the checks and the choice
made once per key, the plan, then allocates dQ, dK, dV and launches.  :class:`BoundBackward` is
the front door's bound backward, kept per (forward signature, O / dO / dLSE layouts): the key
came with the forward, so per call it does only what reads values -- the plan cache's entry for
the call (a mask tensor's identity and version; a plan the cache dropped) and the spec's tensor
arguments -- then the same allocations and the same launch as the validating path (the launch
object's ``__call__``: the same kernels on the same arguments, so the same bits).  It answers None
where the call must take the validating path (a plan not in the cache, ``gluon_backward.DEFAULT``
flipped: ``stale``, and the front door binds again once that path re-planned).

It holds no caller's tensor (the lengths of a spec that reads S_q or S_k are its own) and only a
weak reference to its launch: the plan cache owns plans and their device arrays.
"""
from __future__ import annotations

from . import gluon_backward as GB
from . import plans as P
from .bound import BoundCall


class BoundBackward(BoundCall):
    """A backward call of one key (``BackwardCalls._backward_key``), bound after it ran once without
    tensor gradients: ``__call__(q, k, v, o, lse, do, dlse, tensors)`` -> (dQ, dK, dV), or None
    where the call must take the validating path."""

    def __init__(self, kernel, hit: tuple, launch, do_copy: bool):
        bound, gluon, cfg, call_key, copies = hit
        super().__init__(kernel, bound, launch, call_key if isinstance(call_key, P.Key) else None)
        self.copies, self.do_copy = copies, do_copy
        self.call_key, self.part = call_key, gluon or cfg  # (the plan key's parts, ``_backward``'s)
        self.default = GB.DEFAULT
        torch = kernel._torch
        self.empty_like, self.contiguous = torch.empty_like, torch.contiguous_format

    def _tensor_plan_key(self, tensors: dict):
        return self.kernel._plan_key("backward", self.call_key, self.part, tensors=tensors)[1]

    def __call__(self, q, k, v, o, lse, do, dlse, tensors: dict):
        if GB.DEFAULT is not self.default:  # (the passes are chosen again: the validating path)
            self.stale = True
            return None
        launch = self._launch_of(tensors)
        if launch is None:
            return None
        if self.copies:  # (token-major views: the Gluon passes read contiguous copies, as on the validating path)
            q, k, v, o = (GB.tma_input(x) for x in (q, k, v, o))
        contiguous = self.contiguous
        if self.do_copy:  # (what ``gluon_backward.tma_input`` copies: the key fixes dO's layout and alignment)
            do = do.clone(memory_format=contiguous)
        ts = self._tensor_args(tensors, q.device)
        empty = self.empty_like
        dq = empty(q, memory_format=contiguous)
        dk = empty(k, memory_format=contiguous)
        dv = empty(v, memory_format=contiguous)
        lse = lse.contiguous()
        if dlse is not None:
            dlse = dlse.contiguous()
        if self.bound.bshd:
            launch(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2), lse,
                   do.transpose(1, 2), dlse, ts, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2),
                   self.call_key)
        else:
            launch(q, k, v, o, lse, do, dlse, ts, dq, dk, dv, self.call_key)
        return dq, dk, dv
