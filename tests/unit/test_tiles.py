"""compiler.analysis.tiles: eight block summaries, tile classes and the block-sparse CSR
(DESIGN §4; M4.5 §0x05C, §0x06C-D, §0x06J), as properties over random masks of every
DESIGN §3.5 family against brute-force classification of the dense oracle."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attnc.compiler.oracle import dense_mask
from attnc.compiler.analysis.intervals import analyze, row_intervals
from attnc.compiler.analysis.tiles import (
    FULL, PARTIAL, SKIP, SUMMARY_NAMES, TilePlan, classify_exact, classify_summaries, plan_tiles, summaries,
)
from attnc.compiler.lower import compile_spec

PROPERTY = settings(max_examples=250, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DECLS = {
    "doc": "tensor doc: i32[b, s]",
    "pfx": "tensor pfx: i32[b, s]",
    "tail": "tensor tail: i32[b]",
    "prefix": "tensor prefix: i32[b]",
    "evict": "tensor evict: i32[b, h, s]",
}


@lru_cache(maxsize=None)
def program(mask: str, tensors: tuple[str, ...], heads: int):
    decls = " ".join(DECLS[t] for t in tensors)
    return compile_spec(f"attention t {{ heads = {heads} head_dim = 4 dtype = f32 {decls} mask = {mask} }}")


# ---------------------------------------------------------------- random runtime tensors
def segments(rng, batch, s_k, lo, hi):
    out = np.empty((batch, s_k), np.int64)
    for row in out:
        pos, doc = 0, 0
        while pos < s_k:
            n = int(rng.integers(lo, hi + 1))
            row[pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def prefix_ends(rng, doc, lo, hi):
    out = np.empty_like(doc)
    for src, dst in zip(doc, out):
        starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
        for st_, en in zip(starts, np.r_[starts[1:], len(src)]):
            dst[st_:en] = st_ + min(int(rng.integers(lo, hi + 1)), en - st_)
    return out


# Each family: (mask text, tensor names) from drawn parameters; tensors from a numpy rng.
def family_mask(name: str, p: dict, s_k: int) -> tuple[str, tuple[str, ...]]:
    w, g, c = p["w"], p["g"], p["c"]
    return {
        "full": ("true", ()),
        "causal": ("causal", ()),
        "sliding_window_causal": (f"causal & window({w})", ()),
        "sliding_window_bidirectional": (f"abs(q - k) <= {w}", ()),
        "causal_document": ("causal & doc[b, q] == doc[b, k]", ("doc",)),
        "bidirectional_document": ("doc[b, q] == doc[b, k]", ("doc",)),
        "scrambled_document": ("causal & doc[b, q] == doc[b, k]", ("doc",)),  # ids need not be contiguous
        "prefix_lm": ("k < prefix[b] | causal", ("prefix",)),
        "prefix_lm_document": ("doc[b, q] == doc[b, k] & (k < pfx[b, k] | causal)", ("doc", "pfx")),
        "share_question": ("causal & (doc[b, q] == doc[b, k] | doc[b, k] == 0)", ("doc",)),
        "global_sliding_window": (f"abs(q - k) <= {w} | q < {g} | k < {g}", ()),
        "causal_blockwise": ("causal & (doc[b, q] == doc[b, k] | q >= tail[b])", ("doc", "tail")),
        "qk_sparse": ("causal" + "".join(f" & !(q >= {o} & q < {o + n} & k >= {o} & k < {o + n})"
                                         for o, n in p["regions"]), ()),
        "random_eviction": ("causal & q < evict[b, h, k]", ("evict",)),
        "chunked": (f"causal & q // {c} == k // {c}", ()),
        "sink_window": (f"causal & (window({w}) | k < {g})", ()),
        "dilated_sliding_window": (f"causal & window({w}) & (q - k) % {p['d']} == 0", ()),
        "alternating_column": (f"!(k == {p['col'] % s_k} & q % 2 == 0)", ()),
        "five_runs_exact": (f"!(k == {p['col'] % s_k} & ("
                            + " | ".join(f"q == {s_k - 1 - 2 * j}" for j in range(5)) + "))", ()),
    }[name]


FAMILIES = ["full", "causal", "sliding_window_causal", "sliding_window_bidirectional", "causal_document",
            "bidirectional_document", "scrambled_document", "prefix_lm", "prefix_lm_document", "share_question",
            "global_sliding_window", "causal_blockwise", "qk_sparse", "random_eviction", "chunked", "sink_window",
            "dilated_sliding_window", "alternating_column", "five_runs_exact"]


def family_tensors(name: str, tensors, rng, batch: int, heads: int, s_k: int) -> dict:
    out = {}
    if "doc" in tensors:
        if name == "scrambled_document":
            out["doc"] = rng.integers(0, 3, (batch, s_k))
        else:
            lo = int(rng.integers(1, 9))
            out["doc"] = segments(rng, batch, s_k, lo, lo + int(rng.integers(0, 40)))
    if "pfx" in tensors:
        out["pfx"] = prefix_ends(rng, out["doc"], 0, int(rng.integers(0, 20)))
    if "tail" in tensors:
        out["tail"] = rng.integers(0, s_k + 5, batch)
    if "prefix" in tensors:
        out["prefix"] = rng.integers(0, s_k + 2, batch)
    if "evict" in tensors:
        out["evict"] = rng.integers(0, 2 * s_k + 2, (batch, heads, s_k))
    return out


@st.composite
def cases(draw, families=tuple(FAMILIES)):
    name = draw(st.sampled_from(families))
    s_k = draw(st.integers(1, 200))
    phase = draw(st.sampled_from(["prefill", "append", "decode"]))
    s_q = {"prefill": s_k, "decode": 1}.get(phase) or draw(st.integers(1, s_k))
    batch = draw(st.integers(1, 2))
    heads = draw(st.sampled_from([1, 2, 3]))
    regions, last = [], 0
    for _ in range(draw(st.integers(0, 3))):
        if last >= s_k:
            break
        o = draw(st.integers(last, s_k - 1))
        n = draw(st.integers(1, s_k - o))
        regions.append((o, n))
        last = o + n
    params = {"w": draw(st.integers(1, 80)), "g": draw(st.integers(0, 8)), "c": draw(st.integers(1, 40)),
              "d": draw(st.integers(2, 4)), "col": draw(st.integers(0, 199)), "regions": regions}
    block_m, block_n = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2**32 - 1))
    mask, tensor_names = family_mask(name, params, s_k)
    p = program(mask, tensor_names, heads)
    tensors = family_tensors(name, tensor_names, np.random.default_rng(seed), batch, heads, s_k)
    return name, p, batch, s_q, s_k, tensors, block_m, block_n


# ---------------------------------------------------------------- brute force
def tile_starts(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, block)


def brute_classes(visible: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Exact class of every tile from a dense bool [..., S_q, S_k] (M4.5 §0x05C)."""
    r, c = tile_starts(visible.shape[-2], block_m), tile_starts(visible.shape[-1], block_n)
    some = np.logical_or.reduceat(np.logical_or.reduceat(visible, r, axis=-2), c, axis=-1)
    every = np.logical_and.reduceat(np.logical_and.reduceat(visible, r, axis=-2), c, axis=-1)
    return np.where(~some, SKIP, np.where(every, FULL, PARTIAL)).astype(np.int8)


