"""Issue 21's prefill cases (bench/harness.py): the table is well-formed, each case's float32
reference agrees with attnc's numpy backend on a tiny CPU shape (score programs, GQA,
d_qk != d_v), the FLOP count, the summary's verdicts on synthetic rows, and the CLI's options.
No GPU: the GPU run is ``attnc bench prefill --cases all``."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import attnc
from attnc.bench import harness as H
from attnc.compiler.cli import build_parser

ISSUE21 = ["causal", "sliding_window_1024", "causal_document", "prefix_lm_2048", "full", "causal_s8000",
           "causal_d64_h32", "alibi", "softcap30_gqa", "mla_192_128", "causal_d256", "fp8_causal"]


def test_the_table_holds_issue_21s_cases_at_their_shapes():
    assert list(H.PREFILL_CASES) == ISSUE21
    for name, c in H.PREFILL_CASES.items():
        assert c.name == name and c.mask in H.PREFILL_MASKS and (not c.score or c.score in H.SCORES)
        assert c.batch == 4 and set(c.sdpa) <= set(H.SDPA_BACKENDS)
        assert c.seq == (8000 if name == "causal_s8000" else 8192)
        # SDPA only beside plain causal / full (and FP8, where a refusal is the expected row)
        assert bool(c.sdpa) == (not c.score and c.mask in ("causal", "full") and c.dv == c.d_qk)
    C = H.PREFILL_CASES
    assert (C["causal_d64_h32"].heads, C["causal_d64_h32"].d_qk) == (32, 64)
    assert (C["softcap30_gqa"].heads, C["softcap30_gqa"].h_kv, C["softcap30_gqa"].gqa) == (32, 8, True)
    assert (C["mla_192_128"].d_qk, C["mla_192_128"].dv) == (192, 128)
    assert C["causal_d256"].d_qk == C["causal_d256"].dv == 256
    assert [n for n, c in C.items() if c.fp8] == ["fp8_causal"] and C["fp8_causal"].mask == "causal"
    assert "score = score - exp(-(h + 1) * log(2.0) * 8.0 / 16.0) * (q - k)" in C["alibi"].spec()
    assert "score = softcap(score, 30.0)" in C["softcap30_gqa"].spec()
    # the five masks keep the bench's spec text (and so its programs) from before the table
    for m, (mask, decls) in H.PREFILL_MASKS.items():
        assert C[m].spec() == H.spec_text(m, mask, decls)
    assert set(H.ISSUE21_X_CUDNN) == {"causal", "full", "causal_s8000"} and set(H.ISSUE21_VS_BF16) == {"fp8_causal"}


@pytest.mark.parametrize("name", ISSUE21)
def test_each_spec_compiles_and_specializes_at_its_shape(name):
    c = H.PREFILL_CASES[name]
    attn = attnc.compile(c.spec())
    p = attn.specialize(c.heads, c.h_kv, c.d_qk, c.dv, "bf16")
    assert (p.heads_q, p.heads_kv, p.d_qk, p.d_v) == (c.heads, c.h_kv, c.d_qk, c.dv)
    assert bool(p.score) == bool(c.score)
    assert "dtype = bf16" in c.spec()  # (FP8 too: float8 inputs with descales, O in the spec's dtype)


def _tiny(case):
    """B=1, S=64 and small heads of the case's kind: GQA 4/2, MLA-like d 24/16, else H=2 d=16."""
    heads, heads_kv = (4, 2) if case.gqa else (2, 2)
    d_qk, d_v = (24, 16) if case.dv != case.d_qk else (16, 16)
    g = torch.Generator().manual_seed(1)
    # scaled up so that softcap 30 and the masks' rows matter (scores of tens)
    q = 3 * torch.randn(1, heads, 64, d_qk, dtype=torch.float64, generator=g)
    k = 3 * torch.randn(1, heads_kv, 64, d_qk, dtype=torch.float64, generator=g)
    v = torch.randn(1, heads_kv, 64, d_v, dtype=torch.float64, generator=g)
    tensors = {}
    if case.mask == "causal_document":  # three documents
        tensors["doc"] = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14], dtype=torch.int32)
    return q, k, v, tensors


