"""Study: host time of the public call with and without the raw launch (``launch._raw_launch``), in
one process: attn(q, k, v) at B=1, H=16, S=2048, d=128, bf16 causal, 500 back-to-back calls (best
of 5 per round), the key's ``Launcher.raw`` entry removed (direct: the compiled kernel's ``run``,
with Triton's descriptor wrapper and launch metadata) or restored, three rounds.  Checks first that
the second call (raw) and a call on moved inputs give the first call's O bit for bit.

    python3 -m bench.raw_launch_ab > rows.jsonl
"""
import json
import time


def per_call_us(fn, n=500, repeats=5) -> float:
    import torch
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / n * 1e6)
    return best


def main() -> int:
    import torch

    import attnc
    from attnc.backends.triton import launch as L
    made = []
    init = L.PrefillLaunch.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    L.PrefillLaunch.__init__ = spy
    attn = attnc.compile("attention c { heads = 16 head_dim = 128 dtype = bf16 mask = causal }")
    q, k, v = (torch.randn(1, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = attn(q, k, v).clone()
    launcher = made[-1].launcher
    again = attn(q, k, v)
    moved = attn(q.clone(), k.clone(), v.clone())
    if not (launcher.launches["raw"] == 2 and torch.equal(first, again) and torch.equal(first, moved)):
        raise SystemExit(f"the raw launch did not run or changed O: {launcher.launches}")
    saved = dict(launcher.raw)
    for r in range(3):
        launcher.raw.clear()
        direct = per_call_us(lambda: attn(q, k, v))
        launcher.raw.update(saved)
        raw = per_call_us(lambda: attn(q, k, v))
        print(json.dumps({"study": "raw_launch_host_ab", "round": r, "direct_host_us": direct, "raw_host_us": raw,
                          "launches": dict(launcher.launches)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
