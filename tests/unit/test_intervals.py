"""compiler.analysis.intervals: FlashMask column intervals (DESIGN §3.5, §4; M4.5 §0x06A-B, §0x06H).

* the `mask` fixture of seed_contracts (the column-5 contract and the five-run column);
* every example at prefill / append / decode shapes: ``must <= dense <= may``, ``must == dense``
  when exact, and the four vectors reconstruct the dense mask when representable;
* agreement with PaddlePaddle FlashMask's ``startend_row_indices`` generators
  (``flashmask/tests/generate_startend_row_indices.py`` in PaddlePaddle/flash-attention):
  the generators' rules are re-stated below in our own words (random parameters, several
  sizes), expanded with the rules of its ``startend_row_indices_to_attn_bias``, and compared
  masked cell by masked cell with ``analyze`` and with the dense oracle;
* PlanErrors for malformed calls and runtime tensors.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from attnc.compiler.oracle import dense_mask
from attnc.compiler.analysis.intervals import analyze, row_intervals
from attnc.compiler.analysis.tiles import FULL, SKIP, plan_tiles, summaries
from attnc.compiler.errors import PlanError
from attnc.compiler.inputs import contiguous_variant, sample, validate
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import EXAMPLES, ROOT, seed_contracts

MASK_FIXTURE = seed_contracts()["mask"]


def spec(mask: str, decls: str = "", heads: str = "1"):
    return compile_spec(f"attention t {{ heads = {heads} head_dim = 4 dtype = f32 {decls} mask = {mask} }}")


def example(name: str):
    return contiguous_variant(compile_file(ROOT / "examples" / f"{name}.attn"))


# ---------------------------------------------------------------- views of a result
def rows_cols(runs, mi) -> np.ndarray:
    """Per-column row sets as bool [B', H', S_q, S_k]."""
    b_, h_, s_k = mi.shape
    return np.swapaxes(runs.dense().reshape(b_, h_, s_k, mi.s_q), -1, -2)


def from_vectors(mi) -> np.ndarray:
    """Visibility rebuilt from UTS/UTE/LTS/LTE alone (masked iff row in [UTS,UTE) or [LTS,LTE))."""
    i = np.arange(mi.s_q)[:, None]
    v = {n: a[:, :, None, :] for n, a in mi.vectors().items()}
    return ~(((i >= v["UTS"]) & (i < v["UTE"])) | ((i >= v["LTS"]) & (i < v["LTE"])))


def check_against_dense(mi, dense: np.ndarray) -> None:
    """Soundness, exactness and (when representable) the four vectors, against the oracle."""
    must = np.broadcast_to(rows_cols(mi.visible.must, mi), dense.shape)
    may = np.broadcast_to(rows_cols(mi.visible.may, mi), dense.shape)
    assert not (must & ~dense).any(), "must-visible cell that the oracle masks"
    assert not (dense & ~may).any(), "oracle-visible cell outside may"
    if mi.exact:
        np.testing.assert_array_equal(must, dense)
        assert mi.reason is None or "masked runs" in mi.reason
    else:
        assert mi.reason and "not interval-analyzable" in mi.reason
    if mi.representable:
        assert mi.exact
        for name, v in mi.vectors().items():
            assert v.dtype == np.int32 and v.shape == mi.shape, name
            assert ((0 <= v) & (v <= mi.s_q)).all(), name
        assert (mi.UTS <= mi.UTE).all() and (mi.UTE <= mi.LTS).all() and (mi.LTS <= mi.LTE).all()
        np.testing.assert_array_equal(np.broadcast_to(from_vectors(mi), dense.shape), dense)
    else:
        assert mi.UTS is None and mi.reason


def masked_runs(column: np.ndarray) -> int:
    m = np.r_[False, ~column]
    return int((m[1:] & ~m[:-1]).sum())


# ---------------------------------------------------------------- the seed `mask` fixture
BOUNDS = "tensor ut0: i32[s] tensor ut1: i32[s] tensor lt0: i32[s] tensor lt1: i32[s]"
TWO_INTERVALS = spec("!(q >= ut0[k] & q < ut1[k]) & !(q >= lt0[k] & q < lt1[k])", BOUNDS)


@pytest.mark.parametrize("s_k", [10, 16], ids=["prefill", "append"])
def test_flashmask_column_5_contract(s_k):
    """M4.5 §0x06B: UT [2, 4), LT [7, 10) in a column of 10 rows; half-open on both ends.
    The bounds are declared per column in absolute positions; rows are q - (S_k - S_q)."""
    fx = MASK_FIXTURE["flashmask_column_5"]
    rows, off = fx["rows"], s_k - fx["rows"]
    rng = np.random.default_rng(5)
    t = {n: np.zeros(s_k, np.int64) for n in ("ut0", "ut1", "lt0", "lt1")}
    for j in range(s_k):  # other columns: random disjoint [ut0, ut1) <= [lt0, lt1)
        a, b, c, d = np.sort(rng.integers(0, s_k + 1, 4))
        t["ut0"][j], t["ut1"][j], t["lt0"][j], t["lt1"][j] = a, b, c, d
    (ut0, ut1), (lt0, lt1) = fx["UT"], fx["LT"]
    t["ut0"][5], t["ut1"][5], t["lt0"][5], t["lt1"][5] = ut0 + off, ut1 + off, lt0 + off, lt1 + off
    mi = analyze(TWO_INTERVALS, 1, rows, s_k, t)
    assert mi.exact and mi.representable and mi.reason is None
    assert mi.shape == (1, 1, s_k)
    assert [int(mi.UTS[0, 0, 5]), int(mi.UTE[0, 0, 5])] == fx["UT"]
    assert [int(mi.LTS[0, 0, 5]), int(mi.LTE[0, 0, 5])] == fx["LT"]
    column = rows_cols(mi.visible.must, mi)[0, 0, :, 5]
    assert np.flatnonzero(~column).tolist() == fx["masked_rows"]
    assert np.flatnonzero(column).tolist() == fx["visible_rows"]
    check_against_dense(mi, dense_mask(TWO_INTERVALS, 1, rows, s_k, t))


def test_flashmask_column_5_inclusive_ends_would_differ():
    """§0x06J 'use inclusive interval ends': closing either end changes rows 4 or 10 (absent)."""
    fx = MASK_FIXTURE["flashmask_column_5"]
    closed = spec("!(q >= 2 & q <= 4) & !(q >= 7 & q <= 10)")
    mi = analyze(closed, 1, fx["rows"], fx["rows"])
    masked = np.flatnonzero(~rows_cols(mi.visible.must, mi)[0, 0, :, 5]).tolist()
    assert masked != fx["masked_rows"] and 4 in masked


def test_five_run_column_is_not_representable_exactly():
    """M4.5 §0x06H: rows {0, 2, 4, 6, 8} masked in one column = five runs; exact, not representable."""
    fx = MASK_FIXTURE["not_representable"]
    hits = " | ".join(f"q == {r}" for r in fx["masked_rows_in_one_column"])
    p = spec(f"!(k == 5 & ({hits}))")
    mi = analyze(p, 1, 10, 10)
    assert mi.exact and not mi.representable and mi.UTS is None
    assert "k=5" in mi.reason and f"has {fx['runs']} masked runs" in mi.reason
    assert "[0, 1), [2, 3), [4, 5), [6, 7), [8, 9)" in mi.reason and "at most two" in mi.reason
    masked = ~rows_cols(mi.visible.must, mi)[0, 0]
    assert np.flatnonzero(masked[:, 5]).tolist() == fx["masked_rows_in_one_column"]
    assert masked_runs(~masked[:, 5]) == fx["runs"]
    assert not np.delete(masked, 5, axis=1).any()
    check_against_dense(mi, dense_mask(p, 1, 10, 10, {}))


def test_five_run_column_through_a_periodic_atom_is_inexact():
    """The same column written with `%` on q: the analysis cannot solve the atom, says which, and
    stays sound (exact in every other column)."""
    p = spec("!(k == 5 & q % 2 == 0 & q < 10)")
    mi = analyze(p, 1, 10, 10)
    assert not mi.exact and not mi.representable and mi.UTS is None
    assert "'q % 2 == 0'" in mi.reason and "%" in mi.reason
    dense = dense_mask(p, 1, 10, 10, {})
    check_against_dense(mi, dense)
    must, may = rows_cols(mi.visible.must, mi)[0, 0], rows_cols(mi.visible.may, mi)[0, 0]
    others = np.arange(10) != 5
    assert must[:, others].all() and may[:, others].all()
    assert not must[:, 5].any() and may[:, 5].all()
    assert masked_runs(dense[0, 0, :, 5]) == MASK_FIXTURE["not_representable"]["runs"]


# ---------------------------------------------------------------- every example, every phase
SHAPES = {"prefill": (72, 72), "append": (23, 90), "decode": (1, 97), "single": (1, 1), "tail": (3, 3)}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_sound_exact_and_representable(path, shape):
    program = contiguous_variant(compile_file(path))
    s_q, s_k = SHAPES[shape]
    for seed in range(2):
        call = validate(program, sample(program, 2, s_q, s_k, seed))
        mi = analyze(program, call.batch, s_q, s_k, call.tensors)
        check_against_dense(mi, dense_mask(program, call.batch, s_q, s_k, call.tensors))
        if program.name == "dilated_sliding_window":  # DESIGN §3.5: exercises the fallback
            assert not mi.exact and not mi.representable and "%" in mi.reason
        else:
            assert mi.exact and mi.representable, mi.reason


ONE_RUN_EXAMPLES = {"alibi", "bidirectional_document", "causal", "causal_blockwise", "causal_document",
                    "causal_document_gqa", "chunked", "full", "prefix_lm", "qk_sparse", "sliding_window_bidirectional",
                    "sliding_window_causal", "softcap", "sink_attention"}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_rows_see_one_run_of_keys_where_the_transposed_analysis_says_so(path, shape):
    """``row_intervals``: each query row's keys [KS, KE), rebuilt against the oracle; examples
    whose rows see two runs (sink + window, global + window, dilated, shared question) get None,
    and so does prefix-LM-document, whose transposed form compares pfx[b, q] with q (an atom
    the analysis does not solve), though its rows see one run."""
    program = contiguous_variant(compile_file(path))
    s_q, s_k = SHAPES[shape]
    call = validate(program, sample(program, 2, s_q, s_k, 0))
    ri = row_intervals(program, call.batch, s_q, s_k, call.tensors)
    if path.stem not in ONE_RUN_EXAMPLES:
        if shape in ("prefill", "append"):
            assert ri is None
        return
    assert ri is not None
    dense = dense_mask(program, call.batch, s_q, s_k, call.tensors)
    k = np.arange(s_k)
    rebuilt = (k >= ri.KS[..., None]) & (k < ri.KE[..., None])
    np.testing.assert_array_equal(np.broadcast_to(rebuilt, dense.shape), dense)


def test_causal_document_rows_run_from_their_document_start():
    p = spec("causal & doc[b, q] == doc[b, k]", "tensor doc: i32[b, s]")
    doc = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    ri = row_intervals(p, 1, 8, 8, {"doc": doc})
    assert ri.KS.tolist() == [[[0, 0, 0, 3, 3, 5, 5, 5]]]
    assert ri.KE.tolist() == [[[1, 2, 3, 4, 5, 6, 7, 8]]]
    ri = row_intervals(p, 1, 3, 8, {"doc": doc})  # append: the last 3 rows, at q = 5, 6, 7
    assert ri.KS.tolist() == [[[5, 5, 5]]] and ri.KE.tolist() == [[[6, 7, 8]]]
    assert row_intervals(spec("causal & (window(2) | k < 1)"), 1, 8, 8) is None  # sink + window: two runs


def test_dilated_window_has_many_runs_per_column():
    p = example("dilated_sliding_window")
    dense = dense_mask(p, 1, 96, 96, {})[0, 0]
    assert max(masked_runs(dense[:, j]) for j in range(96)) > 2


def test_broadcast_shape_follows_the_free_variables():
    assert analyze(example("causal"), 3, 5, 9).shape == (1, 1, 9)
    p = example("random_eviction")
    call = validate(p, sample(p, 3, 5, 9))
    assert analyze(p, 3, 5, 9, call.tensors).shape == (3, p.heads_q, 9)
    p = example("prefix_lm")
    call = validate(p, sample(p, 3, 5, 9))
    assert analyze(p, 3, 5, 9, call.tensors).shape == (3, 1, 9)


@pytest.mark.parametrize("mask, exact, representable", [
    ("k % 2 == 0", True, True),  # column-only: all or nothing per column
    ("causal & k % 3 != 1", True, True),
    ("(q + k) % 2 == 0", False, False),  # periodic in q: not analyzable
    ("(q - k) % 2 == 0 & causal", False, False),
    ("abs(q - k) > 2 & abs(q - k) < 10", True, False),  # exact, three masked runs mid-sequence
    ("q // 8 == k // 8 & causal", True, True),  # chunked
    ("abs(q - k) <= 3 | k < 2", True, True),
    ("min(q, 20) == k | causal & q - k < 4", True, True),
    ("max(q - 3, 6) >= k", True, True),
    ("where(k < 10, q >= k, q - k < 5 & causal)", True, True),
    ("q * 2 <= k + 40 & causal", True, True),
    ("2 * q == k", True, True),  # no row for odd k
    ("3 * q != k + 1", True, True),
    ("-2 * q >= 5 - k | q // 3 == 2", True, True),
    ("(q < 12) == (k < 12)", True, True),
    ("q // 4 + q < k", False, False),  # positions under different divisors
])
def test_exactness_and_representability_of_small_masks(mask, exact, representable):
    p = spec(mask)
    for s_q, s_k in ((48, 48), (17, 48), (1, 48)):
        mi = analyze(p, 1, s_q, s_k)
        check_against_dense(mi, dense_mask(p, 1, s_q, s_k, {}))
        if s_q == 48:
            assert (mi.exact, mi.representable) == (exact, representable), mi.reason


def test_min_max_equality_atoms():
    """min(x, z) == y is x == y & z >= y | z == y & x >= y (and max with <=)."""
    for mask in ("min(q, 10) == k", "max(q, 10) == k", "min(q, 10) != k", "max(q, k + 3) == 12"):
        p = spec(mask)
        mi = analyze(p, 1, 20, 24)
        assert mi.exact, mask
        check_against_dense(mi, dense_mask(p, 1, 20, 24, {}))


def test_positions_under_different_divisors_are_not_summed():
    """q // 4 - q // 8 is not a linear form in one variable: the analysis says so (it used to
    keep the first divisor and call every row visible)."""
    for mask in ("q // 4 - q // 8 == 0", "q // 5 + q > k", "q - q + q // 4 == k // 4"):
        p = spec(mask)
        mi = analyze(p, 1, 30, 30)
        check_against_dense(mi, dense_mask(p, 1, 30, 30, {}))
    assert not analyze(spec("q // 4 - q // 8 == 0"), 1, 30, 30).exact
    assert analyze(spec("q - q + q // 4 == k // 4"), 1, 30, 30).exact


# ---------------------------------------------------------------- PaddlePaddle FlashMask
# Our restatement of the startend_row_indices generators.  Each returns an int array
# [B, H or 1, S_k, n] of query-row indices (n = 1, 2 or 4) and the `causal` flag; the values
# are positions clipped to S_q, as the generators build them for S_q == S_k.
def _sri(*cols, s_q) -> np.ndarray:
    return np.minimum(np.stack([np.asarray(c, np.int64) for c in cols], -1), s_q)[None, None]


def pd_non_causal(s):
    return _sri(np.full(s, s), np.zeros(s), s_q=s), False


def pd_causal(s):
    return _sri(np.full(s, s), s_q=s), True


def pd_sliding_window(s, window):
    return _sri(np.arange(s) + window, s_q=s), True


def pd_window_api(s, left, right, causal):
    """flashmask_attention(window_size=(left, right)) builds its own indices."""
    if causal:
        return _sri(np.arange(s) + left + 1, s_q=s), True
    return np.maximum(_sri(np.arange(s) + left + 1, np.arange(s) - right, s_q=s), 0), False


def _pad_last(lens, s):
    lens = list(lens)
    lens[-1] += s - sum(lens)
    return lens


def pd_causal_document(s, lens):
    lens = _pad_last(lens, s)  # padding joins the last document
    return _sri(np.repeat(np.cumsum(lens), lens), s_q=s), True


def pd_document(s, lens):
    """Literal rule: LTS = end of the key's document; UTE accumulates the *next* document's
    length (0, lens[1], lens[1] + lens[2], ...), which is the document start only when the
    lengths are equal (the generator carries 'TODO: this seems buggy').  Padding keys get
    LTS = total, UTE = the last accumulated value."""
    n, total = len(lens), sum(lens)
    ends = np.cumsum(lens)
    starts_literal = np.r_[0, np.cumsum(lens[1:])][:n]
    pad = s - total
    lts = np.r_[np.repeat(ends, lens), np.full(pad, total)]
    ute = np.r_[np.repeat(starts_literal, lens), np.full(pad, starts_literal[-1] if n else 0)]
    return _sri(lts, ute, s_q=s), False


def pd_document_intended(s, lens):
    ends = np.cumsum(lens)
    return _sri(np.repeat(ends, lens), np.repeat(ends - lens, lens), s_q=s), False


def pd_share_question(s, lens):
    """LTS = total length for the question's keys, the end of the key's answer otherwise;
    padding keys LTS = total."""
    total, ends = sum(lens), np.cumsum(lens)
    lts = np.repeat(ends, lens)
    lts[:lens[0]] = total
    return _sri(np.r_[lts, np.full(s - total, total)], s_q=s), True


def pd_global_sliding_window(s, g, left, right):
    """Four columns LTS, LTE, UTS, UTE: below the band [k + left + 1, S_q) except for global
    keys; above it [g, k - right) except for the first g + right + 1 keys."""
    k = np.arange(s)
    lts = k + left + 1
    lts[:g] = s
    uts, ute = np.full(s, g), k - right
    uts[:g + right + 1] = 0
    ute[:g + right + 1] = 0
    return _sri(lts, np.full(s, s), uts, ute, s_q=s), False


def pd_causal_blockwise(s, lens):
    """Two columns: LTS = end of the key's block (padding: total), LTE = start of the last
    block for keys before it, the end of the last block for its keys (padding: S_k)."""
    total, ends = sum(lens), np.cumsum(lens)
    lts = np.r_[np.repeat(ends, lens), np.full(s - total, total)]
    lte = np.r_[np.full(ends[-2], ends[-2]), np.full(lens[-1], ends[-1]), np.full(s - total, s)]
    return _sri(lts, lte, s_q=s), True


def pd_prefix_lm_document(s, pairs):
    """pairs (prefix, length); LTS = end of the key's document, UTE = document start for
    prefix keys and the key itself otherwise (padding: total for both)."""
    lens = [n for _, n in pairs]
    total, ends = sum(lens), np.cumsum(lens)
    ute = []
    for (p, n), e in zip(pairs, ends):
        st = e - n
        ute += [st] * p + list(range(st + p, e))
    lts = np.r_[np.repeat(ends, lens), np.full(s - total, total)]
    return _sri(lts, np.r_[ute, np.full(s - total, total)], s_q=s), False


def pd_prefix_lm_causal(s, prefix):
    ute = np.arange(s)
    ute[:prefix] = 0
    return _sri(np.full(s, s), ute, s_q=s), False


def pd_qk_sparse(s, pairs):
    """pairs (offset, length) with strictly increasing offsets: keys of a region get
    [k, offset + length), other keys [S_k, S_k)."""
    lts, lte = np.full(s, s), np.full(s, s)
    for off, n in pairs:
        lts[off:off + n] = np.arange(off, off + n)
        lte[off:off + n] = off + n
    return _sri(lts, lte, s_q=s), True


def pd_random_eviction(s, batch, heads, start_row, rng):
    """Per (b, h): S_k - start_row distinct keys among the first S_k - 1 are evicted at rows
    start_row, start_row + 1, ... (after moving the keys that lie before their row first);
    other keys get S_k + 1 (never)."""
    out = np.full((batch, heads, s, 1), s + 1, np.int64)
    for b in range(batch):
        for h in range(heads):
            keys = rng.choice(s - 1, s - start_row, replace=False)
            rows = np.arange(start_row, s)
            keys = np.r_[keys[keys < rows - 1], keys[keys >= rows - 1]]
            out[b, h, keys, 0] = rows
    return np.minimum(out, s), True


def pd_masked(sri: np.ndarray, causal: bool, s_q: int, s_k: int) -> np.ndarray:
    """bool [B, H, S_q, S_k] masked cells, by startend_row_indices_to_attn_bias's rules:
    causal with 1 column: [c0, S_q); with 2: [c0, c1); plus the bottom-right upper triangle
    rows [0, k - (S_k - S_q)).  Not causal with 2 columns: [c0, S_q) and [0, c1); with 4:
    [c0, c1) and [c2, c3)."""
    n = sri.shape[-1]
    i = np.arange(s_q)[:, None]
    c = [sri[..., j][:, :, None, :] for j in range(n)]
    has_end = (causal and n == 2) or (not causal and n == 4)
    masked = (i >= c[0]) & ((i < c[1]) if has_end else True)
    if causal:
        masked = masked | (i < np.arange(s_k) - (s_k - s_q))
    elif has_end:
        masked = masked | ((i >= c[2]) & (i < c[3]))
    else:
        masked = masked | (i < c[1])
    return np.broadcast_to(masked, sri.shape[:2] + (s_q, s_k))


def rows_of(sri: np.ndarray, s_q: int, s_k: int) -> np.ndarray:
    """Position-valued indices as row indices of a call with S_q rows (q = S_k - S_q + i)."""
    return np.clip(sri - (s_k - s_q), 0, s_q)


def _partition(rng, s, parts):
    cuts = np.sort(rng.choice(np.arange(1, s), parts - 1, replace=False))
    return np.diff(np.r_[0, cuts, s]).tolist()


def _doc_ids(lens):
    return np.repeat(np.arange(len(lens)), lens)


def _stack(per_batch):
    return np.concatenate(per_batch, axis=0)


# Each family draws its parameters, builds Paddle's indices and our program + tensors.
def fam_causal(rng, batch, s):
    return pd_causal(s), example("causal"), {}


def fam_full(rng, batch, s):
    return pd_non_causal(s), example("full"), {}


def fam_sliding_window(rng, batch, s):
    w = int(rng.integers(1, s + 2))
    return pd_sliding_window(s, w), spec(f"causal & window({w})"), {}


def fam_window_api_causal(rng, batch, s):
    w = int(rng.integers(0, s + 1))
    return pd_window_api(s, w, w, True), spec(f"causal & q - k <= {w}"), {}


def fam_window_api_bidirectional(rng, batch, s):
    left, right = (int(x) for x in rng.integers(0, s + 1, 2))
    return pd_window_api(s, left, right, False), spec(f"q - k <= {left} & k - q <= {right}"), {}


def _doc_family(gen, program, pad_ok):
    def fam(rng, batch, s):
        sris, docs = [], []
        for _ in range(batch):
            n = int(rng.integers(3, min(s, 8) + 1))
            lens = _partition(rng, s, n)
            if pad_ok and rng.random() < 0.5 and lens[-1] > 1:  # let the generator pad
                lens[-1] -= int(rng.integers(1, lens[-1]))
            sri, causal = gen(s, lens)
            sris.append(sri)
            docs.append(_doc_ids(_pad_last(lens, s))[None])
        return (_stack(sris), causal), program(), {"doc": _stack(docs)}
    return fam


fam_causal_document = _doc_family(pd_causal_document, lambda: example("causal_document"), True)
fam_document = _doc_family(pd_document_intended, lambda: example("bidirectional_document"), False)
fam_share_question = _doc_family(pd_share_question, lambda: example("share_question"), False)


def fam_document_equal_lengths(rng, batch, s):
    """The literal document generator with equal lengths and no padding, where its
    accumulated UTE is the document start."""
    sris, docs = [], []
    for _ in range(batch):
        length = int(rng.choice([d for d in range(1, s // 3 + 1) if s % d == 0]))
        lens = [length] * (s // length)
        sri, causal = pd_document(s, lens)
        sris.append(sri)
        docs.append(_doc_ids(lens)[None])
    return (_stack(sris), causal), example("bidirectional_document"), {"doc": _stack(docs)}


def fam_global_sliding_window(rng, batch, s):
    g, left, right = int(rng.integers(0, 6)), int(rng.integers(0, s)), int(rng.integers(0, s))
    program = spec(f"(q - k <= {left} & k - q <= {right}) | q < {g} | k < {g}")
    return pd_global_sliding_window(s, g, left, right), program, {}


def fam_causal_blockwise(rng, batch, s):
    sris, docs, tails = [], [], []
    for _ in range(batch):
        lens = _partition(rng, s, int(rng.integers(3, min(s, 8) + 1)))
        sri, causal = pd_causal_blockwise(s, lens)
        sris.append(sri)
        docs.append(_doc_ids(lens)[None])
        tails.append(s - lens[-1])  # the last block starts at tail[b]
    return (_stack(sris), causal), example("causal_blockwise"), {"doc": _stack(docs), "tail": np.array(tails)}


def fam_prefix_lm_causal(rng, batch, s):
    prefix = rng.integers(0, s + 1, batch)
    sri = _stack([pd_prefix_lm_causal(s, int(p))[0] for p in prefix])
    return (sri, False), example("prefix_lm"), {"prefix": prefix}


def fam_prefix_lm_document(rng, batch, s):
    sris, docs, pfx = [], [], []
    for _ in range(batch):
        lens = _partition(rng, s, int(rng.integers(2, min(s, 8) + 1)))
        pairs = [(int(rng.integers(0, n + 1)), n) for n in lens]
        sri, causal = pd_prefix_lm_document(s, pairs)
        sris.append(sri)
        docs.append(_doc_ids(lens)[None])
        starts = np.cumsum(lens) - lens
        pfx.append(np.repeat([st + p for st, (p, _) in zip(starts, pairs)], lens)[None])
    return (_stack(sris), causal), example("prefix_lm_document"), {"doc": _stack(docs), "pfx": _stack(pfx)}


def fam_qk_sparse(rng, batch, s):
    pairs, last = [], 0
    while last < s - 1 and len(pairs) < 4:
        off = int(rng.integers(last + 1, s))
        n = int(rng.integers(1, s - off + 1))
        pairs.append((off, n))
        last = off + n
    program = spec("causal" + "".join(f" & !(q >= {o} & q < {o + n} & k >= {o} & k < {o + n})" for o, n in pairs))
    return pd_qk_sparse(s, pairs), program, {}


def fam_random_eviction(rng, batch, s):
    program = example("random_eviction")
    start_row = int(rng.integers(1, s + 1))
    sri, causal = pd_random_eviction(s, batch, program.heads_q, start_row, rng)
    # the eviction row itself (not clipped to S_q): keys never evicted hold S_k + 1
    evict = np.full((batch, program.heads_q, s), s + 1, np.int64)
    evict[sri[..., 0] < s] = sri[..., 0][sri[..., 0] < s]
    return (sri, causal), program, {"evict": evict}


FAMILIES = {
    "full": fam_full, "causal": fam_causal, "sliding_window": fam_sliding_window,
    "window_api_causal": fam_window_api_causal, "window_api_bidirectional": fam_window_api_bidirectional,
    "causal_document": fam_causal_document, "document": fam_document,
    "document_literal_equal_lengths": fam_document_equal_lengths,
    "share_question": fam_share_question, "global_sliding_window": fam_global_sliding_window,
    "causal_blockwise": fam_causal_blockwise, "prefix_lm_causal": fam_prefix_lm_causal,
    "prefix_lm_document": fam_prefix_lm_document, "qk_sparse": fam_qk_sparse,
    "random_eviction": fam_random_eviction,
}


def assert_matches_paddle(program, tensors, sri, causal, batch, s):
    """Prefill with Paddle's literal indices; append and decode as the bottom rows of the same
    mask, with the indices shifted to rows and Paddle's bottom-right causal rule."""
    full = pd_masked(sri, causal, s, s)
    for s_q in sorted({s, max(1, s // 3), 1}, reverse=True):
        expected = pd_masked(rows_of(sri, s_q, s), causal, s_q, s)
        np.testing.assert_array_equal(expected, full[:, :, s - s_q:])
        mi = analyze(program, batch, s_q, s, tensors)
        assert mi.exact and mi.representable, mi.reason
        ours = ~rows_cols(mi.visible.must, mi)
        heads = max(program.heads_q, sri.shape[1])
        shape = (batch, heads, s_q, s)
        np.testing.assert_array_equal(np.broadcast_to(ours, shape), np.broadcast_to(expected, shape))
        np.testing.assert_array_equal(np.broadcast_to(~from_vectors(mi), shape), np.broadcast_to(expected, shape))
        dense = dense_mask(program, batch, s_q, s, tensors)
        np.testing.assert_array_equal(np.broadcast_to(~dense, shape), np.broadcast_to(expected, shape))


@pytest.mark.parametrize("s", [7, 31, 64, 129])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_agrees_with_paddle_generators(family, s):
    for seed in range(3):
        rng = np.random.default_rng([seed, s, len(family)])
        batch = int(rng.integers(1, 3))
        (sri, causal), program, tensors = FAMILIES[family](rng, batch, s)
        assert sri.shape[0] in (1, batch) and sri.shape[2] == s
        assert_matches_paddle(program, tensors, sri, causal, batch, s)


@pytest.mark.parametrize("name, paddle", [
    ("sliding_window_causal", lambda s: pd_sliding_window(s, 32)),
    ("sliding_window_bidirectional", lambda s: pd_window_api(s, 16, 16, False)),
    ("global_sliding_window", lambda s: pd_global_sliding_window(s, 4, 16, 16)),
    ("qk_sparse", lambda s: pd_qk_sparse(s, [(16, 8), (36, 26)])),
    ("causal", pd_causal), ("softcap", pd_causal), ("alibi", pd_causal), ("full", pd_non_causal),
])
def test_examples_with_fixed_parameters_agree_with_paddle(name, paddle):
    for s in (64, 128, 200):
        sri, causal = paddle(s)
        assert_matches_paddle(example(name), {}, sri, causal, 1, s)


def test_paddle_document_generator_literal_starts_differ_for_unequal_lengths():
    """Known disagreement (documented in examples/bidirectional_document.attn): with unequal
    lengths the literal generator's UTE is not the document start; we follow the block
    diagonal (attention-gym's generate_doc_mask_mod and Paddle's intended rule)."""
    lens, s = [3, 5, 4], 12
    literal, intended = pd_masked(*pd_document(s, lens), s, s), pd_masked(*pd_document_intended(s, lens), s, s)
    mi = analyze(example("bidirectional_document"), 1, s, s, {"doc": _doc_ids(lens)[None]})
    ours = ~rows_cols(mi.visible.must, mi)
    np.testing.assert_array_equal(ours[0, 0], intended[0, 0])
    assert (ours[0, 0] != literal[0, 0]).any()


# ---------------------------------------------------------------- plan errors
def test_negative_lengths_and_too_many_rows_are_plan_errors():
    p = example("causal")
    for args, words in (((-1, 4, 4), "B = -1"), ((1, -2, 4), "S_q = -2"), ((1, 4, -3), "S_k = -3")):
        with pytest.raises(PlanError, match="negative length") as e:
            analyze(p, *args)
        assert words in str(e.value)
    with pytest.raises(PlanError, match=r"S_q = 6 query rows exceed S_k = 5"):
        analyze(p, 1, 6, 5)


@pytest.mark.parametrize("mask, decls, index", [
    ("doc[b, q + 1] == doc[b, k]", "tensor doc: i32[b, s]", 64),  # the last row reads doc[64]
    ("doc[b, q - 70] == 0", "tensor doc: i32[b, s]", -70),  # row 0 reads doc[-70]
    ("doc[b, k + 1] == 0 | causal", "tensor doc: i32[b, s]", 64),  # column-only read
    ("q < ev[b, h, k]", "tensor ev: i32[b, 2, s]", 2),  # head axis declared 2, heads = 4
])
def test_out_of_range_reads_are_plan_errors_naming_tensor_and_index(mask, decls, index):
    p = spec(mask, decls, heads="4")
    shape = {"doc": (2, 64), "ev": (2, 2, 64)}
    tensors = {n: np.zeros(shape[n], np.int64) for n in shape if f"tensor {n}:" in decls}
    with pytest.raises(PlanError) as e:
        analyze(p, 2, 64, 64, tensors)
    msg = str(e.value)
    name = next(iter(tensors))
    assert f"tensor '{name}'" in msg and "out of range" in msg
    assert re.search(rf"index {index}\b", msg), msg
    with pytest.raises(PlanError):  # the oracle refuses the same call
        dense_mask(p, 2, 64, 64, tensors)


def test_non_contiguous_document_ids_are_never_a_wrong_answer():
    """doc = [0, 0, 1, 1, 0, 0]: id 0 is two separate runs, so `doc[q] == doc[k]` is not one
    interval per column.  The analysis says so (tensor, value, indices) and stays sound."""
    p = example("causal_document")
    doc = np.array([[0, 0, 1, 1, 0, 0]])
    for s_q in (6, 3, 1):
        mi = analyze(p, 1, s_q, 6, {"doc": doc})
        assert not mi.exact and not mi.representable
        assert "tensor 'doc' value 0 appears in separate runs" in mi.reason
        assert "index 0" in mi.reason and "index 4" in mi.reason
        dense = dense_mask(p, 1, s_q, 6, {"doc": doc})
        check_against_dense(mi, dense)
        with pytest.raises(ValueError, match="not representable"):
            summaries(mi, 2)
        for block in (1, 2, 3):  # tile classes stay sound (the exact path, conservatively)
            classes = plan_tiles(mi, block, block).classes[0, 0]
            for r, i0 in enumerate(range(0, s_q, block)):
                for c, k0 in enumerate(range(0, 6, block)):
                    tile = dense[0, 0, i0:i0 + block, k0:k0 + block]
                    assert classes[r, c] != SKIP or not tile.any()
                    assert classes[r, c] != FULL or tile.all()


def test_sorted_and_reverse_sorted_tensor_reads_at_q_are_exact():
    decls = "tensor up: i32[b, s] tensor down: i32[b, s]"
    rng = np.random.default_rng(1)
    t = {"up": np.sort(rng.integers(0, 40, (2, 40)), axis=1)}
    t["down"] = -t["up"]
    for mask in ("up[b, q] < k", "down[b, q] <= 0 - k", "up[b, q] == up[b, k]", "down[b, q] != down[b, k] & causal"):
        p = spec(mask, decls)
        for s_q in (40, 13, 1):
            mi = analyze(p, 2, s_q, 40, t)
            assert mi.exact, (mask, mi.reason)
            check_against_dense(mi, dense_mask(p, 2, s_q, 40, t))
