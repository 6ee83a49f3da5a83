"""Study: what the fast score functions buy (``score_program_fast``: positions converted on the
row and key vectors, compiler/fast_score.py) against the exact ones, on the Gluon engine, kernel
alone (``Kernel.prepare``): plain causal, ALiBi and softcap 30, B4 H16 S8192 d128 bf16.  The exact
form is forced by setting ``launch.FAST_POSITIONS`` to 0 before the launch is made.

    python -m bench.score_forms_study > study.jsonl
"""
from __future__ import annotations

import json
import sys

SCORES = {"causal": "", "alibi": "score = score - exp(-(h + 1) * log(2.0) * 8.0 / 16.0) * (q - k)",
          "softcap30": "score = softcap(score, 30.0)"}


def main() -> int:
    import torch
    import triton.testing
    import attnc
    from attnc.backends.triton import launch
    limit = launch.FAST_POSITIONS
    b, h, s, d = 4, 16, 8192, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cells = b * h * s * (s + 1) / 2
    for name, score in SCORES.items():
        attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d} dtype = bf16 {score} mask = causal }}")
        kernel = attn.kernel("triton", attn.program)
        first = None
        for form, end in (("fast", limit), ("exact", 0)):
            launch.FAST_POSITIONS = end
            run = kernel.prepare(q, k, v)
            o = run()[0]
            first = o if first is None else first
            ms = triton.testing.do_bench(run, warmup=50, rep=300)
            print(json.dumps({"study": "score_forms", "score": name, "form": form, "B": b, "H": h, "S": s, "D": d,
                              "ms": ms, "tflops": 4 * d * cells / ms / 1e9, "config": run.config.describe(),
                              "max_diff_vs_fast": float((o.float() - first.float()).abs().max())}), flush=True)
        launch.FAST_POSITIONS = limit
    return 0


if __name__ == "__main__":
    sys.exit(main())
