"""What a plan's exact tile classes cost on the host (issue 34), and that the faster paths give the
very plans the former ones gave.

* ``tiles.classify_exact`` is linear in the columns' runs plus the tiles (a difference array per
  count); the former classifier counted the must/may cells of every (query tile, column) pair.
  The two must give the same classes and the same undecided tiles, at every shape: here the
  former one is rebuilt from ``Runs.cells_in`` and compared, and both with the dense oracle.
* ``tile_bounds`` decides undecided tiles from interval arithmetic, without a cell: every tile it
  decides must have the brute-force class, and a read that may leave its tensor keeps the
  oracle's error.
* The plan's host work is vectorized: the number of Python-level calls a plan makes does not grow
  with the length (no loop per tile or per query-tile row), and the numpy evaluator evaluates a
  bounded number of cells per undecided tile.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attnc.backends.triton.plans import walk_arrays
from attnc.compiler.analysis.intervals import analyze
from attnc.compiler import interp
from attnc.compiler.analysis.tile_bounds import UNDECIDED, _Bounds, _Int, _RangeTables, tile_bounds_classes
from attnc.compiler.analysis.tile_eval import NumpyTileEvaluator
from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP, TilePlan, classify_exact
from attnc.compiler import ir
from attnc.compiler.errors import PlanError
from attnc.compiler.interp import evaluate
from attnc.compiler.lower import compile_spec
from attnc.compiler.oracle import dense_mask
from attnc.compiler.plan import plan as make_plan
from tests.unit.test_tile_eval import call_tensors, masks, program as eval_program
from tests.unit.test_tiles import brute_classes, cases, dense_for

PROPERTY = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def cell_count_classes(mi, block_m: int, block_n: int):
    """The former classifier: per (query tile, column), the cells of the tile's rows in the must
    and may row sets; then per tile FULL / SKIP / PARTIAL and the undecided PARTIAL tiles."""
    b_, h_, s_k = mi.shape
    i0 = np.arange(0, mi.s_q, block_m)
    i1 = np.minimum(i0 + block_m, mi.s_q)
    need = (i1 - i0)[:, None]
    sure = mi.visible.must.cells_in(i0[:, None], i1[:, None])
    maybe = mi.visible.may.cells_in(i0[:, None], i1[:, None])
    starts = np.arange(0, s_k, block_n)

    def per_tile(x, f):
        return f.reduceat(x.reshape(len(i0), b_, h_, s_k), starts, axis=-1).transpose(1, 2, 0, 3)

    full, skip = per_tile(sure == need, np.logical_and), per_tile(maybe == 0, np.logical_and)
    proven = per_tile(sure > 0, np.logical_or) & per_tile(maybe < need, np.logical_or)
    classes = np.where(skip, SKIP, np.where(full, FULL, PARTIAL)).astype(np.int8)
    return classes, (classes == PARTIAL) & ~proven


def check_classifier(mi, block_m, block_n, truth):
    undecided = np.zeros(truth.shape, bool)
    got = classify_exact(mi, block_m, block_n, undecided=undecided)
    want, want_undecided = cell_count_classes(mi, block_m, block_n)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(undecided, want_undecided)
    np.testing.assert_array_equal(classify_exact(mi, block_m, block_n, chunk=1), want)  # a query-tile row a step
    decided = ~undecided
    np.testing.assert_array_equal(got[decided & (got != PARTIAL)], truth[decided & (got != PARTIAL)])
    assert ((got == truth) | (got == PARTIAL)).all()


@PROPERTY
@given(cases())
def test_linear_classifier_equals_the_cell_counts_on_every_family(case):
    """All mask families (documents, prefixes, evictions per head...), B up to 2, H up to 3,
    bottom-right (S_q < S_k) and decode shapes, any tiles."""
    _, p, batch, s_q, s_k, tensors, block_m, block_n = case
    mi = analyze(p, batch, s_q, s_k, tensors)
    check_classifier(mi, block_m, block_n, brute_classes(dense_for(mi, p, batch, s_q, s_k, tensors), block_m, block_n))


@PROPERTY
@given(masks())
def test_linear_classifier_equals_the_cell_counts_where_the_analysis_gives_up(case):
    expr, s_q, s_k, block_m, block_n, seed = case
    p = eval_program(expr)
    tensors = call_tensors(p, 2, s_k, seed)
    mi = analyze(p, 2, s_q, s_k, tensors)
    b_, h_ = mi.shape[:2]
    check_classifier(mi, block_m, block_n,
                     brute_classes(dense_mask(p, 2, s_q, s_k, tensors)[:b_, :h_], block_m, block_n))


# ---------------------------------------------------------------- whole plans: former path == new path
DOC = "tensor doc: i32[b, s]"
PLANS = [
    # (spec statements, mask, B, S_q, S_k, tiles)
    ("heads = 2", "causal & (window(40) | k < 4 | q % 64 < 4)", 1, 300, 300, (32, 32)),
    ("heads = 2", "causal & window(64) & (q - k) % 2 == 0", 1, 256, 256, (16, 32)),
    ("heads = 2", "(q & k & 96) == 0 | causal & window(16)", 1, 256, 256, (32, 32)),
    (f"heads = 2 {DOC}", "causal & doc[b, q] == doc[b, k] & (window(24) | q % 48 < 3)", 3, 200, 200, (16, 16)),
    (f"heads = 2 {DOC}", "doc[b, q] == doc[b, k] & ((q ^ k) & 8) == 0", 2, 150, 150, (8, 16)),
    ("heads = 2", "causal & (window(30) | q % 50 < 5)", 2, 97, 260, (16, 32)),  # bottom-right, ragged tiles
    ("heads = 8 / 2", "causal & (h < 3 | (q - k) % 3 == 0)", 2, 128, 128, (16, 16)),  # GQA, by query head
    ("heads = 8 / 2", "causal & window(20)", 4, 120, 200, (16, 16)),  # exact: nothing undecided
]


def former_plan(p, batch, s_q, s_k, tensors, block_m, block_n) -> TilePlan:
    """What the former path planned: the cell-count classes, every undecided tile evaluated cell
    by cell (the brute-force class of the dense oracle)."""
    mi = analyze(p, batch, s_q, s_k, tensors)
    classes, undecided = cell_count_classes(mi, block_m, block_n)
    b_, h_ = mi.shape[:2]
    truth = brute_classes(dense_mask(p, batch, s_q, s_k, tensors)[:b_, :h_], block_m, block_n)
    classes[undecided] = truth[undecided]
    np.testing.assert_array_equal(classes, truth)
    return TilePlan.from_classes(classes, block_m, block_n, "exact", int(undecided.sum()),
                                 "numpy" if undecided.any() else None)


@pytest.mark.parametrize("decls, mask, batch, s_q, s_k, tiles", PLANS)
def test_plans_equal_the_former_path(decls, mask, batch, s_q, s_k, tiles):
    p = compile_spec(f"attention t {{ {decls} head_dim = 4 dtype = f32 mask = {mask} }}")
    tensors = {"doc": np.sort(np.random.default_rng(7).integers(0, 6, (batch, s_k)), axis=1)} if p.tensors else {}
    new = make_plan(p, batch, s_q, s_k, tensors, *tiles)
    old = former_plan(p, batch, s_q, s_k, tensors, *tiles)
    for name in ("classes", "partial_indptr", "partial_indices", "full_indptr", "full_indices"):
        np.testing.assert_array_equal(getattr(new.tiles, name), getattr(old, name), err_msg=name)
    assert (new.tiles.undecided, new.tiles.evaluated_by) == (old.undecided, old.evaluated_by)
    assert new.tiles.undecided > 0 or new.intervals.exact
    from dataclasses import replace
    want = walk_arrays(replace(new, tiles=old))
    got = walk_arrays(new)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# ---------------------------------------------------------------- tile bounds
ATOMS = (
    "q % {p} < {c}", "k % {p} >= {c}", "(q - k) % {d} == 0", "(q & k & {m}) == 0", "(q & {m}) == (k & {m})",
    "((q ^ k) & {m}) != 0", "(q | {m}) == (k | {m})", "q // {p} == k // {p}", "q // -{p} <= k // -{p}",
    "q % -{p} > -{c}", "(q >> {s}) == (k >> {s})", "(k << {s}) < q + {w}", "min(q, k) * {d} < {w} + k",
    "max(q - {w}, 0) <= k", "abs(q - k) <= {w}", "abs(k - {w}) * 2 > q", "where(q < {w}, k < {c}, k >= q - {w})",
    "where(k < {w}, q, k) % {p} < {c}", "q % (k % {d}) == 0", "q // (k % {d} - 1) < {c}",
    "(q + {w}) // (k % {d} + 1) == {c}", "(k - {w}) // (q // {p} + 1) >= -{c}", "sign(q - k) == sign({c} - k)",
    "doc[b, q] == doc[b, k]", "doc[b, k] < doc[b, q] + {c}", "k + 1 < S_k & doc[b, k + 1] == doc[b, q]",
    "q - {c} >= 0 & doc[b, q - {c}] != doc[b, k]", "doc[b, k + {c}] == {d}", "h < 1 | k < q",
)


@st.composite
def bound_masks(draw):
    def one():
        a = draw(st.sampled_from(ATOMS)).format(
            p=draw(st.integers(1, 24)), c=draw(st.integers(0, 9)), d=draw(st.integers(1, 5)),
            m=draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 48])), s=draw(st.integers(0, 5)),
            w=draw(st.integers(0, 40)))
        return f"!({a})" if draw(st.integers(0, 5)) == 0 else f"({a})"
    expr = one()
    for _ in range(draw(st.integers(0, 2))):
        expr = f"({expr}) {draw(st.sampled_from(['&', '|']))} {one()}"
    s_k = draw(st.integers(1, 80))
    s_q = draw(st.integers(1, s_k))
    return expr, s_q, s_k, draw(st.integers(1, 17)), draw(st.integers(1, 17)), draw(st.integers(0, 99))


def tile_cells(p, s_q: int, s_k: int, tensors: dict, tiles: np.ndarray, block_m: int, block_n: int):
    """The mask at every cell of each tile (rows and keys past the end repeat the last ones), with
    the interpreter's reads: a read outside its tensor where used raises, tile by tile."""
    q = s_k - s_q + np.minimum(tiles[:, 2, None] * block_m + np.arange(block_m), s_q - 1)
    k = np.minimum(tiles[:, 3, None] * block_n + np.arange(block_n), s_k - 1)
    env = {"b": tiles[:, 0, None, None], "h": tiles[:, 1, None, None], "q": q[:, :, None], "k": k[:, None, :],
           "S_q": np.asarray(s_q), "S_k": np.asarray(s_k)}
    return np.broadcast_to(evaluate(p.mask, env, tensors), (len(tiles), block_m, block_n))


