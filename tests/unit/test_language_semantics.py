"""The language's semantics (README "The language"), issue 18's repros on numpy, the AHBM
simulator, the IR interpreter and the oracle (the Triton kernels: tests/numerics/
test_triton_language.py).  Each backend gives the oracle's answer or the oracle's error."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from attnc.backends.ahbm import runtime as ahbm
from attnc.backends.ahbm.emit import emit as emit_ahbm
from attnc.backends.numpy import runtime as numpy_backend
from attnc.backends.numpy.emit import emit as emit_numpy
from attnc.backends.triton.emit import emit as emit_triton
from attnc.compiler import inputs, interp, ir, numerics, oracle
from attnc.compiler.check import CALL_KEYWORDS
from attnc.compiler.errors import AttncError, PlanError, SpecError
from attnc.compiler.frontend import MAX_DEPTH
from attnc.compiler.lower import compile_spec

HEAD = "heads = 2 head_dim = 16 dtype = f32"


def spec(body: str, head: str = HEAD) -> ir.Program:
    return compile_spec(f"attention t {{ {head} {body} }}", "t.attn")


def outcome(fn):
    try:
        o, lse = fn()
        return np.asarray(o, np.float64), np.asarray(lse, np.float64)
    except AttncError as e:
        return e


def run_all(p: ir.Program, s_q: int, s_k: int, batch: int = 1, seed: int = 0) -> dict:
    """Oracle, numpy (tiled and split programs) and AHBM on one call."""
    return run_all_arrays(p, inputs.sample(p, batch, s_q, s_k, seed=seed))


def run_all_arrays(p: ir.Program, arrays: dict) -> dict:
    """run_all on given inputs (q, k, v and the tensors, bhsd)."""
    batch, _, s_q, _ = arrays["q"].shape
    s_k = arrays["k"].shape[2]
    tensors = {t.name: arrays[t.name] for t in p.tensors}
    qkv = (arrays["q"], arrays["k"], arrays["v"])

    def reference():
        call = inputs.validate(p, arrays)
        return oracle.reference(p, call.q, call.k, call.v, call.tensors)

    def split():  # the same call as a split call over the contiguous cache (packed rows)
        q = arrays["q"].transpose(0, 2, 1, 3).reshape(batch * s_q, p.heads_q, p.d_qk)
        o, lse = numpy_backend.load(p, family="decode_split").run(
            {"q": q, "k": arrays["k"], "v": arrays["v"], "kv_lens": np.full(batch, s_k),
             "q_lens": np.full(batch, s_q), **tensors}, return_lse=True)
        return (o.reshape(batch, s_q, p.heads_q, -1).transpose(0, 2, 1, 3),
                lse.reshape(batch, s_q, p.heads_q).transpose(0, 2, 1))

    return {"oracle": outcome(reference),
            "numpy": outcome(lambda: numpy_backend.load(p)(*qkv, return_lse=True, **tensors)),
            "numpy-split": outcome(split),
            "ahbm": outcome(lambda: ahbm.load(p)(*qkv, return_lse=True, **tensors)),
            "ahbm-sp": outcome(lambda: ahbm.load(p, sp=2)(*qkv, return_lse=True, **tensors))}


def assert_agree(results: dict, dtype: str = "f32") -> None:
    want = results["oracle"]
    for name, got in results.items():
        if isinstance(want, AttncError) or isinstance(got, AttncError):
            assert type(got) is type(want) and str(got) == str(want), f"{name}: {got!r} vs oracle {want!r}"
            continue
        co, cl = numerics.compare_outputs(dtype, got[0], got[1], *want)
        assert co.ok and cl.ok, f"{name}: {co}; {cl}"


# ---------------------------------------------------------------- integers are exact
def test_products_past_i32_are_exact_on_every_backend():
    """`k * 100000000 <= q * 100000000` is `k <= q`: the products need i64 from k = 22 on."""
    p = spec("mask = k * 100000000 <= q * 100000000")
    assert p.mask.left.type is ir.I64
    results = run_all(p, 40, 40)
    assert_agree(results)
    causal = run_all(spec("mask = causal"), 40, 40)
    np.testing.assert_allclose(results["numpy"][0], causal["oracle"][0], atol=1e-6)


def test_constants_past_i32_are_exact():
    p = spec("mask = k < q + 2147483647 * 2")  # was an interpreter traceback
    assert p.mask.right.right == ir.Const(4294967294, ir.I64)
    assert oracle.dense_mask(p, 1, 5, 9, {}).all()
    assert_agree(run_all(p, 5, 9))


@pytest.mark.parametrize("mask, message", [
    ("k * 100000000 * 100000000 * 100000000 < q", "integer expression may overflow i64"),
    ("q << k < 3", "shift count may lie outside [0, 63]"),
    ("(q << 40) < k", "integer expression may overflow i64"),
])
def test_integer_ranges_past_i64_are_located_errors(mask, message):
    with pytest.raises(SpecError, match=re_escape(message)) as e:
        spec(f"mask = {mask}")
    assert str(e.value).startswith("t.attn:1:") and "^" in str(e.value)


def re_escape(s: str) -> str:
    import re
    return re.escape(s)


def test_i32_tensor_arithmetic_widens_and_positions_stay_narrow():
    p = spec("tensor start: i32[b] ~ randint(0, 3) mask = q - start[b] < 4 & q - k < 8")
    left, right = p.mask.left, p.mask.right  # q - start[b] may leave i32, q - k may not
    assert left.left.type is ir.I64 and right.left.type is ir.I32
    assert_agree(run_all(p, 9, 12))


# ---------------------------------------------------------------- division, where, & and |
def test_integer_division_by_zero_is_total():
    p = spec("mask = q // (k - k) == 0 & q % (k - k) == q")  # x // 0 = 0, x % 0 = x
    assert oracle.dense_mask(p, 1, 4, 6, {}).all()
    assert_agree(run_all(p, 4, 6))


def test_where_does_not_evaluate_the_branch_it_does_not_take():
    """`where(k > 0, q // k, 0)` (was a numpy and oracle error at k = 0); reads outside a tensor
    count only where where's branch or the right side of & and | decides."""
    assert_agree(run_all(spec("mask = where(k > 0, q // k, 0) >= 1"), 8, 8))
    doc = "tensor doc: i32[b, s] ~ segments(2, 4) "
    for mask in ("where(k > 0, doc[b, k - 1], -1) == doc[b, q]", "k > 0 & doc[b, k - 1] != doc[b, k] | causal",
                 "where(q > 0, doc[b, q - 1], 0) == doc[b, k]", "k == 0 | doc[b, k - 1] == doc[b, q]"):
        results = run_all(spec(doc + f"mask = {mask}"), 9, 12, batch=2)
        assert not isinstance(results["oracle"], AttncError), mask
        assert_agree(results)


