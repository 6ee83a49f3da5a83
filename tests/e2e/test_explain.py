"""`attnc explain` (DESIGN §7) as a user runs it: text, --json, --tensor, --block, the
Paddle and Flex exports, --png, and its errors."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from attnc.compiler.oracle import dense_mask
from attnc.compiler import cli, explain
from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP
from attnc.compiler.lower import compile_file
from tests.conftest import ROOT
from tests.e2e.test_cli import attnc

EX = ROOT / "examples"
CAUSAL_DOC = EX / "causal_document.attn"
DILATED = EX / "dilated_sliding_window.attn"


def explain_json(*args) -> dict:
    r = attnc("explain", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # exactly one JSON object


def test_text_report():
    r = attnc("explain", CAUSAL_DOC, "--kv-len", "256", "--batch", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("causal_document (") and "B=2 S_q=256 S_k=256, tiles 128x64" in lines[0]
    assert lines[1] == "representable: yes (FlashMask UTS/UTE/LTS/LTE, shape [2, 1, 256])"
    assert lines[2].startswith("tiles (2 x 1 x 2 x 4 = 16, method exact): full ")
    assert lines[3].startswith("density: ") and "visible cells: " in lines[3]
    assert lines[4] == ("metadata bytes (B'*H' = 2): dense u8 131,072, four int32 vectors 8,192, "
                        "eight int32 summaries 256")


def test_text_report_says_why_a_mask_is_not_representable():
    r = attnc("explain", DILATED, "--kv-len", "128", "--q-len", "16")
    assert r.returncode == 0, r.stderr
    assert "representable: no: column k=85 (b=0, h=0) has 3 masked runs of query rows ([0, 1), [2, 3), " \
           "[4, 16)); FlashMask encodes at most two" in r.stdout
    assert "by per-column evaluation of the mask: the interval analysis is not exact here (atom " \
           "'(q - k) % 2 == 0' is not interval-analyzable" in r.stdout
    # the tiles the analysis could not decide were classified by the predicate
    assert "classified by interval analysis + predicate evaluation (numpy) of the " in r.stdout


def test_json_fields_agree_with_the_dense_oracle():
    program = compile_file(CAUSAL_DOC)
    out = explain_json(CAUSAL_DOC, "--kv-len", "200", "--q-len", "150", "--batch", "2", "--seed", "4",
                       "--block", "64x32")
    assert out["representable"] is True and out["reason"] is None and out["exact"] is True
    assert out["shape"] == [2, 1, 200] and (out["s_q"], out["s_k"]) == (150, 200)
    assert out["block"] == {"m": 64, "n": 32}
    assert out["tile_grid"] == [2, 1, 3, 7]
    assert sum(out["tiles"].values()) == 2 * 3 * 7
    assert out["density"] == pytest.approx((out["tiles"]["full"] + out["tiles"]["partial"]) / 42)
    assert out["metadata_bytes"] == {"dense_u8": 150 * 200 * 2, "four_int32_vectors": 4 * 4 * 200 * 2,
                                     "eight_int32_summaries": 8 * 4 * 7 * 2}
    for name in ("UTS", "UTE", "LTS", "LTE"):
        assert np.array(out[name]).shape == (2, 1, 200)
    tensors = explain.call_tensors(program, 2, 150, 200, None, seed=4)
    dense = dense_mask(program, 2, 150, 200, tensors)
    assert out["visible_fraction"] == pytest.approx(dense.mean(), abs=1e-12)
    # the vectors hide exactly the masked cells (rows are query indices 0..S_q)
    i = np.arange(150)[:, None]
    v = {n: np.array(out[n])[:, 0][:, None, :] for n in ("UTS", "UTE", "LTS", "LTE")}
    hidden = ((i >= v["UTS"]) & (i < v["UTE"])) | ((i >= v["LTS"]) & (i < v["LTE"]))
    assert np.array_equal(~hidden, dense[:, 0])
    # tile classes: FULL tiles all visible, SKIP tiles none
    classes = explain.explain(program, 2, 150, 200, tensors, 64, 32).plan.classes
    for b in range(2):
        for r in range(3):
            for c in range(7):
                cells = dense[b, 0, r * 64:(r + 1) * 64, c * 32:(c + 1) * 32]
                want = FULL if cells.all() else SKIP if not cells.any() else PARTIAL
                assert classes[b, 0, r, c] == want


def test_json_for_a_mask_flashmask_cannot_represent():
    out = explain_json(DILATED, "--kv-len", "128")
    assert out["representable"] is False and "has 16 masked runs" in out["reason"]
    assert out["columns_from"] == "evaluation" and "q under '%'" in out["analysis_reason"]
    assert out["exact"] is False and out["visible_fraction"] is None
    assert out["UTS"] is None and out["LTE"] is None
    lo, hi = out["visible_fraction_bounds"]
    assert 0 <= lo < hi <= 1


def test_tensor_files_replace_sampled_values(tmp_path):
    doc = np.repeat(np.arange(4), 16)[None].astype(np.int32)  # four documents of 16
    np.save(tmp_path / "doc.npy", doc)
    out = explain_json(CAUSAL_DOC, "--kv-len", "64", "--block", "16x16", "--tensor", f"doc={tmp_path / 'doc.npy'}")
    assert out["tiles"] == {"full": 0, "partial": 4, "skip": 12}
    assert out["visible_fraction"] == pytest.approx(4 * (16 * 17 / 2) / 64**2)


@pytest.mark.parametrize("args, message", [
    (["--tensor", "nope=x.npy"], "cannot read tensor file for 'nope' x.npy: No such file"),
    (["--tensor", "doc"], "--tensor takes NAME=FILE.npy, got 'doc'"),
    (["--q-len", "65"], "S_q = 65 query rows exceed S_k = 64 keys"),
    (["--out", "x.npz"], "--out writes a --format export (paddle or flex)"),
])
def test_errors_exit_1(args, message, tmp_path):
    r = attnc("explain", CAUSAL_DOC, "--kv-len", "64", *args, cwd=tmp_path)
    assert r.returncode == 1 and message in r.stderr, r.stderr


def test_tensor_file_of_the_wrong_shape_or_name(tmp_path):
    np.save(tmp_path / "doc.npy", np.zeros((1, 63), np.int32))
    r = attnc("explain", CAUSAL_DOC, "--kv-len", "64", "--tensor", f"doc={tmp_path / 'doc.npy'}")
    assert r.returncode == 1 and "tensor 'doc' has shape [1, 63]; expected [b=1, s=64]" in r.stderr
    r = attnc("explain", CAUSAL_DOC, "--kv-len", "64", "--tensor", f"docs={tmp_path / 'doc.npy'}")
    assert r.returncode == 1
    assert "--tensor docs: spec 'causal_document' declares no tensor 'docs' (declared: doc)" in r.stderr


def test_bad_block_is_a_usage_error():
    r = attnc("explain", CAUSAL_DOC, "--kv-len", "64", "--block", "128")
    assert r.returncode == 2 and "expected BLOCK_MxBLOCK_N such as 128x64" in r.stderr


def test_paddle_export(tmp_path):
    r = attnc("explain", EX / "causal.attn", "--kv-len", "6", "--format", "paddle")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"causal": True, "shape": [1, 1, 6, 1], "s_q": 6, "s_k": 6,
                                    "startend_row_indices": [[[[6]] * 6]]}
    r = attnc("explain", EX / "sliding_window_bidirectional.attn", "--kv-len", "64", "--batch", "3",
              "--format", "paddle", "--out", tmp_path / "sri.npz")
    assert r.returncode == 0, r.stderr
    head = json.loads(r.stdout)
    assert head["causal"] is False and head["shape"] == [3, 1, 64, 2] and "startend_row_indices" not in head
    with np.load(tmp_path / "sri.npz") as f:
        assert f["startend_row_indices"].shape == (3, 1, 64, 2) and f["startend_row_indices"].dtype == np.int32
        assert bool(f["causal"]) is False


def test_paddle_export_of_an_unrepresentable_mask_fails_with_the_reason():
    r = attnc("explain", DILATED, "--kv-len", "64", "--format", "paddle")
    assert r.returncode == 1 and r.stdout == ""
    assert "'dilated_sliding_window' is not FlashMask-representable at S_q = 64, S_k = 64: column k=0" in r.stderr


def test_flex_export_matches_the_tile_counts():
    out = explain_json(EX / "sliding_window_causal.attn", "--kv-len", "512", "--block", "64x64")
    r = attnc("explain", EX / "sliding_window_causal.attn", "--kv-len", "512", "--block", "64x64", "--format", "flex")
    assert r.returncode == 0, r.stderr
    fx = json.loads(r.stdout)
    assert fx["BLOCK_SIZE"] == [64, 64] and fx["seq_lengths"] == [512, 512] and fx["shape"] == [1, 1, 8, 8]
    assert np.sum(fx["kv_num_blocks"]) == out["tiles"]["partial"]
    assert np.sum(fx["full_kv_num_blocks"]) == out["tiles"]["full"]
    num, idx = np.array(fx["full_kv_num_blocks"]), np.array(fx["full_kv_indices"])
    for r_ in range(8):  # the first num entries of each row are its FULL blocks, increasing
        blocks = idx[0, 0, r_, :num[0, 0, r_]]
        assert list(blocks) == sorted(blocks)


def test_png_tile_map(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "map.png"
    r = attnc("explain", EX / "random_eviction.attn", "--kv-len", "256", "--batch", "2", "--png", png)
    assert r.returncode == 0, r.stderr
    assert f"tile map -> {png}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    png2 = tmp_path / "big.png"  # JSON stays the only thing on stdout
    out = explain_json(EX / "causal.attn", "--kv-len", "200000", "--png", png2)
    assert out["tile_grid"] == [1, 1, 1563, 3125] and png2.exists()


def test_png_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code = cli.main(["explain", str(EX / "causal.attn"), "--kv-len", "64", "--png", str(tmp_path / "m.png")])
    assert code == 1
    err = capsys.readouterr().err
    assert "--png needs matplotlib" in err and "pip install 'attnc[plot]'" in err
    assert not (tmp_path / "m.png").exists()


# ---------------------------------------------------------------- exact tile classes (issue 34)
PERIODIC = "causal & (window(24) | k < 4 | q % 40 < 4)"  # the mask, scaled to S = 200


def _brute_counts(program, batch, s, block_m, block_n, tensors=None):
    """FULL / PARTIAL / SKIP over B' x H' tiles from the dense oracle mask."""
    from tests.unit.test_tiles import brute_classes
    e = explain.explain(program, batch, s, s, tensors or {}, block_m, block_n)
    b_, h_ = e.intervals.shape[:2]
    truth = brute_classes(dense_mask(program, batch, s, s, tensors or {})[:b_, :h_], block_m, block_n)
    return {"full": int((truth == FULL).sum()), "partial": int((truth == PARTIAL).sum()),
            "skip": int((truth == SKIP).sum())}, e


def test_explain_counts_tiles_exactly_for_a_periodic_mask(tmp_path):
    """The CLI's count equals the brute-force count over the dense mask, and says how the tiles were
    classified; the analysis alone would compute far more of them."""
    spec = tmp_path / "periodic.attn"
    spec.write_text(f"attention periodic {{ heads = 2 head_dim = 8 mask = {PERIODIC} }}\n")
    out = explain_json(spec, "--kv-len", "200", "--block", "16x8")
    want, e = _brute_counts(compile_file(spec), 1, 200, 16, 8)
    assert out["tiles"] == want and out["tiles_exact"] is True
    assert out["tiles_classified_by"] == "evaluation" and out["tiles_evaluated_by"] == "numpy"
    assert out["tiles_undecided"] > 0 and out["exact"] is False
    assert out["density"] == pytest.approx((want["full"] + want["partial"]) / sum(want.values()))
    from attnc.compiler.analysis.tiles import plan_tiles
    safe = plan_tiles(e.intervals, 16, 8)  # the analysis alone: undecided tiles stay PARTIAL
    assert safe.density() > 1.5 * out["density"]


@pytest.mark.parametrize("mask, tensors", [
    ("(q - k) % 3 == 0 & window(20)", ""),  # modular (a dilation)
    ("k % 16 < 2 | q % 32 >= 28 | causal & window(10)", ""),  # periodic columns and rows
    ("(q & k & 24) == 0", ""),  # bitwise
    ("(q & 16) == (k & 16) & causal", ""),  # bitwise stripes
    ("doc[b, q] == doc[b, k] & ((q ^ k) & 4) == 0 & h < 1", "tensor doc: i32[b, s] ~ segments(8, 40)"),
])
def test_explain_tile_counts_equal_brute_force(mask, tensors):
    from attnc.compiler.lower import compile_spec
    program = compile_spec(f"attention t {{ heads = 2 head_dim = 8 {tensors} mask = {mask} }}")
    arrays = explain.call_tensors(program, 2, 100, 100, seed=3)
    want, e = _brute_counts(program, 2, 100, 16, 8, arrays)
    assert e.plan.counts() == want
    assert e.to_json()["tiles"] == want and e.plan.exact
