"""`attnc plan --json --device here` reports what the Triton split launch here runs and allocates
(issue 37, issue 35 "Contracts"): for every split policy, ``split = auto`` included, untuned or
with an `attnc tune` entry for the call, the plan's slots are the launch's split count and its
``workspace_bytes.allocated`` the bytes of the workspace the launch allocates (Triton interpreted
on the CPU, or a GPU with ATTNC_TEST_GPU=1).  ``tests/unit/test_split_choice.py`` checks the
same for a simulated sm_90 device, where the Gluon engine takes long appends."""
import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import cli, inputs, tune  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402

KV, Q = [300, 57], {"decode": [1, 1], "mixed": [3, 1]}


def plan_and_launch(spec, q_lens, monkeypatch, capsys):
    """(`attnc plan --json --device here`'s report, [(slots, workspace bytes)] of each split launch)."""
    assert cli.main(["plan", str(spec), "--kv-lens", ",".join(map(str, KV)), "--q-lens",
                     ",".join(map(str, q_lens)), "--json", "--device", "here"]) == 0
    report = json.loads(capsys.readouterr().out)
    kernel = runtime.load(compile_file(spec))
    launched = []
    launch = kernel._launch_split

    def record(bound, *args):
        launched.append((bound.plan["splits"], bound.workspace_bytes))
        return launch(bound, *args)

    monkeypatch.setattr(kernel, "_launch_split", record)
    arrays = inputs.sample_cache(kernel.program, KV, q_lens, seed=1)
    o, _ = kernel.run(arrays, return_lse=True, engine="split")
    assert np.isfinite(o).all()
    return report, launched


@pytest.mark.parametrize("split, rows, state", [
    ("auto", "decode", "lse_o"), ("auto", "mixed", "lse_o"), ("balanced(3)", "decode", "lse_o"),
    ("chunk(128)", "decode", "lse_o"), ("capacity(2, 4)", "decode", "lse_o"), ("heuristic(0.85)", "decode", "lse_o"),
    ("auto", "decode", "mlu"), ("auto", "mixed", "shared_shift(0.0, -30, 30)")])
def test_attnc_plan_reports_the_triton_launch(tmp_path, monkeypatch, capsys, split, rows, state):
    monkeypatch.setenv("ATTNC_TUNE_CACHE", str(tmp_path / "no_tune_cache.json"))  # untuned: the rule decides
    spec = tmp_path / "plan_launch.attn"
    spec.write_text("attention plan_launch { heads = 4 / 2 head_dim = 16 dtype = f16 mask = causal "
                    f"cache = paged(page_size = 16, layout = nhd) split = {split} state = {state} }}\n")
    report, launched = plan_and_launch(spec, Q[rows], monkeypatch, capsys)
    assert launched == [(report["capacity"], report["workspace_bytes"]["allocated"])], report["policy"]
    assert report["launch"]["tuning_cache"] == "miss"


# attnc tune's winners as its cache stores them: a split count (the launch shares blocks that many
# ways), and a winner without one (the rule then counts the tuned block's K/V blocks: 10 of 32 rows
# in the 300-row request where the untuned 64-row block gives 5)
WINNERS = {"splits": {"BLOCK_N": 16, "splits": 2, "num_warps": 4, "num_stages": 1},
           "block": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}}


@pytest.mark.parametrize("winner, rows", [("splits", "decode"), ("block", "decode"), ("block", "mixed")])
def test_attnc_plan_reports_the_tuned_launch(tmp_path, monkeypatch, capsys, winner, rows):
    """With `attnc tune`'s entry for the call in $ATTNC_TUNE_CACHE, `split = auto` is the tuned
    launch in the plan as in the launch (the plan looked the numpy backend's key up, and counted the
    rule in the untuned block, so it reported 5 slots where the launch ran 2 or 10)."""
    cache_path = tmp_path / "tune.json"
    monkeypatch.setenv("ATTNC_TUNE_CACHE", str(cache_path))
    spec = tmp_path / "plan_tuned.attn"
    spec.write_text("attention plan_tuned { heads = 4 / 2 head_dim = 16 dtype = f16 mask = causal "
                    "cache = paged(page_size = 16, layout = nhd) }\n")
    q_lens = Q[rows]
    one_row = all(x == 1 for x in q_lens)
    key = tune.call_key(compile_file(spec), len(KV), 1 if one_row else q_lens, KV, "triton")
    cache = tune.TuneCache(cache_path)
    cache.put({"digest": key.digest, "key": key.to_json(), "backend": "triton", "config": WINNERS[winner],
               "median_ms": 1.0})
    cache.save()
    report, launched = plan_and_launch(spec, q_lens, monkeypatch, capsys)
    assert report["launch"]["tuning_cache"] == "hit" and report["launch"]["block_n"] == WINNERS[winner]["BLOCK_N"]
    assert report["launch"]["decided_by"] == ("tuned" if winner == "splits" else "auto")
    assert launched == [(report["capacity"], report["workspace_bytes"]["allocated"])], report["policy"]
    assert report["capacity"] == (2 if winner == "splits" else 10)
