"""FlashDecoding++'s guarded shared shift (M4.5 §0x09C), ``state = shared_shift(phi, lower, upper)``:
the language, the ABI's workspace and ledger, and the numpy and Triton (CPU interpreter unless
ATTNC_TEST_GPU=1) split programs against the float64 oracle -- exact when the guard holds (and no
fallback ran), the same answer through a forced fallback, and scores that overflow or underflow
the shared frame (wrong without the guard: shown on the unguarded sums) recomputed only where
the guard tripped."""
import hashlib
import json
import subprocess
import sys
from functools import lru_cache

import numpy as np
import pytest

from attnc.compiler import inputs, numerics, oracle
from attnc.compiler.analysis import ledger as L
from attnc.compiler.errors import SpecError
from attnc.compiler.lower import compile_spec
from attnc.backends.numpy import runtime as np_runtime
from tests.conftest import ROOT

KV_LENS, Q_LENS = [37, 0, 52, 20, 9], [1, 0, 4, 1, 9]  # decode, idle, append, decode, prefill
WINDOW = (-20.0, 20.0)


@lru_cache(maxsize=None)
def program(phi=0.0, window=WINDOW, heads="8 / 2"):
    state = f"shared_shift({phi}, {window[0]}, {window[1]})"
    name = "shift_" + hashlib.sha256(repr((phi, window, heads)).encode()).hexdigest()[:8]
    return compile_spec(f"attention {name} {{ heads = {heads} head_dim = 16 dtype = f32 mask = causal & window(30) "
                        f"cache = paged(page_size = 8, layout = hnd) split = balanced(3) state = {state} }}")


def rows_of(b, q_lens=Q_LENS):
    return slice(sum(q_lens[:b]), sum(q_lens[:b + 1]))


def sample(p, seed=0, overflow=None, underflow=None, kv_lens=KV_LENS, q_lens=Q_LENS):
    """A mixed batch.  ``overflow = b`` / ``underflow = b``: every key gets a common component u
    (and little else), and request b's queries become ~ +-140 / scale * u, so all its scores sit
    near phi + 140 (exp(s - phi) overflows float32) or phi - 140 (it flushes to zero)."""
    arrays = inputs.sample_cache(p, kv_lens, q_lens, seed)
    if overflow is None and underflow is None:
        return arrays
    u = np.zeros(p.d_qk, np.float32)
    u[0] = 1.0
    k = arrays["k_cache"]
    arrays["k_cache"] = np.where(np.isnan(k), k, k * 0.05 + u)
    for b, offset in ((overflow, 140.0), (underflow, -140.0)):
        if b is not None:
            rows = rows_of(b, q_lens)
            arrays["q"][rows] = arrays["q"][rows] * 0.05 + u * (offset / p.scale)
    return arrays


def reference(p, arrays):
    return oracle.reference_cache(p, inputs.validate_cache(p, arrays))


def assert_matches(p, o, lse, arrays):
    ref_o, ref_lse = reference(p, arrays)
    co, cl = numerics.compare_outputs(p.dtype, o, lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))


def unguarded(p, arrays):
    """The shared-frame sums with no guard, in float32 as a kernel holds them: O = n / l per
    (row, head) -- what a call without the fallback would return."""
    call = inputs.validate_cache(p, arrays)
    phi = np.float32(p.state.phi)
    outs = []
    for b in range(call.batch):
        if call.q_lens[b] == 0:
            continue
        k, v = call.kv(b)
        q = call.q_rows(b)
        T, C = k.shape[0], q.shape[0]
        kh = np.arange(p.heads_q) // p.group
        s = np.einsum("chd,thd->cht", q, k[:, kh]).astype(np.float32) * np.float32(p.scale)
        pos = T - C + np.arange(C)
        seen = (np.arange(T)[None, :] <= pos[:, None]) & (pos[:, None] - np.arange(T)[None, :] < 30)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            e = np.where(seen[:, None, :], np.exp(s - phi), np.float32(0))
            outs.append(np.einsum("cht,thd->chd", e, v[:, kh]) / e.sum(-1, keepdims=True))
    return np.concatenate(outs)


def run_numpy(p, arrays):
    stats = {}
    o, lse = np_runtime.load(p).run(arrays, return_lse=True, stats=stats)
    return o, lse, stats


