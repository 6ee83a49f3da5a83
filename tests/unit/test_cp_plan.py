"""The context-parallel planner (compiler/cp.py, compiler/analysis/partition.py, issue 19): owners, computed cells and K/V traffic
against brute force over the tile classes; each strategy's shape; auto's choice; refusals."""
from __future__ import annotations

import numpy as np
import pytest

from attnc.compiler.analysis.tiles import SKIP
from attnc.compiler.analysis.partition import balanced_owner, cut_crossings, even_owner, zigzag_owner
from attnc.compiler.cp import plan_cp, tile_costs
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.lower import compile_spec

CAUSAL = "attention c { heads = 4 / 2 head_dim = 8 dtype = bf16 mask = causal }"
WINDOW = "attention w { heads = 2 head_dim = 8 dtype = f32 mask = causal & window(24) }"
DOCS = "attention d { heads = 2 head_dim = 8 dtype = f32 tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"
PREFIX = "attention p { heads = 2 head_dim = 8 dtype = f32 mask = causal | k < 40 }"
EVICT = ("attention e { heads = 2 head_dim = 8 dtype = f32 tensor ev: i32[h, s] "
         "mask = causal & q < ev[h, k] }")


def _program(text):
    return compile_spec(text, "<test>")


def _brute(cp):
    """Computed cells, needed key tiles and traffic of cp's owners, straight from the classes."""
    b_, h_ = cp.classes.shape[:2]
    p = cp.program
    lens = np.array([cp.tile_tokens(t, t + 1) for t in range(cp.tiles)])
    area = np.outer(lens, lens) * (cp.classes != SKIP)  # [B', H', T, T]
    mult = (cp.batch if b_ == 1 else 1) * (p.heads_q if h_ == 1 else 1)
    work = np.array([area[:, :, cp.owner == r].sum() * mult for r in range(cp.ranks)])
    needed = (cp.classes != SKIP).any(axis=(0, 1))
    need = np.array([needed[cp.owner == r].any(axis=0) for r in range(cp.ranks)]).reshape(cp.ranks, cp.tiles)
    traffic = np.zeros((cp.ranks, cp.ranks), np.int64)
    for r in range(cp.ranks):
        for j in np.flatnonzero(need[r]):
            if cp.owner[j] != r:
                traffic[cp.owner[j], r] += lens[j]
    return work, need, traffic


def _docs(batch, seq, lengths):
    doc = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        doc[b] = np.repeat(np.arange(len(lengths)), lengths)[:seq]
    return doc


@pytest.mark.parametrize("text,seq,block,ranks", [(CAUSAL, 100, 8, 3), (WINDOW, 96, 8, 4), (PREFIX, 77, 8, 5),
                                                  (DOCS, 64, 8, 4), (EVICT, 50, 8, 2)])
@pytest.mark.parametrize("strategy", ["even", "zigzag", "balanced"])
def test_costs_and_traffic_match_brute_force(text, seq, block, ranks, strategy):
    program = _program(text)
    rng = np.random.default_rng(0)
    tensors = {}
    if "doc" in text:
        tensors["doc"] = _docs(2, seq, [5, 11, 20, 9, 19])
    if "ev" in text:
        tensors["ev"] = rng.integers(0, seq + 1, (program.heads_q, seq)).astype(np.int32)
    cp = plan_cp(program, 2, seq, ranks, tensors, block=block, strategy=strategy)
    work, need, traffic = _brute(cp)
    assert cp.strategy == strategy
    np.testing.assert_array_equal(cp.work, work)
    np.testing.assert_array_equal(cp.chosen.need, need)
    np.testing.assert_array_equal(cp.chosen.traffic, traffic)
    assert cp.tokens.sum() == seq and sorted(np.concatenate([cp.positions(r) for r in range(ranks)])) == list(range(seq))
    assert cp.recv_bytes.sum() == cp.send_bytes.sum() == cp.report()["total_bytes"]
    per_token = 2 * program.heads_kv * (program.d_qk + program.d_v) * {"f32": 4, "bf16": 2}[program.dtype]
    assert cp.kv_bytes_per_token == per_token
    # every rank's runs cover exactly the key tiles it needs, each run inside one owner's tiles
    for r in range(ranks):
        covered = np.zeros(cp.tiles, bool)
        for src, a, b in cp.runs(r):
            assert (cp.owner[a:b] == src).all() and not covered[a:b].any()
            covered[a:b] = True
        np.testing.assert_array_equal(covered, need[r])
        for dst, runs in cp.sends(r).items():
            assert [(a, b) for s, a, b in cp.runs(dst) if s == r] == runs


