"""The tuning cache under concurrent writers and damaged files (issue 18): a lock and merge on
write keep every entry; whatever cannot be read is reported and skipped, tuning goes on; a
directory is never renamed."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from attnc.compiler import cli, tune
from attnc.compiler.tune.cache import CacheWriteError
from tests.conftest import ROOT
from tests.unit.test_tune import CPU, SPEC, FakeTimer

from attnc.compiler.lower import compile_spec


def _entry(digest: str, ms: float = 1.0) -> dict:
    return {"digest": digest, "config": {"BLOCK_M": 16}, "median_ms": ms}


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from attnc.compiler.tune import TuneCache
    path, me, other = sys.argv[1], sys.argv[2], sys.argv[3]
    cache = TuneCache(path)                      # both read the cache before either writes
    Path(path + "." + me + ".ready").touch()
    deadline = time.time() + 60
    while not Path(path + "." + other + ".ready").exists():
        if time.time() > deadline:
            sys.exit("the other writer never started")
        time.sleep(0.005)
    for i in range(2):
        cache.put({"digest": me * 8 + str(i), "config": {"i": i}, "median_ms": 1.0})
        cache.save()
""")


def test_two_processes_writing_two_entries_each_keep_all_four(tmp_path):
    path = tmp_path / "tune.json"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), me, other], env=env, cwd=ROOT,
                              stderr=subprocess.PIPE, text=True)
             for me, other in (("a", "b"), ("b", "a"))]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    entries = json.loads(path.read_text())["entries"]
    assert sorted(entries) == ["aaaaaaaa0", "aaaaaaaa1", "bbbbbbbb0", "bbbbbbbb1"]


def test_a_merge_keeps_other_writers_entries_and_ours_win_our_digests(tmp_path):
    path = tmp_path / "tune.json"
    mine, theirs = tune.TuneCache(path), tune.TuneCache(path)
    theirs.put(_entry("x", 2.0))
    theirs.put(_entry("shared", 9.0))
    theirs.save()
    mine.put(_entry("shared", 1.0))
    mine.save()
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {"x", "shared"} and entries["shared"]["median_ms"] == 1.0
    assert set(mine.entries) == {"x", "shared"}  # the writer now sees the merged cache


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe not utf-8", "is not UTF-8 text"),
    (b"{half", "is corrupt"),
])
def test_an_unreadable_file_is_reported_then_set_aside_by_the_next_write(tmp_path, content, message):
    path = tmp_path / "tune.json"
    path.write_bytes(content)
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert cache.entries == {} and [m for m in msgs if message in m]
    cache.put(_entry("a"))
    cache.save()
    assert list(json.loads(path.read_text())["entries"]) == ["a"]
    assert (tmp_path / "tune.json.bad").read_bytes() == content


def test_an_entry_without_median_ms_is_reported_skipped_and_kept_on_disk(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"format": "attnc-tune", "version": 1, "entries": {
        "a": _entry("a"), "b": {"digest": "b", "config": {"BLOCK_M": 16}}}}))
    msgs = []
    cache = tune.TuneCache(path, report=msgs.append)
    assert list(cache.entries) == ["a"]
    assert any("entry b is malformed (has no usable median_ms (None))" in m for m in msgs)
    cache.put(_entry("c"))
    cache.save()
    assert sorted(json.loads(path.read_text())["entries"]) == ["a", "b", "c"]  # not ours to drop
    assert len([m for m in msgs if "entry b" in m]) == 1  # reported once, not at every save


def test_tuning_over_a_malformed_entry_tunes_that_key_again(tmp_path, capsys):
    p = compile_spec(SPEC)
    path = tmp_path / "tune.json"
    [first] = tune.tune(p, tune.parse_shapes("1:8:8"), "numpy", cache=path, timer=FakeTimer(), repeats=2,
                        env=CPU, progress=lambda m: None)
    doc = json.loads(path.read_text())
    del doc["entries"][first.key.digest]["median_ms"]
    path.write_text(json.dumps(doc))
    msgs = []
    [again] = tune.tune(p, tune.parse_shapes("1:8:8"), "numpy", cache=path, timer=FakeTimer(), repeats=2,
                        env=CPU, progress=msgs.append)
    assert not again.cached and any("is malformed" in m for m in msgs)
    assert "median_ms" in json.loads(path.read_text())["entries"][first.key.digest]


def test_an_unwritable_cache_is_reported_and_tuning_goes_on(tmp_path, capsys):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache's directory should be")
    path = blocker / "tune.json"
    cache = tune.TuneCache(path)
    cache.put(_entry("a"))
    with pytest.raises(CacheWriteError, match="cannot write tuning cache"):
        cache.save()
    msgs = []
    results = tune.tune(compile_spec(SPEC), tune.parse_shapes("1:8:8,1:4:8"), "numpy", cache=cache,
                        timer=FakeTimer(), repeats=2, env=CPU, progress=msgs.append)
    assert len(results) == 2 and all(r.entry["median_ms"] > 0 for r in results)  # both shapes tuned
    assert len([m for m in msgs if "is not stored" in m]) == 1
    assert blocker.read_text().startswith("a file")


def test_cli_tune_into_an_unwritable_cache_prints_results_and_exits_1(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    spec = tmp_path / "t.attn"
    spec.write_text(SPEC)
    rc = cli.main(["tune", str(spec), "--shapes", "1:4:8", "--backend", "numpy", "--cache",
                   str(tmp_path / "f" / "tune.json"), "--repeats", "2", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert rc == 1 and "1:4:8" in out and "not stored: cannot write tuning cache" in err


def test_cache_dir_means_the_file_inside_and_is_never_renamed(tmp_path, capsys):
    folder = tmp_path / "cache_dir"
    folder.mkdir()
    (folder / "keep.txt").write_text("user data")
    spec = tmp_path / "t.attn"
    spec.write_text(SPEC)
    args = ["tune", str(spec), "--shapes", "1:4:8", "--backend", "numpy", "--cache", str(folder),
            "--repeats", "2", "--warmup", "0", "--json"]
    assert cli.main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["cache"] == str(folder / "tune.json") and first["stored"] is True
    assert (folder / "keep.txt").read_text() == "user data" and not (tmp_path / "cache_dir.bad").exists()
    assert cli.main(args) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["cached"] is True
