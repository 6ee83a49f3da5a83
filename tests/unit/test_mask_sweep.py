"""bench/mask_sweep.py (issue 34's mask-family sweep) without a GPU: the generator, the two
translations of each mask (.attn and Flex mask_mod) against the oracle, the public call's check
on the CPU, and the summary, so the sweep cannot rot between GPU runs."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the sweep's mask_mods are torch ops")

from attnc.bench import mask_sweep as M  # noqa: E402


def test_the_generator_is_seeded_and_covers_every_atom():
    a, b = M.masks(200, 0, 8192), M.masks(200, 0, 8192)
    assert [m.attn() for m in a] == [m.attn() for m in b]
    assert len({m.attn() for m in a}) == 200
    assert {x for m in a for x in m.atoms()} == set(M.ATOMS)
    # the same seed at a small length: the same structures, smaller sizes
    small = M.masks(200, 0, 96)
    assert [m.atoms() for m in small[:20]] == [m.atoms() for m in a[:20]]
    assert M.masks(5, 1, 8192)[0].attn() != a[0].attn()


@pytest.mark.parametrize("index", range(6))
def test_a_handful_of_masks_check_against_the_oracle(index):
    node = M.masks(6, 3, 128)[index]
    fig = M.check_mask(node, index, batch=2, heads=1, s=128, head_dim=8)
    assert fig["rel_l2_error"] < 1e-2


def test_a_wrong_translation_is_caught():
    import numpy as np
    import attnc
    node = M.Node("and", children=(M.Node("causal"), M.Node("periodic_rows", (8, 2))))
    wrong = M.Node("and", children=(M.Node("causal"), M.Node("periodic_rows", (8, 3))))
    program = attnc.compile(M.spec_text(node, 0)).specialize(1, 1, 8, 8, "bf16")
    M.check_translation(node, program, 1, 32, None)
    with pytest.raises(AssertionError, match="differs from the oracle"):
        M.check_translation(wrong, program, 1, 32, None)
    assert np.all(M.documents(np.random.default_rng(0), 2, 64)[:, 0] == 0)


def test_summary():
    def row(i, impl, ms):
        return {"bench": "mask_sweep", "index": i, "mask": f"m{i}", "impl": impl, "pass": True, "median_ms": ms}
    rows = [row(0, "attnc_call", 1.0), row(0, "flex_triton", 1.5), row(0, "flex_flash", 0.9),
            row(1, "attnc_call", 2.0), row(1, "flex_triton", 2.2),
            {"bench": "mask_sweep", "index": 1, "mask": "m1", "impl": "flex_flash", "error": "no flash-attn-4"}]
    s = M.summarize(rows)
    assert s["masks_timed"] == 2 and s["error_rows"] == 1 and s["errors_by_impl"] == {"flex_flash": 1}
    t = s["flex_triton"]
    assert (t["n"], t["min"], t["max"], t["below_goal"]) == (2, pytest.approx(1.1), pytest.approx(1.5), 1)
    assert t["bottom"][0]["mask"] == "m1"
    assert s["flex_flash"]["n"] == 1 and s["flex_flash"]["min"] == pytest.approx(0.9)


# ------------------------------------------------------------------ warm-up and time budget
@pytest.mark.parametrize("start, count, workers", [(0, 200, 14), (0, 7, 3), (5, 10, 4), (3, 2, 5), (0, 1, 1),
                                                   (12, 13, 13), (0, 0, 4), (4, 9, 1)])
def test_the_slices_cover_every_mask_once_in_order(start, count, workers):
    parts = M.slices(start, count, workers)
    assert [i for s, c in parts for i in range(s, s + c)] == list(range(start, start + count))
    assert len(parts) <= workers and all(c > 0 for _, c in parts)
    if parts:
        assert max(c for _, c in parts) - min(c for _, c in parts) <= 1
        assert len(parts) == min(workers, count)
    assert M.slices(start, count, 0) == []


def test_the_new_options_parse():
    a = M.parser().parse_args(["--warm-workers", "14", "--time-budget", "540", "--start", "32", "--flex", "triton"])
    assert (a.warm_workers, a.time_budget, a.start, a.flex) == (14, 540.0, 32, "triton")
    a = M.parser().parse_args([])
    assert (a.warm_workers, a.time_budget) == (0, None)
    for bad in (["--warm-workers", "2", "--check-only"], ["--warm-workers", "-1"], ["--time-budget", "-5"],
                ["--time-budget", "soon"]):
        with pytest.raises(SystemExit):
            M.main(bad)
    w = M.worker_command(a, 6, 3, "x.jsonl")
    assert w[1:3] == ["-m", f"{M.__package__}.mask_sweep_warm"]
    assert w[w.index("--start") + 1: w.index("--start") + 4] == ["6", "--count", "3"]
    assert w[w.index("--seq") + 1] == "8192" and w[w.index("--out") + 1] == "x.jsonl"


def _rows(path):
    import json
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_zero_budget_checks_nothing_and_names_the_resume_index(tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    assert M.main(["--check-only", "--start", "3", "--count", "5", "--time-budget", "0", "--out", str(out)]) == 0
    assert "resume with --start 3 --count 5" in capsys.readouterr().out
    rows = _rows(out)
    assert [r["bench"] for r in rows] == ["mask_sweep_stop"]
    assert (rows[0]["next_start"], rows[0]["next_count"], rows[0]["stopped_by_time_budget"]) == (3, 5, True)


def test_the_budget_stops_before_the_mask_that_starts_past_it(tmp_path, capsys, monkeypatch):
    """Each (fake) check takes one second of a fake clock; a budget of 2.5 s starts masks at 0, 1
    and 2 s and stops before the fourth; without a budget all five run and nothing is resumed."""
    clock = [100.0]
    monkeypatch.setattr(M, "_now", lambda: clock[0])

    def check(node, index, s):
        clock[0] += 1.0
        return {"rel_l2_error": 0.0, "s": s, "backend": "fake"}

    monkeypatch.setattr(M, "check_mask", check)
    out = tmp_path / "sweep.jsonl"
    M.main(["--check-only", "--start", "7", "--count", "5", "--time-budget", "2.5", "--out", str(out)])
    assert "resume with --start 10 --count 2" in capsys.readouterr().out
    rows = _rows(out)
    assert [r["index"] for r in rows if r["bench"] == "mask_sweep"] == [7, 8, 9]
    assert rows[-1]["bench"] == "mask_sweep_stop" and rows[-1]["next_start"] == 10
    out2 = tmp_path / "all.jsonl"
    M.main(["--check-only", "--start", "7", "--count", "5", "--out", str(out2)])
    assert "resume" not in capsys.readouterr().out
    assert [r["index"] for r in _rows(out2)] == [7, 8, 9, 10, 11]


def test_the_warm_up_runs_its_workers_and_survives_a_failing_one(tmp_path, monkeypatch):
    """Real workers (the same steps on the CPU, attnc's call only, at a tiny shape) over masks 2..6
    in three slices; the second worker's command fails at once: its masks are not warmed, the
    others are, and every worker has its row."""
    import sys
    real = M.worker_command

    def command(a, start, count, out):
        if start == 4:  # the second slice of 2..6 over three workers: (2, 2), (4, 2), (6, 1)
            return [sys.executable, "-c", "import sys; sys.exit(3)"]
        return real(a, start, count, out) + ["--device", "cpu"]

    monkeypatch.setattr(M, "worker_command", command)
    a = M.parser().parse_args(["--start", "2", "--count", "5", "--warm-workers", "3", "--seq", "64", "--batch", "1",
                               "--heads", "1", "--head-dim", "16", "--flex", ""])
    rows = []
    ok = M.warm_up(a, str(tmp_path / "sweep.jsonl"), rows)
    assert ok == {2, 3, 6}
    warm = [r for r in rows if r["bench"] == "mask_sweep_warm"]
    assert [r["index"] for r in warm] == [2, 3, 6] and all("attnc_call" in r["ms"] for r in warm)
    workers = [r for r in rows if r["bench"] == "mask_sweep_warm_worker"]
    assert [(r["start"], r["count"], r["returncode"], r["masks_done"]) for r in workers] == [
        (2, 2, 0, 2), (4, 2, 3, 0), (6, 1, 0, 1)]
    assert not list((tmp_path / "sweep.warm").glob("*.jsonl"))  # merged into the rows


def test_the_warm_up_kills_workers_still_running_at_the_deadline(tmp_path, monkeypatch):
    """The killed workers' rows written so far are kept, a line cut short by the kill skipped."""
    import sys
    script = ("import sys, time; f = open(sys.argv[1], 'w'); "
              "f.write('{\"bench\": \"mask_sweep_warm\", \"index\": %s, \"errors\": {}}\\n{\"bench\": '); "
              "f.flush(); time.sleep(120)")
    monkeypatch.setattr(M, "worker_command", lambda a, start, count, out: [
        sys.executable, "-c", script % start, out])
    a = M.parser().parse_args(["--count", "4", "--warm-workers", "2"])
    rows = []
    t0 = M._now()
    assert M.warm_up(a, str(tmp_path / "s.jsonl"), rows, deadline=t0 + 3.0) == {0, 2}
    assert M._now() - t0 < 30
    workers = [r for r in rows if r["bench"] == "mask_sweep_warm_worker"]
    assert [(r["returncode"] < 0, r["masks_done"]) for r in workers] == [(True, 1), (True, 1)]


def test_the_timing_loop_passes_the_warm_up_on_and_stops_on_the_budget(tmp_path, capsys, monkeypatch):
    """The timing path without a GPU: warm-up, time_mask and the environment stubbed; the rows say
    which masks were warmed, and the summary carries the resume index."""
    from attnc.bench import harness
    clock, seen = [0.0], []
    monkeypatch.setattr(M, "_now", lambda: clock[0])
    monkeypatch.setattr(M, "shared_caches", lambda: "cache")
    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "none"})
    monkeypatch.setattr(M, "warm_up", lambda a, out, rows, deadline: {0, 2})
    monkeypatch.setattr(M, "check_mask", lambda node, index, s: {"rel_l2_error": 0.0})

    def time_mask(node, index, rows, *, warmed, **kw):
        seen.append((index, warmed))
        clock[0] += 10.0

    monkeypatch.setattr(M, "time_mask", time_mask)
    out = tmp_path / "sweep.jsonl"
    M.main(["--count", "4", "--warm-workers", "2", "--time-budget", "25", "--out", str(out)])
    assert seen == [(0, True), (1, False), (2, True)]
    text = capsys.readouterr().out
    assert "   1 wall 10.0 s (run 20 s)" in text and "resume with --start 3 --count 1" in text
    summary = _rows(out)[-1]
    assert summary["bench"] == "mask_sweep_summary" and summary["next_start"] == 3 and summary["masks"] == 3
    assert summary["warm_workers"] == 2
