"""Split calls' block lists from the rows (compiler.analysis.decode_rows) against the general
route (the column analysis and the tile classifier per distinct length), on every example spec
over random lengths: identical arrays wherever the general analysis is exact, and where it is
not, exactly the dense oracle's cells (the general lists are only safe there)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attnc.compiler import oracle
from attnc.compiler import inputs
from attnc.compiler.analysis import decode_rows as dr
from attnc.compiler.analysis.intervals import analyze
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_file, compile_spec
from attnc.compiler.plan import decode_blocks
from tests.conftest import EXAMPLES

FIELDS = ("entry_ptr", "blocks", "partial", "tile_req", "tile_row0")
PROGRAMS = {p.stem: compile_file(p) for p in EXAMPLES}


def tensors_for(p, kv_lens, seed):
    if not p.tensors:
        return {}
    s = max(int(np.max(kv_lens, initial=1)), 1)
    sample = inputs.sample(p, len(kv_lens), s, s, seed=seed)
    return {t.name: sample[t.name] for t in p.tensors}


def general_is_exact(p, kv_lens, q_lens, tensors) -> bool:
    t64 = {n: a.astype(np.int64) for n, a in tensors.items()}
    return all(analyze(p, len(kv_lens), int(c), int(t), t64).exact
               for t, c in {(int(t), int(c)) for t, c in zip(kv_lens, q_lens) if c > 0 and t > 0})


def check_against_oracle(p, got, kv_lens, q_lens, tensors, block_n, block_q, exact=True):
    """Every tile lists exactly the blocks with a visible cell; FULL exactly where all are
    (``exact=False``: at least those blocks, FULL only where all are)."""
    for tile in range(len(got.tile_req)):
        b, i0 = int(got.tile_req[tile]), int(got.tile_row0[tile])
        t_len, c_len = int(kv_lens[b]), int(q_lens[b])
        vis = oracle.dense_mask(p, len(kv_lens), c_len, t_len, tensors)[b, :, i0:i0 + block_q]
        s = got.splits
        lo, hi = got.entry_ptr[tile * s], got.entry_ptr[tile * s + s]
        listed = dict(zip(got.blocks[lo:hi].tolist(), got.partial[lo:hi].tolist()))
        for j in range(-(-t_len // block_n)):
            cells = vis[:, :, j * block_n:(j + 1) * block_n]
            if exact:
                assert (j in listed) == bool(cells.any()), (tile, j)
                if j in listed:
                    assert listed[j] == (not cells.all()), (tile, j)
            else:
                assert j in listed or not cells.any(), (tile, j)
                assert j not in listed or listed[j] or cells.all(), (tile, j)


def compare(name, kv_lens, q_lens, block_n, block_q, splits, seed=0):
    p = PROGRAMS[name]
    kv_lens = np.asarray(kv_lens, np.int64)
    tensors = tensors_for(p, kv_lens, seed)
    general = decode_blocks(p, kv_lens, tensors, block_n, splits, q_lens, block_q, route="general")
    auto = decode_blocks(p, kv_lens, tensors, block_n, splits, q_lens, block_q)
    q = np.ones(len(kv_lens), np.int64) if q_lens is None else np.asarray(q_lens)
    if general_is_exact(p, kv_lens, q, tensors):
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(auto, f), getattr(general, f), err_msg=f"{name} {f}")
        assert auto.skipped == general.skipped
    else:  # the rows' lists are exact (the oracle's cells), the general route's only safe
        try:
            decode_blocks(p, kv_lens, tensors, block_n, splits, q_lens, block_q, route="rows")
            rows = True
        except PlanError:
            rows = False
        check_against_oracle(p, auto, kv_lens, q, tensors, block_n, block_q, exact=rows)
        check_against_oracle(p, general, kv_lens, q, tensors, block_n, block_q, exact=False)


lengths = st.lists(st.integers(1, 300), min_size=1, max_size=5)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv=lengths, block_n=st.sampled_from([4, 16, 64]), splits=st.integers(1, 4), seed=st.integers(0, 3))
def test_decode_rows_match_the_general_route(name, kv, block_n, splits, seed):
    compare(name, kv, None, block_n, 1, splits, seed)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_n=st.sampled_from([4, 16]), block_q=st.sampled_from([1, 4, 16]))
def test_mixed_rows_match_the_general_route(name, data, block_n, block_q):
    kv = data.draw(st.lists(st.integers(0, 120), min_size=1, max_size=4))
    q = [data.draw(st.integers(0, t)) for t in kv]
    compare(name, kv, q, block_n, block_q, 2)


def test_requests_without_keys_or_rows():
    """T = 0 with decode's default row (an empty tile), q_len = 0 (no tile)."""
    for name in ("causal", "sink_window", "causal_document"):
        compare(name, [0, 9, 0, 40], None, 4, 1, 2)
        compare(name, [5, 9, 0, 40], [0, 1, 0, 1], 4, 1, 2)


