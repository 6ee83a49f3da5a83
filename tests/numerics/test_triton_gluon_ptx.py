"""The Gluon engine compiled for sm_90 on any machine (Triton's compiler and ptxas, no GPU: a
stand-in driver names the target): every way it takes a score program -- per cell, and the
separable form with its column part per key or per block, FP8 too -- compiles, and the
instructions it emits per cell are those the separable form promises (compiler/separable.py):
ALiBi per block costs plain causal's FMA and one subtraction per cell, with no conversion of
positions per key.  A spec's learned sink (``sink = sinks[h]``) compiles at head dims 64 (gpt-oss's
window, three consumers) and 128, with FP8 and the separable form, and over a paged cache: one
load of the sink per consumer and job, nothing per cell.  The engine's numerics need an sm_90 GPU
(tests/numerics/test_triton_gluon.py, test_gluon_sinks.py)."""
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


from attnc.backends.triton import choice as C, launch as L
from attnc.backends.triton.kernels import gluon_engine as G
from attnc.backends.common import load_module
from attnc.backends.triton.emit import emit
from attnc.compiler.lower import compile_spec
if not G.HAS_GLUON:
    print(json.dumps({"skip": "this Triton has no Gluon"})); sys.exit(0)
driver.set_active(SM90())


def compile_engine(text, mode, fp8=False, d=128, bn=None, consumers=2, p_perm=False):
    source = emit(compile_spec(text))
    module = load_module(source.text, source.module_stem)
    spec = L.spec_constexprs(module, 4096)
    keep = {n: spec[n] for n in ("VISIBLE", "SCORE", "HAS_SCORE", "SCALE", "H_Q", "H_KV", "GROUP")}
    sep = L.separable_constexprs(module, 4096 if mode else None)
    if mode:
        assert sep["SEPARABLE"] >= mode, sep
        sep["SEPARABLE"] = mode
    gl = G.gl
    dt, gdt = (torch.float8_e4m3fn, gl.float8e4nv) if fp8 else (torch.bfloat16, gl.bfloat16)
    def desc(rows, cols, block, dtype=dt, gdtype=gdt):
        layout = gl.NVMMASharedLayout.get_default_for(block, gdtype)
        return G.TensorDescriptor.from_tensor(torch.empty(rows, cols, dtype=dtype), block, layout)
    bn = bn or (128 if d <= 128 else 64)
    o = torch.empty(4096, d, dtype=torch.bfloat16)
    i32, f32 = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.float32)
    tensors = {n: torch.zeros((2, 4096) if len(a) == 2 else (8,), dtype=torch.float32)
               for n, (_, a) in module.TENSORS.items()}
    ts = L.tensor_args(module, tensors)
    v = desc(d * 32, 4096, [d, bn]) if fp8 else desc(4096, d, [bn, d])
    k = desc(4096, d, [bn, d])
    if p_perm:  # K's 5-d view and box (launch.PrefillLaunch._fp8_k_descriptor)
        box = [bn // 16, 2, 4, 2, d]
        k = G.TensorDescriptor(torch.empty(4096, d, dtype=dt), [4096 // 16, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1],
                               box, gl.NVMMASharedLayout.get_default_for(box, gdt))
    args = (desc(4096, d, [64, d]), k, v, desc(4096, d, [64, d], torch.bfloat16, gl.bfloat16),
            o, f32, i32, i32, i32, i32, i32, i32, i32, f32, f32, f32, ts, 256, 384, 128, 0, 1, 1, 2,
            1.4426950408889634, 8, i32, 1)  # (the non-finite flag, marked)
    maxnreg, regs, _ = C.gluon_regs(d, d, consumers)
    kernel = G._attn_fwd_ws.warmup(*args, grid=(1,), num_warps=4, maxnreg=maxnreg, MASK_FROM_ROWS=False, EVEN_Q=True,
                                   EVEN_K=True, ROWS_=64, BLOCK_N=bn, D=d, SAME_D=True, STAGES=2, HEAD_GROUP=4,
                                   CONSUMER_REGS=regs, PRODUCER_REGS=24, SCHEDULE=1, FP8=fp8,
                                   OVERLAP=C.gluon_overlap(d, d, fp8), ZERO_TAIL=False,
                                   PINGPONG=consumers == 2 and C.gluon_pingpong(d, d, fp8), CONSUMERS=consumers,
                                   P_PERM=p_perm, Q_BUFS=C.gluon_q_buffers(d, d, bn, 2, 1, fp8, 64 * consumers),
                                   **keep, **sep, **L.sink_constexprs(module))
    return ptx_counts(kernel)


def ptx_counts(kernel):
    ops = collections.Counter()
    for line in kernel.asm["ptx"].splitlines():
        m = re.match(r"\s+(?:@%p\d+\s+)?([a-z][\w.]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def compile_cache_engine(page, d=128, text="attention p {{ heads = 8 / 2 head_dim = {d} dtype = bf16 mask = causal }}"):
    """The engine over a paged cache (gluon_paged), pages of ``page`` rows, the separable form
    where the spec has one (launch.separable_constexprs at positions below 4096)."""
    from attnc.backends.triton.kernels import gluon_paged
    module = load_module(*(lambda s: (s.text, s.module_stem))(emit(compile_spec(text.format(d=d)))))
    spec = L.spec_constexprs(module, 4096)
    gl = G.gl
    def desc(rows, cols, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return G.TensorDescriptor.from_tensor(torch.empty(rows, cols, dtype=torch.bfloat16), block, layout)
    bn, chunk = 128, min(page, 128)
    i32, i8, i64 = (torch.empty(16, dtype=t) for t in (torch.int32, torch.int8, torch.int64))
    ts = L.tensor_args(module, {n: torch.zeros(8) for n in module.TENSORS})
    args = (desc(4096, 8 * d, [64, d]), desc(4096, 2 * d, [chunk, d]), desc(4096, 2 * d, [chunk, d]),
            desc(4096, 8 * d, [64, d]), torch.empty(4096, 8, d, dtype=torch.bfloat16),
            torch.empty(4096, 8, dtype=torch.float32), i32, i32, i32, i32, i8, i32, i32, i32, i32, i64, i32,
            16, page, 0, d, d, ts, 256, 1.4426950408889634 / 8)
    kernel = gluon_paged._paged_fwd_ws.warmup(
        *args, grid=(1,), num_warps=4, maxnreg=168, ROWS_=64, BLOCK_N=bn, D=d, STAGES=2, CONSUMER_REGS=240,
        PRODUCER_REGS=24, VISIBLE=spec["VISIBLE"], SCORE=spec["SCORE"], HAS_SCORE=spec["HAS_SCORE"],
        SCALE=spec["SCALE"],
        H_Q=8, GROUP=4, D_QK=d, PAGED=True, PAGE=page, CHUNK=chunk, OVERLAP=C.gluon_overlap(d, d, False),
        PINGPONG=C.gluon_pingpong(d, d, False), Q_BUFS=C.gluon_q_buffers(d, d, bn, 2),
        **L.separable_constexprs(module, 4096), **L.sink_constexprs(module))
    return ptx_counts(kernel)


heads = "heads = 8 / 2 head_dim = {d} dtype = bf16 mask = causal"
causal = "attention c {{ %s }}" % heads
alibi = "attention a {{ %s score = score - exp(-(h + 1) * log(2.0)) * (q - k) }}" % heads
keys = "attention k {{ %s tensor kb: f32[b, s] ~ uniform(-1, 1) score = score + kb[b, k] }}" % heads
sink = " tensor sinks: f32[h] sink = sinks[h] }}"
gpt_oss = "attention g {{ heads = 8 / 2 head_dim = {d} dtype = bf16 mask = causal & window(128)" + sink
cases = {"causal": (causal, 0, False, 128), "alibi": (alibi, 0, False, 128), "alibi_key": (alibi, 1, False, 128),
         "alibi_block": (alibi, 2, False, 128), "alibi_block_fp8": (alibi, 2, True, 128),
         "alibi_block_d64": (alibi, 2, False, 64), "key_bias_d256": (keys, 1, False, 256)}
out = {n: compile_engine(t.format(d=d), mode, fp8, d) for n, (t, mode, fp8, d) in cases.items()}
out["d64_two"] = compile_engine(causal.format(d=64), 0, False, 64)
out["d64_three"] = compile_engine(causal.format(d=64), 0, False, 64, bn=128, consumers=3)
out["fp8_256"] = compile_engine(causal.format(d=128), 0, True, 128, bn=256)
out["fp8_256_p_perm"] = compile_engine(causal.format(d=128), 0, True, 128, bn=256, p_perm=True)
out.update({f"paged{page}": compile_cache_engine(page) for page in (16, 256)})
out["paged_alibi"] = compile_cache_engine(16, text=alibi)
out["causal_sink"] = compile_engine(causal[:-3].format(d=128) + sink.format(), 0, False, 128)
out["gpt_oss_d64_three_sink"] = compile_engine(gpt_oss.format(d=64), 0, False, 64, bn=128, consumers=3)
out["alibi_block_fp8_sink"] = compile_engine(alibi[:-3].format(d=128) + sink.format(), 2, True, 128)
out["paged16_sink"] = compile_cache_engine(16, text=causal[:-3] + sink)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx_ops():
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (3.9's default, said aloud: FMAs)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def test_every_way_of_taking_a_score_program_compiles_for_sm_90(ptx_ops):
    scores = {n: ops for n, ops in ptx_ops.items() if n in ("causal", "alibi", "alibi_key", "alibi_block",
                                                            "alibi_block_fp8", "alibi_block_d64", "key_bias_d256")}
    assert len(scores) == 7
    for name, ops in scores.items():  # (the fixture compiled them: each has its MMAs and exponentials)
        assert any(op.startswith("wgmma.mma_async") for op in ops) and ops["ex2.approx.ftz.f32"] > 0, name


def test_alibi_per_block_costs_causals_cell_arithmetic_and_one_subtraction(ptx_ops):
    causal, block, per_key, per_cell = (ptx_ops[n] for n in ("causal", "alibi_block", "alibi_key", "alibi"))
    cells = causal["ex2.approx.ftz.f32"]  # one exponential per cell (and a few per row)
    assert block["ex2.approx.ftz.f32"] == cells
    assert abs(block["fma.rn.f32"] - causal["fma.rn.f32"]) <= 8  # the FMA replaces causal's s * qk_scale - m
    assert block["sub.f32"] - causal["sub.f32"] == cells  # y - (m - shift)
    assert block.get("neg.f32", 0) <= causal.get("neg.f32", 0)
    # positions are converted per job and per block, not per key (per key: every key, every block)
    assert block["cvt.rn.f32.s32"] - causal["cvt.rn.f32.s32"] < cells // 4 < per_key["cvt.rn.f32.s32"]
    # the score program per cell: a multiply, a subtraction, an FMA and a negation more per cell
    assert per_cell["fma.rn.f32"] - causal["fma.rn.f32"] >= cells - 8


def test_the_engine_over_a_cache_compiles_for_sm_90(ptx_ops):
    """gluon_paged's program compiles with pages smaller than a K/V block (several TMA copies into
    slices of a stage) and larger; each K and V block is copied by TMA."""
    copies = lambda ops: sum(n for op, n in ops.items() if op.startswith("cp.async.bulk.tensor"))  # noqa: E731
    small, large = copies(ptx_ops["paged16"]), copies(ptx_ops["paged256"])
    assert small > large > 0  # 8 copies per K and V block against 1


def test_the_engine_over_a_cache_takes_alibi_per_block(ptx_ops):
    """Appends over a cache take the separable form as prefill does: ALiBi costs causal's cell
    arithmetic and one subtraction per cell, positions converted per job and block, not per key."""
    causal, alibi = ptx_ops["paged16"], ptx_ops["paged_alibi"]
    cells = causal["ex2.approx.ftz.f32"]
    assert alibi["ex2.approx.ftz.f32"] == cells
    assert abs(alibi["fma.rn.f32"] - causal["fma.rn.f32"]) <= 8
    assert alibi["sub.f32"] - causal["sub.f32"] == cells
    assert alibi["cvt.rn.f32.s32"] - causal.get("cvt.rn.f32.s32", 0) < cells // 4


def test_three_consumer_warpgroups_compile_each_with_its_rows(ptx_ops):
    """192-row tiles (head dims <= 64): a third consumer partition, the same code per consumer."""
    two, three = ptx_ops["d64_two"], ptx_ops["d64_three"]
    assert 2 * three["ex2.approx.ftz.f32"] == 3 * two["ex2.approx.ftz.f32"]
    assert 2 * sum(n for op, n in three.items() if op.startswith("wgmma.mma_async")) == \
        3 * sum(n for op, n in two.items() if op.startswith("wgmma.mma_async"))


def test_fp8_p_operand_in_key_order_needs_no_shuffles(ptx_ops):
    """P_PERM: K's rows by a 5-d TMA box in the order P's accumulator already is the FP8 operand:
    the layout change's shuffles and byte permutes are gone (the row reductions' shuffles stay)."""
    plain, perm = ptx_ops["fp8_256"], ptx_ops["fp8_256_p_perm"]
    shuffles = lambda ops: sum(n for op, n in ops.items() if op.startswith("shfl.sync"))  # noqa: E731
    assert plain.get("prmt.b32", 0) > 0 and perm.get("prmt.b32", 0) == 0
    assert shuffles(perm) < shuffles(plain) // 2
    assert any(op.startswith("cp.async.bulk.tensor.5d") for op in perm)
    assert not any(op.startswith("cp.async.bulk.tensor.5d") for op in plain)


def test_a_sink_is_one_load_per_consumer_and_job_and_nothing_per_cell(ptx_ops):
    """The sink joins each row once, after its keys (``gluon_engine._ws_rows_out``): against the same
    launch without it, one more global load (the sink's ``sinks[h]``) per consumer warpgroup, the
    same MMAs and exponentials per cell, two more per row; gpt-oss's window at d 64 on 192-row
    tiles (three consumers), causal at d 128, FP8 with ALiBi per block, and over a paged cache."""
    pairs = {"causal_sink": ("causal", 2), "gpt_oss_d64_three_sink": ("d64_three", 3),
             "alibi_block_fp8_sink": ("alibi_block_fp8", 2), "paged16_sink": ("paged16", 2)}
    mma = lambda ops: sum(n for op, n in ops.items() if op.startswith("wgmma.mma_async"))  # noqa: E731
    for name, (base, consumers) in pairs.items():
        with_sink, without = ptx_ops[name], ptx_ops[base]
        assert with_sink["ld.global.b32"] - without.get("ld.global.b32", 0) == consumers, name
        assert mma(with_sink) == mma(without), name
        # the cells' exponentials unchanged; e^LSE and e^sink per row (each consumer thread holds two rows)
        assert 0 < with_sink["ex2.approx.ftz.f32"] - without["ex2.approx.ftz.f32"] <= 4 * consumers, name
