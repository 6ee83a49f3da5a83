"""The Triton kernels on one block of a larger call (context parallelism, issue 19), in the CPU
interpreter unless ATTNC_TEST_GPU=1: the forward block at its absolute positions against the
float64 oracle at the same offsets, and the backward blocks of a 2 x 2 cut of the call (given the
whole call's O and LSE) summed into dQ, dK, dV against the float64 reference backward of the whole
call.  The CP plan's tiles are smaller than the interpreter's (8 vs 16: the block plan is
coarsened) and larger (32: refined), so both directions of ``blocks.regrid`` run."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.triton import runtime  # noqa: E402
from attnc.backends.triton.blocks import regrid  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP  # noqa: E402
from attnc.compiler.cp import plan_cp  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402
from tests.numerics.test_triton_backward import _small, _torch_call  # noqa: E402

CASES = (("causal", 8), ("sliding_window_causal", 8), ("causal_document_gqa", 32), ("softcap", 8),
         ("alibi", 32), ("prefix_lm_document", 8), ("sink_attention", 8))
BATCH, SEQ = 1, 56


def _setup(stem: str, block: int):
    program = _small(compile_file(next(p for p in EXAMPLES if p.stem == stem)))
    kernel = runtime.load(program)
    arrays = inputs.sample(program, BATCH, SEQ, SEQ, seed=11)
    q, k, v, tensors = _torch_call(kernel, arrays)
    bhsd = {n: (x.transpose(1, 2) if program.cache.layout.value == "bshd" else x) for n, x in zip("qkv", (q, k, v))}
    host = {n: t.cpu().numpy() for n, t in tensors.items()}
    cp = plan_cp(program, BATCH, SEQ, 2, host, block=block, strategy="even")
    return program, kernel, bhsd, tensors, cp


def _f64(t):
    return t.detach().double().cpu().numpy()


def test_regrid_is_conservative_and_exact_on_aligned_tiles():
    c = np.array([[[[FULL, PARTIAL, SKIP, FULL], [SKIP, SKIP, FULL, FULL]]]], np.int8)  # [1, 1, 2, 4] on 8
    coarse = regrid(c, 8, 30, 16, 3)  # 30 keys: tiles [0, 16) and [16, 30)
    assert coarse.tolist() == [[[[PARTIAL, PARTIAL], [SKIP, FULL]]]]
    fine = regrid(c, 8, 30, 4, 3)  # each 8-tile's class, twice, cut at 30 keys
    assert fine.shape[3] == 8 and fine[0, 0, 0].tolist() == [FULL, FULL, PARTIAL, PARTIAL, SKIP, SKIP, FULL, FULL]


@pytest.mark.parametrize("stem,block", CASES)
def test_triton_blocks_forward_and_backward(stem, block):
    program, kernel, bhsd, tensors, cp = _setup(stem, block)
    tiles = cp.tiles
    cuts = [(0, tiles // 2), (tiles // 2, tiles)]
    host = {n: t.cpu().numpy() for n, t in tensors.items()}
    q64, k64, v64 = (_f64(bhsd[n]) for n in "qkv")
    o_all, lse_all = oracle.reference(program, q64, k64, v64, host)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o_all.shape, generator=gen, dtype=torch.float64)
    do = do.to(bhsd["q"].dtype).to(bhsd["q"].device)  # dO as training gives it: the storage dtype
    dq, dk, dv = (np.zeros(x.shape) for x in (q64, k64, v64))
    lengths = (SEQ, SEQ)
    checked = 0
    for rows in cuts:
        for keys in cuts:
            args = cp.block_args(rows, keys)
            if args is None:
                continue
            (q0, q1), (k0, k1) = cp.tile_range(*rows), cp.tile_range(*keys)
            qb, kb, vb = bhsd["q"][:, :, q0:q1], bhsd["k"][:, :, k0:k1], bhsd["v"][:, :, k0:k1]
            o, lse = kernel.block(qb, kb, vb, args, tensors, lengths)
            assert o.dtype == torch.float32  # a partial state, not rounded to the storage dtype
            want_o, want_lse = oracle.reference(program, q64[:, :, q0:q1], k64[:, :, k0:k1], v64[:, :, k0:k1],
                                                host, q_offset=q0, k_offset=k0, sink=False)  # (partial states)
            for c in numerics.compare_outputs("f32" if program.dtype == "f32" else program.dtype, _f64(o),
                                              _f64(lse), want_o, want_lse):
                assert c.ok, f"{stem} rows {rows} keys {keys}: {c}"
            o_rows = torch.as_tensor(o_all[:, :, q0:q1], dtype=torch.float32, device=qb.device)
            lse_rows = torch.as_tensor(lse_all[:, :, q0:q1], dtype=torch.float32, device=qb.device)
            g = kernel.block_backward(qb, kb, vb, o_rows, lse_rows, do[:, :, q0:q1], None, args, tensors, lengths)
            assert all(x.dtype == torch.float32 for x in g)
            dq[:, :, q0:q1] += _f64(g[0])
            dk[:, :, k0:k1] += _f64(g[1])
            dv[:, :, k0:k1] += _f64(g[2])
            checked += 1
    assert checked >= 2
    want = oracle.reference_backward(program, q64, k64, v64, _f64(do), host)
    for name, got, ref in zip(("dQ", "dK", "dV"), (dq, dk, dv), want[:3]):
        c = numerics.compare_gradient(name, program.dtype, got, ref)
        assert c.ok, f"{stem}: {c}"
