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
from attnc.backends.numpy.state import OutputState, merge_output_state  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from attnc.backends.numpy.cp_blocks import NumpyBlocks as _NumpyBlocks  # noqa: E402
from attnc.distributed import _ReferenceBlocks, merge_states, rank_attention, rank_attention_backward  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

BATCH, SEQ, BLOCK = 2, 44, 8


def _call(path):
    program = inputs.contiguous_variant(compile_file(path))
    arrays = inputs.sample(program, BATCH, SEQ, SEQ, seed=3)
    tensors = {t.name: arrays[t.name] for t in program.tensors}
    bhsd = {n: inputs.output_bhsd(program, arrays[n]) for n in ("q", "k", "v")}
    return program, arrays, tensors, bhsd


def simulate(program, cp, bhsd, blocks):
    """Every rank of ``cp`` in turn; a rank's messages are the whole call's K/V of its runs.
    Returns O (``blocks.output``: the call's dtype) and LSE as float64 numpy arrays."""
    o = np.zeros((BATCH, program.heads_q, SEQ, program.d_v))
    lse = np.zeros((BATCH, program.heads_q, SEQ))
    whole = {n: torch.from_numpy(np.ascontiguousarray(bhsd[n])) for n in "qkv"}
    for r in range(cp.ranks):
        pos = torch.from_numpy(cp.positions(r))

        def fetch(src, r=r):
            idx = torch.from_numpy(np.concatenate([np.arange(*cp.tile_range(a, b)) for s, a, b in cp.runs(r)
                                                   if s == src]))
            return blocks.prepare(whole["k"][:, :, idx]), blocks.prepare(whole["v"][:, :, idx])

        o_r, lse_r = rank_attention(cp, r, blocks, *(blocks.prepare(whole[n][:, :, pos]) for n in "qkv"), fetch)
        o[:, :, pos.numpy()], lse[:, :, pos.numpy()] = blocks.output(o_r).double().numpy(), lse_r.double().numpy()
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
        want_o, want_lse = oracle.reference(program, *(blk[n] for n in "qkv"), cp.tensors, q_offset=q0, k_offset=k0,
                                            sink=False)  # a block's partial state: the merge adds a sink once
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
    # the reference blocks are float64 end to end: the score program too (the oracle's wide)
    want_o, want_lse = oracle.reference(program, *(bhsd[n] for n in "qkv"), tensors, wide=True)
    for ranks, strategy in ((3, "auto"), (4, "zigzag")):
        cp = plan_cp(program, BATCH, SEQ, ranks, tensors, block=BLOCK, strategy=strategy)
        o, lse = simulate(program, cp, bhsd, _NumpyBlocks(attn, cp))
        for c in numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse):
            assert c.ok, f"{path.stem} over {ranks} ({cp.strategy}): {c}"
        o64, lse64 = simulate(program, cp, bhsd, _ReferenceBlocks(cp))
        assert np.abs(o64 - want_o).max() <= 1e-12
        assert np.array_equal(np.isinf(lse64), np.isinf(want_lse))
        assert np.abs(np.where(np.isfinite(want_lse), lse64 - want_lse, 0)).max() <= 1e-12


def simulate_backward(program, cp, bhsd, blocks, o, lse, do, dlse):
    """Every rank's backward in turn (``rank_attention_backward``) from the whole call's O, LSE
    (the simulated forward's), dO and dLSE; each rank's shares of other ranks' keys go to their
    positions, as the reversed messages deliver them.  Returns dQ, dK, dV as float64 numpy."""
    whole = {n: torch.from_numpy(np.ascontiguousarray(x)) for n, x in
             (*((n, bhsd[n]) for n in "qkv"), ("o", o), ("lse", lse), ("do", do), ("dlse", dlse))}
    grads = {n: torch.zeros(whole[n].shape, dtype=torch.float64) for n in "qkv"}
    for r in range(cp.ranks):
        pos = torch.from_numpy(cp.positions(r))

        def keys(src, r=r):
            return torch.from_numpy(np.concatenate([np.arange(*cp.tile_range(a, b)) for s, a, b in cp.runs(r)
                                                    if s == src]))

        def fetch(src):
            return blocks.prepare(whole["k"][:, :, keys(src)]), blocks.prepare(whole["v"][:, :, keys(src)])

        shard = [blocks.prepare(whole[n][:, :, pos]) for n in ("q", "k", "v", "o", "lse", "do", "dlse")]
        dq, dk, dv, remote = rank_attention_backward(cp, r, blocks, *shard, fetch)
        assert dq.dtype == dk.dtype == blocks.acc and r not in remote
        for n, g in (("q", dq), ("k", dk), ("v", dv)):
            grads[n][:, :, pos] += g.double()
        for src, (gk, gv) in remote.items():
            grads["k"][:, :, keys(src)] += gk.double()
            grads["v"][:, :, keys(src)] += gv.double()
    return [grads[n].numpy() for n in "qkv"]


