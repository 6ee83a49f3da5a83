"""Study: the generated module's Gluon engine (``engine="gluon"``) against its Triton kernel, per
mask and tile, on the H200.

    python bench/exp_gluon_engine.py [--out FILE] [--rounds 5] [--masks ...] [--variants ...]

Variants (timed in turns): ``triton`` (the untuned default launch of ``Kernel.prefill_launch``
with engine="triton": 128x128, or 64x64 for short rows) and ``gluon_<bm>x<bn>_s<stages>`` (the
plan retiled to bm x bn, the Gluon engine with that many K/V stages; ``_persistent``: one
program per SM looping over the tiles, ``GLUON_PERSISTENT``).  r31 timed ``_overlap`` variants
(the consumers' intra-warpgroup pipelining, removed after it lost; commit 40a81d1 has it).  Each variant's O is
compared with the Triton kernel's (rel. L2 < 1e-2, else the variant is dropped and reported).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--masks", default="full,causal,prefix_lm_2048,sliding_window_1024,causal_document")
    ap.add_argument("--variants", default="128x128s2,128x128s3,128x64s3,128x64s4")  # suffix p: persistent
    ap.add_argument("--flex", default="", help="masks to also time FlexAttention on (both modes), same process")
    args = ap.parse_args(argv)
    import torch
    import triton
    from backends.triton import bench

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        case = bench.study_case(name, batch, heads, seq, d, q.device, engine="triton")
        kernel, plan, mod = case.kernel, case.plan, case.kernel.module
        base = kernel.plan(batch, seq, seq, case.tensors_np, 128, 128)
        fns = {f"triton_{plan.block_m}x{plan.block_n}": lambda: mod.attention(
            q, k, v, case.plan_args, **case.launch, **case.tensors)}
        for var in args.variants.split(","):
            persistent = var.endswith("p")  # one program per SM looping over tiles (GLUON_PERSISTENT)
            tiles, stages = var.rstrip("p").split("s")
            bm, bn = (int(x) for x in tiles.split("x"))
            a = kernel.device_plan(base.retile(bm, bn), q.device)

            def fn(a=a, st=int(stages), persistent=persistent):
                mod.GLUON_PERSISTENT = persistent
                return mod.attention(q, k, v, a, num_stages=st, engine="gluon", **case.tensors)
            fns[f"gluon_{tiles}_s{stages}{'_persistent' if persistent else ''}"] = fn
        ref = None
        errs = {}
        for var, fn in list(fns.items()):
            try:
                o, lse = fn()
                torch.cuda.synchronize()
            except Exception as e:  # reported, not fatal: the study goes on with the others
                print(f"{name} {var}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
                del fns[var]
                continue
            ref = (o, lse) if ref is None else ref
            errs[var] = bench.output_error(o, lse, ref)
            if errs[var][0] > 1e-2:
                print(f"{name} {var}: FAILS CHECK rel L2 {errs[var][0]:.2e}", flush=True)
                del fns[var]
        samples = bench.time_in_turns(fns, args.rounds)
        flops = 4.0 * d * case.visible
        bench.study_rows("gluon_engine", name, samples, flops, {"B": batch, "H": heads, "S": seq, "D": d},
                         {var: {"o_rel_l2_vs_triton": e[0], "lse_max_abs_vs_triton": e[1]} for var, e in errs.items()},
                         args.out)
        if name in args.flex.split(","):  # the peer, checked against the Triton kernel's O
            check = lambda o: bench.output_error(o, ref[1], ref)[0]  # noqa: E731
            record = {"study": "gluon_engine", "mask": name, "B": batch, "H": heads, "S": seq, "D": d,
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
            for row in bench._flex_rows(torch, triton, name, q, k, v, case.tensors, check, record, flops,
                                        ["default", "max-autotune-no-cudagraphs"]):
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    main()