# ---------------------------------------------------------------- language, ABI, ledger
@pytest.mark.parametrize("state,match", [
    ("shared_shift(0.0, 5, -5)", "lower = 5 must be below upper = -5"),
    ("shared_shift(0.0, -80, 5)", r"lower must be in \[-64, 64\], got -80"),
    ("shared_shift(0.0)", "shared_shift state needs 'lower'"),
    ("shared_shift(phi = 1e6, lower = -1, upper = 1)", r"phi must be in \[-10000, 10000\]"),
    ("shared_shift(0.0, -5, 5, 1)", "shared_shift takes 3 arguments"),
])
def test_spec_errors(state, match):
    with pytest.raises(SpecError, match=match):
        compile_spec(f"attention t {{ heads = 4 head_dim = 16 state = {state} }}")


def test_workspace_and_ledger_of_the_abi():
    p = program()
    call = L.DecodeCall.from_program(p)
    fields = call.state_fields()
    assert [(f.name, f.dtype, f.vector) for f in fields] == [
        ("partial_n", "f32", True), ("partial_l", "f32", False), ("partial_valid", "u8", False),
        ("partial_guard", "u8", False)]
    assert L.bytes_per_state(fields, 16) == 16 * 4 + 4 + 1 + 1
    assert [f.name for f in L.fallback_fields("shared_shift")] == ["partial_m"] and not L.fallback_fields("mlu")


