"""Study: host time of the public call with and without the raw launch (``raw_launch.raw_launch``), in
one process: attn(q, k, v) at B=1, H=16, S=2048, d=128, bf16 causal, 500 back-to-back calls (best
of 5 per round), the launchers' ``Launcher.raw`` entries removed (direct: the compiled kernel's
``run``, with Triton's descriptor wrapper and launch metadata) or restored, three rounds; then the
same for decode through ``attn.decode`` (B=8, T=8K, GQA 32/8, paged: the split producer and the
combine).  Checks first that the second call (raw) and a call on moved inputs give the first
call's O bit for bit.

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
    _ab("prefill B1 H16 S2048 d128 causal", lambda: attn(q, k, v))
    from .harness import decode_case
    dattn = attnc.compile("attention d { heads = 32 / 8 head_dim = 128 dtype = bf16 mask = causal "
                          "cache = paged(page_size = 16, layout = nhd) }")
    g = torch.Generator(device="cuda").manual_seed(0)
    qd, _, _, kc, vc, table, lens = decode_case(8, 8192, 32, 8, 128, 16, g)
    cache = {"k_cache": kc, "v_cache": vc, "block_table": table, "kv_lens": lens}
    first = dattn.decode(qd, **cache).clone()
    if not torch.equal(first, dattn.decode(qd, **cache)):
        raise SystemExit("the raw launch changed the decode output")
    _ab("decode B8 T8K GQA 32/8 d128 page 16 (split + combine)", lambda: dattn.decode(qd, **cache))
    return 0


def _ab(call: str, fn, rounds=3):
    """Host us per call of ``fn`` with every launcher's raw launches removed (direct) and restored."""
    import gc

    from attnc.backends.triton import launch as L
    launchers = [x for x in gc.get_objects() if isinstance(x, L.Launcher)]
    saved = [dict(x.raw) for x in launchers]
    for r in range(rounds):
        for x in launchers:
            x.raw.clear()
        direct = per_call_us(fn)
        for x, s in zip(launchers, saved):
            x.raw.update(s)
        raw = per_call_us(fn)
        print(json.dumps({"study": "raw_launch_host_ab", "call": call, "round": r, "direct_host_us": direct,
                          "raw_host_us": raw}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
