"""Study: a warp-specialized attention forward written in Gluon (Triton's explicit-layout
dialect) on the H200, against the generated Triton kernel and SDPA.

    python bench/exp_gluon_fa.py [--out FILE] [--rounds 5] [--masks full,causal]

Triton 3.6 has no warp specialization of its own that helps on Hopper (r11), and the studies
r12-r28 leave the generated kernel 10-12% behind cuDNN on full attention.  FlashAttention-3's
answer is producer/consumer warps: one warp issues the TMA loads of K and V into a ring of
shared-memory stages guarded by mbarriers, and two consumer warpgroups, each with 64 query rows
of the 128-row tile, take turns on the tensor cores while the other one does its softmax.
Gluon exposes exactly those pieces (``gl.warp_specialize``, ``mbarrier``, ``tma``,
``warpgroup_mma``).  This study writes that kernel for the full and causal masks (B=4, H=16,
S=8192, D=128, bf16), checks it against SDPA, and times it in turns with the generated kernel
(``Kernel.prefill_launch``'s default) and SDPA's cuDNN backend.  It is a feasibility probe for
a Gluon code path, not part of the product: it has no plan, no masks beyond these two, no
interpreter story (Gluon does not run in TRITON_INTERPRET).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# Gluon's TMA copies were renamed after 3.6 (async_copy_global_to_shared -> async_load, and the
# store likewise; the old store name raises in 3.9)
_tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
_tma_store = getattr(tma, "async_store", tma.async_copy_shared_to_global)
ROWS = 64  # query rows per consumer warpgroup; a program's tile is 2 * ROWS


@gluon.jit
def _consumer(half, q_smem, k_smem, v_smem, bars, o_desc, LSE, row_q, q_pos0, n_blocks, qk_scale,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    q = q_smem.index(half)
    q_pos = q_pos0 + half * ROWS + gl.arange(0, ROWS, row_l)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_l)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s0 = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_blocks):
        idx = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(idx), ph)
        s = warpgroup_mma(q, k_smem.index(idx).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(idx), count=1)
        if CAUSAL:
            if j == n_blocks - 1:
                k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, col_l)
                s = gl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_ready.index(idx), ph)
        acc = warpgroup_mma(p_op, v_smem.index(idx), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(idx), count=1)
        m_i = m_new
    out = acc / gl.convert_layout(l_i, orow_l)[:, None]
    q.store(out.to(gl.bfloat16))  # Q's stage holds this half's O for the TMA store
    fence_async_shared()
    _tma_store(o_desc, [row_q + half * ROWS, 0], q)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + row_q + half * ROWS + gl.arange(0, ROWS, row_l), lse)
    tma.store_wait(0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, row_q, kv_row0, n_blocks,
            ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [row_q, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [row_q + ROWS, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        idx = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(idx), ph ^ 1)
        mbarrier.expect(k_ready.index(idx), k_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + j * BLOCK_N, 0], k_ready.index(idx), k_smem.index(idx))
        mbarrier.wait(v_empty.index(idx), ph ^ 1)
        mbarrier.expect(v_ready.index(idx), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row0 + j * BLOCK_N, 0], v_ready.index(idx), v_smem.index(idx))


@gluon.jit
def _fa_fwd(q_desc, k_desc, v_desc, o_desc, LSE, S, qk_scale, Q_TILES,
            ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
            CAUSAL: gl.constexpr):
    pid_m = Q_TILES - 1 - gl.program_id(0)  # longest causal rows first
    bh = gl.program_id(1)
    q_pos0 = pid_m * 2 * ROWS
    row_q = bh * S + q_pos0
    kv_row0 = bh * S
    if CAUSAL:
        n_blocks = gl.cdiv(q_pos0 + 2 * ROWS, BLOCK_N)
    else:
        n_blocks = S // BLOCK_N
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, bars, o_desc, LSE, row_q, q_pos0, n_blocks, qk_scale, ROWS, BLOCK_N,
                     HEAD_D, STAGES, CAUSAL)),
        (_consumer, (1, q_smem, k_smem, v_smem, bars, o_desc, LSE, row_q, q_pos0, n_blocks, qk_scale, ROWS, BLOCK_N,
                     HEAD_D, STAGES, CAUSAL)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, row_q, kv_row0, n_blocks, ROWS, BLOCK_N,
                   STAGES)),
    ], [4, 1], [232, 24])


def descriptors(q, k, v, o, block_n):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    d = q.shape[-1]

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return TensorDescriptor.from_tensor(t.reshape(-1, d), [rows, d], layout)
    return desc(q, ROWS), desc(k, block_n), desc(v, block_n), desc(o, ROWS)


def attention(q, k, v, causal, block_n=128, stages=2, maxnreg=168):
    import torch
    b, h, s, d = q.shape
    assert s % (2 * ROWS) == 0 and s % block_n == 0
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    qd, kd, vd, od = descriptors(q, k, v, o, block_n)
    q_tiles = s // (2 * ROWS)
    _fa_fwd[(q_tiles, b * h)](qd, kd, vd, od, lse, s, 1.4426950408889634 / math.sqrt(d), q_tiles,
                              ROWS, block_n, d, stages, causal, num_warps=4, maxnreg=maxnreg)
    return o, lse


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--variants", default="2:168")  # stages:maxnreg for the Gluon kernel
    args = ap.parse_args(argv)
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from backends.triton import bench, runtime

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        causal = name == "causal"
        program, tensors_np, tensors = bench.prefill_case(name, batch, heads, seq, d)
        kernel = runtime.load(program)
        plan, launch, _ = kernel.prefill_launch(batch, seq, seq, tensors_np)
        plan_args = kernel.device_plan(plan, q.device)
        visible = bench.visible_cells(plan, batch, heads)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        fns = {"attnc_triton": lambda: kernel.module.attention(q, k, v, plan_args, **launch, **tensors)}
        for var in args.variants.split(","):
            st, nreg = (int(x) for x in var.split(":"))
            fns[f"gluon_ws_s{st}_r{nreg}"] = lambda st=st, nreg=nreg: attention(q, k, v, causal, 128, st, nreg)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        errs = {}
        for var, fn in list(fns.items()):
            try:
                o = fn()[0]
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(f"{name} {var}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                del fns[var]
                continue
            errs[var] = ((o.float() - ref).norm() / ref.norm()).item()
            if errs[var] > 1e-2:
                print(f"{name} {var}: FAILS CHECK rel L2 {errs[var]:.2e}", flush=True)
                del fns[var]
        fns["sdpa_cudnn"] = cudnn
        errs["sdpa_cudnn"] = 0.0
        samples = bench.time_in_turns(fns, args.rounds)
        flops = 4.0 * d * visible
        for var in fns:
            meds = [float(np.median(s)) for s in samples[var]]
            tf = flops / float(np.median(meds)) / 1e9
            row = {"study": "gluon_ws", "mask": name, "impl": var, "B": batch, "H": heads, "S": seq, "D": d,
                   "o_rel_l2_vs_cudnn": errs[var], "round_medians_ms": meds, "TFLOPs": tf,
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "samples_ms": samples[var]}
            print(f"{name:8} {var:22} {tf:6.1f} TFLOP/s  rounds {min(meds):.3f}-{max(meds):.3f} ms  "
                  f"err {errs[var]:.1e}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    main()
