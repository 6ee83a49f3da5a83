"""The Triton split-K/V decode kernel (CPU interpreter unless ATTNC_TEST_GPU=1): every cache
layout × state ABI × MHA/GQA against the float64 oracle, with NaN in every cache row no
request owns (the tails are never read), lengths that are not multiples of the page size,
and masks that skip K/V blocks in decode."""
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, ir, numerics  # noqa: E402
from attnc.compiler.errors import PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

# 8-key tiles exercise many blocks under the interpreter; a GPU's tl.dot needs 16 (runtime.GPU_MIN_TILE)
TILE = 8 if runtime.interpreted() else runtime.GPU_MIN_TILE

LENS = np.array([53, 16, 1, 37])
PAGE = 8


def _spec(mask, cache, heads="8 / 2", state="lse_o", decl=""):
    return compile_spec(f"attention d {{ heads = {heads} head_dim = 16 dtype = f32 {decl} mask = {mask} "
                        f"cache = {cache} state = {state} }}")


def _logical(program, seed=0):
    cont = replace(program, cache=ir.Cache())  # logical bhsd arrays for the reference
    return cont, inputs.sample(cont, len(LENS), 1, int(LENS.max()), seed=seed)


def _paged(x, rng, order):
    """x [B, H, T, d] -> (cache [pages, P, H, d] or hnd, block table, csr arrays); unused rows are NaN."""
    b_, h_, _, d_ = x.shape
    npages = [-(-int(n) // PAGE) for n in LENS]
    pool = sum(npages) + 2
    ids = rng.permutation(pool)
    cache = np.full((pool, PAGE, h_, d_), np.nan, np.float32)
    table = np.full((b_, max(npages) + 1), 0, np.int32)
    c = 0
    for b in range(b_):
        for j in range(npages[b]):
            table[b, j] = ids[c]
            n = min(PAGE, LENS[b] - j * PAGE)
            cache[ids[c], :n] = x[b, :, j * PAGE:j * PAGE + n].transpose(1, 0, 2)
            c += 1
    if order == "hnd":
        cache = np.ascontiguousarray(cache.transpose(0, 2, 1, 3))
    csr = {"kv_indptr": np.r_[0, np.cumsum(npages)],
           "kv_indices": np.concatenate([table[b, :npages[b]] for b in range(b_)]),
           "kv_last_page_len": np.array([n - (p - 1) * PAGE for n, p in zip(LENS, npages)])}
    return cache, table, csr


def _check(program, cont, arrays, o, lse):
    tens = {t.name: arrays[t.name] for t in program.tensors}
    for b, n in enumerate(LENS):
        call = inputs.validate(cont, {"q": arrays["q"][b:b + 1], "k": arrays["k"][b:b + 1, :, :n],
                                      "v": arrays["v"][b:b + 1, :, :n],
                                      **{k: v[b:b + 1, :n] for k, v in tens.items()}})
        ref_o, ref_lse = oracle.reference(cont, call.q, call.k, call.v, call.tensors)
        co, cl = numerics.compare_outputs(program.dtype, o[b:b + 1, :, None], lse[b:b + 1, :, None], ref_o, ref_lse)
        assert co.ok and cl.ok, (b, str(co), str(cl))


@pytest.mark.parametrize("heads", ["8 / 2", "4"])
@pytest.mark.parametrize("state", ["lse_o", "mlu"])
@pytest.mark.parametrize("table, order", [("dense", "nhd"), ("dense", "hnd"), ("csr", "nhd"), ("csr", "hnd")])
def test_paged_decode_matches_oracle(table, order, state, heads):
    program = _spec("causal", f"paged(page_size = {PAGE}, layout = {order}, table = {table})", heads, state)
    cont, arrays = _logical(program)
    rng = np.random.default_rng(1)
    k_cache, block_table, csr = _paged(arrays["k"], rng, order)
    v_cache, _, _ = _paged(arrays["v"], np.random.default_rng(1), order)
    meta = {"block_table": block_table, "kv_lens": LENS} if table == "dense" else csr
    kernel = runtime.load(program)
    o, lse = kernel.decode(arrays["q"][:, :, 0], k_cache=k_cache, v_cache=v_cache, return_lse=True,
                           block_n=TILE, splits=3, **meta)
    assert np.isfinite(o).all()
    _check(program, cont, arrays, o, lse)


@pytest.mark.parametrize("cache", ["contiguous(layout = bhsd)", "contiguous(layout = bshd)", "ragged"])
def test_contiguous_and_ragged_decode(cache):
    program = _spec("causal & window(20)", cache)
    cont, arrays = _logical(program, seed=2)
    kernel = runtime.load(program)
    if cache == "ragged":
        k = np.concatenate([arrays["k"][b, :, :n].transpose(1, 0, 2) for b, n in enumerate(LENS)])
        v = np.concatenate([arrays["v"][b, :, :n].transpose(1, 0, 2) for b, n in enumerate(LENS)])
        meta = {"k": k, "v": v, "kv_indptr": np.r_[0, np.cumsum(LENS)]}
    else:
        k, v = arrays["k"].copy(), arrays["v"].copy()
        for b, n in enumerate(LENS):  # past each request's length: NaN
            k[b, :, n:] = np.nan
            v[b, :, n:] = np.nan
        if "bshd" in cache:
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
        meta = {"k": k, "v": v, "kv_lens": LENS}
    plan = kernel.decode_plan(meta, block_n=TILE, splits=2)
    assert plan["skipped_blocks"] > 0  # the window skips whole K/V blocks in decode
    o, lse = kernel.decode(arrays["q"][:, :, 0], plan=plan, return_lse=True, **meta)
    assert np.isfinite(o).all()
    _check(program, cont, arrays, o, lse)


def test_document_mask_decode_and_empty_splits():
    program = _spec("causal & doc[b, q] == doc[b, k]", f"paged(page_size = {PAGE})", state="mlu",
                    decl="tensor doc: i32[b, s] ~ segments(4, 20)")
    cont, arrays = _logical(program, seed=4)
    k_cache, block_table, _ = _paged(arrays["k"], np.random.default_rng(3), "nhd")
    v_cache, _, _ = _paged(arrays["v"], np.random.default_rng(3), "nhd")
    kernel = runtime.load(program)
    o, lse = kernel.decode(arrays["q"][:, :, 0], k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                           kv_lens=LENS, doc=arrays["doc"], return_lse=True, block_n=TILE, splits=7)
    _check(program, cont, arrays, o, lse)


def test_bad_page_ids_are_plan_errors():
    program = _spec("causal", f"paged(page_size = {PAGE})")
    _, arrays = _logical(program)
    k_cache, block_table, _ = _paged(arrays["k"], np.random.default_rng(0), "nhd")
    block_table[0, 1] = 999
    kernel = runtime.load(program)
    with pytest.raises(PlanError, match="999"):
        kernel.decode(arrays["q"][:, :, 0], k_cache=k_cache, v_cache=k_cache, block_table=block_table, kv_lens=LENS)


WALK_SPECS = {
    "window": "attention c { heads = 4 / 2 head_dim = 16 dtype = f32 mask = causal & window(40) }",
    "document": "attention d { heads = 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] ~ segments(5, 30) "
                "mask = causal & doc[b, q] == doc[b, k] }",
    "document_predicate": "attention e { heads = 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] ~ segments(5, 30) "
                          "mask = causal & (doc[b, q] == doc[b, k] | k % 7 == 0) }",
}


@pytest.mark.parametrize("walk", ["merged", "merged_blocks", "runs", "blocks", None])
@pytest.mark.parametrize("spec", sorted(WALK_SPECS))
def test_prefill_walks_agree_with_the_oracle(walk, spec):
    """The three ways the prefill kernel walks the plan: merged runs with per-block PARTIAL flags
    (interval or predicate masks), FULL runs then PARTIAL blocks, and block by block."""
    program = compile_spec(WALK_SPECS[spec])
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, 64, 64, seed=9)
    tensors = {n: a for n, a in arrays.items() if n not in ("q", "k", "v")}
    plan = kernel.plan(2, 64, 64, tensors, TILE, TILE)
    from attnc.backends.triton.plans import walk_arrays
    args = walk_arrays(plan)
    assert args["merged_partial"].sum() == len(args["partial_indices"])
    assert len(args["merged_partial"]) == len(args["partial_indices"]) + len(args["full_indices"])
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, plan=plan, walk=walk, **tensors)
    ref_o, ref_lse = oracle.reference(program, arrays["q"], arrays["k"], arrays["v"], tensors)
    assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, ref_o, ref_lse))


