"""Issue 35's silent wrong answers on the Triton kernels (CPU interpreter unless ATTNC_TEST_GPU=1): NaN through min/max,
int64 tensor values past i32, reads outside a tensor at any subscript, non-finite inputs.  Each
gives the oracle's answer or the oracle's error, as numpy and AHBM do."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from test_triton_language import assert_agree, prefill_and_split  # noqa: E402

from attnc.backends.numpy import runtime as numpy_runtime  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, reads  # noqa: E402
from attnc.compiler.errors import AttncError, InputError, PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnc.backends.triton.kernels.numerics import _checked_lse, _checked_sum  # noqa: E402
from tests.conftest import to_triton, triton_device  # noqa: E402

HEAD = "heads = 2 head_dim = 16 dtype = f32"


@pytest.mark.parametrize("body", ["mask = causal & max(0.0, sqrt(q - k - 3.0)) == 0.0",
                                  "mask = causal & min(sqrt(q - k - 3.0), 1.0) != 1.0",
                                  "mask = causal score = max(score, sqrt(q - k - 3.0))"])
def test_min_and_max_keep_a_nan_operand(body):
    """Triton's maximum dropped the NaN (O error 3.65); numpy's np.maximum and the oracle keep it."""
    want, *got = prefill_and_split(body, 6, 9)
    assert_agree(want, *got)


def _cache_call(doc_dtype=np.int64):
    p = compile_spec(f"attention t {{ {HEAD} cache = paged(page_size = 4) tensor doc: i32[b, s] ~ segments(2, 4) "
                     "mask = causal & doc[b, q] == doc[b, k] }")
    arrays = inputs.sample_cache(p, [9, 7], [3, 1], seed=3, poison=False)
    doc = np.zeros((2, 9), doc_dtype)
    doc[:, 4:] = 2**32  # equal to 0 once cast to int32: the two documents would merge
    return p, {**arrays, "doc": doc}


def test_int64_tensor_values_past_i32_are_refused_on_every_backend():
    import torch
    p, arrays = _cache_call()
    errors = []
    for run in (lambda: numpy_runtime.load(p).run(arrays), lambda: runtime.load(p).run(arrays),
                lambda: runtime.load(p).decode(**{n: to_triton(a) for n, a in arrays.items()})):
        with pytest.raises(InputError) as e:
            run()
        errors.append(str(e.value))
    assert len(set(errors)) == 1 and "tensor 'doc' has values outside the i32 range" in errors[0]


T = "tensor d: i32[b, s] ~ randint(0, 3) "


@pytest.mark.parametrize("index", ["q ^ 1", "(q * 7) % 23", "q // 2 * 3", "abs(q - 30)", "q << 1", "max(q, k) + 1"])
def test_reads_outside_a_tensor_are_the_oracles_error(index):
    """Only `q + c` subscripts were checked; Triton clamped the others silently."""
    want, *got = prefill_and_split(f"{T} mask = d[b, {index}] >= 0", 9, 9)
    assert isinstance(want, PlanError) and "read out of range" in str(want)
    assert_agree(want, *got)


@pytest.mark.parametrize("body", ["mask = causal & where(q > 0, d[b, q - 1], 0) >= 0",  # guarded: never read
                                  "mask = k < 3 | d[b, q + k] > 0",  # read where k >= 3 only
                                  "mask = causal score = score + where(q > 3, d[b, q ^ 1], 0)"])
def test_guarded_reads_count_where_they_are_used(body):
    want, *got = prefill_and_split(f"{T} {body}", 6, 9)
    assert_agree(want, *got)


def test_the_read_check_evaluates_only_what_ranges_cannot_bound(monkeypatch):
    """Subscripts bounded by the call's ranges (tensor values included) are not evaluated."""
    p = compile_spec(f"attention t {{ {HEAD} {T} tensor e: i32[b, s] ~ randint(0, 3) "
                     "mask = d[b, e[b, k]] == d[b, min(q, S_k - 1)] & d[b, q // 2] >= 0 }")
    called = []
    monkeypatch.setattr(reads, "_evaluate", lambda *a: called.append(a))
    ok = {"d": np.zeros((2, 12), np.int64), "e": np.full((2, 12), 11, np.int64)}
    reads.check_prefill(p, ok, 2, 12, 12)
    reads.check_requests(p, ok, [12, 5], [3, 1])
    assert not called
    reads.check_prefill(p, {**ok, "e": np.full((2, 12), 12, np.int64)}, 2, 12, 12)
    assert len(called) == 1
    with pytest.raises(AttncError, match="read out of range: axis 1 index 12"):
        monkeypatch.undo()
        reads.check_requests(p, {**ok, "e": np.full((2, 12), 12, np.int64)}, [12, 5], [3, 1])


