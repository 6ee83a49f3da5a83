"""The float64 backward reference of the numpy backend (templates/numpy/backward.py.j2) against
central finite differences of the oracle's forward and against oracle.reference_backward (the
same derivatives evaluated by the IR interpreter), for every contiguous example and for score
programs that read f32 tensors (a learned bias, per-head slopes)."""
import ast as pyast
from dataclasses import replace

import numpy as np
import pytest

from attnc.backends.numpy import runtime
from attnc.backends.numpy.backward import emit_backward
from attnc.compiler import inputs, ir, oracle
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import EXAMPLES

EPS = 1e-6
PHASES = {"prefill": (16, 16), "append": (5, 16)}  # (S_q, S_k): bottom-right rows when S_q < S_k


def small(program: ir.Program) -> ir.Program:
    """The example at test size: 4 / 2 heads (GQA) or 2 (MHA), head dims 8 (d_v 4 where it differs)."""
    heads = (4, 2) if program.heads_q != program.heads_kv else (2, 2)
    return replace(program, heads_q=heads[0], heads_kv=heads[1], d_qk=8, d_v=8 if program.d_v == program.d_qk else 4)


def call(program: ir.Program, s_q: int, s_k: int, seed: int, batch: int = 2):
    """Sampled inputs (float64, the spec's layout), the declared tensors and an incoming dO."""
    arrays = inputs.sample(program, batch, s_q, s_k, seed)
    qkv = {n: np.asarray(arrays[n], np.float64) for n in ("q", "k", "v")}
    tensors = {t.name: np.asarray(arrays[t.name], np.float64) if t.dtype is ir.F32 else arrays[t.name]
               for t in program.tensors}
    o_shape = qkv["q"].shape[:3] + (program.d_v,)
    return qkv, tensors, np.random.default_rng(seed + 1).standard_normal(o_shape)


def bhsd(program, x):
    return inputs.output_bhsd(program, x)


def check_gradients(program: ir.Program, qkv: dict, tensors: dict, do: np.ndarray, seed: int = 0,
                    coordinates: dict | None = None):
    """The generated module's forward and backward against the oracle and against central
    differences of L = sum(O * dO) (directional, two random directions per input; plus the
    listed single coordinates of tensors).  Returns the module's gradients."""
    kernel = runtime.load(program)
    o, lse = kernel.forward64(qkv["q"], qkv["k"], qkv["v"], **tensors)
    q, k, v = (bhsd(program, qkv[n]) for n in ("q", "k", "v"))
    ref_o, ref_lse = oracle.reference(program, q, k, v, tensors, wide=True)
    np.testing.assert_allclose(bhsd(program, o), ref_o, rtol=1e-12, atol=1e-13)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], rtol=1e-12)

    dq, dk, dv, dt = kernel.backward(qkv["q"], qkv["k"], qkv["v"], o, lse, do, **tensors)
    grads = {"q": dq, "k": dk, "v": dv, **dt}
    for name, g in grads.items():
        assert np.isfinite(g).all(), name
    # (b) the interpreter's evaluation of the same derivatives
    rq, rk, rv, rt = oracle.reference_backward(program, q, k, v, bhsd(program, do), tensors)
    assert sorted(rt) == sorted(dt)
    for name, mine, ref in (("q", bhsd(program, dq), rq), ("k", bhsd(program, dk), rk),
                            ("v", bhsd(program, dv), rv), *((n, dt[n], rt[n]) for n in rt)):
        np.testing.assert_allclose(mine, ref, rtol=1e-10, atol=1e-12, err_msg=name)

    # (a) central differences of the oracle's forward
    w = bhsd(program, do)

    def loss(**moved):
        x = {**{n: bhsd(program, qkv[n]) for n in ("q", "k", "v")}, **tensors, **moved}
        o, _ = oracle.reference(program, x["q"], x["k"], x["v"], {t: x[t] for t in tensors}, wide=True)
        return float((o * w).sum())

    rng = np.random.default_rng(seed)
    base = {**{n: bhsd(program, qkv[n]) for n in ("q", "k", "v")}, **tensors}
    mine = {"q": bhsd(program, dq), "k": bhsd(program, dk), "v": bhsd(program, dv), **dt}
    for name, g in mine.items():
        for _ in range(2):
            u = rng.standard_normal(g.shape)
            fd = (loss(**{name: base[name] + EPS * u}) - loss(**{name: base[name] - EPS * u})) / (2 * EPS)
            assert abs(fd - (g * u).sum()) <= 1e-6 * (1 + abs(fd)), (name, fd, (g * u).sum())
    for name, cells in (coordinates or {}).items():
        for cell in cells:
            u = np.zeros_like(base[name])
            u[cell] = 1.0
            fd = (loss(**{name: base[name] + EPS * u}) - loss(**{name: base[name] - EPS * u})) / (2 * EPS)
            assert abs(fd - mine[name][cell]) <= 1e-6 * (1 + abs(fd)), (name, cell, fd, mine[name][cell])
    return grads, lse