def test_a_read_outside_its_tensor_where_it_is_used_is_the_same_error_everywhere():
    results = run_all(spec("tensor doc: i32[b, s] ~ segments(2, 4) mask = where(q > 3, doc[b, q - 5], 0) == 0"),
                      8, 8)
    assert isinstance(results["oracle"], PlanError) and "index -1" in str(results["oracle"])
    assert_agree(results)


@pytest.mark.parametrize("mask, raises", [
    ("!((q - k) % 1 == 0) & doc[b, k + 1] == 1", False),  # the guard is never true (periodic: inexact)
    ("q % 3 == 7 & doc[b, k + 1] == 0 | causal", False),
    ("q < 0 & doc[b, k + 1] == 1 | causal", False),  # an exact guard on q that holds on no row
    ("(q - k) % 3 == 1 & doc[b, k + 1] == 0 | causal", True),  # used at the last key
    ("q % 2 == 1 & doc[b, q + 1] == 0 | causal", True),
    ("q % 2 == 7 & doc[b, q + 1] == 0 | causal", False),
])
@pytest.mark.parametrize("s", [1, 8])
def test_a_read_under_a_guard_the_analysis_cannot_solve_is_an_error_only_where_used(mask, raises, s):
    """The interval analysis checked reads in every column a guard on q left (or, inexact, every
    column): it raised where the oracle does not; the cells decide now, and AHBM's streams take the
    plan's word instead of evaluating every position eagerly."""
    from attnc.backends.triton import runtime as triton_runtime
    pytest.importorskip("torch")
    from tests.conftest import to_triton
    p = spec(f"tensor doc: i32[b, s] ~ segments(1, 3) mask = {mask}")
    arrays = inputs.sample(p, 2, s, s, seed=1)
    results = run_all_arrays(p, arrays)

    def triton():  # torch tensors on the Triton backend's device (CUDA in a GPU run), O and LSE back on the host
        o, lse = triton_runtime.load(p)(*(to_triton(arrays[n]) for n in ("q", "k", "v")), return_lse=True,
                                        doc=to_triton(arrays["doc"]))
        return o.cpu(), lse.cpu()
    results["triton"] = outcome(triton)
    assert isinstance(results["oracle"], PlanError) == (raises and s > 1), results["oracle"]
    assert_agree(results)


