"""Simulated context-parallel study (issue 19), plan only, no GPU: for the five prefill bench
masks at 128K-1M tokens over 8-64 ranks, each strategy's imbalance (max/mean computed cells per
rank) and K/V bytes moved per rank, next to the token-even split (``even``), and which one
``auto`` picks.  One JSON line per (mask, S, ranks, strategy); a plot beside it.

    python3 bench/cp_study.py --out bench/results/studies/cp_study.jsonl --png bench/results/studies/cp_study.png

Shape: B=1, H=16 (MHA), d=128, bf16 (the prefill bench's), tiles of 128 tokens; the documents'
ids are the bench's (`segments(256, 2048)`, seed 0).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__ and str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))

from attnc.compiler.cp import STRATEGIES, plan_cp, tile_costs  # noqa: E402
from attnc.compiler.explain import call_tensors  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from attnc.bench.harness import PREFILL_MASKS, spec_text  # noqa: E402

LENGTHS = (131072, 262144, 524288, 1048576)
RANKS = (8, 16, 32, 64)


def study(masks, lengths, ranks, heads=16, head_dim=128, block=128, seed=0):
    """Yield one row per (mask, S, ranks, strategy)."""
    for name in masks:
        mask, decls = PREFILL_MASKS[name]
        program = compile_spec(spec_text(name, mask, decls, heads, head_dim), f"bench_{name}")
        for seq in lengths:
            t0 = time.perf_counter()
            tensors = call_tensors(program, 1, seq, seq, {}, seed)
            costs = tile_costs(program, 1, seq, tensors, block=block)
            costs_s = time.perf_counter() - t0
            for n in ranks:
                t0 = time.perf_counter()
                cp = plan_cp(program, 1, seq, n, costs=costs)
                assign_s = time.perf_counter() - t0
                per_token = cp.kv_bytes_per_token
                for strategy in STRATEGIES:
                    a = cp.candidates[strategy]
                    recv, send = a.traffic.sum(axis=0) * per_token, a.traffic.sum(axis=1) * per_token
                    yield {"study": "cp", "mask": name, "S": seq, "ranks": n, "strategy": strategy,
                           "auto": strategy == cp.strategy, "B": 1, "H": heads, "D": head_dim, "dtype": "bf16",
                           "block": block, "imbalance": a.imbalance, "token_imbalance": a.token_imbalance,
                           "computed_cells": a.work.tolist(), "tokens": a.tokens.tolist(),
                           "recv_bytes": recv.tolist(), "send_bytes": send.tolist(),
                           "max_recv_bytes": int(recv.max()), "mean_recv_bytes": float(recv.mean()),
                           "total_bytes": int(recv.sum()), "kv_bytes_per_token": per_token,
                           "costs_s": round(costs_s, 3), "assign_s": round(assign_s, 3)}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    lengths = sorted({r["S"] for r in rows})
    shown = [lengths[0], lengths[-1]] if len(lengths) > 1 else lengths
    colours = {"even": "tab:grey", "zigzag": "tab:blue", "balanced": "tab:green"}
    fig, axes = plt.subplots(2, len(masks), figsize=(4 * len(masks), 7), squeeze=False)
    for col, mask in enumerate(masks):
        for strategy in STRATEGIES:
            for seq, style in zip(shown, ("--", "-")):
                pts = sorted((r["ranks"], r) for r in rows if (r["mask"], r["strategy"], r["S"]) == (mask, strategy, seq))
                if not pts:
                    continue
                x = [p for p, _ in pts]
                label = f"{strategy}, S={seq // 1024}K"
                axes[0][col].plot(x, [r["imbalance"] for _, r in pts], style, color=colours[strategy], marker="o",
                                  label=label)
                axes[1][col].plot(x, [r["max_recv_bytes"] / 2**20 for _, r in pts], style, color=colours[strategy],
                                  marker="o", label=label)
                for n, r in pts:
                    if r["auto"]:
                        axes[0][col].plot([n], [r["imbalance"]], "k*", markersize=9)
        axes[0][col].set_title(mask)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("ranks")
        axes[1][col].set_yscale("log")
    axes[0][0].set_ylabel("max / mean computed cells per rank")
    axes[1][0].set_ylabel("K/V received by the busiest rank (MiB)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("context parallelism, plan only: B=1 H=16 d=128 bf16, tiles of 128 (* = auto's pick)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="FILE.jsonl")
    ap.add_argument("--png", metavar="FILE.png", help="plot imbalance and K/V received per rank")
    ap.add_argument("--masks", default=",".join(PREFILL_MASKS), help="comma-separated bench masks")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args(argv)
    masks = [m for m in args.masks.split(",") if m]
    unknown = [m for m in masks if m not in PREFILL_MASKS]
    if unknown:
        ap.error(f"unknown mask {unknown[0]!r}; expected one of {', '.join(PREFILL_MASKS)}")
    rows = []
    with open(args.out, "w") as f:
        for row in study(masks, [int(x) for x in args.lengths.split(",")], [int(x) for x in args.ranks.split(",")],
                         block=args.block):
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
            if row["strategy"] == STRATEGIES[-1]:  # the three candidates of one (mask, S, ranks)
                group = {r["strategy"]: r for r in rows[-len(STRATEGIES):]}
                pick = next(r for r in group.values() if r["auto"])
                print(f"{row['mask']:<20} S={row['S']:>8} N={row['ranks']:>3} auto={pick['strategy']:<9} "
                      f"imbalance {pick['imbalance']:.3f} (even {group['even']['imbalance']:.3f}), max recv "
                      f"{pick['max_recv_bytes'] / 2**20:9.1f} MiB (even {group['even']['max_recv_bytes'] / 2**20:.1f})",
                      flush=True)
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
