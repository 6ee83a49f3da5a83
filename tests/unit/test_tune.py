"""Autotuning per dispatch key on the CPU with an injected timer (DESIGN §6, M4.5 §0x0BH)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnc.backends.numpy import tune as numpy_tune
from attnc.compiler import evidence, tune
from attnc.compiler.dispatch import DispatchKey, Environment
from attnc.compiler.errors import InputError
from attnc.compiler.lower import compile_spec

SPEC = "attention t { heads = 4 / 2 head_dim = 16 dtype = f16 mask = causal & window(8) }"
CPU = Environment(device_type="cpu", torch="2.13.0", triton="3.9.0")
INTERP = Environment(device_type="cpu", interpreter=True, torch="2.13.0", triton="3.9.0")


class FakeTimer:
    """Deterministic samples: the k-th timed candidate gets [100 - k, 100 - k + 1, ...] ms, so
    the last timed candidate wins; records how often it was asked."""

    synchronization = "injected (test)"

    def __init__(self):
        self.calls = 0

    def __call__(self, fn, warmup, repeats):
        for _ in range(warmup):
            fn()
        self.calls += 1
        return [100.0 - self.calls + 0.01 * i for i in range(repeats)]


def _quiet(msgs):
    return msgs.append


def test_parse_shapes():
    assert [str(s) for s in tune.parse_shapes("1:1:4096, 2:16:16")] == ["1:1:4096", "2:16:16"]
    for bad in ("1:2", "a:1:1", "1:8:4", "0:1:1", ""):
        with pytest.raises(InputError, match="--shapes"):
            tune.parse_shapes(bad)


def test_spaces_are_per_backend_declarations():
    p = compile_spec(SPEC)
    h200 = Environment(device_type="cuda", compute_capability=90, device_name="H200", torch="2", triton="3")
    prefill = DispatchKey.from_call(p, {"B": 1, "S_q": 4096, "S_k": 4096, "backend_request": "triton"}, h200)
    decode = DispatchKey.from_call(p, {"B": 8, "S_q": 1, "S_k": 200, "backend_request": "triton"}, h200)
    assert set(tune.SPACES["triton"]["prefill"].axes) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "use_tma"}
    assert {"BLOCK_N", "splits", "num_warps", "num_stages"} <= set(tune.SPACES["triton"]["decode"].axes)
    assert tune.family_of("triton", prefill) == "prefill" and tune.family_of("triton", decode) == "decode"
    cands = tune.space_for("triton", prefill).candidates(prefill)
    # the untuned default measured best on the H200 (backends/triton/choice.default_prefill_config)
    assert cands[0] == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "use_tma": True}
    assert any(c["use_tma"] for c in cands)  # sm_90
    dc = tune.space_for("triton", decode).candidates(decode)
    assert all(c["splits"] is None or c["splits"] <= -(-200 // c["BLOCK_N"]) for c in dc)
    excluded = dict((json.dumps(c, sort_keys=True), why) for c, why in
                    tune.space_for("triton", decode).excluded(decode))
    assert excluded[json.dumps({"BLOCK_N": 128, "splits": 4, "num_warps": 4, "num_stages": 2}, sort_keys=True)] \
        == "splits=4 exceeds the 2 K/V blocks"
    small = DispatchKey.from_call(p, {"S_q": 8, "S_k": 8, "backend_request": "numpy"}, CPU)
    assert all(c["BLOCK_M"] <= 16 and c["BLOCK_N"] <= 16 for c in tune.space_for("numpy", small).candidates(small))
    with pytest.raises(tune.TuneError, match="no search space"):
        tune.space_for("ahbm", small)


def test_tune_checks_then_times_and_stores_winner_with_raw_samples(tmp_path):
    p = compile_spec(SPEC)
    timer, msgs = FakeTimer(), []
    path = tmp_path / "tune.json"
    [res] = tune.tune(p, tune.parse_shapes("2:8:24"), "numpy", cache=path, timer=timer, warmup=1, repeats=4,
                      env=CPU, progress=_quiet(msgs))
    n = len(res.entry["candidates"])
    assert n == timer.calls == len(res.rows) > 2  # every candidate passed, so every one was timed
    assert res.config == res.entry["candidates"][-1]["config"]  # the fake timer favours the last
    assert res.entry["samples_ms"] == [100.0 - n + 0.01 * i for i in range(4)]
    assert res.entry["untuned"]["config"] == {"BLOCK_M": 16, "BLOCK_N": 16}
    assert res.entry["speedup_vs_untuned"] == pytest.approx((99.015) / (100 - n + 0.015))
    assert res.entry["correctness"]["pass"] and res.entry["synchronization"] == "injected (test)"
    assert any("winner" in m for m in msgs) and any(f"{n}/{n}" in m for m in msgs)  # progress
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("attnc-tune", 1)
    assert list(doc["entries"]) == [res.key.digest] and res.key.backend_request == "numpy"
    assert doc["entries"][res.key.digest]["key"] == res.key.to_json()
    # hooks: a hit gives the tuned config, a miss None (the caller keeps its heuristic)
    assert tune.tuned_config(res.key, cache=path) == res.config
    assert tune.tuned_config(res.key.with_(backend_request="auto"), "numpy", cache=path) == res.config
    assert tune.tuned_tiles(p, 2, 8, 24, "numpy", cache=path, env=CPU) == res.config
    assert tune.tuned_tiles(p, 2, 8, 32, "numpy", cache=path, env=CPU) is None
    assert tune.tuned_tiles(p, 2, 8, 4, "numpy", cache=path, env=CPU) is None  # malformed: not the cache's error
    assert tune.tuned_tiles(p, 2, 8, 24, "numpy", cache=tmp_path / "none.json", env=CPU) is None
    for row in res.rows:  # one evidence row per candidate, each at level 4
        rep = evidence.validate_row(row, min_samples=4)
        assert rep.ok and rep.level == 4, rep
    # a second run is a cache hit: nothing timed; --retune times again
    [again] = tune.tune(p, tune.parse_shapes("2:8:24"), "numpy", cache=path, timer=timer, env=CPU,
                        progress=_quiet(msgs))
    assert again.cached and timer.calls == n and again.config == res.config
    tune.tune(p, tune.parse_shapes("2:8:24"), "numpy", cache=path, timer=timer, repeats=4, env=CPU,
              progress=_quiet(msgs), retune=True)
    assert timer.calls == 2 * n


def test_a_failing_candidate_is_recorded_and_never_timed(tmp_path, monkeypatch):
    p = compile_spec(SPEC)

    class Broken(numpy_tune.NumpyRunner):
        def prepare(self, cfg):
            launch, host = super().prepare(cfg)
            if cfg["BLOCK_N"] == 8:
                return launch, lambda r: (host(r)[0] + 1.0, host(r)[1])
            if cfg["BLOCK_N"] == 16 and cfg["BLOCK_M"] == 8:
                def boom():
                    raise RuntimeError("out of resources: shared memory")
                return boom, host
            return launch, host

    monkeypatch.setattr(numpy_tune, "RUNNER", Broken)
    timer, msgs = FakeTimer(), []
    [res] = tune.tune(p, tune.parse_shapes("1:16:16"), "numpy", cache=tmp_path / "t.json", timer=timer,
                      warmup=0, repeats=3, env=CPU, progress=_quiet(msgs))
    status = {json.dumps(r["config"], sort_keys=True): r["status"] for r in res.entry["candidates"]}
    assert status[json.dumps({"BLOCK_M": 16, "BLOCK_N": 8}, sort_keys=True)] == "failed"
    assert status[json.dumps({"BLOCK_M": 8, "BLOCK_N": 16}, sort_keys=True)] == "error"
    timed = [r for r in res.entry["candidates"] if r["status"] == "timed"]
    assert timer.calls == len(timed) and res.config["BLOCK_N"] != 8
    assert all("samples_ms" not in r for r in res.entry["candidates"] if r["status"] != "timed")
    failed_rows = [r for r in res.rows if not r["correctness"]["pass"]]
    assert failed_rows and all("measurement" not in r for r in failed_rows)
    rep = evidence.validate_row(failed_rows[0])
    assert rep.ok and rep.claim == "correctness_failed"
    assert any("FAILED correctness" in m and "not timed" in m for m in msgs)
    assert any("error RuntimeError: out of resources" in m for m in msgs)


def test_no_passing_candidate_is_an_error(tmp_path, monkeypatch):
    p = compile_spec(SPEC)

    class Wrong(numpy_tune.NumpyRunner):
        def prepare(self, cfg):
            launch, host = super().prepare(cfg)
            return launch, lambda r: (host(r)[0] * 2 + 1, host(r)[1])

    monkeypatch.setattr(numpy_tune, "RUNNER", Wrong)
    with pytest.raises(tune.TuneError, match="no candidate passed"):
        tune.tune(p, tune.parse_shapes("1:8:8"), "numpy", cache=tmp_path / "t.json", timer=FakeTimer(),
                  env=CPU, progress=lambda m: None)
    assert not (tmp_path / "t.json").exists()


def test_forced_backend_fails_closed_with_reasons(tmp_path):
    p = compile_spec(SPEC)
    with pytest.raises(tune.TuneError, match=r"forced backend triton rejects the call: device_type=cpu outside"):
        tune.tune(p, tune.parse_shapes("1:8:8"), "triton", cache=tmp_path / "t.json", timer=FakeTimer(),
                  env=CPU, progress=lambda m: None)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is corrupt"),
    (json.dumps({"format": "attnc-tune", "version": 99, "entries": {}}), "has version 99"),
    (json.dumps({"format": "something-else"}), "is not an attnc tuning cache"),
    (json.dumps([1, 2]), "is not an attnc tuning cache"),
])
def test_corrupt_or_foreign_cache_is_reported_and_ignored(tmp_path, content, message):
    p = compile_spec(SPEC)
    path = tmp_path / "tune.json"
    path.write_text(content)
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert cache.entries == {} and any(message in m for m in msgs)
    key = DispatchKey.from_call(p, {"S_q": 8, "S_k": 8, "backend_request": "numpy"}, CPU)
    assert tune.tuned_config(key, cache=cache) is None
    [res] = tune.tune(p, tune.parse_shapes("1:8:8"), "numpy", cache=cache, timer=FakeTimer(), repeats=2,
                      env=CPU, progress=msgs.append)
    assert json.loads(path.read_text())["entries"][res.key.digest]["config"] == res.config
    assert (tmp_path / "tune.json.bad").read_text() == content  # set aside, not destroyed


def test_malformed_entry_is_skipped_and_others_kept(tmp_path):
    path = tmp_path / "tune.json"
    good = {"digest": "a" * 64, "config": {"BLOCK_M": 16}, "median_ms": 0.5}
    path.write_text(json.dumps({"format": "attnc-tune", "version": 1,
                                "entries": {"a" * 64: good, "b" * 64: {"config": 3}}}))
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert list(cache.entries) == ["a" * 64] and any("malformed" in m for m in msgs)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    cache = tune.TuneCache(path)
    cache.put({"digest": "a" * 64, "config": {"BLOCK_M": 16}})
    cache.save()
    before = path.read_text()
    cache.put({"digest": "b" * 64, "config": {"BLOCK_M": 32}})

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(json, "dump", crash)  # the stdlib module the cache writes with
    with pytest.raises(OSError, match="disk full"):
        cache.save()
    assert path.read_text() == before  # the old file, whole
    # no temporary left behind (the lock file stays: removing it would race with a waiting writer)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["tune.json", "tune.json.lock"]


def test_split_auto_consults_the_cache(tmp_path):
    from attnc.compiler.analysis import splits
    auto = compile_spec("attention t { heads = 8 / 2 head_dim = 64 mask = causal "
                        "cache = paged(page_size = 16, layout = nhd) split = auto }")
    fixed = compile_spec("attention t { heads = 8 / 2 head_dim = 64 mask = causal split = balanced(3) }")
    h200 = Environment(device_type="cuda", compute_capability=90, device_name="H200", torch="2", triton="3")
    key = DispatchKey.from_call(auto, {"B": 4, "S_q": 1, "S_k": 4096, "backend_request": "triton"}, h200)
    cache = tune.TuneCache(tmp_path / "t.json")
    assert isinstance(tune.tuned_split_policy(auto, key, cache), splits.Auto)  # miss: the heuristic
    cache.put({"digest": key.digest, "config": {"BLOCK_N": 64, "splits": 8, "num_warps": 4, "num_stages": 2}})
    assert tune.tuned_split_policy(auto, key, cache) == splits.balanced(8)
    assert tune.tuned_split_policy(auto, key.with_(backend_request="auto"), cache) == splits.balanced(8)
    assert tune.tuned_split_policy(fixed, key, cache) == splits.balanced(3)  # a declared policy is the spec's
    assert tune.tuned_split_policy(auto, None, cache) == splits.auto()


def test_big_shapes_check_a_row_sample_with_the_oracle():
    from attnc.compiler import inputs
    p = compile_spec(SPEC)
    arrays = inputs.sample(p, 3, 64, 96, seed=0)
    call = inputs.validate(p, arrays)
    ref = tune.reference_for(p, call, max_cells=4 * 96 * 10)
    assert ref.o.shape == (1, 4, 10, 16) and "rows [54, 64) of 64" in ref.description
    from attnc.compiler.dispatch import backend
    o, lse = backend("numpy").load(p)(arrays["q"], arrays["k"], arrays["v"], return_lse=True)
    assert all(c.ok for c in tune.check_against(p, ref, o, lse))
    assert not all(c.ok for c in tune.check_against(p, ref, np.roll(o, 1, axis=2), lse))


def test_triton_interpreter_prefill_and_decode_tune_on_a_tiny_shape(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    p = compile_spec(SPEC)
    timer = FakeTimer()
    results = tune.tune(p, tune.parse_shapes("1:8:16,2:1:20"), "triton", cache=tmp_path / "t.json", timer=timer,
                        warmup=0, repeats=2, env=INTERP, progress=lambda m: None)
    assert [r.entry["family"] for r in results] == ["interpreter_prefill", "interpreter_decode"]
    assert all(r.entry["correctness"]["pass"] for r in results)
    assert "splits" in results[1].config
    assert tune.tuned_tiles(p, 1, 8, 16, "triton", cache=tmp_path / "t.json", env=INTERP) == results[0].config