def test_a_split_call_names_the_read_the_oracle_names():
    """Two reads that leave the tensor in different requests: the oracle raises the read first in
    evaluation order (over the whole call), the split call's request-by-request check named the
    first request's (found by a random cross-backend run: index 20 against the oracle's 25)."""
    mask = ("((abs(q - k) <= 8 & !(doc[b, k - 4] == doc[b, q])) | doc[b, k + 7] == 0) & "
            "!(doc[b, k + 5] == 0)")
    p = spec(f"tensor doc: i32[b, s] ~ segments(1, 9) mask = {mask} score = softcap(score, 5.0)")
    arrays = inputs.sample(p, 2, 4, 20, seed=9)
    results = run_all_arrays(p, arrays)
    assert "index 25" in str(results["oracle"]), results["oracle"]
    assert_agree(results)


# ---------------------------------------------------------------- floats are f32
def test_float_masks_compute_in_f32_in_the_oracle_too():
    """`abs(q / 12 - k / 12) <= 3`: float64 and float32 disagree on cells at the boundary; the
    language (and so the oracle) is f32, as every kernel computes."""
    p = spec("mask = abs(q / 12 - k / 12) <= 3")
    q = np.arange(200).reshape(-1, 1)
    k = np.arange(200).reshape(1, -1)
    f32 = np.abs(np.float32(q) / np.float32(12) - np.float32(k) / np.float32(12)) <= np.float32(3)
    f64 = np.abs(q / 12 - k / 12) <= 3
    assert (f32 != f64).sum() > 0  # the repro: the precisions differ here
    np.testing.assert_array_equal(oracle.dense_mask(p, 1, 200, 200, {})[0, 0], f32)
    got = numpy_backend.load(spec("mask = abs(q / 12 - k / 12) <= 3", "heads = 1 head_dim = 16 dtype = f32"))
    arrays = inputs.sample(got.program, 1, 200, 200, seed=3)
    o, lse = got(arrays["q"], arrays["k"], arrays["v"], return_lse=True)
    ref = oracle.reference(got.program, arrays["q"], arrays["k"], arrays["v"])
    assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, *ref))


def test_scale_past_f32_is_a_located_error():
    with pytest.raises(SpecError, match=r"scale cannot be computed: overflows f32") as e:
        spec("scale = 1e38 * 1e38")
    assert "t.attn:1:" in str(e.value)


def test_constant_folding_is_f32():
    p = spec("score = score * (0.1 + 0.2)")
    folded = p.score[0].right.value
    assert folded == float(np.float32(np.float32(0.1) + np.float32(0.2)))


