"""The CLI contract of DESIGN §7, exercised as a user would (a subprocess per call)."""
import subprocess
import sys

import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.compiler import inputs
from attnc.compiler.lower import compile_file
from tests.conftest import EXAMPLES, ROOT

CAUSAL_DOC = ROOT / "examples" / "causal_document.attn"


def attnc(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "attnc", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_check_every_example():
    r = attnc("check", *EXAMPLES)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok (") == len(EXAMPLES)


def test_check_reports_located_error_with_caret(tmp_path):
    bad = tmp_path / "bad.attn"
    bad.write_text("attention bad {\n    heads = 4\n    head_dim = 16\n"
                   "    tensor doc: i32[b, s]\n    mask  = causal & doc[k] == doc[b, q]\n}\n")
    r = attnc("check", bad)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert lines[0] == f"{bad}:5:22: error: tensor 'doc' takes 2 subscripts (declared i32[b, s]), got 1"
    assert lines[1] == "    mask  = causal & doc[k] == doc[b, q]"
    assert lines[2] == " " * 21 + "^" * 6


def test_check_missing_file(tmp_path):
    r = attnc("check", tmp_path / "nope.attn")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_compile_prints_the_golden_source(tmp_path):
    r = attnc("compile", CAUSAL_DOC, "--backend", "numpy")
    assert r.returncode == 0
    assert r.stdout == (ROOT / "tests/golden/generated/numpy/causal_document.py").read_text()
    out = tmp_path / "k.py"
    assert attnc("compile", CAUSAL_DOC, "-o", out).returncode == 0
    assert out.read_text() == r.stdout


def test_compiled_module_runs_standalone(tmp_path):
    """The printed module needs nothing but numpy: import it from a bare directory."""
    out = tmp_path / "kernel.py"
    attnc("compile", CAUSAL_DOC, "-o", out)
    program = compile_file(CAUSAL_DOC)
    arrays = inputs.sample(program, 1, 40, 40, seed=3)
    np.savez(tmp_path / "in.npz", **arrays)
    code = ("import numpy as np, kernel; a = np.load('in.npz'); "
            "o, lse = kernel.attention(a['q'], a['k'], a['v'], doc=a['doc'], return_lse=True); "
            "np.savez('o.npz', o=o, lse=lse)")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env={"PATH": ""})
    got = np.load(tmp_path / "o.npz")
    call = inputs.validate(program, arrays)
    ref_o, _ = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    assert np.abs(got["o"] - ref_o).max() < 2e-2


def test_ir_prints_an_mlir_module():
    r = attnc("ir", CAUSAL_DOC)
    assert r.returncode == 0
    assert r.stdout.startswith('"builtin.module"()') and '"attn.mask_program"' in r.stdout


def test_run_with_npz_inputs_writes_o_and_lse(tmp_path):
    program = compile_file(CAUSAL_DOC)
    arrays = inputs.sample(program, 2, 12, 50, seed=1)
    np.savez(tmp_path / "in.npz", **arrays)
    r = attnc("run", CAUSAL_DOC, "--backend", "numpy", "--inputs", tmp_path / "in.npz",
              "--out", tmp_path / "out.npz", "--check")
    assert r.returncode == 0, r.stderr
    assert "vs float64 oracle: O" in r.stdout and "FAIL" not in r.stdout
    out = np.load(tmp_path / "out.npz")
    assert out["o"].shape == (2, program.heads_q, 12, program.d_v)
    assert out["lse"].shape == (2, program.heads_q, 12)
    call = inputs.validate(program, arrays)
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    assert np.abs(out["o"] - ref_o).max() < 2e-2


def test_run_on_sampled_inputs_with_check():
    r = attnc("run", ROOT / "examples" / "causal.attn", "--kv-len", "40", "--q-len", "8", "--check")
    assert r.returncode == 0, r.stderr
    assert "S_q=8 S_k=40" in r.stdout


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.pop("k"), "missing key 'k'"),
    (lambda a: a.update(q=a["q"][0]), "'q' has shape [4, 10, 64] (rank 3)"),
    (lambda a: a.update(v=a["v"].astype(np.int32)), "'v' has dtype int32"),
    (lambda a: a.update(v=a["v"][..., :8]), "'v' has shape [1, 4, 30, 8]; expected [1, H_kv=4, 30, d_v=64]"),
    (lambda a: a.update(doc=a["doc"][:, :5]), "tensor 'doc' has shape [1, 5]; expected [b=1, s=30]"),
    (lambda a: a.update(doc=a["doc"].astype(np.float32)), "tensor 'doc' has dtype float32"),
    (lambda a: a.update(extra=a["doc"]), "unknown key 'extra'"),
    (lambda a: a.update(q=np.concatenate([a["q"]] * 4, axis=2)), "S_q = 40 rows but 'k' has S_k = 30"),
])
def test_run_rejects_malformed_npz(tmp_path, mutate, message):
    program = compile_file(CAUSAL_DOC)
    arrays = inputs.sample(program, 1, 10, 30)
    mutate(arrays)
    np.savez(tmp_path / "in.npz", **arrays)
    r = attnc("run", CAUSAL_DOC, "--inputs", tmp_path / "in.npz")
    assert r.returncode == 1
    assert message in r.stderr, r.stderr


def test_run_rejects_unreadable_npz(tmp_path):
    (tmp_path / "in.npz").write_text("not a zip")
    r = attnc("run", CAUSAL_DOC, "--inputs", tmp_path / "in.npz")
    assert r.returncode == 1 and "is neither a numpy .npz archive nor a .npy array" in r.stderr


def test_out_of_range_tensor_read_is_a_plan_error(tmp_path):
    spec = tmp_path / "shift.attn"
    spec.write_text("attention shift { heads = 2 head_dim = 8\n"
                    "  tensor doc: i32[b, s] ~ segments(3, 6)\n"
                    "  mask = causal & doc[b, q] == doc[b, k + 1] }\n")
    r = attnc("run", spec, "--kv-len", "16")
    assert r.returncode == 1
    assert "tensor 'doc' read out of range: axis 1 index 16 is outside [0, 16)" in r.stderr


def test_non_finite_score_is_a_plan_error(tmp_path):
    spec = tmp_path / "logscore.attn"
    spec.write_text("attention logscore { heads = 2 head_dim = 8 dtype = f32\n"
                    "  score = log(score) }\n")
    r = attnc("run", spec, "--kv-len", "16")
    assert r.returncode == 1
    assert "the score program produced NaN or +inf at a visible key of query row (b=0, h=" in r.stderr


def test_demo_runs_examples_against_the_oracle():
    r = attnc("demo", ROOT / "examples" / "causal.attn", ROOT / "examples" / "alibi.attn", "--length", "48")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6 passed, 0 failed" in r.stdout


def test_unknown_backend_is_rejected():
    r = attnc("compile", CAUSAL_DOC, "--backend", "cuda")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_triton_without_a_gpu_or_the_interpreter_is_one_clear_error():
    import os
    pytest.importorskip("torch")
    # no interpreter, and no CUDA device visible to the child even on a GPU machine
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "attnc", "demo", "--backend", "triton"], cwd=ROOT,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("set TRITON_INTERPRET=1") == 1, r.stderr
