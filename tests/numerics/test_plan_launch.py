"""`attnc plan --json` reports what the Triton split launch runs and allocates (issue 37, issue
35 "Contracts"): for every split policy, ``split = auto`` included, the plan's slots are the
launch's split count and its ``workspace_bytes.allocated`` the bytes of the workspace the launch
allocates (Triton interpreted on the CPU, or a GPU with ATTNC_TEST_GPU=1)."""
import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import cli, inputs  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402

KV, Q = [300, 57], {"decode": [1, 1], "mixed": [3, 1]}


@pytest.mark.parametrize("split, rows, state", [
    ("auto", "decode", "lse_o"), ("auto", "mixed", "lse_o"), ("balanced(3)", "decode", "lse_o"),
    ("chunk(128)", "decode", "lse_o"), ("capacity(2, 4)", "decode", "lse_o"), ("heuristic(0.85)", "decode", "lse_o"),
    ("auto", "decode", "mlu"), ("auto", "mixed", "shared_shift(0.0, -30, 30)")])
def test_attnc_plan_reports_the_triton_launch(tmp_path, monkeypatch, capsys, split, rows, state):
    monkeypatch.setenv("ATTNC_TUNE_CACHE", str(tmp_path / "no_tune_cache.json"))  # untuned: the rule decides
    spec = tmp_path / "plan_launch.attn"
    spec.write_text("attention plan_launch { heads = 4 / 2 head_dim = 16 dtype = f16 mask = causal "
                    f"cache = paged(page_size = 16, layout = nhd) split = {split} state = {state} }}\n")
    q_lens = Q[rows]
    assert cli.main(["plan", str(spec), "--kv-lens", ",".join(map(str, KV)), "--q-lens",
                     ",".join(map(str, q_lens)), "--json"]) == 0
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
    assert launched == [(report["capacity"], report["workspace_bytes"]["allocated"])], report["policy"]
