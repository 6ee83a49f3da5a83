"""Study: is the prefill kernel's exponential bound by the SFU (MUFU) on the H200?

    python bench/exp_half_exp2.py [--out FILE] [--rounds 5] [--masks full,causal,...]

Per K/V block the kernel takes BLOCK_M x BLOCK_N exponentials, one ``ex2.approx.f32`` each; the
H200's SFU issues 16 a clock per SM, about half the block's tensor-core time at D = 128.  The
SFU also has packed half-precision forms that take two per instruction.  Variants, timed in
turns on the default tiles of ``Kernel.prefill_launch`` (patched copies of the generated module):

- ``base``: the generated module;
- ``f16x2``: the argument rounded to f16 pairs, ``ex2.approx.f16x2``, widened back to f32
  (the row sum and P's cast to bf16 as before): one SFU op per two exponentials;
- ``bf16x2``: the argument rounded to bf16 pairs, ``ex2.approx.ftz.bf16x2``: P comes out in bf16,
  ready for the P.V dot; the row sum widens it (a shift).

Each variant's output is compared with the base module's (O rel. L2, LSE max abs); the error is
recorded, and a variant above the bf16 check (1e-2) is reported as failing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BASE = ("    p = tl.math.exp2(s * qk_scale - m_new[:, None])\n",
        "    l_i = l_i * alpha + tl.sum(p, 1)\n",
        "    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)\n")
F16X2 = ('    p = tl.inline_asm_elementwise("{ .reg .b32 t; .reg .b16 lo, hi; cvt.rn.f16x2.f32 t, $3, $2; '
         'ex2.approx.f16x2 t, t; mov.b32 {lo, hi}, t; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", '
         '"=r,=r,r,r", [s * qk_scale - m_new[:, None]], dtype=tl.float32, is_pure=True, pack=2)\n',
         BASE[1], BASE[2])
BF16X2 = ('    p = tl.inline_asm_elementwise("{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $2, $1; '
          'ex2.approx.ftz.bf16x2 $0, t; }", "=r,r,r", [s * qk_scale - m_new[:, None]], dtype=tl.bfloat16, '
          'is_pure=True, pack=2)\n',
          "    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)\n",
          "    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)\n")
VARIANTS = {"base": BASE, "f16x2": F16X2, "bf16x2": BF16X2}


def patched_source(text: str, variant: str) -> str:
    for old, new in zip(BASE, VARIANTS[variant]):  # the prefill tile's lines (the module's split
        old, new = "\n" + old, "\n" + new       # kernel has the same ones, indented deeper)
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--masks", default="full,causal,sliding_window_1024,causal_document")
    args = ap.parse_args(argv)
    import torch
    import triton
    from backends.common import load_module
    from backends.triton import bench, runtime

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        program, tensors_np, tensors = bench.prefill_case(name, batch, heads, seq, d)
        kernel = runtime.load(program)
        plan, launch, _ = kernel.prefill_launch(batch, seq, seq, tensors_np)
        plan_args = kernel.device_plan(plan, q.device)
        visible = bench.visible_cells(plan, batch, heads)
        ref = None
        fns, errs = {}, {}
        for var in VARIANTS:
            module = load_module(patched_source(kernel.source.text, var), f"{kernel.source.module_stem}_{var}")

            def fn(module=module):
                return module.attention(q, k, v, plan_args, **launch, **tensors)
            o, lse = fn()
            torch.cuda.synchronize()
            ref = (o.float(), lse) if ref is None else ref
            errs[var] = (((o.float() - ref[0]).norm() / ref[0].norm()).item(),
                         (lse - ref[1]).abs().nan_to_num(0.0).max().item())
            fns[var] = fn
        samples = bench.time_in_turns(fns, args.rounds)
        flops = 4.0 * d * visible
        for var in fns:
            meds = [float(np.median(s)) for s in samples[var]]
            tf = flops / float(np.median(meds)) / 1e9
            ok = errs[var][0] < 1e-2
            row = {"study": "half_exp2", "mask": name, "variant": var, "B": batch, "H": heads, "S": seq, "D": d,
                   "tiles": [plan.block_m, plan.block_n], "launch": launch, "o_rel_l2_vs_base": errs[var][0],
                   "lse_max_abs_vs_base": errs[var][1], "check_ok": ok, "round_medians_ms": meds,
                   "TFLOPs": tf, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "samples_ms": samples[var]}
            print(f"{name:22} {var:7} {tf:6.1f} TFLOP/s  rounds {min(meds):.3f}-{max(meds):.3f} ms  "
                  f"err o {errs[var][0]:.1e} lse {errs[var][1]:.1e}{'' if ok else '  FAILS CHECK'}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    main()
