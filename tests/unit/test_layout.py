"""compiler.analysis.layout reproduces the `kv_address` fixture (M4.5 §0x04) and its
translation invariants: request identity, K/V head, visibility and address bounds."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attnc.compiler import ir
from attnc.compiler.analysis import layout as lay
from attnc.compiler.analysis.ledger import metadata_bytes
from attnc.compiler.errors import PlanError
from tests.conftest import seed_contracts

FIXTURE = seed_contracts()["kv_address"]
GEO, PROBE, RAGGED, PAGED = FIXTURE["geometry"], FIXTURE["probe"], FIXTURE["ragged"], FIXTURE["paged"]
LENS = RAGGED["lengths"]                      # req-A, req-B, req-C
P = PAGED["page_size"]
HEADS = dict(heads_q=GEO["H_q"], heads_kv=GEO["H_kv"], d_qk=GEO["d_h"], elem_bytes=GEO["elem_bytes"])
# active request 0 (req-A) lives in cache row 2 (§0x04A); the others in rows 0 and 3, row 1 unused
CACHE_BATCH_IDX = [GEO["cache_batch_idx"]["active_0"], 0, 3]


def pages_needed(n):
    return -(-n // P)


def fixture_paged():
    """req-A's table is the fixture's [7, 3, 9]; the other requests get other pool pages."""
    lists = [PAGED["request_A_block_table"], [1, 4], [0, 11]]
    assert [len(x) for x in lists] == [pages_needed(n) for n in LENS]
    width = max(len(x) for x in lists)
    table = np.full((GEO["B_c"], width), -1)             # -1: sentinel past the visible blocks
    for c, pages in zip(CACHE_BATCH_IDX, lists):
        table[c, :len(pages)] = pages
    pool = max(max(x) for x in lists) + 1
    dense = lay.paged_dense(table, LENS, page_size=P, num_pages=pool, cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])])
    last = [n - P * (pages_needed(n) - 1) for n in LENS]
    csr = lay.paged_csr(indptr, np.concatenate(lists), last, page_size=P, num_pages=pool, **HEADS)
    return dense, csr


# ---------------------------------------------------------------- the fixture, exactly
@pytest.mark.parametrize("order,key", [("bshd", "nhd"), ("bhsd", "hnd")])
def test_contiguous_probe_offsets(order, key):
    L = lay.contiguous(LENS, order=order, batch_capacity=GEO["B_c"], token_capacity=GEO["T_c"],
                       cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    a = lay.address(L, PROBE["active_b"], PROBE["t"], PROBE["h_q"], PROBE["x"])
    assert (a.cache_row, a.kv_head) == (PROBE["expect_cache_row"], PROBE["expect_h_kv"])
    assert list(a.coordinate) == PROBE[f"{key}_coordinate"]
    assert list(a.strides) == PROBE[f"{key}_strides"]
    assert a.elem_offset == PROBE[f"{key}_offset_elems"]
    assert a.byte_offset == PROBE[f"{key}_offset_bytes"]
    assert lay.AXIS_NAMES[order] == key.upper()
    assert int(lay.elem_offsets(L, PROBE["active_b"], PROBE["t"], PROBE["h_q"], PROBE["x"])) == a.elem_offset


def test_cache_row_remap_changes_the_address():
    """Using active b as the cache row is an in-bounds read of another request (§0x04J)."""
    remapped = lay.contiguous(LENS, order="bshd", batch_capacity=4, token_capacity=12,
                              cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    plain = lay.contiguous(LENS, order="bshd", batch_capacity=4, token_capacity=12, **HEADS)
    assert lay.address(plain, 0, 3, 3, 2).cache_row == 0
    assert lay.address(remapped, 0, 3, 3, 2).elem_offset != lay.address(plain, 0, 3, 3, 2).elem_offset


def test_ragged_packed_row():
    L = lay.ragged(RAGGED["indptr"], total_rows=RAGGED["indptr"][-1], **HEADS)
    assert L.kv_lens.tolist() == LENS
    pr = RAGGED["probe"]
    a = lay.address(L, pr["request"], pr["t"], 0, 0)
    assert a.packed_row == pr["packed_row"]
    assert a.elem_offset == pr["packed_row"] * GEO["H_kv"] * GEO["d_h"]


@pytest.mark.parametrize("which", ["dense", "csr"])
def test_paged_split_trace(which):
    dense, csr = fixture_paged()
    L = dense if which == "dense" else csr
    assert L.kv_lens[0] == PAGED["request_A_length"]
    a, e = PAGED["split"]
    segs = lay.page_segments(L, 0, a, e)
    assert [list(s) for s in segs] == PAGED["segments_page_offset_count"]
    assert len(segs) == lay.segment_count(a, e, P)
    tail = PAGED["invisible_tail"]
    assert lay.invisible_tail(L, 0) == (tail["page"], tuple(tail["offsets"]))


def test_metadata_resident_bytes():
    dense, csr = fixture_paged()
    want = PAGED["metadata_resident_bytes"]
    assert dense.block_table.shape == (4, 3)
    assert metadata_bytes(dense).table == want["dense_table_4x3_int32"]
    assert metadata_bytes(csr).table == want["csr_14_int32"]
    assert sum(x.size for x in (csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len)) == 14


def test_dense_and_csr_agree_and_paged_offsets_follow_the_formula():
    dense, csr = fixture_paged()
    for b, n in enumerate(LENS):
        assert dense.kv_lens[b] == csr.kv_lens[b] == n
        assert lay.pages_of(dense, b).tolist() == lay.pages_of(csr, b).tolist()
        for t in range(n):
            ad, ac = lay.address(dense, b, t, 3, 1), lay.address(csr, b, t, 3, 1)
            assert ad.page == ac.page and ad.elem_offset == ac.elem_offset
            pi, r = ad.page, t % P
            assert ad.elem_offset == ((pi * P + r) * GEO["H_kv"] + 1) * GEO["d_h"] + 1   # §0x04D NHD


def test_hnd_page_offset_formula():
    dense, _ = fixture_paged()
    hnd = lay.paged_dense(dense.block_table, LENS, page_size=P, num_pages=dense.num_pages, order="hnd",
                          cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    a = lay.address(hnd, 0, 9, 2, 3)
    assert a.page == 9 and a.coordinate == (9, 1, 1, 3)
    assert a.elem_offset == ((9 * GEO["H_kv"] + 1) * P + 1) * GEO["d_h"] + 3


def _stores(L, rng, poison=np.nan):
    """Storage tensors holding unique payload ids at visible rows and NaN everywhere else."""
    k = np.full(L.tensor_shape("k"), poison)
    v = np.full(L.tensor_shape("v"), poison)
    logical = []
    for b in range(L.batch):
        n = int(L.kv_lens[b])
        kk = rng.standard_normal((n, L.heads_kv, L.d_qk))
        vv = rng.standard_normal((n, L.heads_kv, L.d_v))
        t, h, x = np.meshgrid(np.arange(n), np.arange(L.heads_kv), np.arange(L.d_qk), indexing="ij")
        # query head h * G reads K/V head h
        k.reshape(-1)[lay.elem_offsets(L, b, t, h * L.group, x, "k")] = kk
        t, h, x = np.meshgrid(np.arange(n), np.arange(L.heads_kv), np.arange(L.d_v), indexing="ij")
        v.reshape(-1)[lay.elem_offsets(L, b, t, h * L.group, x, "v")] = vv
        logical.append((kk, vv))
    keys = L.array_keys
    return {keys[0]: k, keys[1]: v}, logical


def all_fixture_layouts():
    dense, csr = fixture_paged()
    hnd = lay.paged_dense(dense.block_table, LENS, page_size=P, num_pages=dense.num_pages, order="hnd",
                          cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    return [lay.contiguous(LENS, order=o, batch_capacity=4, token_capacity=12, cache_batch_idx=CACHE_BATCH_IDX,
                           **HEADS) for o in ("bshd", "bhsd")] + \
        [lay.ragged(RAGGED["indptr"], **HEADS), dense, hnd, csr]


@pytest.mark.parametrize("L", all_fixture_layouts(), ids=lambda L: f"{L.kind}-{L.order}-{L.table}")
def test_every_visible_coordinate_round_trips(L):
    """§0x04J: 176 scalar elements per K or V across three requests, no address collision,
    and every visible gather recovers the payload without reaching a poisoned slot."""
    offsets = np.concatenate([
        lay.elem_offsets(L, b, *np.meshgrid(np.arange(n), np.arange(L.heads_q), np.arange(L.d_qk),
                                            indexing="ij")).reshape(n, L.heads_q, -1)[:, ::L.group].ravel()
        for b, n in enumerate(LENS)])
    assert offsets.size == 176 and np.unique(offsets).size == 176
    assert offsets.min() >= 0 and offsets.max() < np.prod(L.tensor_shape("k"))
    arrays, logical = _stores(L, np.random.default_rng(0))
    for b, (kk, vv) in enumerate(logical):
        k, v = lay.gather_kv(L, arrays, b)
        np.testing.assert_array_equal(k, kk)
        np.testing.assert_array_equal(v, vv)
    if L.kind == "paged":
        poisoned = sum(np.isnan(arrays[key]).sum() for key in L.array_keys)
        unused = (L.num_pages - sum(pages_needed(n) for n in LENS)) * P * L.heads_kv * L.d_qk * 2
        assert poisoned - unused == 96      # the allocated-but-invisible tail elements, K and V


def test_from_inputs_builds_each_layout():
    dense, csr = fixture_paged()
    pool = dense.num_pages
    k = np.zeros((pool, P, 2, 4), np.float16)
    arrays = {"k_cache": k, "v_cache": k, "block_table": dense.block_table, "kv_lens": np.array(LENS),
              "cache_batch_idx": np.array(CACHE_BATCH_IDX)}
    L = lay.from_inputs(ir.Cache(ir.CacheKind.PAGED, ir.Layout.NHD, P, "dense"), arrays, heads_q=4, heads_kv=2)
    assert L.table == "dense" and L.elem_bytes == 2 and L.kv_lens.tolist() == LENS
    csr_arrays = {"k_cache": k, "v_cache": k, "kv_indptr": csr.kv_indptr, "kv_indices": csr.kv_indices,
                  "kv_last_page_len": csr.kv_last_page_len}
    L = lay.from_inputs(ir.Cache(ir.CacheKind.PAGED, ir.Layout.NHD, P, "csr"), csr_arrays, heads_q=4, heads_kv=2)
    assert L.table == "csr" and L.kv_lens.tolist() == LENS
    kc = np.zeros((2, 2, 12, 4), np.float32)
    L = lay.from_inputs(ir.Cache(), {"k": kc, "v": kc}, heads_q=4, heads_kv=2)
    assert (L.order, L.kv_lens.tolist(), L.elem_bytes) == ("bhsd", [12, 12], 4)
    kr = np.zeros((22, 2, 4))
    L = lay.from_inputs(ir.Cache(ir.CacheKind.RAGGED, ir.Layout.BHSD), {"k": kr, "v": kr,
                        "kv_indptr": np.array(RAGGED["indptr"])}, heads_q=4, heads_kv=2)
    assert L.kv_lens.tolist() == LENS


def test_gather_checks_array_shapes():
    dense, _ = fixture_paged()
    with pytest.raises(PlanError, match=r"'k_cache' has shape \[3, 4, 2, 4\]"):
        lay.gather_kv(dense, {"k_cache": np.zeros((3, 4, 2, 4)), "v_cache": np.zeros((3, 4, 2, 4))}, 0)


# ---------------------------------------------------------------- contract breaks
def test_page_id_outside_pool():
    with pytest.raises(PlanError, match=r"block_table\[2, 1\] = 12 is outside the page pool \[0, 12\)"):
        lay.paged_dense([[1, 4, -1], [-1, -1, -1], [7, 12, 9], [0, 11, -1]], LENS, page_size=4, num_pages=12,
                        cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    with pytest.raises(PlanError, match=r"kv_indices\[1\] = -3 is outside the page pool"):
        lay.paged_csr([0, 3], [7, -3, 9], [2], page_size=4, num_pages=12, **HEADS)


def test_visible_sentinel_is_rejected_but_invisible_one_is_not():
    ok = lay.paged_dense([[7, 3, -1]], [8], page_size=4, num_pages=10, **HEADS)
    assert lay.pages_of(ok, 0).tolist() == [7, 3]
    with pytest.raises(PlanError, match=r"block_table\[0, 2\] = -1"):
        lay.paged_dense([[7, 3, -1]], [9], page_size=4, num_pages=10, **HEADS)


@pytest.mark.parametrize("last,msg", [([0], r"kv_last_page_len\[0\] = 0 is outside \[1, page_size = 4\]"),
                                      ([5], r"kv_last_page_len\[0\] = 5 is outside \[1, page_size = 4\]")])
def test_last_page_len_outside_range(last, msg):
    with pytest.raises(PlanError, match=msg):
        lay.paged_csr([0, 3], [7, 3, 9], last, page_size=4, num_pages=10, **HEADS)


def test_empty_request_needs_last_page_len_zero():
    L = lay.paged_csr([0, 0, 2], [1, 2], [0, 4], page_size=4, num_pages=3, **HEADS)
    assert L.kv_lens.tolist() == [0, 8]
    with pytest.raises(PlanError, match=r"kv_last_page_len\[0\] = 2 is outside 0"):
        lay.paged_csr([0, 0, 2], [1, 2], [2, 4], page_size=4, num_pages=3, **HEADS)


@pytest.mark.parametrize("indptr,msg", [
    ([1, 3, 5], r"kv_indptr\[0\] = 1, must be 0"),
    ([0, 4, 3], r"kv_indptr is not monotone: kv_indptr\[2\] = 3 < kv_indptr\[1\] = 4"),
    ([0, 2, 4], r"kv_indptr\[2\] = 4 must equal len\(kv_indices\) = 5"),
])
def test_bad_csr_indptr(indptr, msg):
    with pytest.raises(PlanError, match=msg):
        lay.paged_csr(indptr, [0, 1, 2, 3, 4], [1, 1], page_size=4, num_pages=10, **HEADS)


@pytest.mark.parametrize("indptr,msg", [
    ([2, 10], r"kv_indptr\[0\] = 2, must be 0"),
    ([0, 10, 7], r"kv_indptr\[2\] = 7 < kv_indptr\[1\] = 10"),
    ([0, 10, 17], r"kv_indptr\[2\] = 17 must equal the packed K/V rows = 22"),
])
def test_bad_ragged_indptr(indptr, msg):
    with pytest.raises(PlanError, match=msg):
        lay.ragged(indptr, total_rows=22, **HEADS)


def test_request_longer_than_its_table():
    with pytest.raises(PlanError, match=r"kv_lens\[0\] = 13 exceeds its block_table row \(cache row 2\): "
                                        r"3 pages x page_size 4 = 12 rows"):
        lay.paged_dense(np.zeros((4, 3), int), [13, 1, 1], page_size=4, num_pages=1,
                        cache_batch_idx=CACHE_BATCH_IDX, **HEADS)
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = 13 exceeds the cache's token capacity T_c = 12"):
        lay.contiguous([3, 13], token_capacity=12, **HEADS)


@pytest.mark.parametrize("idx,msg", [
    ([2, 0, 2], r"cache_batch_idx\[2\] = 2 duplicates cache_batch_idx\[0\]"),
    ([2, 4, 0], r"cache_batch_idx\[1\] = 4 is outside the cache rows \[0, 4\)"),
    ([-1, 0, 1], r"cache_batch_idx\[0\] = -1 is outside"),
])
def test_bad_cache_batch_idx(idx, msg):
    with pytest.raises(PlanError, match=msg):
        lay.contiguous(LENS, batch_capacity=4, token_capacity=12, cache_batch_idx=idx, **HEADS)
    with pytest.raises(PlanError, match=msg):
        lay.paged_dense(np.zeros((4, 3), int), LENS, page_size=4, num_pages=1, cache_batch_idx=idx, **HEADS)


def test_negative_lengths():
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = -2 is negative"):
        lay.contiguous([3, -2], **HEADS)
    with pytest.raises(PlanError, match=r"kv_lens\[0\] = -1 is negative"):
        lay.paged_dense([[0]], [-1], page_size=4, num_pages=1, **HEADS)


def test_reads_past_the_visible_length_are_refused():
    dense, _ = fixture_paged()
    with pytest.raises(PlanError, match=r"t = 10 is outside the visible rows of request 0 \[0, 10\)"):
        lay.address(dense, 0, 10, 0, 0)
    with pytest.raises(PlanError, match=r"range \[8, 11\) of request 0 is outside its visible rows \[0, 10\)"):
        lay.page_segments(dense, 0, 8, 11)
    with pytest.raises(PlanError, match=r"h_q = 4 is outside the query heads"):
        lay.address(dense, 0, 1, 4, 0)


def test_gqa_ratio_must_divide():
    with pytest.raises(PlanError, match="H_q = 6 is not a multiple of H_kv = 4"):
        lay.contiguous([1], heads_q=6, heads_kv=4, d_qk=8)


# ---------------------------------------------------------------- properties
@st.composite
def paged_caches(draw):
    """A random paged cache: lengths, page size, a permuted pool (with spare pages), both
    table encodings, both page orders."""
    P_ = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, 30), min_size=1, max_size=4))
    need = [-(-n // P_) for n in lens]
    spare = draw(st.integers(0, 3))
    pool = sum(need) + spare
    perm = draw(st.permutations(list(range(pool)))) if pool else []
    lists, i = [], 0
    for n in need:
        lists.append(list(perm[i:i + n]))
        i += n
    order = draw(st.sampled_from(["nhd", "hnd"]))
    hkv = draw(st.integers(1, 3))
    g = draw(st.integers(1, 3))
    d_qk, d_v = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    geo = dict(page_size=P_, num_pages=max(pool, 1), order=order, heads_q=hkv * g, heads_kv=hkv,
               d_qk=d_qk, d_v=d_v)
    if draw(st.booleans()):
        width = max(need + [1]) + draw(st.integers(0, 2))
        table = np.full((len(lens), width), -7)
        for b, pages in enumerate(lists):
            table[b, :len(pages)] = pages
        return lay.paged_dense(table, lens, **geo)
    indptr = np.concatenate([[0], np.cumsum(need)])
    last = [n - P_ * (m - 1) if m else 0 for n, m in zip(lens, need)]
    return lay.paged_csr(indptr, np.asarray(sum(lists, []), dtype=np.int64), last, **geo)


@settings(max_examples=60, deadline=None)
@given(paged_caches(), st.data())
def test_page_segments_reassemble_the_logical_rows(L, data):
    b = data.draw(st.integers(0, L.batch - 1))
    n = int(L.kv_lens[b])
    a = data.draw(st.integers(0, n))
    e = data.draw(st.integers(a, n))
    segs = lay.page_segments(L, b, a, e)
    assert len(segs) == lay.segment_count(a, e, L.page_size)
    assert sum(s.count for s in segs) == e - a
    rows = [(s.page, s.offset + i) for s in segs for i in range(s.count)]
    expect = [(lay.address(L, b, t, 0, 0).page, t % L.page_size) for t in range(a, e)]
    assert rows == expect
    for s in segs:
        assert 0 <= s.offset and s.offset + s.count <= L.page_size and s.count > 0


@settings(max_examples=60, deadline=None)
@given(paged_caches(), st.integers(0, 2**31 - 1))
def test_gather_kv_of_a_poisoned_paged_cache_is_the_logical_kv(L, seed):
    arrays, logical = _stores(L, np.random.default_rng(seed))
    for b, (kk, vv) in enumerate(logical):
        k, v = lay.gather_kv(L, arrays, b)
        assert not np.isnan(k).any() and not np.isnan(v).any()
        np.testing.assert_array_equal(k, kk)
        np.testing.assert_array_equal(v, vv)
        n = int(L.kv_lens[b])
        a = n // 3
        ks, vs = lay.gather_segments(L, arrays, b, a, n)
        np.testing.assert_array_equal(ks, kk[a:])
        np.testing.assert_array_equal(vs, vv[a:])


@settings(max_examples=60, deadline=None)
@given(st.one_of(paged_caches(),
                 st.lists(st.integers(0, 30), min_size=1, max_size=4).map(
                     lambda lens: lay.ragged(np.concatenate([[0], np.cumsum(lens)]), heads_q=2, heads_kv=1, d_qk=2)),
                 st.lists(st.integers(0, 30), min_size=1, max_size=4).map(
                     lambda lens: lay.contiguous(lens, order="bshd", heads_q=2, heads_kv=1, d_qk=2,
                                                 batch_capacity=len(lens) + 1, token_capacity=31,
                                                 cache_batch_idx=list(range(len(lens)))[::-1]))),
       st.integers(1, 7), st.data())
def test_storage_segments_cover_a_range_in_order(L, cap, data):
    """Every storage run lies inside its block, is at most ``max_rows`` long, and the runs
    list the range's rows in logical order, exactly (pages, cache rows or packed rows)."""
    b = data.draw(st.integers(0, L.batch - 1))
    n = int(L.kv_lens[b])
    a = data.draw(st.integers(0, n))
    e = data.draw(st.integers(a, n))
    segs = lay.storage_segments(L, b, a, e, cap)
    assert all(0 < s.count <= cap for s in segs) and sum(s.count for s in segs) == e - a
    rows = [(s.page, s.offset + i) for s in segs for i in range(s.count)]
    if L.kind == lay.PAGED:
        expect = [(lay.address(L, b, t, 0, 0).page, t % L.page_size) for t in range(a, e)]
        assert all(s.offset + s.count <= L.page_size for s in segs)
    elif L.kind == lay.RAGGED:
        expect = [(0, int(L.indptr[b]) + t) for t in range(a, e)]
    else:
        expect = [(L.cache_row(b), t) for t in range(a, e)]
    assert rows == expect
    whole = lay.storage_segments(L, b, a, e)                 # uncapped: pages, or one run
    assert whole == (lay.page_segments(L, b, a, e) if L.kind == lay.PAGED else
                     ((rows[0][0], rows[0][1], e - a),) if e > a else ())