@PROPERTY
@given(bound_masks())
def test_bounds_decide_tiles_only_with_their_true_class(case):
    """Every tile the bounds decide holds that class cell by cell, and none of its cells reads
    outside a tensor where the read is used (the cells' evaluation does not raise: a tile with such
    a read goes to the cells, which raise the oracle's error).  Document ids sorted or not (the
    range minima and maxima).  (Whole plans against the dense oracle: test_tile_eval.py.)"""
    expr, s_q, s_k, block_m, block_n, seed = case
    p = eval_program(expr)
    tensors = call_tensors(p, 2, s_k, seed)
    if tensors and seed % 2:
        tensors = {"doc": np.random.default_rng(seed).integers(-3, 6, (2, s_k))}
    b_, h_ = (2 if "b" in ir.free_vars(p.mask) else 1), (2 if "h" in ir.free_vars(p.mask) else 1)
    tiles = np.argwhere(np.ones((b_, h_, -(-s_q // block_m), -(-s_k // block_n)), bool)).astype(np.int64)
    got = tile_bounds_classes(p, s_q, s_k, tensors, tiles, block_m, block_n)
    decided = got != UNDECIDED
    cells = tile_cells(p, s_q, s_k, tensors, tiles[decided], block_m, block_n).reshape(-1, block_m * block_n)
    want = np.where(cells.all(axis=1), FULL, np.where(cells.any(axis=1), PARTIAL, SKIP))
    np.testing.assert_array_equal(got[decided], want, err_msg=expr)


def operands(rng, n: int, scale: int, width: int = 24, low: int | None = None):
    """``n`` ranges ``[lo, lo + w]`` at offsets from ``low`` (default ``-scale``) up to ``scale``
    (wide offsets: high bits that carry), a quarter of them points; with every value of each,
    padded by repeating the last."""
    lo = rng.integers(-scale if low is None else low, scale, n)
    carry = rng.random(n) < 0.5  # half of them across a power of two (every lower bit varies)
    lo = np.where(carry, (1 << rng.integers(1, max(2, scale.bit_length()), n)) - rng.integers(1, width, n), lo)
    lo = np.maximum(lo, -scale if low is None else low)
    hi = lo + np.where(rng.random(n) < 0.25, 0, rng.integers(0, width, n))
    values = np.minimum(lo[:, None] + np.arange(width), hi[:, None])
    return _Int(lo, hi, np.zeros(n, bool)), values


RULES = {  # the rule's operands: (offset scale of a, of b)
    "add": (1 << 20, 1 << 20), "sub": (1 << 20, 1 << 20), "mul": (1 << 12, 64), "floordiv": (1 << 12, 12),
    "mod": (1 << 12, 12), "bitand": (1 << 20, 1 << 20), "bitor": (1 << 20, 1 << 20),
    "bitxor": (1 << 20, 1 << 20), "shl": (1 << 12, 4), "shr": (1 << 20, 4),
    "min": (1 << 12, 1 << 12), "max": (1 << 12, 1 << 12),
}


@pytest.mark.parametrize("op", sorted(RULES))
def test_each_bound_rule_holds_every_value(op):
    """For ranges of each operand, the rule's bounds hold the interpreter's value at every pair
    (points give points where the rule is exact), and a comparison's 'can be true / false' hold
    every pair's truth."""
    rng = np.random.default_rng(sorted(RULES).index(op))
    n = 600
    low = 0 if op.startswith("bit") else None  # (bits of negative ranges are unbounded)
    (a, xs), (b, ys) = (operands(rng, n, scale, low=low) for scale in RULES[op])
    bounds = _Bounds({}, {}, {}, _RangeTables({}), n)
    fn = {"min": np.minimum, "max": np.maximum}.get(op) or interp.ARITH[op]
    with np.errstate(all="ignore"):
        values = fn(xs[:, :, None], ys[:, None, :])
    got = bounds.call(op, [a, b]) if op in ("min", "max") else bounds.arith(op, a, b)
    inside = (got.lo[:, None, None] <= values) & (values <= got.hi[:, None, None])
    assert inside.all(), (op, np.argwhere(~inside)[:3])
    points = (a.lo == a.hi) & (b.lo == b.hi) & ((b.lo >= 0) | (op not in ("shl", "shr")))
    assert points.any() and (got.lo[points] == got.hi[points]).all()
    for cmp in ("eq", "ne", "lt", "le", "gt", "ge"):
        truth = interp.COMPARE[cmp](xs[:, :, None], ys[:, None, :])
        bounds.box = {"x": (a.lo, a.hi), "y": (b.lo, b.hi)}
        t = bounds.compare(ir.Compare(cmp, ir.Var("x", ir.I32), ir.Var("y", ir.I32)))
        assert (t.can_true | ~truth.any(axis=(1, 2))).all() and (t.can_false | truth.all(axis=(1, 2))).all()


def test_bounds_at_the_limit_widen_instead_of_wrapping():
    """Sums, differences and products of the widest bounds never wrap around int64 into an
    inverted range (which would decide a comparison): they become unbounded."""
    from attnc.compiler.analysis.tile_bounds import BIG
    bounds = _Bounds({}, {}, {}, _RangeTables({}), 3)
    no = np.zeros(3, bool)
    wide = _Int(np.array([0, -BIG, BIG]), np.array([BIG, 0, BIG]), no)
    for op in ("add", "sub", "mul", "shl", "bitor", "bitxor"):
        got = bounds.arith(op, wide, wide if op != "shl" else _Int(np.full(3, 1), np.full(3, 1), no))
        assert (got.lo <= got.hi).all() and ((got.lo == -BIG) & (got.hi == BIG) | (got.lo == got.hi)).all(), op
    assert bounds.point(1 << 62).lo[0] == -BIG and bounds.point(-(1 << 62)).hi[0] == BIG


def test_known_bits_hold_for_every_value_of_a_range():
    """The bits of ``[lo, hi]`` known set or clear hold for its values: ranges of every width up to
    2^45, each checked at its ends, at the powers of two inside it and at random values."""
    from attnc.compiler.analysis.tile_bounds import _known_bits
    rng = np.random.default_rng(5)
    lo = rng.integers(0, 1 << 40, 4000) >> rng.integers(0, 40, 4000)
    hi = lo + (rng.integers(0, 1 << 40, 4000) >> rng.integers(0, 40, 4000))
    k = rng.integers(0, 46, 1000)  # [m 2^k, (m + 1) 2^k]: the ends differ in one bit, the values in all below
    lo[:1000] = rng.integers(0, 1 << 10, 1000) << k
    hi[:1000] = lo[:1000] + (np.int64(1) << k)
    ones, zeros = _known_bits(lo.copy(), hi.copy())
    assert not (ones & zeros).any()
    inside = [lo, hi, lo + (rng.random((64, 4000)) * (hi - lo + 1)).astype(np.int64)]
    powers = (hi >> np.arange(47)[:, None]) << np.arange(47)[:, None]  # hi with its low bits cleared
    inside += [np.where(powers >= lo, powers, lo)]
    for v in inside:
        assert ((v & ones) == ones).all() and not (v & zeros).any()
    assert ((ones | zeros) == np.iinfo(np.int64).max).any()  # points: every bit known


@pytest.mark.parametrize("fn", ["abs", "sign", "neg"])
def test_each_unary_bound_rule_holds_every_value(fn):
    rng = np.random.default_rng(len(fn))
    a, xs = operands(rng, 500, 1 << 10)
    bounds = _Bounds({"x": (a.lo, a.hi)}, {}, {}, _RangeTables({}), 500)
    x = ir.Var("x", ir.I32)
    got = bounds.int(ir.Unary("neg", x, ir.I32) if fn == "neg" else ir.Call(fn, (x,), ir.I32))
    values = -xs if fn == "neg" else interp.CALL[fn](xs)
    assert ((got.lo[:, None] <= values) & (values <= got.hi[:, None])).all()


def test_a_select_bound_holds_both_branches_where_its_condition_may_go_either_way():
    rng = np.random.default_rng(3)
    (a, xs), (b, ys) = operands(rng, 500, 1 << 10), operands(rng, 500, 1 << 10)
    bounds = _Bounds({"x": (a.lo, a.hi), "y": (b.lo, b.hi)}, {}, {}, _RangeTables({}), 500)
    x, y = ir.Var("x", ir.I32), ir.Var("y", ir.I32)
    for first, second in ((x, y), (y, x)):  # min(x, y), max(x, y) written with where
        got = bounds.int(ir.Select(ir.Compare("lt", x, y), first, second, ir.I32))
        take = xs[:, :, None] < ys[:, None, :]
        values = np.where(take, xs[:, :, None], ys[:, None, :]) if first is x else \
            np.where(take, ys[:, None, :], xs[:, :, None])
        assert ((got.lo[:, None, None] <= values) & (values <= got.hi[:, None, None])).all()


def test_a_bool_tensor_read_can_be_true_where_one_value_is_and_false_where_one_is():
    p = compile_spec("attention t { heads = 1 head_dim = 4 dtype = f32 tensor m: bool[b, s] mask = m[b, k] }")
    m = {"m": np.array([[True] * 8 + [False] * 8 + [True, False] * 4])}
    tiles = np.array([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]], np.int64)
    assert tile_bounds_classes(p, 8, 24, m, tiles, 8, 8).tolist() == [FULL, SKIP, UNDECIDED]


def test_bounds_decide_the_tiles_the_analysis_cannot():
    """Periodic rows away from their rows, bitwise patterns over aligned tiles, documents that do not
    meet: decided by bounds; tiles that really hold both values stay undecided."""
    p = eval_program("q % 64 < 4")
    tiles = np.array([[0, 0, r, 0] for r in range(8)], np.int64)  # rows [16 r, 16 r + 16)
    got = tile_bounds_classes(p, 128, 128, {}, tiles, 16, 16)
    assert got.tolist() == [UNDECIDED, SKIP, SKIP, SKIP, UNDECIDED, SKIP, SKIP, SKIP]
    p = eval_program("(q & k & 96) == 0")
    grid = np.argwhere(np.ones((1, 1, 8, 8), bool)).astype(np.int64)
    got = tile_bounds_classes(p, 256, 256, {}, grid, 32, 32)
    want = np.where(((np.arange(8)[:, None] * 32) & (np.arange(8)[None, :] * 32) & 96) == 0, FULL, SKIP)
    np.testing.assert_array_equal(got.reshape(8, 8), want)
    p = eval_program("doc[b, q] == doc[b, k]")
    doc = {"doc": np.repeat(np.arange(4), 16)[None, :]}  # four documents of 16
    got = tile_bounds_classes(p, 64, 64, doc, np.array([[0, 0, 0, 0], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 3, 3]]),
                              16, 16)
    assert got.tolist() == [FULL, SKIP, SKIP, FULL]
    got = tile_bounds_classes(p, 64, 64, doc, np.array([[0, 0, 0, 0]]), 32, 32)  # two documents in one tile
    assert got.tolist() == [UNDECIDED]


def test_a_read_that_may_leave_its_tensor_is_left_to_the_cells():
    """``doc[b, k + 1]`` past the last key, used: the bounds do not decide the tile (the cells raise
    the oracle's error), even where the other side of ``&`` is false; guarded, it is decided."""
    p = eval_program("doc[b, k + 1] == 0 & q % 4 == 5")
    doc = {"doc": np.zeros((1, 16), np.int64)}
    tiles = np.array([[0, 0, 0, 0], [0, 0, 0, 1]], np.int64)
    assert tile_bounds_classes(p, 16, 16, doc, tiles, 8, 8).tolist() == [SKIP, UNDECIDED]
    p = eval_program("(q % 4 < 4 & doc[b, k + 1] == 0) & q % 4 == 5")  # used where q % 4 < 4
    assert tile_bounds_classes(p, 16, 16, doc, tiles, 8, 8).tolist() == [SKIP, UNDECIDED]
    p = eval_program("q % 4 == 5 & doc[b, k + 1] == 0")  # the read is used nowhere
    assert tile_bounds_classes(p, 16, 16, doc, tiles, 8, 8).tolist() == [SKIP, SKIP]
    p = eval_program("where(k < 8, q % 4 == 5, doc[b, k + 1] == 0 & q < 0)")  # only in the second tile
    assert tile_bounds_classes(p, 16, 16, doc, tiles, 8, 8).tolist() == [SKIP, UNDECIDED]


# ---------------------------------------------------------------- the structure of the cost
def python_calls(fn) -> int:
    """Python-level calls (functions and builtins) while ``fn`` runs: numpy's work over arrays is
    not counted, a loop over tiles or query-tile rows is."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


class Precomputed:
    """A tile evaluator that knows the answers (stands in for the GPU's): the host's part alone."""

    name = "precomputed"

    def __init__(self, classes):
        self.classes = classes

    def __call__(self, tiles, block_m, block_n):
        return self.classes[tuple(tiles.T)]


@pytest.mark.parametrize("mask", ["causal & (window(512) | k < 16 | q % 1024 < 16)",
                                  "(q & k & 3072) == 0 | causal & window(128)"])
def test_a_plans_python_work_does_not_grow_with_the_length(mask):
    """From S = 4096 to 32768 (64x the tiles) the plan makes as many Python-level calls, with the
    GPU's evaluator's stand-in and with the host's numpy evaluator: the analysis, the classifier,
    the bounds and the cell stages are whole-array operations (the former classifier stepped over
    query-tile rows, the former evaluator over a few tiles at a time)."""
    p = eval_program(mask)
    counts = {}
    for s in (4096, 32768):
        truth = make_plan(p, 1, s, s, {}, 128, 128)
        assert truth.tiles.undecided > 0 and truth.tiles.evaluated_by == "numpy"
        stub = Precomputed(truth.tiles.classes)
        counts[s] = (python_calls(lambda: make_plan(p, 1, s, s, {}, 128, 128, tile_evaluator=stub)),
                     python_calls(lambda: make_plan(p, 1, s, s, {}, 128, 128)))
    # (a few calls of slack for data-dependent branches; a loop per query-tile row adds hundreds,
    # one per tile tens of thousands: the former code's counts went 3794 -> 3962 and 5727 -> 122055)
    assert all(big <= small + 40 for big, small in zip(counts[32768], counts[4096])), counts


def test_the_host_evaluator_evaluates_a_few_cells_per_undecided_tile():
    """The issue's mask at S = 8192 (1830 undecided tiles of 128 x 128): bounds decide the tiles
    away from the periodic rows and 16 cells each the others, where a tile's 16 384 cells were
    evaluated before (25.9M cells, 0.4 s)."""
    p = eval_program("causal & (window(512) | k < 16 | q % 1024 < 16)")
    ev = NumpyTileEvaluator(p, 1, 8192, 8192)
    plan = make_plan(p, 1, 8192, 8192, {}, 128, 128, tile_evaluator=ev)
    undecided = plan.tiles.undecided
    assert undecided > 1000 and plan.tiles.evaluated_by == "numpy"
    assert ev.by_bounds >= 0.8 * undecided
    assert ev.cells <= 16 * (undecided - ev.by_bounds)
