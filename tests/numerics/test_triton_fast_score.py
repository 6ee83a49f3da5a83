"""Score programs' fast forms on the Triton kernels (CPU interpreter unless ATTNC_TEST_GPU=1):
``score_program_fast`` is ``score_program`` bit for bit on positions below FAST_POSITIONS, and a
call whose positions reach it runs the exact form (a block of a larger call at those positions,
forward and backward, against the float64 oracle)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
triton = pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")
import triton.language as tl  # noqa: E402

from attnc.backends.triton import grad as G, launch, runtime  # noqa: E402
from attnc.backends.triton.lang import _f32_small  # noqa: E402
from attnc.compiler import fast_score, inputs, numerics, oracle  # noqa: E402
from attnc.compiler.analysis.tiles import PARTIAL  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402
from tests.numerics.test_triton_backward import _small, _torch_call  # noqa: E402

LIMIT = fast_score.FAST_POSITIONS
SCORES = ["score - exp(-(h + 1) * log(2.0)) * (q - k)", "score + 0.5 * (q - k + 5)",
          "score - 0.25 * abs(q - k) + min(k - q, 7)", "score + where(q > k + 3, q, k) * 0.001 - (q // 64 - k // 64)"]


@triton.jit
def _scores(OUT, QP, KP, SP, H, TS, SCORE: tl.constexpr, R: tl.constexpr, N: tl.constexpr):
    """SCORE on an R x N tile of scores SP at row positions QP [R] and key positions KP [N]."""
    rows, cols = tl.arange(0, R)[:, None], tl.arange(0, N)[None, :]
    s = SCORE(tl.load(SP + rows * N + cols), 0, H, tl.load(QP + tl.arange(0, R))[:, None],
              tl.load(KP + tl.arange(0, N))[None, :], TS)
    tl.store(OUT + rows * N + cols, s)


@triton.jit
def _convert(OUT, XP, N: tl.constexpr):
    x = tl.load(XP + tl.arange(0, N))
    tl.store(OUT + tl.arange(0, N), _f32_small(x))


def _device():
    return "cpu" if runtime.interpreted() else "cuda"


def test_small_integers_convert_exactly_by_addition():
    x = np.array([0, 1, 2, 3, 7, 1000, 2**20 + 1, 2**22 - 1, 2**22, LIMIT - 3, LIMIT - 2, LIMIT - 1, 12345, 999999,
                  2**21 + 7, 5], np.int32)
    xs = torch.as_tensor(x, device=_device())
    out = torch.empty(x.size, dtype=torch.float32, device=_device())
    _convert[(1,)](out, xs, x.size)
    assert np.array_equal(out.cpu().numpy(), x.astype(np.float32))


@pytest.mark.parametrize("score", SCORES)
def test_fast_and_exact_score_functions_agree_bit_for_bit(score):
    program = compile_spec(f"attention a {{ heads = 4 head_dim = 16 dtype = f32 score = {score} mask = causal }}")
    module = runtime.load(program).module
    assert module.score_program_fast is not module.score_program  # each of these has a fast form
    rng = np.random.default_rng(3)
    edges = [0, 1, 2, 63, 64, 2**22, LIMIT - 65, LIMIT - 3, LIMIT - 2, LIMIT - 1]
    q = np.concatenate([edges, rng.integers(0, LIMIT, 6)]).astype(np.int32)
    k = np.concatenate([edges[::-1], rng.integers(0, LIMIT, 6)]).astype(np.int32)
    s = (rng.standard_normal((q.size, k.size)) * 4).astype(np.float32)
    dev = _device()
    qs, ks, ss = (torch.as_tensor(a, device=dev) for a in (q, k, s))
    for h in (0, 3):
        got = {}
        for name in ("score_program", "score_program_fast"):
            out = torch.empty_like(ss)
            _scores[(1,)](out, qs, ks, ss, h, (), SCORE=getattr(module, name), R=q.size, N=k.size)
            got[name] = out.cpu().numpy()
        assert np.array_equal(got["score_program"].view(np.uint32), got["score_program_fast"].view(np.uint32)), score


def _block(kernel, q_offset: int, k_offset: int, rows: int = 16, keys: int = 32):
    """Forward and backward of one block of a larger alibi call at positions [q_offset, +rows) x
    [k_offset, +keys) against the float64 oracle at those positions; returns its launches."""
    program = kernel.program
    arrays = inputs.sample(program, 1, rows, keys, seed=5)
    q, k, v, tensors = _torch_call(kernel, arrays)
    bm, bn = 16, 16
    args = {"classes": np.full((1, 1, -(-rows // bm), -(-keys // bn)), PARTIAL, np.int8), "block_m": bm,
            "block_n": bn, "q_offset": q_offset, "k_offset": k_offset}
    end = launch.position_end(rows, keys, (q_offset, k_offset))
    lengths = (end, end)
    o, lse = kernel.block(q, k, v, args, tensors, lengths)
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    want_o, want_lse = oracle.reference(program, q64, k64, v64, q_offset=q_offset, k_offset=k_offset)
    for c in numerics.compare_outputs(program.dtype, o.double().cpu().numpy(), lse.cpu().numpy(), want_o, want_lse):
        assert c.ok, f"block at ({q_offset}, {k_offset}): {c}"
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o_rows = torch.as_tensor(want_o, dtype=torch.float32, device=q.device)
    lse_rows = torch.as_tensor(want_lse, dtype=torch.float32, device=q.device)
    grads = kernel.block_backward(q, k, v, o_rows, lse_rows, do.to(q.dtype).to(q.device), None, args, tensors, lengths)
    want = oracle.reference_backward(program, q64, k64, v64, do.to(q.dtype).double().numpy(), q_offset=q_offset,
                                     k_offset=k_offset)
    for name, got, ref in zip(("dQ", "dK", "dV"), grads, want[:3]):
        c = numerics.compare_gradient(name, program.dtype, got.double().cpu().numpy(), ref)
        assert c.ok, f"block at ({q_offset}, {k_offset}): {c}"
    return args["_triton"].values()


def test_blocks_below_the_limit_run_the_fast_form_and_those_reaching_it_the_exact_one():
    """ALiBi in a block of a larger call: rows and keys ending at the limit take the fast form; a
    block whose positions cross it takes the exact one (the fast form's positions would be off by
    up to 8 there: the oracle would see it)."""
    kernel = runtime.load(_small(compile_file(next(p for p in EXAMPLES if p.stem == "alibi"))))
    module = kernel.module
    for (q_off, k_off), fast in (((LIMIT - 16, LIMIT - 32), True), ((LIMIT - 8, LIMIT - 24), False),
                                 ((2**24, 2**24 - 16), False)):
        launches = list(_block(kernel, q_off, k_off))
        forward = next(x for x in launches if isinstance(x, launch.PrefillLaunch))
        backward = next(x for x in launches if isinstance(x, G.BackwardLaunch))
        assert forward.launcher.constexprs["SCORE"] is (module.score_program_fast if fast else module.score_program)
        assert backward.passes[0][0].constexprs["SCORE_GRAD"] is (module.score_grad_fast if fast else
                                                                   module.score_grad)
