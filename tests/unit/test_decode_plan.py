"""The Triton split call's host plan (backends.triton.decode.decode_plan) without launching a
kernel: declared tensors by name, the untuned launch rule, and the quick checks giving the same
plan as the full ones."""
import numpy as np
import pytest

from attnc.backends.triton import decode as D
from attnc.compiler import inputs
from attnc.compiler.analysis import layout as kvl
from attnc.compiler.errors import InputError
from attnc.compiler.lower import compile_spec

DOC = ("attention plan_doc { heads = 8 / 2 head_dim = 16 tensor doc: i32[b, s] ~ segments(3, 9) "
       "mask = causal & doc[b, q] == doc[b, k] cache = paged(page_size = 8, layout = nhd) }")
PLAN_ARRAYS = ("kv_lens", "q_lens", "qo_indptr", "cache_rows", "base", "table", "tile_req", "tile_row0",
               "entry_ptr", "blocks", "partial")


@pytest.fixture(autouse=True)
def interpreter_facts(monkeypatch):
    """Host plans for Triton's interpreter whatever the machine: 8-key blocks (a GPU's tiles take at
    least 16) and the interpreter's SM count, so the GPU test list runs these checks unchanged."""
    monkeypatch.setattr(D.device, "facts", lambda device=None: D.device.INTERPRETER)


def same_plan(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        if isinstance(a[n], np.ndarray):
            np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        else:
            assert a[n] == b[n], n


def call(p, kv_lens, q_lens=None, seed=0):
    a = inputs.sample_cache(p, kv_lens, q_lens, seed)
    del a["q"]
    if q_lens is None:
        del a["q_lens"]
    return a


def test_declared_tensors_by_name():
    """decode_plan takes the spec's tensors among the arrays, like every other call (it raised
    KeyError: 'doc'), or apart in tensors= as before; the two plans are the same."""
    p = compile_spec(DOC)
    arrays = call(p, [30, 9, 17])
    by_name = D.decode_plan(p, arrays, block_n=8, splits=2)
    apart = D.decode_plan(p, {n: a for n, a in arrays.items() if n != "doc"}, block_n=8, splits=2,
                          tensors={"doc": arrays["doc"]})
    same_plan(by_name, apart)
    import torch
    same_plan(D.decode_plan(p, {n: torch.as_tensor(a) for n, a in arrays.items()}, block_n=8, splits=2), by_name)
    with pytest.raises(InputError, match="missing key 'doc'"):
        D.decode_plan(p, {n: a for n, a in arrays.items() if n != "doc"})
    with pytest.raises(InputError, match="'doc' is given twice"):
        D.decode_plan(p, arrays, tensors={"doc": arrays["doc"]})


def test_default_decode_config_rule():
    """About four programs per SM (bench/results/decode_h200_r28_graph.jsonl, r30_recheck): the
    bench shapes on 132 SMs, GQA 32/8, block_n 64, 4 warps, 2 stages."""
    p = compile_spec("attention rule { heads = 32 / 8 head_dim = 128 dtype = bf16 mask = causal "
                     "cache = paged(page_size = 16, layout = nhd) }")
    cfg = D.default_decode_config
    for batch, t_len, splits in ((8, 8192, 8), (32, 8192, 2), (1, 131072, 66), (64, 2048, 1)):
        got = cfg(p, [t_len] * batch, [1] * batch, 132)
        assert got == {"block_n": 64, "splits": splits, "num_warps": 4, "num_stages": 2, "block_q": 1}, batch
    assert cfg(p, [100], [1], 132)["splits"] == 2  # never more splits than the longest request's blocks
    assert cfg(p, [10 ** 6], [1], 1000)["splits"] == D.MAX_SPLITS
    assert cfg(p, [8192] * 8, [1] * 8, 132, block_n=128)["splits"] == 8
    mixed = cfg(p, [4096, 300], [256, 1], 132)
    assert mixed["block_q"] > 1 and mixed["splits"] >= 1
    # decode_plan with nothing given plans with it and records the launch
    arrays = {n: np.broadcast_to(np.zeros((), np.float16), (8 * 512, 16, 8, 128)) for n in ("k_cache", "v_cache")}
    arrays.update(block_table=np.arange(8 * 512, dtype=np.int32).reshape(8, 512),
                  kv_lens=np.full(8, 8192, np.int32))
    plan = D.decode_plan(p, arrays, num_sms=132)
    assert (plan["splits"], plan["block_n"], plan["num_warps"], plan["num_stages"]) == (8, 64, 4, 2)


CACHES = {
    "paged_dense": "paged(page_size = 8, layout = hnd, table = dense)",
    "paged_csr": "paged(page_size = 8, layout = nhd, table = csr)",
    "contiguous": "contiguous(layout = bshd)",
    "ragged": "ragged",
}


@pytest.mark.parametrize("mask", ["causal & window(9)", "causal & (k < 3 | q - k < 6)", "causal"])
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_quick_checks_give_the_full_checks_plan(cache, mask, monkeypatch):
    p = compile_spec(f"attention quick_plan {{ heads = 8 / 2 head_dim = 16 mask = {mask} "
                     f"cache = {CACHES[cache]} }}")
    for kv, q in (([30, 9, 17, 1], None), ([30, 9, 17, 1], [3, 0, 17, 1])):
        arrays = call(p, kv, q)
        total_q = None if q is None else sum(q)
        quick = D.decode_plan(p, arrays, block_n=8, total_q=total_q)
        with monkeypatch.context() as m:
            m.setattr(kvl, "quick_layout", lambda *a, **k: None)
            full = D.decode_plan(p, arrays, block_n=8, total_q=total_q)
        same_plan(quick, full)
        assert quick["table"] is not arrays.get("block_table", arrays.get("kv_indices"))  # a copy


def test_decode_plan_keeps_its_error_messages():
    """The quick checks hand every contract break to the full ones (same words as before)."""
    p = compile_spec(DOC)
    a = call(p, [30, 9, 17])
    bad = dict(a, block_table=a["block_table"].copy())
    bad["block_table"][1, 0] = 999
    with pytest.raises(Exception, match=r"block_table\[1, 0\] = 999 is outside the page pool"):
        D.decode_plan(p, bad)
    with pytest.raises(Exception, match=r"kv_lens\[1\] = -1 is negative"):
        D.decode_plan(p, dict(a, kv_lens=np.array([30, -1, 17], np.int32)))
    with pytest.raises(InputError, match=r"request 1 has q_lens\[1\] = 3 query rows but only kv_len = 2 keys"):
        D.decode_plan(p, dict(a, kv_lens=np.array([30, 2, 17], np.int32), q_lens=np.array([1, 3, 1])))


def test_a_request_with_no_keys_keeps_its_query_row():
    """Decode over an empty context (M4.5 §0x03G's capacity tail): request 1 has kv_len 0 and its
    one query row; it lists no block in any slot (its states are identities) and the others are
    planned as without it."""
    p = compile_spec(DOC)
    a = call(p, [30, 9, 17])
    plan = D.decode_plan(p, dict(a, kv_lens=np.array([30, 0, 17], np.int32)), block_n=8, splits=2)
    assert plan["total_q"] == 3 and plan["one_row"] and plan["tiles"] == 3
    ptr = plan["entry_ptr"]
    assert ptr[2] == ptr[4]                                  # request 1's two slots: no block
    ref = D.decode_plan(p, dict(a, kv_lens=np.array([30, 9, 17], np.int32)), block_n=8, splits=2)
    assert plan["blocks"][:ptr[2]].tolist() == ref["blocks"][:ref["entry_ptr"][2]].tolist()
