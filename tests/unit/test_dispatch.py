"""Dispatch keys, admission vectors and selection policies (M4.5 §0x07, DESIGN §6).

The seven-case teaching matrix of §0x07D runs against four deliberately generic teaching
backends registered in a test registry; the acceptance numbers are the `dispatch` fixture."""
from __future__ import annotations

import json

import pytest

from attnc.compiler import dispatch as d
from attnc.compiler.dispatch import (BackendSpec, CallError, DispatchError, DispatchKey, Environment, PlanKey,
                               Registry, allowed, bounded, requires, rule)
from attnc.compiler.lower import compile_spec
from tests.conftest import seed_contracts

FIXTURE = seed_contracts()["dispatch"]
# The teaching calls name their device; the host's versions must not leak into their keys.
TEACHING_ENV = Environment(device_type="cuda")


def _paged_only(k):
    return None if k.paged else f"cache_layout={k.cache_layout} unsupported"


def _not_paged(k):
    return f"cache_layout={k.cache_layout} unsupported" if k.paged else None


def teaching_registry() -> Registry:
    """§0x07D's four teaching backends, in priority order.  Their names describe no real
    PyTorch, vLLM, FlashInfer or FlashAttention implementation."""
    return Registry([
        BackendSpec("decode_paged_fast", platforms=("cuda",), phases=("decode",), admission=(
            bounded("Q", "S_q", 1, 4, label="q_len"),
            allowed("Q", "d_qk", (64, 128, 256), label="head_dim_qk"),
            allowed("Q", "d_v", (64, 128, 256), label="head_dim_vo"),
            allowed("M", "mask_kind", ("causal", "window")),
            rule("L", "paged K/V", _paged_only),
        ), description=FIXTURE["teaching_backends"]["decode_paged_fast"]),
        BackendSpec("prefill_contiguous_fast", platforms=("cuda",), phases=("prefill", "append"), admission=(
            bounded("Q", "S_q", lo=2, label="q_len"),
            rule("L", "no paged cache", _not_paged),
        ), description=FIXTURE["teaching_backends"]["prefill_contiguous_fast"]),
        BackendSpec("paged_reference", platforms=("cuda",), phases=("prefill", "append", "decode"), admission=(
            bounded("Q", "d_qk", 16, 512, label="head_dim_qk"), bounded("Q", "d_v", 16, 512, label="head_dim_vo"),
            rule("L", "paged K/V", _paged_only),
            requires("C", "graph_mode", False, label="cuda_graph"),
        ), description=FIXTURE["teaching_backends"]["paged_reference"]),
        BackendSpec("math_reference", platforms=("cpu", "cuda"), phases=("prefill", "append", "decode"), admission=(
            rule("L", "no paged-cache address program", _not_paged),
        ), description=FIXTURE["teaching_backends"]["math_reference"]),
    ])


def teaching_key(change) -> DispatchKey:
    call = dict(FIXTURE["base_call"])
    if change != "none":
        call.update(change)
    return DispatchKey.from_call(None, call, TEACHING_ENV)


def test_teaching_matrix_reproduces_the_fixture():
    reg = teaching_registry()
    selections = errors = fallbacks = 0
    for case in FIXTURE["cases"]:
        sel = reg.select(teaching_key(case["change"]))
        if case["result"] == "error":
            errors += 1
            assert sel.selected is None and sel.error
            with pytest.raises(DispatchError):
                sel.require()
        else:
            selections += 1
            assert sel.require() == case["result"], (case, sel.text())
        assert sel.fallback == bool(case.get("fallback")), (case, sel.text())
        fallbacks += sel.fallback
        if "rejections_kept" in case:  # the head-dim case keeps both failed predicates
            kept = [r.reason for r in sel.rejections("decode_paged_fast")]
            assert kept == case["rejections_kept"]
    assert {"selections": selections, "errors": errors, "backend_fallbacks": fallbacks} == FIXTURE["totals"]


