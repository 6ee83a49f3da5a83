"""`attnc dispatch` and `attnc tune` as a user runs them (DESIGN §7): a subprocess per call."""
import json
import os
import subprocess
import sys

from attnc.compiler import evidence
from tests.conftest import ROOT

CAUSAL = ROOT / "examples" / "causal.attn"
PAGED = ROOT / "examples" / "causal_document_gqa.attn"


def attnc(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "attnc", *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def _call(tmp_path, **fields):
    path = tmp_path / "call.json"
    path.write_text(json.dumps(fields))
    return path


def test_dispatch_prints_selection_and_every_rejection(tmp_path):
    call = _call(tmp_path, B=2, q_len=1, kv_lens=[4096, 100], device="cuda", compute_capability=90)
    r = attnc("dispatch", PAGED, "--call", call)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("dispatch key ") and "phase=decode" in out and "S_k=4096,100" in out
    assert "1. triton         eligible  <- selected" in out and out.rstrip().endswith("selected: triton")
    # graph mode: the split kernels replay from a CUDA graph (Kernel.decode_graph); the numpy
    # backend's host code cannot be captured, the interpreter has no graphs
    graph = _call(tmp_path, B=2, q_len=1, kv_lens=[4096, 100], device="cuda", compute_capability=90,
                  cuda_graph=True)
    real = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    r = attnc("dispatch", PAGED, "--call", graph, env=real)
    assert r.returncode == 0 and "1. triton         eligible  <- selected" in r.stdout
    assert "[C] graph_mode=true unsupported (host code cannot be captured in a CUDA graph)" in r.stdout
    r = attnc("dispatch", PAGED, "--call", graph, env={**real, "TRITON_INTERPRET": "1"})
    assert r.returncode == 1 and "[C] graph_mode=true unsupported without a CUDA device" in r.stdout
    prefill = _call(tmp_path, B=1, S_q=64, S_k=64, device="cuda", compute_capability=90, cuda_graph=True)
    r = attnc("dispatch", CAUSAL, "--call", prefill, env=real)
    assert r.returncode == 1 and r.stdout.count("[C] graph_mode=true") == 2
    assert "[C] graph_mode=true unsupported for prefill on a contiguous cache" in r.stdout
    assert "error: every candidate rejects the call" in r.stdout


def test_dispatch_force_fails_closed_and_json(tmp_path):
    hopper = _call(tmp_path, B=1, S_q=64, S_k=64, device="cuda", compute_capability=90)
    r = attnc("dispatch", PAGED, "--call", hopper, "--force", "triton")  # prefill over pages: the split kernels
    assert r.returncode == 0 and "selected: triton" in r.stdout
    call = _call(tmp_path, B=1, S_q=64, S_k=64, device="cuda", compute_capability=75)
    r = attnc("dispatch", PAGED, "--call", call, "--force", "triton")
    assert r.returncode == 1
    assert "policy: forced triton (fail closed)" in r.stdout
    assert "[H] compute_capability=75 unsupported" in r.stdout and "numpy" not in r.stdout.split("policy:")[1]
    r = attnc("dispatch", PAGED, "--call", call, "--json")
    assert r.returncode == 0
    obj = json.loads(r.stdout)
    assert obj["selected"] == "numpy" and obj["fallbacks"] == ["triton"] and len(obj["digest"]) == 64
    assert obj["key"]["runtime"]["cache_layout"] == "paged_nhd"


def test_dispatch_malformed_call_is_an_error_not_unsupported(tmp_path):
    r = attnc("dispatch", CAUSAL, "--call", _call(tmp_path, q_len=9, kv_len=4, num_q_heads=16))
    assert r.returncode == 1 and r.stdout == ""
    assert "error: the call has H_q = 16 but spec 'causal' declares 8" in r.stderr
    r = attnc("dispatch", CAUSAL, "--call", _call(tmp_path, q_len=9, kv_len=4))
    assert "error: malformed call: request 0: S_q = 9 query rows exceed S_k = 4 keys" in r.stderr
    r = attnc("dispatch", CAUSAL, "--call", tmp_path / "missing.json")
    assert r.returncode == 1 and "cannot read call file" in r.stderr
    r = attnc("dispatch", CAUSAL, "--call", _call(tmp_path, S_q=1, S_k=8, backend="flash9"))
    assert r.returncode == 1 and "not a registered backend" in r.stderr


def test_tune_numpy_end_to_end(tmp_path):
    cache = tmp_path / "tune.json"
    r = attnc("tune", CAUSAL, "--shapes", "1:8:16,2:16:16", "--backend", "numpy", "--cache", cache,
              "--repeats", "3", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    assert "[1/2] B=1 S_q=8 S_k=16" in r.stderr and "[2/2]" in r.stderr and "winner" in r.stderr  # progress
    lines = r.stdout.splitlines()
    assert lines[0] == f"causal on numpy: tuning cache {cache}"
    assert lines[2].lstrip().startswith("1:8:16") and lines[3].lstrip().startswith("2:16:16")
    doc = json.loads(cache.read_text())
    assert doc["format"] == "attnc-tune" and len(doc["entries"]) == 2
    for digest, e in doc["entries"].items():
        assert e["digest"] == digest and len(e["samples_ms"]) == 3 and e["correctness"]["pass"]
        assert all(c["status"] == "timed" for c in e["candidates"])
    r = attnc("tune", CAUSAL, "--shapes", "2:16:16", "--backend", "numpy", "--cache", cache, "--json")
    obj = json.loads(r.stdout)
    assert obj["results"][0]["cached"] is True and "cached" in r.stderr


def test_tune_evidence_rows_validate(tmp_path):
    rows = tmp_path / "rows.jsonl"
    r = attnc("tune", CAUSAL, "--shapes", "1:4:8", "--backend", "numpy", "--cache", tmp_path / "t.json",
              "--warmup", "0", "--repeats", "3", "--evidence", rows)
    assert r.returncode == 1 and "need at least 20 raw samples" in r.stderr
    r = attnc("tune", CAUSAL, "--shapes", "1:4:8", "--backend", "numpy", "--cache", tmp_path / "t.json",
              "--warmup", "0", "--repeats", "20", "--evidence", rows)
    assert r.returncode == 0, r.stderr
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert written and all(evidence.check_row(w).level == 4 for w in written)


def test_tune_reports_a_corrupt_cache_and_fails_closed_without_a_gpu(tmp_path):
    cache = tmp_path / "tune.json"
    cache.write_text("{ half a file")
    r = attnc("tune", CAUSAL, "--shapes", "1:4:8", "--backend", "numpy", "--cache", cache, "--repeats", "2",
              "--warmup", "0")
    assert r.returncode == 0 and "is corrupt" in r.stderr and "ignoring it" in r.stderr
    assert json.loads(cache.read_text())["entries"] and (tmp_path / "tune.json.bad").exists()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = attnc("tune", CAUSAL, "--shapes", "1:4:8", "--cache", cache, env=env)
    if r.returncode == 0:  # a GPU host: tuned for real
        assert r.stdout.startswith("causal on triton")
    else:  # a CPU host: the forced backend fails closed with its reason
        assert "forced backend triton rejects the call: device_type=cpu outside platforms" in r.stderr
