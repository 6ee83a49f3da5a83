"""Append and mixed batches on the Triton split-K/V kernel (CPU interpreter unless
ATTNC_TEST_GPU=1): requests with 0, 1 and several query rows (bottom-right positions) over
every cache layout the decode path reads × state ABI × MHA/GQA, against the float64 oracle
per request; NaN in every cache element no request owns; windows whose early rows see blocks
the last row does not; a data-dependent document mask; rows with no visible key."""
import hashlib
from functools import lru_cache

import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.errors import InputError, PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from attnc.compiler.plan import decode_blocks  # noqa: E402

# an idle request (q_len 0), a decode, an append, a prefill (q_len = kv_len)
KV_LENS = [3, 40, 17, 13]
Q_LENS = [0, 1, 5, 13]
LAYOUTS = {
    "paged_dense_nhd": "paged(page_size = 8, layout = nhd, table = dense)",
    "paged_dense_hnd": "paged(page_size = 8, layout = hnd, table = dense)",
    "paged_csr_nhd": "paged(page_size = 8, layout = nhd, table = csr)",
    "paged_csr_hnd": "paged(page_size = 8, layout = hnd, table = csr)",
    "ragged": "ragged",
    "contiguous_bhsd": "contiguous(layout = bhsd)",
    "contiguous_bshd": "contiguous(layout = bshd)",
}
HEADS = {"gqa": "8 / 2", "mha": "2"}
WINDOW = "causal & window(9)"  # the prefill's early rows read blocks its last row skips
DOC = "causal & doc[b, q] == doc[b, k]"
BN = 8 if runtime.interpreted() else 16  # compiled tl.dot needs K/V blocks of 16 keys or more


@lru_cache(maxsize=None)
def program(cache="ragged", state="lse_o", heads="8 / 2", mask=WINDOW, score="", dtype="f32"):
    decl = "tensor doc: i32[b, s] ~ segments(3, 9)" if "doc" in mask else ""
    name = "mixed_" + hashlib.sha256(repr((cache, state, heads, mask, score, dtype)).encode()).hexdigest()[:8]
    return compile_spec(f"attention {name} {{ heads = {heads} head_dim = 16 dtype = {dtype} {decl} {score} "
                        f"mask = {mask} cache = {cache} state = {state} }}")


def sample(p, kv_lens=KV_LENS, q_lens=Q_LENS, seed=0):
    # contiguous caches get two spare rows: requests sit in shuffled rows named by cache_batch_idx
    return inputs.sample_cache(p, kv_lens, q_lens, seed, cache_rows=len(kv_lens) + 2)


