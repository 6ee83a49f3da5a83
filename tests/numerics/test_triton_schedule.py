"""The prefill launch's schedule (CPU interpreter unless ATTNC_TEST_GPU=1): jobs in head groups,
longest first per plane (``_job``, ``Plan.q_tile_order``), against the float64 oracle, with head
counts that do not divide the group, ragged last query tiles, rows that see no key, per-batch
plans, score programs and every walk."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

SPECS = {
    "full": "attention a { heads = 6 / 2 head_dim = 16 dtype = f32 mask = true }",
    "prefix": "attention b { heads = 3 head_dim = 16 dtype = f32 mask = causal | k < 24 }",
    # rows q < 30 see no key: whole split parts, and whole tiles, with -inf LSE and O = 0
    "empty_rows": "attention c { heads = 2 head_dim = 16 dtype = f32 mask = k > 9 & q >= 30 }",
    "document": "attention d { heads = 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] ~ segments(20, 60) "
                "mask = doc[b, q] == doc[b, k] | k < 8 }",
    "softcap": "attention e { heads = 4 / 1 head_dim = 16 dtype = f32 score = softcap(score, 5.0) mask = true }",
}
SEQ = 76  # five query tiles of 16, the last one ragged


def _case(name, batch=2, seed=3):
    program = compile_spec(SPECS[name])
    kernel = runtime.load(program)
    arrays = inputs.sample(program, batch, SEQ, SEQ, seed=seed)
    tensors = {n: a for n, a in arrays.items() if n not in ("q", "k", "v")}
    ref = oracle.reference(program, arrays["q"], arrays["k"], arrays["v"], tensors)
    return program, kernel, arrays, tensors, ref


def _ok(program, got, ref):
    return all(c.ok for c in numerics.compare_outputs(program.dtype, *got, *ref))


CASES = [(n, g, None) for n in ("full", "document", "softcap") for g in (1, 3, 5, 64)] + [
    ("prefix", 4, None), ("empty_rows", 5, None)] + [("document", 3, w) for w in ("merged", "runs", "blocks")]


@pytest.mark.parametrize("name, head_group, walk", CASES)
def test_every_job_once_for_any_head_group(name, head_group, walk):
    """Head groups that divide B * H_q, that do not, and that exceed it: every (tile, head) runs
    once (a tile run twice or never shows as a wrong or garbage row)."""
    program, kernel, arrays, tensors, ref = _case(name)
    got, one_by_one = (kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, block_m=16, block_n=16,
                              head_group=g, walk=walk, **tensors) for g in (head_group, 1))
    # every tile is computed the same way whatever the order: bit for bit the one-head-at-a-time launch
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, one_by_one))
    if runtime.interpreted():  # (f32 specs run tl.dot in TF32 on a GPU: outside the f32 tolerance)
        assert _ok(program, got, ref)


def test_head_group_must_be_positive():
    program, kernel, arrays, tensors, ref = _case("full")
    with pytest.raises(ValueError, match="head_group = 0"):
        kernel(arrays["q"], arrays["k"], arrays["v"], head_group=0)


def test_q_tile_order_is_longest_first_per_plane():
    program, kernel, arrays, tensors, ref = _case("document", batch=3)
    plan = kernel.plan(3, SEQ, SEQ, tensors, 16, 16)
    work = (plan.tiles.classes != 0).sum(axis=3)
    order = plan.q_tile_order().reshape(work.shape)
    assert work.shape[0] == 3  # a plan per batch row
    for b in range(3):
        assert sorted(order[b, 0]) == list(range(work.shape[2]))
        assert np.all(np.diff(work[b, 0][order[b, 0]]) <= 0)