def test_each_case_keeps_the_diagnostic_the_seed_names():
    reg = teaching_registry()
    cases = {json.dumps(c["change"], sort_keys=True): c for c in FIXTURE["cases"]}
    by = {k: reg.select(teaching_key(c["change"])) for k, c in cases.items()}
    base = by['"none"']
    assert base.candidates[0].eligible and not base.fallbacks  # no rejection above the winner
    custom = by[json.dumps({"mask_kind": "dense_custom", "cuda_graph": False}, sort_keys=True)]
    assert [r.reason for r in custom.rejections("decode_paged_fast")] == ["mask_kind=dense_custom unsupported"]
    assert custom.fallbacks == ("decode_paged_fast",)
    forced = by[json.dumps({"mask_kind": "dense_custom", "backend_request": "decode_paged_fast"}, sort_keys=True)]
    assert forced.policy == "forced" and [c.name for c in forced.candidates] == ["decode_paged_fast"]
    assert "mask_kind=dense_custom unsupported" in forced.error  # fails closed; no fallback
    prefill = by[json.dumps({"phase": "prefill", "q_len": 128, "cache_layout": "contiguous", "page_size": None},
                            sort_keys=True)]
    assert not prefill.candidates[0].in_domain and "phase=prefill" in prefill.candidates[0].outside[0]
    cpu = by[json.dumps({"device": "cpu", "cache_layout": "contiguous", "page_size": None}, sort_keys=True)]
    assert [c.name for c in cpu.candidates if c.in_domain] == ["math_reference"]  # CUDA backends leave
    graph = by[json.dumps({"mask_kind": "dense_custom", "cuda_graph": True}, sort_keys=True)]
    in_domain = [c for c in graph.candidates if c.in_domain]
    assert in_domain and all(c.rejections for c in in_domain)  # every in-domain candidate has reasons
    assert [r.reason for r in graph.rejections("paged_reference")] == ["cuda_graph=true unsupported"]
    assert [r.reason for r in graph.rejections("math_reference")] == ["cache_layout=paged_nhd unsupported"]


def test_digest_is_canonical_and_moves_with_any_coordinate():
    base = teaching_key("none")
    assert base.digest == teaching_key("none").digest
    assert len(base.digest) == 64 and base.canonical() == d.canonical_json(base.to_json())
    assert DispatchKey.from_json(json.loads(base.canonical())) == base
    assert base.with_(d_qk=80).digest != base.digest  # changing only d_qk changes the digest
    # spellings of one call (teaching names, §0x0BE names, dtype aliases) are one key
    same = DispatchKey.from_call(None, {**FIXTURE["base_call"], "dtype": "float16", "head_dim_qk": 128}, TEACHING_ENV)
    assert same.digest == base.digest
    assert set(base.to_json()) == {"version", *d.KEY_GROUPS}


@pytest.mark.parametrize("change, message", [
    ({"num_kv_heads": 5}, "H_q = 32 is not a multiple of H_kv = 5"),
    ({"dropout_p": 1.5}, "dropout_p = 1.5 must be in [0, 1]"),
    ({"page_size": None}, "cache_layout = paged_nhd needs page_size > 0"),
    ({"cache_layout": "contiguous"}, "page_size = 16 given for a contiguous_bhsd cache"),
    ({"q_len": 0}, "both must be positive"),
    ({"q_len": 8, "kv_len": 4}, "S_q = 8 query rows exceed S_k = 4 keys"),
    ({"dtype": "fp7"}, "q_dtype = 'fp7' is not a dtype"),
    ({"phase": "training"}, "phase = 'training' must be one of"),
    ({"flavour": 1}, "unknown call field 'flavour'"),
])
def test_malformed_calls_are_errors_not_unsupported(change, message):
    with pytest.raises(CallError, match="") as e:
        teaching_key(change)
    assert message in str(e.value)


def test_semantic_validation_reports_every_problem_at_once():
    with pytest.raises(CallError) as e:
        teaching_key({"num_kv_heads": 5, "dropout_p": -1, "page_size": None})
    assert len(e.value.diagnostics) == 3


