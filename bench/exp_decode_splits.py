"""Study: the untuned decode launch.  GQA 32/8, d = 128, bf16, paged (page 16, shuffled pages;
``bench.decode_case``), every config replayed from a CUDA graph (GPU time only: the host cost of
a call is plan_decode_cost.py's), configs timed in turns for ``--rounds`` rounds, each checked
against a float32 reference first.  The configs: split counts around
``backends.triton.decode.default_decode_config``'s rule at block_n 64 / 4 warps / 2 stages,
the rule's splits at 3 stages, and block_n 128 at half the rule's splits.

    python bench/exp_decode_splits.py [--out FILE] [--rounds 2] [--cases 8:8192,32:8192,1:131072,64:2048]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NEIGHBOURS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # split counts tried, as multiples of the rule's


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="8:8192,32:8192,1:131072,64:2048")
    args = ap.parse_args(argv)
    import torch
    import triton
    from attnc.backends.triton import bench, runtime
    from attnc.backends.triton.decode import default_decode_config
    from attnc.backends.triton.graph import capture
    from attnc.compiler.lower import compile_spec

    hq, hkv, d, page = 32, 8, 128, 16
    program = compile_spec(bench.decode_spec(hq, hkv, d, page))
    kernel = runtime.load(program)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    out = open(args.out, "a") if args.out else None
    for case in args.cases.split(","):
        batch, t_len = map(int, case.split(":"))
        q, k, v, k_cache, v_cache, table, kv_lens = bench.decode_case(batch, t_len, hq, hkv, d, page, g)
        kf = k.float().repeat_interleave(hq // hkv, 1)
        vf = v.float().repeat_interleave(hq // hkv, 1)
        ref = (torch.softmax((q.float()[:, :, None] @ kf.transpose(-1, -2)) / math.sqrt(d), -1) @ vf)[:, :, 0]
        del kf, vf
        kv_bytes = 2 * batch * t_len * hkv * d * 2
        cache = {"k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_lens": kv_lens}
        rule = default_decode_config(program, [t_len] * batch, [1] * batch, sms)
        most = -(-t_len // 64)
        splits = sorted({max(1, min(most, 128, round(rule["splits"] * f))) for f in NEIGHBOURS}
                        | {max(1, min(most, -(-2 * sms // (batch * hkv))))})  # and the old two-wave rule
        configs = [(64, s, 4, 2) for s in splits] + [(64, rule["splits"], 4, 3),
                                                     (128, max(1, rule["splits"] // 2), 4, 2)]
        graphs = {}
        for block_n, s, warps, stages in configs:
            plan = kernel.decode_plan(cache, block_n=block_n, splits=s, num_sms=sms)
            launch = kernel.decode_args(plan, "cuda")
            fn = (lambda launch=launch, warps=warps, stages=stages, q=q, kc=k_cache, vc=v_cache:
                  kernel.module.decode(q, kc, vc, launch, num_warps=warps, num_stages=stages))
            o, _ = fn()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            graph, _ = capture(fn)
            graphs[(block_n, s, warps, stages)] = (graph, err)
        for rnd in range(args.rounds):
            for (block_n, s, warps, stages), (graph, err) in graphs.items():
                ms = float(np.median(triton.testing.do_bench(graph.replay, warmup=25, rep=150, return_mode="all")))
                row = {"study": "decode_splits", "B": batch, "T": t_len, "H_q": hq, "H_kv": hkv, "D": d,
                       "page_size": page, "round": rnd, "config": {"BLOCK_N": block_n, "splits": s,
                                                                   "num_warps": warps, "num_stages": stages},
                       "rule": s == rule["splits"] and block_n == 64 and stages == 2, "programs": s * batch * hkv,
                       "graph_us": ms * 1e3, "TBps": kv_bytes / ms / 1e9, "rel_l2_error": err,
                       "pass": err < 1e-2, "gpu": torch.cuda.get_device_name(), "sms": sms,
                       "torch": torch.__version__, "triton": triton.__version__}
                print(f"B={batch:3} T={t_len:6} bn={block_n:3} splits={s:3} w{warps} s{stages} "
                      f"{'rule' if row['rule'] else '    '} {ms * 1e3:7.1f} us  {row['TBps']:.2f} TB/s  "
                      f"err {err:.1e}", flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
        del graphs, q, k, v, k_cache, v_cache, table, kv_lens, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
