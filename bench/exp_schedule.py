"""Study: the prefill launch order and the split tail, A/B interleaved on one GPU.

    python bench/exp_schedule.py [--out FILE] [--rounds 7] [--masks causal,full,...]

For each mask: the default tiles of ``Kernel.prefill_launch`` launched with (a) the order before
r21 (one head after another, head_group 1), (b) head groups of 8, longest tile first across the
group, (c) head groups of 4 (the default since r23), (d) as (c) without the load of the plan's
order (a patched copy of the module).  Variants are timed in turns, ``--rounds`` times, so that
clock and thermal drift fall on all of them alike; rows carry every round's samples.  (r22/r23
were made at commit 878a5a3, which also had a split of the last wave, since removed.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {"old_order": 1, "group8": 8, "group4": 4, "group4_no_order_load": 4}
# the last variant runs a copy of the module whose tiles skip the plan's order (tile = last - rank,
# no dependent load before the row's block list): what one fewer load in the prologue is worth
NO_ORDER = ("pid_m = tl.load(ORDER + plane * Q_TILES + rank)", "pid_m = Q_TILES - 1 - rank")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--masks", default="full,causal,prefix_lm_2048,sliding_window_1024,causal_document")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args(argv)
    import torch
    from attnc.backends.common import load_module
    from attnc.backends.triton import bench

    batch, heads, seq, d = args.batch, args.heads, args.seq, 128
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in args.masks.split(","):
        case = bench.study_case(name, batch, heads, seq, d, q.device, engine="triton")  # the patched kernel
        kernel = case.kernel
        assert NO_ORDER[0] in kernel.source.text
        patched = load_module(kernel.source.text.replace(*NO_ORDER), kernel.source.module_stem + "_no_order")
        fns = {}
        ref = None
        for var, group in VARIANTS.items():
            module = patched if var == "group4_no_order_load" else kernel.module

            def fn(group=group, module=module):
                return module.attention(q, k, v, case.plan_args, head_group=group, **case.launch, **case.tensors)
            o, lse = fn()
            torch.cuda.synchronize()
            ref = (o, lse) if ref is None else ref
            err = bench.output_error(o, lse, ref)[0]
            assert err < 1e-2, (name, var, err)
            fns[var] = fn
        samples = bench.time_in_turns(fns, args.rounds)
        common = {"B": batch, "H": heads, "S": seq, "D": d, "tiles": [case.plan.block_m, case.plan.block_n],
                  "launch": case.launch}
        bench.study_rows("prefill_schedule", name, samples, 4.0 * d * case.visible, common, out=args.out)
    return 0


if __name__ == "__main__":
    main()