def test_strategy_owners():
    np.testing.assert_array_equal(even_owner(10, 4), [0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(zigzag_owner(8, 2), [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(zigzag_owner(4, 2), [0, 1, 1, 0])
    assert set(even_owner(3, 4)) == {1, 2, 3}  # fewer tiles than ranks: a rank owns nothing
    # balanced: equal work where the tiles allow it, and a cut moves to a free boundary within the slack
    np.testing.assert_array_equal(balanced_owner(np.ones(8), np.zeros(9), 2), [0] * 4 + [1] * 4)
    crossing = np.full(9, 5)
    crossing[5] = 0
    np.testing.assert_array_equal(balanced_owner(np.ones(8), crossing, 2, slack=0.3), [0] * 5 + [1] * 3)
    np.testing.assert_array_equal(balanced_owner(np.ones(8), crossing, 2, slack=0.0), [0] * 4 + [1] * 4)
    np.testing.assert_array_equal(balanced_owner(np.zeros(6), np.zeros(7), 3), even_owner(6, 3))


@pytest.mark.parametrize("seed", range(6))
def test_balanced_owner_has_the_least_worst_crossing_under_the_cap(seed):
    """Against every partition of 9 tiles into 3 non-empty contiguous ranges."""
    import itertools
    rng = np.random.default_rng(seed)
    work = rng.integers(0, 20, 9).astype(float)
    crossing = np.concatenate([[0], rng.integers(0, 4, 8), [0]])
    slack = 0.2
    parts = [(a, b) for a, b in itertools.combinations(range(1, 9), 2)]
    load = lambda a, b: max(work[:a].sum(), work[a:b].sum(), work[b:].sum())  # noqa: E731
    best = min(load(a, b) for a, b in parts)
    fits = [(a, b) for a, b in parts if load(a, b) <= best * (1 + slack)]
    worst = min(max(crossing[a], crossing[b]) for a, b in fits)
    dev = lambda a, b: abs(work[:a].sum() - work.sum() / 3) + abs(work[:b].sum() - 2 * work.sum() / 3)  # noqa: E731
    closest = min(dev(a, b) for a, b in fits if max(crossing[a], crossing[b]) == worst)
    owner = balanced_owner(work, crossing, 3, slack)
    a, b = (int(np.flatnonzero(owner == r)[0]) for r in (1, 2))
    assert load(a, b) <= best * (1 + slack) + 1e-9
    assert max(crossing[a], crossing[b]) == worst and dev(a, b) == pytest.approx(closest)


def test_cut_crossings_match_brute_force():
    rng = np.random.default_rng(3)
    needed = rng.random((12, 12)) < 0.2
    got = cut_crossings(needed)
    for t in range(13):
        left = {j for j in range(t) if needed[t:, j].any()}
        right = {j for j in range(t, 12) if needed[:t, j].any()}
        assert got[t] == len(left) + len(right), t


def test_causal_pairs_zigzag_and_is_balanced():
    cp = plan_cp(_program(CAUSAL), 1, 4096, 8, block=128)
    assert cp.strategy == "zigzag" and cp.imbalance < 1.01 and cp.chosen.token_imbalance == 1.0
    assert cp.candidates["even"].imbalance > 1.8
    assert [len(cp.segments(r)) for r in range(8)] == [2] * 7 + [1]  # the two middle chunks are adjacent


def test_windows_receive_from_the_left_neighbour_only():
    cp = plan_cp(_program(WINDOW), 1, 1024, 4, block=16)
    assert cp.strategy in ("even", "balanced") and cp.imbalance < 1.02
    for r in range(4):
        assert cp.report()["peers"][r] == ([] if r == 0 else [r - 1])
        assert cp.recv_bytes[r] == (0 if r == 0 else 32 * cp.kv_bytes_per_token)  # 24 keys -> 2 tiles of 16


def test_document_aware_cuts_move_no_kv():
    """Documents on tile boundaries: the balanced cuts land on them and nothing crosses."""
    lengths = [64, 64, 32, 160, 192, 128, 128, 160, 96]  # multiples of the block
    doc = _docs(1, 1024, lengths)
    cp = plan_cp(_program(DOCS), 1, 1024, 4, {"doc": doc}, block=32, strategy="auto", slack=0.05)
    assert cp.strategy == "balanced" and cp.report()["total_bytes"] == 0 and cp.imbalance < 1.05
    assert cp.candidates["even"].imbalance > 1.4
    starts = set(np.cumsum([0] + lengths))
    assert all(a in starts for r in range(4) for a, _ in cp.token_ranges(r))
    assert cp.candidates["even"].traffic.sum() > 0


def test_block_args_place_the_block():
    cp = plan_cp(_program(CAUSAL), 1, 40, 2, block=8, strategy="even")
    args = cp.block_args((3, 5), (0, 2))
    assert (args["q_offset"], args["k_offset"], args["q_tiles"], args["partial_state"]) == (24, 0, 2, True)
    assert args["full_indptr"][-1] == 4 and args["partial_indptr"][-1] == 0  # rows 24..39 see keys 0..15 whole
    assert cp.block_args((0, 1), (3, 5)) is None  # above the diagonal: all SKIP


def test_tile_costs_are_reused_and_checked():
    program = _program(CAUSAL)
    costs = tile_costs(program, 1, 256, block=16)
    a = plan_cp(program, 1, 256, 4, costs=costs)
    b = plan_cp(program, 1, 256, 4, block=16)
    np.testing.assert_array_equal(a.owner, b.owner)
    with pytest.raises(PlanError, match="another spec or call shape"):
        plan_cp(program, 1, 128, 4, costs=costs)


def test_refusals_name_the_problem():
    program = _program(CAUSAL)
    with pytest.raises(InputError, match="strategy 'ring'"):
        plan_cp(program, 1, 64, 2, strategy="ring")
    with pytest.raises(InputError, match="ranks >= 1"):
        plan_cp(program, 1, 64, 0)
    with pytest.raises(InputError, match="paged K/V cache"):
        plan_cp(_program("attention g { heads = 2 head_dim = 8 cache = paged(page_size = 16) mask = causal }"),
                1, 64, 2)
    with pytest.raises(InputError, match="missing tensor 'doc'"):
        plan_cp(_program(DOCS), 1, 64, 2)
    with pytest.raises(InputError, match="tensor 'doc' has shape"):
        plan_cp(_program(DOCS), 1, 64, 2, {"doc": np.zeros((1, 32), np.int32)})
    with pytest.raises(PlanError, match=r"tile pairs \(more than .*use a block of at least 32"):
        plan_cp(program, 1, 1 << 20, 2, block=16)


def test_text_report_lists_every_rank():
    cp = plan_cp(_program(PREFIX), 1, 200, 3, block=8)
    text = cp.text()
    assert f"strategy {cp.strategy} (auto)" in text and text.count("\n") == 3 + 3 + 2
    assert "imbalance (max/mean computed cells)" in text
