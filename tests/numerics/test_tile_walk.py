"""The numpy program follows the tile plan: SKIP tiles are never read, FULL tiles take no
element mask, PARTIAL tiles mask before the update, and data-dependent representable
masks are evaluated from the interval vectors instead of the tensors."""
import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.backends.numpy import runtime
from attnc.compiler import inputs, numerics
from attnc.compiler.ir import TileClass
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import EXAMPLES

SHAPES = {"prefill": (72, 72), "append": (20, 72), "decode": (1, 72)}


def run(program, arrays, **kw):
    kernel = runtime.load(program)
    return kernel, kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                          **{t.name: arrays[t.name] for t in program.tensors}, **kw)


@pytest.mark.parametrize("phase", SHAPES)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_visited_tiles_match_the_plan_and_the_oracle(path, phase):
    program = inputs.contiguous_variant(compile_file(path))
    s_q, s_k = SHAPES[phase]
    arrays = inputs.sample(program, 2, s_q, s_k, seed=7)
    call = inputs.validate(program, arrays)
    kernel = runtime.load(program)
    plan = kernel.plan(2, s_q, s_k, call.tensors, block_m=16, block_n=16)
    stats = {}
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], plan=plan, return_lse=True, stats=stats,
                    **{t.name: arrays[t.name] for t in program.tensors})
    # the plan's tiles are per (b', h'); the kernel visits them once per request and head
    reps = (2 // plan.intervals.shape[0]) * (program.heads_q // plan.intervals.shape[1])
    assert stats == {n: c * reps for n, c in plan.tiles.counts().items()}
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (co, cl)


@pytest.mark.parametrize("name", ["sliding_window_causal", "chunked", "causal_document", "sink_window"])
def test_kv_in_skipped_blocks_is_never_read(name, monkeypatch):
    """Poison K/V with NaN wherever every tile of a key block is SKIP: the output stays finite
    and equal to the oracle on clean inputs.  (A call refuses a non-finite V before attending,
    numerics.check_values; the check is switched off here to trap the kernel's reads.)"""
    monkeypatch.setattr(numerics, "check_values", lambda *a, **kw: None)
    program = inputs.contiguous_variant(compile_file(f"examples/{name}.attn"))
    s_q, s_k = 1, 96
    arrays = inputs.sample(program, 1, s_q, s_k, seed=3)
    call = inputs.validate(program, arrays)
    kernel = runtime.load(program)
    plan = kernel.plan(1, s_q, s_k, call.tensors, block_m=16, block_n=16)
    skipped = (plan.tiles.classes == TileClass.SKIP).all(axis=(0, 1, 2))
    assert skipped.any(), "the example should skip some K/V blocks in decode"
    poisoned = {n: a.copy() for n, a in arrays.items()}
    for j in np.flatnonzero(skipped):
        poisoned["k"][:, :, j * 16:(j + 1) * 16] = np.nan
        poisoned["v"][:, :, j * 16:(j + 1) * 16] = np.nan
    o, lse = kernel(poisoned["q"], poisoned["k"], poisoned["v"], plan=plan, return_lse=True,
                    **{t.name: arrays[t.name] for t in program.tensors})
    assert np.isfinite(o).all()
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    assert numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse)[0].ok


def test_full_tiles_take_no_element_mask():
    """Every tile of this mask is FULL or SKIP: the kernel evaluates no element mask at all."""
    program = compile_spec("attention f { heads = 2 head_dim = 8 dtype = f32 tensor t: i32[b, s] "
                           "mask = q >= t[b, k] }")
    s = 40
    t = np.zeros((1, s), np.int32)
    t[0, 32:] = 100  # columns 32.. are never visible (SKIP); the rest are FULL
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, s, 8), dtype=np.float32) for _ in range(3))
    kernel = runtime.load(program)
    plan = kernel.plan(1, s, s, {"t": t}, block_m=8, block_n=8)
    assert set(np.unique(plan.tiles.classes)) == {TileClass.SKIP, TileClass.FULL}
    stats = {}
    o, lse = kernel(q, k, v, plan=plan, return_lse=True, stats=stats, t=t)
    assert stats["partial"] == 0 and stats["full"] == 2 * 5 * 4 and stats["skip"] == 2 * 5 * 1
    ref_o, _ = oracle.reference(program, q, k, v, {"t": t})
    np.testing.assert_allclose(o, ref_o, atol=2e-5)


def test_representable_data_dependent_mask_reads_intervals_not_tensors():
    program = inputs.contiguous_variant(compile_file("examples/causal_document.attn"))
    arrays = inputs.sample(program, 2, 64, 64, seed=5)
    call = inputs.validate(program, arrays)
    kernel = runtime.load(program)
    plan = kernel.plan(2, 64, 64, call.tensors, block_m=16, block_n=16)
    assert plan.mask_from_intervals
    scrambled = np.zeros_like(arrays["doc"])  # the kernel must not consult doc again
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], plan=plan, return_lse=True, doc=scrambled)
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    assert all(c.ok for c in numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse))


def test_a_plan_for_another_shape_is_refused():
    program = compile_file("examples/causal.attn")
    arrays = inputs.sample(program, 1, 8, 32)
    kernel = runtime.load(program)
    plan = kernel.plan(1, 8, 16)
    with pytest.raises(Exception, match="plan was made for S_k = 16, the call has S_k = 32"):
        kernel(arrays["q"], arrays["k"], arrays["v"], plan=plan)
