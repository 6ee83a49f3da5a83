"""The context-parallel study and the one-rank overhead script run (issue 19): the study's rows on
a small grid, and the overhead script's CPU path (the numpy backend, tiny shapes) with its output
check; on the GPU the lead runs the full commands of bench/results/README.md."""
import json

import pytest

from attnc.bench import cp_overhead, cp_study


def test_study_rows(tmp_path):
    out = tmp_path / "study.jsonl"
    assert cp_study.main(["--out", str(out), "--masks", "causal,causal_document", "--lengths", "4096",
                          "--ranks", "2,4", "--block", "128"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 and {r["strategy"] for r in rows} == {"even", "zigzag", "balanced"}
    for group in range(0, len(rows), 3):
        assert sum(r["auto"] for r in rows[group:group + 3]) == 1
    causal4 = {r["strategy"]: r for r in rows if (r["mask"], r["ranks"]) == ("causal", 4)}
    assert causal4["zigzag"]["auto"] and causal4["even"]["imbalance"] > 1.5
    assert all(len(r["recv_bytes"]) == r["ranks"] and sum(r["tokens"]) == 4096 for r in rows)


def test_overhead_script_cpu_path(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "overhead.jsonl"
    assert cp_overhead.main(["--device", "cpu", "--seq", "32", "--heads", "2", "--head-dim", "8", "--batches", "1",
                             "--rounds", "1", "--calls", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mask"] for r in rows] == ["causal", "causal_document"]
    assert all(r["outputs_equal"] and r["ratio"] > 0 and r["device"] == "cpu" for r in rows)
    assert "worst ratio" in capsys.readouterr().out
