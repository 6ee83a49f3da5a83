"""Decode benchmark on a GPU: attnc's split-K/V kernel on a paged cache vs SDPA (contiguous).

    python bench/gpu_decode.py [--out bench/results/decode_h200.jsonl]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/decode_h200.jsonl")
    args = ap.parse_args()
    from attnc.backends.triton import bench
    rows = bench.run_decode(out=args.out)
    print("\nsummary (K/V read bandwidth, best passing config)")
    best = {}
    for r in rows:
        if r.get("pass") and r.get("TBps"):
            key = (r["B"], r["T"], r["impl"])
            if key not in best or r["TBps"] > best[key]["TBps"]:
                best[key] = r
    for (b, t, impl), r in sorted(best.items()):
        print(f"B={b:3} T={t:6} {impl:16} {r['TBps']:.2f} TB/s  cfg={r.get('dispatch', {}).get('config', '')}")
