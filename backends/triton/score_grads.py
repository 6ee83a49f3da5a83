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

import triton
import triton.language as tl

from attnc.compiler import ir
from .backward import _probs

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


@triton.jit
def _bwd_tensor_cells(Q, K, V, DO, LSE, DELTA, W, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                      s_vb, s_vh, s_vn, s_vd, s_db, s_dh, s_dm, s_dd, R_PTR, R_IDX, TS, S_Q, S_K, Q_OFF, K_OFF,
                      PLAN_B, PLAN_H, Q_TILES, BH, N_LOADS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, VISIBLE: tl.constexpr, SCORE_GRAD: tl.constexpr,
                      TENSOR_GRAD: tl.constexpr, HAS_SCORE: tl.constexpr, SCALE: tl.constexpr, H_Q: tl.constexpr,
                      GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, D_QK_PAD: tl.constexpr,
                      D_V_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dS times each load's derivative on every computed cell of one query tile of one (request,
    query head), written to its cell of W [N_LOADS, B * H_Q, S_Q, S_K]."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_Q
    h = bh % H_Q
    kv_h = h // GROUP
    plane = tl.where(PLAN_B > 1, b, 0) * PLAN_H + tl.where(PLAN_H > 1, h, 0)
    row = plane * Q_TILES + pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = (Q_OFF + offs_m)[:, None]
    offs_dk = tl.arange(0, D_QK_PAD)
    offs_dv = tl.arange(0, D_V_PAD)
    row_in = offs_m < S_Q
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_dk[None, :] * s_qd,
                mask=row_in[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_dv[None, :] * s_dd,
                 mask=row_in[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    lse = tl.load(LSE + bh * S_Q + offs_m, mask=row_in, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)[:, None]
    delta = tl.load(DELTA + bh * S_Q + offs_m, mask=row_in, other=0.0)
    K += b * s_kb + kv_h * s_kh
    V += b * s_vb + kv_h * s_vh
    for i in tl.range(tl.load(R_PTR + 2 * row), tl.load(R_PTR + 2 * row + 2)):  # FULL and PARTIAL blocks
        offs_n = tl.load(R_IDX + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_pos = (K_OFF + offs_n)[None, :]
        kt = tl.load(K + offs_n[None, :] * s_kn + offs_dk[:, None] * s_kd,
                     mask=(offs_n[None, :] < S_K) & (offs_dk[:, None] < D_QK), other=0.0)
        vt = tl.load(V + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd,
                     mask=(offs_n[None, :] < S_K) & (offs_dv[:, None] < D_V), other=0.0)
        s_raw = tl.dot(q, kt, input_precision=DOT_PRECISION)
        # (every block takes the predicate: a FULL block's is true on every cell)
        p, g = _probs(s_raw, b, h, q_pos, k_pos, lse2, TS, K_OFF + S_K, Q_OFF + S_Q, True, False, VISIBLE,
                      SCORE_GRAD, HAS_SCORE, SCALE)
        ds = p * (tl.dot(do, vt, input_precision=DOT_PRECISION) - delta[:, None])
        inside = row_in[:, None] & (offs_n[None, :] < S_K)
        for n in tl.static_range(N_LOADS):
            cell = tl.where(p > 0.0, ds * TENSOR_GRAD(s_raw * SCALE, b, h, q_pos, k_pos, TS, n), 0.0)
            tl.store(W + ((n * BH + bh) * S_Q + offs_m[:, None]).to(tl.int64) * S_K + offs_n[None, :], cell,
                     mask=inside)


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
