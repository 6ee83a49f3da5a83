"""The separable form of score programs on the CPU: the generated module's ``score_scale``,
``score_row`` and ``score_column`` under Triton's interpreter (compiled on the GPU under
ATTNC_TEST_GPU=1) against its ``score_program``, and
the Gluon engine's online softmax on the form, emulated in float32 (numpy), against the float64
oracle -- with the origin, and without it, where the cancellation between the parts costs LSE
its tolerance (compiler/separable.py).  The engine itself runs on an sm_90 GPU only
(tests/numerics/test_triton_gluon.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
triton = pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")
import triton.language as tl  # noqa: E402

from attnc.backends.triton import launch, runtime  # noqa: E402
from attnc.compiler import inputs, numerics, oracle, separable  # noqa: E402
from attnc.compiler.interp import evaluate  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from tests.conftest import to_triton, triton_device  # noqa: E402

ALIBI = "score - exp(-(h + 1) * log(2.0)) * (q - k)"
SPECS = {  # score (and tensors) -> whether the column part is affine
    "alibi": ("", ALIBI, True),
    "alibi_bench": ("", "score - exp(-(h + 1) * log(2.0) * 8.0 / 16.0) * (q - k)", True),
    "key_bias": ("tensor kb: f32[b, s] ~ uniform(-2, 2)", "score + kb[b, k]", False),
    "heads_and_keys": ("tensor kb: f32[b, s] ~ uniform(-2, 2)",
                       "where(h < 2, 2.0 * score - 0.5 * (q - k + 3), score) + kb[b, k] * 0.5", False),
    "scaled": ("", "score * 0.5 + 0.25 * (k - q) + 3.0", True),
}
LENGTH = 4096  # the tensors' positions


def _program(name: str, dtype: str = "bf16", heads: str = "4 / 2"):
    tensors, score, _ = SPECS[name]
    return compile_spec(f"attention a {{ heads = {heads} head_dim = 16 dtype = {dtype} {tensors} score = {score} "
                        "mask = causal }")


@triton.jit
def _evaluate(DIRECT, PARTS, STEPS, SP, QP, KP, B, H, ORIGIN, MIDDLE, TS, SCORE: tl.constexpr,
              SCORE_SCALE: tl.constexpr, SCORE_ROW: tl.constexpr, SCORE_COLUMN: tl.constexpr, R: tl.constexpr,
              N: tl.constexpr):
    """On an R x N tile of scores SP at row positions QP and key positions KP: the score program,
    the sum of its separable parts, and the column part at MIDDLE plus at ORIGIN + k - MIDDLE."""
    rows, cols = tl.arange(0, R)[:, None], tl.arange(0, N)[None, :]
    s = tl.load(SP + rows * N + cols)
    q = tl.load(QP + tl.arange(0, R))[:, None]
    k = tl.load(KP + tl.arange(0, N))[None, :]
    tl.store(DIRECT + rows * N + cols, SCORE(s, B, H, q, k, TS))
    parts = SCORE_SCALE(B, H, TS) * s + SCORE_ROW(B, H, q, ORIGIN, TS) + SCORE_COLUMN(B, H, k, ORIGIN, TS)
    tl.store(PARTS + rows * N + cols, parts)
    steps = SCORE_COLUMN(B, H, MIDDLE, ORIGIN, TS) + SCORE_COLUMN(B, H, ORIGIN + k - MIDDLE, ORIGIN, TS)
    tl.store(STEPS + tl.arange(0, N)[None, :], steps)


@pytest.mark.parametrize("name", SPECS)
def test_the_generated_parts_add_up_to_the_score_program(name):
    program = _program(name)
    kernel = runtime.load(program)
    module = kernel.module
    assert module.SEPARABLE_POSITIONS > 0
    assert (module.SEPARABLE_BLOCK_POSITIONS > 0) == SPECS[name][2]
    rng = np.random.default_rng(5)
    arrays = inputs.sample(program, 2, LENGTH, LENGTH, seed=5)
    tensors = {t.name: to_triton(arrays[t.name]) for t in program.tensors}
    ts = launch.tensor_args(module, tensors)
    far = not program.tensors  # without tensors, positions near 2**29 (the parts read them from the origin)
    base = 2**29 if far else 1000
    q = (base + np.arange(16) * 4).astype(np.int32)  # a run of rows, its origin in the middle
    k = (base - 700 + rng.integers(0, 800, 32)).astype(np.int32)
    s = (rng.standard_normal((16, 32)) * 4).astype(np.float32)
    origin, middle = int(q[0]) + separable.ORIGIN_ROWS // 2, int(base - 300)
    for b, h in ((0, 0), (1, 3)):
        direct, parts, steps = (torch.empty(shape, dtype=torch.float32, device=triton_device())
                                for shape in ((16, 32), (16, 32), (1, 32)))
        _evaluate[(1,)](direct, parts, steps, to_triton(s), to_triton(q), to_triton(k), b, h, origin,
                        middle, ts, SCORE=module.score_program, SCORE_SCALE=module.score_scale,
                        SCORE_ROW=module.score_row, SCORE_COLUMN=module.score_column, R=16, N=32)
        direct, parts = direct.cpu().numpy().astype(np.float64), parts.cpu().numpy().astype(np.float64)
        # float32 roundings: a few units of the largest magnitude involved, per cell
        env = {"q": q[:, None], "k": k[None, :], "b": np.asarray(b), "h": np.asarray(h), "o": np.asarray(origin)}
        host = {n: np.asarray(a) for n, a in arrays.items()}
        form = separable.separable(program)
        size = sum(np.abs(np.broadcast_to(evaluate(e, env, host, wide=True), s.shape)) for e in
                   (form.row, form.column)) + np.abs(s) * 2 + np.abs(direct)
        assert (np.abs(parts - direct) <= 8 * 2.0**-24 * size).all(), (name, np.abs(parts - direct).max())
        if SPECS[name][2]:  # an affine column part steps from any key
            column = evaluate(form.column, {**env, "k": k[None, :]}, host, wide=True)
            np.testing.assert_allclose(steps.cpu().numpy(), column, rtol=0, atol=8 * 2.0**-24 * np.abs(column).max())


# ---------------------------------------------------------------- the engine's softmax, emulated
F32 = np.float32
LOG2E, LN2 = F32(math.log2(math.e)), F32(math.log(2))


def _part(e, env):
    return np.asarray(evaluate(e, env, {}), F32)  # the language's f32 arithmetic


def _emulate(program, s, v, q_pos, k_pos, origin: int, per_block: bool, block: int = 128):
    """One run of rows of the Gluon engine on the separable form (``_ws_softmax`` and the
    epilogue), in float32: s [rows, keys] the scaled-less q.k (float32), keys in blocks of
    ``block`` from k_pos[0]; causal.  Returns O and LSE."""
    form = separable.separable(program)
    env = {"b": np.asarray(0), "h": np.asarray(0), "o": np.asarray(origin)}
    sep_scale = F32(F32(_part(form.scale, env) * F32(program.scale)) * LOG2E)
    steps = F32(_part(form.column, {**env, "k": origin - block // 2 + np.arange(block)}) * LOG2E)
    rows = s.shape[0]
    m, l_sum, acc = np.full(rows, -np.inf, F32), np.zeros(rows, F32), np.zeros((rows, v.shape[1]), F32)
    for start in range(0, s.shape[1], block):
        keys = k_pos[start:start + block]
        if per_block:
            shift = F32(_part(form.column, {**env, "k": np.asarray(k_pos[0] + start + block // 2)}) * LOG2E)
            y = F32(s[:, start:start + block] * sep_scale) + steps[:keys.size]
        else:
            shift = F32(0)
            y = F32(s[:, start:start + block] * sep_scale) + F32(_part(form.column, {**env, "k": keys}) * LOG2E)
        y = np.where(keys[None, :] <= q_pos[:, None], y, -np.inf).astype(F32)
        m_new = np.maximum(m, y.max(1) + shift)
        m_new = np.where(m_new == -np.inf, F32(0), m_new).astype(F32)
        p = np.exp2(y - (m_new - shift)[:, None]).astype(F32)
        alpha = np.exp2(m - m_new).astype(F32)
        l_sum = (l_sum * alpha + p.sum(1, dtype=F32)).astype(F32)
        acc = (acc * alpha[:, None] + p @ v[start:start + block]).astype(F32)
        m = m_new
    lse = F32(F32(m + np.log2(l_sum)) * LN2) + _part(form.row, {**env, "q": q_pos})
    return acc / l_sum[:, None], lse


@pytest.mark.parametrize("q0", [0, 2**20, 2**26])
def test_the_engines_softmax_on_the_form_matches_the_oracle_far_from_position_zero(q0):
    """ALiBi (slope 1/2), 64 rows at positions q0.., 1088 keys ending with them (a block of a
    larger call): the form with the origin, its column part per block and per key, is within
    the declared tolerances of O and LSE at any position; with origin 0 the parts cancel by
    slope * q0, and past a few thousand positions LSE is off by more than its tolerance."""
    program = compile_spec(f"attention a {{ heads = 1 head_dim = 16 dtype = bf16 score = {ALIBI} mask = causal }}")
    rng = np.random.default_rng(q0 % 97)
    rows, keys = 64, 1088
    q_pos, k_pos = q0 + 1024 + np.arange(rows), q0 + np.arange(keys)
    q, k, v = (rng.standard_normal((n, 16)).astype(F32) for n in (rows, keys, keys))
    s = (q.astype(np.float64) @ k.T.astype(np.float64)).astype(F32)
    ref_o, ref_lse = oracle.reference(program, q[None, None], k[None, None], v[None, None], q_offset=int(q_pos[0]),
                                      k_offset=q0)
    origin = int(q_pos[0]) + separable.ORIGIN_ROWS // 2
    for per_block in (True, False):
        o, lse = _emulate(program, s, v, q_pos, k_pos, origin, per_block)
        for c in numerics.compare_outputs("bf16", o[None, None], lse[None, None], ref_o, ref_lse):
            assert c.ok, (per_block, str(c))
    o, lse = _emulate(program, s, v, q_pos, k_pos, 0, per_block=False)
    _, lse_check = numerics.compare_outputs("bf16", o[None, None], lse[None, None], ref_o, ref_lse)
    assert lse_check.ok == (q0 == 0), str(lse_check)
