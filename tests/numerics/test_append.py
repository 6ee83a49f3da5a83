"""Append as a transaction through the public API (``attn.append``, M4.5 §0x08C/§0x08E/§0x08H) on
the numpy, Triton (CPU interpreter unless ATTNC_TEST_GPU=1) and AHBM backends, over every cache
layout: outputs against the float64 oracle on committed + staged rows, the seed's phase fixture
run as prefill -> append -> decode on one cache, commits to the request's cache row, and a cache
poisoned (NaN) everywhere outside the committed rows whose every byte outside the rows the call
commits is unchanged, on success, on refusal and on an error after staging."""
import hashlib
import os
from functools import lru_cache

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attn.append takes torch tensors")

import attnc  # noqa: E402
from attnc.compiler import oracle  # noqa: E402
from attnc.compiler.errors import InputError, PlanError  # noqa: E402
from tests.conftest import seed_contracts  # noqa: E402

PAGE = 4
LAYOUTS = {
    "contiguous_bhsd": "contiguous(layout = bhsd)",
    "contiguous_bshd": "contiguous(layout = bshd)",
    "ragged": "ragged",
    "paged_dense_nhd": f"paged(page_size = {PAGE}, layout = nhd, table = dense)",
    "paged_dense_hnd": f"paged(page_size = {PAGE}, layout = hnd, table = dense)",
    "paged_csr_nhd": f"paged(page_size = {PAGE}, layout = nhd, table = csr)",
    "paged_csr_hnd": f"paged(page_size = {PAGE}, layout = hnd, table = csr)",
}
BACKENDS = ["numpy", "triton", "ahbm"]
GPU = os.environ.get("ATTNC_TEST_GPU") == "1"  # the Triton backend then runs on CUDA tensors
DOC = "causal & doc[b, q] == doc[b, k]"
# a mixed batch (§0x08F): a prefill, an append, a decode, an idle request, an append over pages
T_MIX, C_MIX = [0, 6, 9, 3, 5], [4, 2, 1, 0, 6]


@lru_cache(maxsize=None)
def compiled(cache: str, mask: str = "causal", dtype: str = "f32", score: str = ""):
    decl = "tensor doc: i32[b, s]" if "doc" in mask else ""
    name = "append_" + hashlib.sha256(repr((cache, mask, dtype, score)).encode()).hexdigest()[:8]
    return attnc.compile(f"attention {name} {{ heads = 4 / 2 head_dim = 16 dtype = {dtype} {decl} {score} "
                         f"mask = {mask} cache = {cache} }}")


def _round(x: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(x, np.float32))
    return t.to(torch.bfloat16) if dtype == "bf16" else t


