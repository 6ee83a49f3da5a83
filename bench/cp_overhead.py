"""The one-rank cost of context parallelism (issue 19): ``attnc.distributed``'s call with a
one-rank plan against the plain call ``attn(q, k, v, **tensors)``, causal and documents, B=1..4,
H=16, S=8192, d=128, bf16.  The outputs are checked to be equal first; then both are timed in
turns (rounds), as GPU time per call over back-to-back calls (CUDA events) and as host time per
call.  One JSON line per (mask, B); the goal is a ratio of at most 1.05.

    python3 bench/cp_overhead.py --out bench/results/studies/cp_overhead_h200.jsonl     # on the GPU

``--device cpu`` runs the same on the numpy backend (small shapes: ``--seq 64 --heads 2
--head-dim 16``), which is how CI runs this script.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__ and str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from attnc.bench.harness import PREFILL_MASKS, spec_text  # noqa: E402

MASKS = ("causal", "causal_document")
GOAL = 1.05


def _per_call_ms(fn, device: str, calls: int) -> float:
    """Time per call over ``calls`` back-to-back calls, the device synchronized around them."""
    import torch
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def _host_us(fn, device: str, calls: int) -> float:
    """Host time per call (the device kept busy behind the calls)."""
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def measure(mask: str, batch: int, *, heads: int, seq: int, head_dim: int, device: str, rounds: int, calls: int,
            seed: int = 0) -> dict:
    import torch
    import attnc
    import attnc.distributed as cpd
    from attnc.compiler import inputs

    text, decls = PREFILL_MASKS[mask]
    attn = attnc.compile(spec_text(mask, text, decls))
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    tensors = {}
    program = attn.specialize(heads, heads, head_dim, head_dim, "bf16")
    if program.tensors:
        sample = inputs.sample(program, batch, seq, seq, seed)
        tensors = {t.name: torch.as_tensor(sample[t.name].astype(np.int32), device=device) for t in program.tensors}
    cp = cpd.ContextParallel(attn)
    plan = cp.plan(batch=batch, seq_len=seq, heads=heads, head_dim=head_dim, dtype=dtype, **tensors)
    assert plan.ranks == 1, "run this script as one process"
    with torch.no_grad():
        plain = lambda: attn(q, k, v, **tensors)  # noqa: E731
        one_rank = lambda: cp(q, k, v, plan=plan)  # noqa: E731
        o_plain, o_cp = plain(), one_rank()
        equal = bool(torch.equal(o_plain, o_cp))
        if not equal:
            raise SystemExit(f"{mask} B={batch}: the one-rank call's O differs from the plain call's "
                             f"(max |diff| {(o_plain.float() - o_cp.float()).abs().max().item():.3e})")
        samples = {"plain": [], "cp": []}
        host = {"plain": [], "cp": []}
        for name, fn in (("plain", plain), ("cp", one_rank)):  # warm both
            _per_call_ms(fn, device, max(2, calls // 4))
        for _ in range(rounds):
            for name, fn in (("plain", plain), ("cp", one_rank)):
                samples[name].append(_per_call_ms(fn, device, calls))
                host[name].append(_host_us(fn, device, calls))
    med = {n: statistics.median(s) for n, s in samples.items()}
    host_med = {n: statistics.median(s) for n, s in host.items()}
    return {"bench": "cp_overhead", "mask": mask, "B": batch, "H": heads, "S": seq, "D": head_dim, "dtype": "bf16",
            "device": device, "outputs_equal": equal, "ms_plain": med["plain"], "ms_cp": med["cp"],
            "ratio": med["cp"] / med["plain"], "host_us_plain": host_med["plain"], "host_us_cp": host_med["cp"],
            "samples_ms": samples, "host_us_samples": host, "rounds": rounds, "calls_per_sample": calls,
            "goal_ratio": GOAL}


def environment(device: str) -> dict:
    import platform
    import torch
    import attnc
    env = {"torch": torch.__version__, "python": platform.python_version(), "attnc": attnc.__version__}
    if device == "cuda":
        import triton
        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="FILE.jsonl", help="append one JSON line per (mask, B)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--batches", default="1,2,3,4")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7, help="turns of (plain, one-rank) samples")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU (--device cpu runs the numpy backend)")
    masks = [m for m in args.masks.split(",") if m]
    unknown = [m for m in masks if m not in PREFILL_MASKS]
    if unknown:
        ap.error(f"unknown mask {unknown[0]!r}; expected one of {', '.join(PREFILL_MASKS)}")
    with tempfile.TemporaryDirectory() as tmp:  # a one-process group, as `torchrun --nproc-per-node 1` makes
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            env = environment(args.device)
            worst = 0.0
            for mask in masks:
                for batch in (int(b) for b in args.batches.split(",")):
                    row = {**measure(mask, batch, heads=args.heads, seq=args.seq, head_dim=args.head_dim,
                                     device=args.device, rounds=args.rounds, calls=args.calls), "environment": env}
                    worst = max(worst, row["ratio"])
                    print(f"{mask:<16} B={batch} plain {row['ms_plain']:.4f} ms, one rank {row['ms_cp']:.4f} ms: "
                          f"x{row['ratio']:.4f} (host {row['host_us_plain']:.1f} / {row['host_us_cp']:.1f} us)",
                          flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
            print(f"worst ratio {worst:.4f} (goal <= {GOAL})")
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
