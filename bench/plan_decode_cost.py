"""Host time of one decode plan (CPU): ``backends.triton.decode.decode_plan`` for GQA 32/8,
d = 128, bf16, as a serving loop calls it every step (metadata as torch tensors on the host,
K/V as shape-only ``meta`` tensors: the plan reads only their shapes and strides).

    python bench/plan_decode_cost.py [--repeats 200] [--masks causal,...] [--caches paged_dense,...]

Cases: B=64 with every length 2048; B=64 with distinct lengths drawn in [1, 8192]; B=1 with
T=131072 — over a paged cache with a dense table (page 16), a paged CSR table, a contiguous
cache; for the masks causal, sliding window 1024, full and causal documents (the document ids
``doc [B, S]`` passed by name among the arrays).  Prints the median and p90 µs per call after
warm-up (the first call, which fills the per-spec caches, is printed apart)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MASKS = {"causal": "causal", "window": "causal & window(1024)", "full": "true",
         "documents": "causal & doc[b, q] == doc[b, k]"}
CACHES = {"paged_dense": "paged(page_size = 16, layout = nhd, table = dense)",
          "paged_csr": "paged(page_size = 16, layout = nhd, table = csr)",
          "contiguous": "contiguous(layout = bhsd)"}
CASES = {"B64_T2K": lambda rng: np.full(64, 2048), "B64_mixed": lambda rng: rng.integers(1, 8193, 64),
         "B1_T128K": lambda rng: np.full(1, 131072)}
HQ, HKV, D, PAGE = 32, 8, 128, 16


def spec(mask: str, cache: str) -> str:
    doc = "tensor doc: i32[b, s] ~ segments(256, 2048)" if "doc" in MASKS[mask] else ""
    return (f"attention plan_{mask}_{cache} {{ heads = {HQ} / {HKV} head_dim = {D} dtype = bf16 {doc} "
            f"mask = {MASKS[mask]} cache = {CACHES[cache]} state = lse_o }}")


def documents(rng, batch: int, s: int) -> np.ndarray:
    """Contiguous document ids per request, lengths in [256, 2048]."""
    lens = rng.integers(256, 2049, (batch, s // 256 + 1))
    ends = np.cumsum(lens, axis=1)
    return np.stack([np.searchsorted(e, np.arange(s), "right") for e in ends]).astype(np.int32)


def arrays(cache: str, kv_lens: np.ndarray, rng, doc: bool) -> dict:
    import torch
    b = len(kv_lens)
    pages = -(-kv_lens // PAGE)
    out = {}
    if cache == "contiguous":
        t = int(kv_lens.max())
        out["k"] = out["v"] = torch.empty(b, HKV, t, D, dtype=torch.bfloat16, device="meta")
        out["kv_lens"] = torch.as_tensor(kv_lens.astype(np.int32))
    else:
        pool = int(pages.sum())
        out["k_cache"] = out["v_cache"] = torch.empty(pool, PAGE, HKV, D, dtype=torch.bfloat16, device="meta")
        ids = rng.permutation(pool).astype(np.int32)
        first = np.r_[0, np.cumsum(pages)]
        if cache == "paged_dense":
            table = np.full((b, int(pages.max())), -1, np.int32)
            for i in range(b):
                table[i, :pages[i]] = ids[first[i]:first[i + 1]]
            out["block_table"] = torch.as_tensor(table)
            out["kv_lens"] = torch.as_tensor(kv_lens.astype(np.int32))
        else:
            out["kv_indptr"] = torch.as_tensor(first.astype(np.int32))
            out["kv_indices"] = torch.as_tensor(ids)
            out["kv_last_page_len"] = torch.as_tensor((kv_lens - PAGE * (pages - 1)).astype(np.int32))
    if doc:
        out["doc"] = torch.as_tensor(documents(rng, b, int(kv_lens.max())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tensors-apart", action="store_true",
                    help="pass the declared tensors as tensors= (decode_plan before it read them by name)")
    args = ap.parse_args(argv)
    from attnc.backends.triton.decode import decode_plan
    from attnc.compiler.lower import compile_spec
    print(f"{'case':10} {'cache':12} {'mask':10} {'first µs':>10} {'median µs':>10} {'p90 µs':>9} "
          f"{'splits':>6}")
    for mask in args.masks.split(","):
        for cache in args.caches.split(","):
            program = compile_spec(spec(mask, cache))
            for case in args.cases.split(","):
                rng = np.random.default_rng(0)
                a = arrays(cache, CASES[case](rng), rng, "doc" in MASKS[mask])
                kw = {"num_sms": 132}
                if args.tensors_apart:  # decode_plan before it took declared tensors by name
                    kw["tensors"] = {t.name: a.pop(t.name) for t in program.tensors}
                t0 = time.perf_counter()
                plan = decode_plan(program, a, **kw)
                first = time.perf_counter() - t0
                samples = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    decode_plan(program, a, **kw)
                    samples.append(time.perf_counter() - t0)
                us = np.asarray(samples) * 1e6
                print(f"{case:10} {cache:12} {mask:10} {first * 1e6:10.0f} {np.median(us):10.1f} "
                      f"{np.percentile(us, 90):9.1f} {plan['splits']:6}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
