"""FlashDecoding++'s guarded shared shift (M4.5 §0x09C) against the synchronized (m, l, u) path,
on decode over a paged bf16 cache (GQA 32/8, d = 128, page 16, shuffled page ids).

Three specs, the same mask (causal) and the same plan (splits, tiles: the default config):

  sync      ``state = mlu``: each split keeps its running max; the combine takes the max over the
            splits and rescales each (one exponential per split)
  shift     ``state = shared_shift(0, -20, 20)``: one frame exp(s - 0) for every split, the combine
            adds; the guard holds on these scores (|s| < 6), so the two gated fallback launches
            exit at once
  fallback  ``state = shared_shift(60, -20, 20)``: every score is 60 below phi, every split trips
            its guard and every output is recomputed by the (m, l, u) launches

For each case and variant: the output is checked against a float32 softmax on the GPU (relative
L2 < 1e-2) and the outputs the guard sent to the fallback are counted (they must be none for
``shift``, all for ``fallback``); then the call captured in a CUDA graph (``Kernel.decode_graph``)
is timed with ``triton.testing.do_bench`` (raw samples kept), and a profiled loop of the bound
call (``Kernel.prepare_decode``) gives every kernel's device time.  One ``summary`` row per
case: the combine time the shared frame saves, the producer time it saves, what the two gated
launches cost when nothing trips, and what a full fallback costs.

    python3 bench/shared_shift.py --out bench/results/shared_shift_h200.jsonl

``--smoke`` runs one tiny case in Triton's CPU interpreter (checks only, no timing): the test
suite runs it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ((8, 8192), (32, 8192), (1, 131072))
VARIANTS = {"sync": "mlu", "shift": "shared_shift(0.0, -20.0, 20.0)", "fallback": "shared_shift(60.0, -20.0, 20.0)"}
KERNELS = ("_decode_split", "_combine", "_shift_split", "_shift_combine", "_fallback_split", "_fallback_combine")


def spec(variant: str, page_size: int, dtype: str = "bf16") -> str:
    return (f"attention shift_bench_{variant} {{ dtype = {dtype} mask = causal "
            f"cache = paged(page_size = {page_size}, layout = nhd) state = {VARIANTS[variant]} }}")


def paged_case(batch, t_len, heads_q, heads_kv, head_dim, page_size, device, generator, dtype="bf16"):
    """q [B, H_q, d]; K/V [B, H_kv, T, d] and the same rows in a paged nhd cache, shuffled pages."""
    import torch
    g, dt = generator, {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    q = torch.randn(batch, heads_q, head_dim, device=device, generator=g).to(dt)
    k = torch.randn(batch, heads_kv, t_len, head_dim, device=device, generator=g).to(dt)
    v = torch.randn(batch, heads_kv, t_len, head_dim, device=device, generator=g).to(dt)
    pages = batch * t_len // page_size
    perm = torch.randperm(pages, device=device, generator=g)
    k_cache = torch.empty(pages, page_size, heads_kv, head_dim, device=device, dtype=dt)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.permute(0, 2, 1, 3).reshape(pages, page_size, heads_kv, head_dim)
    v_cache[perm] = v.permute(0, 2, 1, 3).reshape(pages, page_size, heads_kv, head_dim)
    cache = {"k_cache": k_cache, "v_cache": v_cache, "block_table": perm.view(batch, -1).to(torch.int32).cpu(),
             "kv_lens": torch.full((batch,), t_len, dtype=torch.int32)}
    return q, k, v, cache


def reference(q, k, v):
    """float32 softmax(q k^T / sqrt(d)) v, GQA by repetition: [B, H_q, d]."""
    import torch
    group = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(group, 1) for x in (k, v))
    s = (q.float()[:, :, None] @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, -1) @ vf)[:, :, 0]


def fallback_outputs(kernel, graph) -> int | None:
    """(row, head) outputs the last replay recomputed: the shift workspace's ``need`` bytes."""
    from attnc.backends.triton.shift import ShiftLaunch
    launch = kernel.split_launch(graph._warps, graph._stages)
    if not isinstance(launch, ShiftLaunch):
        return None
    return int(launch.fields(graph.workspace, graph.plan["total_q"], graph.plan["splits"])["need"].sum())