# ---------------------------------------------------------------- quick_layout (a split call's checks)
QUICK_CACHES = {
    "paged_dense_nhd": "paged(page_size = 4, layout = nhd, table = dense)",
    "paged_dense_hnd": "paged(page_size = 4, layout = hnd, table = dense)",
    "paged_csr_nhd": "paged(page_size = 4, layout = nhd, table = csr)",
    "paged_csr_hnd": "paged(page_size = 4, layout = hnd, table = csr)",
    "contiguous_bhsd": "contiguous(layout = bhsd)",
    "contiguous_bshd": "contiguous(layout = bshd)",
    "ragged": "ragged",
}


def _set(key, index, value):
    def mutate(a):
        if key not in a:
            return
        a[key] = a[key].copy()
        a[key][index] = value
    return mutate


QUICK_MUTATIONS = {
    "none": lambda a: None,
    "negative kv_len": _set("kv_lens", 1, -3),
    "kv_len past the table / capacity": _set("kv_lens", 0, 10 ** 6),
    "float kv_lens": lambda a: a.update(kv_lens=a["kv_lens"].astype(np.float32)) if "kv_lens" in a else None,
    "unsigned kv_lens": lambda a: a.update(kv_lens=a["kv_lens"].astype(np.uint32)) if "kv_lens" in a else None,
    "2-D kv_lens": lambda a: a.update(kv_lens=a["kv_lens"][None]) if "kv_lens" in a else None,
    "no kv_lens": lambda a: a.pop("kv_lens", None),
    "page past the pool": _set("block_table", (0, 0), 10 ** 6),
    "negative page": _set("block_table", (2, 0), -1),
    "sentinel past the visible pages": _set("block_table", (0, -1), -7),
    "table short of rows": lambda a: a.update(block_table=a["block_table"][:1]) if "block_table" in a else None,
    "csr page past the pool": _set("kv_indices", 0, 10 ** 6),
    "indptr not monotone": _set("kv_indptr", 1, 10 ** 3),
    "indptr[0] != 0": _set("kv_indptr", 0, 1),
    "last page of 0": _set("kv_last_page_len", 0, 0),
    "last page past P": _set("kv_last_page_len", 1, 5),
    "K of another page size": lambda a: a.update(k_cache=a["k_cache"][:, :2]) if "k_cache" in a else None,
    "V of another head count": lambda a: a.update(v=a["v"][..., :1, :]) if "v" in a and a["v"].ndim == 3 else None,
    "K of rank 3": lambda a: a.update(**{n: a[n][0] for n in ("k", "k_cache") if n in a}),
    "V with another first axis": lambda a: a.update(**{n: a[n][1:] for n in ("v", "v_cache") if n in a}),
    "cache_batch_idx": lambda a: a.update(cache_batch_idx=np.arange(3, dtype=np.int32)),
}