CONTIGUOUS = [p for p in EXAMPLES if compile_file(p).cache.kind is ir.CacheKind.CONTIGUOUS]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("path", CONTIGUOUS, ids=lambda p: p.stem)
def test_example_gradients(path, phase):
    program = small(compile_file(path))
    qkv, tensors, do = call(program, *PHASES[phase], seed=len(path.stem))
    check_gradients(program, qkv, tensors, do)


def test_paged_example_is_refused_and_its_contiguous_variant_differentiates():
    (path,) = [p for p in EXAMPLES if p not in CONTIGUOUS]
    program = small(compile_file(path))
    kernel = runtime.load(program)
    arrays = inputs.sample(inputs.contiguous_variant(program), 1, 4, 4, 0)
    args = [arrays[n] for n in ("q", "k", "v")]
    with pytest.raises(InputError, match=f"declares a {program.cache.kind.value} K/V cache; the backward pass "
                                         "takes contiguous calls"):
        kernel.backward(*args, args[0][..., :program.d_v], np.zeros((1, program.heads_q, 4)),
                        args[0][..., :program.d_v], doc=arrays["doc"])
    with pytest.raises(InputError, match="the backward pass takes contiguous calls"):
        kernel.forward64(*args, doc=arrays["doc"])
    contiguous = inputs.contiguous_variant(program)  # softcap + document mask + GQA
    qkv, tensors, do = call(contiguous, *PHASES["append"], seed=3)
    check_gradients(contiguous, qkv, tensors, do)


def test_split_keys_are_refused():
    program = small(compile_file(CONTIGUOUS[0]))
    qkv, tensors, do = call(program, 4, 4, 0)
    with pytest.raises(InputError, match="'kv_lens' describes a split call; the backward pass takes contiguous"):
        runtime.load(program).backward(*qkv.values(), do, np.zeros(do.shape[:3]), do, kv_lens=np.array([4, 4]),
                                       **tensors)


SPEC = """attention learned {{
    heads    = 4 / 2
    head_dim = 8
    dtype    = f32
    {decls}
    {score}
    mask = {mask}
}}"""


def test_learned_bias_under_a_document_mask():
    program = compile_spec(SPEC.format(
        decls="tensor doc: i32[b, s] ~ segments(3, 7)\n tensor bias: f32[h, s, s] ~ uniform(-1.0, 1.0)",
        score="score = score + bias[h, q, k]", mask="causal & doc[b, q] == doc[b, k]"))
    qkv, tensors, do = call(program, 7, 12, seed=5)
    grads, _ = check_gradients(program, qkv, tensors, do, coordinates={"bias": [(0, 11, 11), (3, 9, 7)]})
    db = grads["bias"]
    assert db.shape == tensors["bias"].shape
    # the bias is read at (h, q, k), q among the last 7 positions; a cell no request sees gets nothing
    pos = np.arange(12)
    seen = np.zeros((12, 12), bool)
    for doc in tensors["doc"]:
        seen |= (pos[:, None] >= 5) & (pos[None, :] <= pos[:, None]) & (doc[:, None] == doc[None, :])
    assert (db[:, ~seen] == 0).all() and (db[:, seen] != 0).all()


def test_alibi_slopes_get_summed_gradients():
    program = compile_spec(SPEC.format(decls="tensor slope: f32[h] ~ uniform(0.1, 1.0)",
                                       score="score = score - slope[h] * (q - k)\n score = softcap(score, 5.0)",
                                       mask="causal"))
    qkv, tensors, do = call(program, 6, 10, seed=7)
    grads, _ = check_gradients(program, qkv, tensors, do, coordinates={"slope": [(0,), (1,), (2,), (3,)]})
    assert grads["slope"].shape == (4,) and (grads["slope"] != 0).all()