# ---------------------------------------------------------------- non-finite scores
NONFINITE = "the score program produced NaN or +inf at a visible key of query row (b=0, h=0, q="


@pytest.mark.parametrize("score", ["sqrt(k - q)", "exp(score * 100.0)", "score + 1.0 / (q - k)"])
def test_a_non_finite_visible_score_is_one_named_error_on_every_backend(score):
    results = run_all(spec(f"mask = causal score = {score}"), 6, 6)
    assert isinstance(results["oracle"], PlanError) and NONFINITE in str(results["oracle"])
    assert_agree(results)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_v_is_one_located_error_on_every_contiguous_backend(bad):
    """V must be finite (numerics.check_values): a NaN or inf would reach every row whose tiles read
    its key, hidden ones too (P = 0 times NaN), which depends on each backend's tiles; so every
    backend refuses it before attending, naming the first element, also at a key no row sees."""
    from attnc.backends.triton import runtime as triton_runtime
    torch = pytest.importorskip("torch")
    p = spec("mask = causal & k != 2")
    arrays = inputs.sample(p, 1, 6, 6, seed=0)
    arrays["v"][0, 1, 2, 3] = bad  # key 2: hidden from every row
    results = {n: r for n, r in run_all_arrays(p, arrays).items() if n != "numpy-split"}
    # torch tensors where Triton interprets (CPU tensors); numpy arrays on a GPU, whose host copies the
    # call checks (a plain GPU call does not look at a device V: ATTNC_CHECK_FINITE=1 does)
    host = triton_runtime.interpreted()
    results["triton"] = outcome(lambda: triton_runtime.load(p)(
        *((torch.from_numpy(arrays[n]) if host else arrays[n]) for n in ("q", "k", "v")), return_lse=True))
    want = "inputs: 'v' holds NaN or inf at (b=0, h=1, k=2, d=3): V must be finite"
    assert all(want in str(r) for r in results.values()), results
    assert_agree(results)


def test_hidden_cells_may_hold_any_score():
    """`score + 1.0 / (q - k)` under `k < q`: the diagonal's +inf is hidden (AHBM leaked it as NaN)."""
    results = run_all(spec("mask = k < q score = score + 1.0 / (q - k)"), 7, 7, batch=2)
    assert not isinstance(results["oracle"], AttncError)
    assert_agree(results)


def test_minus_infinity_drops_a_visible_cell():
    dropped = run_all(spec("mask = causal score = where(k == 0, -1e30 * 1e30, score)"), 6, 6)
    assert_agree(dropped)
    hidden = run_all(spec("mask = causal & k != 0"), 6, 6)
    np.testing.assert_allclose(dropped["numpy"][0], hidden["oracle"][0], atol=1e-6)


@pytest.mark.parametrize("s", [1, 16, 128])
def test_a_row_whose_visible_scores_are_all_minus_infinity_sees_no_key_everywhere(s):
    """Every visible cell dropped by the score program (on tiles the mask keeps whole): O = 0 and
    LSE = -inf on every backend (AHBM took exp(-inf - -inf) on FULL tiles and raised the non-finite
    error; found by a random cross-backend run at S = 1)."""
    from attnc.backends.triton import runtime as triton_runtime
    torch = pytest.importorskip("torch")
    p = spec("mask = true score = where(k < 64, -1e30 * 1e30, score)")
    arrays = inputs.sample(p, 1, s, s, seed=0)
    results = run_all_arrays(p, arrays)
    # torch tensors where Triton interprets (CPU tensors); numpy arrays on a GPU, whose host copies the
    # call checks (a plain GPU call does not look at a device V: ATTNC_CHECK_FINITE=1 does)
    host = triton_runtime.interpreted()
    results["triton"] = outcome(lambda: triton_runtime.load(p)(
        *((torch.from_numpy(arrays[n]) if host else arrays[n]) for n in ("q", "k", "v")), return_lse=True))
    if s <= 64:  # (every key dropped; at 128 the rows see keys 64..127)
        assert np.isneginf(results["oracle"][1]).all()
    assert_agree(results)