@pytest.mark.parametrize("name", [n for n in ISSUE21 if not H.PREFILL_CASES[n].fp8])
def test_reference_agrees_with_the_numpy_backend(name):
    case = H.PREFILL_CASES[name]
    q, k, v, tensors = _tiny(case)
    o = attnc.compile(case.spec())(q, k, v, **tensors)  # CPU float64: the numpy backend's float64 path
    planes = [(0, h) for h in range(q.shape[1])]
    refs = H.reference_planes(case, q, k, v, tensors, planes)
    assert refs[0].shape == (64, v.shape[-1])
    err = H.plane_check(refs, planes)(o)
    assert err < 1e-5, err
    # ... and the check sees a wrong answer: the reference without the case's score program or mask
    wrong = H.reference_planes(H.PrefillCase("x", mask="full"), q, k, v, tensors, planes)
    if name not in ("full", "prefix_lm_2048"):  # (a prefix of 2048 keys is all of 64)
        assert H.plane_check(wrong, planes)(o) > 1e-3


def test_softcap_and_alibi_references_differ_from_plain_causal():
    """(the tiny inputs exercise the score programs: neither reference is plain causal's)"""
    plain = H.PREFILL_CASES["causal"]
    for name in ("alibi", "softcap30_gqa"):
        case = H.PREFILL_CASES[name]
        q, k, v, tensors = _tiny(case)
        planes = [(0, 0), (0, q.shape[1] - 1)]
        a = H.reference_planes(case, q, k, v, tensors, planes)
        b = H.reference_planes(plain, q, k, v, tensors, planes)
        for x, y in zip(a, b):
            assert float((x - y).norm() / y.norm()) > 1e-2


def test_flop_count_is_2_dqk_plus_dv_per_visible_cell():
    case = H.PREFILL_CASES["causal"]
    program = attnc.compile(case.spec()).specialize(2, 2, 24, 16, "bf16")
    visible, counts, plan_ms = H._plan_stats(program, 2, 64, {})
    assert visible == 2 * 64 * 65 // 2 and plan_ms >= 0
    assert H.prefill_flops(visible, 2, 24, 16) == 2 * (24 + 16) * 2 * visible
    assert H.prefill_flops(visible, 16, 128, 128) == 4 * 128 * 16 * visible  # the old 4 d per cell
    full = attnc.compile(H.PREFILL_CASES["full"].spec()).specialize(2, 2, 16, 16, "bf16")
    assert H._visible_cells(full, 3, 64, {}) == 3 * 64 * 64
    assert "2 * (d_qk + d_v)" in H.FLOP_FORMULA


# ---------------------------------------------------------------- the summary's verdicts
def _rows(name, call=None, flex=None, cudnn=None, vs_bf16=None, dtype="bf16", call_error=None):
    base = {"bench": "prefill", "case": name, "B": 4, "H": 16, "H_kv": 16, "S": 8192, "d_qk": 128, "d_v": 128,
            "dtype": dtype}
    rows = []
    if call_error:
        rows.append({**base, "impl": "attnc_call", "error": call_error})
    elif call is not None:
        rows.append({**base, "impl": "attnc_call", "pass": call > 0, "TFLOPs": abs(call), "host_us": 20.0,
                     **({"vs_bf16_causal": vs_bf16} if vs_bf16 is not None else {})})
    for mode, t in (flex or {}).items():
        rows.append({**base, "impl": f"flex_{mode}", "flex_mode": mode,
                     **({"error": "boom"} if t is None else {"pass": True, "TFLOPs": t})})
    if cudnn is not None:
        rows.append({**base, "impl": "sdpa_cudnn", "pass": True, "TFLOPs": cudnn})
    return rows


BOTH = "max-autotune-no-cudagraphs"


def _verdicts(rows):
    s = H.issue21_summary(rows)
    return s, {c["case"]: c["verdict"] for c in s["cases"]}