class Cache:
    """A cache of the spec's layout with each request's T committed rows (random) and room for
    C more (plus spare room), NaN in every other stored element; requests sit in shuffled cache
    rows / pages."""

    def __init__(self, kind: str, T, C, *, dtype="f32", seed=0, heads_kv=2, d=16):
        rng = np.random.default_rng(seed)
        self.kind, self.T, self.C, self.dtype = kind, np.asarray(T), np.asarray(C), dtype
        B, need = len(T), np.asarray(T) + np.asarray(C)
        self.committed = [(rng.standard_normal((t, heads_kv, d)), rng.standard_normal((t, heads_kv, d)))
                          for t in T]
        meta: dict = {}
        if kind.startswith("contiguous"):
            rows = rng.permutation(B + 2)[:B]
            shape = (B + 2, int(need.max()) + 2, heads_kv, d)  # bshd
            k, v = np.full(shape, np.nan), np.full(shape, np.nan)
            for b, r in enumerate(rows):
                k[r, :T[b]], v[r, :T[b]] = self.committed[b]
            if kind.endswith("bhsd"):
                k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            meta["cache_batch_idx"] = torch.as_tensor(rows)
            self.where = [(r, None) for r in rows]
        elif kind == "ragged":
            size = need + 2
            ptr = np.concatenate([[0], np.cumsum(size)])
            k, v = np.full((int(ptr[-1]), heads_kv, d), np.nan), np.full((int(ptr[-1]), heads_kv, d), np.nan)
            for b in range(B):
                k[ptr[b]:ptr[b] + T[b]], v[ptr[b]:ptr[b] + T[b]] = self.committed[b]
            meta["kv_indptr"] = torch.as_tensor(ptr)
            self.where = [(int(ptr[b]), None) for b in range(B)]
        else:
            pages = -(-need // PAGE) + 1  # one page more than the call needs is allocated
            pool = int(pages.sum()) + 3
            ids = rng.permutation(pool)
            first = np.concatenate([[0], np.cumsum(pages)])
            self.pages = [ids[first[b]:first[b + 1]] for b in range(B)]
            k, v = np.full((pool, PAGE, heads_kv, d), np.nan), np.full((pool, PAGE, heads_kv, d), np.nan)
            for b in range(B):
                t = np.arange(T[b])
                k[self.pages[b][t // PAGE], t % PAGE], v[self.pages[b][t // PAGE], t % PAGE] = self.committed[b]
            if kind.endswith("hnd"):
                k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            if "csr" in kind:
                meta.update(kv_indptr=torch.as_tensor(first), kv_indices=torch.as_tensor(ids[:first[-1]]))
            else:
                rows = rng.permutation(B + 1)[:B]
                table = np.full((B + 1, int(pages.max()) + 1), -1)
                for b, r in enumerate(rows):
                    table[r, :pages[b]] = self.pages[b]
                meta.update(block_table=torch.as_tensor(table), cache_batch_idx=torch.as_tensor(rows))
        keys = ("k_cache", "v_cache") if kind.startswith("paged") else ("k", "v")
        self.keys = keys
        self.arrays = {keys[0]: _round(np.ascontiguousarray(k), dtype), keys[1]: _round(np.ascontiguousarray(v), dtype),
                       "kv_lens": torch.as_tensor(np.asarray(T), dtype=torch.int32), **meta}

    def snapshot(self) -> dict:
        return {n: t.clone() for n, t in self.arrays.items()}

    def to(self, backend: str) -> "Cache":
        """The cache on the backend's device (CUDA for Triton in a GPU run)."""
        if backend == "triton" and GPU:
            self.arrays = {n: t.cuda() for n, t in self.arrays.items()}
        return self

    def rows(self, b: int, lo: int, hi: int, arrays: dict | None = None):
        """Request b's logical K and V rows [lo, hi) as stored (of ``arrays``, default the cache's)."""
        arrays = arrays or {n: self.arrays[n].float().cpu().numpy() for n in self.keys}
        k, v = arrays[self.keys[0]], arrays[self.keys[1]]
        t = np.arange(lo, hi)
        if self.kind.startswith("paged"):
            pg, off = self.pages[b][t // PAGE], t % PAGE
            if self.kind.endswith("hnd"):
                return k[pg, :, off], v[pg, :, off]
            return k[pg, off], v[pg, off]
        base, _ = self.where[b]
        if self.kind == "ragged":
            return k[base + t], v[base + t]
        if self.kind.endswith("bhsd"):
            return k[base][:, t].transpose(1, 0, 2), v[base][:, t].transpose(1, 0, 2)
        return k[base][t], v[base][t]


def new_rows(cache: Cache, seed=1, heads_q=4, d=16):
    rng = np.random.default_rng(seed)
    n = int(cache.C.sum())
    device = cache.arrays["kv_lens"].device
    return tuple(_round(rng.standard_normal((n, h, d)), cache.dtype).to(device) for h in (heads_q, 2, 2))


def doc_ids(T, C, seed=3):
    rng = np.random.default_rng(seed)
    s = int((np.asarray(T) + np.asarray(C)).max())
    return torch.as_tensor(np.cumsum(rng.random((len(T), s)) < 0.3, axis=1), dtype=torch.int32)


def reference(attn, cache: Cache, q, k_new, v_new, tensors):
    p = attn.specialize(4, 2, 16, 16, cache.dtype)
    o = np.zeros((q.shape[0], 4, 16))
    lse = np.full((q.shape[0], 4), -np.inf)
    host = {n: t.cpu().numpy() for n, t in tensors.items()}
    first = 0
    for b, (t, c) in enumerate(zip(cache.T, cache.C)):
        if c:
            rows = slice(first, first + c)
            k = np.concatenate([cache.committed[b][0], k_new[rows].float().cpu().numpy()])
            v = np.concatenate([cache.committed[b][1], v_new[rows].float().cpu().numpy()])
            kc, vc = (np.asarray(_round(x, cache.dtype).float()) for x in (k, v))
            o[rows], lse[rows] = oracle.reference_request(p, b, q[rows].float().cpu().numpy(), kc, vc, host)
        first += c
    return o, lse


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bytes as integers (NaN payloads compare exactly)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]) if t.is_floating_point() else t


def assert_unchanged_outside(cache: Cache, before: dict, committed) -> None:
    """Every stored element outside the rows this call commits (``[T_b, committed[b])``) has the
    bytes it had: the committed history and the NaN poison around the targets alike."""
    for n in cache.keys:
        shape = tuple(cache.arrays[n].shape)
        ids = np.arange(int(np.prod(shape))).reshape(shape)
        keep = torch.ones(ids.size, dtype=torch.bool)
        for b, hi in enumerate(committed):
            if hi > cache.T[b]:
                mine = cache.rows(b, int(cache.T[b]), int(hi), {cache.keys[0]: ids, cache.keys[1]: ids})
                keep[torch.as_tensor(np.asarray(mine[0]).reshape(-1))] = False
        was, now = _bits(before[n]).reshape(-1).cpu(), _bits(cache.arrays[n]).reshape(-1).cpu()
        assert torch.equal(was[keep], now[keep]), f"{n}: bytes outside the rows the call commits changed"


def assert_untouched(cache: Cache, before: dict) -> None:
    for n, t in before.items():
        assert torch.equal(_bits(t), _bits(cache.arrays[n])), f"{n} changed"


def check_call(attn, cache: Cache, backend, tensors=None, **extra):
    cache.to(backend)
    tensors = {n: t.to(cache.arrays["kv_lens"].device) for n, t in (tensors or {}).items()}
    q, k_new, v_new = new_rows(cache)
    before = cache.snapshot()
    o, lse = attn.append(q, k_new, v_new, q_lens=torch.as_tensor(cache.C), return_lse=True, backend=backend,
                         **cache.arrays, **tensors, **extra)
    ref_o, ref_lse = reference(attn, cache, q, k_new, v_new, tensors)
    tol = 2e-2 if cache.dtype == "bf16" else 2e-5
    np.testing.assert_allclose(o.float().cpu().numpy(), ref_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=tol, rtol=tol)
    post = cache.T + cache.C
    assert cache.arrays["kv_lens"].tolist() == post.tolist()
    assert_unchanged_outside(cache, before, post)
    first = 0
    for b, (t, c) in enumerate(zip(cache.T, cache.C)):  # the new rows went to the request's own rows
        k, v = cache.rows(b, int(t), int(t + c))
        assert np.array_equal(k, k_new[first:first + c].float().cpu().numpy())
        assert np.array_equal(v, v_new[first:first + c].float().cpu().numpy())
        first += c
    return o, lse


# ---------------------------------------------------------------- the seed's fixture, through the API
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_append_decode_fixture(backend):
    """§0x08C: one cache taken through prefill (0,5) -> append (5,3) -> decode (8,1).  q = 0 makes
    every visible score 0, so exp(LSE) of a row counts the keys it saw: the visible cells are
    measured from the call's output, the rectangle comes from its manifest and the post-commit
    length from kv_lens."""
    fixture = {c["name"]: c for c in seed_contracts()["phase"]["cases"] if "T" in c}
    attn = compiled(LAYOUTS["paged_dense_nhd"])
    cache = Cache("paged_dense_nhd", [0], [9], seed=7).to(backend)  # room for all nine rows
    dev = cache.arrays["kv_lens"].device
    history_v = []
    for name in ("prefill", "append", "decode"):
        case = fixture[name]
        T, C = case["T"], case["C"]
        assert cache.arrays["kv_lens"].tolist() == [T]
        q = torch.zeros(C, 4, 16, device=dev)
        k_new, v_new = torch.randn(C, 2, 16, device=dev), torch.randn(C, 2, 16, device=dev)
        plan = attn.plan_append(q, k_new, v_new, q_lens=torch.tensor([C]), backend=backend, **cache.arrays)
        entry = plan.manifest.entries[0]
        assert (entry.T, entry.C, entry.phase, entry.post_length) == (T, C, name, case["post"])
        o, lse = attn.append(q, k_new, v_new, q_lens=torch.tensor([C]), plan=plan, return_lse=True,
                             backend=backend, **cache.arrays)
        visible = np.exp(lse.double().cpu().numpy()).sum(axis=0)  # per query head
        rect = entry.C * (entry.T + entry.C)
        assert rect == case["rect"]
        np.testing.assert_allclose(visible, case["visible"], rtol=1e-5)
        assert rect - int(round(visible[0])) == case["masked"]
        assert cache.arrays["kv_lens"].tolist() == [case["post"]]
        history_v.append(v_new)
        # each row's O is the mean of the V rows it saw: [0, T + i]
        v_all = torch.cat(history_v).double().cpu()
        want = torch.stack([v_all[:T + i + 1].mean(0) for i in range(C)])  # [C, H_kv, d]
        np.testing.assert_allclose(o.double().cpu().numpy(), want.repeat_interleave(2, dim=1).numpy(), atol=1e-5)


# ---------------------------------------------------------------- a mixed batch on every layout
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_commits_to_cache_rows(layout, backend):
    """A prefill, an append, a decode and an idle request in shuffled cache rows (pages) with a
    document mask; AHBM runs ADR-0060's decode (C = 1) and prefill (C > 1) programs per request."""
    attn = compiled(LAYOUTS[layout], DOC)
    cache = Cache(layout, T_MIX, C_MIX, seed=len(layout))
    check_call(attn, cache, backend, {"doc": doc_ids(T_MIX, C_MIX)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_with_a_sink(backend):
    """A learned sink per head (``sink = sinks[h]``) on a paged mixed batch: every backend's
    append adds it once per row (the reference: the oracle per request)."""
    attn = compiled(LAYOUTS["paged_csr_nhd"], DOC, score="tensor sinks: f32[h] sink = sinks[h]")
    cache = Cache("paged_csr_nhd", T_MIX, C_MIX, seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, -float("inf")])
    check_call(attn, cache, backend, {"doc": doc_ids(T_MIX, C_MIX), "sinks": sinks})


def test_bf16_cache():
    attn = compiled(LAYOUTS["paged_dense_hnd"], "causal & window(5)", "bf16")
    for backend in ("numpy", "triton"):
        check_call(attn, Cache("paged_dense_hnd", [3, 7], [2, 1], dtype="bf16", seed=4), backend)


# ---------------------------------------------------------------- refusals write nothing
def _shared_page(cache: Cache):
    """Request 1's page for its new rows is also one of request 0's pages."""
    table = cache.arrays["block_table"].clone()
    rows = cache.arrays["cache_batch_idx"].tolist()
    table[rows[1], 1] = table[rows[0], 0]
    return {"block_table": table}


REFUSALS = {
    "capacity_contiguous": ("contiguous_bshd", lambda c: {"kv_lens": torch.tensor([4, 10], dtype=torch.int32)},
                            PlanError, "more than cache row .* token capacity"),
    "capacity_ragged": ("ragged", lambda c: {"kv_lens": torch.tensor([4, 10], dtype=torch.int32)}, PlanError,
                        r"more than its region kv_indptr\[2\] - kv_indptr\[1\]"),
    "capacity_csr": ("paged_csr_nhd", lambda c: {"kv_indices": c.arrays["kv_indices"][:5],
                                                 "kv_indptr": torch.tensor([0, 3, 5])}, PlanError,
                     r"request 1 has T = 7 committed \+ C = 2 new rows = 9, more than its 2 allocated page"),
    "page_outside_pool": ("paged_dense_nhd", lambda c: {"block_table": c.arrays["block_table"].masked_fill(
        c.arrays["block_table"] == int(c.pages[1][2]), 99)}, PlanError, r"block_table\[.*\] = 99 is outside the page pool"),
    "page_shared_by_a_write": ("paged_dense_nhd", _shared_page, PlanError,
                               "page .* receives request .* new rows but is listed by request 0 and 1"),
    "duplicate_cache_row": ("contiguous_bhsd", lambda c: {"cache_batch_idx": torch.tensor([2, 2])}, PlanError,
                            r"cache_batch_idx\[1\] = 2 duplicates"),
    "new_rows_shape": ("ragged", lambda c: {"k_new": torch.zeros(3, 2, 8)}, InputError, "'k_new' has shape"),
    "kv_lens_not_a_tensor": ("ragged", lambda c: {"kv_lens": [4, 7]}, InputError, "advances in place"),
    "stale_manifest": ("paged_dense_hnd", lambda c: {"manifest": attnc.MicrobatchManifest.freeze(
        [0, 1], c.arrays["cache_batch_idx"], [4, 6], [1, 2])}, PlanError, "is stale: request 1 .* T = 6"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal_mutates_nothing(case):
    layout, change, error, match = REFUSALS[case]
    attn = compiled(LAYOUTS[layout])
    cache = Cache(layout, [4, 7], [1, 2], seed=9)
    q, k_new, v_new = new_rows(cache)
    args = {**cache.arrays, "q_lens": torch.tensor([1, 2])}
    args.update(change(cache))
    k_new = args.pop("k_new", k_new)
    before = cache.snapshot()
    with pytest.raises(error, match=match):
        attn.append(q, k_new, v_new, backend="numpy", **args)
    assert_untouched(cache, before)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_error_after_staging_restores_the_cache():
    """A score program that is infinite at a visible cell fails inside the numpy program, after
    the rows were staged: the staged slots get their old bytes (NaN) back, kv_lens stays."""
    attn = compiled(LAYOUTS["paged_csr_nhd"], score="score = score / (q - k - 1)")
    cache = Cache("paged_csr_nhd", [4, 7], [1, 2], seed=9)
    q, k_new, v_new = new_rows(cache)
    before = cache.snapshot()
    with pytest.raises(PlanError, match="score program produced"):
        attn.append(q, k_new, v_new, q_lens=torch.tensor([1, 2]), backend="numpy", **cache.arrays)
    assert_untouched(cache, before)


# ---------------------------------------------------------------- a plan's validated call, reused
def test_a_plan_keeps_its_validated_call_for_equal_inputs(monkeypatch):
    """The layers of a serving step: one plan, then appends over other storage tensors of the same
    shapes with the same metadata reuse the plan's validated call (validate_append does not run
    again) and write and attend correctly; other metadata values are validated again and refused."""
    import attnc.serving
    attn = compiled(LAYOUTS["paged_dense_nhd"])
    layers = [Cache("paged_dense_nhd", T_MIX, C_MIX, seed=5) for _ in range(2)]
    q, k_new, v_new = new_rows(layers[0])
    q_lens = torch.as_tensor(layers[0].C)
    plan = attn.plan_append(q, k_new, v_new, q_lens=q_lens, backend="numpy", **layers[0].arrays)
    runs = []
    validate = attnc.serving.validate_append
    monkeypatch.setattr(attnc.serving, "validate_append", lambda *a, **k: runs.append(1) or validate(*a, **k))
    for cache in layers:
        check_call(attn, cache, "numpy", plan=plan)
    assert runs == []
    other = Cache("paged_dense_nhd", T_MIX, C_MIX, seed=5)
    other.arrays["kv_lens"][0] += 1  # (request 0 has room: one more committed row)
    with pytest.raises(PlanError, match="plan was made for manifest .* plan it again"):
        attn.append(q, k_new, v_new, q_lens=q_lens, plan=plan, backend="numpy", **other.arrays)
    assert runs == [1]
