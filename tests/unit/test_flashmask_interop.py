"""FlashMask interop: `flashmask(sri, causal)` in specs and the Paddle export of `attnc explain`.

Paddle's convention (paddle.nn.functional.flashmask_attention; dense reference
``startend_row_indices_to_attn_bias`` in PaddlePaddle/flash-attention
flashmask/tests/generate_startend_row_indices.py): ``startend_row_indices`` is
``[B, H or 1, S_k, n]``; causal=True takes n = 1 ``[LTS]`` or 2 ``[LTS, LTE]``,
causal=False takes n = 2 ``[LTS, UTE]`` or 4 ``[LTS, LTE, UTS, UTE]``; hidden rows are
half-open.  Also the metadata ledger of M4.5 §0x06G (seed fixture
``mask.payload_ledger_N131072_Bc64``).
"""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from attnc.compiler.oracle import dense_mask
from attnc.compiler import cli, explain, ir
from attnc.compiler.errors import AttncError
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import EXAMPLES, seed_contracts


def flashmask_spec(n: int, causal: bool, heads: str = "4", head_axis: str = "h") -> ir.Program:
    return compile_spec(f"attention fm {{ heads = {heads}  head_dim = 8\n"
                        f"  tensor sri: i32[b, {head_axis}, s, {n}]\n"
                        f"  mask = flashmask(sri, {'true' if causal else 'false'}) }}")


def flashmask_dense(sri, causal: bool, heads: int = 1, s_q: int | None = None) -> np.ndarray:
    """The dense mask a spec `flashmask(sri, causal)` gives at prefill (or the last s_q rows)."""
    sri = np.asarray(sri, np.int64)
    b, nh, s, n = sri.shape
    axis = "h" if nh == heads and nh > 1 else str(nh)
    program = flashmask_spec(n, causal, f"{heads} / {nh if nh > 1 else heads}", axis)
    return dense_mask(program, b, s_q or s, s, {"sri": sri})


def rows(*lines: str) -> np.ndarray:
    return np.array([[c == "1" for c in line] for line in lines])


# ---------------------------------------------------------------- lowering
@pytest.mark.parametrize("causal, n, text", [
    (True, 1, "k <= q & q < sri[b, h, k, 0]"),
    (True, 2, "k <= q & !(q >= sri[b, h, k, 0] & q < sri[b, h, k, 1])"),
    (False, 2, "q < sri[b, h, k, 0] & q >= sri[b, h, k, 1]"),
    (False, 4, "!(q >= sri[b, h, k, 0] & q < sri[b, h, k, 1]) & !(q >= sri[b, h, k, 2] & q < sri[b, h, k, 3])"),
])
def test_flashmask_lowers_to_plain_ir(causal, n, text):
    program = flashmask_spec(n, causal)
    assert ir.format_expr(program.mask) == text
    assert not any(isinstance(e, ir.Call) for e in ir.walk(program.mask))


def test_head_axis_of_one_broadcasts_and_h_kv_is_read_at_h_over_g():
    assert ir.format_expr(flashmask_spec(1, True, "4", "1").mask) == "k <= q & q < sri[b, 0, k, 0]"
    assert ir.format_expr(flashmask_spec(1, True, "8 / 2", "2").mask) == "k <= q & q < sri[b, h // 4, k, 0]"


