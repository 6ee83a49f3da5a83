"""Issue 35's silent wrong answers on the Triton kernels (CPU interpreter): NaN through min/max,
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
                lambda: runtime.load(p).decode(**{n: torch.as_tensor(a) for n, a in arrays.items()})):
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
