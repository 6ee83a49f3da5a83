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

import numpy as np

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
    from backends.triton import bench, runtime

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        program, tensors_np, tensors = bench.prefill_case(name, batch, heads, seq, d)
        kernel = runtime.load(program)
        plan, launch, _ = kernel.prefill_launch(batch, seq, seq, tensors_np, engine="triton")
        base = kernel.plan(batch, seq, seq, tensors_np, 128, 128)
        visible = bench.visible_cells(plan, batch, heads)
        args_t = kernel.device_plan(plan, q.device)
        fns = {f"triton_{plan.block_m}x{plan.block_n}": lambda a=args_t: kernel.module.attention(
            q, k, v, a, **launch, **tensors)}
        mod = kernel.module
        for var in args.variants.split(","):
            persistent = var.endswith("p")  # one program per SM looping over tiles (GLUON_PERSISTENT)
            tiles, stages = var.rstrip("p").split("s")
            bm, bn = (int(x) for x in tiles.split("x"))
            a = kernel.device_plan(base.retile(bm, bn), q.device)

            def fn(a=a, st=int(stages), persistent=persistent):
                mod.GLUON_PERSISTENT = persistent
                return mod.attention(q, k, v, a, num_stages=st, engine="gluon", **tensors)
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
            ref = (o.float(), lse) if ref is None else ref
            errs[var] = (((o.float() - ref[0]).norm() / ref[0].norm()).item(),
                         (lse - ref[1]).abs().nan_to_num(0.0).max().item())
            if errs[var][0] > 1e-2:
                print(f"{name} {var}: FAILS CHECK rel L2 {errs[var][0]:.2e}", flush=True)
                del fns[var]
        samples = bench.time_in_turns(fns, args.rounds)
        flops = 4.0 * d * visible
        for var in fns:
            meds = [float(np.median(s)) for s in samples[var]]
            tf = flops / float(np.median(meds)) / 1e9
            row = {"study": "gluon_engine", "mask": name, "variant": var, "B": batch, "H": heads, "S": seq, "D": d,
                   "o_rel_l2_vs_triton": errs[var][0], "lse_max_abs_vs_triton": errs[var][1],
                   "round_medians_ms": meds, "TFLOPs": tf, "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__, "samples_ms": samples[var]}
            print(f"{name:22} {var:20} {tf:6.1f} TFLOP/s  rounds {min(meds):.3f}-{max(meds):.3f} ms  "
                  f"err o {errs[var][0]:.1e} lse {errs[var][1]:.1e}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if name in args.flex.split(","):  # the peer, checked against the Triton kernel's O
            check = lambda o: ((o.float() - ref[0]).norm() / ref[0].norm()).item()  # noqa: E731
            record = {"study": "gluon_engine", "mask": name, "B": batch, "H": heads, "S": seq, "D": d,
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
            for row in bench._flex_rows(torch, triton, name, q, k, v, tensors, check, record, flops,
                                        ["default", "max-autotune-no-cudagraphs"]):
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    main()