def test_plan_json_reports_the_shift_workspace(tmp_path):
    spec = tmp_path / "shift.attn"
    spec.write_text("attention s { heads = 8 / 2 head_dim = 128 dtype = bf16 split = balanced(4) "
                    "cache = paged(page_size = 16) state = shared_shift(2.0, -30, 30) }\n")
    r = subprocess.run([sys.executable, "-m", "attnc", "plan", str(spec), "--kv-lens", "100,40", "--json"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["state"] == "shared_shift"
    assert {f["name"]: f["dtype"] for f in rep["workspace"]["fields"]} == {
        "partial_n": "f32", "partial_l": "f32", "partial_valid": "u8", "partial_guard": "u8"}
    assert rep["workspace_bytes"]["per_state"] == 128 * 4 + 4 + 1 + 1
    states = 2 * 8 * 4  # decode rows x query heads x split capacity
    assert rep["ledgers"]["workspace_roundtrip"] == 2 * states * rep["workspace_bytes"]["per_state"]
    fb = rep["fallback"]
    assert fb["fields"] == [{"name": "partial_m", "dtype": "f32", "bytes": states * 4}]
    mlu = 128 * 4 + 4 + 4 + 1  # the (m, l, u) state it recomputes with
    assert fb["worst_case"]["workspace_roundtrip"] == 2 * states * mlu
    assert fb["worst_case"]["kv_demand"] == rep["ledgers"]["kv_demand"]


# ---------------------------------------------------------------- numpy
def test_exact_when_the_guard_holds_numpy():
    p = program()
    arrays = sample(p, seed=1)
    o, lse, stats = run_numpy(p, arrays)
    assert stats["fallback_outputs"] == 0 and stats["producers"] > sum(Q_LENS) // 2
    assert_matches(p, o, lse, arrays)


def test_forced_fallback_gives_the_same_answer_numpy():
    """phi far above every score: every split trips the guard; the (m, l, u) recomputation is the
    answer, and it is the one the guarded shift gave (and the mlu spec gives)."""
    arrays = sample(program(), seed=1)
    o0, lse0, _ = run_numpy(program(), arrays)
    o, lse, stats = run_numpy(program(phi=60.0), arrays)
    assert stats["fallback_outputs"] == sum(Q_LENS) * 8
    assert_matches(program(phi=60.0), o, lse, arrays)
    np.testing.assert_allclose(o, o0, atol=1e-6)
    np.testing.assert_allclose(lse, lse0, atol=1e-5)


@pytest.mark.parametrize("case", ["overflow", "underflow"])
def test_overflow_and_underflow_fall_back_where_they_happen_numpy(case):
    """Request 2's scores sit near phi + 140 (exp(s - phi) overflows float32), or request 3's near
    phi - 140 (exp flushes to 0): the unguarded sums are wrong there; the guard sends
    exactly those requests' outputs to the fallback, and every output matches the oracle."""
    p = program()
    b = {"overflow": 2, "underflow": 3}[case]
    arrays = sample(p, seed=2, **{case: b})
    ref_o, _ = reference(p, arrays)
    bad = unguarded(p, arrays)[rows_of(b)]
    wrong = ~np.isfinite(bad) | ~np.isclose(bad, ref_o[rows_of(b)], atol=1e-3)
    assert wrong.any(), f"{case}: the unguarded shared frame should be wrong for request {b}"
    o, lse, stats = run_numpy(p, arrays)
    assert stats["fallback_outputs"] == Q_LENS[b] * 8, "only the request whose guard tripped is recomputed"
    assert_matches(p, o, lse, arrays)


# ---------------------------------------------------------------- Triton
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnc.backends.triton import runtime as tr_runtime  # noqa: E402
from attnc.backends.triton.shift import ShiftLaunch  # noqa: E402

BN = 8 if tr_runtime.interpreted() else 16


def run_triton(p, arrays):
    """The Triton split call through ``Kernel.decode_graph`` (captured on a GPU; run directly in
    the interpreter), whose workspace it owns: (O, LSE, need [total_q, H_q]), ``need`` being the
    (row, head)s the guard sent to the fallback."""
    kernel = tr_runtime.load(p)
    t = {n: torch.as_tensor(a).to(kernel.device) for n, a in arrays.items()}
    q = t.pop("q")
    graph = kernel.decode_graph(q, block_n=BN, splits=3, capture=not tr_runtime.interpreted(), **t)
    o, lse = graph(q)
    launch = kernel.split_launch(graph._warps, graph._stages)
    assert isinstance(launch, ShiftLaunch)
    need = launch.fields(graph.workspace, q.shape[0], graph.plan["splits"])["need"].view(q.shape[0], p.heads_q)
    return o.cpu().numpy(), lse.cpu().numpy(), need.cpu().numpy()


KV_T, Q_T = [30, 0, 17, 21, 9], [1, 0, 3, 1, 2]  # smaller: the interpreter runs every program


def test_exact_and_forced_fallback_triton():
    p, forced = program(heads="4 / 2"), program(phi=60.0, heads="4 / 2")
    arrays = sample(p, seed=1, kv_lens=KV_T, q_lens=Q_T)
    o, lse, need = run_triton(p, arrays)
    assert not need.any()
    assert_matches(p, o, lse, arrays)
    o2, lse2, need2 = run_triton(forced, arrays)
    assert need2.all()
    assert_matches(forced, o2, lse2, arrays)
    np.testing.assert_allclose(o2, o, atol=1e-6)


def test_overflow_and_underflow_fall_back_triton():
    """Request 2 overflows, request 3 underflows: exactly their outputs are recomputed."""
    p = program(heads="4 / 2")
    arrays = sample(p, seed=2, overflow=2, underflow=3, kv_lens=KV_T, q_lens=Q_T)
    o, lse, need = run_triton(p, arrays)
    rows = np.zeros(sum(Q_T), bool)
    rows[rows_of(2, Q_T)] = rows[rows_of(3, Q_T)] = True
    assert need[rows].all() and not need[~rows].any()
    assert_matches(p, o, lse, arrays)


@pytest.mark.skipif(not tr_runtime.interpreted(), reason="the smoke run is the interpreter's; on a GPU run the bench")
def test_bench_smoke(capsys):
    """bench/shared_shift.py's checks, on one tiny case in the interpreter."""
    from attnc.bench import shared_shift
    assert shared_shift.main(["--smoke"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(x["variant"], x["fallback_outputs"]) for x in rows] == [("sync", None), ("shift", 0), ("fallback", 8)]


def test_dispatch_refuses_triton_for_a_split_policy_with_the_launchs_message():
    """state = shared_shift with split = balanced(3): Triton's shift kernels take block shares, so
    dispatch refuses it (auto takes numpy) with the reason the launch itself gives."""
    from attnc.backends.triton.admission import shared_shift_refusal
    from attnc.compiler.dispatch import Environment, dispatch
    from attnc.compiler.errors import PlanError
    p = program(heads="4 / 2")
    call = {"B": 2, "S_q": [1, 1], "S_k": [30, 17], "device": "cpu"}
    env = Environment(device_type="cpu", interpreter=True, torch="2", triton="3")
    reason = shared_shift_refusal("balanced(3)")
    forced = dispatch(p, {**call, "backend": "triton"}, env)
    assert forced.selected is None and reason in forced.error
    assert dispatch(p, call, env).selected == "numpy"
    pytest.importorskip("triton")
    with pytest.raises(PlanError) as e:
        tr_runtime.load(p).run(sample(p, seed=1, kv_lens=KV_T, q_lens=Q_T), return_lse=True)
    assert reason in str(e.value)
