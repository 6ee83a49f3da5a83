"""GPU benchmarks: attnc's public call against its peers, in one process, on the same inputs.

Every implementation's output is checked against a float32 reference on the GPU before it is
timed.  Timings are ``triton.testing.do_bench`` samples (ms, raw samples recorded), and
``host_us``: the host time of one call, measured over back-to-back calls while the GPU is kept
busy (so it is the time Python spends issuing the call, launches included).

Prefill implementations:
  attnc_call    ``attnc.compile(spec)(q, k, v, **tensors)`` as a user makes it: no plan passed in,
                the untuned default; its plan comes from the plan cache after the first call;
  attnc_kernel  the same kernel with its launch bound once (``Kernel.prepare``): the kernel alone;
  flex_<mode>   FlexAttention compiled with torch.compile (its BlockMask made once);
  sdpa_cudnn, sdpa_flash   SDPA's backends (causal and full only).
Decode implementations (GQA, paged bf16 cache, page 16, shuffled page ids):
  attnc_call    ``attn.decode(q, k_cache=..., v_cache=..., block_table=..., kv_lens=...)``: the
                default config, planned in every call, no graph;
  attnc_graph   the same call captured once (``Kernel.decode_graph``) and replayed;
  attnc_cfg     fixed configs (BLOCK_N, splits, warps, stages) with the plan made once: the best
                of them is what the default is measured against;
  sdpa_*        SDPA on the same K/V stored contiguously (and replayed from a graph).
TFLOP/s count visible cells only (4 * d * visible cells per (b, h)); decode TB/s counts the K/V
bytes a call must read once.
"""
from __future__ import annotations

import json
import math
import platform
import time

import numpy as np

PREFILL_MASKS = {
    # name -> (mask in the .attn language, tensors it declares)
    "causal": ("causal", ""),
    "sliding_window_1024": ("causal & window(1024)", ""),
    "causal_document": ("causal & doc[b, q] == doc[b, k]", "tensor doc: i32[b, s] ~ segments(256, 2048)"),
    "prefix_lm_2048": ("causal | k < 2048", ""),
    "full": ("true", ""),
}
GOAL_MASKS = list(PREFILL_MASKS)
DECODE_CASES = [(8, 8192), (32, 8192), (1, 131072), (64, 2048)]
DECODE_CONFIGS = ((64, 1.0, 4, 2), (64, 1.0, 4, 3), (128, 1.0, 4, 2), (64, 2.0, 4, 2), (64, 0.5, 4, 2),
                  (32, 1.0, 4, 2), (128, 2.0, 8, 2))


def spec_text(name: str, mask: str, decls: str, heads: int | None = None, head_dim: int | None = None) -> str:
    shape = (f"heads = {heads} head_dim = {head_dim} " if heads else "")
    return f"attention bench_{name} {{ {shape}dtype = bf16 {decls} mask = {mask} }}"


def environment() -> dict:
    import torch
    import triton
    import attnc
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "attnc": attnc.__version__}


def evidence_row(row: dict, key, environment: dict, warmup: dict) -> dict:
    """A measurement as an evidence row (compiler/evidence.py, M4.5 §0x0BI): environment,
    dispatch key + digest, the implementation and its config, the correctness check, raw
    samples; the validator's verdict is recorded in the row (``validation``), so a row that
    skips a level says so instead of passing for evidence."""
    from attnc.compiler import evidence
    row = dict(row)
    correctness = None
    if "rel_l2_error" in row:
        correctness = {"reference": row["reference"], "rel_error": row["rel_l2_error"],
                       "tolerance": {"rel_l2": row["tolerance_rel_l2"]}, "pass": bool(row.get("pass"))}
    config = row.pop("config", None) or {}
    if not isinstance(config, dict):
        config = {"config": config}
    samples = row.pop("samples_ms", None) or None  # raw samples live in measurement.samples
    out = evidence.make_row(environment=environment, key=key, selected=row["impl"], config=config,
                            policy="forced", correctness=correctness, samples_ms=samples, warmup=warmup,
                            synchronization="CUDA events around each call (triton.testing.do_bench)", **row)
    report = evidence.validate_row(out)
    out["validation"] = {"level": report.level, "claim": report.claim, "errors": report.errors,
                         "missing": report.missing}
    return out


def call_key(program, batch, s_q, s_k):
    from attnc.compiler import tune
    return tune.call_key(program, batch, s_q, s_k, "triton")


def evidence_environment() -> dict:
    from attnc.compiler import evidence
    from attnc.compiler.dispatch import Environment
    return evidence.environment_record(Environment.detect())


