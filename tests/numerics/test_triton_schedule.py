"""The prefill launch's schedule (CPU interpreter unless ATTNC_TEST_GPU=1): jobs in head groups,
longest first per plane (``_job``, ``Plan.q_tile_order``), and the split tail (``tail_split``:
the last wave's long jobs cut into parts of their block lists, merged by ``_tail_combine``),
against the float64 oracle, with head counts that do not divide the group, ragged last query
tiles, rows that see no key, per-batch plans, score programs and every walk."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from backends.numpy import oracle  # noqa: E402
from backends.triton import runtime  # noqa: E402
from compiler import inputs, numerics  # noqa: E402
from compiler.lower import compile_spec  # noqa: E402

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


@pytest.mark.parametrize("head_group", [1, 3, 5, 64])
@pytest.mark.parametrize("name", ["full", "document", "softcap"])
def test_every_job_once_for_any_head_group(name, head_group):
    """Head groups that divide B * H_q, that do not, and that exceed it: every (tile, head) runs
    once (a tile run twice or never shows as a wrong or garbage row)."""
    program, kernel, arrays, tensors, ref = _case(name)
    got = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, block_m=16, block_n=16,
                 head_group=head_group, slots=0, **tensors)
    assert _ok(program, got, ref)


SPLIT_CASES = [("full", w) for w in ("merged", "merged_blocks", "runs", "blocks")] + [
    (n, None) for n in ("prefix", "empty_rows", "document", "softcap")] + [("document", "blocks")]


@pytest.mark.parametrize("name, walk", SPLIT_CASES)
def test_split_tail_matches_the_oracle(name, walk, monkeypatch):
    """Slots chosen so that the last wave holds two jobs, or all of them: the main programs walk
    the plan their way, the parts (as short as one block) walk block lists, the combine merges."""
    program, kernel, arrays, tensors, ref = _case(name)
    monkeypatch.setattr(kernel.module, "MIN_PART_BLOCKS", 1)
    plan = kernel.plan(2, SEQ, SEQ, tensors, 16, 16)
    args = kernel.device_plan(plan, kernel.device)
    jobs = plan.tiles.classes.shape[2] * 2 * program.heads_q
    splits = 0
    for slots in (jobs - 2, 2 * jobs + 5):
        split = kernel.module.tail_split(args, 2 * program.heads_q, slots, 3)
        splits += split is not None
        got = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, plan=plan, walk=walk,
                     slots=slots, head_group=3, **tensors)
        assert _ok(program, got, ref), (slots, split and split[0])
    assert splits >= 1


def test_tail_split_policy():
    program, kernel, arrays, tensors, ref = _case("full")
    plan = kernel.plan(2, SEQ, SEQ, tensors, 16, 16)
    args = kernel.device_plan(plan, kernel.device)
    bh, tiles, blocks = 12, 5, 5
    jobs = bh * tiles
    split = kernel.module.tail_split
    assert split(args, bh, 0) is None and split(args, bh, jobs) is None  # no partial last wave
    assert split(args, bh, jobs - 20) is None  # the last wave is more than half full
    n_main, job, lo, hi, ptr = split(args, bh, 1000, min_part_blocks=1)  # one short wave: split it all
    assert n_main == 0 and len(ptr) == jobs + 1
    assert np.all(np.diff(ptr) == blocks) and np.all(hi - lo == 1)
    n_main, job, lo, hi, ptr = split(args, bh, 29, min_part_blocks=2)  # 60 = 2 * 29 + 2: two jobs split
    assert n_main == 58 and list(np.unique(job)) == [58, 59] and list(ptr) == [0, 2, 4]
    indptr = args["merged_indptr"].cpu().numpy()
    for j in range(2):  # each job's parts tile its row's block list exactly, in order
        a, b = ptr[j], ptr[j + 1]
        assert lo[a] in indptr and hi[b - 1] - lo[a] == blocks and np.all(lo[a + 1:b] == hi[a:b - 1])
    assert split(args, bh, 29, min_part_blocks=3) is None  # parts would be shorter than asked


def test_tail_split_leaves_short_tail_jobs_alone():
    """Causal: the longest-first order leaves the shortest rows for the last wave; not worth a split."""
    program = compile_spec("attention c { heads = 2 head_dim = 16 dtype = f32 mask = causal }")
    kernel = runtime.load(program)
    plan = kernel.plan(1, 256, 256, {}, 16, 16)
    args = kernel.device_plan(plan, kernel.device)
    assert kernel.module.tail_split(args, 2, 30, min_part_blocks=1) is None  # 32 jobs, 2 left: rows of 1 block
    assert kernel.module.tail_split(args, 2, 100, min_part_blocks=1) is not None  # one short wave: split


def test_q_tile_order_is_longest_first_per_plane():
    program, kernel, arrays, tensors, ref = _case("document", batch=3)
    plan = kernel.plan(3, SEQ, SEQ, tensors, 16, 16)
    work = (plan.tiles.classes != 0).sum(axis=3)
    order = plan.q_tile_order().reshape(work.shape)
    assert work.shape[0] == 3  # a plan per batch row
    for b in range(3):
        assert sorted(order[b, 0]) == list(range(work.shape[2]))
        assert np.all(np.diff(work[b, 0][order[b, 0]]) <= 0)
