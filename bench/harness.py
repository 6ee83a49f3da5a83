"""GPU benchmarks: attnc's public call against its peers, in one process, on the same inputs.

Every implementation's output is checked against a float32 reference on the GPU before it is
timed.  Timings are ``triton.testing.do_bench`` samples (ms, raw samples recorded), and
``host_us``: the host time of one call, measured over back-to-back calls while the GPU is kept
busy (so it is the time Python spends issuing the call, launches included).

Prefill cases (``PREFILL_CASES``, ``attnc bench prefill --cases all|<names>``): the five bench
masks at B4 H16 S8192 d128 and issue 21's shapes and score programs (S 8000, d 64 with 32 heads,
ALiBi, softcap 30 with GQA 32/8, MLA d 192/128, d 256, FP8 e4m3 causal); each case is checked
against a float32 dense reference of its own (score program, GQA, d_qk != d_v; FP8 against the
original bf16 inputs, tolerance 8e-2) and the run ends with issue 21's summary (``issue21_summary``:
x Flex best, x cuDNN, FP8 over bf16, and the done-criterion's verdict per case).
Prefill implementations:
  attnc_call    ``attnc.compile(spec)(q, k, v, **tensors)`` as a user makes it: no plan passed in,
                the untuned default; its plan comes from the plan cache after the first call (FP8:
                ``attn(q8, k8, v8, q_descale=, k_descale=, v_descale=)``, quantized once outside);
  attnc_kernel  the same kernel with its launch bound once (``Kernel.prepare``): the kernel alone;
  flex_<mode>   FlexAttention compiled with torch.compile (its BlockMask made once; dynamo reset
                before each mode and case; score_mod for the score programs, enable_gqa for GQA);
  flex_flash    the same compiled call with ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4's
                kernels under Flex; skipped with a line when ``flash_attn`` is not importable);
  fa4           FlashAttention-4 itself (``flash_attn.cute``: bench/peers.py) on the masks it has
                (causal, full, window, documents through varlen) with no score program or softcap,
                on its own bshd copies made once;
  sdpa_cudnn, sdpa_flash   SDPA's backends (plain causal and full cases only; FP8: tried on the
                quantized tensors, a refusal is recorded as an error row).
Decode implementations (GQA, paged bf16 cache, page 16, shuffled page ids):
  attnc_call    ``attn.decode(q, k_cache=..., v_cache=..., block_table=..., kv_lens=...)``: the
                default config, planned in every call, no graph;
  attnc_graph   the same call captured once (``Kernel.decode_graph``) and replayed;
  attnc_cfg     fixed configs (BLOCK_N, splits, warps, stages) with the plan made once: the best
                of them is what the default is measured against;
  sdpa_*        SDPA on the same K/V stored contiguously (and replayed from a graph).
TFLOP/s count visible cells only (2 * (d_qk + d_v) * visible cells per (b, h): 4 * d when they
are equal); decode TB/s counts the K/V bytes a call must read once.
"""
from __future__ import annotations

import gc
import json
import math
import platform
import time
from dataclasses import dataclass, replace

import numpy as np

from .peers import fa4 as fa4_peer, flash_importable

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
          warmup: int = 50, rep: int = 300, post=None) -> dict | None:
    """Check ``fn``'s output, then time it: one row (or an error row).  ``check_call_ms`` is the
    wall time of the checking call (a compile, for a peer compiled on first use); ``post(row)``
    returns fields derived from the measurement, added before the row is written."""
    import torch
    import triton
    try:
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        check_ms = (time.perf_counter() - t0) * 1e3
        err = check(out)
        del out
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
           "check_call_ms": check_ms, "samples_ms": samples}
    derived = post(row) if post is not None else {}
    row.update(derived)
    rows.append(row)
    print(f"{label}: err {err:.1e}  {med * 1e3:8.1f} us  host {hus:6.1f} us  {rate or 0:7.1f} {unit}"
          + "".join(f"  {n} {x:.3f}" if isinstance(x, float) else f"  {n} {x}" for n, x in derived.items()), flush=True)
    return row


