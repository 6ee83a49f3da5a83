"""The language's semantics on the Triton kernels (CPU interpreter unless ATTNC_TEST_GPU=1):
issue 18's repros give the oracle's answer or the oracle's error, in prefill and split calls."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.errors import AttncError, PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

HEAD = "heads = 2 head_dim = 16 dtype = f32"


def prefill_and_split(body: str, s_q: int, s_k: int, batch: int = 1):
    """(oracle, Triton prefill, Triton split) outcomes of one call: (O, LSE) or the AttncError."""
    p = compile_spec(f"attention t {{ {HEAD} {body} }}")
    arrays = inputs.sample(p, batch, s_q, s_k, seed=4)
    tensors = {t.name: arrays[t.name] for t in p.tensors}
    kernel = runtime.load(p)

    def attempt(fn):
        try:
            return fn()
        except AttncError as e:
            return e

    def reference():
        call = inputs.validate(p, arrays)
        return oracle.reference(p, call.q, call.k, call.v, call.tensors)

    def split():
        q = arrays["q"].transpose(0, 2, 1, 3).reshape(batch * s_q, p.heads_q, p.d_qk)
        o, lse = kernel.decode(q, k=arrays["k"], v=arrays["v"], kv_lens=np.full(batch, s_k, np.int32),
                               q_lens=np.full(batch, s_q, np.int32), return_lse=True, **tensors)
        return (o.reshape(batch, s_q, p.heads_q, -1).transpose(0, 2, 1, 3),
                lse.reshape(batch, s_q, p.heads_q).transpose(0, 2, 1))

    return (attempt(reference), attempt(lambda: kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                                                       **tensors)), attempt(split))


def assert_agree(want, *got):
    for g in got:
        if isinstance(want, AttncError) or isinstance(g, AttncError):
            assert type(g) is type(want) and str(g) == str(want), (g, want)
            continue
        co, cl = numerics.compare_outputs("f32", np.asarray(g[0]), np.asarray(g[1]), *want)
        assert co.ok and cl.ok, (co, cl)


def test_integer_products_past_i32_are_exact():
    """`k * 100000000 <= q * 100000000` wrapped at i32 in Triton (O error 0.61)."""
    want, *got = prefill_and_split("mask = k * 100000000 <= q * 100000000 | k < q + 2147483647 * 2 & false",
                                   40, 40)
    assert_agree(want, *got)


# exp overflows f32 past 88.72: (q - k) * 100 is far past it wherever q > k, so the first marked
# row is the same on every backend (a score near the threshold would depend on exp's last ulp,
# which a GPU's exp does not promise)
@pytest.mark.parametrize("score", ["sqrt(k - q)", "exp(score + (q - k) * 100.0)"])
def test_a_non_finite_visible_score_is_the_oracles_error(score):
    """Triton reported those rows as empty; now it marks them and the call raises the oracle's error."""
    want, *got = prefill_and_split(f"mask = causal score = {score}", 5, 9)
    assert isinstance(want, PlanError) and "NaN or +inf at a visible key" in str(want)
    assert_agree(want, *got)


def test_language_semantics_in_the_kernels():
    """Total // and % by a divisor that may be 0, where's untaken branch, bitwise operators,
    erf/sin/cos, a hidden cell's +inf, -inf dropping a visible cell."""
    body = ("mask = where(k > 0, q // k, 0) >= 1 | ((q ^ k) & 3) == 0 | q >> 1 == k >> 1 | q % (k - k) == 99 "
            "score = where(k == 1, -1e30 * 1e30, score + erf(score) * sin(0.5 * (q - k)) + cos(score)) "
            "+ 1.0 / (q - k + 0.5)")
    want, *got = prefill_and_split(body, 7, 11, batch=2)
    assert not isinstance(want, AttncError)
    assert_agree(want, *got)


def test_tensors_whose_names_met_in_generated_code():
    want, *got = prefill_and_split("tensor T_x: i32[b, s] ~ randint(0, 3) tensor x_s0: i32[b, s] ~ randint(0, 3) "
                                   "tensor x: i32[b, s] ~ randint(0, 3) mask = T_x[b, k] * 2 + x_s0[b, q] - x[b, k] > 0",
                                   6, 8, batch=2)
    assert_agree(want, *got)


def test_the_requests_lengths_in_the_kernels():
    """S_q and S_k reach every kernel through TS (the call's kv_lens and qo_indptr)."""
    want, *got = prefill_and_split("tensor lts: i32[b, s] ~ randint(0, 6) mask = k <= q & q - (S_k - S_q) < lts[b, k] "
                                   "score = score - 0.25 * S_q + 0.01 * S_k", 5, 12, batch=2)
    assert_agree(want, *got)
    p = compile_spec(f"attention t {{ {HEAD} cache = paged(page_size = 4) mask = k <= q - (S_k - S_q) | k >= S_k - 2 }}")
    arrays = inputs.sample_cache(p, [12, 7, 9], [5, 2, 1], seed=3)
    o, lse = runtime.load(p).run(arrays, return_lse=True)
    ref = oracle.reference_cache(p, inputs.validate_cache(p, arrays))
    assert all(c.ok for c in numerics.compare_outputs("f32", np.asarray(o), np.asarray(lse), *ref))


@pytest.mark.parametrize("fn", ["sign", "min", "erf"])
def test_functions_in_the_kernels(fn):
    """A function of the language on the Triton kernels, prefill and split (sign: the worked
    example of docs/ARCHITECTURE.md; tests/unit/test_functions.py runs every function on the CPU
    backends with the same spec bodies)."""
    from tests.unit.test_functions import _uses
    want, *got = prefill_and_split(_uses(fn), 7, 9, batch=2)
    assert not isinstance(want, AttncError), want
    assert_agree(want, *got)


def test_sign_of_tensor_reads_in_the_kernels():
    want, *got = prefill_and_split("tensor side: i32[b, s] ~ randint(-3, 3) tensor w: f32[h] ~ uniform(-1, 1) "
                                   "mask = sign(side[b, q]) == sign(side[b, k]) | k == q "
                                   "score = score + sign(w[h] - 0.0) * abs(q - k) * 0.125", 8, 8, batch=2)
    assert not isinstance(want, AttncError), want
    assert_agree(want, *got)


@pytest.mark.parametrize("mask", [
    "causal & (k % 8 < 3 | q // 4 == k // 4)",                     # never-negative dividends, powers of two
    "causal & (q % 7 < 3 | k // 5 == q // 5)",                     # never negative, other divisors
    "causal & ((q - k) % 4 == 0 | (q - k) // 3 == 2)",             # dividends that may be negative
    "causal & (doc[b, k] % 4 == doc[b, q] // -2 | k % -3 == -1)",  # tensor values (any i32), negative divisors
])
def test_floor_division_and_remainder_keep_the_languages_rule(mask):
    """The emitter prints `//` and `%` of a dividend the range analysis proves never negative by a
    positive constant as Triton's operators (a power of two: a shift, a bitwise and), the rest
    through the floor helpers: every form gives the oracle's answer."""
    from attnc.backends.triton.emit import emit
    body = f"tensor doc: i32[b, s] ~ randint(-9, 9) mask = {mask}" if "doc" in mask else f"mask = {mask}"
    source = emit(compile_spec(f"attention t {{ {HEAD} {body} }}")).text
    if "q - k" in mask or "doc" in mask:
        assert "_floordiv(" in source or "_mod(" in source
    else:
        assert "_floordiv(" not in source.split("def visible")[1].split("@triton.jit")[0]
    want, *got = prefill_and_split(body, 37, 45, batch=2)
    assert_agree(want, *got)
