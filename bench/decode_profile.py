"""Where a decode call's host time goes (GPU): cProfile of back-to-back ``attn.decode`` calls.
A study script: python3 bench/decode_profile.py"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import attnc  # noqa: E402
from attnc.bench.harness import decode_case  # noqa: E402


def main():
    attn = attnc.compile("attention d { dtype = bf16 mask = causal cache = paged(page_size = 16, layout = nhd) }")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, _, _, kc, vc, table, lens = decode_case(8, 8192, 32, 8, 128, 16, g)
    cache = {"k_cache": kc, "v_cache": vc, "block_table": table, "kv_lens": lens}
    kern = attn.kernel("triton", attn.specialize(32, 8, 128, 128, "bf16"))
    for _ in range(20):
        attn.decode(q, **cache)
    torch.cuda.synchronize()
    for label, fn in (("attn.decode", lambda: attn.decode(q, **cache)),
                      ("decode_plan", lambda: kern.decode_plan(cache)),
                      ("decode_args", lambda p=kern.decode_plan(cache): kern.decode_args(p, "cuda"))):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        print(f"== {label}: {(time.perf_counter() - t0) * 1e4:.1f} us/call", flush=True)
        torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        attn.decode(q, **cache)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