def test_may_be_nonfinite_knows_the_safe_score_programs():
    from attnc.compiler.ranges import may_be_nonfinite
    safe = ["softcap(score, 20.0)", "score - exp(-(h + 1) * log(2.0)) * (q - k)", "score * 0.5 + tanh(score)",
            "where(k > q, score, -score)", "erf(score) + sin(score) * cos(score)",
            "score + w[h]", "score * w[h]", "score - w[h] * (q - k)"]  # (inputs: finite, at most 2^63)
    risky = ["exp(score * 100.0)", "sqrt(score)", "score / (q - k)", "log(score)", "score * 1e30",
             "sin(exp(score))", "score + log(0.0 - 1.0)", "score + log(0.0 - h)", "score + exp(w[h])",
             "score * score * score", "score / w[h]"]
    decl = "tensor w: f32[h] ~ uniform(-1, 1) "
    assert not any(may_be_nonfinite(spec(decl + f"score = {s}")) for s in safe)
    assert all(may_be_nonfinite(spec(decl + f"score = {s}")) for s in risky)


# ---------------------------------------------------------------- vocabulary
@pytest.mark.parametrize("mask", ["(q & 7) == (k & 7)", "q >> 2 == k >> 2", "(q ^ k) < 4", "(q | 1) == (k | 1)",
                                  "(k << 2) <= q", "(q & 1) == 0 ^ causal", "(h | b) == 0 | k < 3"])
def test_bitwise_operators_on_integers(mask):
    p = spec(f"mask = {mask}")
    results = run_all(p, 9, 13, batch=2)
    assert_agree(results)
    q, k = np.arange(4, 13), np.arange(13)
    py = {  # the operators' Python meaning, cell by cell
        "(q & 7) == (k & 7)": lambda a, c: (a & 7) == (c & 7), "q >> 2 == k >> 2": lambda a, c: a >> 2 == c >> 2,
        "(q ^ k) < 4": lambda a, c: (a ^ c) < 4, "(q | 1) == (k | 1)": lambda a, c: (a | 1) == (c | 1),
        "(k << 2) <= q": lambda a, c: (c << 2) <= a}
    if mask in py:
        want = np.array([[py[mask](int(a), int(c)) for c in k] for a in q])
        np.testing.assert_array_equal(oracle.dense_mask(p, 1, 9, 13, {})[0, 0], want)


def test_bitwise_precedence_mistake_is_explained():
    with pytest.raises(SpecError, match=r"write \(q & 7\) == 0"):
        spec("mask = q & 7 == 0")


@pytest.mark.parametrize("fn, ref", [("erf", math.erf), ("sin", math.sin), ("cos", math.cos)])
def test_erf_sin_cos(fn, ref):
    p = spec(f"score = score + {fn}(score) - {fn}(0.5 * (q - k)) mask = causal")
    assert_agree(run_all(p, 7, 9))
    x = np.linspace(-3, 3, 13, dtype=np.float32)
    got = interp.evaluate(ir.Call(fn, (ir.Var("score", ir.F32),), ir.F32), {"score": x}, {})
    np.testing.assert_allclose(got, [ref(float(v)) for v in x], atol=2e-7)


# ---------------------------------------------------------------- tracebacks -> located errors
def test_long_chains_of_associative_operators_work():
    mask = " & ".join(["k <= q"] * 489)  # was a RecursionError
    p = spec(f"mask = {mask}")
    assert_agree(run_all(p, 4, 4))
    for src in (emit_numpy(p), emit_triton(p), emit_ahbm(p)):
        compile(src.text, "x", "exec")


