"""Where a call's host time goes (GPU): cProfile of back-to-back public calls, and the launch
counters (JIT vs direct launches).  A study script: python3 bench/host_profile.py"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import attnc  # noqa: E402
from attnc.backends.triton import launch as L  # noqa: E402


def per_call_us(fn, n=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def profile(label, fn, n=300):
    print(f"== {label}: {per_call_us(fn):.1f} us/call host", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(24)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


def launch_only(label, last: list, n=300):
    """Host time of the last launch replayed alone through ``Launcher.launch`` with the same
    arguments (descriptors already built): ``last`` holds (launcher, grid, args, key, stream)."""
    if not last:
        return
    launcher, grid, args, key, stream = last[-1]
    print(f"== {label}: Launcher.launch {per_call_us(lambda: launcher.launch(grid, args, key, stream), n):.1f} "
          "us/call host", flush=True)


def main():
    counts = {}
    orig = L.Launcher.launch

    last = []

    def counted(self, grid, args, key=None, stream=None):
        last[:] = [(self, grid, args, key, stream)]
        orig(self, grid, args, key, stream)
        counts[self.fn.__name__ if hasattr(self.fn, "__name__") else str(self.fn)] = dict(self.launches)
    L.Launcher.launch = counted
    attn = attnc.compile("attention c { dtype = bf16 mask = causal }")
    q, k, v = (torch.randn(1, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    profile("prefill B=1 S=2048 causal attn(q, k, v)", lambda: attn(q, k, v))
    launch_only("prefill B=1 S=2048 causal: its launch alone", last)
    outs = []
    profile("prefill B=1 S=2048 causal attn(q, k, v), outputs kept", lambda: outs.append(attn(q, k, v)), n=200)
    outs.clear()
    kern = attn.kernel("triton", attn.specialize(16, 16, 128, 128, "bf16"))
    run = kern.prepare(q, k, v)
    profile("prefill prepared run()", run)
    print("launches", counts, flush=True)
    L.Launcher.launch = orig
    # a bare launch: the time of Launcher.launch with its arguments built
    from attnc.bench.harness import decode_case
    dattn = attnc.compile("attention d { dtype = bf16 mask = causal cache = paged(page_size = 16, layout = nhd) }")
    g = torch.Generator(device="cuda").manual_seed(0)
    qd, _, _, kc, vc, table, lens = decode_case(8, 8192, 32, 8, 128, 16, g)
    cache = {"k_cache": kc, "v_cache": vc, "block_table": table, "kv_lens": lens}
    dk = dattn.kernel("triton", dattn.specialize(32, 8, 128, 128, "bf16"))
    plan = dk.decode_plan(cache)
    drun = dk.prepare_decode(qd, plan, **cache)
    L.Launcher.launch = counted
    profile("decode B=8 T=8K prepared run()", drun)
    profile("decode B=8 T=8K attn.decode(q, **cache)", lambda: dattn.decode(qd, **cache), n=50)
    print("launches", counts, flush=True)


if __name__ == "__main__":
    main()
