"""Issue 18, the runtime half: command-line arguments and input files give located errors, oversized
calls are refused up front with the estimate and the limit, lengths past int32 positions are
refused, and `attnc run` runs where dispatch admission says (refusals name their reasons)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from attnc.compiler import cli, inputs, resources
from attnc.compiler.analysis import layout
from attnc.compiler.dispatch import CallError, DispatchKey, Environment
from attnc.compiler.lower import compile_file
from tests.conftest import ROOT

EX = ROOT / "examples"
CAUSAL, PAGED = EX / "causal.attn", EX / "causal_document_gqa.attn"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("args, message", [
    (("run", CAUSAL, "--kv-len", "-5"), "argument --kv-len: expected an integer >= 1, got '-5'"),
    (("run", CAUSAL, "--batch", "-1"), "argument --batch: expected an integer >= 1, got '-1'"),
    (("run", CAUSAL, "--q-len", "0"), "argument --q-len: expected an integer >= 1, got '0'"),
    (("run", CAUSAL, "--seed", "-3"), "argument --seed: expected an integer >= 0"),
    (("explain", CAUSAL, "--kv-len", "2147483648"), "2147483648 exceeds 1073741824 (2^30)"),
    (("plan", CAUSAL, "--kv-lens", "5,2147483648"), "length 2147483648 exceeds 1073741824"),
    (("plan", CAUSAL, "--kv-lens", "5", "--sms", "0"), "argument --sms: expected an integer >= 1"),
    (("tune", CAUSAL, "--shapes", "1:4:8", "--repeats", "0"), "argument --repeats: expected an integer >= 1"),
    (("explain", CAUSAL, "--kv-len", "8", "--memory-limit", "lots"), "expected a size such as 4GiB"),
])
def test_bad_arguments_are_usage_errors(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err, err


# ---------------------------------------------------------------- input files
@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"PK\x03\x04 not really a zip", "is damaged or not readable: BadZipFile"),
    (b"garbage", "is neither a numpy .npz archive nor a .npy array (it starts with b'garbag')"),
    (None, "is a single .npy array; --inputs takes an .npz archive of named arrays"),
])
def test_bad_inputs_files_are_located_errors(tmp_path, capsys, content, message):
    path = tmp_path / "in.npz"
    if content is None:
        np.save(tmp_path / "in.npy", np.zeros(3))
        path = tmp_path / "in.npy"
    else:
        path.write_bytes(content)
    code, _, err = run_cli(capsys, "run", CAUSAL, "--inputs", path)
    assert code == 1 and message in err and str(path) in err, err


def test_missing_inputs_and_tensor_files(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", CAUSAL, "--inputs", tmp_path)
    assert code == 1 and f"cannot read inputs file {tmp_path}: Is a directory" in err
    np.savez(tmp_path / "doc.npz", doc=np.zeros((1, 8), np.int32))
    code, _, err = run_cli(capsys, "explain", EX / "causal_document.attn", "--kv-len", "8",
                           "--tensor", f"doc={tmp_path / 'doc.npz'}")
    assert code == 1 and "is an .npz archive; it takes one .npy array (np.save)" in err


# ---------------------------------------------------------------- resources
@pytest.mark.parametrize("args, what", [
    (("explain", CAUSAL, "--kv-len", "10000000"), "the tile plan (1 x 1 x 78,125 x 156,250 tiles of 128x64)"),
    (("explain", CAUSAL, "--kv-len", "65536", "--block", "1x1"), "the tile plan (1 x 1 x 65,536 x 65,536 tiles"),
    (("plan", PAGED, "--kv-lens", "1000000000"), "the split plan over 62,500,000 pages"),
    (("plan", PAGED, "--kv-lens", "1000000000,1000000000,1000000000"), "the split plan over 187,500,000 pages"),
    (("run", CAUSAL, "--kv-len", "100000", "--batch", "1", "--check"), "the float64 oracle of 'causal'"),
])
def test_oversized_calls_are_refused_before_allocating(capsys, args, what):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        code, _, err = run_cli(capsys, *args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 1 and what in err and "of host memory, over the limit of 4.0 GiB" in err, err
    assert "ATTNC_MEMORY_LIMIT" in err
    assert peak < 64 << 20 and time.perf_counter() - t0 < 20, (peak, what)


def test_the_limit_is_configurable(capsys, monkeypatch):
    args = ("explain", CAUSAL, "--kv-len", "4096")
    assert run_cli(capsys, *args)[0] == 0
    code, _, err = run_cli(capsys, *args, "--memory-limit", "1MiB")
    assert code == 1 and "over the limit of 1.0 MiB" in err
    monkeypatch.setenv("ATTNC_MEMORY_LIMIT", "1MiB")
    assert run_cli(capsys, *args)[0] == 1
    assert run_cli(capsys, *args, "--memory-limit", "1GiB")[0] == 0  # the flag wins for its command
    monkeypatch.setenv("ATTNC_MEMORY_LIMIT", "a lot")
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and "ATTNC_MEMORY_LIMIT='a lot'" in err
    assert resources.parse_size("2G") == resources.parse_size("2GiB") == 2 << 30
    assert resources.parse_size("1.5kb") == 1500


def test_lengths_past_int32_positions_are_refused():
    dims = dict(heads_q=2, heads_kv=2, d_qk=8)
    # a CSR page list declaring S_k = 2 * 2^30 + 1 >= 2^31 (pages of 2^30 rows)
    with pytest.raises(resources.ResourceError, match=r"kv_lens .*\[0\] = 2147483649 exceeds 1073741824"):
        layout.paged_csr([0, 3], [0, 1, 2], [1], page_size=2**30, num_pages=3, **dims)
    assert layout.quick_layout(type("C", (), {"kind": "paged", "layout": "nhd", "page_size": 2**30,
                                              "table": "csr"})(),
                               {"k_cache": np.zeros((3, 1, 2, 1)), "v_cache": np.zeros((3, 1, 2, 1)),
                                "kv_indptr": np.array([0, 3]), "kv_indices": np.arange(3),
                                "kv_last_page_len": np.array([1])}, heads_q=2, heads_kv=2) is None
    with pytest.raises(resources.ResourceError, match=r"kv_lens\[1\] = 2147483648"):
        layout.contiguous([5, 2**31], **dims)
    with pytest.raises(resources.ResourceError, match="2147483648"):
        layout.ragged([0, 2**31], **dims)
    program = compile_file(CAUSAL)
    cpu = Environment(device_type="cpu")
    with pytest.raises(CallError, match="S_k = 2147483648 exceeds 1073741824"):
        DispatchKey.from_call(program, {"B": 1, "S_q": 1, "S_k": 2**31}, cpu)


def test_sampled_inputs_are_budgeted():
    program = compile_file(CAUSAL)
    with pytest.raises(resources.ResourceError, match=r"sampled inputs of 'causal' \(B = 64, S_q = 1000000"):
        inputs.sample(program, 64, 1_000_000, 1_000_000)


# ---------------------------------------------------------------- run admission
def test_run_takes_the_backend_dispatch_selects(capsys):
    code, out, _ = run_cli(capsys, "run", CAUSAL, "--kv-len", "16")
    auto = "triton" if Environment.detect().device_type == "cuda" else "numpy"  # the interpreter only when forced
    assert code == 0 and out.startswith(f"causal on {auto}:")
    code, _, err = run_cli(capsys, "run", PAGED, "--kv-len", "16", "--backend", "ahbm")
    assert code == 1 and "forced backend ahbm rejects the call: cache_layout=paged_nhd unsupported" in err
    code, out, err = run_cli(capsys, "run", PAGED, "--kv-len", "16", "--cuda-graph")
    if auto == "triton":  # a CUDA device: the Triton backend replays the split call as a CUDA graph
        assert code == 0 and out.startswith("causal_document_gqa on triton:"), err
    else:  # no CUDA device: numpy is the only candidate, and it cannot be captured
        assert code == 1 and "every candidate rejects the call: numpy: graph_mode=true unsupported" in err
    code, _, err = run_cli(capsys, "run", PAGED, "--kv-len", "16", "--cuda-graph", "--backend", "numpy")
    assert code == 1 and "forced backend numpy rejects the call: graph_mode=true unsupported" in err
    if os.environ.get("TRITON_INTERPRET") == "1":
        code, _, err = run_cli(capsys, "run", PAGED, "--kv-len", "16", "--backend", "triton", "--cuda-graph")
        assert code == 1 and "forced backend triton rejects the call: graph_mode=true unsupported without a " \
                             "CUDA device" in err


NO_GPU_STACK = """
import sys
from attnc.compiler import cli
from attnc.compiler.dispatch import backend
from attnc.compiler.errors import BackendUnavailable
from attnc.compiler.lower import compile_file
assert cli.main(["run", sys.argv[1], "--kv-len", "8"]) == 0          # auto: numpy
assert cli.main(["run", sys.argv[1], "--kv-len", "8", "--backend", "triton"]) == 1
try:
    backend("triton").load(compile_file(sys.argv[1]))
except BackendUnavailable as e:
    print(e)
"""


def test_the_triton_backend_without_torch_or_triton_says_so():
    # the fixture first (its sitecustomize hides torch and triton by name, wherever they are), then
    # this checkout, then the parent's own path (where attnc's dependencies may live, e.g. lark)
    path = [str(ROOT / "tests" / "fixtures" / "no_gpu_stack"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", NO_GPU_STACK, str(CAUSAL)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "causal on numpy:" in r.stdout
    assert "forced backend triton rejects the call: triton not installed; torch not installed" in r.stderr
    assert "the triton backend needs torch and triton, and 'triton' cannot be imported here" in r.stdout
