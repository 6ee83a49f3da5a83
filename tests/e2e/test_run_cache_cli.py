"""`attnc run` and `attnc demo` over paged and ragged caches (DESIGN §5 npz keys)."""
import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.compiler import inputs
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import ROOT
from tests.e2e.test_cli import attnc

PAGED = ROOT / "examples" / "causal_document_gqa.attn"


def test_run_paged_npz_inputs_writes_packed_o_and_lse(tmp_path):
    program = compile_file(PAGED)
    arrays = inputs.sample_cache(program, [40, 0, 23, 16], [40, 0, 5, 1], seed=2)
    np.savez(tmp_path / "in.npz", **arrays)
    r = attnc("run", PAGED, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz", "--check")
    assert r.returncode == 0, r.stderr
    assert "kv_lens [40, 0, 23, 16], q_lens [40, 0, 5, 1]" in r.stdout
    assert "vs float64 oracle: O" in r.stdout and "FAIL" not in r.stdout
    out = np.load(tmp_path / "out.npz")
    assert out["o"].shape == (46, 32, 64) and out["lse"].shape == (46, 32)
    ref_o, _ = oracle.reference_cache(program, inputs.validate_cache(program, arrays))
    assert np.abs(out["o"] - ref_o).max() < 2e-2


def test_run_samples_a_paged_cache():
    r = attnc("run", PAGED, "--kv-len", "37", "--q-len", "3", "--batch", "2", "--check")
    assert r.returncode == 0, r.stderr
    assert "over a paged nhd cache (page_size 16, csr table), kv_lens [37, 37], q_lens [3, 3]" in r.stdout


def test_run_contiguous_spec_with_per_request_lengths(tmp_path):
    spec = tmp_path / "c.attn"
    spec.write_text("attention c { heads = 4 / 2 head_dim = 16 mask = causal split = balanced(2) }")
    program = compile_spec(spec.read_text())
    arrays = inputs.sample_cache(program, [9, 30], [2, 1], seed=1, cache_rows=3)
    np.savez(tmp_path / "in.npz", **arrays)
    r = attnc("run", spec, "--inputs", tmp_path / "in.npz", "--check")
    assert r.returncode == 0, r.stderr
    assert "over a contiguous bhsd cache" in r.stdout and "FAIL" not in r.stdout


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.pop("kv_last_page_len"), "missing key 'kv_last_page_len'"),
    (lambda a: a.update(kv_indices=a["kv_indices"] + 100), "kv_indices[0] = 10"),
    (lambda a: a.update(kv_last_page_len=np.array([17, 1], np.int32)), "kv_last_page_len[0] = 17 is outside [1, page_size = 16]"),
])
def test_run_rejects_broken_cache_metadata(tmp_path, mutate, message):
    program = compile_file(PAGED)
    arrays = inputs.sample_cache(program, [20, 3], [1, 1], seed=0)
    mutate(arrays)
    np.savez(tmp_path / "in.npz", **arrays)
    r = attnc("run", PAGED, "--inputs", tmp_path / "in.npz")
    assert r.returncode == 1
    assert message in r.stderr, r.stderr


def test_demo_runs_the_paged_example_through_the_paged_path():
    r = attnc("demo", PAGED, "--length", "48")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 passed, 0 failed" in r.stdout
    assert "paged nhd cache (page_size 16, csr table), shuffled pages" in r.stdout
    assert "run as contiguous" not in r.stdout
    assert " mixed " in r.stdout


def test_run_through_a_cuda_graph():
    """`--cuda-graph` captures the split call and replays it: checked against the oracle on a GPU
    (ATTNC_TEST_GPU=1); refused with the reason under the interpreter, and for calls it cannot
    capture, on every machine."""
    import os
    args = ("run", PAGED, "--backend", "triton", "--cuda-graph", "--kv-len", "100", "--q-len", "1", "--batch", "3",
            "--check")
    r = attnc(*args)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert r.returncode == 1 and r.stderr.startswith(
            "error: forced backend triton rejects the call: graph_mode=true unsupported without a CUDA device")
    else:
        assert r.returncode == 0, r.stderr
        assert "kv_lens [100, 100, 100], q_lens [1, 1, 1]" in r.stdout and "(captured, replayed)" in r.stdout
        assert r.stdout.count("vs float64 oracle:") == 2 and "FAIL" not in r.stdout
    r = attnc("run", ROOT / "examples" / "causal.attn", "--backend", "triton", "--cuda-graph", "--kv-len", "16")
    assert r.returncode == 1 and "--cuda-graph replays split calls" in r.stderr
    r = attnc("run", PAGED, "--backend", "numpy", "--cuda-graph", "--kv-len", "16", "--q-len", "1")
    assert r.returncode == 1 and "forced backend numpy rejects the call: graph_mode=true unsupported" in r.stderr