def dense_for(mi, p, batch, s_q, s_k, tensors) -> np.ndarray:
    """The oracle at the analysis' broadcast shape [B', H', S_q, S_k]."""
    b_, h_, _ = mi.shape
    d = dense_mask(p, batch, s_q, s_k, tensors)
    if b_ == 1:  # the mask does not read b: every request sees the same mask
        assert (d == d[:1]).all()
    if h_ == 1:
        assert (d == d[:, :1]).all()
    return d[:b_, :h_]


def assert_sound(classes: np.ndarray, truth: np.ndarray) -> None:
    """Never SKIP a tile with a visible cell, never FULL a tile with a masked cell."""
    assert classes.shape == truth.shape
    assert not ((classes == SKIP) & (truth != SKIP)).any(), "SKIP for a tile with a visible cell"
    assert not ((classes == FULL) & (truth != FULL)).any(), "FULL for a tile with a masked cell"


def assert_plan_consistent(plan: TilePlan, shape) -> None:
    b_, h_, t_r, t_c = plan.classes.shape
    assert (b_, h_) == shape[:2]
    rows = plan.classes.reshape(-1, t_c)
    for prefix, cls, indptr, indices in (("", PARTIAL, plan.partial_indptr, plan.partial_indices),
                                         ("full_", FULL, plan.full_indptr, plan.full_indices)):
        assert indptr.dtype == np.int32 and indices.dtype == np.int32
        assert indptr.shape == (rows.shape[0] + 1,) and indptr[0] == 0 and indptr[-1] == len(indices)
        assert (np.diff(indptr) >= 0).all()
        for r, row in enumerate(rows):  # exactly the blocks of that class, increasing
            assert indices[indptr[r]:indptr[r + 1]].tolist() == np.flatnonzero(row == cls).tolist()
        flex = plan.flex_block_mask()
        num, idx = flex[f"{prefix}kv_num_blocks"], flex[f"{prefix}kv_indices"]
        assert num.shape == (b_, h_, t_r) and idx.shape == (b_, h_, t_r, t_c)
        assert num.dtype == np.int32 and idx.dtype == np.int32
        np.testing.assert_array_equal(num, (plan.classes == cls).sum(-1))
        np.testing.assert_array_equal(np.sort(idx, axis=-1), np.broadcast_to(np.arange(t_c), idx.shape))
        for r, row in enumerate(rows):
            lead = idx.reshape(-1, t_c)[r, :num.reshape(-1)[r]]
            assert lead.tolist() == np.flatnonzero(row == cls).tolist()
    counts = plan.counts()
    assert set(counts) == {"full", "partial", "skip"}
    assert sum(counts.values()) == plan.classes.size == b_ * h_ * t_r * t_c
    assert counts["skip"] == int((plan.classes == SKIP).sum())
    assert plan.density() == pytest.approx(1 - counts["skip"] / plan.classes.size)