def test_forced_unknown_backend_is_a_malformed_call():
    with pytest.raises(CallError, match="not a registered backend"):
        teaching_registry().select(teaching_key({"backend_request": "flash9"}))


def test_mixed_phase_label_must_match_the_requests():
    call = {n: v for n, v in FIXTURE["base_call"].items() if n not in ("q_len", "kv_len")}
    with pytest.raises(CallError, match="mix phases"):
        DispatchKey.from_call(None, {**call, "S_q": [1, 16], "S_k": [4096, 16]}, TEACHING_ENV)
    with pytest.raises(CallError, match="repeats S_q with another value"):
        DispatchKey.from_call(None, {**FIXTURE["base_call"], "S_q": 2}, TEACHING_ENV)
    k = DispatchKey.from_call(None, {**call, "phase": "mixed", "S_q": [1, 16], "S_k": [4096, 16]}, TEACHING_ENV)
    assert k.B == 2 and k.S_k == (4096, 16)


# ---------------------------------------------------------------- attnc's own backends
SPEC = "attention t { heads = 8 / 2 head_dim = 64 dtype = f16 mask = causal }"
CPU = Environment(device_type="cpu", torch="2.13.0", triton="3.9.0")
H200 = Environment(device_type="cuda", compute_capability=90, device_name="NVIDIA H200", torch="2.13.0",
                   triton="3.9.0", cuda_runtime="12.8")


def test_key_from_a_spec_derives_semantics_and_rejects_contradictions():
    p = compile_spec(SPEC)
    k = DispatchKey.from_call(p, {"B": 2, "S_q": 1, "S_k": [100, 37]}, CPU)
    assert (k.phase, k.H_q, k.H_kv, k.d_qk, k.q_dtype, k.cache_layout) == ("decode", 8, 2, 64, "f16", "contiguous_bhsd")
    assert k.mask_kind == "causal" and k.mask_representable is True and len(k.score_digest) == 64
    with pytest.raises(CallError, match="the call has H_q = 16 but spec 't' declares 8"):
        DispatchKey.from_call(p, {"S_q": 4, "S_k": 4, "H_q": 16}, CPU)
    doc = compile_spec("attention t { heads = 4 head_dim = 32 tensor doc: i32[b, s] "
                       "mask = causal & doc[b, q] == doc[b, k] }")
    kd = DispatchKey.from_call(doc, {"S_q": 8, "S_k": 8}, CPU)
    assert kd.mask_kind == "tensor" and kd.mask_representable is None  # values decide, at plan time


def test_default_backends_admission_vectors():
    p = compile_spec(SPEC)
    sel = d.dispatch(p, {"B": 2, "S_q": 64, "S_k": 64}, CPU)
    assert sel.selected == "numpy" and not sel.candidates[0].in_domain  # triton: no GPU, no interpreter
    sel = d.dispatch(p, {"B": 2, "S_q": 64, "S_k": 64}, H200)
    assert sel.selected == "triton" and not sel.fallback
    sel = d.dispatch(p, {"B": 2, "S_q": 64, "S_k": 64, "graph_mode": True}, H200)
    assert sel.selected is None and [c.name for c in sel.candidates] == ["triton", "numpy", "ahbm"]
    assert all(c.rejections for c in sel.candidates if c.in_domain)
    assert not sel.candidates[2].in_domain  # ahbm: the mesh simulator is its only platform
    assert [r.reason for r in sel.rejections("triton")] == ["graph_mode=true unsupported for prefill on a "
                                                           "contiguous cache"]
    decode = {"B": 2, "S_q": 1, "S_k": [4096, 100], "graph_mode": True}  # the split kernels are captured
    assert d.dispatch(p, decode, H200).selected == "triton"
    interp = Environment(device_type="cpu", interpreter=True, torch="2.13.0", triton="3.9.0")
    assert [r.reason for r in d.dispatch(p, decode, interp).rejections("triton")] == [
        "graph_mode=true unsupported without a CUDA device"]
    mesh = Environment(device_type="ahbm")
    assert d.dispatch(p, {"B": 2, "S_q": 64, "S_k": 64}, mesh).selected == "ahbm"
    big = compile_spec("attention t { heads = 4 head_dim = 512 mask = causal }")
    sel = d.dispatch(big, {"S_q": 16, "S_k": 16}, H200)
    assert sel.selected == "numpy" and sel.fallbacks == ("triton",)
    assert [r.reason for r in sel.rejections("triton")] == ["d_qk=512 unsupported", "d_v=512 unsupported"]
    forced = d.dispatch(big, {"S_q": 16, "S_k": 16, "backend_request": "triton"}, H200)
    assert forced.selected is None and "d_qk=512" in forced.error and "d_v=512" in forced.error
    interp = Environment(device_type="cpu", interpreter=True, torch="2.13.0", triton="3.9.0")
    assert d.dispatch(p, {"S_q": 8, "S_k": 8}, interp).selected == "triton"
    old = Environment(device_type="cuda", compute_capability=75, torch="2.13.0", triton=None)
    reasons = [r.reason for r in d.dispatch(p, {"S_q": 8, "S_k": 8}, old).rejections("triton")]
    assert reasons == ["triton not installed", "compute_capability=75 unsupported"]


