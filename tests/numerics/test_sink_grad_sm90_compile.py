"""The sink's gradient kernel (``kernels/sink_grad.py``: dL/dsink per (b, h) from LSE and D, one
launch of a backward with a sink) compiled for sm_90 on any machine (a stand-in driver names the
target, tests/sm90.py), with the generated ``sink_value`` of a tensor sink and of a constant one, as
``BackwardCalls._sink_grads`` launches it.  Its numerics: tests/numerics/test_triton_sinks.py in
the interpreter, tests/numerics/test_gluon_sinks.py on an H200."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.conftest import ROOT  # noqa: E402

SCRIPT = r'''
import json, sys
import torch
from triton.runtime import driver
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)
from tests.sm90 import SM90
import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import launch as L
from attnc.backends.triton.emit import emit
from attnc.backends.triton.kernels.sink_grad import _sink_grad
driver.set_active(SM90())
out = []
for sink in ("sinks[h]", "1.5"):
    text = "attention g { tensor sinks: f32[h] mask = causal & window(128) sink = %s }" % sink
    program = attnc.compile(text).specialize(64, 8, 64, 64, "bf16")
    module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
    ts = L.tensor_args(module, {"sinks": torch.zeros(64)})
    lse = torch.empty(2, 64, 300)
    k = _sink_grad.warmup(lse, lse, torch.empty(2, 64), ts, 300, SINK=module.sink_value, H_Q=64, BLOCK=256,
                          num_warps=4, grid=(128,))
    out.append(len(k.asm["ptx"]) > 0)
print(json.dumps({"compiled": out}))
'''


def test_the_sink_gradient_kernel_compiles_for_sm_90():
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["compiled"] == [True, True]
