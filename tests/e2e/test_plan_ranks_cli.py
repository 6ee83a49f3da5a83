"""`attnc plan --ranks N` (issue 19): a context-parallel plan from the command line, without GPUs
or torch: per-rank tokens, computed cells and K/V bytes; refusals as located one-line errors."""
import json

import numpy as np

from tests.conftest import ROOT
from tests.e2e.test_cli import attnc

DOC = ROOT / "examples" / "causal_document.attn"


def test_plan_ranks_json_and_text_agree_with_the_library(tmp_path):
    from attnc.compiler.cp import plan_cp
    from attnc.compiler.lower import compile_file
    doc = np.repeat(np.arange(8), 64)[None].astype(np.int32)  # 8 documents of 64 tokens
    np.save(tmp_path / "doc.npy", doc)
    r = attnc("plan", DOC, "--ranks", "4", "--kv-lens", "512", "--block", "32", "--tensor", f"doc={tmp_path / 'doc.npy'}",
              "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = plan_cp(compile_file(DOC), 1, 512, 4, {"doc": doc}, block=32).report()
    assert got == json.loads(json.dumps(want))
    assert got["ranks"] == 4 and sum(got["tokens"]) == 512 and got["total_bytes"] == 0  # whole documents per rank
    text = attnc("plan", DOC, "--ranks", "4", "--kv-lens", "512,512", "--block", "32", "--strategy", "zigzag")
    assert text.returncode == 0, text.stderr
    assert "strategy zigzag" in text.stdout and "B=2 x S=512 tokens over 4 rank(s)" in text.stdout
    assert "\n     3 " in text.stdout and "imbalance (max/mean computed cells)" in text.stdout


def test_plan_ranks_refusals():
    r = attnc("plan", DOC, "--ranks", "2", "--kv-lens", "512,256")
    assert r.returncode == 1 and "share one length" in r.stderr, r.stderr
    r = attnc("plan", ROOT / "examples" / "causal_document_gqa.attn", "--ranks", "2", "--kv-lens", "64")
    assert r.returncode == 1 and "paged K/V cache" in r.stderr