@pytest.mark.parametrize("walk", ["merged", "blocks", None])
def test_prefill_document_mask_as_predicate_or_intervals(walk):
    program = compile_spec(WALK_SPECS["document"])
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, 48, 48, seed=4)
    tensors = {n: a for n, a in arrays.items() if n not in ("q", "k", "v")}
    plan = kernel.plan(2, 48, 48, tensors, TILE, TILE)
    assert plan.mask_from_intervals
    ref_o, ref_lse = oracle.reference(program, arrays["q"], arrays["k"], arrays["v"], tensors)
    for source in ("predicate", "intervals"):
        o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, plan=plan, walk=walk,
                        mask_source=source, **tensors)
        assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, ref_o, ref_lse)), source


def test_prefill_walk_must_be_known():
    program = compile_spec(WALK_SPECS["window"])
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 1, 16, 16, seed=9)
    with pytest.raises(ValueError, match="walk must be one of"):
        kernel(arrays["q"], arrays["k"], arrays["v"], walk="zigzag")
    with pytest.raises(ValueError, match="no exact interval vectors"):
        kernel(arrays["q"], arrays["k"], arrays["v"], mask_source="intervals")


def test_attnc_run_triton_on_a_paged_spec(tmp_path):
    """`attnc run --backend triton --check` over a paged cache (DESIGN §5 keys in an npz)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    program = compile_spec("attention d { heads = 8 / 2 head_dim = 16 dtype = bf16 mask = causal "
                           "cache = paged(page_size = 8, layout = nhd, table = csr) }")
    call = inputs.sample_cache(program, [37, 5, 16], [1, 1, 1], seed=4)
    np.savez(tmp_path / "in.npz", **call)
    spec = tmp_path / "d.attn"
    spec.write_text("attention d { heads = 8 / 2 head_dim = 16 dtype = bf16 mask = causal "
                    "cache = paged(page_size = 8, layout = nhd, table = csr) }")
    r = subprocess.run([sys.executable, "-m", "attnc", "run", str(spec), "--backend", "triton",
                        "--inputs", str(tmp_path / "in.npz"), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and "vs float64 oracle: O" in r.stdout


WALK_EXAMPLES = ["alibi", "softcap", "sliding_window_bidirectional", "flashmask_interop", "sink_window"]


@pytest.mark.parametrize("walk", ["merged", "merged_blocks"])
@pytest.mark.parametrize("name", WALK_EXAMPLES)
def test_merged_walks_on_examples_with_ragged_tails(name, walk):
    """The merged walks under score programs, bshd layouts, interval-read masks and a K/V
    length that is not a multiple of the tile (the last block's tail is masked in both the
    FULL and the PARTIAL branch of the per-block flag)."""
    from attnc.compiler.lower import compile_file
    from tests.conftest import EXAMPLES
    path = next(p for p in EXAMPLES if p.stem == name)
    program = inputs.contiguous_variant(compile_file(path))
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, 21, 37, seed=3)  # append: 21 rows over 37 keys, tiles of 8
    call = inputs.validate(program, arrays)
    tensors = {t.name: arrays[t.name] for t in program.tensors}
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, block_m=TILE, block_n=TILE, walk=walk,
                    **tensors)
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))


def test_gpu_tiles_below_16_are_plan_errors(monkeypatch):
    """On a GPU, tl.dot's smallest shape is 16: smaller tiles are refused before any compile
    (the interpreter runs them, which is how the tests above use 8-key blocks)."""
    from attnc.backends.triton import decode
    monkeypatch.setattr(decode, "interpreted", lambda: False)
    with pytest.raises(PlanError, match="block_n = 8: on a GPU a tile needs at least 16 rows and keys"):
        decode._check_gpu_tile(None, 8)
    with pytest.raises(PlanError, match="block_m = 4: on a GPU"):
        decode._check_gpu_tile(4, 64)
    decode._check_gpu_tile(16, 16)


def test_split_calls_reuse_their_plan_until_the_metadata_changes():
    """Torch metadata is a plan-cache key by identity and version: the layers of a decode step
    share one plan; kv_lens changed in place (the next step) makes a new one, and the answer
    follows the new lengths."""
    import torch
    from attnc.backends.triton import plans
    program = compile_spec("attention d { heads = 4 / 2 head_dim = 16 dtype = f32 mask = causal "
                           "cache = paged(page_size = 8, layout = nhd) }")
    kernel = runtime.load(program)
    arrays = inputs.sample_cache(program, [40, 17], None, seed=3)
    t = {n: torch.as_tensor(a) for n, a in arrays.items()}
    t["kv_lens"] = t["kv_lens"].to(torch.int32)  # metadata on the host, q and the cache where the kernel runs
    for n in ("q", "k_cache", "v_cache"):
        t[n] = t[n].to(kernel.device)
    call = {n: x for n, x in t.items() if n != "q"}
    first = kernel.decode(t["q"], **call)
    hits = plans.PLANS.hits
    assert torch.equal(kernel.decode(t["q"], **call), first) and plans.PLANS.hits == hits + 1
    t["kv_lens"][1] -= 5  # a shorter request: a new plan, the oracle's answer
    again = kernel.decode(t["q"], **call)
    host = {n: x.cpu().numpy() for n, x in t.items()}
    ref_o, _ = oracle.reference_cache(program, inputs.validate_cache(program, host))
    tol = 1e-4 if runtime.interpreted() else 2e-2  # (f32 dots run in TF32 on a GPU)
    assert np.allclose(again.cpu().numpy(), ref_o, atol=tol) and not torch.allclose(again, first)
