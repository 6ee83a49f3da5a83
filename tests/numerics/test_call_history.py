"""A call's checks do not depend on the calls before it (issue 35): every call that a fresh
``Attention`` refuses is refused the same way (same error type, same message) after a good call
has filled the route and launch caches -- on the numpy backend and on Triton (interpreted, or on
the GPU under ATTNC_TEST_GPU=1: its tensors are then CUDA tensors)."""
import pytest

torch = pytest.importorskip("torch", reason="attnc.compile takes torch tensors (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.compiler.errors import AttncError  # noqa: E402
from tests.conftest import triton_device  # noqa: E402

OPEN = "attention h { mask = causal }"  # dtype from the call
DOCS = "attention d { tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"
B, H, S, D = 1, 2, 16, 16


def _qkv(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g).to(dtype).to(device) for _ in range(3)]


def _device(backend):
    """The tensors' device: CPU for the default (numpy) route, the Triton backend's for triton."""
    return triton_device() if backend == "triton" else "cpu"


def _refusal(call):
    with pytest.raises(AttncError) as e:
        call()
    return type(e.value), str(e.value)


def _same_after_a_good_call(spec, good, bad):
    fresh = _refusal(lambda: bad(attnc.compile(spec)))
    attn = attnc.compile(spec)
    good(attn)
    assert _refusal(lambda: bad(attn)) == fresh
    good(attn)  # (and the good call still runs)


BACKENDS = [None, "triton"]  # CPU tensors: numpy by default; triton forced on its device (interpreted on CPU)


@pytest.mark.parametrize("backend", BACKENDS, ids=["numpy", "triton"])
def test_kv_dtype_is_checked_after_a_good_call(backend):
    q, k, v = _qkv(device=_device(backend))
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    _same_after_a_good_call(OPEN, lambda a: a(q, k, v, backend=backend), lambda a: a(q, kb, vb, backend=backend))
    _same_after_a_good_call(OPEN, lambda a: a(q, k, v, backend=backend), lambda a: a(q, k, vb, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS, ids=["numpy", "triton"])
def test_a_mask_tensors_device_is_checked_after_a_good_call(backend):
    q, k, v = _qkv(device=_device(backend))
    doc = torch.zeros(B, S, dtype=torch.int32, device=_device(backend))
    meta = torch.zeros(B, S, dtype=torch.int32, device="meta")
    _same_after_a_good_call(DOCS, lambda a: a(q, k, v, doc=doc, backend=backend),
                            lambda a: a(q, k, v, doc=meta, backend=backend))


def test_contiguity_admission_holds_after_a_good_call():
    q, k, v = _qkv(device=triton_device())
    strided = torch.randn(B, H, D, S, device=triton_device()).transpose(2, 3)  # [B, H, S, d] with stride(-1) = S
    assert strided.shape == q.shape and strided.stride(-1) != 1
    _same_after_a_good_call(OPEN, lambda a: a(q, k, v, backend="triton"),
                            lambda a: a(q, strided, v, backend="triton"))
    _same_after_a_good_call(OPEN, lambda a: a(q, k, v, backend="triton"),
                            lambda a: a(strided, k, v, backend="triton"))


def test_a_rank_0_tensor_is_a_located_error():
    q, k, v = _qkv()
    fresh = _refusal(lambda: attnc.compile(OPEN)(torch.tensor(1.0), k, v))
    assert "rank 0" in fresh[1]
    _same_after_a_good_call(OPEN, lambda a: a(q, k, v), lambda a: a(q, torch.tensor(1.0), v))