def _fields(L):
    import dataclasses
    return {f.name: getattr(L, f.name) for f in dataclasses.fields(L)}


@pytest.mark.parametrize("mutation", sorted(QUICK_MUTATIONS))
@pytest.mark.parametrize("cache", sorted(QUICK_CACHES))
def test_quick_layout_accepts_only_what_from_inputs_accepts(cache, mutation):
    """quick_layout is from_inputs + check_arrays for the common calls: whatever it accepts the
    full checks accept with the same layout, and every contract break sends the call to them."""
    from attnc.compiler import inputs
    from attnc.compiler.lower import compile_spec
    p = compile_spec(f"attention quick {{ heads = 4 / 2 head_dim = 8 mask = causal "
                     f"cache = {QUICK_CACHES[cache]} }}")
    arrays = {n: a for n, a in inputs.sample_cache(p, [9, 5, 13], seed=1).items() if n not in ("q", "q_lens")}
    QUICK_MUTATIONS[mutation](arrays)
    try:
        full = lay.from_inputs(p.cache, arrays, heads_q=4, heads_kv=2, copy=False)
        lay.check_arrays(full, arrays)
    except (PlanError, IndexError) as e:
        full = e
    quick = lay.quick_layout(p.cache, arrays, heads_q=4, heads_kv=2)
    if mutation == "none":
        assert quick is not None and not isinstance(full, Exception)
    if quick is not None:
        assert not isinstance(full, Exception), (mutation, full)
        want, got = _fields(full), _fields(quick)
        for name, value in want.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(got[name], value, err_msg=name)
                assert not got[name].flags.writeable
            else:
                assert got[name] == value, name
