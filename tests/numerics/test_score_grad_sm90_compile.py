"""The Triton backward's score-tensor gradient kernel (backends/triton/kernels/tensor_grads.py)
compiled for sm_90 on any machine (a stand-in driver names the target, as
test_triton_sm90_compile.py does): bf16, d = 128, GQA, the GPU's default backward tiles, one launch
per reduction mode (bias[h, q, k]: the tile summed over the batch; slope[h]: per-query-tile partial
sums; kb[b, k]: key columns; rb[b, h, q]: query rows)."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import compile_script  # noqa: E402

SCRIPT = r'''
import json, sys, types
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)


from tests.sm90 import SM90  # (the stand-in driver: tests/sm90.py)


import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import grad as G, launch as L, score_grads as SG
from attnc.backends.triton.emit import emit
from attnc.compiler.plan import plan as make_plan
driver.set_active(SM90())
compiled = []


def warmup(self, grid, args, key=None, stream=None):  # every launch compiled only
    k = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
    if self.fn is SG._bwd_tensor_grad:  # tensor_gradients' launches
        compiled.append([self.constexprs[n] for n in ("KEEP_B", "KEEP_H", "KEEP_Q", "KEEP_K")] if k.asm["ptx"] else None)


L.Launcher.launch = warmup
text = ("attention lt { heads = 4 / 2 head_dim = 128 tensor bias: f32[h, s, s] tensor slope: f32[h] "
        "tensor kb: f32[b, s] tensor rb: f32[b, h, s] "
        "score = score + bias[h, q, k] - slope[h] * (q - k) + kb[b, k] + rb[b, h, q] "
        "score = softcap(score, 5.0) mask = causal }")
d, s, b = 128, 200, 2
program = attnc.compile(text).specialize(4, 2, d, d, "bf16")
module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
tensors = {"bias": torch.zeros(4, s, s), "slope": torch.zeros(4), "kb": torch.zeros(b, s), "rb": torch.zeros(b, 4, s)}
cfg = G.default_backward_config(d, d, False)
(bm1, bn1), (bm2, bn2) = cfg.tiles()
dq_plan = make_plan(program, b, s, s, {n: t.numpy() for n, t in tensors.items()}, bm2, bn2)
launch = G.BackwardLaunch(module, cfg, dq_plan.retile(bm1, bn1), dq_plan, (b, s, s), "cpu")
q, k = torch.zeros(b, 4, s, d, dtype=torch.bfloat16), torch.zeros(b, 2, s, d, dtype=torch.bfloat16)
SG.tensor_gradients(types.SimpleNamespace(program=program, module=module), launch, q, k, k, torch.zeros(b, 4, s),
                    torch.zeros(b, 4, s), q, L.call_tensor_args(module, tensors, b, s, s, "cpu"), tensors, tuple(tensors))
print(json.dumps({"compiled": compiled}))
'''


@pytest.mark.skipif(os.environ.get("ATTNC_SLOW_COMPILE") != "1",
                    reason="four kernels compile in about 15 s on 2 cores (ATTNC_SLOW_COMPILE=1); the GPU runs them")
def test_score_tensor_gradient_kernels_compile_for_sm_90():
    out = compile_script(SCRIPT)
    # bias[h, q, k], slope[h], kb[b, k] (h kept apart), rb[b, h, q]: (KEEP_B, KEEP_H, KEEP_Q, KEEP_K)
    assert out["compiled"] == [[False, True, True, True], [False, True, False, False], [True, True, False, True],
                               [True, True, True, False]]
