"""One real tuning run on the H200: the prefill benchmark's causal shape (B=4, H=16, S=8192,
D=128, bf16) over 32 launch configs, every candidate checked against the oracle before it is
timed; the cache entry records the untuned (heuristic) median next to the winner's.

    OUT=DIR python3 bench/tune_h200.py
"""
import json
import os
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnc.compiler import evidence as ev, tune  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402

out = os.environ.get("OUT", "bench/results")
T = tune.SPACES["triton"]["prefill"]
space = tune.Space({"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3),
                    "use_tma": (False, True)}, T.heuristic, T.constraints)
program = compile_file(Path(__file__).parent / "specs" / "causal_h16_d128.attn")
cache = os.path.join(out, "tune_h200_cache.json")
results = tune.tune(program, tune.parse_shapes("4:8192:8192"), "triton", cache=cache, space=space,
                    warmup=5, repeats=20)
rows = results[0].rows
with open(os.path.join(out, "tune_h200.jsonl"), "w") as f:
    for r in rows:
        ev.check_row(r)
        f.write(json.dumps(r) + "\n")
entry = json.load(open(cache))["entries"]
for digest, e in entry.items():
    print(json.dumps({k: e[k] for k in e if k not in ("samples_ms", "candidates")}, default=str)[:1500])
