"""The Triton kernels of small-head f32 training calls compiled for sm_90 on any machine (Triton's
compiler, no GPU: a stand-in driver names the target), as the GPU would launch them: the forward
with the launch layer's choice at capability 90 (TMA where the head dim is a power of two from 16
up: a TMA box of d < 16 columns would not match the kernel's 16-wide padded tiles, the "input and
other must have equal reduction dimensions" of issue 33) and the backward's passes with the GPU's
default config.  The calls are those of test_training.py's GPU tests and test_triton_backward.py's
dLSE test; their numerics run on the GPU (ATTNC_TEST_GPU=1) and in the interpreter."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import compile_script  # noqa: E402

# Runs without TRITON_INTERPRET (the tests' conftest sets it): the kernels are compiled, not interpreted.
SCRIPT = r'''
import json, sys
import numpy as np, torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)


from tests.sm90 import SM90  # (the stand-in driver: tests/sm90.py)


import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import choice as C, grad as G, launch as L, plans as P
from attnc.backends.triton.emit import emit
from attnc.compiler.plan import plan as make_plan
driver.set_active(SM90())
compiled = []


def warmup(self, grid, args, key=None, stream=None):  # Launcher.launch, compiling only
    kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
    compiled.append(kernel.asm["ptx"] and self.fn.__name__)
L.Launcher.launch = warmup


def call(text, heads, d, s, tensors, dlse=False):
    """Compile the forward (and, with BACKWARD set, the backward) of an f32 call [1, heads, s, d]."""
    h_q, h_kv = heads
    program = attnc.compile(text).specialize(h_q, h_kv, d, d, "f32")
    module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
    host = {n: t.numpy().astype(np.int64) if t.dtype == torch.int32 else t.numpy() for n, t in tensors.items()}
    ts = L.call_tensor_args(module, tensors, 1, s, s, "cpu")
    q, k, lse = torch.empty(1, h_q, s, d), torch.empty(1, h_kv, s, d), torch.empty(1, h_q, s)
    config, plan = C.choose_prefill(program, s, s, lambda bm, bn: make_plan(program, 1, s, s, host, bm, bn),
                                    asked={}, tuned=None, contiguous=True, device_capability=90, given_plan=None)
    L.PrefillLaunch(module, config, P.upload(P.walk_arrays(plan), "cpu"), (1, s, s), "cpu")(
        q, k, k, ts, q.clone(), lse, None)
    if not BACKWARD:
        return {"use_tma": config.use_tma, "kernels": compiled[:]}
    cfg = G.default_backward_config(d, d, False, program.dtype == "f32")  # (what the GPU launches)
    (bm1, bn1), (bm2, bn2) = cfg.tiles()
    dq_plan = make_plan(program, 1, s, s, host, bm2, bn2)
    G.BackwardLaunch(module, cfg, dq_plan.retile(bm1, bn1), dq_plan, (1, s, s), "cpu")(
        q, k, k, q, lse, q, lse if dlse else None, ts, q.clone(), k.clone(), k.clone())
    return {"use_tma": config.use_tma, "kernels": compiled[:]}


DOC = "attention d { tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"
BIAS = "attention lb { tensor bias: f32[h, s, s] score = score + bias[h, q, k] score = softcap(score, 5.0) mask = causal }"
BACKWARD = len(sys.argv) > 1 and sys.argv[1] == "backward"
out = {}
cases = {"doc_d8": (DOC, (4, 2), 8, 16, {"doc": torch.zeros(1, 16, dtype=torch.int32)}),
         "bias_d4": (BIAS, (2, 2), 4, 6, {"bias": torch.zeros(2, 6, 6)}),
         "dlse_d16": ("attention l { mask = causal }", (2, 2), 16, 17, {}, True)}
if not BACKWARD:  # (the forward's TMA at d = 16 is the unit tests' default config; CI time)
    del cases["dlse_d16"]
for name, args in cases.items():
    compiled.clear()
    out[name] = call(*args)
print(json.dumps(out))
'''


@pytest.mark.parametrize("passes", ["forward", "backward"])  # (the backward's f32 tiles compile in seconds: grad.F32_TILES)
def test_small_head_f32_training_kernels_compile_for_sm_90(passes):
    out = compile_script(SCRIPT, passes)
    assert set(out) == {"doc_d8", "bias_d4", *(("dlse_d16",) if passes == "backward" else ())}
    for name, got in out.items():  # the forward, D = rowsum(dO * O) - dLSE, and the fused dK/dV + dQ pass
        assert got["kernels"] == ["_attn_fwd", "_bwd_delta", "_bwd_main"][:3 if passes == "backward" else 1], \
            (name, got)
    assert not out["doc_d8"]["use_tma"] and not out["bias_d4"]["use_tma"]
    assert out.get("dlse_d16", {"use_tma": True})["use_tma"]
