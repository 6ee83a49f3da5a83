"""One rank's blocks (the block backends) and how a rank's rows come together from them: the
partial (O, LSE) states merged with the split-state algebra, forward and backward."""
from __future__ import annotations

import numpy as np
import torch

from ..backends.numpy.state import OutputState
from ..compiler import oracle, sinks
from ..compiler.cp import CPPlan

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


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
                                  sink=False,  # a partial state: the merge adds the sink
                                  **self._where(args))
        return torch.from_numpy(o), torch.from_numpy(lse)

    def backward(self, q, k, v, o, lse, do, dlse, args):
        dq, dk, dv, _ = oracle.reference_backward(self.cp.program, q.numpy(), k.numpy(), v.numpy(), do.numpy(),
                                                  self.cp.tensors, o=o.numpy(), lse=lse.numpy(),
                                                  dlse=None if dlse is None else dlse.numpy(), **self._where(args))
        return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in (dq, dk, dv))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(self.device)


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