def test_which_route_serves_a_call():
    kv = np.array([50, 7, 130])
    # tensor-free masks: the cached position runs (one run: the decode table; sink + window: two)
    for name in ("causal", "sliding_window_causal", "full", "sink_window", "chunked", "prefix_lm"):
        p = PROGRAMS[name]
        if p.tensors:
            continue
        assert dr.cached_position_runs(p, 130) is not None, name
        decode_blocks(p, kv, {}, 16, 2, None, 1, route="rows")
        decode_blocks(p, kv, {}, 16, 2, [3, 1, 20], 4, route="rows")  # several rows per tile
    assert dr.decode_table(dr.cached_position_runs(PROGRAMS["causal"], 130), 16) is not None
    assert dr.decode_table(dr.cached_position_runs(PROGRAMS["sink_window"], 130), 16) is None
    # a mask that reads a tensor: the row slab in decode, the general route for several rows
    p = PROGRAMS["causal_document"]
    tens = tensors_for(p, kv, 0)
    assert dr.cached_position_runs(p, 130) is None
    decode_blocks(p, kv, tens, 16, 2, None, 1, route="rows")
    with pytest.raises(PlanError, match="does not apply"):
        decode_blocks(p, kv, tens, 16, 2, [3, 1, 20], 4, route="rows")


def test_position_runs_are_made_once_per_bucket():
    p = compile_spec("attention bucket_probe { heads = 2 head_dim = 8 mask = causal & window(100) }")
    a = dr.cached_position_runs(p, 10)
    assert a.length == dr.MIN_POSITIONS and dr.cached_position_runs(p, dr.MIN_POSITIONS) is a
    b = dr.cached_position_runs(p, dr.MIN_POSITIONS + 1)  # the next power of two
    assert b.length == 2 * dr.MIN_POSITIONS and dr.cached_position_runs(p, 5) is b
    # an equal spec compiled again shares the entry
    again = compile_spec("attention bucket_probe { heads = 2 head_dim = 8 mask = causal & window(100) }")
    assert dr.cached_position_runs(again, 5) is b
    # the runs themselves: row q sees keys [q - 99, q + 1)
    q = np.arange(b.length)
    np.testing.assert_array_equal(b.start[0, :, 0], np.maximum(q - 99, 0))
    np.testing.assert_array_equal(b.end[0, :, 0], q + 1)


def test_slab_reads_tensors_as_the_interpreter():
    """An out-of-range tensor read in the slab is the general route's PlanError (same words)."""
    p = PROGRAMS["causal_document"]
    kv = np.array([20, 30])
    short = {"doc": np.zeros((2, 10), np.int64)}
    with pytest.raises(PlanError, match="read out of range") as got:
        decode_blocks(p, kv, short, 8, 1)
    with pytest.raises(PlanError) as want:
        decode_blocks(p, kv, short, 8, 1, route="general")
    assert str(got.value) == str(want.value)
