"""Study: the generated module's Gluon engine (``engine="gluon"``) against its Triton kernel, per
mask and tile, on the H200.

    python bench/exp_gluon_engine.py [--out FILE] [--rounds 5] [--masks ...] [--variants ...]

Variants (timed in turns): ``triton`` (the untuned default launch of ``Kernel.prefill_launch``
with engine="triton": 128x128, or 64x64 for short rows) and ``gluon_<bm>x<bn>_s<stages>`` (the
plan retiled to bm x bn, the Gluon engine with that many K/V stages), then how its programs take
their jobs (``GLUON_SCHEDULE``): ``one_tile`` (no letter) or ``counter`` (letter c: one program
per SM drawing the next tile from an atomic counter); ``_predicate`` (letter m): PARTIAL blocks
evaluate the mask expression even where the plan has each row's run of keys
(mask_source="predicate"); ``_nomask`` (letter z): every block taken as FULL, so no mask at all
(wrong numbers, timed as the bound on what a cheaper mask could win; its error is recorded, not
gated).  r31 timed ``_overlap`` variants (the consumers' intra-warpgroup pipelining, removed
after it lost; commit 40a81d1 has it); r35-r36 ``strided`` (letter p: every num_programs-th
tile, removed after it lost to the counter).  Each variant's O is compared with the Triton
kernel's (rel. L2 < 1e-2, else the variant is dropped and reported).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--masks", default="full,causal,prefix_lm_2048,sliding_window_1024,causal_document")
    # letters: c counter programs; z no mask, m the predicate
    ap.add_argument("--variants", default="128x128s2c,128x128s2,128x128s2cm,128x128s2cz")
    ap.add_argument("--flex", default="", help="masks to also time FlexAttention on (both modes), same process")
    args = ap.parse_args(argv)
    import torch
    import triton
    from attnc.backends.triton import bench

    batch, heads, seq, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        case = bench.study_case(name, batch, heads, seq, d, q.device, engine="triton")
        kernel, plan, mod = case.kernel, case.plan, case.kernel.module
        base = kernel.plan(batch, seq, seq, case.tensors_np, 128, 128)
        fns = {f"triton_{plan.block_m}x{plan.block_n}": lambda: mod.attention(
            q, k, v, case.plan_args, **case.launch, **case.tensors)}
        for var in args.variants.split(","):
            m = re.fullmatch(r"(\d+)x(\d+)s(\d)(c?)([zm]?)", var)
            bm, bn, stages = int(m[1]), int(m[2]), int(m[3])
            schedule = "counter" if m[4] else "one_tile"
            a = kernel.device_plan(base.retile(bm, bn), q.device)
            if m[5] == "z":  # every block taken as FULL: the mask's cost (wrong numbers, not gated)
                a = {**a, "merged_partial": torch.zeros_like(a["merged_partial"])}
            source = "predicate" if m[5] == "m" else None

            def fn(a=a, st=stages, schedule=mod.SCHEDULE_NAMES.index(schedule), source=source):
                mod.GLUON_SCHEDULE = schedule
                return mod.attention(q, k, v, a, num_stages=st, engine="gluon", mask_source=source, **case.tensors)
            fns[f"gluon_{bm}x{bn}_s{stages}_{schedule}{dict(z='_nomask', m='_predicate').get(m[5], '')}"] = fn
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
            if errs[var][0] > 1e-2 and not var.endswith("_nomask"):
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
