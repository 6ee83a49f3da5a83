"""The prefill launch's schedule: jobs in head groups, longest first per plane (``prefill._job``,
``Plan.q_tile_order``).  The order is tested on its numpy twin (``launch.job_order``), the kernel's
enumeration against the twin with one tiny kernel, and a few head-grouped launches against the
float64 oracle (CPU interpreter unless ATTNC_TEST_GPU=1)."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnc.backends.triton.kernels.prefill import _job  # noqa: E402
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


def test_the_job_order_visits_every_tile_once_longest_first():
    """``launch.job_order`` (``prefill._job`` in numpy): head groups that divide B * H_q, that do
    not, and that exceed it; every (tile rank, head) exactly once, and within a group ranks rise."""
    from attnc.backends.triton import launch
    for bh in (1, 5, 12, 64):
        for q_tiles in (1, 3, 7):
            for group in (1, 3, 4, 5, 64):
                jobs = launch.job_order(bh, q_tiles, group)
                assert sorted(map(tuple, jobs)) == [(r, h) for r in range(q_tiles) for h in range(bh)]
                for start in range(0, bh, group):  # a group's heads run rank by rank
                    mine = jobs[(jobs[:, 1] >= start) & (jobs[:, 1] < start + group)]
                    assert np.all(np.diff(mine[:, 0]) >= 0)


@triton.jit
def _jobs(OUT, BH, Q_TILES, HEAD_GROUP: tl.constexpr):
    t = tl.program_id(0)
    rank, bh = _job(t, BH, Q_TILES, HEAD_GROUP)
    tl.store(OUT + 2 * t, rank)
    tl.store(OUT + 2 * t + 1, bh)


def test_the_kernel_enumerates_jobs_as_its_numpy_twin():
    """The jitted ``_job`` (interpreted here; compiled with ATTNC_TEST_GPU=1) gives
    ``launch.job_order``'s table."""
    import torch
    from attnc.backends.triton import launch
    jobs = _jobs
    device = "cpu" if runtime.interpreted() else "cuda"
    for bh, q_tiles, group in ((6, 5, 4), (3, 2, 1), (8, 3, 64)):
        out = torch.full((bh * q_tiles, 2), -1, dtype=torch.int32, device=device)
        jobs[(bh * q_tiles,)](out, bh, q_tiles, HEAD_GROUP=group)
        assert np.array_equal(out.cpu().numpy(), launch.job_order(bh, q_tiles, group))


@pytest.mark.parametrize("name, head_group, walk", [("document", 3, "merged"), ("empty_rows", 5, None),
                                                     ("softcap", 5, "blocks"), ("prefix", 4, "runs")])
def test_a_head_grouped_launch_matches_the_oracle(name, head_group, walk):
    """Head groups that do not divide B * H_q, ragged last query tiles, rows that see no key,
    per-batch plans, score programs and walks, against the float64 oracle."""
    program, kernel, arrays, tensors, ref = _case(name)
    got = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, block_m=16, block_n=16,
                 head_group=head_group, walk=walk, **tensors)
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