@pytest.mark.parametrize("text", ["abs(" * 330 + "k" + ")" * 330 + " < q",
                                  " + ".join(["q"] + ["1"] * 200) + " > k",
                                  "where(k > 0, " * 40 + "k" + ", 0)" * 40 + " < q"])
def test_deep_expressions_are_refused_naming_the_limit(text):
    with pytest.raises(SpecError, match=f"nested more than {MAX_DEPTH} levels deep") as e:
        spec(f"mask = {text}")
    assert str(e.value).startswith("t.attn:1:")


@pytest.mark.parametrize("shape", ["abs({})", "({} + 1)", "where(k > 0, {}, 0)", "doc[b, {}]", "min({}, q)",
                                   "-{}", "(({}) // 2)"])
def test_the_deepest_accepted_expressions_compile_and_run_everywhere(shape):
    inner = "k"
    depth = 1
    while True:  # as deep as the language allows
        wider = shape.format(inner)
        try:
            spec(f"tensor doc: i32[b, s] ~ randint(0, 4) mask = {wider} >= 0 | causal")
        except SpecError:
            break
        inner, depth = wider, depth + 1
    assert depth >= MAX_DEPTH - 4
    p = spec(f"tensor doc: i32[b, s] ~ randint(0, 4) mask = {inner} >= 0 | causal score = score + {inner}")
    for src in (emit_numpy(p), emit_numpy(p, family="decode_split"), emit_triton(p), emit_ahbm(p)):
        compile(src.text, "x", "exec")
    assert_agree(run_all(p, 3, 5))


@pytest.mark.parametrize("text, message", [
    (f"{HEAD} mask = k < {'9' * 4301}", "integer with 4301 digits is too large"),
    (f"heads = 2 head_dim = {'9' * 300}", "integer with 300 digits is too large"),
    ("heads = 2 head_dim = 99999999999", "head_dim must be at most 2147483647"),
    (f"{HEAD} tensor t: i32[99999999999]", "axis size must be in [1, 2147483647]"),
    (f"{HEAD} split = chunk(99999999999)", "size must be at most 2147483647"),
    (f"{HEAD} tensor t: i32[s] ~ randint(0, 99999999999)", "must fit in i32"),
    (f"{HEAD} tensor t: f32[s] ~ const(1e39)", "outside the f32 range"),
])
def test_oversized_literals_are_located_errors(text, message):
    with pytest.raises(SpecError, match=re_escape(message)) as e:
        compile_spec(f"attention t {{ {text} }}", "t.attn")
    assert str(e.value).startswith("t.attn:1:")


def test_long_names_are_refused():
    with pytest.raises(SpecError, match="attention name is 300 characters long; names have at most 64"):
        compile_spec(f"attention {'a' * 300} {{ {HEAD} }}")
    compile_spec(f"attention {'a' * 64} {{ {HEAD} }}")


@pytest.mark.parametrize("name", ["plan", "stats", "cache", "lengths", "occupancy", "kv_lens", "q_lens", "self",
                                  "return_lse", "block_table", "lse"])
def test_tensor_names_a_call_uses_are_refused(name):
    with pytest.raises(SpecError, match=f"tensor name '{name}' is reserved: a call passes its inputs"):
        spec(f"tensor {name}: i32[b, s] ~ randint(0, 3) mask = {name}[b, k] > 0")


def test_tensor_names_cannot_collide_in_generated_code():
    """`T_x` and `x_s0` were one Triton argument; generated names are the tensors' indices."""
    p = spec("tensor T_x: i32[b, s] ~ randint(0, 3) tensor x_s0: i32[b, s] ~ randint(0, 3) "
             "tensor x: i32[b, s] ~ randint(0, 3) mask = T_x[b, k] + x_s0[b, q] + x[b, k] > 1")
    src = emit_triton(p).text
    assert "_t0, _t0_s0, _t0_n0, _t0_s1, _t0_n1, _t1," in src and "T_x" not in src.split("TENSORS")[1].split("\n", 1)[1]
    compile(src, "x", "exec")
    assert_agree(run_all(p, 5, 7, batch=2))