# ---------------------------------------------------------------- prefill
# Score programs the cases use: (the .attn statement, the float32 reference's score function on
# an [S_q, S_k] plane of head h, FlexAttention's score_mod).  The statement acts on the scaled score.
ALIBI_SCORE = "score = score - exp(-(h + 1) * log(2.0) * 8.0 / 16.0) * (q - k)"  # slopes 2^(-8(h+1)/16)
SOFTCAP_SCORE = "score = softcap(score, 30.0)"


def _alibi_reference(s, h, qi, ki):
    return s - math.exp(-(h + 1) * math.log(2.0) * 8.0 / 16.0) * (qi - ki).to(s.dtype)


def _alibi_flex():
    import torch
    return lambda s, b, h, q, k: s - torch.exp2(-(h + 1) * 8.0 / 16.0) * (q - k)


def _softcap_reference(s, h, qi, ki):
    import torch
    return 30.0 * torch.tanh(s / 30.0)


def _softcap_flex():
    import torch
    return lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)


SCORES = {
    "alibi": (ALIBI_SCORE, _alibi_reference, _alibi_flex),
    "softcap30": (SOFTCAP_SCORE, _softcap_reference, _softcap_flex),
}
DEVICE = "cuda"  # the prefill cases' device (the CPU only in the unit tests' dry run)
FLOP_FORMULA = "2 * (d_qk + d_v) * H_q * visible_cells (visible (q, k) cells of one head, summed over b)"
SDPA_BACKENDS = ("cudnn", "flash")


@dataclass(frozen=True)
class PrefillCase:
    """One prefill case of the bench: its mask (a ``PREFILL_MASKS`` name: the .attn mask, the Flex
    mask_mod and the reference's visibility all come from it), its score program (a ``SCORES``
    name or ""), its shapes (bhsd; GQA when ``heads_kv`` < ``heads``; ``d_v`` None: d_qk), the SDPA
    backends timed beside it, and whether its inputs are FP8 e4m3 (``attnc.fp8.quantize``)."""
    name: str
    mask: str = "causal"
    score: str = ""
    batch: int = 4
    heads: int = 16
    heads_kv: int | None = None
    d_qk: int = 128
    d_v: int | None = None
    seq: int = 8192
    sdpa: tuple[str, ...] = ()
    fp8: bool = False

    @property
    def h_kv(self) -> int:
        return self.heads_kv or self.heads

    @property
    def dv(self) -> int:
        return self.d_v or self.d_qk

    @property
    def gqa(self) -> bool:
        return self.h_kv != self.heads

    def spec(self) -> str:
        """The .attn text: shape-generic (heads and head dims come from the call), bf16 (the FP8
        case's too: its inputs are float8_e4m3fn with descales, O is in the spec's dtype)."""
        mask_src, decls = PREFILL_MASKS[self.mask]
        body = " ".join(x for x in (decls, SCORES[self.score][0] if self.score else "") if x)
        return spec_text(self.name, mask_src, body)

    def describe(self) -> str:
        heads = f"{self.heads}/{self.h_kv}" if self.gqa else f"{self.heads}"
        dims = f"{self.d_qk}/{self.dv}" if self.dv != self.d_qk else f"{self.d_qk}"
        return (f"B={self.batch} H={heads} S={self.seq} d={dims} {'fp8_e4m3' if self.fp8 else 'bf16'} "
                f"mask={self.mask}{' score=' + self.score if self.score else ''}")

    def flex_score_mod(self):
        return SCORES[self.score][2]() if self.score else None


def mask_case(name: str, batch: int = 4, heads: int = 16, seq: int = 8192, head_dim: int = 128) -> PrefillCase:
    """One of the five bench masks as a case (SDPA beside causal and full)."""
    if name not in PREFILL_MASKS:
        raise ValueError(f"unknown mask {name!r}; expected one of {', '.join(PREFILL_MASKS)}")
    return PrefillCase(name, mask=name, batch=batch, heads=heads, seq=seq, d_qk=head_dim,
                       sdpa=SDPA_BACKENDS if name in ("causal", "full") else ())