def test_empty_rows_and_hidden_nans_give_zero_gradients():
    """Rows with no visible key get dQ = 0 and add nothing; a score program that is NaN on
    hidden cells (sqrt of a negative bias there) leaves no NaN anywhere."""
    program = compile_spec(SPEC.format(
        decls="tensor w: f32[h, s, s] ~ uniform(0.5, 1.5)", score="score = score + sqrt(w[h, q, k])",
        mask="causal & q % 3 != 0"))
    qkv, tensors, do = call(program, 9, 9, seed=11)
    hidden = ~((np.arange(9)[None, :] <= np.arange(9)[:, None]) & (np.arange(9)[:, None] % 3 != 0))
    tensors["w"][:, hidden] = -1.0
    grads, lse = check_gradients(program, qkv, tensors, do)
    empty = np.arange(9) % 3 == 0
    assert np.isneginf(lse[:, :, empty]).all() and np.isfinite(lse[:, :, ~empty]).all()
    assert (grads["q"][:, :, empty] == 0).all() and (grads["w"][:, hidden] == 0).all()
    assert (grads["q"][:, :, ~empty] != 0).any()


def test_infinite_derivative_is_the_same_error_everywhere():
    """sqrt'(0) = +inf (torch's convention) at a visible cell: an error naming the statement
    and the cell from the generated module and from the oracle alike, never a NaN."""
    program = compile_spec(SPEC.format(decls="tensor w: f32[h, s, s] ~ uniform(0.5, 1.5)",
                                       score="score = score + sqrt(w[h, q, k])", mask="causal"))
    qkv, tensors, do = call(program, 4, 4, seed=0, batch=1)
    tensors["w"][1, 2, 1] = 0.0
    kernel = runtime.load(program)
    o, lse = kernel.forward64(*qkv.values(), **tensors)
    with pytest.raises(PlanError) as mine:
        kernel.backward(*qkv.values(), o, lse, do, **tensors)
    with pytest.raises(PlanError) as ref:
        oracle.reference_backward(program, *qkv.values(), do, tensors)
    assert str(mine.value) == str(ref.value)
    assert "derivative of score statement 1 with respect to w[h, q, k] is inf at visible cell " \
           "(b=0, h=1, q=2, k=1)" in str(mine.value)


def test_backward_inputs_are_validated():
    program = small(compile_file(CONTIGUOUS[0]))
    qkv, tensors, do = call(program, 4, 6, 0)
    kernel = runtime.load(program)
    o, lse = kernel.forward64(*qkv.values(), **tensors)
    with pytest.raises(InputError, match=r"'do' has shape \[2, 2, 4, 7\]; expected \[B, H_q=2, S_q, d_v=8\]"):
        kernel.backward(*qkv.values(), o, lse, do[..., :7], **tensors)
    with pytest.raises(InputError, match=r"'lse' is nan at \[b, h, i\] = \[1, 0, 2\]"):
        bad = lse.copy()
        bad[1, 0, 2] = np.nan
        kernel.backward(*qkv.values(), o, bad, do, **tensors)
    with pytest.raises(PlanError, match=r"saved LSE is -inf at \[b, h, i\] = \[0, 1, 3\] but that row has visible"):
        bad = lse.copy()
        bad[0, 1, 3] = -np.inf
        kernel.backward(*qkv.values(), o, bad, do, **tensors)
    with pytest.raises(InputError, match="missing key 'do'"):
        inputs.validate_backward(program, {**qkv, "o": o, "lse": lse, **tensors})


def test_forward_import_does_not_emit_the_backward():
    program = small(compile_file(CONTIGUOUS[0]))
    kernel = runtime.load(program)
    assert kernel._backward_module is None
    qkv, tensors, do = call(program, 4, 4, 0)
    kernel(*(x.astype(np.float32) for x in qkv.values()), **tensors)
    assert kernel._backward_module is None


@pytest.mark.parametrize("name", ["softcap", "alibi"])
def test_generated_backward_is_golden_and_self_contained(name, golden):
    (path,) = [p for p in EXAMPLES if p.stem == name]
    source = emit_backward(compile_file(path)).text
    imports = [n for n in pyast.walk(pyast.parse(source)) if isinstance(n, (pyast.Import, pyast.ImportFrom))]
    assert [a.name for n in imports for a in n.names] == ["numpy"]
    golden(f"generated/numpy_backward/{name}.py", source)