# ---------------------------------------------------------------- Paddle's documented examples
# startend_row_indices of the eight figures of paddle.nn.functional.flashmask_attention's
# docstring (1 batch, 1 head, 10 tokens), re-typed, with the dense visibility each one
# documents (row = query, column = key; 1 = visible).
PADDLE_FIGURES = {
    "b": (True, [[4], [4], [4], [4], [7], [7], [7], [10], [10], [10]],  # causal document
          rows("1000000000", "1100000000", "1110000000", "1111000000", "0000100000",
               "0000110000", "0000111000", "0000000100", "0000000110", "0000000111")),
    "e": (True, [[4, 7]] * 4 + [[10, 10]] * 6,  # causal blockwise
          rows("1000000000", "1100000000", "1110000000", "1111000000", "0000100000",
               "0000110000", "0000111000", "1111111100", "1111111110", "1111111111")),
    "f": (False, [[4, 0]] * 4 + [[7, 4]] * 3 + [[10, 7]] * 3,  # bidirectional document
          rows(*["1111000000"] * 4, *["0000111000"] * 3, *["0000000111"] * 3)),
    "g": (False, [[10, 10, 0, 0]] * 3 + [[3, 10, 0, 0]] + [[k, 10, 3, k] for k in range(4, 10)],
          rows(*["1111111111"] * 3, *["1110000000"] * 7)),
    "h": (True, [[10], [4], [8], [6], [10], [7], [10], [9], [10], [10]],  # random eviction
          rows("1000000000", "1100000000", "1110000000", "1111000000", "1011100000",
               "1011110000", "1010111000", "1010101100", "1000101110", "1000101011")),
}
PADDLE_FIGURES_VALUES_ONLY = {
    "a": (True, [[5]] * 10),
    "c": (True, [[10]] * 4 + [[7]] * 3 + [[10]] * 3),
    "d": (True, [[10], [4], [5], [6], [7], [8], [9], [10], [10], [10]]),
}


@pytest.mark.parametrize("figure", sorted(PADDLE_FIGURES))
def test_paddle_documented_masks(figure):
    causal, values, expected = PADDLE_FIGURES[figure]
    sri = np.array(values, np.int32)[None, None]
    assert np.array_equal(flashmask_dense(sri, causal)[0, 0], expected)
    assert np.array_equal(explain.startend_row_indices_to_mask(sri, causal, 10)[0, 0], expected)


@pytest.mark.parametrize("figure", sorted(PADDLE_FIGURES_VALUES_ONLY))
def test_paddle_figures_agree_with_paddles_dense_reference(figure):
    causal, values = PADDLE_FIGURES_VALUES_ONLY[figure]
    sri = np.array(values, np.int32)[None, None]
    assert np.array_equal(flashmask_dense(sri, causal), explain.startend_row_indices_to_mask(sri, causal, 10))


@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_random_bounds_match_paddles_dense_reference(causal, n):
    rng = np.random.default_rng(n + 10 * causal)
    sri = rng.integers(0, 18, (2, 3, 16, n)).astype(np.int32)
    got = flashmask_dense(sri, causal, heads=3)
    assert np.array_equal(got, explain.startend_row_indices_to_mask(sri, causal, 16))


# ---------------------------------------------------------------- export, and back
def _tensors(program, batch, s_q, s_k, seed=0):
    return explain.call_tensors(program, batch, s_q, s_k, None, seed)


REPRESENTABLE = [p for p in EXAMPLES if p.stem != "dilated_sliding_window"]


@pytest.mark.parametrize("path", REPRESENTABLE, ids=lambda p: p.stem)
@pytest.mark.parametrize("length", [128, 200])
def test_paddle_export_round_trips_through_flashmask(path, length, capsys):
    """`attnc explain --format paddle` fed back through flashmask(sri, causal) gives the
    example's dense mask at prefill."""
    program = compile_file(path)
    assert cli.main(["explain", str(path), "--kv-len", str(length), "--batch", "2", "--seed", "3",
                     "--format", "paddle"]) == 0
    out = json.loads(capsys.readouterr().out)
    sri = np.array(out["startend_row_indices"], np.int32)
    assert list(sri.shape) == out["shape"] and sri.shape[0] == 2 and sri.shape[2] == length
    assert sri.shape[1] in (1, program.heads_kv) and sri.shape[3] in ((1, 2) if out["causal"] else (2, 4))
    want = dense_mask(program, 2, length, length, _tensors(program, 2, length, length, seed=3))
    assert np.array_equal(flashmask_dense(sri, out["causal"], program.heads_q), want)


