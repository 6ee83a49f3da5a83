"""Inputs that used to end in a traceback, a MemoryError or minutes of simulation (issue 35) end in
a located error, the same one on every backend."""
from __future__ import annotations

import numpy as np
import pytest

from attnc.compiler.errors import AttncError, InputError, SpecError
from attnc.compiler.lower import compile_spec
from tests.conftest import ROOT
from tests.e2e.test_runtime_hardening import run_cli

CAUSAL = ROOT / "examples" / "causal.attn"
BACKENDS = ("numpy", "triton", "ahbm")


@pytest.mark.parametrize("args, message", [
    (("plan", CAUSAL, "--ranks", "100000", "--kv-lens", "1024"),
     "a context-parallel plan over 100000 ranks needs about"),
    (("tune", CAUSAL, "--shapes", "99999999999:1:1", "--backend", "numpy"), "a call of B = 99999999999 requests"),
    (("run", CAUSAL, "--backend", "ahbm", "--sp", "999", "--kv-len", "8"),
     "sp = 999 PEs for each of 4 work items (B x H_kv) is 3996 PEs; the simulator runs at most 512"),
    (("ir", CAUSAL, "--output", ROOT), f"cannot write {ROOT}: Is a directory"),
])
def test_oversized_or_impossible_commands_are_located_errors(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and message in err, err


def test_segments_past_i32_is_refused_by_check():
    with pytest.raises(SpecError, match=r"1:51: error: 'max_len' of sample 'segments' must be at most 2147483647"):
        compile_spec("attention s { tensor doc: i32[b, s] ~ segments(8, 9223372036854775808) "
                     "mask = causal & doc[b, q] == doc[b, k] }")


@pytest.mark.parametrize("text", ["examples/no_such_spec", "no_such_spec", "specs/causal.atn"])
def test_a_missing_path_is_no_such_file_not_spec_text(text):
    import attnc
    with pytest.raises(SpecError, match=f"cannot read {text}: No such file or directory"):
        attnc.compile(text)


# ---------------------------------------------------------------- the PyTorch API, every backend
torch = pytest.importorskip("torch")


def _call(attn, backend, *args, **kw):
    try:
        attn(*args, backend=backend, **kw)
    except AttncError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_zero_is_an_input_error(backend):
    import attnc
    x = torch.zeros(1, 2, 8, 0)
    got = _call(attnc.compile("attention c { mask = causal }"), backend, x, x, x)
    assert got == ("InputError", "error: inputs: q/k have head dim 0 and v 0; a head dim is at least 1")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["q", "v", "doc"])
@pytest.mark.parametrize("value", [[[0] * 8], np.zeros((1, 8), np.int32)], ids=["list", "ndarray"])
def test_a_non_tensor_is_an_input_error(backend, where, value):
    import attnc
    attn = attnc.compile("attention d { tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }")
    args = {"q": torch.zeros(1, 2, 8, 16), "v": torch.zeros(1, 2, 8, 16), "doc": torch.zeros(1, 8, dtype=torch.int32)}
    args[where] = value
    got = _call(attn, backend, args["q"], torch.zeros(1, 2, 8, 16), args["v"], doc=args["doc"])
    assert got is not None and got[0] == "InputError" and "torch tensors" in got[1]


def test_the_triton_kernel_refuses_a_list_by_name():
    pytest.importorskip("triton")
    from attnc.backends.triton import runtime
    kernel = runtime.load(compile_spec("attention c { heads = 2 head_dim = 16 dtype = f32 mask = causal }"))
    x = torch.zeros(1, 2, 8, 16)
    with pytest.raises(InputError, match="'q' is a list; the Triton backend takes torch tensors"):
        kernel([[1.0]], x, x)


def test_a_manifest_that_is_not_one_is_an_input_error():
    from tests.numerics.test_append import LAYOUTS, Cache, compiled, new_rows, assert_untouched
    attn = compiled(LAYOUTS["paged_dense_hnd"])
    cache = Cache("paged_dense_hnd", [4, 7], [1, 2], seed=9)
    q, k_new, v_new = new_rows(cache)
    before = cache.snapshot()
    for backend in BACKENDS[:2]:
        with pytest.raises(InputError, match="manifest is a type; give an attnc.MicrobatchManifest"):
            attn.append(q, k_new, v_new, backend=backend, manifest=dict, q_lens=torch.tensor([1, 2]),
                        **cache.arrays)
    assert_untouched(cache, before)
