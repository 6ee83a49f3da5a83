"""The sink's gradient kernel (``kernels/sink_grad.py``: dL/dsink per (b, h) from LSE and D, one
launch of a backward with a sink) compiled for sm_90 on any machine (a stand-in driver names the
target, tests/sm90.py), with the generated ``sink_value`` of a tensor sink and of a constant one, as
``BackwardCalls._sink_grads`` launches it.  Its numerics: tests/numerics/test_triton_sinks.py in
the interpreter, tests/numerics/test_gluon_sinks.py on an H200."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import PREAMBLE, compile_script  # noqa: E402

SCRIPT = PREAMBLE + r'''
import torch
import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import launch as L
from attnc.backends.triton.emit import emit
from attnc.backends.triton.kernels.sink_grad import _sink_grad
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
    assert compile_script(SCRIPT)["compiled"] == [True, True]