@pytest.mark.parametrize("path", REPRESENTABLE, ids=lambda p: p.stem)
def test_paddle_export_at_append_follows_paddles_bottom_right_reference(path):
    program = compile_file(path)
    s_q, s_k = 37, 128
    tensors = _tensors(program, 2, s_q, s_k)
    e = explain.explain(program, 2, s_q, s_k, tensors)
    pm = explain.paddle_startend_row_indices(e.intervals, program, 2)
    got = explain.startend_row_indices_to_mask(pm.startend_row_indices, pm.causal, s_q, program.heads_q)
    assert np.array_equal(got, dense_mask(program, 2, s_q, s_k, tensors))
    assert "note" in pm.to_json()


@pytest.mark.parametrize("spec, causal, n", [
    ("causal", True, 1),
    ("causal & !(q >= 5 & q < 9 & k < 3)", True, 2),  # a band below the diagonal
    ("true", False, 2),
    ("k < 3 | abs(q - k) < 2", False, 2),
    ("q < 3 | k < 3 | abs(q - k) < 2", False, 4),  # global rows and columns + window
    ("false", True, 1),
])
def test_most_compact_encoding(spec, causal, n):
    program = compile_spec(f"attention t {{ heads = 2 head_dim = 8 mask = {spec} }}")
    e = explain.explain(program, 1, 12, 12)
    pm = explain.paddle_startend_row_indices(e.intervals, program, 1)
    assert (pm.causal, pm.startend_row_indices.shape[-1]) == (causal, n)
    assert np.array_equal(flashmask_dense(pm.startend_row_indices, pm.causal, 2), dense_mask(program, 1, 12, 12, {}))


def test_four_bounds_put_a_run_above_the_diagonal_in_the_upper_pair():
    program = compile_spec("attention t { heads = 2 head_dim = 8 mask = !(q >= 2 & q < k - 1) }")
    e = explain.explain(program, 1, 12, 12)
    pm = explain.paddle_startend_row_indices(e.intervals, program, 1)
    assert not pm.causal
    lts, lte, uts, ute = np.moveaxis(pm.startend_row_indices[0, 0], -1, 0)
    hidden = np.arange(12) >= 4  # columns k >= 4 hide rows [2, k - 1), all above the diagonal
    assert (lts == 12).all() and (lte == 12).all()
    assert np.array_equal(uts, np.where(hidden, 2, 0)) and np.array_equal(ute, np.where(hidden, np.arange(12) - 1, 0))


def test_paddle_figure_g_comes_back_more_compact():
    """Figure (g) hides rows [3, 10) of every key from 3 on: [LTS, UTE] says it in two bounds."""
    causal, values, expected = PADDLE_FIGURES["g"]
    program = flashmask_spec(4, False, "1", "1")
    e = explain.explain(program, 1, 10, 10, {"sri": np.array(values, np.int64)[None, None]})
    pm = explain.paddle_startend_row_indices(e.intervals, program, 1)
    assert not pm.causal
    assert pm.startend_row_indices[0, 0].tolist() == [[10, 0]] * 3 + [[3, 0]] * 7
    assert np.array_equal(explain.startend_row_indices_to_mask(pm.startend_row_indices, False, 10)[0, 0], expected)


def test_gqa_per_kv_head_mask_exports_h_kv_heads():
    program = compile_spec("attention t { heads = 8 / 2 head_dim = 8 tensor evict: i32[b, h, s]\n"
                           "  mask = causal & q < evict[b, h, k] }")
    evict = np.repeat(np.array([[5] * 10, [7] * 10]), 4, axis=0)[None]  # equal within each group
    e = explain.explain(program, 1, 10, 10, {"evict": evict})
    pm = explain.paddle_startend_row_indices(e.intervals, program, 1)
    assert pm.startend_row_indices.shape == (1, 2, 10, 1)
    assert np.array_equal(flashmask_dense(pm.startend_row_indices, pm.causal, 8), dense_mask(program, 1, 10, 10, {"evict": evict}))
    evict[0, 1] = 9  # query head 1 differs from query head 0 of the same K/V head
    e = explain.explain(program, 1, 10, 10, {"evict": evict})
    with pytest.raises(AttncError, match=r"differs between query heads 0\.\.3 \(b=0\) that share K/V head 0"):
        explain.paddle_startend_row_indices(e.intervals, program, 1)