def test_summary_verdicts():
    rows = (_rows("causal", 540.0, {"default": 400.0, BOTH: 410.0}, cudnn=550.0)   # 1.317x Flex, 0.98x cuDNN
            + _rows("full", 600.0, {"default": 420.0, BOTH: 440.0}, cudnn=590.0)   # 1.36x, 1.017x
            + _rows("alibi", 430.0, {"default": 372.0, BOTH: 380.0})               # 1.13x Flex
            + _rows("mla_192_128", 470.0, {"default": 300.0, BOTH: None})          # autotune failed: best = default
            + _rows("causal_d256", 560.0, {"default": 300.0})                      # autotune not run
            + _rows("softcap30_gqa", 350.0, {"default": 300.0})                    # 1.17x: fails whatever autotune does
            + _rows("causal_s8000", 530.0, {"default": 380.0, BOTH: 390.0}, cudnn=560.0)  # 0.946x cuDNN
            + _rows("causal_d64_h32", -400.0, {"default": 200.0, BOTH: 210.0})     # our call failed its check
            + _rows("fp8_causal", 800.0, vs_bf16=1.48, dtype="fp8_e4m3")
            + _rows("prefix_lm_2048", call_error="RuntimeError: x")
            + _rows("sliding_window_1024", 420.0, {"default": None, BOTH: None}))  # no Flex row passed
    s, v = _verdicts(rows)
    assert v == {"causal": "fail", "full": "pass", "alibi": "fail", "mla_192_128": "pass",
                 "causal_d256": "incomplete", "softcap30_gqa": "fail", "causal_s8000": "fail",
                 "causal_d64_h32": "fail", "fp8_causal": "pass", "prefix_lm_2048": "fail",
                 "sliding_window_1024": "incomplete"}
    c = {x["case"]: x for x in s["cases"]}
    assert c["causal"]["x_flex"] == pytest.approx(540 / 410) and c["causal"]["flex_best_mode"] == BOTH
    assert c["causal"]["x_cudnn"] == pytest.approx(540 / 550)
    assert c["mla_192_128"]["flex_best_mode"] == "default" and c["mla_192_128"]["flex_TFLOPs"][BOTH] is None
    assert c["fp8_causal"]["vs_bf16_causal"] == 1.48 and c["fp8_causal"]["x_flex"] is None
    assert c["prefix_lm_2048"]["attnc_call_error"] == "RuntimeError: x"
    assert s["verdict"] == "fail" and s["missing_cases"] == ["causal_document"]
    text = H.format_issue21(s)
    assert "issue 21 verdict: fail" in text and "x_cudnn 0.946 < 0.95" in text and "not run: causal_document" in text
    assert "Flex max-autotune not run" in text


def test_summary_passes_only_with_every_case_met():
    good = []
    for name, case in H.PREFILL_CASES.items():
        if case.fp8:
            good += _rows(name, 800.0, vs_bf16=1.45, dtype="fp8_e4m3")
        else:
            good += _rows(name, 540.0, {"default": 400.0, BOTH: 410.0},
                          cudnn=530.0 if name in H.ISSUE21_X_CUDNN else None)
    s, v = _verdicts(good)
    assert set(v.values()) == {"pass"} and s["verdict"] == "pass" and s["missing_cases"] == []
    s, _ = _verdicts([r for r in good if r["case"] != "alibi"])
    assert s["verdict"] == "incomplete"
    low_fp8 = [dict(r, vs_bf16_causal=1.39) if r["case"] == "fp8_causal" else r for r in good]
    s, v = _verdicts(low_fp8)
    assert v["fp8_causal"] == "fail" and s["verdict"] == "fail"
    no_cudnn = [r for r in good if not (r["case"] == "full" and r["impl"] == "sdpa_cudnn")]
    assert _verdicts(no_cudnn)[1]["full"] == "incomplete"


