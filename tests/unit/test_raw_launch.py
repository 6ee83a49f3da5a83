"""``raw_launch.raw_launch``: a compiled kernel launched straight through its C launcher passes the
C function exactly the arguments Triton 3.6's own path would (``CudaLauncher.__call__`` and its
wrapper that expands each TensorDescriptor argument), and keeps each descriptor's encoding per
(address, shape, strides).  The launcher here is a stand-in with 3.6's calling convention; the
GPU tests (test_triton_gluon.py) run the real one and compare outputs."""
import types

import pytest

nv = pytest.importorskip("triton.backends.nvidia.driver", reason="the raw launch is NVIDIA Triton's")
from attnc.backends.triton import raw_launch  # noqa: E402

BASE = 13  # 3.6's leading launch arguments: grid (3), stream, function, cooperative, PDL, two scratch
#            buffers, packed metadata, launch metadata, the enter and exit hooks


class _Desc:
    def __init__(self, ptr, shape, strides):
        self.base = types.SimpleNamespace(data_ptr=lambda: ptr)
        self.shape, self.strides, self.padding = shape, strides, "zero"


def _encode(desc, meta):
    return [("tensormap", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]


def _wrapped(c_launch, positions: set, metas: list):
    """A wrapper with 3.6's free variables and contract: the leading arguments as they are, each
    descriptor argument (by position among the kernel's) expanded by the driver's
    ``make_tensordesc_arg``."""
    launcher, tensordesc_indices, tensordesc_meta = c_launch, positions, metas

    def inner(*args):
        order = sorted(tensordesc_indices)
        final = list(args[:BASE])
        for i, arg in enumerate(args[BASE:]):
            final.extend(nv.make_tensordesc_arg(arg, tensordesc_meta[order.index(i)])
                         if i in tensordesc_indices else [arg])
        return launcher(*final)
    return inner


def _kernel(c_launch, positions, metas, scratch=0):
    run = types.SimpleNamespace(launch=_wrapped(c_launch, positions, metas), global_scratch_size=scratch,
                                profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=True)
    return types.SimpleNamespace(run=run, function=0xF00D, packed_metadata=(4, 1, 227 * 1024))


def test_the_c_launcher_gets_what_the_wrapper_passes_and_encodings_are_kept(monkeypatch):
    monkeypatch.setattr(nv, "_BASE_ARGS_FORMAT_LEN", BASE, raising=False)
    encoded = []
    monkeypatch.setattr(nv, "make_tensordesc_arg", lambda d, m: encoded.append(d.base.data_ptr()) or _encode(d, m),
                        raising=False)
    calls = []
    kernel = _kernel(lambda *a: calls.append(a), {0, 1, 4}, [{"swizzle": 128}, {"swizzle": 64}, {"swizzle": 32}])
    q, k, o = _Desc(0x1000, [64, 128], [128, 1]), _Desc(0x2000, [64, 128], [128, 1]), _Desc(0x3000, [32, 16], [16, 1])
    args = (q, k, "out", 7, o, 1.5, None)
    grid, stream = (132, 1, 1), 0xABC
    # Triton 3.6's path: CudaLauncher.__call__ puts its fields and no scratch before the arguments
    kernel.run.launch(*grid, stream, kernel.function, False, True, None, None, kernel.packed_metadata, None, None,
                      None, *args)
    raw = raw_launch.raw_launch(kernel)
    assert raw is not None
    raw(grid, stream, args)
    assert calls[1] == calls[0]
    assert calls[0][BASE:BASE + 3] == (("tensormap", 0x1000, 128), 64, 128)
    n = len(encoded)
    raw(grid, stream, args)
    assert calls[2] == calls[0] and len(encoded) == n  # nothing encoded again
    moved = _Desc(0x4000, [32, 16], [16, 1])  # a new output at another address: encoded once
    raw(grid, stream, (q, k, "out", 7, moved, 1.5, None))
    assert len(encoded) == n + 1 and calls[3][BASE + 12] == ("tensormap", 0x4000, 32)


def test_an_argument_encoded_once_is_handed_over_as_it_is(monkeypatch):
    """``launch.encode(p, desc)`` (a bound launch's, ``bound.py``) encodes with position p's meta;
    the launch then passes that ``Encoded`` where the wrapper would have expanded the descriptor."""
    monkeypatch.setattr(nv, "_BASE_ARGS_FORMAT_LEN", BASE, raising=False)
    encoded = []
    monkeypatch.setattr(nv, "make_tensordesc_arg", lambda d, m: encoded.append(d.base.data_ptr()) or _encode(d, m),
                        raising=False)
    calls = []
    kernel = _kernel(lambda *a: calls.append(a), {0, 2}, [{"swizzle": 128}, {"swizzle": 32}])
    q, o = _Desc(0x1000, [64, 128], [128, 1]), _Desc(0x3000, [32, 16], [16, 1])
    grid, stream = (8, 1, 1), 0xABC
    kernel.run.launch(*grid, stream, kernel.function, False, True, None, None, kernel.packed_metadata, None, None,
                      None, q, 5, o)
    raw = raw_launch.raw_launch(kernel)
    assert raw.positions == (0, 2)
    eq, eo = raw.encode(0, q), raw.encode(2, o)
    assert isinstance(eq, raw_launch.Encoded) and eo[0] == ("tensormap", 0x3000, 32)
    n = len(encoded)
    raw(grid, stream, (eq, 5, eo))
    assert calls[1] == calls[0] and len(encoded) == n  # (nothing encoded at the launch)


def test_no_raw_launch_where_the_launcher_is_not_the_known_one(monkeypatch):
    monkeypatch.setattr(nv, "_BASE_ARGS_FORMAT_LEN", BASE, raising=False)
    monkeypatch.setattr(nv, "make_tensordesc_arg", _encode, raising=False)
    assert raw_launch.raw_launch(_kernel(print, {0}, [{"swizzle": 128}], scratch=256)) is None  # a scratch buffer
    other = _kernel(print, {0}, [{"swizzle": 128}])
    other.run.launch = lambda *a: None  # a wrapper of another shape
    assert raw_launch.raw_launch(other) is None
    monkeypatch.setattr(nv, "_BASE_ARGS_FORMAT_LEN", BASE + 1)  # another calling convention
    assert raw_launch.raw_launch(_kernel(print, {0}, [{"swizzle": 128}])) is None


def test_empty_hook_chains_do_not_count_as_hooks():
    chain = types.SimpleNamespace(calls=[])
    assert not raw_launch.hooked(None) and not raw_launch.hooked(chain)
    chain.calls.append(print)
    assert raw_launch.hooked(chain) and raw_launch.hooked(print)
