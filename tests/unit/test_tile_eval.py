"""Exact tile classes where the interval analysis is not exact (issue 34): the tiles it leaves
undecided are classified by the predicate over their cells (compiler/analysis/tile_eval.py on the
host, backends/triton/tile_classes.py on a GPU or in Triton's interpreter), and must equal the
brute-force classes of the dense oracle mask; where the analysis is exact nothing is evaluated."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attnc.compiler import oracle
from attnc.compiler.analysis.intervals import analyze
from attnc.compiler.analysis.tile_eval import NumpyTileEvaluator, classify_tiles
from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP, plan_tiles
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_spec
from attnc.compiler.oracle import dense_mask
from attnc.compiler.plan import plan as make_plan
from tests.unit.test_tiles import brute_classes

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# atoms of every kind the analysis solves and of the kinds it cannot (%, bitwise, dilations)
ATOMS = (
    "causal", "window({w})", "abs(q - k) <= {w}", "k < {c}", "q < {c}", "q // {p} == k // {p}",
    "q % {p} < {c}", "k % {p} < {c}", "(q - k) % {d} == 0", "(q & k & {m}) == 0", "(q & {m}) == (k & {m})",
    "((q ^ k) & {m}) != 0", "doc[b, q] == doc[b, k]", "h < 1",
)
DOC = "tensor doc: i32[b, s]"


# reads that may leave the tensor (past the last key or row, before the first): errors only where used
READS = ("doc[b, k + {c}] == 0", "doc[b, q + {c}] == 1", "doc[b, k - {c}] == doc[b, q]", "doc[b, q - {c}] < 2")


@st.composite
def masks(draw, atoms=ATOMS):
    """A random mask of two to four atoms under &, | and !, with its call shape and tiles."""
    def one():
        a = draw(st.sampled_from(atoms)).format(w=draw(st.integers(1, 24)), c=draw(st.integers(1, 8)),
                                                 p=draw(st.integers(2, 20)), d=draw(st.integers(2, 4)),
                                                 m=draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16])))
        return f"!({a})" if draw(st.integers(0, 5)) == 0 else f"({a})"
    expr = one()
    for _ in range(draw(st.integers(1, 3))):
        expr = f"({expr}) {draw(st.sampled_from(['&', '&', '|']))} {one()}"
    s_k = draw(st.integers(8, 56))
    s_q = draw(st.integers(1, s_k))
    return expr, s_q, s_k, draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(0, 99))


def program(expr: str):
    decl = DOC if "doc" in expr else ""
    return compile_spec(f"attention t {{ heads = 2 head_dim = 4 dtype = f32 {decl} mask = {expr} }}")


def call_tensors(p, batch: int, s_k: int, seed: int) -> dict:
    if not p.tensors:
        return {}
    rng = np.random.default_rng(seed)
    return {"doc": np.sort(rng.integers(0, 4, (batch, s_k)), axis=1)}


def truth(p, mi, batch, s_q, s_k, tensors, block_m, block_n):
    b_, h_ = mi.shape[:2]
    return brute_classes(dense_mask(p, batch, s_q, s_k, tensors)[:b_, :h_], block_m, block_n)


@PROPERTY
@given(masks())
def test_plans_classify_every_tile_exactly(case):
    expr, s_q, s_k, block_m, block_n, seed = case
    p = program(expr)
    tensors = call_tensors(p, 2, s_k, seed)
    plan = make_plan(p, 2, s_q, s_k, tensors, block_m, block_n)
    want = truth(p, plan.intervals, 2, s_q, s_k, tensors, block_m, block_n)
    np.testing.assert_array_equal(plan.tiles.classes, want, err_msg=expr)
    assert plan.tiles.exact
    if plan.intervals.exact:  # nothing undecided, nothing evaluated
        assert plan.tiles.undecided == 0 and plan.tiles.evaluated_by is None
    # the analysis alone: the same tiles decided, the undecided ones PARTIAL
    safe = plan_tiles(plan.intervals, block_m, block_n)
    assert safe.undecided == plan.tiles.undecided
    decided = (safe.classes == want) | (safe.classes == PARTIAL)
    assert decided.all(), expr
    assert int((safe.classes != want).sum()) <= safe.undecided


@PROPERTY
@given(masks(ATOMS + READS * 3))
def test_plans_raise_the_oracles_read_error_exactly_where_it_does(case):
    """Reads that may leave their tensor under guards of every kind (exact, periodic, bitwise): the
    plan raises the oracle's error when a cell that uses the read is out of range, and otherwise
    plans every tile exactly (the analysis once raised where the guard kept no such cell)."""
    expr, s_q, s_k, block_m, block_n, seed = case
    p = program(expr)
    tensors = call_tensors(p, 2, s_k, seed)
    try:
        want = dense_mask(p, 2, s_q, s_k, tensors)
    except PlanError as e:
        with pytest.raises(PlanError) as got:
            make_plan(p, 2, s_q, s_k, tensors, block_m, block_n)
        assert str(got.value) == str(e), expr
        return
    plan = make_plan(p, 2, s_q, s_k, tensors, block_m, block_n)
    b_, h_ = plan.intervals.shape[:2]
    np.testing.assert_array_equal(plan.tiles.classes, brute_classes(want[:b_, :h_], block_m, block_n), err_msg=expr)


def test_an_exact_analysis_evaluates_nothing():
    p = program("causal & (window(8) | k < 2)")
    calls = []

    class Counting(NumpyTileEvaluator):
        def __call__(self, tiles, block_m, block_n):
            calls.append(len(tiles))
            return super().__call__(tiles, block_m, block_n)

    plan = make_plan(p, 1, 64, 64, {}, 8, 8, tile_evaluator=Counting(p, 1, 64, 64))
    assert plan.intervals.exact and calls == [] and plan.tiles.undecided == 0
    # an inexact one evaluates only what it cannot prove, and a retile reuses the evaluator
    p = program("causal & (window(8) | q % 16 < 2)")
    plan = make_plan(p, 1, 64, 64, {}, 8, 8, tile_evaluator=Counting(p, 1, 64, 64))
    assert not plan.intervals.exact and calls == [plan.tiles.undecided] and 0 < calls[0] < 64
    again = plan.retile(16, 4)
    assert len(calls) == 2 and again.tiles.evaluated_by == "numpy"
    np.testing.assert_array_equal(again.tiles.classes, truth(p, plan.intervals, 1, 64, 64, {}, 16, 4))


def test_past_the_host_limit_undecided_tiles_stay_partial():
    p = program("causal & (window(8) | q % 16 < 2)")
    mi = analyze(p, 1, 64, 64)
    ev = NumpyTileEvaluator(p, 1, 64, 64, max_cells=100)
    plan = plan_tiles(mi, 8, 8, evaluator=ev)
    assert plan.evaluated_by is None and not plan.exact and ev.cells == 0
    assert "over the numpy evaluator's limit of 100" in plan.classified_by()
    np.testing.assert_array_equal(plan.classes, plan_tiles(mi, 8, 8).classes)  # the safe classes


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (2, 7), (5, 1)])
def test_chunks_and_borders_do_not_change_the_classes(block_m, block_n):
    p = program("(q & k & 8) == 0 | (q - k) % 3 == 0 & causal")
    grid = np.argwhere(np.ones((1, 1, -(-40 // block_m), -(-50 // block_n)), bool)).astype(np.int64)
    whole = classify_tiles(p, 40, 50, {}, grid, block_m, block_n)
    np.testing.assert_array_equal(classify_tiles(p, 40, 50, {}, grid, block_m, block_n, chunk=1), whole)
    mi = analyze(p, 1, 40, 50)
    np.testing.assert_array_equal(whole.reshape(grid[-1, 2] + 1, -1), truth(p, mi, 1, 40, 50, {}, block_m,
                                                                            block_n)[0, 0])
    assert {SKIP, PARTIAL, FULL} >= set(whole.tolist())


def test_reads_outside_a_tensor_are_the_oracles_errors():
    """The host evaluator reads tensors with the oracle's checks: a read outside a tensor in an
    undecided tile is the oracle's error, not a clamped value."""
    from attnc.compiler.errors import PlanError
    p = compile_spec("attention t { heads = 1 head_dim = 4 dtype = f32 tensor doc: i32[b, s] "
                     "mask = q % 2 == 0 & doc[b, k + 1] == 0 }")
    doc = {"doc": np.zeros((1, 16), np.int64)}
    with pytest.raises(PlanError, match="read out of range") as plan_error:
        make_plan(p, 1, 16, 16, doc, 4, 4)
    with pytest.raises(PlanError, match="read out of range") as oracle_error:
        oracle.dense_mask(p, 1, 16, 16, doc)
    assert str(plan_error.value) == str(oracle_error.value)


