"""Study of the prefill inner loop on a Hopper GPU: which loop structure the generated kernel should use.

A stripped kernel (no plan, no mask program: full or causal only) in variants, timed against SDPA
in one process, each checked against SDPA's output first:

- PREFETCH: software-pipelined S = Q K^T — the dot for block j+1 is issued before the softmax of
  block j, so the tensor cores can run it while the warps do exp2 (FA3's intra-warpgroup overlap).
- FTZ: exp2 as ``ex2.approx.ftz.f32`` (one MUFU op) instead of Triton's ``exp2``.
- configs: BLOCK_M x BLOCK_N x warps x stages, all with TMA descriptors.

    python bench/exp_prefill_loop.py [--out rows.jsonl] [--seq 8192] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _exp2(x, FTZ: tl.constexpr):
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.math.exp2(x)


@triton.jit
def _absorb(s, m_i, l_i, acc, v, qk_scale, FTZ: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = _exp2(s * qk_scale - m_new[:, None], FTZ)
    alpha = _exp2(m_i - m_new, FTZ)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _fwd(desc_q, desc_k, desc_v, desc_o, N_CTX, qk_scale, CAUSAL: tl.constexpr, PREFETCH: tl.constexpr,
         FTZ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m  # heaviest first
    row0 = tl.program_id(1) * N_CTX
    q = desc_q.load([row0 + start_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    if CAUSAL:
        hi = start_m * BLOCK_M
    else:
        hi = N_CTX
    if PREFETCH:
        if hi > 0:
            s = tl.dot(q, desc_k.load([row0, 0]).T)
            for start_n in tl.range(BLOCK_N, hi, BLOCK_N):
                s_next = tl.dot(q, desc_k.load([row0 + start_n, 0]).T)
                v = desc_v.load([row0 + start_n - BLOCK_N, 0])
                m_i, l_i, acc = _absorb(s, m_i, l_i, acc, v, qk_scale, FTZ)
                s = s_next
            v = desc_v.load([row0 + hi - BLOCK_N, 0])
            m_i, l_i, acc = _absorb(s, m_i, l_i, acc, v, qk_scale, FTZ)
    else:
        for start_n in tl.range(0, hi, BLOCK_N):
            s = tl.dot(q, desc_k.load([row0 + start_n, 0]).T)
            v = desc_v.load([row0 + start_n, 0])
            m_i, l_i, acc = _absorb(s, m_i, l_i, acc, v, qk_scale, FTZ)
    if CAUSAL:  # the diagonal blocks, masked
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        for start_n in range(hi, hi + BLOCK_M, BLOCK_N):
            s = tl.dot(q, desc_k.load([row0 + start_n, 0]).T)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
            v = desc_v.load([row0 + start_n, 0])
            m_i, l_i, acc = _absorb(s, m_i, l_i, acc, v, qk_scale, FTZ)
    out = acc / l_i[:, None]
    desc_o.store([row0 + start_m * BLOCK_M, 0], out.to(desc_o.dtype))


def run(q, k, v, causal, prefetch, ftz, bm, bn, warps, stages):
    b, h, s, d = q.shape
    o = torch.empty_like(q)
    dq = TensorDescriptor.from_tensor(q.view(-1, d), [bm, d])
    dk = TensorDescriptor.from_tensor(k.view(-1, d), [bn, d])
    dv = TensorDescriptor.from_tensor(v.view(-1, d), [bn, d])
    do = TensorDescriptor.from_tensor(o.view(-1, d), [bm, d])
    grid = (s // bm, b * h)

    def go():
        _fwd[grid](dq, dk, dv, do, s, 1.4426950408889634 / math.sqrt(d), CAUSAL=causal, PREFETCH=prefetch,
                   FTZ=ftz, BLOCK_M=bm, BLOCK_N=bn, HEAD_D=d, num_warps=warps, num_stages=stages)
        return o
    return go


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", default="128x128x8x2,128x128x8x3,128x64x4x3,128x64x8x3,64x64x4x3,64x128x4x3")
    ap.add_argument("--variants", default="00,10,01,11", help="PREFETCH FTZ bits")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = open(args.out, "a") if args.out else None
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for causal in (True, False):
        flops = 4.0 * d * b * h * (s * (s + 1) / 2 if causal else s * s)
        ref = None
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel([backend]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                o = f()
                ref = o.float() if ref is None else ref
                ms = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="all")
            med = sorted(ms)[len(ms) // 2]
            row = dict(env, impl=f"sdpa_{backend.name.lower()}", causal=causal, B=b, H=h, S=s, D=d,
                       ms=med, TFLOPs=flops / med / 1e9, samples_ms=ms)
            print(f"causal={causal} {row['impl']:28} {row['TFLOPs']:6.1f}", flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
        for cfg, var in itertools.product(args.configs.split(","), args.variants.split(",")):
            bm, bn, w, st = (int(x) for x in cfg.split("x"))
            pf, ftz = bool(int(var[0])), bool(int(var[1]))
            try:
                go = run(q, k, v, causal, pf, ftz, bm, bn, w, st)
                o = go()
                err = ((o.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300, return_mode="all")
            except Exception as e:  # a config that does not compile is a result too
                print(f"causal={causal} {cfg} pf={pf} ftz={ftz}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            med = sorted(ms)[len(ms) // 2]
            row = dict(env, impl="study", causal=causal, config=cfg, prefetch=pf, ftz=ftz, B=b, H=h, S=s, D=d,
                       rel_l2=err, ms=med, TFLOPs=flops / med / 1e9, samples_ms=ms)
            print(f"causal={causal} {cfg:12} pf={pf:d} ftz={ftz:d} err={err:.1e} {row['TFLOPs']:6.1f}", flush=True)
            if out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
