"""Caches that cannot be trusted (issue 35): the tuning cache reads and replaces regular files only
and skips entries a launch cannot take; generated modules fall back to a private temporary
directory when the cache root cannot be written, and are written atomically from any number of
threads; byte sizes in the environment have one parser and a located error."""
from __future__ import annotations

import json
import os
import stat
import threading

import numpy as np
import pytest

from attnc.backends import common
from attnc.compiler import cachedir, resources, tune
from attnc.compiler.errors import AttncError
from attnc.compiler.lower import compile_spec
from attnc.compiler.tune.cache import CacheWriteError

SPEC = "attention t { heads = 2 head_dim = 16 dtype = f32 mask = causal }"


def _doc(entries: dict) -> str:
    return json.dumps({"format": "attnc-tune", "version": 1, "entries": entries})


def _entry(digest: str, **config) -> dict:
    return {"digest": digest, "config": config, "median_ms": 1.0}


def test_a_fifo_at_the_cache_path_is_reported_never_opened_for_a_blocking_read(tmp_path):
    path = tmp_path / "tune.json"
    os.mkfifo(path)  # (a blocking open would hang here: no writer ever comes)
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert cache.entries == {} and any("is not a regular file" in m for m in msgs)
    cache.put(_entry("a", BLOCK_M=16))
    with pytest.raises(CacheWriteError, match="not a regular file"):
        cache.save()
    assert stat.S_ISFIFO(os.stat(path).st_mode) and not (tmp_path / "tune.json.lock").exists()
    assert tune.load_cache(path).entries == {}


def test_a_character_device_is_read_as_no_cache():
    msgs = []
    assert tune.TuneCache("/dev/null", report=msgs.append).entries == {}
    assert any("is not a regular file" in m for m in msgs)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_cli_tune_into_a_fifo_refuses_to_store_and_leaves_it(tmp_path, capsys):
    from attnc.compiler import cli
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    spec = tmp_path / "t.attn"
    spec.write_text(SPEC)
    rc = cli.main(["tune", str(spec), "--shapes", "1:4:8", "--backend", "numpy", "--cache", str(fifo),
                   "--repeats", "2", "--warmup", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and "not a regular file" in err and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("bad", [0, 3, "16", None, True, -16])
def test_entries_a_launch_cannot_take_are_reported_and_skipped(tmp_path, bad):
    path = tmp_path / "tune.json"
    path.write_text(_doc({"bad": _entry("bad", BLOCK_M=bad), "good": _entry("good", BLOCK_M=16)}))
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert list(cache.entries) == ["good"]
    assert any(f"entry bad is malformed (has an unusable BLOCK_M ({bad!r}))" in m for m in msgs)


def test_a_deeply_nested_file_is_corrupt_not_a_recursion_error(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    msgs = []
    assert tune.TuneCache(path, report=msgs.append).entries == {}
    assert any("nested too deeply" in m for m in msgs)


def test_a_triton_call_over_a_bad_tuned_entry_runs_its_default(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    import attnc
    attn = attnc.compile(SPEC)
    program = attn.specialize(2, 2, 16, 16, "f32")
    digest = tune.call_key(program, 1, 16, 16, "triton").digest
    path = tmp_path / "tune.json"
    path.write_text(_doc({digest: _entry(digest, BLOCK_M=3, BLOCK_N=16)}))
    monkeypatch.setenv("ATTNC_TUNE_CACHE", str(path))
    from tests.conftest import to_triton
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(3))
    o = attn(*map(to_triton, (q, k, v)), backend="triton")  # (CUDA tensors in a GPU run)
    ref = attn(q, k, v, backend="numpy")
    assert torch.allclose(o.cpu(), ref, atol=1e-4) and "unusable BLOCK_M (3)" in capsys.readouterr().err


@pytest.mark.parametrize("gpu", [False, True])
def test_a_tuned_tile_a_gpu_cannot_take_is_not_launched_there(monkeypatch, gpu):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from attnc.backends.triton import device, prefill_calls
    monkeypatch.setattr(device, "interpreted", lambda: not gpu)
    small, fine = {"BLOCK_M": 8, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}
    assert prefill_calls.runnable_tiles(small) == (None if gpu else small)
    assert prefill_calls.runnable_tiles(fine) == fine and prefill_calls.runnable_tiles(None) is None


# ---------------------------------------------------------------- generated modules
def test_an_unwritable_cache_root_falls_back_to_a_private_temporary_directory(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "home_file"
    blocker.write_text("a file where the cache's parent should be (a read-only home reads the same)")
    monkeypatch.setenv("ATTNC_CACHE", str(blocker / "attnc"))
    first = common.cache_dir()
    assert first != blocker / "attnc" and first.is_dir() and stat.S_IMODE(first.stat().st_mode) == 0o700
    assert common.cache_dir() == first  # one directory, one warning, per process
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1 and "ATTNC_CACHE" in err
    module = common.load_module("ANSWER = 42\n", "t_fallback")
    assert module.ANSWER == 42 and os.path.dirname(module.__file__) == str(first)


def test_first_calls_from_twelve_threads_write_each_module_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNC_CACHE", str(tmp_path))
    sources = [f"VALUE = {i}\n" + "# padding\n" * 20000 for i in range(8)]  # 8 new modules, 12 threads each
    barrier, errors, values = threading.Barrier(12), [], []

    def first_calls():
        try:
            for i, source in enumerate(sources):
                barrier.wait()
                values.append((i, common.load_module(source, "t_threads").VALUE))
        except Exception as e:  # noqa: BLE001 - the test reports whatever a thread hit
            errors.append(repr(e))
            barrier.abort()
    threads = [threading.Thread(target=first_calls) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(values) == sorted((i, i) for i in range(8) for _ in range(12))
    assert {p.suffix for p in tmp_path.iterdir() if p.is_file()} == {".py"}  # no temporary file left


def test_twelve_threads_compiling_new_specializations(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNC_CACHE", str(tmp_path))
    from attnc.backends.numpy import runtime
    programs = [compile_spec(f"attention w{i} {{ heads = 1 head_dim = 8 mask = causal & window({i + 1}) }}")
                for i in range(12)]
    barrier, errors = threading.Barrier(12), []

    def first_call(p):
        try:
            barrier.wait()
            runtime.load(p)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=first_call, args=(p,)) for p in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------- byte sizes
def test_the_plan_cache_budget_reads_sizes_as_the_memory_limit_does(monkeypatch):
    pytest.importorskip("torch")
    from attnc.backends.triton import plans
    monkeypatch.setenv("ATTNC_PLAN_CACHE_BYTES", "512MiB")
    assert plans.PlanCache().budget == resources.parse_size("512MiB") == 512 << 20
    monkeypatch.setenv("ATTNC_PLAN_CACHE_BYTES", "0")
    cache = plans.PlanCache()
    cache.put("k", object(), 1)
    assert cache.budget == 0 and len(cache) == 0
    monkeypatch.setenv("ATTNC_PLAN_CACHE_BYTES", "lots")
    with pytest.raises(AttncError, match="ATTNC_PLAN_CACHE_BYTES='lots': expected a size"):
        plans.PlanCache().put("k", object(), 1)
    monkeypatch.setenv("ATTNC_MEMORY_LIMIT", "0")
    with pytest.raises(AttncError, match="ATTNC_MEMORY_LIMIT='0': a size of at least 1 byte"):
        resources.memory_limit()
