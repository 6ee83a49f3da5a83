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
from typing import NamedTuple

import numpy as np

from attnc.compiler import __version__, ir
from attnc.compiler.lower import compile_spec

PREFILL_MASKS = {
    # name -> (mask in the .attn language, tensors it declares, Flex mask_mod factory)
    "causal": ("causal", ""),
    "sliding_window_1024": ("causal & window(1024)", ""),
    "causal_document": ("causal & doc[b, q] == doc[b, k]", "tensor doc: i32[b, s] ~ segments(256, 2048)"),
    "prefix_lm_2048": ("causal | k < 2048", ""),
    "full": ("true", ""),
    # not a goal mask: documents of 1024 aligned to the tiles, a predicate (bench diagnostics)
    "chunked_causal_1024": ("causal & q // 1024 == k // 1024", ""),
}
GOAL_MASKS = ["causal", "sliding_window_1024", "causal_document", "prefix_lm_2048", "full"]


class PrefillConfig(NamedTuple):
    """One prefill launch the bench times (walk / mask_source None: the kernel's own choice;
    per_sm > 0: persistent, that many programs per SM)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool
    warp_specialize: bool = False
    walk: str | None = None
    mask_source: str | None = None
    per_sm: int = 0
    head_group: int | None = None  # None: the kernel's HEAD_GROUP; 1: one head after another (the order before r21)
    engine: str = "triton"  # or "gluon": the module's warp-specialized Hopper program (its stages; warps/TMA unused)


DEFAULT = "default"  # a config string: time what the runtime picks untuned (Kernel.prefill_launch)


CONFIGS = [PrefillConfig(*c) for c in ((128, 128, 8, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 3, False),
                                       (64, 64, 4, 3, True), (64, 64, 4, 3, False), (128, 64, 8, 3, True),
                                       (64, 128, 4, 3, False))]


WALK_LETTERS = {"r": "runs", "b": "blocks", "g": "merged", "m": "merged_blocks"}


FLAGS = "twrbgmpisoG"


def parse_configs(text: str) -> list:
    """``BMxBNxWxS[flags],...`` (or ``default``: the runtime's own untuned choice) -> configs.
    Flags: t = TMA loads, w = warp-specialized FULL runs, p = the mask as a predicate even where
    interval vectors exist (the default already), i = from the interval vectors; a walk letter
    (r = FULL runs then PARTIAL blocks, b = block by block, g = merged runs, m = merged block
    list), else the kernel's own choice; s = persistent with one program per SM, ss two per SM,
    and so on; o = the old launch order (one head after another, head_group 1); G = the Gluon engine
    (BM must be 128; warps, TMA and walk letters do not apply to it)."""
    out = []
    for c in text.split(","):
        if c.strip() == DEFAULT:
            out.append(DEFAULT)
            continue
        head, _, last = c.strip().rpartition("x")
        digits = last.rstrip(FLAGS)
        flags = last[len(digits):]
        if not digits.isdigit() or len(head.split("x")) != 3 or not all(x.isdigit() for x in head.split("x")):
            raise ValueError(f"config {c!r}: expected 'default' or BMxBNxWxS followed by flags from '{FLAGS}'")
        walk = next((w for f, w in WALK_LETTERS.items() if f in flags), None)
        source = "intervals" if "i" in flags else "predicate" if "p" in flags else None
        out.append(PrefillConfig(*(int(x) for x in head.split("x")), int(digits), "t" in flags, "w" in flags,
                                 walk, source, flags.count("s"), 1 if "o" in flags else None,
                                 "gluon" if "G" in flags else "triton"))
    return out


def _call_key(program, batch, s_q, s_k):
    from attnc.compiler import tune
    return tune.call_key(program, batch, s_q, s_k, "triton")


def _environment() -> dict:
    from attnc.compiler import evidence
    from attnc.compiler.dispatch import Environment
    return evidence.environment_record(Environment.detect())


def spec_text(name: str, heads: int, head_dim: int, mask: str, decls: str) -> str:
    return (f"attention bench_{name} {{ heads = {heads} head_dim = {head_dim} dtype = bf16 {decls} "
            f"mask = {mask} }}")


def prefill_case(name: str, batch: int, heads: int, seq: int, head_dim: int, seed: int = 0):
    """A bench mask's program and the tensors its mask reads (numpy, and int32 on the GPU)."""
    import torch
    from attnc.compiler import inputs
    mask_src, decls = PREFILL_MASKS[name]
    program = compile_spec(spec_text(name, heads, head_dim, mask_src, decls))
    tensors_np = {}
    if program.tensors:
        tensors_np = {t: a for t, a in inputs.sample(program, batch, seq, seq, seed).items()
                      if t not in ("q", "k", "v")}
    tensors = {n: torch.as_tensor(a.astype(np.int32), device="cuda") for n, a in tensors_np.items()}
    return program, tensors_np, tensors


class StudyCase(NamedTuple):
    """One bench mask set up for a study (``study_case``)."""
    kernel: object
    plan: object
    launch: dict
    plan_args: dict
    tensors: dict
    tensors_np: dict
    visible: int


def study_case(name: str, batch: int, heads: int, seq: int, head_dim: int, device, **launch_options) -> StudyCase:
    """A bench mask's kernel, its untuned plan and launch (``Kernel.prefill_launch`` with
    ``launch_options``, e.g. engine="triton"), the plan's device arrays and the visible cells."""
    from attnc.backends.triton import runtime
    program, tensors_np, tensors = prefill_case(name, batch, heads, seq, head_dim)
    kernel = runtime.load(program)
    plan, launch, _ = kernel.prefill_launch(batch, seq, seq, tensors_np, **launch_options)
    return StudyCase(kernel, plan, launch, kernel.device_plan(plan, device), tensors, tensors_np,
                     visible_cells(plan, batch, heads))


def output_error(o, lse, ref) -> tuple[float, float]:
    """(O's relative L2 error, LSE's largest absolute error) of a variant against ref = (O, LSE)."""
    return (((o.float() - ref[0].float()).norm() / ref[0].float().norm()).item(),
            (lse - ref[1]).abs().nan_to_num(0.0).max().item())


def study_rows(study: str, mask: str, samples: dict, flops: float, common: dict, per_variant: dict | None = None,
               out: str | None = None) -> None:
    """A study's timed variants (``time_in_turns``' samples): one JSON line each, appended to
    ``out`` (round medians, TFLOP/s, raw samples, the software), and one printed line each."""
    import torch
    import triton
    for var, rounds in samples.items():
        meds = [float(np.median(s)) for s in rounds]
        tf = flops / float(np.median(meds)) / 1e9
        extra = (per_variant or {}).get(var, {})
        row = {"study": study, "mask": mask, "variant": var, **common, **extra, "round_medians_ms": meds,
               "TFLOPs": tf, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "samples_ms": rounds}
        notes = "  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
        print(f"{mask:22} {var:28} {tf:6.1f} TFLOP/s  rounds {min(meds):.3f}-{max(meds):.3f} ms  {notes}",
              flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def time_in_turns(fns: dict, rounds: int, warmup: int = 25, rep: int = 150) -> dict:
    """Studies' A/B timing: every variant in turn, ``rounds`` times, so that clock and thermal
    drift fall on all of them alike; {name: [one round's raw do_bench samples (ms), ...]}."""
    import triton
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all"))
    return samples


def visible_cells(plan, batch: int, heads: int) -> int:
    """Visible (query, key) cells over every (b, h), exactly, from the analysis' row sets (no
    S x S evaluation)."""
    per_column = plan.intervals.visible.must.cells_in(0, plan.s_q).reshape(plan.intervals.shape)
    return int(np.broadcast_to(per_column.sum(-1), (batch, heads)).sum())


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
    from attnc.backends.triton import runtime

    masks = masks or GOAL_MASKS
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
        program, tensors_np, tensors = prefill_case(name, batch, heads, seq, head_dim, seed)
        kernel = runtime.load(program)
        t0 = time.perf_counter()
        plan0 = kernel.plan(batch, seq, seq, tensors_np, 128, 128)
        plan_ms = (time.perf_counter() - t0) * 1e3
        visible = visible_cells(plan0, batch, heads)
        flops = 4.0 * head_dim * visible
        # reference for (b=0, h in {0, heads-1})
        bh = [(0, 0), (batch - 1, heads - 1)]
        from attnc.compiler import oracle
        dense = {}
        for b, h in bh:
            vis = np.array(oracle.dense_mask(program, batch, seq, seq, tensors_np)[b, h])
            dense[(b, h)] = torch.as_tensor(np.ascontiguousarray(vis), device="cuda")
        refs = {(b, h): _dense_reference(torch, q[b, h], k[b, h], v[b, h], dense[(b, h)], scale) for b, h in bh}

        def check(o):
            errs = [((o[b, h].float() - refs[(b, h)]).norm() / refs[(b, h)].norm()).item() for b, h in bh]
            return max(errs)

        record = {"_key": _call_key(program, batch, seq, seq), "_environment": _environment(),
                  "_warmup": {"warmup_ms": 100, "rep_ms": 500},
                  "bench": "prefill", "mask": name, "B": batch, "H": heads, "S": seq, "D": head_dim,
                  "dtype": "bf16", "visible_cells": visible, "density": visible / (batch * heads * seq * seq),
                  "spec_digest": ir.digest(program), "plan_ms": plan_ms, "env": env, "ceilings": ceil,
                  "reference": "float32 dense softmax on GPU, (b,h) in " + str(bh), "tolerance_rel_l2": 1e-2}
        best = None
        for cfg in configs:
            is_default = cfg == DEFAULT
            if is_default:  # what an untuned call runs: the runtime's choice, made once
                plan, launch, _ = kernel.prefill_launch(batch, seq, seq, tensors_np)
                engine = launch["engine"] or ("gluon" if kernel.module.gluon_reason(
                    q, k, v, None, kernel.device_plan(plan, q.device)) is None else "triton")
                cfg = PrefillConfig(plan.block_m, plan.block_n, launch["num_warps"], launch["num_stages"],
                                    launch["use_tma"], engine=engine)
            bm, bn, warps, stages, tma, ws, walk, source, per_sm, head_group, engine = PrefillConfig(*cfg)
            programs = per_sm * torch.cuda.get_device_properties(0).multi_processor_count if per_sm else None
            if not is_default:
                plan = kernel.plan(batch, seq, seq, tensors_np, bm, bn)
            args = kernel.device_plan(plan, q.device)
            walk_used = ("merged_blocks" if engine == "gluon"
                         else walk or kernel.module.default_walk(args, None, source))
            fn = lambda: kernel.module.attention(q, k, v, args, num_warps=warps, num_stages=stages,  # noqa: E731
                                                 use_tma=tma, warp_specialize=ws, walk=walk,
                                                 mask_source=source, programs=programs, head_group=head_group,
                                                 engine=engine, **tensors)
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
            gluon = engine == "gluon"  # 4 + 4 consumer warps and 1 producer warp, TMA loads: fixed
            row = {**record, "impl": "attnc", "config": {"BLOCK_M": bm, "BLOCK_N": bn,
                                                          "num_warps": "4+4+1" if gluon else warps,
                                                          "num_stages": stages, "use_tma": True if gluon else tma,
                                                          "warp_specialize": ws, "walk": walk_used,
                                                          "mask_source": source or (
                                                              "rows" if gluon and args.get("mask_from_rows")
                                                              else "predicate"),
                                                          "programs": programs, "default": is_default,
                                                          "schedule": kernel.module.SCHEDULE_NAMES[
                                                              kernel.module.gluon_schedule(args)] if gluon else None,
                                                          "head_group": head_group or kernel.module.HEAD_GROUP,
                                                          "engine": engine},
                   "tiles": plan.tiles.counts(), "rel_l2_error": err, "pass": ok, "samples_ms": samples,
                   "median_ms": med, "TFLOPs": flops / med / 1e9 if samples else None}
            rows.append(row)
            label = (f"{'default ' if is_default else ''}{bm}x{bn} w{warps} s{stages} tma={tma} ws={ws} {walk_used} "
                     f"{source or ''}{f' persistent {programs}' if programs else ''}"
                     f"{' old-order' if head_group == 1 else ''}") if engine == "triton" else (
                f"{'default ' if is_default else ''}{bm}x{bn} s{stages} gluon")
            print(f"{name:22} attnc {label}: err {err:.1e} "
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
        config = {"config": list(config)}
    samples = row.pop("samples_ms", None) or None  # raw samples live in measurement.samples
    out = evidence.make_row(environment=environment, key=key, selected=row["impl"], config=config,
                            policy="forced", correctness=correctness, samples_ms=samples, warmup=warmup,
                            synchronization="CUDA events around each call (triton.testing.do_bench)", **row)
    report = evidence.validate_row(out)
    out["validation"] = {"level": report.level, "claim": report.claim, "errors": report.errors,
                         "missing": report.missing}
    return out


class _Rows(list):
    """Rows, each appended to the JSON-lines file as soon as it exists (a run cut short by a
    time limit keeps what it measured).  Rows that carry ``_key`` become evidence rows."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, row):
        if "_key" in row:
            row = dict(row)
            row = evidence_row(row, row.pop("_key"), row.pop("_environment"), row.pop("_warmup"))
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
    elif name == "chunked_causal_1024":
        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi // 1024 == ki // 1024)
    elif name == "prefix_lm_2048":
        def mask_mod(b, h, qi, ki):
            return (qi >= ki) | (ki < 2048)
    elif name == "full":
        def mask_mod(b, h, qi, ki):  # an explicit all-visible BlockMask (every block full)
            return qi >= 0
    else:
        raise ValueError(f"no FlexAttention mask_mod for bench mask {name!r}")
    rows = []
    t0 = time.perf_counter()
    torch._dynamo.reset()  # each mask compiles afresh: past dynamo's recompile limit Flex runs eager
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


DECODE_CASES = [(8, 8192), (32, 8192), (1, 131072)]


def decode_spec(heads_q=32, heads_kv=8, head_dim=128, page_size=16) -> str:
    return (f"attention decode_bench {{ heads = {heads_q} / {heads_kv} head_dim = {head_dim} dtype = bf16 "
            f"mask = causal cache = paged(page_size = {page_size}, layout = nhd) state = lse_o }}")


def decode_case(batch, t_len, heads_q, heads_kv, head_dim, page_size, generator):
    """One decode call on the GPU: q [B, H_q, d], contiguous k/v [B, H_kv, T, d], and the same
    K/V in a paged nhd cache with shuffled page ids (table, kv_lens)."""
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
    kv_lens = torch.full((batch,), t_len, device="cuda", dtype=torch.int32)
    return q, k, v, k_cache, v_cache, table, kv_lens


DECODE_CONFIGS = ((64, None, 4, 2), (64, None, 4, 3), (128, None, 4, 2), (64, "x2", 4, 2), (64, "/2", 4, 2))


def run_decode(cases=None, heads_q=32, heads_kv=8, head_dim=128, page_size=16, out=None, seed=0,
               configs=DECODE_CONFIGS, graph=True):
    """Decode: GQA heads_q/heads_kv, bf16, our split-K/V kernel on a paged cache (page_size,
    shuffled page ids) against SDPA on the same K/V stored contiguously.  Bandwidth counts
    the K/V bytes that must be read once: 2 * B * T * H_kv * d * 2 bytes.  ``graph``: also time
    every config and every SDPA backend replayed from a CUDA graph (attnc: ``Kernel.decode_graph``,
    the query rows copied into the graph's buffer in each timed call; SDPA: its call captured), the
    way serving engines run decode when the host cannot keep up (impl names end in ``_graph``)."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from attnc.backends.triton import runtime
    from attnc.backends.triton.graph import capture

    cases = cases or DECODE_CASES
    rows = _Rows(out)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "attnc": __version__}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    program = compile_spec(decode_spec(heads_q, heads_kv, head_dim, page_size))
    kernel = runtime.load(program)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for batch, t_len in cases:
        kv_bytes = 2 * batch * t_len * heads_kv * head_dim * 2
        q, k, v, k_cache, v_cache, table, kv_lens = decode_case(batch, t_len, heads_q, heads_kv, head_dim,
                                                                page_size, g)
        # float32 reference
        kf = k.float().repeat_interleave(heads_q // heads_kv, 1)
        vf = v.float().repeat_interleave(heads_q // heads_kv, 1)
        ref = torch.softmax((q.float()[:, :, None] @ kf.transpose(-1, -2)) / math.sqrt(head_dim), -1) @ vf
        ref = ref[:, :, 0]
        del kf, vf
        record = {"_key": _call_key(program, batch, 1, [t_len] * batch), "_environment": _environment(),
                  "_warmup": {"warmup_ms": 50, "rep_ms": 300},
                  "bench": "decode", "B": batch, "T": t_len, "H_q": heads_q, "H_kv": heads_kv, "D": head_dim,
                  "dtype": "bf16", "page_size": page_size, "kv_bytes": kv_bytes, "env": env,
                  "spec_digest": ir.digest(program), "reference": "float32 softmax on GPU (all rows)",
                  "tolerance_rel_l2": 1e-2}

        def rel(o):
            return ((o.float() - ref).norm() / ref.norm()).item()

        def timed(impl, fn, config=None, label=None):
            """Check, then time ``fn``; one row (or an error row)."""
            extra = {} if config is None else {"config": config}
            try:
                o = fn()
                o = o[0] if isinstance(o, tuple) else o
                o = o[:, :, 0] if o.dim() == 4 else o
                torch.cuda.synchronize()
            except Exception as e:
                rows.append({**record, "impl": impl, **extra, "error": str(e)[-1500:]})
                print(f"decode B={batch} T={t_len} {label or impl} ERROR {str(e)[-300:]}", flush=True)
                return
            err = rel(o)
            samples = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="all") if err < 1e-2 else []
            med = float(np.median(samples)) if samples else float("nan")
            rows.append({**record, "impl": impl, **extra, "rel_l2_error": err, "pass": err < 1e-2,
                         "samples_ms": samples, "median_ms": med, "TBps": kv_bytes / med / 1e9 if samples else None})
            print(f"decode B={batch:3} T={t_len:6} {label or impl}: err {err:.1e} {med * 1e3:.1f} us "
                  f"{kv_bytes / med / 1e9:.2f} TB/s", flush=True)

        cache = {"k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_lens": kv_lens}
        for block_n, split_rule, warps, stages in configs:
            plan = kernel.decode_plan(cache, block_n=block_n, num_sms=sms)  # the runtime's own split count
            if split_rule is not None:
                base = plan["splits"]
                splits = {"x2": min(2 * base, 128), "/2": max(base // 2, 1)}[split_rule]
                plan = kernel.decode_plan(cache, block_n=block_n, splits=splits, num_sms=sms)
            launch = kernel.decode_args(plan, "cuda")
            config = {"BLOCK_N": block_n, "splits": plan["splits"], "num_warps": warps, "num_stages": stages}
            label = f"attnc bn={block_n} splits={plan['splits']:3} w{warps} s{stages}"
            timed("attnc_paged", lambda: kernel.module.decode(q, k_cache, v_cache, launch, num_warps=warps,
                                                              num_stages=stages), config, label)
            if graph:
                try:
                    replay = kernel.decode_graph(q, **cache, block_n=block_n, splits=plan["splits"],
                                                 num_warps=warps, num_stages=stages)
                except Exception as e:
                    rows.append({**record, "impl": "attnc_paged_graph", "config": config, "error": str(e)[-1500:]})
                    continue
                timed("attnc_paged_graph", lambda: replay(q), config, label + " graph")
                del replay
        q4 = q[:, :, None]
        for name, backend in (("sdpa_default", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def fn(backend=backend):
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            timed(name, fn)
            if graph:
                try:
                    sdpa_graph, sdpa_out = capture(fn)
                    replay = lambda g=sdpa_graph, o=sdpa_out: (g.replay(), o)[1]  # noqa: E731
                except Exception as e:
                    rows.append({**record, "impl": name + "_graph", "error": str(e)[-300:]})
                    continue
                timed(name + "_graph", replay)
        del k, v, k_cache, v_cache
        torch.cuda.empty_cache()
    return list(rows)