# ---------------------------------------------------------------- properties
@PROPERTY
@given(cases())
def test_tile_classes_are_sound_and_exact_when_the_analysis_is(case):
    name, p, batch, s_q, s_k, tensors, block_m, block_n = case
    mi = analyze(p, batch, s_q, s_k, tensors)
    truth = brute_classes(dense_for(mi, p, batch, s_q, s_k, tensors), block_m, block_n)
    t_r, t_c = -(-s_q // block_m), -(-s_k // block_n)
    assert truth.shape == mi.shape[:2] + (t_r, t_c)

    exact = classify_exact(mi, block_m, block_n)
    assert exact.dtype == np.int8
    assert_sound(exact, truth)
    if mi.exact:
        np.testing.assert_array_equal(exact, truth)
    if name == "dilated_sliding_window" or name == "alternating_column":
        assert not mi.representable

    if mi.representable:
        summ = summaries(mi, block_n)
        assert list(summ) == list(SUMMARY_NAMES)
        starts = tile_starts(s_k, block_n)
        for vec, v in mi.vectors().items():  # the eight summaries are block min / max
            np.testing.assert_array_equal(summ[f"{vec}_min"], np.minimum.reduceat(v, starts, axis=-1))
            np.testing.assert_array_equal(summ[f"{vec}_max"], np.maximum.reduceat(v, starts, axis=-1))
            assert summ[f"{vec}_min"].dtype == np.int32 and summ[f"{vec}_min"].shape == mi.shape[:2] + (t_c,)
        coarse = classify_summaries(summ, s_q, block_m)
        assert_sound(coarse, truth)
        # summaries may only err towards PARTIAL
        assert ((coarse == truth) | (coarse == PARTIAL)).all()
    else:
        with pytest.raises(ValueError, match="not representable"):
            summaries(mi, block_n)


@PROPERTY
@given(cases())
def test_tile_plans_list_partial_then_full_blocks(case):
    name, p, batch, s_q, s_k, tensors, block_m, block_n = case
    mi = analyze(p, batch, s_q, s_k, tensors)
    truth = brute_classes(dense_for(mi, p, batch, s_q, s_k, tensors), block_m, block_n)
    methods = ["exact", "auto"] + (["summaries"] if mi.representable else [])
    for method in methods:
        plan = plan_tiles(mi, block_m, block_n, method=method)
        assert plan.method in ("exact", "summaries") and (method == "auto" or plan.method == method)
        assert (plan.block_m, plan.block_n) == (block_m, block_n)
        assert_sound(plan.classes, truth)
        if plan.method == "exact" and mi.exact:
            np.testing.assert_array_equal(plan.classes, truth)
        assert_plan_consistent(plan, mi.shape)
    if not mi.representable:
        with pytest.raises(ValueError):
            plan_tiles(mi, block_m, block_n, method="summaries")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cases(families=("causal_document", "prefix_lm_document", "random_eviction", "qk_sparse",
                       "global_sliding_window")))
def test_exact_classifier_is_chunk_size_independent(case):
    """classify_exact walks a few Q tiles at a time; the chunking must not change the answer."""
    _, p, batch, s_q, s_k, tensors, block_m, block_n = case
    mi = analyze(p, batch, s_q, s_k, tensors)
    np.testing.assert_array_equal(classify_exact(mi, block_m, block_n, chunk=1),
                                  classify_exact(mi, block_m, block_n))


