"""Study: is short decode CPU-bound?  GQA 32/8 paged decode (bench.run_decode's case), each
config timed four ways: triton do_bench (CUDA events around each call, as the bench does), the
host time of one launch (perf_counter over 200 calls without synchronizing), back-to-back
calls (200 queued, one event pair: GPU-bound if the queue stays ahead), and one CUDA-graph
replay (pure GPU time).

    python bench/exp_decode_launch.py [--out FILE] [--batch 8] [--seq 8192]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    import triton
    from attnc.backends.triton import bench, runtime
    from attnc.backends.triton.graph import capture
    from attnc.compiler.lower import compile_spec

    batch, t_len, hq, hkv, d, page = args.batch, args.seq, 32, 8, 128, 16
    kernel = runtime.load(compile_spec(bench.decode_spec(hq, hkv, d, page)))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, k_cache, v_cache, table, kv_lens = bench.decode_case(batch, t_len, hq, hkv, d, page, g)
    kv_bytes = 2 * batch * t_len * hkv * d * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q4 = q[:, :, None]
    fns = {}
    for block_n, stages in ((64, 2), (64, 3), (128, 2)):
        plan = kernel.decode_plan({"k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_lens": kv_lens},
                                  block_n=block_n, num_sms=sms)
        launch = kernel.decode_args(plan, "cuda")
        fns[f"attnc bn{block_n} s{stages} splits{plan['splits']}"] = (
            lambda launch=launch, stages=stages: kernel.module.decode(q, k_cache, v_cache, launch, num_warps=4,
                                                                      num_stages=stages))
    fns["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for rnd in range(args.rounds):
        for name, fn in fns.items():
            bench = float(np.median(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(200):
                fn()
            e1.record()
            torch.cuda.synchronize()
            queued_us = e0.elapsed_time(e1) / 200 * 1e3
            graph, _ = capture(fn)
            graph_ms = float(np.median(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="all")))
            row = {"study": "decode_launch", "B": batch, "T": t_len, "impl": name, "round": rnd,
                   "do_bench_us": bench * 1e3, "host_us_per_call": host_us, "queued_us_per_call": queued_us,
                   "graph_us": graph_ms * 1e3, "TBps_do_bench": kv_bytes / bench / 1e9,
                   "TBps_graph": kv_bytes / graph_ms / 1e9, "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__}
            print(f"B={batch} T={t_len} {name:30} do_bench {bench * 1e3:6.1f} us  host {host_us:6.1f} us/call  "
                  f"queued {queued_us:6.1f} us/call  graph {graph_ms * 1e3:6.1f} us  "
                  f"({kv_bytes / bench / 1e9:.2f} / {kv_bytes / graph_ms / 1e9:.2f} TB/s)", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