def test_runs_combine_flex_modes_but_judge_the_first_runs_call(tmp_path):
    """``bench.issue21_combine``: a later run (Flex max-autotune) adds its Flex rows; its own attnc
    rows never replace the main run's call."""
    import json
    from attnc.bench.issue21_combine import combine
    main, extra = tmp_path / "main.jsonl", tmp_path / "autotune.jsonl"
    main.write_text("".join(json.dumps(r) + "\n" for r in _rows("causal", 540.0, {"default": 400.0}, cudnn=530.0)))
    extra.write_text("".join(json.dumps(r) + "\n" for r in _rows("causal", 900.0, {BOTH: 410.0})))
    s = combine(str(main), str(extra))
    c = s["cases"][0]
    assert c["attnc_call_TFLOPs"] == 540.0 and c["flex_best_mode"] == BOTH and c["x_flex"] == pytest.approx(540 / 410)
    assert c["verdict"] == "pass" and s["runs"] == [str(main), str(extra)] and BOTH in s["flex_modes"]


# ---------------------------------------------------------------- the command line
def test_cases_option_selects_and_scales():
    assert [c.name for c in H.select_cases("all")] == ISSUE21
    picked = H.select_cases("alibi, fp8_causal,alibi", batch=1, seq=1024)
    assert [(c.name, c.batch, c.seq, c.heads) for c in picked] == [("alibi", 1, 1024, 16), ("fp8_causal", 1, 1024, 16)]
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        H.select_cases("causal,nope")
    args = build_parser().parse_args(["bench", "prefill", "--out", "x.jsonl", "--cases", "all", "--flex-modes",
                                      "default"])
    assert (args.cases, args.flex_modes, args.batch, args.heads, args.masks) == ("all", "default", None, None, None)
    from attnc.compiler.cli import _bench_shape
    assert _bench_shape(args) == {"batch": 4, "heads": 16, "seq": 8192, "head_dim": 128}
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert all(name in " ".join(bench.format_help().split()) for name in ISSUE21)  # --cases' help names them
    args = build_parser().parse_args(["bench", "prefill", "--out", "x.jsonl", "--masks", "causal", "--seq", "2048"])
    assert _bench_shape(args)["seq"] == 2048 and args.flex_modes == "default,max-autotune-no-cudagraphs"


def test_mask_cases_keep_the_old_bench_options():
    c = H.mask_case("full", batch=1, heads=8, seq=2048, head_dim=64)
    assert (c.batch, c.heads, c.seq, c.d_qk, c.dv, c.sdpa) == (1, 8, 2048, 64, 64, H.SDPA_BACKENDS)
    assert H.mask_case("causal_document").sdpa == ()
    with pytest.raises(ValueError):
        H.mask_case("alibi")
    assert math.isclose(H._alibi_reference(torch.zeros(1, 1), 1, torch.tensor([[3]]), torch.tensor([[1]])).item(),
                        -2 * 2 ** -1.0, rel_tol=1e-6)
    assert np.isclose(H._softcap_reference(torch.tensor([300.0]), 0, None, None).item(), 30 * math.tanh(10.0))