def test_not_representable_is_an_error_with_the_reason():
    program = compile_file([p for p in EXAMPLES if p.stem == "dilated_sliding_window"][0])
    e = explain.explain(program, 1, 64, 64)
    with pytest.raises(AttncError, match="not FlashMask-representable.*q under '%'"):
        explain.paddle_startend_row_indices(e.intervals, program, 1)


def test_flashmask_example_is_random_eviction_in_paddles_layout():
    interop = compile_file([p for p in EXAMPLES if p.stem == "flashmask_interop"][0])
    evict = compile_spec("attention t { heads = 8 / 2 head_dim = 8 tensor evict: i32[b, h, s]\n"
                         "  mask = causal & q < evict[b, h, k] }")
    tensors = _tensors(interop, 2, 96, 96)
    per_query_head = np.repeat(tensors["sri"][..., 0], interop.group, axis=1)
    assert np.array_equal(dense_mask(interop, 2, 96, 96, tensors),
                          dense_mask(evict, 2, 96, 96, {"evict": per_query_head}))


# ---------------------------------------------------------------- the metadata ledger
def test_payload_ledger_reproduces_the_seed_fixture():
    """M4.5 §0x06G: N = 131072, B_c = 64, square, one batch and head — by arithmetic and
    through a full `explain` of a causal mask, with nothing N^2 in memory."""
    fixture = seed_contracts()["mask"]["payload_ledger_N131072_Bc64"]
    n = 131072
    assert explain.metadata_ledger(n, n, 64) == fixture
    program = compile_spec("attention causal { heads = 1 head_dim = 8 mask = causal }")
    tracemalloc.start()
    try:
        e = explain.explain(program, 1, n, n, {}, block_m=128, block_n=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.ledger() == fixture
    assert peak < 256 << 20, f"explain used {peak / 2**20:.0f} MiB at N = {n}"  # N^2 bytes = 16 GiB
    assert e.visible_fraction() == (n * (n + 1) // 2) / n**2


def test_ledger_scales_with_distinct_masks_and_partial_blocks():
    assert explain.metadata_ledger(10, 100, 64, extent=6) == {
        "dense_u8": 6000, "four_int32_vectors": 6 * 1600, "eight_int32_summaries": 6 * 8 * 4 * 2}


# ---------------------------------------------------------------- issue 18: Paddle's head counts, values
@pytest.mark.parametrize("heads, head_axis, index", [
    ("2", "2", "h"),  # Paddle's docstring: num_heads = the heads of q and k (multi-head, no GQA)
    ("8 / 2", "8", "h"),  # num_heads = H_q under GQA
    ("8 / 2", "2", "h // 4"),  # num_heads = H_kv
])
def test_paddle_head_counts_written_as_numbers(heads, head_axis, index):
    program = flashmask_spec(1, True, heads, head_axis)
    assert ir.format_expr(program.mask) == f"k <= q & q < sri[b, {index}, k, 0]"
    hq = int(heads.split("/")[0])
    sri = np.random.default_rng(0).integers(0, 11, (2, int(head_axis), 10, 1)).astype(np.int32)
    assert np.array_equal(dense_mask(program, 2, 10, 10, {"sri": sri}),
                          explain.startend_row_indices_to_mask(sri, True, 10, hq))


def test_a_head_count_as_a_number_needs_declared_heads():
    with pytest.raises(AttncError, match="declared i32\\[b, 2, s, 1\\].*\n.*\n.*\nnote: this spec leaves heads to "
                                         "the call"):
        compile_spec("attention g { tensor sri: i32[b, 2, s, 1]\n  mask = flashmask(sri, true) }")
    with pytest.raises(AttncError, match="note: Paddle's head axis here is 1 \\(shared by every head\\), h or 4"):
        flashmask_spec(1, True, "4", "3")


BAD_BOUNDS = [  # (causal, n, the bounds of column 5, the error)
    (True, 2, [6, 3], r"sri\[0, 1, 5, 0\] = 6 > sri\[0, 1, 5, 1\] = 3: LTS > LTE"),
    (True, 2, [4, 13], r"sri\[0, 1, 5, 1\] = 13: LTE exceeds S = 12"),
    (True, 1, [-2], r"sri\[0, 1, 5, 0\] = -2: LTS is negative"),
    (False, 2, [3, 7], r"sri\[0, 1, 5, 1\] = 7 > sri\[0, 1, 5, 0\] = 3: .*UTE > LTS: the ranges overlap"),
    (False, 4, [6, 12, 2, 8], r"sri\[0, 1, 5, 3\] = 8 > sri\[0, 1, 5, 0\] = 6: .*overlap"),
    (False, 4, [12, 12, 9, 2], r"sri\[0, 1, 5, 2\] = 9 > sri\[0, 1, 5, 3\] = 2: UTS > UTE"),
]
GOOD = {(True, 1): [12], (True, 2): [12, 12], (False, 2): [12, 0], (False, 4): [12, 12, 0, 0]}


def _bad_sri(causal, n, bounds):
    sri = np.tile(np.array(GOOD[(causal, n)], np.int32), (1, 2, 12, 1))
    sri[0, 1, 5] = bounds
    return sri


@pytest.mark.parametrize("causal, n, bounds, message", BAD_BOUNDS)
def test_flashmask_bounds_are_validated_on_every_path(causal, n, bounds, message):
    """LTS > LTE, LTE > S, negative bounds, overlapping upper and lower ranges: a PlanError naming
    the tensor, the index and the value, from a prefill call (numpy, AHBM), a split call (numpy),
    and the plans the Triton kernels launch from (prefill and split-K/V)."""
    from attnc.compiler import inputs
    from attnc.compiler.errors import PlanError
    from attnc.compiler.plan import plan
    from attnc.backends.triton.decode import decode_plan
    program = flashmask_spec(n, causal, "2", "h")
    sri = _bad_sri(causal, n, bounds)
    arrays = {"q": np.zeros((1, 2, 12, 8), np.float32), "k": np.zeros((1, 2, 12, 8), np.float32),
              "v": np.zeros((1, 2, 12, 8), np.float32), "sri": sri}
    with pytest.raises(PlanError, match=message):
        inputs.validate(program, arrays)
    with pytest.raises(PlanError, match=message):
        plan(program, 1, 12, 12, {"sri": sri.astype(np.int64)})
    split = {"q": np.zeros((1, 2, 8), np.float32), "k": np.zeros((1, 2, 12, 8), np.float32),
             "v": np.zeros((1, 2, 12, 8), np.float32), "kv_lens": np.array([12], np.int32), "sri": sri}
    with pytest.raises(PlanError, match=message):
        inputs.validate_cache(program, split)
    with pytest.raises(PlanError, match=message):
        decode_plan(program, {n: a for n, a in split.items() if n != "q"}, total_q=1)
    sri[0, 1, 5] = GOOD[(causal, n)]
    inputs.validate(program, {**arrays, "sri": sri})  # the same call with good bounds runs


def test_flashmask_bounds_are_validated_by_attnc_run(tmp_path, capsys):
    spec = tmp_path / "fm.attn"
    spec.write_text("attention fm { heads = 2 head_dim = 8 dtype = f32 tensor sri: i32[b, h, s, 2]\n"
                    "  mask = flashmask(sri, true) }")
    arrays = {"q": np.zeros((1, 2, 12, 8), np.float32), "k": np.zeros((1, 2, 12, 8), np.float32),
              "v": np.zeros((1, 2, 12, 8), np.float32), "sri": _bad_sri(True, 2, [6, 3])}
    np.savez(tmp_path / "in.npz", **arrays)
    import os
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # (the tests' default: Triton on the CPU)
    for backend in ("numpy", "ahbm") + (("triton",) if interpreted else ()):
        assert cli.main(["run", str(spec), "--inputs", str(tmp_path / "in.npz"), "--backend", backend]) == 1
        assert "sri[0, 1, 5, 0] = 6 > sri[0, 1, 5, 1] = 3: LTS > LTE" in capsys.readouterr().err


def test_exports_keep_the_flashmask_contract():
    """What `attnc explain --format paddle` writes is accepted back by flashmask(sri, causal)."""
    from attnc.compiler import inputs
    for path in REPRESENTABLE:
        program = compile_file(path)
        for s_q in (96, 37):
            e = explain.explain(program, 2, s_q, 96, _tensors(program, 2, s_q, 96))
            pm = explain.paddle_startend_row_indices(e.intervals, program, 2)
            n = pm.startend_row_indices.shape[-1]
            back = flashmask_spec(n, pm.causal, f"{program.heads_q} / {program.heads_kv}",
                                  "1" if pm.startend_row_indices.shape[1] == 1 else str(program.heads_kv))
            inputs.check_flashmask(back, {"sri": pm.startend_row_indices})


# ---------------------------------------------------------------- issue 18: export depends on the mask
ISSUE_MASKS = {  # masks FlashMask represents that the interval analysis cannot solve, with their tensors
    "block diffusion, % on q": ("mask = q - q % 16 >= k - k % 16", {}),
    "batchified causal": ("mask = q // 16 == k // 16 & q % 16 >= k % 16", {}),
    "clamp": ("mask = k <= q & k >= q - min(max(q % 7, 2), 5)", {}),
    "nested tensor reads": ("tensor doc: i32[b, s]\n tensor off: i32[b, 4]\n mask = causal & k >= off[b, doc[b, q]]",
                            {"doc": np.repeat(np.arange(4), [10, 20, 14, 20])[None],
                             "off": np.array([[0, 10, 30, 44]])}),
    "bool tensor": ("tensor seq: bool[b, s]\n mask = seq[b, q] == seq[b, k]",
                    {"seq": (np.arange(64) < 24)[None]}),
    "q - start[b, q]": ("tensor start: i32[b, s]\n mask = causal & q - k <= q - start[b, q]",
                        {"start": np.repeat([0, 30, 50], [30, 20, 14])[None]}),
    "abs of floats": ("mask = abs(q / 12 - k / 12) <= 3", {}),
}


@pytest.mark.parametrize("name", sorted(ISSUE_MASKS))
def test_paddle_export_depends_on_the_mask_not_how_it_is_written(name):
    body, tensors = ISSUE_MASKS[name]
    program = compile_spec(f"attention t {{ heads = 2 head_dim = 8\n {body} }}")
    e = explain.explain(program, 1, 64, 64, tensors)
    assert not e.intervals.exact and e.columns.method == "evaluation"  # the analysis alone refused these
    pm = e.paddle()
    got = explain.startend_row_indices_to_mask(pm.startend_row_indices, pm.causal, 64, 2)
    assert np.array_equal(got, dense_mask(program, 1, 64, 64, tensors))


def test_the_minimal_pair_exports_the_same_mask():
    a, b = (compile_spec(f"attention t {{ heads = 2 head_dim = 8 mask = {m} }}")
            for m in ("causal & q // 16 == k // 16", "q // 16 == k // 16 & q % 16 >= k % 16"))
    pa, pb = (explain.explain(p, 1, 64, 64).paddle() for p in (a, b))
    assert pa.causal == pb.causal and np.array_equal(pa.startend_row_indices, pb.startend_row_indices)


def test_the_per_column_evaluation_is_bounded_by_the_memory_limit():
    from attnc.compiler import resources
    program = compile_spec("attention t { heads = 2 head_dim = 8 mask = q // 16 == k // 16 & q % 16 >= k % 16 }")
    with resources.overridden(240_000):  # the analysis fits (512 columns), the evaluation (512^2 cells) does not
        e = explain.explain(program, 1, 512, 512)
        assert e.evaluated is None and "262,144 cells" in e.skipped and "over the limit" in e.skipped
        with pytest.raises(AttncError, match="not FlashMask-representable.*the per-column evaluation that decides "
                                             "it exactly was skipped"):
            e.paddle()