class Rows(list):
    """Rows appended to a JSON-lines file as they come (a crash keeps what was measured).  Rows
    that carry ``_key`` become evidence rows (``evidence_row``)."""

    def __init__(self, path: str | None, command: str):
        super().__init__()
        self.path, self.command = path, command

    def append(self, row: dict) -> None:
        row = {"command": self.command, **row}
        if "_key" in row:
            row = evidence_row(row, row.pop("_key"), evidence_environment(), {"warmup_ms": 50, "rep_ms": 300})
        super().append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def host_us(fn, calls: int = 40) -> float:
    """Host time per call over back-to-back calls (the GPU busy behind them)."""
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def timed(fn, check, record: dict, rows: Rows, label: str, work: float, unit: str, tol: float = 1e-2,
          warmup: int = 50, rep: int = 300) -> dict | None:
    """Check ``fn``'s output, then time it: one row (or an error row)."""
    import torch
    import triton
    try:
        out = fn()
        torch.cuda.synchronize()
        err = check(out)
    except Exception as e:  # noqa: BLE001 - a peer failing is a row, not the end of the run
        rows.append({**record, "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
        print(f"{label}: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)
        return None
    ok = err < tol
    if ok:  # long calls get a longer budget: at least 25 samples whatever the call costs
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rep = max(rep, int(30 * (time.perf_counter() - t0) * 1e3))
    samples = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all") if ok else []
    med = float(np.median(samples)) if samples else float("nan")
    hus = host_us(fn) if ok else float("nan")
    rate = work / med / 1e9 if samples else None  # FLOP (or bytes) per ms / 1e9: TFLOP/s (or TB/s)
    row = {**record, "rel_l2_error": err, "pass": ok, "median_ms": med, "host_us": hus, unit: rate,
           "samples_ms": samples}
    rows.append(row)
    print(f"{label}: err {err:.1e}  {med * 1e3:8.1f} us  host {hus:6.1f} us  {rate or 0:7.1f} {unit}", flush=True)
    return row


# ---------------------------------------------------------------- prefill
def _flex_mask_mod(name, tensors):
    if name == "causal":
        return lambda b, h, qi, ki: qi >= ki
    if name == "sliding_window_1024":
        return lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 1024)
    if name == "causal_document":
        doc = tensors["doc"]
        return lambda b, h, qi, ki: (qi >= ki) & (doc[b, qi] == doc[b, ki])
    if name == "prefix_lm_2048":
        return lambda b, h, qi, ki: (qi >= ki) | (ki < 2048)
    if name == "full":
        return lambda b, h, qi, ki: qi >= 0
    raise ValueError(name)


def run_prefill(batch=4, heads=16, seq=8192, head_dim=128, masks=None, out=None, seed=0, command="",
                flex_modes=("default", "max-autotune-no-cudagraphs"), sdpa=True, kernel_alone=True):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attnc
    from attnc.compiler import inputs

    rows = Rows(out, command)
    env = environment()
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name in masks or GOAL_MASKS:
        mask_src, decls = PREFILL_MASKS[name]
        attn = attnc.compile(spec_text(name, mask_src, decls))  # shape-generic: heads, head_dim from the call
        q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        tensors = {}
        program = attn.specialize(heads, heads, head_dim, head_dim, "bf16")
        if program.tensors:
            sample = inputs.sample(program, batch, seq, seq, seed)
            tensors = {t.name: torch.as_tensor(sample[t.name].astype(np.int32), device="cuda")
                       for t in program.tensors}
        kernel = attn.kernel("triton", program)
        t0 = time.perf_counter()
        plan = kernel.plan(batch, seq, seq, tensors, 128, 128)
        plan_ms = (time.perf_counter() - t0) * 1e3
        counts = plan.tiles.counts()
        visible = _visible_cells(program, batch, seq, tensors)
        flops = 4.0 * head_dim * visible * heads
        # float32 reference on two (b, h) planes
        planes = [(0, 0), (batch - 1, heads - 1)]
        refs = []
        dense = _dense_visible(program, seq, tensors)
        for b, h in planes:
            s = (q[b, h].float() @ k[b, h].float().T) / math.sqrt(head_dim)
            vis = dense(b)
            s = s.masked_fill(~vis, float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)
            refs.append(p @ v[b, h].float())

        def check(o):
            o = o[0] if isinstance(o, tuple) else o
            num = sum(((o[b, h].float() - r) ** 2).sum() for (b, h), r in zip(planes, refs))
            den = sum((r ** 2).sum() for r in refs)
            return float((num / den).sqrt())

        record = {"_key": call_key(program, batch, seq, seq), "bench": "prefill", "mask": name, "B": batch, "H": heads, "S": seq, "D": head_dim,
                  "dtype": "bf16", "visible_cells": visible, "density": visible / (batch * seq * seq),
                  "tiles_128": counts, "plan_ms": plan_ms, "env": env,
                  "reference": f"float32 dense softmax on GPU, (b,h) in {planes}", "tolerance_rel_l2": 1e-2}
        label = f"{name:20} B={batch} S={seq}"
        t0 = time.perf_counter()
        attn(q, k, v, **tensors)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        config = kernel.config_for(q, k, v, **tensors)
        timed(lambda: attn(q, k, v, **tensors), check,
              {**record, "impl": "attnc_call", "config": config.describe(), "first_call_ms": first_ms}, rows,
              f"{label} attnc_call   ", flops, "TFLOPs")
        if kernel_alone:
            run = kernel.prepare(q, k, v, **tensors)
            timed(run, check, {**record, "impl": "attnc_kernel", "config": run.config.describe()}, rows,
                  f"{label} attnc_kernel ", flops, "TFLOPs")
        if flex_modes:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            torch._dynamo.reset()
            t0 = time.perf_counter()
            block_mask = create_block_mask(_flex_mask_mod(name, tensors), batch if tensors else None, None, seq, seq,
                                           device="cuda")
            torch.cuda.synchronize()
            bm_ms = (time.perf_counter() - t0) * 1e3
            for mode in flex_modes:
                compiled = torch.compile(flex_attention) if mode == "default" else torch.compile(flex_attention,
                                                                                                 mode=mode)
                timed(lambda: compiled(q, k, v, block_mask=block_mask), check,
                      {**record, "impl": f"flex_{mode}", "block_mask_ms": bm_ms}, rows, f"{label} flex_{mode[:8]}",
                      flops, "TFLOPs")
        if sdpa and name in ("causal", "full"):
            for impl, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal")
                timed(fn, check, {**record, "impl": impl}, rows, f"{label} {impl:12}", flops, "TFLOPs")
        del q, k, v
        torch.cuda.empty_cache()
    return list(rows)


def _visible_cells(program, batch, seq, tensors) -> int:
    """Visible (query, key) cells of one head over the batch, exactly, from the analysis' row sets
    (no S x S evaluation)."""
    from attnc.compiler.plan import plan as make_plan
    host = {n: t.cpu().numpy().astype(np.int64) for n, t in tensors.items()}
    p = make_plan(program, batch, seq, seq, host, 128, 128)
    per_column = p.intervals.visible.must.cells_in(0, p.s_q).reshape(p.intervals.shape)
    return int(np.broadcast_to(per_column.sum(-1)[:, :1], (batch, 1)).sum())


def _dense_visible(program, seq, tensors):
    """b -> [S, S] bool visibility on the GPU for the bench masks (for the reference)."""
    import torch
    qi = torch.arange(seq, device="cuda")[:, None]
    ki = torch.arange(seq, device="cuda")[None, :]
    name = program.name.removeprefix("bench_")
    if name == "causal_document":
        return lambda b: (qi >= ki) & (tensors["doc"][b][:, None] == tensors["doc"][b][None, :])
    fixed = {"causal": qi >= ki, "sliding_window_1024": (qi >= ki) & (qi - ki < 1024),
             "prefix_lm_2048": (qi >= ki) | (ki < 2048), "full": torch.ones(seq, seq, dtype=torch.bool, device="cuda")}
    return lambda b: fixed[name]


# ---------------------------------------------------------------- decode
def decode_case(batch, t_len, heads_q, heads_kv, head_dim, page_size, generator):
    """q [B, H_q, d], contiguous k/v [B, H_kv, T, d], and the same K/V in a paged nhd cache with
    shuffled page ids (table, kv_lens)."""
    import torch
    g = generator
    q = torch.randn(batch, heads_q, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, heads_kv, t_len, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, heads_kv, t_len, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    pages = batch * t_len // page_size
    perm = torch.randperm(pages, device="cuda", generator=g)
    table = perm.view(batch, t_len // page_size).to(torch.int32)
    k_cache = torch.empty(pages, page_size, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.permute(0, 2, 1, 3).reshape(pages, page_size, heads_kv, head_dim)
    v_cache[perm] = v.permute(0, 2, 1, 3).reshape(pages, page_size, heads_kv, head_dim)
    kv_lens = torch.full((batch,), t_len, dtype=torch.int32)  # host metadata, as serving engines keep it
    return q, k, v, k_cache, v_cache, table.cpu(), kv_lens


def run_decode(cases=None, heads_q=32, heads_kv=8, head_dim=128, page_size=16, out=None, seed=0, command="",
               configs=DECODE_CONFIGS, graph=True):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attnc
    from attnc.backends.triton.graph import capture

    rows = Rows(out, command)
    env = environment()
    attn = attnc.compile(f"attention decode_bench {{ dtype = bf16 mask = causal "
                         f"cache = paged(page_size = {page_size}, layout = nhd) }}")
    program = attn.specialize(heads_q, heads_kv, head_dim, head_dim, "bf16")
    kernel = attn.kernel("triton", program)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for batch, t_len in cases or DECODE_CASES:
        kv_bytes = 2 * batch * t_len * heads_kv * head_dim * 2
        q, k, v, k_cache, v_cache, table, kv_lens = decode_case(batch, t_len, heads_q, heads_kv, head_dim,
                                                                page_size, g)
        kf = k.float().repeat_interleave(heads_q // heads_kv, 1)
        vf = v.float().repeat_interleave(heads_q // heads_kv, 1)
        ref = (torch.softmax((q.float()[:, :, None] @ kf.transpose(-1, -2)) / math.sqrt(head_dim), -1) @ vf)[:, :, 0]
        del kf, vf

        def check(o):
            o = o[0] if isinstance(o, tuple) else o
            o = o[:, :, 0] if o.dim() == 4 else o
            return float((o.float() - ref).norm() / ref.norm())

        record = {"_key": call_key(program, batch, 1, [t_len] * batch), "bench": "decode", "B": batch, "T": t_len, "H_q": heads_q, "H_kv": heads_kv, "D": head_dim,
                  "dtype": "bf16", "page_size": page_size, "kv_bytes": kv_bytes, "env": env,
                  "reference": "float32 softmax on GPU (all rows)", "tolerance_rel_l2": 1e-2}
        label = f"decode B={batch:3} T={t_len:6}"
        cache = {"k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_lens": kv_lens}
        default = kernel.decode_plan(cache)
        timed(lambda: attn.decode(q, **cache), check,
              {**record, "impl": "attnc_call", "config": {n: default[n] for n in ("block_n", "splits", "block_q")}},
              rows, f"{label} attnc_call", kv_bytes, "TBps")
        if graph:
            replay = kernel.decode_graph(q, **cache)
            timed(lambda: replay(q), check, {**record, "impl": "attnc_graph"}, rows, f"{label} attnc_graph",
                  kv_bytes, "TBps")
            del replay
        for block_n, split_factor, warps, stages in configs:
            base = kernel.decode_plan(cache, block_n=block_n)["splits"]
            splits = max(1, min(128, int(round(base * split_factor))))
            plan = kernel.decode_plan(cache, block_n=block_n, splits=splits)
            run = kernel.prepare_decode(q, plan, num_warps=warps, num_stages=stages, **cache)
            cfg = {"BLOCK_N": block_n, "splits": splits, "num_warps": warps, "num_stages": stages}
            timed(run, check, {**record, "impl": "attnc_cfg", "config": cfg}, rows,
                  f"{label} attnc bn={block_n:3} s={splits:3} w{warps} st{stages}", kv_bytes, "TBps")
        q4 = q[:, :, None]
        for impl, backend in (("sdpa_default", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def fn(backend=backend):
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            timed(fn, check, {**record, "impl": impl}, rows, f"{label} {impl}", kv_bytes, "TBps")
            if graph:
                try:
                    sdpa_graph, sdpa_out = capture(fn)
                except Exception as e:  # noqa: BLE001
                    rows.append({**record, "impl": impl + "_graph", "error": str(e)[-300:]})
                    continue
                timed(lambda gr=sdpa_graph, o=sdpa_out: (gr.replay(), o)[1], check,
                      {**record, "impl": impl + "_graph"}, rows, f"{label} {impl}_graph", kv_bytes, "TBps")
        del k, v, k_cache, v_cache
        torch.cuda.empty_cache()
    return list(rows)


def summary(rows) -> str:
    """The table the bench prints last: per case, each implementation's best passing median."""
    out = []
    cases = {}
    for r in rows:
        if not r.get("pass"):
            continue
        case = (r["bench"], r.get("mask", ""), r.get("B"), r.get("S", r.get("T")), r.get("phase", ""))
        best = cases.setdefault(case, {})
        if r["impl"] not in best or r["median_ms"] < best[r["impl"]]["median_ms"]:
            best[r["impl"]] = r
    for case, impls in cases.items():
        out.append(" ".join(str(c) for c in case))
        for impl, r in sorted(impls.items(), key=lambda kv: kv[1]["median_ms"]):
            rate = r.get("TFLOPs") or r.get("TBps") or 0
            out.append(f"   {impl:32} {r['median_ms'] * 1e3:9.1f} us  host {r['host_us']:7.1f} us  {rate:7.2f}")
    return "\n".join(out)
