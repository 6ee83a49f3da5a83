"""Bound split calls (``backends/triton/bound_decode.py``): a decode call whose signature ran before
skips the layers between ``Attention.decode`` and the launches, and answers exactly what the
validating path answers; what reads values still follows every call (kv_lens and the page table
changed in place or replaced: a plan made from them, their values checked; a plan the cache
dropped; the rows' non-finite rule), and bad metadata raises the validating path's error.  On the
CPU the kernels run in Triton's interpreter with the calls on a GPU call's path for the non-finite
rule (``runtime.marks_on_device``); with ATTNC_TEST_GPU=1 on the GPU, where the bound launches go
straight to the C launchers."""
from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.backends.triton import bound_decode  # noqa: E402
from attnc.backends.triton import plans as P  # noqa: E402
from attnc.compiler.errors import AttncError, PlanError  # noqa: E402

from tests.conftest import bound_answers, triton_setting  # noqa: E402

DEV, GPU, DT, DTS, KW = triton_setting()
SPEC = f"attention bd_paged {{ dtype = {DTS} mask = causal cache = paged(page_size = 4, layout = nhd) }}"


@pytest.fixture
def answered(monkeypatch):
    """The calls the bound split call answered (True per call it took, False per one it declined),
    the calls on a GPU call's non-finite path and split calls on CPU tensors on Triton."""
    return bound_answers(monkeypatch, bound_decode.BoundDecode)


def inputs(b=2, hq=4, hkv=2, d=16, seed=1):
    """q [b, hq, d] and a paged cache: 8 pages of 4 rows, two requests of 13 and 16 keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(DEV, DT)
    kc, vc = (torch.randn(8, 4, hkv, d, generator=g).to(DEV, DT) for _ in range(2))
    table = torch.tensor([[3, 1, 6, 0], [2, 7, 5, 4]], dtype=torch.int32)[:b]
    lens = torch.tensor([13, 16], dtype=torch.int32)[:b]
    return q, {"k_cache": kc, "v_cache": vc, "block_table": table, "kv_lens": lens}


def validated(q, cache, return_lse=True):
    """The validating path's answer: a fresh Attention, its first call (nothing bound yet)."""
    return attnc.compile(SPEC).decode(q, return_lse=return_lse, **cache)