@pytest.mark.parametrize("expr", ["causal & (window(6) | k < 2 | q % 16 < 2)",
                                  "doc[b, q] == doc[b, k] & ((q - k) % 2 == 0 | (q & k & 8) == 0)"])
def test_numpy_backend_outputs_with_exact_tiles(expr):
    from attnc.compiler import numerics
    from attnc.compiler.dispatch import backend
    p = program(expr)
    kernel = backend("numpy").load(p)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 48, 4)).astype(np.float32) for _ in range(3))
    tensors = call_tensors(p, 2, 48, 3)
    plan = kernel.plan(2, 48, 48, tensors, 8, 8)
    assert plan.tiles.evaluated_by == "numpy" and plan.tiles.undecided > 0
    np.testing.assert_array_equal(plan.tiles.classes, truth(p, plan.intervals, 2, 48, 48, tensors, 8, 8))
    o, lse = kernel(q, k, v, plan=plan, return_lse=True, **tensors)
    ref_o, ref_lse = oracle.reference(p, q, k, v, tensors)
    assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, ref_o, ref_lse))


# ---------------------------------------------------------------- the Triton evaluator
def test_triton_evaluator_equals_the_host_one():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from attnc.backends.triton import runtime
    from attnc.backends.triton.tile_classes import TritonTileEvaluator
    p = program("(doc[b, q] == doc[b, k] & (q - k) % 3 != 1) | (q & k & 12) == 0 & h < 1")
    kernel = runtime.load(p)
    doc = call_tensors(p, 2, 37, 5)
    tiles = np.array([[0, 0, 0, 0], [1, 0, 2, 1], [0, 1, 4, 4], [1, 1, 1, 3], [1, 0, 3, 2]],
                     np.int64)  # (4, 4): the tile across S_q = 35 and S_k = 37
    host = classify_tiles(p, 35, 37, doc, tiles, 8, 9)
    from tests.conftest import to_triton
    doc_t = to_triton(torch.as_tensor(doc["doc"], dtype=torch.int32))  # on the kernel's device (CUDA in a GPU run)
    dev = TritonTileEvaluator(kernel.module, {"doc": doc_t}, 2, 35, 37, kernel.device)(tiles, 8, 9)
    np.testing.assert_array_equal(dev, host)
    assert dev.dtype == np.int8 and len(set(host.tolist())) > 1