def _outcome(fn):
    try:
        return fn()
    except AttncError as e:
        return e


@pytest.mark.parametrize("where", ["q", "k", "scale"])
def test_non_finite_inputs_are_one_error_on_every_backend(where):
    """NaN or inf in q or K, or `scale = 1e38`: numpy and AHBM raised, Triton returned NaN rows."""
    from attnc.backends.ahbm import runtime as ahbm_runtime
    p = compile_spec(f"attention t {{ {HEAD} {'scale = 1e38' if where == 'scale' else ''} mask = causal }}")
    a = inputs.sample(p, 1, 4, 6, seed=1)
    if where != "scale":
        a[where][0, 1, 2, 3] = np.inf if where == "q" else np.nan
    got = [_outcome(lambda m=m: m.load(p)(a["q"], a["k"], a["v"], return_lse=True))
           for m in (numpy_runtime, runtime, ahbm_runtime)]
    assert all(isinstance(g, PlanError) and "NaN or +inf at a visible key" in str(g) for g in got), got
    assert len({str(g) for g in got}) == 1


def test_non_finite_cache_rows_are_an_error_in_split_calls():
    p = compile_spec(f"attention t {{ {HEAD} cache = paged(page_size = 4) mask = causal }}")
    arrays = inputs.sample_cache(p, [9, 7], [3, 1], seed=3)
    lay = inputs.validate_cache(p, arrays).layout
    page = int(lay.block_table[1, 1])  # request 1's second page: its keys 4..7, visible to its row
    arrays["k_cache"][page, 0, 1, 0] = np.nan
    got = [_outcome(lambda k=k: k.run(arrays, return_lse=True)) for k in (numpy_runtime.load(p), runtime.load(p))]
    assert all(isinstance(g, PlanError) for g in got) and str(got[0]) == str(got[1]), got


def test_gpu_calls_mark_a_device_flag_that_check_numerics_raises():
    """The GPU's default path marks without a host sync (exercised on host tensors in the
    interpreter, on CUDA tensors under ATTNC_TEST_GPU=1)."""
    import torch
    dev = triton_device()
    kernel = runtime.load(compile_spec(f"attention t {{ {HEAD} mask = causal }}"))
    flag = torch.zeros(1, dtype=torch.int32, device=dev)  # (what _row_check makes on a GPU)
    kernel._nonfinite[str(flag.device)] = flag  # (keyed by the device, as _row_check keys it)
    kernel._mark_rows(torch.zeros(1, 2, 3, device=dev), flag)
    kernel.check_numerics()  # nothing marked
    kernel._mark_rows(torch.tensor([[[0.0, float("nan")]]], device=dev), flag)
    kernel._mark_rows(torch.zeros(1, 2, 3, device=dev), flag)  # a later good call does not clear it
    with pytest.raises(PlanError, match="since the last check had NaN or \\+inf at a visible key"):
        kernel.check_numerics()
    kernel.check_numerics()  # cleared
    far = torch.zeros(2, 3, 417, device=dev)  # one launch over several blocks: a NaN in the last one is marked
    kernel._mark_rows(far, flag)
    kernel.check_numerics()
    far[1, 2, 416] = float("nan")
    kernel._mark_rows(far, flag)
    with pytest.raises(PlanError):
        kernel.check_numerics()


@triton.jit
def _apply_checked_sum(M, L, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, _checked_sum(tl.load(M + offs), tl.load(L + offs)))