def _keywords(fn) -> set[str]:
    return {n for n, prm in inspect.signature(fn).parameters.items()
            if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)}


def test_call_keywords_cover_every_entry_point_that_takes_tensors_by_name():
    """A declared tensor is passed as a keyword next to these parameters: each entry point's
    keywords must be reserved (or a tensor could never be passed)."""
    import attnc.api as api
    from attnc.backends.triton import graph, runtime as triton_rt
    entry_points = [api.Attention.__call__, api.Attention.plan, api.Attention.run, api.Attention.decode,
                    numpy_backend.Kernel.__call__, numpy_backend.Kernel.run, ahbm.Kernel.__call__,
                    ahbm.Kernel.simulate, triton_rt.Kernel.__call__, triton_rt.Kernel.decode,
                    triton_rt.Kernel.prepare, triton_rt.Kernel.prepare_decode, triton_rt.Kernel.decode_graph,
                    triton_rt.Kernel.config_for, graph.DecodeGraph.__init__]
    p = spec("mask = causal")
    for family in ("attention", "decode_split"):
        module = numpy_backend.load(p, family=family)
        entry_points.append((module.module if family == "attention" else module.split_module).attention)
    keys = set().union(*(_keywords(f) for f in entry_points))
    keys |= {"o", "lse", *inputs.SPLIT_KEYS, "kv_indptr", "kv_indices", "kv_last_page_len", "block_table",
             "k_cache", "v_cache"}
    assert keys <= CALL_KEYWORDS, sorted(keys - CALL_KEYWORDS)


# ---------------------------------------------------------------- the request's lengths
def test_top_left_aligned_masks_with_the_requests_lengths():
    """`S_q`, `S_k` name the request's query rows and keys: row i of an append call is
    q - (S_k - S_q), so top-left causal is `k <= q - (S_k - S_q)`."""
    p = spec("mask = k <= q - (S_k - S_q)")
    rows = np.arange(5).reshape(-1, 1)
    np.testing.assert_array_equal(oracle.dense_mask(p, 1, 5, 12, {})[0, 0], np.arange(12) <= rows)
    assert_agree(run_all(p, 5, 12, batch=2))
    assert_agree(run_all(p, 1, 12, batch=2))  # decode: AHBM's decode program, the split program's one row


def test_paddle_row_vectors_of_an_append_call():
    """A FlashMask-style vector of row indices (as Paddle builds them for the call), read against
    the row index q - (S_k - S_q), with a score that reads the lengths too."""
    body = ("tensor lts: i32[b, s] ~ randint(0, 6) mask = k <= q & q - (S_k - S_q) < lts[b, k] "
            "score = score - 0.25 * S_q + 0.01 * S_k")
    p = spec(body)
    arrays = inputs.sample(p, 2, 5, 12, seed=7)
    rows = np.arange(5).reshape(1, -1, 1)
    want = (np.arange(12) <= rows + 7) & (rows < arrays["lts"][:, None, :])
    np.testing.assert_array_equal(oracle.dense_mask(p, 2, 5, 12, {"lts": arrays["lts"]})[:, 0], want)
    assert_agree(run_all(p, 5, 12, batch=2))


def test_lengths_per_request_in_a_mixed_batch():
    p = spec("cache = paged(page_size = 4) mask = k <= q - (S_k - S_q) | k >= S_k - 2")
    arrays = inputs.sample_cache(p, [12, 7, 9], [5, 2, 1], seed=3)
    kernel = numpy_backend.load(p)
    o, lse = kernel.run(arrays, return_lse=True)
    ref_o, ref_lse = oracle.reference_cache(p, inputs.validate_cache(p, arrays))
    assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, ref_o, ref_lse))
    with pytest.raises(SpecError, match="'S_k' is the request's length; scale must be a constant"):
        spec("scale = 1.0 / S_k")