def same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_repeated_decode_is_answered_by_its_bound_call_bit_for_bit(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    first = attn.decode(q, return_lse=True, **cache)  # validated, planned, launched: then bound
    assert answered == []
    again = attn.decode(q, return_lse=True, **cache)
    o = attn.decode(q.clone(), **cache)  # another q, the same signature; no LSE asked
    assert answered == [True, True]
    same(first, again)
    assert torch.is_tensor(o) and torch.equal(o, first[0])
    assert again[0].shape == (2, 4, 16) and again[1].shape == (2, 4) and again[1].dtype == torch.float32
    from attnc.compiler import dispatch
    numpy = attnc.compile(SPEC)  # (the numpy backend, float64 inside: the bound answer is right too)
    dispatch_default = dispatch.device_default
    try:
        dispatch.device_default = lambda device: "numpy"
        ref = numpy.decode(q.cpu(), **{n: t.cpu() for n, t in cache.items()})
    finally:
        dispatch.device_default = dispatch_default
    assert torch.allclose(again[0].float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


def test_metadata_changed_in_place_or_replaced_is_planned_again(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    attn.decode(q, **cache)
    before = attn.decode(q, return_lse=True, **cache)
    cache["kv_lens"][0] = 9  # the same tensor, new values (its version moves): a plan of its own
    after = attn.decode(q, return_lse=True, **cache)
    assert answered == [True, False]  # declined: the validating path planned the new lengths
    same(after, validated(q, cache))
    assert not torch.equal(before[0], after[0])
    same(attn.decode(q, return_lse=True, **cache), after)
    assert answered[-1] is True  # (bound again: the plan of these values is in the cache)
    bound = next(b for b in attn._bound_splits.values() if b)
    assert all(P.PLANS.stored_key(k) is k for k in bound.keys.values())  # (the cache's own keys: by identity)
    cache["block_table"][1, 0] = 6  # another first page for request 1 (request 0's third)
    moved = attn.decode(q, return_lse=True, **cache)
    same(moved, validated(q, cache))
    assert not torch.equal(moved[0][1], after[0][1])
    cache["kv_lens"] = torch.tensor([5, 16], dtype=torch.int32)  # a new tensor, same signature
    replaced = attn.decode(q, return_lse=True, **cache)
    same(replaced, validated(q, cache))
    same(attn.decode(q, return_lse=True, **cache), replaced)
    assert answered == [True, False, True, False, False, True]


@pytest.mark.parametrize("bad", ["lens", "page"])
def test_bad_metadata_on_a_bound_signature_raises_the_validating_paths_error(answered, bad):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    attn.decode(q, **cache)
    attn.decode(q, **cache)
    assert answered == [True]
    if bad == "lens":
        cache["kv_lens"][1] = 17  # past its four pages of four rows
    else:
        cache["block_table"][0, 2] = 99  # a page the cache has not
    with pytest.raises(AttncError) as fresh:
        validated(q, cache)
    with pytest.raises(AttncError) as bound:
        attn.decode(q, **cache)
    assert type(bound.value) is type(fresh.value) and str(bound.value) == str(fresh.value)
    assert answered == [True, False]
    with pytest.raises(AttncError) as again:  # (and again: a failed call leaves nothing to take it)
        attn.decode(q, **cache)
    assert str(again.value) == str(fresh.value) and answered == [True, False, False]


def test_another_signature_is_validated_first(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    attn.decode(q, **cache)
    attn.decode(q, **cache)
    q1, cache1 = inputs(b=1)  # one request: its own validation, plan and binding
    one = attn.decode(q1, return_lse=True, **cache1)
    assert answered == [True]
    same(one, validated(q1, cache1))
    wide = dict(cache, kv_lens=cache["kv_lens"].long())  # int64 lengths: another signature too
    same(attn.decode(q, return_lse=True, **wide), validated(q, wide))
    assert answered == [True]
    with pytest.raises(AttncError) as fresh:
        validated(q[..., :-1].contiguous(), cache)
    with pytest.raises(AttncError) as bound:  # a bad call is never a bound call's: the same error
        attn.decode(q[..., :-1].contiguous(), **cache)
    assert str(bound.value) == str(fresh.value) and answered == [True]


def test_layers_sharing_the_metadata_are_each_answered_by_the_bound_call(answered, monkeypatch):
    """A model's decode step: every layer calls with the same kv_lens and page table and its own
    K/V cache (a plan each, the K/V addresses in its key); the bound call keeps each plan's key."""
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    layers = [dict(cache, k_cache=cache["k_cache"] + i, v_cache=cache["v_cache"] - i) for i in range(3)]
    first = [attn.decode(q, return_lse=True, **layer) for layer in layers]  # (the second and third: declined)
    for layer, want in zip(layers, first):
        same(attn.decode(q, return_lse=True, **layer), want)
    assert answered == [False, False, True, True, True]
    from attnc.backends.triton import split_calls
    made = []
    monkeypatch.setattr(split_calls.SplitCalls, "_split_key",
                        lambda self, *a, _key=split_calls.SplitCalls._split_key: made.append(1) or _key(self, *a))
    for layer, want in zip(layers, first):
        same(attn.decode(q, return_lse=True, **layer), want)
    assert answered[5:] == [True] * 3 and made == []  # (each layer's key kept: none made again)
    same(first[2], validated(q, layers[2]))


def test_options_and_inference_tensors_take_the_validating_path(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    for _ in range(2):
        attn.decode(q, engine="split", **cache)
    with torch.inference_mode():
        lens = torch.tensor([13, 16], dtype=torch.int32)
    attn.decode(q, **cache)
    same((attn.decode(q, **dict(cache, kv_lens=lens)),), (attn.decode(q, **cache),))
    assert answered == [False, True]  # (the inference tensor: declined; no plan is cached for it)


def test_a_plan_the_cache_dropped_is_made_again_and_nothing_holds_the_callers_tensors(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    first = attn.decode(q, return_lse=True, **cache)
    attn.decode(q, **cache)
    split = P.PLANS.get(next(iter(attn._bound_splits[next(iter(attn._bound_splits))].keys.values())),
                        [None, None, cache["block_table"], cache["kv_lens"]])
    assert split is not None and split.runs  # (the bound launches live on the plan)
    arrays = weakref.ref(split.arrays["kv_lens"])
    del split
    P.PLANS.clear()
    gc.collect()
    assert arrays() is None  # (nothing bound keeps a plan the cache let go)
    same(attn.decode(q, return_lse=True, **cache), first)
    same(attn.decode(q, return_lse=True, **cache), first)
    assert answered == [True, False, True]
    held = [weakref.ref(t) for t in cache.values()] + [weakref.ref(q)]
    del q, cache, first
    gc.collect()
    assert all(r() is None for r in held)


def test_the_non_finite_rule_holds_on_bound_calls(answered, monkeypatch):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    attn.decode(q, **cache)
    attn.decode(q, **cache)
    bad = q.clone()
    bad[1, 0, 3] = float("nan")
    attn.decode(bad, **cache)  # bound: the combine marks the row, the check raises it
    assert answered == [True, True]
    with pytest.raises(PlanError, match="NaN or \\+inf"):
        attn.check_numerics()
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "1")  # rows checked at the call, on the bound path too
    with pytest.raises(PlanError, match="NaN or \\+inf") as bound:
        attn.decode(bad, **cache)
    with pytest.raises(PlanError) as fresh:
        validated(bad, cache)
    assert str(bound.value) == str(fresh.value)
    assert answered == [True, True]  # (the bound call raised: had it declined, a False would be here)


def test_the_raw_branch_hands_the_c_launchers_the_launch_layers_arguments(answered, monkeypatch):
    """The bound split call's C-launcher branch, on the CPU with stand-in C launchers (a GPU runs
    the real ones below): the grids, the current stream and the same arguments, in the same order,
    as ``SplitCall`` hands the launch layer on the validating path."""
    if GPU:
        pytest.skip("the GPU test below runs the real C launchers")
    from types import SimpleNamespace
    from triton.runtime import driver
    from attnc.backends.triton import launch as L
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    first = attn.decode(q, return_lse=True, **cache)
    seen = []
    original = L.Launcher.launch

    def spy(self, grid, args, key=None, stream=None):
        seen.append((self, tuple(grid), args + self.tail, key))
        return original(self, grid, args, key, stream)
    monkeypatch.setattr(L.Launcher, "launch", spy)
    same(attn.decode(q, return_lse=True, **cache), first)  # bound, not raw here: through the launch layer
    assert answered == [True] and len(seen) == 2
    calls = []

    class FakeRaw:
        positions = ()

        def __init__(self, name):
            self.name = name

        def __call__(self, g, stream, args):
            calls.append((self.name, g, stream, args))
    for i, (launcher, _, _, key) in enumerate(seen):
        launcher.raw[key] = FakeRaw(i)
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_stream=lambda device: 1234,
                                                           get_current_device=lambda: 0))
    flag = attn.kernel("triton", attn.specialize(4, 2, 16, 16, DTS))._nonfinite  # (the combine's flag)
    o, lse = attn.decode(q, return_lse=True, **cache)
    assert answered == [True, True] and len(seen) == 2 and [c[0] for c in calls] == [0, 1]
    for (launcher, grid, want, _), (_, g, stream, got) in zip(seen, calls):
        assert g == grid + (1,) * (3 - len(grid)) and stream == 1234 and len(got) == len(want)
        for a, b in zip(got, want):
            if hasattr(a, "data_ptr"):  # O, LSE and the workspace are new each call: their layout
                assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
                if any(a is t for t in (q, *cache.values(), *flag.values())):
                    assert a is b
            else:
                assert a == b
        assert launcher.launches["raw"] >= 1
    assert calls[1][3][5] is o and calls[1][3][6] is lse and calls[0][3][3] is calls[1][3][0]  # O, LSE, workspace


@pytest.mark.skipif(not GPU, reason="the C launchers (ATTNC_TEST_GPU=1 on a GPU)")
def test_gpu_a_bound_decode_launches_through_the_c_launchers(answered):
    attn = attnc.compile(SPEC)
    q, cache = inputs()
    first = attn.decode(q, return_lse=True, **cache)
    again = attn.decode(q, return_lse=True, **cache)
    bound = next(b for b in attn._bound_splits.values() if b)
    split = P.PLANS.get(next(iter(bound.keys.values())), [None, None, cache["block_table"], cache["kv_lens"]])
    runs = list(split.runs.values())
    assert answered == [True] and runs and all(r.raws is not None for r in runs)
    before = sum(r.producer.launches["raw"] + r.combine.launches["raw"] for r in runs)
    third = attn.decode(q, return_lse=True, **cache)
    assert sum(r.producer.launches["raw"] + r.combine.launches["raw"] for r in runs) == before + 2
    same(first, again)
    same(first, third)