def test_rows_whose_scores_left_float32s_range_are_marked():
    """``numerics._checked_sum``, every Triton epilogue's reading of a row's (max, sum): a running max
    or sum of +inf -- a score past float32's range once scaled to base 2, which a GPU's fused
    multiply-add turns into exp2 of -inf or +inf, not NaN -- reads as NaN, so the row is marked as a
    visible NaN score marks it, and so does a sum of 0 under a finite max other than 0 (the largest
    term underflowed: exp2 of a residual of the rounded product); every other row's sum is kept, rows
    that saw nothing (max 0 or -inf, sum 0) included."""
    import torch
    inf, nan = float("inf"), float("nan")
    m = torch.tensor([inf, inf, 3.0, 0.0, -inf, 1e30, 2.0, 5.0, 1e30, -7.0] + [0.0] * 6)
    l = torch.tensor([0.0, 2.0, inf, 0.0, 0.0, 1.0, nan, 4.5, 0.0, 0.0] + [1.0] * 6)
    out = torch.empty_like(m)
    dev = triton_device()
    m, l, out = m.to(dev), l.to(dev), out.to(dev)
    _apply_checked_sum[(1,)](m, l, out, N=16)
    got = out.cpu()
    assert torch.isnan(got[:3]).all() and torch.isnan(got[6]) and torch.isnan(got[8:10]).all()
    assert got[3] == 0.0 and got[4] == 0.0 and got[5] == 1.0 and got[7] == 4.5 and (got[10:] == 1.0).all()


@triton.jit
def _apply_checked_lse(LSE, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, _checked_lse(tl.load(LSE + offs)))


def test_rows_whose_lse_reaches_the_score_limit_are_marked():
    """``numerics._checked_lse``, the Triton epilogues' last word on a row's LSE: finite with a
    magnitude of 2^30 (``compiler.numerics.SCORE_LIMIT``) or more reads as NaN; -inf (nothing seen),
    NaN and everything inside the limit are kept."""
    import torch
    inf, nan = float("inf"), float("nan")
    lse = torch.tensor([2.0 ** 30, -(2.0 ** 30), 1e30, -1e30, 2.0 ** 30 - 64, -1e9, -inf, nan, 0.0, 3.5, -2.5, 1e-30,
                        1e9, 5e8, -5e8, 7.0])
    out = torch.empty_like(lse)
    lse, out = lse.to(triton_device()), out.to(triton_device())
    _apply_checked_lse[(1,)](lse, out, N=16)
    got = out.cpu()
    assert torch.isnan(got[:4]).all() and torch.isnan(got[7])
    keep = [4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(got[keep], lse.cpu()[keep])


@pytest.mark.parametrize("score,fails", [("score * 1e30", True), ("score * 0.0 - 2e9", True),
                                         ("score * 0.0 + 1.5e9", True), ("score * 1e6", False),
                                         ("where(k + 2 > q, score, -1e9)", False), ("score * 0.0 - 1e9", False)])
def test_a_row_past_the_score_limit_is_one_error_on_every_backend(score, fails):
    """A row whose largest visible score (after scale) reaches 2^30 in magnitude is the non-finite
    score error on numpy, Triton and AHBM alike (float32 kernels cannot weigh it; on a GPU its
    largest term is exp2 of the product's rounding error), whatever its arithmetic gave; rows
    inside the limit -- -1e9 fills of masked cells included -- answer the same everywhere."""
    from attnc.backends.ahbm import runtime as ahbm_runtime
    from attnc.compiler import numerics, oracle
    p = compile_spec(f"attention t {{ {HEAD} score = {score} mask = causal }}")
    a = inputs.sample(p, 1, 8, 8, seed=2)
    got = [_outcome(lambda m=m: m.load(p)(a["q"], a["k"], a["v"], return_lse=True))
           for m in (numpy_runtime, runtime, ahbm_runtime)]
    want = _outcome(lambda: oracle.reference(p, a["q"], a["k"], a["v"]))
    if fails:
        assert isinstance(want, PlanError) and "2^30" in str(want)
        assert all(isinstance(g, PlanError) and str(g) == str(want) for g in got), got
    else:
        assert not isinstance(want, AttncError), want
        for g in got:
            assert not isinstance(g, AttncError), g
            assert all(c.ok for c in numerics.compare_outputs("f32", np.asarray(g[0]), np.asarray(g[1]), *want))
