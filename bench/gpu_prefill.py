"""Prefill benchmark on a GPU: attnc's Triton kernel vs FlexAttention and SDPA, one process.

    python bench/gpu_prefill.py [--out bench/results/prefill_h200.jsonl] [--masks causal,full]
        [--seq 8192] [--batch 4] [--heads 16] [--flex-modes default,max-autotune-no-cudagraphs]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/prefill_h200.jsonl")
    ap.add_argument("--masks", default=None)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", default=None, help="BMxBNxWxS[twrbgmpis],... e.g. 128x64x4x3,128x128x8x2t")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--flex-modes", default="default,max-autotune-no-cudagraphs")
    args = ap.parse_args(argv)
    from attnc.backends.triton import bench
    configs = None
    if args.configs:  # BMxBNxWxS[flags]: backends/triton/bench.parse_configs
        configs = bench.parse_configs(args.configs)
    masks = args.masks.split(",") if args.masks else None
    rows = bench.run_prefill(args.batch, args.heads, args.seq, args.head_dim, masks=masks, configs=configs, out=args.out,
                             flex=not args.no_flex, sdpa=not args.no_sdpa,
                             flex_modes=tuple(args.flex_modes.split(",")))
    print("\nsummary (visible-cell TFLOP/s; best passing config per implementation)")
    best = {}
    for r in rows:
        if r.get("pass") and r.get("TFLOPs"):
            key = (r["mask"], r["impl"])
            if key not in best or r["TFLOPs"] > best[key]["TFLOPs"]:
                best[key] = r
    for (mask, impl), r in sorted(best.items()):
        print(f"{mask:22} {impl:32} {r['TFLOPs']:7.1f}  cfg={r.get('dispatch', {}).get('config', '')}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
