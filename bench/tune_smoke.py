"""H200 smoke of compiler.tune's CUDA path: CUDA-event samples, TMA/shared-memory constraints,
paged split-K/V decode; every candidate checked against the float64 oracle before timing.

    python3 bench/tune_smoke.py      (OUT=DIR for the cache and rows; default bench/results/)

Two shapes with restricted spaces (17 prefill, 7 decode candidates) so the run fits a short
device lease; `attnc tune SPEC --shapes ... --evidence FILE` searches the full declared spaces.
"""
import json
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnc.compiler import evidence as ev, tune  # noqa: E402
from attnc.compiler.dispatch import Environment  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402

out = os.environ.get("OUT", "bench/results")
print("env", Environment.detect().to_json(), flush=True)
T = tune.SPACES["triton"]
sp = tune.Space({"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (3,),
                 "use_tma": (False, True)}, T["prefill"].heuristic, T["prefill"].constraints)
sd = tune.Space({"BLOCK_N": (64, 128), "splits": (1, 4, 16), "num_warps": (4,), "num_stages": (2,)},
                T["decode"].heuristic, T["decode"].constraints)
cache = os.path.join(out, "tune_h200_smoke_cache.json")
rows = []
t0 = time.time()
p = compile_file("examples/causal.attn")
r = tune.tune(p, tune.parse_shapes("4:4096:4096"), "triton", cache=cache, space=sp, warmup=10, repeats=30)
rows += r[0].rows
q = compile_file("examples/causal_document_gqa.attn")
r2 = tune.tune(q, tune.parse_shapes("8:1:8192"), "triton", cache=cache, space=sd, warmup=10, repeats=30)
rows += r2[0].rows
print(f"tuned in {time.time() - t0:.1f} s", flush=True)
for x in rows:
    ev.check_row(x)
with open(os.path.join(out, "tune_h200_smoke.jsonl"), "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in rows)
print("hook prefill", tune.tuned_tiles(p, 4, 4096, 4096, "triton", cache=cache))
print("hook decode", tune.tuned_tiles(q, 8, 1, 8192, "triton", cache=cache))
for res in (r[0], r2[0]):
    e = res.entry
    print(res.shape, "winner", e["config"], e["median_ms"], "untuned", e["untuned"], "speedup", e["speedup_vs_untuned"])
