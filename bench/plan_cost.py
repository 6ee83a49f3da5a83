"""Plan cost of a causal-document mask at long context (CPU): intervals + eight summaries +
tile CSR, B = 1, one head, 128 x 128 tiles.  Target (issue): < 100 ms and < 64 MB at 128K.

    python bench/plan_cost.py [--lengths 32768,131072] [--repeats 5] [--out bench/results/plan_cost.jsonl]

Each row records raw samples (seconds) and the tracemalloc peak of one planning run.
FlexAttention's create_block_mask for the same mask is O(S^2) (11 GB at 32K on the H200,
out of memory at 128K): our plan never forms the S x S rectangle.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnc.compiler import __version__, inputs  # noqa: E402
from attnc.compiler.analysis.intervals import analyze  # noqa: E402
from attnc.compiler.analysis.tiles import plan_tiles, summaries  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

SPEC = """attention causal_document_1h {
    heads = 1  head_dim = 128
    tensor doc: i32[b, s] ~ segments(256, 2048)
    mask = causal & doc[b, q] == doc[b, k]
}"""


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def plan_once(program, s, doc, block):
    mi = analyze(program, 1, s, s, {"doc": doc})
    summ = summaries(mi, block)
    tiles = plan_tiles(mi, block, block, method="summaries")
    return mi, summ, tiles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--out", default="bench/results/plan_cost.jsonl")
    args = ap.parse_args(argv)
    program = compile_spec(SPEC)
    rows = []
    for s in map(int, args.lengths.split(",")):
        doc = inputs.sample(program, 1, s, s, seed=0)["doc"]
        mi, summ, tiles = plan_once(program, s, doc, args.block)  # warm-up, and the result we check
        assert mi.representable, mi.reason
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan_once(program, s, doc, args.block)
            samples.append(time.perf_counter() - t0)
        tracemalloc.start()
        plan_once(program, s, doc, args.block)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        metadata = {"four_int32_vectors": 16 * s, "eight_int32_summaries": sum(v.nbytes for v in summ.values()),
                    "tile_csr": int(tiles.partial_indptr.nbytes + tiles.partial_indices.nbytes
                                    + tiles.full_indptr.nbytes + tiles.full_indices.nbytes),
                    "tile_classes_int8": int(tiles.classes.nbytes), "dense_u8_would_be": s * s}
        row = {
            "bench": "plan_cost", "mask": "causal_document", "docs": "segments(256, 2048)",
            "B": 1, "H": 1, "S": s, "block": [args.block, args.block], "documents": int(doc.max()) + 1,
            "tiles": tiles.counts(), "method": tiles.method,
            "samples_s": samples, "median_ms": float(np.median(samples) * 1e3),
            "peak_bytes": int(peak), "metadata_bytes": metadata,
            "env": {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
                    "cpus": os.cpu_count(), "attnc": __version__, "commit": _commit()},
            "command": "python bench/plan_cost.py " + " ".join(argv or sys.argv[1:]),
        }
        rows.append(row)
        print(f"S={s:>7}: median {row['median_ms']:.1f} ms over {args.repeats}, peak {peak / 2**20:.1f} MiB, "
              f"tiles {row['tiles']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
