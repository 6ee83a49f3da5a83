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
import sys
from pathlib import Path

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
    from attnc.backends.common import load_module
    from attnc.backends.triton import bench

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        case = bench.study_case(name, batch, heads, seq, d, q.device, engine="triton")  # the patched kernel
        ref = None
        fns, errs = {}, {}
        for var in VARIANTS:
            module = load_module(patched_source(case.kernel.source.text, var),
                                 f"{case.kernel.source.module_stem}_{var}")

            def fn(module=module):
                return module.attention(q, k, v, case.plan_args, **case.launch, **case.tensors)
            o, lse = fn()
            torch.cuda.synchronize()
            ref = (o, lse) if ref is None else ref
            errs[var] = bench.output_error(o, lse, ref)
            fns[var] = fn
        samples = bench.time_in_turns(fns, args.rounds)
        common = {"B": batch, "H": heads, "S": seq, "D": d, "tiles": [case.plan.block_m, case.plan.block_n],
                  "launch": case.launch}
        bench.study_rows("half_exp2", name, samples, 4.0 * d * case.visible, common,
                         {var: {"o_rel_l2_vs_base": e[0], "lse_max_abs_vs_base": e[1], "check_ok": e[0] < 1e-2}
                          for var, e in errs.items()}, args.out)
    return 0


if __name__ == "__main__":
    main()