# ---------------------------------------------------------------- a dry run of the bench on the CPU
def test_dry_run_on_the_cpu_writes_every_row_and_the_summary(tmp_path, monkeypatch):
    """run_prefill end to end on tiny shapes, on the CPU: the public call runs the numpy backend,
    Flex runs uncompiled ("eager"), SDPA's GPU backends and the kernel alone refuse (error rows),
    and FP8 has no attnc.fp8 here (an error row); timing is faked.  Checks the flow and the rows,
    not any speed."""
    import json
    import triton.testing
    monkeypatch.setattr(H, "DEVICE", "cpu")
    monkeypatch.setattr(H, "environment", lambda: {"gpu": "none (dry run)"})
    monkeypatch.setattr(H, "host_us", lambda fn, calls=40: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    def do_bench(fn, warmup, rep, return_mode):
        fn()
        return [1.0] * 30  # 30 samples of 1 ms
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    cases = H.select_cases("causal,causal_document,alibi,softcap30_gqa,mla_192_128,fp8_causal", batch=1, seq=64)
    cases = [replace(c, heads=4, heads_kv=2 if c.gqa else None, d_qk=24 if c.dv != c.d_qk else 16,
                       d_v=16) for c in cases]
    out = tmp_path / "rows.jsonl"
    rows = H.run_prefill(cases=cases, out=str(out), command="attnc bench prefill --cases ...", flex_modes=("eager",),
                         issue21=True)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("impl") for r in written] == [r.get("impl") for r in rows]
    assert all(r["command"] == "attnc bench prefill --cases ..." for r in written)
    by = {(r.get("case"), r.get("impl")): r for r in rows}
    for c in cases:
        call = by[(c.name, "attnc_call")]
        if c.fp8:  # an error row where attnc.fp8 or the FP8 call is missing; else checked against bf16
            assert call["bf16_causal_source"] == "case causal of this run"
            assert "error" in call or (not call["pass"] or call["vs_bf16_causal"] == pytest.approx(1.0))
            continue
        assert call["pass"] and call["rel_l2_error"] < 1e-2 and call["measurement"]["samples"] == [1.0] * 30
        assert call["flops"] == H.prefill_flops(call["visible_cells"], c.heads, c.d_qk, c.dv)
        assert call["flop_formula"] == H.FLOP_FORMULA and call["host_us"] == 1.0 and "first_call_ms" in call
        flex = by[(c.name, "flex_eager")]
        assert flex["pass"] and flex["flex_mode"] == "eager" and flex["dispatch"]["config"]["flex_mode"] == "eager"
        assert "error" in by[(c.name, "attnc_kernel")]  # (the numpy backend has no bound launch)
    assert "error" in by[("causal", "sdpa_cudnn")] and ("alibi", "sdpa_cudnn") not in by
    summary = written[-1]
    assert summary["bench"] == "issue21_summary" and summary["verdict"] == "fail"
    verdicts = {c["case"]: c["verdict"] for c in summary["cases"]}
    assert verdicts["fp8_causal"] == "fail" and set(verdicts) == {c.name for c in cases}
    assert all(c["flex_best_mode"] == "eager" for c in summary["cases"] if c["case"] != "fp8_causal")
    # FP8 alone: its bf16 baseline is timed in the case itself, on the same (unquantized) inputs
    rows = H.run_prefill(cases=[c for c in cases if c.fp8], out=None, flex_modes=(), sdpa=False)
    base = next(r for r in rows if r["impl"] == "attnc_call_bf16")
    assert base["pass"] and base["dtype"] == "bf16" and base["case"] == "fp8_causal"
    call = next(r for r in rows if r["impl"] == "attnc_call")
    assert call["bf16_causal_source"] == "attnc_call_bf16 row of this case"


def test_the_bench_draws_only_the_declared_tensors_on_the_host():
    """The documents case at B4 S8192 needs its doc tensor only (q, k, v are drawn on the GPU): no
    5 GiB host sample of q/k/v, and the same distribution as inputs.sample's."""
    from attnc.compiler import inputs
    from attnc.compiler.lower import compile_spec
    program = compile_spec("attention d { heads = 16 head_dim = 128 dtype = bf16 tensor doc: i32[b, s] ~ "
                           "segments(256, 2048) mask = causal & doc[b, q] == doc[b, k] }")
    doc = inputs.sample_tensors(program, 4, 8192, seed=0)["doc"]
    assert doc.shape == (4, 8192) and doc.dtype.kind == "i"
    runs = np.diff(np.flatnonzero(np.diff(doc[0]) != 0))
    assert (np.diff(doc, axis=1) >= 0).all() and runs.min() >= 256 and runs.max() <= 2048


def test_the_plane_check_of_a_mask_that_shows_no_key():
    """All-zero references (an empty mask: O is 0) give the absolute error, not 0 / 0 = NaN, so an
    empty mask's zero O passes and a nonzero one fails (the sweep's masks 40 and 148 in r57)."""
    planes = [(0, 0), (0, 1)]
    refs = [torch.zeros(8, 4, dtype=torch.float64) for _ in planes]
    o = torch.zeros(1, 2, 8, 4)
    assert H.plane_check(refs, planes)(o) == 0.0
    o[0, 1, 3, 2] = 0.5
    assert H.plane_check(refs, planes)(o) == pytest.approx(0.5)