@pytest.mark.parametrize("expr", ["causal & (window(6) | k < 2 | q % 16 < 2)",
                                  "doc[b, q] == doc[b, k] & (q & k & 8) == 0"])
def test_triton_calls_plan_with_the_device_evaluator_and_cache_it(monkeypatch, expr):
    """A Triton call whose analysis is inexact plans its tiles with the predicate kernel (forced here
    under the interpreter, as a CUDA call is; CUDA tensors under ATTNC_TEST_GPU=1), matches the float64 oracle, and keeps the plan: the
    second call evaluates nothing, a document tensor changed in place is planned again."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from attnc.backends.triton import runtime
    from attnc.backends.triton import tile_classes
    from attnc.compiler import numerics
    runs = []

    class Counting(tile_classes.TritonTileEvaluator):
        def __call__(self, tiles, block_m, block_n):
            runs.append(len(tiles))
            return super().__call__(tiles, block_m, block_n)

    monkeypatch.setattr(tile_classes, "tile_evaluator", lambda module, tensors, batch, s_q, s_k, device:
                        Counting(module, tensors, batch, s_q, s_k, device))
    from attnc.backends.triton import plans
    plans.PLANS.clear()  # (a plan an earlier test left for this call would be reused: nothing evaluated here)
    from tests.conftest import to_triton, triton_device
    p = program(expr)
    kernel = runtime.load(p)
    rng = np.random.default_rng(0)
    # (a GPU's tiles are 16 x 16 and up, whose bounds decide every tile of 40 rows: longer there)
    s = 40 if triton_device() == "cpu" else 200
    q, k, v = (to_triton(rng.standard_normal((1, 2, s, 4)).astype(np.float32)) for _ in range(3))
    doc = to_triton(torch.as_tensor(call_tensors(p, 1, s, 2).get("doc", np.zeros((1, s))), dtype=torch.int32))
    named = {"doc": doc} if p.tensors else {}
    o, lse = kernel(q, k, v, return_lse=True, **named)
    # (once per tile shape the launch layer weighs: on a GPU a plan retiled to the chosen tiles evaluates again)
    assert runs and all(r > 0 for r in runs)
    first = len(runs)
    host = {"doc": doc.cpu().numpy().astype(np.int64)} if p.tensors else {}
    hq, hk, hv = (t.cpu().numpy() for t in (q, k, v))
    ref_o, ref_lse = oracle.reference(p, hq, hk, hv, host)
    assert all(c.ok for c in numerics.compare_outputs("f32", o.cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse))
    kernel(q, k, v, **named)
    assert len(runs) == first  # the plan cache's
    if p.tensors:
        doc[0, 20:] += 1  # in place: a new version, a new plan
        o2 = kernel(q, k, v, **named)
        assert len(runs) > first
        ref2, _ = oracle.reference(p, hq, hk, hv, {"doc": doc.cpu().numpy().astype(np.int64)})
        assert numerics.compare_outputs("f32", o2.cpu().numpy(), lse.cpu().numpy(), ref2, ref_lse)[0].ok