def test_paged_spec_every_phase_goes_to_triton_and_old_gpus_fall_back_with_reasons():
    paged = compile_spec("attention t { heads = 8 / 2 head_dim = 64 mask = causal "
                         "cache = paged(page_size = 16, layout = nhd, table = csr) }")
    sel = d.dispatch(paged, {"B": 3, "S_q": 1, "S_k": [40, 2, 300]}, H200)
    assert sel.selected == "triton" and sel.key.paged
    # prefill and mixed batches over the paged cache: the split producer + combine kernels
    sel = d.dispatch(paged, {"B": 1, "S_q": 64, "S_k": 64}, H200)
    assert sel.selected == "triton" and not sel.fallbacks
    mixed = d.dispatch(paged, {"S_q": [1, 30], "S_k": [40, 30], "phase": "mixed"}, H200)
    assert mixed.selected == "triton" and mixed.candidates[0].in_domain
    turing = Environment(device_type="cuda", compute_capability=75, device_name="T4", torch="2", triton="3")
    old = d.dispatch(paged, {"B": 1, "S_q": 64, "S_k": 64}, turing)
    assert old.selected == "numpy" and old.fallbacks == ("triton",)
    assert [r.reason for r in old.rejections("triton")] == ["compute_capability=75 unsupported"]
    forced = d.dispatch(paged, {"B": 1, "S_q": 64, "S_k": 64, "backend": "triton"}, turing)
    assert forced.selected is None and "compute_capability=75 unsupported" in forced.error


def test_disabled_backend_is_an_enabled_factor_rejection():
    p = compile_spec(SPEC)
    key = DispatchKey.from_call(p, {"S_q": 8, "S_k": 8}, H200)
    sel = Registry(d.ADMISSION.values(), disabled={"triton"}).select(key)
    assert sel.selected == "numpy" and sel.rejections("triton")[0].factor == "E"


# ---------------------------------------------------------------- plan keys (§0x07F)
def test_plan_key_lifecycle_table():
    base = teaching_key("none").plan_key(device="cuda:0")
    assert len(base.digest) == 64
    lengths = teaching_key({"kv_len": 8192}).plan_key(device="cuda:0")
    assert lengths == base  # declared dynamic: reuse
    dims = teaching_key({"head_dim_qk": 256, "head_dim_vo": 256}).plan_key(device="cuda:0")
    assert [f for f, *_ in base.changed(dims)] == ["d_qk", "d_v"]
    ws = base.replace(workspace_device="cuda:1")
    assert [f for f, *_ in base.changed(ws)] == ["workspace_device"]
    graph = teaching_key({"cuda_graph": False}).plan_key(device="cuda:0")
    assert [f for f, *_ in base.changed(graph)] == ["graph_mode"]
    assert PlanKey.of(compile_spec(SPEC)).to_json()["device"] is None