def kernel_times(run, reps: int) -> dict:
    """Device time per kernel (us per call) over ``reps`` calls of ``run``, by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        names = [k for k in KERNELS if k in e.key]  # the longest: "_combine" is in "_shift_combine" too
        if names:
            name = max(names, key=len)
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            out[name] = out.get(name, 0.0) + total / reps
    return out


def run(cases, heads_q=32, heads_kv=8, head_dim=128, page_size=16, out=None, smoke=False, command=""):
    import torch
    import attnc
    device = "cpu" if smoke else "cuda"
    dtype = "f32" if smoke else "bf16"  # (the interpreter has no bf16 loads)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []

    def emit(row):
        row = {"command": command, **row}
        rows.append(row)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
        shown = {k: v for k, v in row.items() if k not in ("samples_ms", "command", "env")}
        print(json.dumps(shown), flush=True)

    env = {} if smoke else {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "attnc": attnc.__version__}
    for batch, t_len in cases:
        q, k, v, cache = paged_case(batch, t_len, heads_q, heads_kv, head_dim, page_size, device, g, dtype)
        ref = reference(q, k, v)
        del k, v
        kv_bytes = 2 * batch * t_len * heads_kv * head_dim * 2
        record = {"bench": "shared_shift", "B": batch, "T": t_len, "H_q": heads_q, "H_kv": heads_kv, "D": head_dim,
                  "dtype": dtype, "page_size": page_size, "kv_bytes": kv_bytes, "env": env,
                  "reference": "float32 softmax on the device", "tolerance_rel_l2": 1e-2}
        measured = {}
        for variant in VARIANTS:
            attn = attnc.compile(spec(variant, page_size, dtype))
            kernel = attn.kernel("triton", attn.specialize(heads_q, heads_kv, head_dim, head_dim, dtype))
            plan = kernel.decode_plan(cache)
            graph = kernel.decode_graph(q, **cache, capture=not smoke)
            o, _ = graph(q)
            err = float((o.float() - ref).norm() / ref.norm())
            recomputed = fallback_outputs(kernel, graph)
            row = {**record, "variant": variant, "state": VARIANTS[variant], "rel_l2_error": err, "pass": err < 1e-2,
                   "fallback_outputs": recomputed, "outputs": batch * heads_q,
                   "config": {n: plan[n] for n in ("block_n", "splits", "block_q", "num_warps", "num_stages")}}
            want = {"sync": None, "shift": 0, "fallback": batch * heads_q}[variant]
            if recomputed != want:
                row.update({"pass": False, "error": f"expected {want} recomputed outputs, got {recomputed}"})
            if row["pass"] and not smoke:
                import triton
                samples = triton.testing.do_bench(lambda: graph(q), warmup=50, rep=300, return_mode="all")
                med = float(sorted(samples)[len(samples) // 2])
                bound = kernel.prepare_decode(q, plan, **cache)
                row.update(median_ms=med, TBps=kv_bytes / med / 1e9, samples_ms=samples,
                           kernels_us=kernel_times(bound, 50))
            measured[variant] = row
            emit(row)
            del graph
        if not smoke and all(r.get("pass") for r in measured.values()):
            ks = {n: r["kernels_us"] for n, r in measured.items()}
            emit({**record, "variant": "summary",
                  "combine_saved_us": ks["sync"].get("_combine", 0.0) - ks["shift"].get("_shift_combine", 0.0),
                  "producer_saved_us": ks["sync"].get("_decode_split", 0.0) - ks["shift"].get("_shift_split", 0.0),
                  "gated_fallback_idle_us": ks["shift"].get("_fallback_split", 0.0)
                  + ks["shift"].get("_fallback_combine", 0.0),
                  "call_shift_minus_sync_us": (measured["shift"]["median_ms"] - measured["sync"]["median_ms"]) * 1e3,
                  "fallback_cost_us": (measured["fallback"]["median_ms"] - measured["shift"]["median_ms"]) * 1e3})
        del q, cache
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--cases", default=",".join(f"{b}:{t}" for b, t in CASES), help="B:T,... (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="one tiny case in the CPU interpreter, checks only")
    args = ap.parse_args(argv)
    if args.smoke:
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = run([(2, 40)], heads_q=4, heads_kv=2, head_dim=16, page_size=8, out=args.out, smoke=True,
                   command="bench/shared_shift.py --smoke")
    else:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
        rows = run(cases, out=args.out, command=" ".join(["python3", "bench/shared_shift.py", *(argv or sys.argv[1:])]))
    bad = [r for r in rows if r.get("pass") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
