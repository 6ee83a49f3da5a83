"""Appends that cannot corrupt a cache (issue 35), on the numpy, Triton (the CPU interpreter, or
CUDA tensors under ATTNC_TEST_GPU=1) and AHBM backends: every refusal and every failure injected after staging (the attention, the
output check, the commit itself) leaves the NaN-poisoned cache's bytes and kv_lens as they were,
byte by byte, and the same input gives the same located error on every backend.  Tiny shapes:
two requests, T = [4, 7], C = [1, 2] unless a case needs more."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attn.append takes torch tensors")

import attnc.serving as serving  # noqa: E402
from attnc.compiler.errors import InputError, PlanError  # noqa: E402
from tests.numerics.test_append import LAYOUTS, Cache, assert_untouched, compiled, new_rows  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow on the poisoned rows
BACKENDS = ["numpy", "triton", "ahbm"]


def attempt(layout, backend, change=None, *, T=(4, 7), C=(1, 2), spec=""):
    """One append on a fresh poisoned cache after ``change(cache, args, rows)``; returns the error
    (or None) after checking that nothing the call may write changed when it failed."""
    attn = compiled(LAYOUTS[layout], score=spec)
    cache = Cache(layout, list(T), list(C), seed=9).to(backend)  # (the Triton backend's device)
    q, k_new, v_new = new_rows(cache)
    args = {**cache.arrays, "q_lens": torch.tensor(list(C))}
    rows = {"q": q, "k_new": k_new, "v_new": v_new}
    if change is not None:
        change(cache, args, rows)
    cache.arrays["kv_lens"] = args["kv_lens"]  # (a case may pass another kv_lens: that is what must stay)
    before = {n: t.clone() for n, t in cache.arrays.items()}
    try:
        attn.append(rows["q"], rows["k_new"], rows["v_new"], backend=backend, **args)
    except Exception as e:  # noqa: BLE001 (the test asserts on it)
        assert_untouched(cache, before)
        return e
    assert cache.arrays["kv_lens"].tolist() == [t + c for t, c in zip(T, C)]
    return None


# ---------------------------------------------------------------- refused before anything is written
def _narrow_lengths(dtype):
    return lambda cache, args, rows: args.update(kv_lens=args["kv_lens"].to(dtype))


def _idle_row_lists_a_written_page(cache, args, rows):
    """The dense table's unscheduled row lists the page request 1's new rows go to."""
    table = args["block_table"].clone()
    idle = sorted(set(range(table.shape[0])) - set(args["cache_batch_idx"].tolist()))[0]
    table[idle, 0] = int(cache.pages[1][7 // 4])
    args["block_table"] = table


def _expanded_lengths(cache, args, rows):
    args["kv_lens"] = torch.tensor([4], dtype=torch.int32, device=args["kv_lens"].device).expand(2)


def _inference_lengths(cache, args, rows):
    with torch.inference_mode():
        args["kv_lens"] = args["kv_lens"].clone()


def _same_storage(cache, args, rows):
    args[cache.keys[1]] = args[cache.keys[0]]


def _new_rows_in_the_cache(cache, args, rows):
    rows["k_new"] = args[cache.keys[0]][:3]  # a view of the K storage the call writes


def _lengths_in_metadata(cache, args, rows):
    ptr = args["kv_indptr"].to(torch.int32).clone()
    ptr[1:3] = torch.tensor([4, 7], dtype=torch.int32, device=ptr.device)  # kv_lens = [4, 7] lives inside kv_indptr
    args["kv_indptr"], args["kv_lens"] = ptr, ptr[1:3]


REFUSALS = {  # name -> (layout, change, T, C, error, match)
    "int8_lengths": ("ragged", _narrow_lengths(torch.int8), (120, 3), (10, 1), PlanError,
                     r"kv_lens is int8, and request 0 would commit T = 120 \+ C = 10 = 130 rows, more than int8 "
                     r"holds \(127\)"),
    "uint8_lengths": ("ragged", _narrow_lengths(torch.uint8), (250, 3), (10, 1), PlanError,
                      r"kv_lens is uint8, and request 0 would commit .* = 260 rows, more than uint8 holds \(255\)"),
    "idle_row_page": ("paged_dense_nhd", _idle_row_lists_a_written_page, (4, 7), (1, 2), PlanError,
                      r"page \d+ receives request 1's new rows but is listed by block_table\[\d, 0\], a row this "
                      "call does not schedule"),
    "expanded_lengths": ("contiguous_bhsd", _expanded_lengths, (4, 4), (1, 2), InputError,
                         r"'kv_lens' \(strides \[0\]\) repeats one memory location"),
    "inference_lengths": ("ragged", _inference_lengths, (4, 7), (1, 2), InputError,
                          r"'kv_lens' was made under torch.inference_mode\(\)"),
    "k_is_v": ("paged_csr_nhd", _same_storage, (4, 7), (1, 2), InputError,
               "'k_cache' shares memory with 'v_cache'"),
    "k_new_in_cache": ("ragged", _new_rows_in_the_cache, (4, 7), (1, 2), InputError,
                       "'k' shares memory with 'k_new'"),
    "lengths_in_metadata": ("ragged", _lengths_in_metadata, (4, 7), (1, 2), InputError,
                            "'kv_lens' shares memory with 'kv_indptr'"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal_writes_nothing(case, backend):
    layout, change, T, C, error, match = REFUSALS[case]
    e = attempt(layout, backend, change, T=T, C=C)
    assert isinstance(e, error) and e is not None, repr(e)
    with pytest.raises(error, match=match):
        raise e


def test_kv_and_v_halves_of_one_tensor_are_not_aliases():
    """K and V as the two halves of one [pages, 2, page, H, d] tensor interleave in memory but
    share no element: accepted, and the append is right (the halves hold what was committed)."""
    def halves(cache, args, rows):
        both = torch.stack([args["k_cache"], args["v_cache"]], dim=1)
        args["k_cache"], args["v_cache"] = both[:, 0], both[:, 1]
        cache.arrays.update(k_cache=both[:, 0], v_cache=both[:, 1])
    assert attempt("paged_csr_nhd", "numpy", halves) is None


# ---------------------------------------------------------------- failures after staging roll back
def _poison(what, value=float("nan")):
    def change(cache, args, rows):
        if what == "k_cache":  # request 1's committed row 2, which both its new rows see
            k = args[cache.keys[0]]
            cache_rows = cache.rows(1, 2, 3, {cache.keys[0]: np.arange(k.numel()).reshape(k.shape),
                                              cache.keys[1]: np.arange(k.numel()).reshape(k.shape)})[0]
            k.view(-1)[int(np.asarray(cache_rows).reshape(-1)[5])] = value
        else:
            rows[what][2, 1, 0] = value
    return change


NONFINITE = {  # name -> (change, spec, the error every backend gives)
    "nan_q": (_poison("q"), "", r"score program produced NaN or \+inf at a visible key of query row \(b=1, h=1, q=8\)"),
    "nan_k_cache": (_poison("k_cache"), "", r"query row \(b=1, h=[0-3], q=7\)"),
    "inf_k_new": (_poison("k_new", float("inf")), "", r"query row \(b=1, h=2, q=8\)"),
    "inf_v_new": (_poison("v_new", float("inf")), "",
                  r"output of query row \(b=1, h=2, q=7\) is not finite .* nothing was committed"),
    "scale_1e38": (None, "scale = 1e38", r"query row \(b=0, h=0, q=4\)"),
}


@pytest.mark.parametrize("case", sorted(NONFINITE))
def test_nonfinite_output_commits_nothing_and_every_backend_says_so(case):
    change, spec, match = NONFINITE[case]
    errors = [attempt("ragged", backend, change, spec=spec) for backend in BACKENDS]
    for backend, e in zip(BACKENDS, errors):
        assert isinstance(e, PlanError), f"{backend}: {e!r}"
        with pytest.raises(PlanError, match=match):
            raise e
    assert len({str(e) for e in errors}) == 1, [str(e) for e in errors]


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_at_commit_rolls_back_and_a_retry_appends_once(backend, monkeypatch):
    """A failure after kv_lens was written (injected into the commit) puts the staged slots and
    kv_lens back; the same call again then commits T + C once."""
    real = serving._Transaction.commit

    def failing(txn):
        real(txn)
        raise RuntimeError("injected at commit")

    attn = compiled(LAYOUTS["paged_dense_hnd"])
    cache = Cache("paged_dense_hnd", [4, 7], [1, 2], seed=9).to(backend)
    q, k_new, v_new = new_rows(cache)
    before = cache.snapshot()
    monkeypatch.setattr(serving._Transaction, "commit", failing)
    with pytest.raises(RuntimeError, match="injected at commit"):
        attn.append(q, k_new, v_new, q_lens=torch.tensor([1, 2]), backend=backend, **cache.arrays)
    assert_untouched(cache, before)
    monkeypatch.setattr(serving._Transaction, "commit", real)
    attn.append(q, k_new, v_new, q_lens=torch.tensor([1, 2]), backend=backend, **cache.arrays)
    assert cache.arrays["kv_lens"].tolist() == [5, 9]


@pytest.mark.parametrize("step", ["run", "check_output", "stage_v"])
def test_failure_injected_after_staging_rolls_back(step, monkeypatch):
    """Failures in the attention, in the output check, and between the K and the V writes."""
    if step == "stage_v":
        real = serving._Transaction.stage

        def stage(txn, saved):
            txn.v_new = txn.v_new[:2]  # the V write fails after the K rows were staged
            real(txn, saved)
        monkeypatch.setattr(serving._Transaction, "stage", stage)
    elif step == "run":
        from attnc.backends.numpy.torch_api import NumpyAppend
        monkeypatch.setattr(NumpyAppend, "run", lambda self, txn, plan: 1 / 0)
    else:
        monkeypatch.setattr(serving._Transaction, "check_output", lambda self, o, lse: 1 / 0)
    e = attempt("contiguous_bshd", "numpy")
    assert isinstance(e, (ZeroDivisionError, RuntimeError)), repr(e)
