"""Study: FP8 (e4m3) against bf16 through the public call, causal and full, B4 H16 d128 bf16 O.

For each case: the bf16 call ``attn(q, k, v)``; the FP8 call on inputs quantized once outside the
timed call (``attnc.fp8.quantize``, V stored transposed); and the FP8 call given a plain
contiguous V8 (the call copies it to V^T each time).  Each output is checked first: rel-L2 against
a float32 reference of the original (unquantized) values on two (b, h) planes.  One JSON line per
row: median ms, visible-cell TFLOP/s, host us per call, FP8 over bf16.

    python -m bench.fp8_study [--seq 8192,8000] > study.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="8192,8000")
    ap.add_argument("--masks", default="causal,full")
    ap.add_argument("--head-dims", default="128")
    args = ap.parse_args(argv)
    import torch
    import triton.testing
    import attnc
    from .harness import host_us
    b, h = 4, 16
    for d in map(int, args.head_dims.split(",")):
        for s in map(int, args.seq.split(",")):
            for mask in args.masks.split(","):
                attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d} dtype = bf16 "
                                     f"mask = {'causal' if mask == 'causal' else 'true'} }}")
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                planes = [(0, 0), (b - 1, h - 1)]
                refs = []
                for pb, ph in planes:
                    sc = q[pb, ph].float() @ k[pb, ph].float().T / math.sqrt(d)
                    if mask == "causal":
                        sc = sc.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
                    refs.append(torch.softmax(sc, -1) @ v[pb, ph].float())

                def err(o):
                    num = sum(((o[pb, ph].float() - r) ** 2).sum() for (pb, ph), r in zip(planes, refs))
                    return float((num / sum((r ** 2).sum() for r in refs)).sqrt())
                (q8, dq), (k8, dk), (v8, dv) = (attnc.fp8.quantize(q), attnc.fp8.quantize(k),
                                                attnc.fp8.quantize(v, transposed=True))
                v8c = v8.contiguous()
                desc = dict(q_descale=dq, k_descale=dk, v_descale=dv)
                cells = b * h * (s * (s + 1) / 2 if mask == "causal" else s * s)
                calls = {"bf16": lambda: attn(q, k, v), "fp8": lambda: attn(q8, k8, v8, **desc),
                         "fp8_plain_v": lambda: attn(q8, k8, v8c, **desc)}
                base = None
                for impl, fn in calls.items():
                    try:
                        e = err(fn())
                    except Exception as ex:  # noqa: BLE001 - a study records what failed and goes on
                        print(json.dumps({"study": "fp8", "impl": impl, "mask": mask, "S": s, "D": d,
                                          "error": f"{type(ex).__name__}: {str(ex)[:400]}"}), flush=True)
                        continue
                    samples = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="all")
                    ms = sorted(samples)[len(samples) // 2]
                    tf = 4 * d * cells / ms / 1e9
                    base = tf if impl == "bf16" else base
                    print(json.dumps({"study": "fp8", "impl": impl, "mask": mask, "B": b, "H": h, "S": s, "D": d,
                                      "rel_l2_vs_f32_of_unquantized": e, "median_ms": ms, "tflops": tf,
                                      "host_us": host_us(fn), "x_bf16": tf / base if base else None,
                                      "samples_ms": samples}), flush=True)
                del q, k, v, q8, k8, v8, v8c
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
