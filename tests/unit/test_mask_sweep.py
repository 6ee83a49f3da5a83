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