def check(p, arrays, **options):
    kernel = runtime.load(p)
    o, lse = kernel.run(arrays, return_lse=True, **options)
    ref_o, ref_lse = oracle.reference_cache(p, inputs.validate_cache(p, arrays))
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert np.isfinite(o).all()
    co, cl = numerics.compare_outputs(p.dtype, o, lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    return o, lse


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("state", ["lse_o", "mlu"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mixed_batch_matches_oracle(layout, state, heads):
    p = program(LAYOUTS[layout], state, HEADS[heads])
    check(p, sample(p, seed=len(layout)), block_n=BN, splits=3)


@pytest.mark.parametrize("layout", ["paged_dense_nhd", "ragged"])
def test_document_mask_and_score_program(layout):
    """A data-dependent mask (documents: per-request block lists from the tensor) with a score
    program, in bf16 (carried in float32 under the interpreter)."""
    p = program(LAYOUTS[layout], "mlu", "8 / 2", DOC, "score = softcap(score, 20.0)", "bf16")
    check(p, sample(p, seed=5), block_n=BN, splits=2)


def test_rows_without_visible_keys_get_zero_and_minus_inf():
    """Keys before position 10 are hidden: the prefill's first ten rows see nothing (no block is
    read for them; O = 0, LSE = -inf) while its later rows and the others do."""
    p = program(LAYOUTS["paged_csr_nhd"], "lse_o", "8 / 2", "causal & k >= 10")
    o, lse = check(p, sample(p, seed=2), block_n=BN, splits=2)
    rows = slice(6, 16)  # request 3's rows 0..9 (request 1 has packed row 0, request 2 rows 1..5)
    assert np.isneginf(lse[rows]).all() and (o[rows] == 0).all()
    assert np.isfinite(lse[:6]).all() and np.isfinite(lse[16:]).all()


def test_default_tiles_splits_and_torch_inputs():
    """The default plan (query tiles, split heuristic) and torch tensors in and out."""
    import torch
    p = program(LAYOUTS["paged_dense_hnd"], "mlu", "8 / 2")
    arrays = sample(p, seed=7)
    o, lse = check(p, arrays)
    kernel = runtime.load(p)
    plan = kernel.decode_plan({n: a for n, a in arrays.items() if n != "q"}, total_q=len(arrays["q"]))
    assert not plan["one_row"] and plan["block_q"] * 8 // 2 >= 16
    assert plan["tiles"] == sum(-(-n // plan["block_q"]) for n in Q_LENS)
    t = {n: torch.as_tensor(a, device=kernel.device) for n, a in arrays.items()}
    o_t, lse_t = kernel.decode(t.pop("q"), plan=plan, return_lse=True, **t)
    assert isinstance(o_t, torch.Tensor) and o_t.device == t["k_cache"].device
    np.testing.assert_allclose(o_t.cpu().numpy(), o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_t.cpu().numpy(), lse, rtol=1e-6, atol=1e-6)


def test_qo_indptr_instead_of_q_lens_and_all_empty():
    p = program(LAYOUTS["ragged"], "lse_o", "2")
    arrays = sample(p, seed=3)
    by_ptr = dict(arrays, qo_indptr=np.r_[0, np.cumsum(Q_LENS)].astype(np.int32))
    del by_ptr["q_lens"]
    o, _ = check(p, by_ptr, block_n=BN, splits=2)
    np.testing.assert_array_equal(o, runtime.load(p).run(arrays, block_n=BN, splits=2))
    none = sample(p, [4, 9], [0, 0], seed=3)  # no query rows at all: empty outputs
    o, lse = runtime.load(p).run(none, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_decode_keeps_one_row_tiles():
    """A batch of one row per request plans exactly as decode did: a tile per request."""
    p = program(LAYOUTS["paged_dense_nhd"], "lse_o", "8 / 2")
    arrays = sample(p, [30, 9, 17], [1, 1, 1], seed=1)
    kernel = runtime.load(p)
    plan = kernel.decode_plan({n: a for n, a in arrays.items() if n not in ("q", "q_lens")}, block_n=BN, splits=2)
    assert plan["one_row"] and plan["block_q"] == 1 and plan["tiles"] == 3
    np.testing.assert_array_equal(plan["tile_req"], [0, 1, 2])
    check(p, arrays, block_n=BN, splits=2)


@pytest.mark.parametrize("mask", [WINDOW, DOC, "causal & (k < 3 | q - k < 6)"])
def test_block_lists_cover_every_visible_cell(mask):
    """decode_blocks with several rows per tile: a block is listed for a tile iff some row and head
    of the tile sees one of its keys, and it is FULL (no element mask) only if every cell in range is
    visible.  The windowed prefill's first tile reads blocks its last row does not."""
    p = program("ragged", "lse_o", "8 / 2", mask)
    arrays = sample(p, seed=11)
    tensors = {t.name: arrays[t.name].astype(np.int64) for t in p.tensors}
    block_n, block_q = 4, 4
    blocks = decode_blocks(p, KV_LENS, tensors, block_n, 2, Q_LENS, block_q)
    assert blocks.tiles == sum(-(-n // block_q) for n in Q_LENS)
    for tile in range(blocks.tiles):
        b, i0 = int(blocks.tile_req[tile]), int(blocks.tile_row0[tile])
        t_len, c_len = KV_LENS[b], Q_LENS[b]
        vis = oracle.dense_mask(p, len(KV_LENS), c_len, t_len, tensors)[b, :, i0:i0 + block_q]  # [H, rows, T]
        lo, hi = blocks.entry_ptr[tile * 2], blocks.entry_ptr[tile * 2 + 2]
        listed = dict(zip(blocks.blocks[lo:hi].tolist(), blocks.partial[lo:hi].tolist()))
        for j in range(-(-t_len // block_n)):
            cells = vis[:, :, j * block_n:(j + 1) * block_n]
            assert (j in listed) == bool(cells.any()), (tile, j)
            if j in listed and not listed[j]:
                assert cells.all(), (tile, j)
    if mask == WINDOW:  # request 3's first tile (rows 0..3) vs its last row only (decode's list)
        first = blocks.blocks[blocks.entry_ptr[3 * 2]:blocks.entry_ptr[3 * 2 + 2]]
        last = decode_blocks(p, [13], {}, block_n, 1).blocks
        assert set(first.tolist()) == {0} and set(last.tolist()) == {1, 2, 3}


def test_bad_query_rows_are_input_errors():
    p = program(LAYOUTS["paged_dense_nhd"], "lse_o", "8 / 2")
    kernel = runtime.load(p)
    a = sample(p, [5, 2], [1, 2], seed=4)
    a["q_lens"] = np.array([0, 3], np.int32)
    with pytest.raises(InputError, match=r"request 1 has q_lens\[1\] = 3 query rows but only kv_len = 2"):
        kernel.run(a)
    a = sample(p, seed=4)
    with pytest.raises(InputError, match="q_lens sums to 19"):
        kernel.run(dict(a, q=a["q"][:-1]))
    with pytest.raises(InputError, match=r"q_lens\[2\] = 5 disagrees with qo_indptr"):
        kernel.run(dict(a, qo_indptr=np.array([0, 0, 1, 7, 19])))
    with pytest.raises(PlanError, match=r"q_lens\[0\] = -1 is negative"):
        kernel.run(dict(a, q_lens=np.array([-1, 2, 5, 13])))
    with pytest.raises(InputError, match="unknown key 'q_len'"):
        kernel.run(dict(a, q_len=np.array([1])))
    with pytest.raises(PlanError, match="block_q = 3"):
        kernel.run(a, block_q=3)
    bad = dict(a, block_table=a["block_table"].copy())
    bad["block_table"][2, 1] = 999
    with pytest.raises(PlanError, match="999"):
        kernel.run(bad)
    plan = kernel.decode_plan({n: x for n, x in a.items() if n != "q"})
    with pytest.raises(InputError, match="plan was made for 19"):
        kernel.decode(a["q"][:-1], plan=plan, **{n: x for n, x in a.items() if n != "q"})


def test_attnc_run_triton_on_a_mixed_batch(tmp_path):
    """`attnc run --backend triton --check` over a mixed batch (DESIGN §5 keys in an npz)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    text = ("attention m { heads = 8 / 2 head_dim = 16 dtype = bf16 mask = causal & window(12) "
            "cache = paged(page_size = 8, layout = hnd, table = csr) state = mlu }")
    call = inputs.sample_cache(compile_spec(text), KV_LENS, Q_LENS, seed=4)
    np.savez(tmp_path / "in.npz", **call)
    spec = tmp_path / "m.attn"
    spec.write_text(text)
    r = subprocess.run([sys.executable, "-m", "attnc", "run", str(spec), "--backend", "triton",
                        "--inputs", str(tmp_path / "in.npz"), "--check", "--out", str(tmp_path / "out.npz")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "q_lens [0, 1, 5, 13]" in r.stdout and "FAIL" not in r.stdout and "vs float64 oracle: O" in r.stdout
    out = np.load(tmp_path / "out.npz")
    assert out["o"].shape == (19, 8, 16) and out["lse"].shape == (19, 8)
