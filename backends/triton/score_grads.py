"""Gradients of the float tensors a score program reads, on the Triton backend (a learned bias
``bias[h, q, k]``, per-head slopes ``slope[h]``, per-key biases ``kb[b, k]``).

One launch after the backward's dQ/dK/dV: a program per (query tile, request * query head) walks
the forward plan's row of computed blocks (SKIP blocks never loaded), recomputes P and
dS = P (dP - D) (D = rowsum(dO * O) - dLSE), and writes, for each f32 load of the score program,
dS times d (final score) / d (load) (the spec's generated ``tensor_grad``) into its own cell of a
float32 workspace [loads, B, H_q, S_q, S_k] (cells of SKIP blocks stay 0).  The host then sums
each load's cells over the axes its index does not name and adds them into the tensor's
gradient: torch's reductions, in a fixed order, so the bits do not depend on scheduling (no
atomics: deterministic, run to run).  The workspace is one float32 per cell and load: this path
is for correctness at the sizes a learned bias has (a bias[h, q, k] is S_q * S_k per head
already), not the fast engine's.

A tensor gets a gradient here when every f32 load of it indexes with distinct plain positions
among b, h, q, k (``refusal``); others (an index computed from positions, such as ``t[q - k]``)
are refused with the reason (the numpy backend gives them on the CPU).
"""
from __future__ import annotations

from attnc.compiler import ir
from .kernels.tensor_grads import _bwd_tensor_cells

AXES = ("b", "h", "q", "k")


def loads(program: ir.Program) -> list:
    """The score program's f32 loads, in ``tensor_grad``'s order (autodiff's dloads)."""
    from attnc.compiler.autodiff import score_grad
    return [load for _, load, _ in score_grad(program).dloads] if program.score else []


def _axes(load) -> tuple[str, ...] | None:
    names = [x.name if isinstance(x, ir.Var) and x.name in AXES else None for x in load.index]
    return tuple(names) if None not in names and len(set(names)) == len(names) else None


def refusal(program: ir.Program, name: str) -> str | None:
    """Why the Triton backward gives no gradient of tensor ``name`` (None: it gives one)."""
    for load in loads(program):
        if load.tensor == name and _axes(load) is None:
            return (f"the Triton backward differentiates tensors indexed by distinct positions among b, h, q, k; "
                    f"'{ir.format_expr(load)}' is not (its gradient comes from the numpy backend, on the CPU)")
    return None


def tensor_gradients(kernel, launch, qb, kb, vb, ob, lse, dob, dlse, ts, tensors: dict, names) -> dict:
    """{name: gradient} of the named score tensors (module docstring); bhsd views of the call's
    q, k, v, O and dO, ``launch`` the call's ``grad.BackwardLaunch`` (its plan's rows)."""
    import torch
    program, module = kernel.program, kernel.module
    spec = module.SPEC
    found = loads(program)
    batch, s_q, s_k = launch.batch, launch.s_q, launch.s_k
    h_q = spec["H_Q"]
    delta = (ob.float() * dob.float()).sum(-1).contiguous()
    if dlse is not None:
        delta = delta - dlse.float()
    work = torch.zeros((len(found), batch * h_q, s_q, s_k), device=qb.device, dtype=torch.float32)
    a = launch.arrays
    bm, bn = launch.config.block_m2, launch.config.block_n2
    _, _, q_off, k_off, plan_b, plan_h, _, q_tiles = launch.ints[:8]
    grid = (q_tiles, batch * h_q)
    _bwd_tensor_cells[grid](
        qb, kb, vb, dob, lse, delta, work, *qb.stride(), *kb.stride(), *vb.stride(), *dob.stride(),
        a["r_ptr"], a["r_idx"], ts, s_q, s_k, q_off, k_off, plan_b, plan_h, q_tiles, batch * h_q,
        N_LOADS=len(found), BLOCK_M=bm, BLOCK_N=bn, VISIBLE=module.visible, SCORE_GRAD=launch.score_grad,
        TENSOR_GRAD=module.tensor_grad, HAS_SCORE=spec["HAS_SCORE"], SCALE=spec["SCALE"], H_Q=h_q,
        GROUP=spec["GROUP"], D_QK=spec["D_QK"], D_V=spec["D_V"], D_QK_PAD=spec["D_QK_PAD"],
        D_V_PAD=spec["D_V_PAD"], DOT_PRECISION=spec["DOT_PRECISION"], num_warps=4)
    out = {}
    cells = work.view(len(found), batch, h_q, s_q, s_k)
    for n, load in enumerate(found):
        if load.tensor not in names:
            continue
        axes = _axes(load)
        t = tensors[load.tensor]
        grad = out.setdefault(load.tensor, torch.zeros(t.shape, device=t.device, dtype=torch.float32))
        summed = cells[n].sum(dim=[i for i, a_ in enumerate(AXES) if a_ not in axes])
        kept = [a_ for a_ in AXES if a_ in axes]
        summed = summed.permute(*[kept.index(a_) for a_ in axes])
        # positions: q = q_off + row, k = k_off + key; an index past the tensor's extent was clamped by the
        # forward's load (the generated code clamps every index), so it reads (and is credited to) the edge
        region = []
        for a_, extent in zip(axes, summed.shape):
            start = {"q": q_off, "k": k_off}.get(a_, 0)
            region.append((start, extent))
        _add_clamped(grad, summed, region)
    return {n: g.to(tensors[n].dtype) for n, g in out.items()}


def _add_clamped(grad, values, region) -> None:
    """grad[clamp(start + i)] += values[i] along every axis (the forward's loads clamp their index
    to the tensor's extent: positions past an edge read, and are credited to, the edge), by
    slices and sums in a fixed order (no scatter: deterministic on every device)."""
    import torch
    for axis, (start, extent) in enumerate(region):
        size = grad.shape[axis]
        if start == 0 and extent == size:
            continue
        lo, hi = min(max(0, -start), extent), max(min(extent, size - start), 0)
        folded = torch.zeros((*values.shape[:axis], size, *values.shape[axis + 1:]), device=values.device,
                             dtype=values.dtype)
        if hi > lo:
            folded.narrow(axis, start + lo, hi - lo).copy_(values.narrow(axis, lo, hi - lo))
        if lo > 0:
            folded.narrow(axis, 0, 1).add_(values.narrow(axis, 0, lo).sum(axis, keepdim=True))
        if hi < extent:
            folded.narrow(axis, size - 1, 1).add_(values.narrow(axis, hi, extent - hi).sum(axis, keepdim=True))
        values = folded
    grad += values
