"""Study: the Gluon engine against the Triton kernel on head dims the engine newly takes
(192 / 128 as in MLA prefill, 256, and 64 with 32 heads), causal, bf16, through the public call
with ``engine=`` forced (a study: the user's untuned call takes the Gluon engine); and what a
score program costs on the engine: plain causal, ALiBi (per-head slope times distance) and
softcap 30 at B4 H16 S8192 d128.  Prints one
JSON line per (case, engine): median ms and visible-cell TFLOP/s (4 * d_qk-or-d_v-weighted
cells: 2 * d_qk + 2 * d_v FLOPs per visible cell).

    python -m bench.head_dims_study > study.jsonl
"""
from __future__ import annotations

import json
import sys

CASES = [(2, 16, 8192, 192, 128, ""), (2, 16, 8192, 256, 256, ""), (4, 32, 8192, 64, 64, ""),
         (4, 16, 8192, 128, 128, ""), (4, 16, 8192, 128, 128, "score = score - exp(-(h + 1) * log(2.0) / 2.0) * (q - k)"),
         (4, 16, 8192, 128, 128, "score = softcap(score, 30.0)")]


def main() -> int:
    import torch
    import triton.testing
    import attnc
    for b, h, s, d_qk, d_v, score in CASES:
        attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d_qk} / {d_v} dtype = bf16 {score} "
                             "mask = causal }")
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, s, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, h, s, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, h, s, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
        kernel = attn.kernel("triton", attn.program)
        ref = kernel(q, k, v, engine="triton")
        cells = b * h * s * (s + 1) / 2
        for engine in ("gluon", "triton"):
            try:
                o = kernel(q, k, v, engine=engine)
            except Exception as e:  # noqa: BLE001 - a study records what failed and goes on
                print(json.dumps({"study": "head_dims", "d_qk": d_qk, "d_v": d_v, "engine": engine,
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                continue
            err = float((o.float() - ref.float()).abs().max())
            run = kernel.prepare(q, k, v, engine=engine)  # bound once: a call with options is planned each time
            ms = triton.testing.do_bench(run, warmup=50, rep=300)
            print(json.dumps({"study": "head_dims", "B": b, "H": h, "S": s, "d_qk": d_qk, "d_v": d_v, "score": score,
                              "engine": engine, "ms": ms, "tflops": 2 * (d_qk + d_v) * cells / ms / 1e9,
                              "max_err_vs_triton": err,
                              "config": run.config.describe()}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