# ---------------------------------------------------------------- fixed cases
def test_causal_tiles_by_hand():
    """8 x 8 causal with 4 x 4 tiles: the diagonal tiles are PARTIAL, below FULL, above SKIP."""
    mi = analyze(program("causal", (), 1), 1, 8, 8)
    for method in ("exact", "summaries"):
        plan = plan_tiles(mi, 4, 4, method)
        assert plan.classes[0, 0].tolist() == [[PARTIAL, SKIP], [FULL, PARTIAL]]
        assert plan.partial_indptr.tolist() == [0, 1, 2] and plan.partial_indices.tolist() == [0, 1]
        assert plan.full_indptr.tolist() == [0, 0, 1] and plan.full_indices.tolist() == [0]
        assert plan.counts() == {"full": 1, "partial": 2, "skip": 1}


def test_summaries_err_only_towards_partial_where_the_envelope_cannot_decide():
    """Column 0 is masked on rows [0, 5) (its UT run), column 1 on rows [3, 10) (its LT run):
    the tile rows [3, 4) x columns {0, 1} is wholly masked, but neither family covers it on
    its own, so the eight summaries say PARTIAL while the exact classifier says SKIP."""
    p = program("!(k == 0 & q < 5) & !(k == 1 & q >= 3)", (), 1)
    mi = analyze(p, 1, 10, 10)
    assert mi.representable
    assert (mi.UTS[0, 0, 0], mi.UTE[0, 0, 0], mi.LTS[0, 0, 1], mi.LTE[0, 0, 1]) == (0, 5, 3, 10)
    truth = brute_classes(dense_mask(p, 1, 10, 10, {}), 1, 2)
    coarse = plan_tiles(mi, 1, 2, "summaries").classes
    exact = plan_tiles(mi, 1, 2, "exact").classes
    np.testing.assert_array_equal(exact, truth)
    assert truth[0, 0, 3, 0] == SKIP and coarse[0, 0, 3, 0] == PARTIAL
    assert_sound(coarse, truth)
    assert ((coarse == truth) | (coarse == PARTIAL)).all()


def test_inexact_mask_gives_partial_where_it_cannot_decide():
    """The M4.5 §0x06H alternating column written with `%`: with 1 x 1 tiles the truth in
    column 5 alternates SKIP / FULL, which the exact classifier cannot see (the atom is not
    analyzable), so it marks that column PARTIAL; every other tile is exact."""
    p = program("!(k == 5 & q % 2 == 0 & q < 10)", (), 1)
    mi = analyze(p, 1, 10, 10)
    assert not mi.exact
    plan = plan_tiles(mi, 1, 1, "auto")
    assert plan.method == "exact"
    truth = brute_classes(dense_mask(p, 1, 10, 10, {}), 1, 1)
    assert_sound(plan.classes, truth)
    assert truth[0, 0, :, 5].tolist() == [SKIP, FULL] * 5
    assert (plan.classes[0, 0, :, 5] == PARTIAL).all()
    np.testing.assert_array_equal(np.delete(plan.classes, 5, -1), np.delete(truth, 5, -1))
    assert_plan_consistent(plan, mi.shape)


def test_tile_sizes_must_be_positive():
    mi = analyze(program("causal", (), 1), 1, 4, 4)
    for bm, bn in ((0, 2), (2, 0), (-1, 1)):
        with pytest.raises(ValueError, match="positive"):
            plan_tiles(mi, bm, bn)


# ---------------------------------------------------------------- each row's run of keys
ONE_RUN_PER_ROW = {"full", "causal", "sliding_window_causal", "sliding_window_bidirectional", "causal_document",
                   "bidirectional_document", "prefix_lm", "chunked"}


@PROPERTY
@given(cases())
def test_row_runs_of_keys_rebuild_the_dense_mask(case):
    """``row_intervals`` (the transposed analysis): where it answers, k in [KS, KE) is the dense
    mask of every row; it answers for every family whose rows see one run of keys, and never
    where some row sees two or more."""
    name, p, batch, s_q, s_k, tensors, _, _ = case
    mi = analyze(p, batch, s_q, s_k, tensors)
    dense = dense_for(mi, p, batch, s_q, s_k, tensors)
    ri = row_intervals(p, batch, s_q, s_k, tensors)
    one_run = (np.diff(dense.astype(np.int8), axis=-1, prepend=0) == 1).sum(-1).max(initial=0) <= 1
    if name in ONE_RUN_PER_ROW:
        assert ri is not None
    if ri is None:
        return
    assert one_run
    assert ri.KS.shape == ri.KE.shape == mi.shape[:2] + (s_q,) and ri.KS.dtype == ri.KE.dtype == np.int32
    k = np.arange(s_k)
    np.testing.assert_array_equal((k >= ri.KS[..., None]) & (k < ri.KE[..., None]), dense)
