"""The Gluon backward's kernels (backends/triton/gluon_backward.py) compiled for sm_90 on any machine
(Triton's compiler, no GPU: a stand-in driver names the target, as tests/numerics/
test_triton_gluon_ptx.py does for the forward), with the constexprs its launch takes
(``kernel_constexprs``): the warp-specialized dK/dV and dQ passes on the tensor cores (wgmma) with
TMA loads and register reallocation, no atomics unless dQ is asked for by atomics; the fused dQ
(dq "fused", "fused_atomic": five GEMMs in the dK/dV pass, a dQ writer's float32 adds, ordered by
acquire / release counters in the deterministic mode) at d 64 and 128, causal, full and a
PARTIAL-mask score program with GQA, within shared memory.  Their numerics need an sm_90 GPU
(tests/numerics/test_triton_gluon_backward.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.conftest import ROOT  # noqa: E402

# Runs without TRITON_INTERPRET (the tests' conftest sets it): Gluon kernels do not interpret.
SCRIPT = r'''
import collections, json, re, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


from tests.sm90 import SM90  # (the stand-in driver: tests/sm90.py)


from attnc.backends.triton import gluon_backward as GB, launch as L
from attnc.backends.common import load_module
from attnc.backends.triton.emit import emit
from attnc.compiler.lower import compile_spec
if not GB.HAS_GLUON:
    print(json.dumps({"skip": "this Triton has no Gluon"})); sys.exit(0)
driver.set_active(SM90())
gl = GB.gl


def desc(rows, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return GB.TensorDescriptor.from_tensor(torch.empty(rows, block[1], dtype=torch.bfloat16), block, layout)


def ops_of(kernel):
    ops = collections.Counter()
    for line in kernel.asm["ptx"].splitlines():
        m = re.match(r"\s+(?:@%p\d+\s+)?([a-z][\w.]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def compile_passes(text, config, s_q, s_k):
    module = load_module(*(lambda s: (s.text, s.module_stem))(emit(compile_spec(text))))
    d = module.SPEC["D_QK"]
    kernels = GB.kernel_constexprs(module, config, s_q, s_k)
    ts = L.tensor_args(module, {})
    i32, f32, bf = (torch.empty(16, dtype=t) for t in (torch.int32, torch.float32, torch.bfloat16))
    out = {}
    fn, consts, options = kernels["dkdv"]
    kv = config.block_n // 2 if config.warp_specialize else config.block_n
    dqa = f32
    if config.dq in GB.FUSED:  # (the fused dQ's workspace: a float32 TMA descriptor)
        box = [config.block_m, d // GB.dq_split(d)]
        dqa = GB.TensorDescriptor.from_tensor(torch.empty(4096, d, dtype=torch.float32), box,
                                              gl.NVMMASharedLayout.get_default_for(box, gl.float32))
    args = (desc(4096, [config.block_m, d]), desc(4096, [kv, d]), desc(4096, [kv, d]), desc(4096, [config.block_m, d]),
            bf, bf, dqa, f32, f32, i32, i32, i32, i32, i32, ts, s_q, s_k, s_k - s_q, 0, 1, 1, 1, 4, 8)
    kernel = fn.warmup(*args, grid=(1,), **consts, **options)
    out["dkdv"] = ops_of(kernel)
    out["dkdv"]["shared"] = kernel.metadata.shared
    if "dq" in kernels:
        fn, consts, options = kernels["dq"]
        args = (desc(4096, [64, d]), desc(4096, [config.dq_block_n, d]), desc(4096, [config.dq_block_n, d]),
                desc(4096, [64, d]), bf, f32, f32, i32, i32, i32, ts, s_q, s_k, s_k - s_q, 0, 1, 1, 2, 8)
        out["dq"] = ops_of(fn.warmup(*args, grid=(1,), **consts, **options))
    return out


# (one call: GQA, a score program, PARTIAL blocks and tiles across S_q and S_k -- every path of the kernels)
softcap = "attention s { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal score = 30.0 * tanh(score / 30.0) }"
out = {"softcap_gqa_tails": compile_passes(softcap, GB.default_config(128), 333, 400)}
fused = lambda d, dq: GB.GluonBackwardConfig(**{**GB.default_config(d).__dict__, "dq": dq})
window = "attention w { heads = 4 / 2 head_dim = 64 dtype = bf16 mask = causal & q - k < 200 }"
out["fused_softcap_gqa_tails"] = compile_passes(softcap, fused(128, "fused"), 333, 400)
if len(sys.argv) > 1 and sys.argv[1] == "slow":  # (ATTNC_SLOW_COMPILE=1: CI time)
    out["fused_window_gqa_d64"] = compile_passes(window, fused(64, "fused"), 512, 512)
    out["fused_atomic_full_d128"] = compile_passes("attention f { heads = 2 head_dim = 128 dtype = bf16 mask = true }",
                                                   fused(128, "fused_atomic"), 512, 512)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx_ops():
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    slow = ["slow"] if os.environ.get("ATTNC_SLOW_COMPILE") == "1" else []
    run = subprocess.run([sys.executable, "-c", SCRIPT, *slow], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def test_the_backward_passes_compile_for_sm_90_on_the_tensor_cores(ptx_ops):
    case = "softcap_gqa_tails"
    for name in ("dkdv", "dq"):
        ops = ptx_ops[case][name]
        mma = sum(n for op, n in ops.items() if op.startswith("wgmma.mma_async"))
        # dK/dV: S^T, dP^T, dV, dK; dQ: S, dP, dQ -- each a chain of k16 steps, in both consumers
        assert mma >= (8 if name == "dkdv" else 6), (case, name, mma)
        assert any(op.startswith("cp.async.bulk.tensor") for op in ops), (case, name)
        assert any(op.startswith("setmaxnreg") for op in ops), (case, name)  # producer warp and consumers
        assert not any(op.startswith(("atom", "red.")) for op in ops), (case, name)  # deterministic: no atomics
        assert ops["ex2.approx.ftz.f32"] > 0


SLOW = pytest.mark.skipif(os.environ.get("ATTNC_SLOW_COMPILE") != "1", reason="CI time (ATTNC_SLOW_COMPILE=1)")


@pytest.mark.parametrize("case", ["fused_softcap_gqa_tails", pytest.param("fused_window_gqa_d64", marks=SLOW),
                                  pytest.param("fused_atomic_full_d128", marks=SLOW)])
def test_the_fused_dq_compiles_for_sm_90(case, ptx_ops):
    """One launch: the dK/dV pass with dQ's GEMM (five per entry), dQ added into the float32
    workspace by TMA reduce-add (bulk tensor operations, no per-element atomics), in the ordered
    mode behind an acquire-load spin and a release increment per entry and nowhere else, in the
    shared memory of one sm_90 program, without spilling."""
    ops = ptx_ops[case]["dkdv"]
    assert set(ptx_ops[case]) == {"dkdv"}  # no dQ pass
    mma = sum(n for op, n in ops.items() if op.startswith("wgmma.mma_async"))
    assert mma >= 10, mma
    assert any(op.startswith("cp.reduce.async.bulk.tensor") for op in ops), ops
    assert not any(op.startswith(("atom.global.gpu.relaxed", "red.global.gpu.relaxed")) for op in ops)  # no element adds
    assert not any(op.startswith(("ld.local", "st.local")) for op in ops)  # no spills
    ordered = not case.startswith("fused_atomic")
    release = sum(n for op, n in ops.items() if "release" in op)
    acquire = sum(n for op, n in ops.items() if "acquire" in op)
    assert (release > 0, acquire > 0) == (ordered, ordered), ops
    assert any(op.startswith("setmaxnreg") for op in ops) and any(op.startswith("cp.async.bulk.tensor") for op in ops)
    assert ops["shared"] <= 232448
