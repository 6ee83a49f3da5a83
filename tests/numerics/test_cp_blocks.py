"""Context parallelism's arithmetic in one process (issue 19): the numpy program's blocks at
position offsets against the float64 oracle at the same offsets, and every rank of a plan
simulated (its messages cut from the whole call's K/V) against the single-process call, for every
example (score programs, tensors, per-head masks, bshd).  tests/integrations/test_distributed.py
runs the same ranks as gloo processes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attnc.distributed runs on torch")

import attnc  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.cp import plan_cp  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402
from attnc.distributed import _NumpyBlocks, _ReferenceBlocks, rank_attention  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

BATCH, SEQ, BLOCK = 2, 44, 8


def _call(path):
    program = inputs.contiguous_variant(compile_file(path))
    arrays = inputs.sample(program, BATCH, SEQ, SEQ, seed=3)
    tensors = {t.name: arrays[t.name] for t in program.tensors}
    bhsd = {n: inputs.output_bhsd(program, arrays[n]) for n in ("q", "k", "v")}
    return program, arrays, tensors, bhsd


def simulate(program, cp, bhsd, blocks, cast):
    """Every rank of ``cp`` in turn; a rank's messages are the whole call's K/V of its runs."""
    o = np.zeros((BATCH, program.heads_q, SEQ, program.d_v), cast)
    lse = np.zeros((BATCH, program.heads_q, SEQ), cast)
    for r in range(cp.ranks):
        pos = cp.positions(r)

        def fetch(src, r=r):
            idx = np.concatenate([np.arange(*cp.tile_range(a, b)) for s, a, b in cp.runs(r) if s == src])
            return bhsd["k"][:, :, idx].astype(cast), bhsd["v"][:, :, idx].astype(cast)

        o_r, lse_r = rank_attention(cp, r, blocks, *(bhsd[n][:, :, pos].astype(cast) for n in "qkv"), fetch)
        o[:, :, pos], lse[:, :, pos] = blocks.output(o_r), lse_r
    return o, lse


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_blocks_at_offsets_match_the_oracle(path):
    program, arrays, tensors, bhsd = _call(path)
    cp = plan_cp(program, BATCH, SEQ, 2, tensors, block=BLOCK, strategy="even")
    kernel = attnc.Attention(program).kernel("numpy", program)
    checked = 0
    for rows, keys in (((1, 3), (0, 2)), ((4, 6), (2, 5)), ((0, 6), (0, 6)), ((2, 3), (3, 6))):
        args = cp.block_args(rows, keys)
        if args is None:
            continue
        (q0, q1), (k0, k1) = cp.tile_range(*rows), cp.tile_range(*keys)
        blk = {n: bhsd[n][:, :, a:b] for n, (a, b) in (("q", (q0, q1)), ("k", (k0, k1)), ("v", (k0, k1)))}
        layout = {n: (x.transpose(0, 2, 1, 3) if program.cache.layout.value == "bshd" else x) for n, x in blk.items()}
        o, lse = kernel.block(layout["q"], layout["k"], layout["v"], args, cp.tensors)
        want_o, want_lse = oracle.reference(program, *(blk[n] for n in "qkv"), cp.tensors, q_offset=q0, k_offset=k0)
        assert o.dtype == np.float32  # a partial state, not rounded to the storage dtype
        for c in numerics.compare_outputs("f32", inputs.output_bhsd(program, o), lse, want_o, want_lse):
            assert c.ok, f"{path.stem} rows {rows} keys {keys}: {c}"
        checked += 1
    assert checked


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_simulated_ranks_match_the_single_process_call(path):
    program, arrays, tensors, bhsd = _call(path)
    attn = attnc.Attention(program)
    ref_o, ref_lse = attn.kernel("numpy", program)(arrays["q"], arrays["k"], arrays["v"], return_lse=True, **tensors)
    ref_o = inputs.output_bhsd(program, ref_o)
    want_o, want_lse = oracle.reference(program, *(bhsd[n] for n in "qkv"), tensors)
    for ranks, strategy in ((3, "auto"), (4, "zigzag")):
        cp = plan_cp(program, BATCH, SEQ, ranks, tensors, block=BLOCK, strategy=strategy)
        o, lse = simulate(program, cp, bhsd, _NumpyBlocks(attn, cp), np.float32)
        for c in numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse):
            assert c.ok, f"{path.stem} over {ranks} ({cp.strategy}): {c}"
        o64, lse64 = simulate(program, cp, bhsd, _ReferenceBlocks(cp), np.float64)
        assert np.abs(o64 - want_o).max() <= 1e-12
        assert np.array_equal(np.isinf(lse64), np.isinf(want_lse))
        assert np.abs(np.where(np.isfinite(want_lse), lse64 - want_lse, 0)).max() <= 1e-12
