"""GPU benchmarks: our generated kernels against their peers in one process (DESIGN §6).

Every row checks correctness against a float32 reference on the GPU before it times
anything, and records raw synchronized samples (ms) from ``triton.testing.do_bench``.
Peers: FlexAttention (torch.compile'd, default and max-autotune-no-cudagraphs, the same
mask as a BlockMask) and SDPA's flash and cuDNN backends (causal and full only).
TFLOP/s count visible cells only: 4 * d * visible cells per (b, h).
"""
from __future__ import annotations

import json
import math
import platform
import time

import numpy as np

from compiler import __version__, ir
from compiler.lower import compile_spec

PREFILL_MASKS = {
    # name -> (mask in the .attn language, tensors it declares, Flex mask_mod factory)
    "causal": ("causal", ""),
    "sliding_window_1024": ("causal & window(1024)", ""),
    "causal_document": ("causal & doc[b, q] == doc[b, k]", "tensor doc: i32[b, s] ~ segments(256, 2048)"),
    "prefix_lm_2048": ("causal | k < 2048", ""),
    "full": ("true", ""),
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages, use_tma)
CONFIGS = [(128, 128, 8, 2, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False), (64, 64, 4, 3, False),
           (128, 64, 8, 3, False), (128, 128, 8, 2, True), (128, 128, 8, 3, True), (128, 64, 4, 3, True),
           (64, 64, 4, 3, True), (128, 64, 8, 3, True)]


def spec_text(name: str, heads: int, head_dim: int, mask: str, decls: str) -> str:
    return (f"attention bench_{name} {{ heads = {heads} head_dim = {head_dim} dtype = bf16 {decls} "
            f"mask = {mask} }}")


def ceilings(torch, triton):
    """Measured here, now: device copy bandwidth (read + write) and bf16 GEMM rate."""
    n = 1 << 30  # 1 GiB
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_TBps": 2 * n / t_copy / 1e9, "bf16_gemm_TFLOPs": 2 * 8192 ** 3 / t_mm / 1e9}