# Issue 21's cases: the five masks at B4 H16 S8192 d128, then the shapes and score programs.
PREFILL_CASES = {name: mask_case(name) for name in PREFILL_MASKS}
PREFILL_CASES.update({c.name: c for c in (
    PrefillCase("causal_s8000", seq=8000, sdpa=SDPA_BACKENDS),
    PrefillCase("causal_d64_h32", heads=32, d_qk=64, sdpa=SDPA_BACKENDS),
    PrefillCase("alibi", score="alibi"),
    PrefillCase("softcap30_gqa", score="softcap30", heads=32, heads_kv=8),
    PrefillCase("mla_192_128", d_qk=192, d_v=128),
    PrefillCase("causal_d256", d_qk=256, sdpa=SDPA_BACKENDS),
    PrefillCase("fp8_causal", fp8=True, sdpa=SDPA_BACKENDS),  # SDPA on fp8 inputs: tried, expected to refuse
)})

# Issue 21's done-criterion, per case (the summary's verdict).
ISSUE21_X_FLEX = 1.3          # attnc_call over FlexAttention's best mode, every case but FP8
ISSUE21_X_CUDNN = {"causal": 1.0, "full": 1.0, "causal_s8000": 0.95}
ISSUE21_VS_BF16 = {"fp8_causal": 1.4}  # FP8 causal over the same run's bf16 causal attnc_call
ISSUE21_FLEX_MODES = ("default", "max-autotune-no-cudagraphs")


def select_cases(text: str, batch: int | None = None, seq: int | None = None) -> list[PrefillCase]:
    """``all`` or a comma list of case names (``PREFILL_CASES``); ``batch`` / ``seq`` replace every
    case's (a smaller run: its rows say so, and the summary is then not issue 21's shapes)."""
    names = list(PREFILL_CASES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREFILL_CASES]
    if unknown or not names:
        raise ValueError(f"unknown case {unknown[0] if unknown else text!r}; expected 'all' or a comma list of "
                         f"{', '.join(PREFILL_CASES)}")
    cases = [PREFILL_CASES[n] for n in dict.fromkeys(names)]
    return [replace(c, **({"batch": batch} if batch else {}), **({"seq": seq} if seq else {})) for c in cases]


def prefill_flops(visible_cells: float, heads_q: int, d_qk: int, d_v: int) -> float:
    """FLOPs of a prefill call counting visible cells only (``FLOP_FORMULA``): Q.K^T is 2 d_qk and
    P.V 2 d_v per visible cell per (b, h); ``visible_cells`` is one head's count over the batch."""
    return 2.0 * (d_qk + d_v) * heads_q * visible_cells


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


def _mask_planes(name, s_q, s_k, tensors, device):
    """b -> [S_q, S_k] bool visibility of a bench mask (for the references)."""
    import torch
    qi = torch.arange(s_q, device=device)[:, None]
    ki = torch.arange(s_k, device=device)[None, :]
    if name == "causal_document":
        return lambda b: (qi >= ki) & (tensors["doc"][b][:s_q, None] == tensors["doc"][b][None, :s_k])
    fixed = {"causal": lambda: qi >= ki, "sliding_window_1024": lambda: (qi >= ki) & (qi - ki < 1024),
             "prefix_lm_2048": lambda: (qi >= ki) | (ki < 2048),
             "full": lambda: torch.ones(s_q, s_k, dtype=torch.bool, device=device)}
    plane = fixed[name]()
    return lambda b: plane


