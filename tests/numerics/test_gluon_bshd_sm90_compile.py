"""The Gluon engine reading token-major (bshd) q, k, v views and writing O token-major, compiled
for sm_90 on any machine (Triton's compiler and ptxas, no GPU: a stand-in driver names the target,
tests/sm90.py) through the launch layer as a GPU call takes it: ``choice.gluon_layouts`` on the
call's tensors, ``choose_prefill`` at capability 90, ``PrefillLaunch``'s descriptors and constexprs,
the kernel compiled by ``warmup`` instead of launched.  Cases: all four token-major at d 128 (two
consumers, pingpong) with S across the tiles (the masked epilogue), GQA; d 64 on three consumers;
q and O token-major over contiguous K/V (a cache's concatenation); a sink.  Their numerics need an
sm_90 GPU (tests/numerics/test_triton_gluon.py, ATTNC_TEST_GPU=1).  Run under Triton 3.6 (the GPU
machine's) by putting its copy first on PYTHONPATH."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import PREAMBLE, compile_script  # noqa: E402

SCRIPT = PREAMBLE + r'''
import numpy as np, torch
import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import choice as C, launch as L, plans as P
from attnc.backends.triton.emit import emit
from attnc.backends.triton.kernels import gluon_engine as G
from attnc.compiler.plan import plan as make_plan
if not G.HAS_GLUON:
    print(json.dumps({"skip": "this Triton has no Gluon"})); sys.exit(0)
compiled = []


def warmup(self, grid, args, key=None, stream=None):  # Launcher.launch, compiling only
    kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
    compiled.append({"kernel": self.fn.__name__, "ptx": bool(kernel.asm["ptx"]),
                     **{n: self.constexprs[n] for n in ("Q_BSHD", "K_BSHD", "V_BSHD", "O_BSHD", "CONSUMERS")}})
L.Launcher.launch = warmup
L.sm_count = lambda device: 132  # (no GPU to ask)


def view(b, h, s, d, token_major):
    """A logical bhsd bf16 tensor: [B, S, H, d] memory transposed, or contiguous."""
    if token_major:
        return torch.zeros(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    return torch.zeros(b, h, s, d, dtype=torch.bfloat16)


def call(text, heads, d, b, s, qo_bshd, kv_bshd, tensors=None):
    h_q, h_kv = heads
    program = attnc.compile(text).specialize(h_q, h_kv, d, d, "bf16")
    module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
    tensors = tensors or {}
    ts = L.call_tensor_args(module, tensors, b, s, s, "cpu")
    q, k, v = view(b, h_q, s, d, qo_bshd), view(b, h_kv, s, d, kv_bshd), view(b, h_kv, s, d, kv_bshd)
    o_order = attnc.layouts.out_order(q.shape, q.stride())
    layouts = C.gluon_layouts(q, k, v, o_order)
    host = {n: t.numpy() for n, t in tensors.items()}
    config, plan = C.choose_prefill(program, s, s, lambda bm, bn: make_plan(program, b, s, s, host, bm, bn),
                                    asked={}, tuned=None, contiguous=False, device_capability=90, layouts=layouts)
    o = attnc.layouts.new_out(q, (b, h_q, s, d), o_order)
    lse = torch.empty(b, h_q, s)
    compiled.clear()
    L.PrefillLaunch(module, config, P.upload(P.walk_arrays(plan), "cpu"), (b, s, s), "cpu")(q, k, v, ts, o, lse, None)
    return {"engine": config.engine, "layouts": list(config.layouts), "describe": config.describe(),
            "compiled": compiled[:]}


SINK = "attention g { tensor sinks: f32[h] mask = causal & window(128) sink = sinks[h] }"
out = {"d128_all_bshd_gqa": call("attention c { mask = causal }", (8, 2), 128, 2, 300, True, True),
       "d64_three_consumers": call("attention c { mask = causal }", (4, 4), 64, 2, 200, True, True),
       "d128_q_bshd_kv_contiguous": call("attention f { mask = true }", (4, 2), 128, 2, 256, True, False),
       "d64_sink": call(SINK, (8, 2), 64, 2, 256, True, True, {"sinks": torch.zeros(8)})}
print(json.dumps(out))
'''


def test_the_engine_compiles_for_sm_90_on_token_major_views():
    out = compile_script(SCRIPT)
    for name, got in out.items():
        assert got["engine"] == "gluon", (name, got)
        assert len(got["compiled"]) == 1 and got["compiled"][0]["kernel"] == "_attn_fwd_ws", (name, got)
        assert got["compiled"][0]["ptx"], name
    flags = {n: [g["compiled"][0][f] for f in ("Q_BSHD", "K_BSHD", "V_BSHD", "O_BSHD")] for n, g in out.items()}
    assert flags["d128_all_bshd_gqa"] == [True] * 4
    assert flags["d64_three_consumers"] == [True] * 4 and out["d64_three_consumers"]["compiled"][0]["CONSUMERS"] == 3
    assert flags["d128_q_bshd_kv_contiguous"] == [True, False, False, True]
    assert out["d128_q_bshd_kv_contiguous"]["layouts"] == ["bshd", "bhsd", "bhsd", "bshd"]
    assert "q/k/v/o bshd/bhsd/bhsd/bshd" in out["d128_q_bshd_kv_contiguous"]["describe"]
    assert flags["d64_sink"] == [True] * 4
