"""The kernels that mark a call's non-finite rows themselves, compiled for sm_90 on any machine (a
stand-in driver names the target, tests/sm90.py): the split producer and combine over one uint8
workspace at byte offsets (``_split_at`` / ``_combine_at``: the field pointers cast in the kernel)
and the Triton prefill kernel, each with and without the mark (MARK 1 with the flag, 0), as a GPU
call launches them (``launch.SplitLaunch.bind``, ``launch.PrefillLaunch``): MARK = 1 is specialized,
so the marked kernels are compilations of their own.  Their numerics run in the interpreter
(tests/numerics/test_launch_counts.py) and on the GPU.  Minutes of compiling on 2 cores without
Triton's cache: ATTNC_SLOW_COMPILE=1."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import compile_script  # noqa: E402

# Runs without TRITON_INTERPRET (the tests' conftest sets it): the kernels are compiled, not interpreted.
SCRIPT = r'''
import json, re, sys
import numpy as np, torch
from triton.runtime import driver
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)


from tests.sm90 import SM90  # (the stand-in driver: tests/sm90.py)


import attnc
from attnc.backends.common import load_module
from attnc.backends.triton import choice as C, decode as D, launch as L, plans as P
from attnc.backends.triton.emit import emit
from attnc.backends.triton.split_calls import SplitCalls
from attnc.compiler.plan import plan as make_plan
driver.set_active(SM90())
stores = []


def warmup(self, grid, args, key=None, stream=None):  # Launcher.launch, compiling only
    ptx = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options).asm["ptx"]
    stores.append([self.fn.__name__, len(re.findall(r"\bst\.global", ptx)), hash(ptx)])
L.Launcher.launch = warmup
bf = torch.bfloat16
flag = torch.zeros(1, dtype=torch.int32)

# decode: paged nhd, GQA 32/8, d 128 (attnc bench decode's case)
program = attnc.compile("attention p { dtype = bf16 mask = causal cache = paged(page_size = 16, layout = nhd) }"
                        ).specialize(32, 8, 128, 128, "bf16")
module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
b, t = 4, 256
kc = torch.empty(b * t // 16, 16, 8, 128, dtype=bf)
plan = dict(D.decode_plan(program, {"k_cache": kc, "v_cache": kc, "kv_lens": torch.full((b,), t, dtype=torch.int32),
                                    "block_table": torch.arange(b * t // 16, dtype=torch.int32).view(b, -1)},
                          engine="split"))
plan["k_strides"], plan["v_strides"] = D.cache_strides("paged", "nhd", kc, kc)
arrays = SplitCalls.decode_args(plan, "cpu")
q = torch.empty(b, 32, 128, dtype=bf)
call = L.SplitLaunch(module).bind(b, q.stride(), plan, arrays, L.tensor_args(module, {}, (arrays["kv_lens"],
                                                                                          arrays["qo_indptr"])))
for mark in (flag, None):
    call(q, kc, kc, torch.empty(b, 32, 128, dtype=bf), torch.empty(b, 32), torch.empty(call.size, dtype=torch.uint8),
         mark)

# prefill: the Triton kernel (engine="triton": the Gluon engine takes such calls on Hopper), causal, d 128
program = attnc.compile("attention c { dtype = bf16 mask = causal }").specialize(4, 4, 128, 128, "bf16")
module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
s = 256
config, plan = C.choose_prefill(program, s, s, lambda bm, bn: make_plan(program, 1, s, s, {}, bm, bn),
                                asked={"engine": "triton"}, tuned=None, contiguous=True, device_capability=90,
                                given_plan=None)
launch = L.PrefillLaunch(module, config, P.upload(P.walk_arrays(plan), "cpu"), (1, s, s), "cpu")
x = torch.empty(1, 4, s, 128, dtype=bf)
for mark in (flag, None):
    launch(x, x, x, (), torch.empty_like(x), torch.empty(1, 4, s), None, flag=mark)
print(json.dumps({"engine": config.engine, "stores": stores}))
'''


@pytest.mark.skipif(os.environ.get("ATTNC_SLOW_COMPILE") != "1",
                    reason="compiling the split, combine and prefill kernels takes minutes on 2 cores "
                           "(ATTNC_SLOW_COMPILE=1); the GPU runs them")
def test_the_marking_kernels_compile_for_sm_90():
    out = compile_script(SCRIPT, timeout=900)
    assert out["engine"] == "triton"
    names = [name for name, _, _ in out["stores"]]
    assert names == ["_split_at", "_combine_at", "_split_at", "_combine_at", "_attn_fwd", "_attn_fwd"], out
    (_, s1, split_marked), (_, c1, combine_marked), (_, s0, split_plain), (_, c0, combine_plain), \
        (_, f1, fwd_marked), (_, f0, fwd_plain) = out["stores"]
    assert split_marked == split_plain and s1 == s0 > 0  # (the producer does not mark)
    # MARK = 1 is specialized (the launch keys say which): the marked combine and prefill kernel are
    # their own compilations, each storing O, LSE and the flag (MARK = 0: the store behind a branch)
    assert combine_marked != combine_plain and fwd_marked != fwd_plain, out
    assert c1 >= 3 and f1 >= 3, out