def _backward_case(program, tensors, bhsd, ranks, strategy, seed=5):
    attn = attnc.Attention(program)
    rng = np.random.default_rng(seed)
    do = rng.standard_normal((BATCH, program.heads_q, SEQ, program.d_v))
    dlse = rng.standard_normal((BATCH, program.heads_q, SEQ))
    cp = plan_cp(program, BATCH, SEQ, ranks, tensors, block=BLOCK, strategy=strategy)
    want = oracle.reference_backward(program, *(bhsd[n] for n in "qkv"), do, tensors, dlse=dlse)[:3]
    # float64 reference blocks: the float64 oracle's gradients within 1e-10
    ref = _ReferenceBlocks(cp)
    o64, lse64 = simulate(program, cp, bhsd, ref)
    got = simulate_backward(program, cp, bhsd, ref, o64, lse64, do, dlse)
    for n, g, w in zip("qkv", got, want):
        assert np.abs(g - w).max() <= 1e-10 * max(1.0, np.abs(w).max()), f"d{n} over {ranks} ({cp.strategy})"
    # numpy blocks (float32 containers, O rounded to the storage dtype) within the gradient tolerance
    blocks = _NumpyBlocks(attn, cp)
    o, lse = simulate(program, cp, bhsd, blocks)
    got = simulate_backward(program, cp, bhsd, blocks, o, lse, do.astype(np.float32), dlse.astype(np.float32))
    for n, g, w in zip("qkv", got, want):
        c = numerics.compare_gradient(f"d{n}", program.dtype, g, w)
        assert c.ok, f"over {ranks} ({cp.strategy}): {c}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_simulated_backward_matches_the_oracle(path):
    program, arrays, tensors, bhsd = _call(path)
    _backward_case(program, tensors, bhsd, 3, "auto")


def test_blocks_use_the_whole_calls_lengths():
    """S_q and S_k in a spec mean the whole call's lengths in every block, forward and backward."""
    program = compile_spec("attention lens { heads = 2 head_dim = 8 dtype = f32 "
                           "mask = causal & q < S_q - 3 | k >= S_k - 6 }", "lens")
    arrays = inputs.sample(program, BATCH, SEQ, SEQ, seed=4)
    bhsd = {n: arrays[n] for n in "qkv"}
    attn = attnc.Attention(program)
    cp = plan_cp(program, BATCH, SEQ, 4, {}, block=BLOCK, strategy="even")
    want_o, want_lse = oracle.reference(program, *(bhsd[n] for n in "qkv"))
    o, lse = simulate(program, cp, bhsd, _NumpyBlocks(attn, cp))
    for c in numerics.compare_outputs(program.dtype, o, lse, want_o, want_lse):
        assert c.ok, c
    _backward_case(program, {}, bhsd, 4, "even")


def test_torch_merge_is_the_numpy_merge():
    rng = np.random.default_rng(0)
    shape, d = (3, 2, 17), 5

    def state(drop):
        lse = rng.standard_normal(shape) * 3
        lse[rng.random(shape) < drop] = -np.inf
        o = np.where(np.isinf(lse)[..., None], 0.0, rng.standard_normal((*shape, d)))
        return lse, o

    (la, oa), (lb, ob) = state(0.3), state(0.3)
    la[0, 0, :3] = lb[0, 0, :3] = -np.inf  # rows invalid on both sides
    oa[0, 0, :3] = ob[0, 0, :3] = 0
    la[1, 1, 4] = np.nan  # a row marked NaN (a visible NaN score) on one side
    want = merge_output_state(OutputState(la != -np.inf, la, oa), OutputState(lb != -np.inf, lb, ob))
    t = [torch.from_numpy(x) for x in (la, oa, lb, ob)]
    got = merge_states(OutputState(t[0] != -torch.inf, t[0], t[1]), OutputState(t[2] != -torch.inf, t[2], t[3]))
    assert np.array_equal(got.valid.numpy(), want.valid)
    np.testing.assert_allclose(got.lse.numpy(), want.lse, rtol=1e-15, atol=0)  # equal_nan, -inf alike
    np.testing.assert_allclose(got.o.numpy(), want.o, rtol=1e-14, atol=1e-15)
    assert torch.isnan(got.lse[1, 1, 4]) and got.o[1, 1, 4].isnan().all() and got.valid[1, 1, 4]
    assert torch.isneginf(got.lse[0, 0, :3]).all() and not got.o[0, 0, :3].any()
    f32 = merge_states(*(OutputState(x.lse.float() != -torch.inf, x.lse.float(), x.o.float()) for x in
                         (OutputState(None, t[0], t[1]), OutputState(None, t[2], t[3]))))
    assert f32.lse.dtype == torch.float32 and torch.allclose(f32.o.double(), got.o, atol=1e-5, equal_nan=True)


def test_block_args_are_cached_with_their_tile_classes():
    program = compile_spec("attention c { heads = 2 head_dim = 8 dtype = f32 mask = causal }", "c")
    cp = plan_cp(program, 1, 40, 2, {}, block=8, strategy="even")
    args = cp.block_args((2, 4), (0, 3))
    assert cp.block_args((2, 4), (0, 3)) is args and args["classes"].shape == (1, 1, 2, 3)
    assert np.array_equal(args["classes"], cp.classes[:, :, 2:4, 0:3])
    assert (args["q_offset"], args["k_offset"], args["lengths"]) == (16, 0, (40, 40))
    assert cp.block_args((0, 1), (3, 5)) is None and cp.block_args((0, 1), (3, 5)) is None