def reference_planes(case: PrefillCase, q, k, v, tensors: dict, planes) -> list:
    """float32 O of each (b, h) plane by dense masked softmax on q's device: scale 1/sqrt(d_qk),
    the case's score program on the scaled score, GQA by the query head's K/V head (h // group),
    d_v from v.  Rows that see no key are zero."""
    import torch
    group = q.shape[1] // k.shape[1]
    s_q, s_k = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    visible = _mask_planes(case.mask, s_q, s_k, tensors, q.device)
    qi = torch.arange(s_q, device=q.device)[:, None]
    ki = torch.arange(s_k, device=q.device)[None, :]
    score = SCORES[case.score][1] if case.score else None
    out = []
    for b, h in planes:
        s = (q[b, h].float() @ k[b, h // group].float().T) * scale
        if score is not None:
            s = score(s, h, qi, ki)
        s = s.masked_fill(~visible(b), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out.append(p @ v[b, h // group].float())
        del s, p
    return out


def plane_check(refs, planes):
    """o -> relative L2 error of o's planes against the references (o or (o, lse)); against all-zero
    references (a mask that shows no key: O is 0) the absolute L2 error, not 0 / 0."""
    def check(o):
        o = o[0] if isinstance(o, tuple) else o
        num = sum(((o[b, h].float() - r) ** 2).sum() for (b, h), r in zip(planes, refs))
        den = sum((r ** 2).sum() for r in refs)
        return float((num / den).sqrt()) if float(den) > 0 else float(num ** 0.5)
    return check


def _plan_stats(program, batch, seq, tensors):
    """(visible cells of one head over the batch, tile-class counts at 128 x 128, plan ms) from the
    mask analysis on the host."""
    from attnc.compiler.plan import plan as make_plan
    host = {n: t.cpu().numpy().astype(np.int64) for n, t in tensors.items()}
    t0 = time.perf_counter()
    p = make_plan(program, batch, seq, seq, host, 128, 128)
    plan_ms = (time.perf_counter() - t0) * 1e3
    per_column = p.intervals.visible.must.cells_in(0, p.s_q).reshape(p.intervals.shape)
    visible = int(np.broadcast_to(per_column.sum(-1)[:, :1], (batch, 1)).sum())
    return visible, p.tiles.counts(), plan_ms


def _case_key(attn, program, case, batch, seq):
    """The dispatch key of the case's call; FP8 rows carry the key of the fp8 specialisation where
    the compiler has one, else the bf16 one (the row's ``key_note`` says so)."""
    if case.fp8:
        try:
            return call_key(attn.specialize(case.heads, case.h_kv, case.d_qk, case.dv, "fp8_e4m3"), batch, seq,
                            seq), None
        except Exception as e:  # noqa: BLE001 - the key is a label here, not the measurement
            return call_key(program, batch, seq, seq), (f"dispatch key of the bf16 specialisation (no fp8 key: "
                                                         f"{type(e).__name__}: {str(e)[:160]})")
    return call_key(program, batch, seq, seq), None


def _error_row(rows, record, label, e):
    rows.append({**record, "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
    print(f"{label}: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)


def run_prefill(batch=4, heads=16, seq=8192, head_dim=128, masks=None, out=None, seed=0, command="",
                flex_modes=ISSUE21_FLEX_MODES, sdpa=True, kernel_alone=True, cases=None, issue21=False,
                flex_flash=True, fa4=True):
    """Time every case (``cases``: ``PrefillCase`` s; default the bench masks ``masks`` at the given
    shape) in this process; with ``issue21``, end with issue 21's summary table and its JSON row."""
    import torch

    if cases is None:
        cases = [mask_case(name, batch, heads, seq, head_dim) for name in masks or GOAL_MASKS]
    rows = Rows(out, command)
    env = environment()
    start = time.perf_counter()
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case.name}: {case.describe()}  ({time.perf_counter() - start:.0f} s so far)",
              flush=True)
        try:
            _run_case(case, rows, env, seed, flex_modes, sdpa, kernel_alone, flex_flash, fa4)
        except Exception as e:  # noqa: BLE001 - a case that fails outside timed() (inputs, plan) is a row
            _error_row(rows, {"bench": "prefill", "case": case.name, "impl": "case", "env": env},
                       f"{case.name} (setup)", e)
        finally:
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    print(f"prefill: {len(cases)} cases in {time.perf_counter() - start:.0f} s", flush=True)
    if issue21:
        s = issue21_summary(rows, flex_modes=flex_modes)
        rows.append({"bench": "issue21_summary", **s})
        print(format_issue21(s), flush=True)
    return list(rows)


def _run_case(case: PrefillCase, rows: Rows, env: dict, seed: int, flex_modes, sdpa: bool, kernel_alone: bool,
              flex_flash: bool = True, fa4: bool = True):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attnc
    from attnc.compiler import inputs

    B, H, H_kv, d_qk, d_v, S = case.batch, case.heads, case.h_kv, case.d_qk, case.dv, case.seq
    attn = attnc.compile(case.spec())  # shape-generic: heads, head dims from the call
    program = attn.specialize(H, H_kv, d_qk, d_v, "bf16")  # (FP8: the mask analysis and the key's fallback)
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # each case's inputs whatever ran before it
    q = torch.randn(B, H, S, d_qk, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, H_kv, S, d_qk, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, H_kv, S, d_v, device=DEVICE, dtype=torch.bfloat16, generator=g)
    tensors = {}
    if program.tensors:
        sample = inputs.sample_tensors(program, B, S, seed)  # (q, k, v are drawn on the GPU)
        tensors = {t.name: torch.as_tensor(sample[t.name].astype(np.int32), device=DEVICE) for t in program.tensors}
    visible, counts, plan_ms = _plan_stats(program, B, S, tensors)
    flops = prefill_flops(visible, H, d_qk, d_v)
    planes = [(0, 0), (B - 1, H - 1)]
    refs = reference_planes(case, q, k, v, tensors, planes)  # FP8: of the original bf16 inputs
    check = plane_check(refs, planes)
    tol = 8e-2 if case.fp8 else 1e-2  # FP8: e4m3 inputs and P; measured 0.048-0.054 at S = 8K (bench/fp8_study.py)
    key, key_note = _case_key(attn, program, case, B, S)
    record = {"_key": key, "bench": "prefill", "case": case.name, "mask": case.mask,
              "score": SCORES[case.score][0] if case.score else "", "spec": case.spec(),
              "B": B, "H": H, "H_kv": H_kv, "S": S, "D": d_qk, "d_qk": d_qk, "d_v": d_v,
              "dtype": "fp8_e4m3" if case.fp8 else "bf16", "layout": "bhsd",
              "visible_cells": visible, "density": visible / (B * S * S), "flops": flops, "flop_formula": FLOP_FORMULA,
              "tiles_128": counts, "plan_ms": plan_ms, "env": env,
              "reference": (f"float32 dense softmax on GPU{' of the original bf16 inputs' if case.fp8 else ''}"
                            f"{', score ' + case.score if case.score else ''}, (b,h) in {planes}"),
              "tolerance_rel_l2": tol}
    if key_note:
        record["key_note"] = key_note
    label = f"{case.name:20}"
    args, extra, post = (q, k, v), {}, None
    if case.fp8:
        bf16_rate, source = _bf16_causal_rate(rows, case)
        if bf16_rate is None:  # no bf16 causal row at this shape in this run: time one on these inputs
            base = attnc.compile(mask_case("causal").spec())
            base(q, k, v)
            row = timed(lambda: base(q, k, v), check,
                        {**record, "_key": call_key(program, B, S, S), "impl": "attnc_call_bf16", "dtype": "bf16",
                         "tolerance_rel_l2": 1e-2, "spec": mask_case("causal").spec()},
                        rows, f"{label} bf16_call    ", flops, "TFLOPs")
            bf16_rate, source = (row["TFLOPs"], "attnc_call_bf16 row of this case") if row else (None, None)
        record.update(bf16_causal_TFLOPs=bf16_rate, bf16_causal_source=source,
                      quantize="attnc.fp8.quantize: per-(b,h) float32 descales; v transposed=True")
        try:
            import attnc.fp8
            t0 = time.perf_counter()
            q8, dq = attnc.fp8.quantize(q)
            k8, dk = attnc.fp8.quantize(k)
            v8, dv = attnc.fp8.quantize(v, transposed=True)
            torch.cuda.synchronize()
            record["quantize_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001
            _error_row(rows, {**record, "impl": "attnc_call"}, f"{label} fp8 quantize", e)
            return
        args, extra = (q8, k8, v8), {"q_descale": dq, "k_descale": dk, "v_descale": dv}

        def post(row):
            rate = row.get("TFLOPs")
            return {"vs_bf16_causal": rate / bf16_rate if rate and bf16_rate else None}

    # the public call: no plan passed, the default config
    try:
        t0 = time.perf_counter()
        attn(*args, **tensors, **extra)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        be, kernel = attn._kernel_for(*args, tensors, None)
        backend = be.name
    except Exception as e:  # noqa: BLE001
        _error_row(rows, {**record, "impl": "attnc_call"}, f"{label} attnc_call", e)
        return
    try:
        config = kernel.config_for(*args, **tensors, **extra).describe()
    except Exception as e:  # noqa: BLE001 - the label is missing, the call is still timed
        config = {"error": f"config_for: {type(e).__name__}: {str(e)[:300]}"}
    timed(lambda: attn(*args, **tensors, **extra), check,
          {**record, "impl": "attnc_call", "backend": backend, "config": config, "first_call_ms": first_ms},
          rows, f"{label} attnc_call   ", flops, "TFLOPs", tol=tol, post=post)
    if kernel_alone:
        try:
            run = kernel.prepare(*args, **tensors, **extra)
        except Exception as e:  # noqa: BLE001
            _error_row(rows, {**record, "impl": "attnc_kernel", "backend": backend}, f"{label} attnc_kernel", e)
        else:
            timed(run, check, {**record, "impl": "attnc_kernel", "backend": backend, "config": run.config.describe()},
                  rows, f"{label} attnc_kernel ", flops, "TFLOPs", tol=tol, post=post)
            del run
    if flex_modes and not case.fp8:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.reset()
        try:
            t0 = time.perf_counter()
            block_mask = create_block_mask(_flex_mask_mod(case.mask, tensors), B if tensors else None, None, S, S,
                                           device=DEVICE)
            torch.cuda.synchronize()
            bm_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001
            for mode in flex_modes:
                _error_row(rows, {**record, "impl": f"flex_{mode}", "flex_mode": mode}, f"{label} flex block mask", e)
            block_mask = None
        if block_mask is not None:
            flex_kw = {"block_mask": block_mask, "scale": 1.0 / math.sqrt(d_qk)}
            if case.score:
                flex_kw["score_mod"] = case.flex_score_mod()
            if case.gqa:
                flex_kw["enable_gqa"] = True
            for mode in flex_modes:
                torch._dynamo.reset()  # each mode compiles afresh (no recompile limit, no shared cache entry)
                # ("eager": flex_attention uncompiled, slow; for checking the bench itself)
                compiled = (flex_attention if mode == "eager" else torch.compile(flex_attention) if mode == "default"
                            else torch.compile(flex_attention, mode=mode))
                print(f"{label} flex_{mode}: {'running' if mode == 'eager' else 'compiling'}", flush=True)
                timed(lambda: compiled(q, k, v, **flex_kw), check,
                      {**record, "impl": f"flex_{mode}", "flex_mode": mode, "block_mask_ms": bm_ms,
                       "config": {"flex_mode": mode, "score_mod": case.score or None, "enable_gqa": case.gqa,
                                  "block_mask": f"create_block_mask(B={B if tensors else None}, H=None), made once"}},
                      rows, f"{label} flex_{mode[:8]}", flops, "TFLOPs", tol=tol)
                del compiled
            if flex_flash and not flash_importable():
                print(f"{label} flex_flash: skipped (its FLASH backend needs flash_attn.cute, not importable)",
                      flush=True)
            elif flex_flash:
                torch._dynamo.reset()
                compiled = torch.compile(flex_attention)
                print(f"{label} flex_flash: compiling", flush=True)
                timed(lambda: compiled(q, k, v, **flex_kw, kernel_options={"BACKEND": "FLASH"}), check,
                      {**record, "impl": "flex_flash", "flex_mode": "default", "block_mask_ms": bm_ms,
                       "config": {"flex_mode": "default", "kernel_options": {"BACKEND": "FLASH"},
                                  "score_mod": case.score or None, "enable_gqa": case.gqa}},
                      rows, f"{label} flex_flash", flops, "TFLOPs", tol=tol)
                del compiled
            del block_mask
    if fa4 and not case.fp8 and case.score in ("", "softcap30"):
        peer = fa4_peer(case.mask, q, k, v, tensors, softcap=30.0 if case.score == "softcap30" else 0.0)
        if isinstance(peer, str):
            print(f"{label} fa4: skipped ({peer})", flush=True)
        else:
            forward, _, to_bhsd = peer

            def fa4_call(forward=forward, to_bhsd=to_bhsd):
                with torch.no_grad():
                    return to_bhsd(forward())
            timed(fa4_call, check, {**record, "impl": "fa4", "layout": "bshd (its own copies, made once)"},
                  rows, f"{label} fa4         ", flops, "TFLOPs", tol=tol)
            del forward, peer
    if sdpa and case.sdpa:
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        sdpa_args = args  # FP8: the quantized tensors, no descales (SDPA has none): a refusal is the expected row
        for name in case.sdpa:
            def fn(backend=backends[name]):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(*sdpa_args, is_causal=case.mask == "causal")
            timed(fn, check, {**record, "impl": f"sdpa_{name}"}, rows, f"{label} sdpa_{name:7}", flops, "TFLOPs",
                  tol=tol)
    del q, k, v, args, extra, refs


def _bf16_causal_rate(rows, case: PrefillCase):
    """The bf16 causal attnc_call TFLOP/s of this run at the FP8 case's shape, and where it came from."""
    for r in rows:
        if (r.get("case") == "causal" and r.get("impl") == "attnc_call" and r.get("pass")
                and (r["B"], r["H"], r["S"], r["d_qk"]) == (case.batch, case.heads, case.seq, case.d_qk)):
            return r["TFLOPs"], "case causal of this run"
    return None, None


def _visible_cells(program, batch, seq, tensors) -> int:
    """Visible (query, key) cells of one head over the batch, exactly, from the analysis' row sets
    (no S x S evaluation)."""
    return _plan_stats(program, batch, seq, tensors)[0]


def _dense_visible(program, seq, tensors):
    """b -> [S, S] bool visibility on the GPU for the bench masks (for the reference)."""
    return _mask_planes(program.name.removeprefix("bench_"), seq, seq, tensors, "cuda")


# ---------------------------------------------------------------- issue 21's summary
def _check(name, value, threshold, ok=None):
    if ok is None and value is not None:
        ok = value >= threshold
    return {"check": name, "value": value, "threshold": threshold, "ok": ok}


def issue21_summary(rows, flex_modes=ISSUE21_FLEX_MODES) -> dict:
    """Issue 21's done-criterion over a run's prefill rows: per case attnc_call TFLOP/s, x Flex best
    (the best mode that passed its check), x cuDNN, and a verdict: ``pass`` (every check met),
    ``fail`` (one missed, or the call failed its check), ``incomplete`` (a peer is missing; an x Flex
    at or above 1.3 without the max-autotune mode tried is incomplete: that mode can only raise
    Flex's best).  The run's verdict is ``pass`` only with every case of ``PREFILL_CASES``."""
    by_case: dict[str, list] = {}
    for r in rows:
        if r.get("bench") == "prefill" and "case" in r:
            by_case.setdefault(r["case"], []).append(r)
    out = []
    for name, rs in by_case.items():
        impl = {}
        for r in rs:
            impl.setdefault(r["impl"], r)
        first = rs[0]
        call = impl.get("attnc_call")
        call_ok = bool(call and call.get("pass") and "error" not in call)
        rate = call["TFLOPs"] if call_ok else None

        def ok_rate(name):
            r = impl.get(name)
            return r["TFLOPs"] if r and r.get("pass") and r.get("TFLOPs") else None

        flex = {r["flex_mode"]: (r["TFLOPs"] if r.get("pass") else None) for r in rs
                if r["impl"].startswith("flex_") and "flex_mode" in r}
        passed = {m: t for m, t in flex.items() if t}
        best_mode = max(passed, key=passed.get) if passed else None
        flex_best = passed.get(best_mode)
        cudnn = ok_rate("sdpa_cudnn")
        x_flex = rate / flex_best if rate and flex_best else None
        x_cudnn = rate / cudnn if rate and cudnn else None
        fp8 = name in ISSUE21_VS_BF16 or str(first.get("dtype", "")).startswith("fp8")
        vs_bf16 = call.get("vs_bf16_causal") if call_ok else None
        checks = [_check("attnc_call passes its reference check", None, None, ok=call_ok)]
        if fp8:
            checks.append(_check("vs_bf16_causal", vs_bf16, ISSUE21_VS_BF16.get(name, 1.4)))
        else:
            c = _check("x_flex_best", x_flex, ISSUE21_X_FLEX)
            autotuned = "max-autotune-no-cudagraphs" in flex or "max-autotune" in flex
            if c["ok"] and not autotuned:
                c.update(ok=None, note="Flex max-autotune not run: its best may be higher")
            checks.append(c)
        if name in ISSUE21_X_CUDNN:
            checks.append(_check("x_cudnn", x_cudnn, ISSUE21_X_CUDNN[name]))
        oks = [c["ok"] for c in checks]
        verdict = "fail" if False in oks else "incomplete" if None in oks else "pass"
        out.append({"case": name, "B": first.get("B"), "H": first.get("H"), "H_kv": first.get("H_kv"),
                    "S": first.get("S"), "d_qk": first.get("d_qk", first.get("D")), "d_v": first.get("d_v"),
                    "dtype": first.get("dtype"), "attnc_call_TFLOPs": rate,
                    "attnc_call_host_us": call.get("host_us") if call_ok else None,
                    "attnc_call_error": (call or {}).get("error") if not call_ok else None,
                    "attnc_kernel_TFLOPs": ok_rate("attnc_kernel"), "flex_TFLOPs": flex,
                    "flex_best_TFLOPs": flex_best, "flex_best_mode": best_mode, "x_flex": x_flex,
                    "cudnn_TFLOPs": cudnn, "x_cudnn": x_cudnn, "flash_TFLOPs": ok_rate("sdpa_flash"),
                    "vs_bf16_causal": vs_bf16, "checks": checks, "verdict": verdict})
    missing = [n for n in PREFILL_CASES if n not in by_case]
    verdicts = [c["verdict"] for c in out]
    overall = "fail" if "fail" in verdicts else "incomplete" if (missing or "incomplete" in verdicts) else "pass"
    return {"verdict": overall, "missing_cases": missing, "flex_modes": list(flex_modes or ()),
            "thresholds": {"x_flex": ISSUE21_X_FLEX, "x_cudnn": ISSUE21_X_CUDNN, "vs_bf16_causal": ISSUE21_VS_BF16},
            "flop_formula": FLOP_FORMULA, "cases": out}


def _why(check: dict) -> str:
    """Why a check is not met, in words."""
    if check.get("note"):
        return f"{check['check']} {check['value']:.3f}: {check['note']}"
    if check["value"] is not None:
        return f"{check['check']} {check['value']:.3f} < {check['threshold']}"
    if check["threshold"] is None:
        return f"not {check['check']}" if check["ok"] is False else check["check"]
    return f"{check['check']}: not measured"


def format_issue21(summary: dict) -> str:
    def f(x, fmt="7.1f"):
        return format(x, fmt) if isinstance(x, (int, float)) else f"{'-':>{int(fmt.split('.')[0])}}"
    lines = [f"issue 21 (visible-cell TFLOP/s, {summary['flop_formula']})",
             f"{'case':18} {'shape':24} {'attnc':>7} {'flex':>7} {'x flex':>7} {'cuDNN':>7} {'x cuDNN':>7} "
             f"{'vs bf16':>7}  verdict"]
    for c in summary["cases"]:
        heads = f"{c['H']}/{c['H_kv']}" if c.get("H_kv") not in (None, c["H"]) else f"{c['H']}"
        dims = f"{c['d_qk']}/{c['d_v']}" if c.get("d_v") not in (None, c["d_qk"]) else f"{c['d_qk']}"
        shape = f"B{c['B']} H{heads} S{c['S']} d{dims}"
        why = [_why(x) for x in c["checks"] if x["ok"] is not True]
        lines.append(f"{c['case']:18} {shape:24} {f(c['attnc_call_TFLOPs'])} {f(c['flex_best_TFLOPs'])} "
                     f"{f(c['x_flex'], '7.3f')} {f(c['cudnn_TFLOPs'])} {f(c['x_cudnn'], '7.3f')} "
                     f"{f(c['vs_bf16_causal'], '7.3f')}  {c['verdict']}{' (' + '; '.join(why) + ')' if why else ''}")
    if summary["missing_cases"]:
        lines.append(f"not run: {', '.join(summary['missing_cases'])}")
    lines.append(f"issue 21 verdict: {summary['verdict']}")
    return "\n".join(lines)


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
        case = (r["bench"], r.get("case", r.get("mask", "")), r.get("B"), r.get("S", r.get("T")), r.get("phase", ""))
        best = cases.setdefault(case, {})
        if r["impl"] not in best or r["median_ms"] < best[r["impl"]]["median_ms"]:
            best[r["impl"]] = r
    for case, impls in cases.items():
        out.append(" ".join(str(c) for c in case))
        for impl, r in sorted(impls.items(), key=lambda kv: kv[1]["median_ms"]):
            rate = r.get("TFLOPs") or r.get("TBps") or 0
            out.append(f"   {impl:32} {r['median_ms'] * 1e3:9.1f} us  host {r['host_us']:7.1f} us  {rate:7.2f}")
    return "\n".join(out)
