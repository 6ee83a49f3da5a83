"""Compile time of an f32 spec's kernels for sm_90 (Triton's compiler, no GPU: tests/sm90.py's
stand-in driver names the target), as the GPU launches them for the blocks of a larger call: the
ALiBi example (f32, d 64: its dots multiply in full f32, FMAs unrolled per thread) in the blocks of
test_triton_cp_blocks.py's alibi-32 case and of test_triton_fast_score.py's fast / exact score
forms.  On the H200 those two tests once spent 176 s and over 200 s compiling: the backward's
``_bwd_main`` on FlashAttention-2's tiles took 65-80 s per specialization on one core (71K lines
of PTX, spilled), three specializations a test; ``grad.f32_backward_config`` keeps it to seconds.

CI compiles one block of each case (the fast score form, then the exact one); ATTNC_SLOW_COMPILE=1
compiles every block of both, as the two tests launch them on the GPU.  Each compile is timed in a
fresh Triton cache; the PTX size bounds the backward's code whatever the machine's speed."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from tests.sm90 import PREAMBLE, compile_script  # noqa: E402

# Runs without TRITON_INTERPRET (the tests' conftest sets it): the kernels are compiled, not interpreted.
SCRIPT = PREAMBLE + r'''
import os, shutil, tempfile, time
from dataclasses import replace
from pathlib import Path
import numpy as np, torch
from attnc.backends.triton import device, launch as L, runtime
from attnc.compiler import inputs
from attnc.compiler.analysis.tiles import PARTIAL
from attnc.compiler.cp import plan_cp
from attnc.compiler.fast_score import FAST_POSITIONS as LIMIT
from attnc.compiler.lower import compile_file

os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="attnc-compile-time-")  # (every kernel compiled)
compiled = []


def warmup(self, grid, args, key=None, stream=None):  # Launcher.launch, compiling only, timed
    t0 = time.perf_counter()
    kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
    score = self.constexprs.get("SCORE", self.constexprs.get("SCORE_GRAD"))
    compiled.append({"kernel": self.fn.__name__, "s": round(time.perf_counter() - t0, 2),
                     "ptx_lines": kernel.asm["ptx"].count("\n"), "score": getattr(score, "__name__", None)})


L.Launcher.launch = warmup
device.capability = lambda d=None: 90  # the H200's: the blocks' forward config reads it
available = torch.cuda.is_available
torch.cuda.is_available = lambda: True  # (a kernel object without a GPU: only its launches run, compiling)
program = compile_file(Path("examples/alibi.attn"))
program = replace(inputs.contiguous_variant(program), heads_q=2, heads_kv=2)  # (the tests' _small)
kernel = runtime.load(program)
torch.cuda.is_available = available
h, d = program.heads_q, program.d_qk


def block(args, q_range, k_range, lengths):
    """Compile a block's forward and backward launches (test_triton_cp_blocks' calls)."""
    rows, keys = q_range[1] - q_range[0], k_range[1] - k_range[0]
    q, k = torch.zeros(1, h, rows, d), torch.zeros(1, h, keys, d)
    o, lse = kernel.block(q, k, k.clone(), args, {}, lengths)
    kernel.block_backward(q, k, k.clone(), o, lse, q.clone(), None, args, {}, lengths)


ALL = sys.argv[1] == "all"
out = {}
# test_triton_cp_blocks.py[alibi-32]: a 56-token call on two ranks, 32-token CP tiles, even split
cp = plan_cp(program, 1, 56, 2, {}, block=32, strategy="even")
cuts = [(0, cp.tiles // 2), (cp.tiles // 2, cp.tiles)]
compiled.clear()
for rows in cuts:
    for keys in cuts:
        args = cp.block_args(rows, keys)
        if args is not None and (ALL or not compiled):
            block(args, cp.tile_range(*rows), cp.tile_range(*keys), (56, 56))
out["cp_alibi_32"] = compiled[:]
# test_triton_fast_score.py: 16 rows x 32 keys at the fast form's limit (fast), across it and at
# 2**24 (exact)
compiled.clear()
for n, (q_off, k_off) in enumerate(((LIMIT - 16, LIMIT - 32), (LIMIT - 8, LIMIT - 24), (2**24, 2**24 - 16))):
    if ALL or n == 1:
        args = {"classes": np.full((1, 1, 1, 2), PARTIAL, np.int8), "block_m": 16, "block_n": 16,
                "q_offset": q_off, "k_offset": k_off}
        end = L.position_end(16, 32, (q_off, k_off))
        block(args, (q_off, q_off + 16), (k_off, k_off + 32), (end, end))
out["fast_score"] = compiled[:]
shutil.rmtree(cache, ignore_errors=True)
print(json.dumps(out))
'''

KERNEL_S = 30  # seconds per kernel (here: 2-3; FlashAttention-2's tiles took 61-79 s for _bwd_main)
BACKWARD_PTX_LINES = 20000  # _bwd_main's PTX (here: about 7K lines; FlashAttention-2's tiles: 71K)
SLOW = os.environ.get("ATTNC_SLOW_COMPILE") == "1"


@pytest.mark.parametrize("blocks", ["one", pytest.param("all", marks=pytest.mark.skipif(
    not SLOW, reason="CI time: every block of both tests, about 25 s on 2 cores (ATTNC_SLOW_COMPILE=1)"))])
def test_f32_block_kernels_compile_for_sm_90_in_seconds(blocks):
    out = compile_script(SCRIPT, blocks)
    assert set(out) == {"cp_alibi_32", "fast_score"}
    for case, kernels in out.items():
        names = [k["kernel"] for k in kernels]
        assert {"_attn_fwd", "_bwd_delta", "_bwd_main"} <= set(names), (case, names)
        for k in kernels:
            assert k["s"] < KERNEL_S, (case, k)
            if k["kernel"] == "_bwd_main":
                assert k["ptx_lines"] < BACKWARD_PTX_LINES, (case, k)
    forms = {k["score"] for case in out.values() for k in case if k["kernel"] == "_bwd_main"}
    assert forms == {"score_grad_fast", "score_grad"}  # both score forms' backward compiled
    if blocks == "all":  # every block the two tests launch: 3 blocks each, forward and backward
        assert [k["kernel"] for k in out["cp_alibi_32"]].count("_bwd_main") == 3
        assert [k["kernel"] for k in out["fast_score"]].count("_bwd_main") == 3
        assert sum(k["s"] for case in out.values() for k in case) < 4 * KERNEL_S  # (was over 400 s)