def _dense_reference(torch, q, k, v, visible, scale):
    """float32 attention with a dense boolean mask for a few (b, h); all-masked rows give 0."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v.float()


def run_prefill(batch=4, heads=16, seq=8192, head_dim=128, masks=None, configs=None, seed=0, out=None,
                flex=True, sdpa=True, flex_modes=("default", "max-autotune-no-cudagraphs")):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from backends.triton import runtime
    from compiler import inputs

    masks = masks or list(PREFILL_MASKS)
    configs = configs or CONFIGS
    rows = _Rows(out)
    torch.manual_seed(seed)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "attnc": __version__}
    ceil = ceilings(torch, triton)
    print(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s", flush=True)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    scale = 1 / math.sqrt(head_dim)
    for name in masks:
        mask_src, decls = PREFILL_MASKS[name]
        program = compile_spec(spec_text(name, heads, head_dim, mask_src, decls))
        tensors_np = {}
        if program.tensors:
            tensors_np = {t: a for t, a in inputs.sample(program, batch, seq, seq, seed).items()
                          if t not in ("q", "k", "v")}
        tensors = {n: torch.as_tensor(a.astype(np.int32), device="cuda") for n, a in tensors_np.items()}
        kernel = runtime.load(program)
        # visible cells, exactly, from the analysis' row sets (no S x S evaluation)
        t0 = time.perf_counter()
        plan0 = kernel.plan(batch, seq, seq, tensors_np, 128, 128)
        plan_ms = (time.perf_counter() - t0) * 1e3
        runs = plan0.intervals.visible.must
        per_column = runs.cells_in(0, seq).reshape(plan0.intervals.shape)
        visible = int(np.broadcast_to(per_column.sum(-1), (batch, heads)).sum())
        flops = 4.0 * head_dim * visible
        # reference for (b=0, h in {0, heads-1})
        bh = [(0, 0), (batch - 1, heads - 1)]
        from backends.numpy import oracle
        dense = {}
        for b, h in bh:
            vis = np.array(oracle.dense_mask(program, batch, seq, seq, tensors_np)[b, h])
            dense[(b, h)] = torch.as_tensor(np.ascontiguousarray(vis), device="cuda")
        refs = {(b, h): _dense_reference(torch, q[b, h], k[b, h], v[b, h], dense[(b, h)], scale) for b, h in bh}

        def check(o):
            errs = [((o[b, h].float() - refs[(b, h)]).norm() / refs[(b, h)].norm()).item() for b, h in bh]
            return max(errs)

        record = {"bench": "prefill", "mask": name, "B": batch, "H": heads, "S": seq, "D": head_dim,
                  "dtype": "bf16", "visible_cells": visible, "density": visible / (batch * heads * seq * seq),
                  "spec_digest": ir.digest(program), "plan_ms": plan_ms, "env": env, "ceilings": ceil,
                  "reference": "float32 dense softmax on GPU, (b,h) in " + str(bh), "tolerance_rel_l2": 1e-2}
        best = None
        for bm, bn, warps, stages, tma in configs:
            plan = kernel.plan(batch, seq, seq, tensors_np, bm, bn)
            args = kernel.device_plan(plan, q.device)
            fn = lambda: kernel.module.attention(q, k, v, args, num_warps=warps, num_stages=stages,  # noqa: E731
                                                 use_tma=tma, **tensors)
            try:
                o, _ = fn()
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile (e.g. shared memory) is recorded
                rows.append({**record, "impl": "attnc", "config": [bm, bn, warps, stages, tma], "error": str(e)[-1500:]})
                print(f"{name:22} attnc {bm}x{bn} w{warps} s{stages} tma={tma}: ERROR {str(e)[-400:]}", flush=True)
                continue
            err = check(o)
            ok = err < record["tolerance_rel_l2"]
            samples = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="all") if ok else []
            med = float(np.median(samples)) if samples else float("nan")
            row = {**record, "impl": "attnc", "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                                                          "num_stages": stages, "use_tma": tma},
                   "tiles": plan.tiles.counts(), "rel_l2_error": err, "pass": ok, "samples_ms": samples,
                   "median_ms": med, "TFLOPs": flops / med / 1e9 if samples else None}
            rows.append(row)
            print(f"{name:22} attnc {bm}x{bn} w{warps} s{stages} tma={tma}: err {err:.1e} "
                  f"{med:.3f} ms {row['TFLOPs'] or 0:.0f} TFLOP/s", flush=True)
            if ok and (best is None or med < best["median_ms"]):
                best = row
        if flex:
            rows += _flex_rows(torch, triton, name, q, k, v, tensors, check, record, flops, flex_modes)
        if sdpa and name in ("causal", "full"):
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal")
                try:
                    o = fn()
                except Exception as e:
                    rows.append({**record, "impl": f"sdpa_{backend.name.lower()}", "error": str(e)[:300]})
                    continue
                err = check(o)
                samples = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="all")
                med = float(np.median(samples))
                rows.append({**record, "impl": f"sdpa_{backend.name.lower()}", "rel_l2_error": err,
                             "pass": err < 1e-2, "samples_ms": samples, "median_ms": med,
                             "TFLOPs": flops / med / 1e9})
                print(f"{name:22} sdpa {backend.name}: err {err:.1e} {med:.3f} ms {flops / med / 1e9:.0f} TFLOP/s",
                      flush=True)
    return list(rows)


class _Rows(list):
    """Rows, each appended to the JSON-lines file as soon as it exists (a run cut short by a
    time limit keeps what it measured)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, row):
        super().append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def __iadd__(self, rows):
        for r in rows:
            self.append(r)
        return self


def _flex_rows(torch, triton, name, q, k, v, tensors, check, record, flops, modes):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    batch, heads, seq, _ = q.shape
    if name == "causal":
        def mask_mod(b, h, qi, ki):
            return qi >= ki
    elif name == "sliding_window_1024":
        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < 1024)
    elif name == "causal_document":
        doc = tensors["doc"]

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (doc[b, qi] == doc[b, ki])
    elif name == "prefix_lm_2048":
        def mask_mod(b, h, qi, ki):
            return (qi >= ki) | (ki < 2048)
    else:
        mask_mod = None
    rows = []
    t0 = time.perf_counter()
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, batch if name == "causal_document" else None, None, seq, seq,
                                       device="cuda")
    torch.cuda.synchronize()
    bm_ms = (time.perf_counter() - t0) * 1e3
    for mode in modes:
        compiled = torch.compile(flex_attention) if mode == "default" else torch.compile(flex_attention, mode=mode)
        fn = lambda: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
        try:
            o = fn()
        except Exception as e:
            rows.append({**record, "impl": f"flex_{mode}", "error": str(e)[:300]})
            continue
        err = check(o)
        samples = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="all")
        med = float(np.median(samples))
        rows.append({**record, "impl": f"flex_{mode}", "rel_l2_error": err, "pass": err < 1e-2,
                     "block_mask_ms": bm_ms, "samples_ms": samples, "median_ms": med, "TFLOPs": flops / med / 1e9})
        print(f"{name:22} flex {mode}: err {err:.1e} {med:.3f} ms {flops / med / 1e9:.0f} TFLOP/s", flush=True)
    return rows
