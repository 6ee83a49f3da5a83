"""Gradients of the float tensors a score program reads, on the Triton backend (a learned bias
``bias[h, q, k]``, per-head slopes ``slope[h]``, per-key biases ``kb[b, k]``).

After the backward's dQ/dK/dV, one launch per f32 load of a wanted tensor
(``kernels/tensor_grads.py``): its programs recompute P and dS = P (dP - D) (D = rowsum(dO * O)
- dLSE) on the plan's computed tiles (SKIP tiles never loaded, FULL ones without the predicate)
and reduce dS times d (final score) / d (load) (the spec's generated ``tensor_grad``) inside the
kernel over the axes the load's index does not name, in a fixed order: every element of what a
launch writes is written once, by one program (no atomics: the same bits run to run).  A launch
writes (``launch_axes``, ``work_shape``) the load's gradient over the call's positions --
[H, S_q, S_k] for ``bias[h, q, k]``, whatever the batch -- except that a load that does not
name both q and k keeps the head axis apart (one program per head: parallel work where the
output is small) and, naming neither, writes one partial sum per query tile ([H, query tiles]
for ``slope[h]``); the host sums those axes (torch's reductions over a fixed axis: the same
bits run to run) and adds the result into the tensor's gradient at the load's positions
(``_add_clamped``).  No buffer is larger than the load's gradient over the call times the heads.

A tensor gets a gradient here when every f32 load of it indexes with distinct plain positions
among b, h, q, k (``refusal``); others (an index computed from positions, such as ``t[q - k]``)
are refused with the reason (the numpy backend gives them on the CPU).
"""
from __future__ import annotations

from attnc.compiler import ir
from .launch import Launcher
from .kernels.tensor_grads import _bwd_tensor_grad

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


def launch_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes, in AXES order, a load's launch keeps apart: the load's own, and h unless it names
    both q and k (its programs then own the whole tile and loop over the batch)."""
    keep = set(axes) if {"q", "k"} <= set(axes) else set(axes) | {"h"}
    return tuple(a_ for a_ in AXES if a_ in keep)


def work_shape(kept: tuple[str, ...], batch: int, h_q: int, s_q: int, s_k: int, q_tiles: int) -> tuple:
    """What a launch keeping the axes ``kept`` (``launch_axes``) writes: the gradient over the call's
    kept b, h, q and k, in AXES order; one partial sum per query tile when it keeps neither q nor k
    (the last axis)."""
    shape = tuple(n for a_, n in zip(AXES, (batch, h_q, s_q, s_k)) if a_ in kept)
    return shape if "q" in kept or "k" in kept else (*shape, q_tiles)


def _workspace(shape: tuple, device):
    """The float32 buffer a launch writes (every element, once)."""
    import torch
    return torch.empty(shape, device=device, dtype=torch.float32)


def tensor_gradients(kernel, launch, qb, kb, vb, lse, delta, dob, ts, tensors: dict, names, key=None) -> dict:
    """{name: gradient} of the named score tensors (module docstring); bhsd views of the call's
    q, k, v and dO, ``launch`` the call's ``grad.BackwardLaunch`` (its plan's tile classes) and
    ``delta`` what it returned (D - dLSE); ``key`` the call's binding key (None: the JIT), which
    with the load fixes the launch's specialization."""
    import torch
    program, module = kernel.program, kernel.module
    spec = module.SPEC
    batch, s_q, s_k = launch.batch, launch.s_q, launch.s_k
    h_q = spec["H_Q"]
    launchers = launch.tensor_grad_launchers
    bm, bn = launch.config.block_m2, launch.config.block_n2
    _, _, q_off, k_off, plan_b, plan_h, _, q_tiles = launch.ints[:8]
    k_tiles = -(-s_k // bn)
    out = {}
    for n, load in enumerate(loads(program)):
        if load.tensor not in names:
            continue
        axes = _axes(load)
        kept = launch_axes(axes)
        keep = {a_: a_ in kept for a_ in AXES}
        work = _workspace(work_shape(kept, batch, h_q, s_q, s_k, q_tiles), qb.device)
        tiles = (q_tiles * k_tiles if keep["q"] and keep["k"] else k_tiles if keep["k"] else q_tiles)
        grid = (tiles, (batch if keep["b"] else 1) * (h_q if keep["h"] else 1))
        which = (n, *keep.values())
        launcher = launchers.get(which)
        if launcher is None:  # (one per load and kept axes: the launch's shape fixes the rest)
            launcher = launchers[which] = Launcher(
                _bwd_tensor_grad, dict(
                    N=n, KEEP_B=keep["b"], KEEP_H=keep["h"], KEEP_Q=keep["q"], KEEP_K=keep["k"],
                    EVEN=s_q % bm == 0 and s_k % bn == 0, BLOCK_M=bm, BLOCK_N=bn, VISIBLE=module.visible,
                    SCORE_GRAD=launch.score_grad, TENSOR_GRAD=module.tensor_grad, HAS_SCORE=spec["HAS_SCORE"],
                    SCALE=spec["SCALE"], H_Q=h_q, GROUP=spec["GROUP"], D_QK=spec["D_QK"], D_V=spec["D_V"],
                    D_QK_PAD=spec["D_QK_PAD"], D_V_PAD=spec["D_V_PAD"], DOT_PRECISION=spec["DOT_PRECISION"]),
                num_warps=8 if bm * bn >= 128 * 64 else 4)
        launcher.launch(grid, (qb, kb, vb, dob, lse, delta, launch.arrays["r_cls"], work, *qb.stride(), *kb.stride(),
                               *vb.stride(), *dob.stride(), ts, batch, s_q, s_k, q_off, k_off, plan_b, plan_h,
                               q_tiles, k_tiles), None if key is None else (key, which))
        summed = work if keep["q"] or keep["k"] else work.sum(-1)  # the query tiles' partial sums
        if "h" not in axes and keep["h"]:
            summed = summed.sum(kept.index("h"))
        left = [a_ for a_ in kept if a_ in axes]
        summed = summed.permute(*[left.index(a_) for a_ in axes])
        t = tensors[load.tensor]
        # positions: q = q_off + row, k = k_off + key; an index past the tensor's extent was clamped by the
        # forward's load (the generated code clamps every index), so it reads (and is credited to) the edge
        region = [({"q": q_off, "k": k_off}.get(a_, 0), extent) for a_, extent in zip(axes, summed.shape)]
        if (load.tensor not in out and tuple(summed.shape) == tuple(t.shape) and summed.is_contiguous()
                and all(start == 0 for start, _ in region)):
            out[load.tensor] = summed  # the gradient itself (bias[h, q, k] of a whole call: no second copy)
            continue
        grad = out.setdefault(load.tensor, torch.zeros(t.shape, device=t.device, dtype=torch.float32))
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
