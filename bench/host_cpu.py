"""Python host time of the public call on the CPU, kernel launches stubbed (issue 34): microseconds
per call of prefill (closed-form mask, tensor mask: plan reused) and decode (contiguous, paged),
measured in one process, cases interleaved.  A study script:
TRITON_INTERPRET=1 python3 bench/host_cpu.py [--profile CASE] [--calls N]"""
import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import attnc  # noqa: E402
from attnc.backends.triton import launch as L  # noqa: E402


def cases():
    """name -> a call (after one warm call: its plan made, its launch bound)."""
    g = torch.Generator().manual_seed(0)
    dt = torch.float16
    out = {}
    causal = attnc.compile("attention c { dtype = f16 mask = causal }")
    q, k, v = (torch.randn(1, 4, 64, 64, generator=g, dtype=dt) for _ in range(3))
    out["prefill causal"] = lambda: causal(q, k, v, backend="triton")
    docs = attnc.compile("attention d { dtype = f16 tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }")
    doc = torch.zeros(1, 64, dtype=torch.int32)
    doc[:, 32:] = 1
    out["prefill doc mask"] = lambda: docs(q, k, v, doc=doc, backend="triton")
    b, hq, hkv, d, t, page = 4, 8, 2, 64, 128, 16
    dec = attnc.compile("attention e { dtype = f16 mask = causal }")
    qd = torch.randn(b, hq, d, generator=g, dtype=dt)
    kc, vc = (torch.randn(b, hkv, t, d, generator=g, dtype=dt) for _ in range(2))
    lens = torch.full((b,), t, dtype=torch.int32)
    out["decode contiguous"] = lambda: dec.decode(qd, k=kc, v=vc, kv_lens=lens)
    paged = attnc.compile(f"attention p {{ dtype = f16 mask = causal cache = paged(page_size = {page}, layout = nhd) }}")
    pages = b * t // page
    kp, vp = (torch.randn(pages, page, hkv, d, generator=g, dtype=dt) for _ in range(2))
    table = torch.randperm(pages, generator=g).view(b, t // page).to(torch.int32)
    out["decode paged"] = lambda: paged.decode(qd, k_cache=kp, v_cache=vp, block_table=table, kv_lens=lens)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--profile", default=None, help="a case name to cProfile")
    a = ap.parse_args()
    launches = [0]

    def stub(self, grid, args, key=None, stream=None):
        launches[0] += 1
    L.Launcher.launch = stub  # no kernel runs: the Python path alone
    # the stubbed launches leave LSE unwritten: the host check of CPU rows (numerics.check_rows; a GPU
    # call marks its rows on the device instead, Kernel._mark_rows, timed on the GPU) is left out
    from attnc.compiler import numerics
    numerics.check_rows = lambda *a, **k: None
    # split calls on CPU tensors default to the numpy backend; the study times the Triton path
    import attnc.compiler.dispatch as D
    D.device_default = lambda device: "triton"
    calls = cases()
    for fn in calls.values():
        fn()
        fn()
    if a.profile:
        fn = calls[a.profile]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            fn()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        return
    best = {n: float("inf") for n in calls}
    for _ in range(a.rounds):  # cases interleaved: the machine's load hits each alike
        for n, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            best[n] = min(best[n], (time.perf_counter() - t0) / a.calls * 1e6)
    for n, us in best.items():
        print(f"{n:20s} {us:7.1f} us/call (best of {a.rounds} x {a.calls})")


if __name__ == "__main__":
    main()
