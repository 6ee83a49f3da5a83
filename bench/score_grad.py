"""GPU benchmark of a learned score bias's gradient (issue 33): the backward of
``score = score + bias[h, q, k]`` under a causal mask, attnc's public call (the Triton backward,
dBias reduced inside its kernel: ``backends/triton/score_grads.py``) against FlexAttention
compiled with the bias captured by its ``score_mod`` (its Triton path sums the bias's gradient
with atomics), in one process on the same inputs: B=4 H=16 d=128 bf16 q/k/v, a float32 bias,
S = 2048, 4096, 8192 unless told.

Each implementation's dQ, dK, dV (planes (0, 0) and (B-1, H-1)) and dBias (heads 0 and H-1, summed
over the batch) are checked first against float32 dense autograd on the GPU; then
  bwd      ``torch.autograd.grad(o, (q, k, v, bias), do, retain_graph=True)`` on a graph made once;
  fwd_bwd  the forward and that backward.
TFLOP/s count visible cells only (backward 10 * d * cells, forward+backward 14 * d * cells), as
``bench/backward.py``.  attnc's deterministic dBias is also checked bit for bit on a second call
(``deterministic`` in its rows).

``python3 -m bench.score_grad [--seqs 2048,4096,8192] [--out bench/results/score_grad_h200.jsonl]``
"""
from __future__ import annotations

import argparse
import math
import sys

from .harness import Rows, environment, timed

SPEC = ("attention learned_bias {{ heads = {heads} head_dim = {d} dtype = bf16 tensor bias: f32[h, s, s] "
        "score = score + bias[h, q, k] mask = causal }}")


def _reference(q, k, v, bias, do, planes, heads):
    """float32 dense autograd: {(b, h): (dq, dk, dv)} of ``planes`` and {h: dBias[h]} of ``heads``
    (summed over every request)."""
    import torch
    grads, dbias = {}, {}
    s = q.shape[2]
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    for b in range(q.shape[0]):
        for h in sorted({h for _, h in planes} | set(heads)):
            if (b, h) not in planes and h not in heads:
                continue
            qq, kk, vv = (x[b, h].float().detach().requires_grad_() for x in (q, k, v))
            bb = bias[h].detach().clone().requires_grad_()
            sc = (qq @ kk.T) / math.sqrt(q.shape[-1]) + bb
            p = torch.softmax(sc.masked_fill(~visible, float("-inf")), -1)
            (p @ vv).backward(do[b, h].float())
            if (b, h) in planes:
                grads[(b, h)] = (qq.grad, kk.grad, vv.grad)
            if h in heads:
                dbias[h] = dbias[h] + bb.grad if h in dbias else bb.grad
            del qq, kk, vv, bb, sc, p
    return grads, dbias


def _rel(a, b) -> float:
    return float((a.float() - b).norm() / b.norm())


def run_score_grad(batch=4, heads=16, seqs=(2048, 4096, 8192), head_dim=128, out=None, seed=0, command="",
                   flex=True):
    import torch
    import attnc

    rows = Rows(out, command)
    env = environment()
    attn = attnc.compile(SPEC.format(heads=heads, d=head_dim))
    for seq in seqs:
        _one_length(attn, rows, env, batch, heads, seq, head_dim, seed, flex)
        torch.cuda.empty_cache()
    return list(rows)


def _one_length(attn, rows, env, batch, heads, seq, head_dim, seed, flex) -> None:
    """Check, then time, every implementation at one sequence length (its tensors freed on return)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    bias = torch.randn((heads, seq, seq), device="cuda", dtype=torch.float32, generator=g).requires_grad_()
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    planes, check_heads = [(0, 0), (batch - 1, heads - 1)], [0, heads - 1]
    refs, ref_bias = _reference(q, k, v, bias, do, planes, check_heads)

    def check(grads):
        worst = max(_rel(gx[b, h], r) for (b, h), ref in refs.items() for gx, r in zip(grads[:3], ref))
        return max(worst, *(_rel(grads[3][h], ref_bias[h]) for h in check_heads))

    visible = batch * seq * (seq + 1) // 2
    fwd_flops = 4.0 * head_dim * visible * heads
    record = {"bench": "score_grad", "score": "score + bias[h, q, k]", "mask": "causal", "B": batch,
              "H": heads, "S": seq, "D": head_dim, "dtype": "bf16", "bias_dtype": "f32",
              "visible_cells": visible, "env": env, "tolerance_rel_l2": 2e-2,
              "reference": f"float32 dense autograd on GPU: dq/dk/dv of (b,h) in {planes}, dBias of heads "
                           f"{check_heads} summed over the batch; worst rel-L2"}
    impls = {"attnc_call": lambda: attn(q, k, v, bias=bias)}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.reset()
        torch._functorch.config.donated_buffer = False  # bwd replays one graph (retain_graph)
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device="cuda")
        compiled = torch.compile(flex_attention)

        def score_mod(score, b, h, qi, ki):
            return score + bias[h, qi, ki]
        impls["flex_default"] = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    leaves = (q, k, v, bias)
    label = f"bias[h,q,k] causal B={batch} S={seq}"
    for impl, forward in impls.items():
        extra = {}
        try:
            o = forward()
            if impl == "attnc_call":
                once = torch.autograd.grad(o, leaves, do, retain_graph=True)
                again = torch.autograd.grad(o, leaves, do, retain_graph=True)
                extra["deterministic"] = all(torch.equal(a, b) for a, b in zip(once, again))
                del once, again
        except Exception as e:  # noqa: BLE001 - a peer failing is a row
            rows.append({**record, "impl": impl, "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
            print(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)
            continue

        def bwd(o=o):
            return torch.autograd.grad(o, leaves, do, retain_graph=True)

        def fwd_bwd(forward=forward):
            return torch.autograd.grad(forward(), leaves, do)
        timed(bwd, check, {**record, **extra, "impl": impl, "phase": "bwd"}, rows, f"{label} {impl:13} bwd    ",
              2.5 * fwd_flops, "TFLOPs", tol=2e-2)
        timed(fwd_bwd, check, {**record, **extra, "impl": impl, "phase": "fwd_bwd"}, rows,
              f"{label} {impl:13} fwd+bwd", 3.5 * fwd_flops, "TFLOPs", tol=2e-2)
        del o


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--out", default="bench/results/score_grad_h200.jsonl")
    a = p.parse_args(argv)
    command = "python3 -m bench.score_grad " + " ".join(sys.argv[1:] if argv is None else argv)
    run_score_grad(a.batch, a.heads, tuple(int(s) for s in a.seqs.split(",")), a.head_dim, a.out, command=command,
                   flex=not a.no_flex)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
