"""Token-major (bshd) q, k, v and O on the Gluon engine, the host side (no GPU): which memory
orders a call's tensors have (``attnc.layouts``), which layout each gets on the engine
(``choice.gluon_layouts``, ``choose_prefill``, ``PrefillConfig.layouts``), the TMA descriptors the
launch makes for them (``launch.tma_geometry``, ``PrefillLaunch._gluon_descriptor``) and the tile
coordinates the kernel computes (``gluon_engine._tile_origin``, run in Triton's interpreter, and
its twin ``launch.tile_origin``): each (b, h, row) lands on that element.  O's order for the public
call, on the CPU backends (the Triton kernel interpreted, numpy): token-major for a token-major q,
the same values as a contiguous call.  The engine's numerics: tests/numerics/test_triton_gluon.py
(ATTNC_TEST_GPU=1); its sm_90 compile: tests/numerics/test_gluon_bshd_sm90_compile.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
triton = pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc import layouts  # noqa: E402
from attnc.backends.triton import choice, launch, plans  # noqa: E402
from attnc.backends.triton.kernels import gluon_engine  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from attnc.compiler.plan import plan as make_plan  # noqa: E402
from tests.conftest import prefill_launches, triton_device  # noqa: E402


def token_major(b, h, s, d, dtype=torch.bfloat16, extra=0, device="cpu"):
    """transformers' q: its [B, S, H * d (+ extra)] projection viewed [B, S, H, d] and transposed
    (``extra`` columns: a slice of a fused projection, rows H * d + extra apart)."""
    x = torch.randn(b, s, h * d + extra).to(device=device, dtype=dtype)
    return x[..., :h * d].view(b, s, h, d).transpose(1, 2)


# ---------------------------------------------------------------- attnc.layouts
def test_orders_of_contiguous_token_major_and_other_strides():
    q = token_major(2, 4, 24, 16)
    assert layouts.order_of(q.shape, q.stride()) == "bshd" and layouts.token_rows(q.shape, q.stride()) == 64
    c = q.contiguous()
    assert layouts.order_of(c.shape, c.stride()) == "bhsd"
    fused = token_major(2, 4, 24, 16, extra=128)  # a slice of a fused QKV projection: rows 192 apart
    assert layouts.order_of(fused.shape, fused.stride()) == "bshd" and layouts.token_rows(fused.shape, fused.stride()) == 192
    for other in (c.transpose(2, 3), c[:, :, ::2], q[:, ::2], c.permute(1, 0, 2, 3)):  # neither
        assert layouts.order_of(other.shape, other.stride()) is None, other.stride()
    one_row = token_major(3, 4, 1, 16)  # a decode step's q: contiguous as torch counts it
    assert one_row.is_contiguous() and layouts.order_of(one_row.shape, one_row.stride()) == "bhsd"
    one_head = token_major(2, 1, 24, 16)
    assert layouts.order_of(one_head.shape, one_head.stride()) == "bhsd"
    for t in (q, c, fused, one_row, one_head, c[:, :, ::2]):  # torch's own contiguity rule
        assert layouts.is_contiguous(t.shape, t.stride()) == t.is_contiguous()


def test_o_follows_a_token_major_q_so_its_transpose_is_contiguous():
    q = token_major(2, 4, 24, 16)
    assert layouts.out_order(q.shape, q.stride()) == "bshd"
    o = layouts.new_out(q, (2, 4, 24, 8))
    assert o.shape == (2, 4, 24, 8) and o.transpose(1, 2).is_contiguous() and o.dtype == q.dtype
    assert o.stride() == layouts.out_strides(o.shape, "bshd")
    c = q.contiguous()
    assert layouts.out_order(c.shape, c.stride()) == "bhsd" and layouts.new_out(c, (2, 4, 24, 8)).is_contiguous()


# ---------------------------------------------------------------- the engine's layouts: the decision
def test_gluon_layouts_per_tensor():
    q, k, v = token_major(2, 8, 200, 128), token_major(2, 2, 200, 128), token_major(2, 2, 200, 128)
    assert choice.gluon_layouts(q, k, v, "bshd") == ("bshd",) * 4
    assert choice.gluon_layouts(q, k.contiguous(), v.contiguous(), "bshd") == ("bshd", "bhsd", "bhsd", "bshd")
    assert choice.gluon_layouts(q.contiguous(), k.contiguous(), v.contiguous(), "bhsd") == choice.BHSD_LAYOUTS
    fused = token_major(2, 8, 200, 128, extra=2 * 2 * 128)  # rows 1536 apart: 16-byte pitch
    assert choice.gluon_layouts(fused, k, v, "bshd")[0] == "bshd"
    every_other_row = token_major(2, 8, 400, 128)[:, :, ::2]  # rows 2 * H * d apart: token-major too
    assert choice.gluon_layouts(every_other_row, k, v, "bshd")[0] == "bshd"


@pytest.mark.parametrize("case", ["d192", "odd_pitch", "misaligned", "every_other_head"])
def test_gluon_layouts_refuses_what_tma_cannot_copy(case):
    k = token_major(2, 2, 64, 64)
    q = {"d192": token_major(2, 4, 64, 192),  # a 256-wide box would read the next head's columns
         "odd_pitch": token_major(2, 4, 64, 64, extra=4),  # rows 260 bf16 apart: not 16 bytes
         "misaligned": torch.randn(2 * 64 * 4 * 64 + 1).to(torch.bfloat16)[1:].view(2, 64, 4, 64).transpose(1, 2),
         "every_other_head": token_major(2, 8, 64, 64)[:, ::2]}[case]
    why = choice.gluon_layouts(q, k, k, "bshd")
    assert isinstance(why, str) and "'q'" in why and "16-byte aligned" in why
    program = attnc.compile("attention g { mask = causal }").specialize(4, 2, q.shape[3], 64, "bf16")
    assert choice.gluon_call_refusal(program, 64, 64, why, 90) is not None
    # contiguous, the same head dims read bhsd (a 192-wide head as 256 zero-filled columns)
    assert choice.gluon_layouts(q.contiguous(), k, k, "bhsd")[0] == "bhsd"


def _choose(monkeypatch, layouts_, asked=None, d=128, s=200):
    monkeypatch.setattr(choice, "interpreted", lambda: False)  # (the decision as a GPU host makes it)
    if not gluon_engine.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    program = attnc.compile("attention g { mask = causal }").specialize(8, 2, d, d, "bf16")
    return choice.choose_prefill(program, s, s, lambda bm, bn: make_plan(program, 2, s, s, {}, bm, bn),
                                 asked=asked or {}, tuned=None, contiguous=False, device_capability=90,
                                 layouts=layouts_)


def test_choose_prefill_keeps_the_layouts_on_the_engine_and_names_a_refusal(monkeypatch):
    config, _ = _choose(monkeypatch, ("bshd", "bhsd", "bhsd", "bshd"))
    assert config.engine == "gluon" and config.layouts == ("bshd", "bhsd", "bhsd", "bshd")
    assert "q/k/v/o bshd/bhsd/bhsd/bshd" in config.describe()
    config, _ = _choose(monkeypatch, choice.BHSD_LAYOUTS)
    assert config.engine == "gluon" and config.layouts == choice.BHSD_LAYOUTS and "q/k/v/o" not in config.describe()
    why = "the Gluon engine reads q, k and v ... 16-byte aligned ...: 'q' is neither"
    config, _ = _choose(monkeypatch, why)
    assert config.engine == "triton" and config.layouts == choice.BHSD_LAYOUTS  # (the Triton kernel takes strides)
    with pytest.raises(ValueError, match="'q' is neither"):
        _choose(monkeypatch, why, asked={"engine": "gluon"})


# ---------------------------------------------------------------- the launch: descriptors and coordinates
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("b, h, s, d, extra", [(2, 3, 5, 4, 0), (3, 2, 7, 8, 8), (1, 4, 3, 2, 0)])
def test_geometry_and_tile_origins_address_each_element(layout, b, h, s, d, extra):
    """For every (b, h, row): the 2-D view ``tma_geometry`` describes, at ``tile_origin``'s
    coordinates plus the row, holds exactly t[b, h, row, :d] -- and the kernel's own
    ``_tile_origin`` (interpreted) gives those coordinates."""
    t = token_major(b, h, s, d, torch.float32, extra) if layout == "bshd" else torch.randn(b, h, s, d)
    shape, strides, box = launch.tma_geometry(t.shape, t.stride(), d, 64, layout)
    assert box == [64, d] and strides[1] == 1
    flat = torch.as_strided(t, shape, strides)
    origins = _kernel_origins(b * h, s, h, d, layout == "bshd")
    for bh in range(b * h):
        row, col = launch.tile_origin(bh, s, h, d, layout)
        assert (row, col) == origins[bh]
        for r in range(s):
            torch.testing.assert_close(flat[row + r, col:col + d], t[bh // h, bh % h, r], rtol=0, atol=0)
    if layout == "bshd":  # the rows past a request's S are the next request's (masked by the engine, never stored)
        assert shape == [b * s, h * d] and strides[0] == h * d + extra


@triton.jit
def _origins(OUT, S, H: triton.language.constexpr, COLS: triton.language.constexpr,
             BSHD: triton.language.constexpr):
    bh = triton.language.program_id(0)
    row, col = gluon_engine._tile_origin(bh, S, H, COLS, BSHD)
    triton.language.store(OUT + 2 * bh, row)
    triton.language.store(OUT + 2 * bh + 1, col)


def _kernel_origins(bh, s, heads, cols, bshd):
    out = torch.full((bh, 2), -1, dtype=torch.int32, device=triton_device())  # (run where Triton runs)
    _origins[(bh,)](out, s, heads, cols, bshd)
    return [tuple(int(x) for x in r) for r in out.cpu()]


def test_a_launch_makes_its_descriptors_and_constexprs_from_the_config(monkeypatch):
    """``PrefillLaunch`` on the Gluon engine (made on the CPU: nothing launched): the constexprs
    Q_BSHD .. O_BSHD from ``config.layouts``, q's descriptor over [B * S, H * d] (its rows the
    projection's pitch) in [64, d] boxes, K's contiguous one over [B * H_kv * S, d], O's columns."""
    if not gluon_engine.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    b, s, d = 2, 200, 128
    q = token_major(b, 8, s, d, extra=256)
    k = torch.randn(b, 2, s, d).to(torch.bfloat16)
    lay = choice.gluon_layouts(q, k, k, layouts.out_order(q.shape, q.stride()))
    assert lay == ("bshd", "bhsd", "bhsd", "bshd")
    config, plan = _choose(monkeypatch, lay)
    module = attnc.compile("attention g { mask = causal }").kernel(
        "triton", attnc.compile("attention g { mask = causal }").specialize(8, 2, d, d, "bf16")).module
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    run = launch.PrefillLaunch(module, config, plans.upload(plans.walk_arrays(plan), "cpu"), (b, s, s), "cpu")
    c = run.launcher.constexprs
    assert (c["Q_BSHD"], c["K_BSHD"], c["V_BSHD"], c["O_BSHD"]) == (True, False, False, True)
    qd = run._gluon_descriptor(q, 64, "q")
    assert (list(qd.shape), list(qd.strides), list(qd.block_shape)) == ([b * s, 8 * d], [8 * d + 256, 1], [64, d])
    assert qd.base.data_ptr() == q.data_ptr()  # the view itself: nothing copied
    kd = run._gluon_descriptor(k, config.block_n, "k")
    assert (list(kd.shape), list(kd.strides), list(kd.block_shape)) == ([b * 2 * s, d], [d, 1], [config.block_n, d])
    o = layouts.new_out(q, (b, 8, s, d))
    od = run._gluon_descriptor(o, 64, "o", keep=False)
    assert (list(od.shape), list(od.strides)) == ([b * s, 8 * d], [8 * d, 1]) and run.o_cols == 8 * d



def test_a_bound_gluon_launch_makes_no_o_descriptor_once_it_goes_raw(monkeypatch):
    """O is new each call: once the launch under a call's key goes raw, ``output_descriptor`` is
    asked under that same key and hands a per-call view (``raw_launch.TensorView``), no Gluon
    descriptor made (r56 on the H200: it asked under the key without the mark flag, and every
    prefill call built one)."""
    if not gluon_engine.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    from attnc.backends.triton import raw_launch
    b, s, d = 1, 200, 128
    q, k = (torch.randn(b, 2, s, d).to(torch.bfloat16) for _ in range(2))
    config, plan = _choose(monkeypatch, ("bhsd",) * 4)
    module = attnc.compile("attention g { mask = causal }").kernel(
        "triton", attnc.compile("attention g { mask = causal }").specialize(2, 2, d, d, "bf16")).module
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    run = launch.PrefillLaunch(module, config, plans.upload(plans.walk_arrays(plan), "cpu"), (b, s, s), "cpu")
    seen = []
    monkeypatch.setattr(launch, "_stream", lambda: 0)
    monkeypatch.setattr(launch, "_counter", lambda device, stream=None: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(run.launcher, "launch", lambda grid, args, key=None, stream=None: seen.append((key, args[3])))
    made = []
    monkeypatch.setattr(run, "_gluon_descriptor",
                        lambda t, rows, role, keep=True: made.append(role) or launch.PrefillLaunch._gluon_descriptor(
                            run, t, rows, role, keep))
    flag, lse, out = torch.zeros(1, dtype=torch.int32), torch.empty(b, 2, s), torch.empty_like(q)
    for _ in range(2):
        run(q, k, k, (), out, lse, key="call", flag=flag)
        run.launcher.raw[seen[-1][0]] = object()  # (as a first launch through the JIT leaves it: raw from now on)
    assert seen[0][0] == seen[1][0] == ("call", 1)
    assert made.count("o") == 1 and isinstance(seen[1][1], raw_launch.TensorView)

# ---------------------------------------------------------------- the public call on the CPU backends
@pytest.mark.parametrize("backend", ["triton", "numpy"])
def test_the_call_takes_views_and_returns_o_token_major(backend, monkeypatch):
    """Token-major q, k, v (GQA, B 2, S not a multiple of the tiles) through ``attnc.compile``: the
    same O and LSE as contiguous copies, O token-major (its transpose contiguous); on the Triton
    kernel the launch reads the views themselves (no copy: its q is the caller's)."""
    attn = attnc.compile("attention g { mask = causal & window(9) }")
    dev = triton_device() if backend == "triton" else "cpu"
    q, k, v = token_major(2, 4, 37, 16, torch.float32, device=dev), token_major(2, 2, 37, 16, torch.float32, device=dev), \
        token_major(2, 2, 37, 16, torch.float32, extra=16, device=dev)
    seen = []
    if backend == "triton":
        call = launch.PrefillLaunch.__call__

        def spy(self, q_, *args, **kwargs):
            seen.append(q_)
            return call(self, q_, *args, **kwargs)
        monkeypatch.setattr(launch.PrefillLaunch, "__call__", spy)
    o, lse = attn(q, k, v, backend=backend, return_lse=True)
    o_ref, lse_ref = attn(q.contiguous(), k.contiguous(), v.contiguous(), backend=backend, return_lse=True)
    assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous() and o_ref.is_contiguous()
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
    if backend == "triton":
        assert seen[0].data_ptr() == q.data_ptr() and seen[0].stride() == q.stride()


def test_the_custom_op_keeps_o_contiguous_as_its_fake():
    """Under torch.compile the op's layout is its fake's (contiguous): the op returns that even for
    a token-major q (inductor may hand the op other strides than the fake saw)."""
    attn = attnc.compile("attention g { mask = causal }")
    q = token_major(2, 4, 12, 16, torch.float32)
    o, _ = torch.ops.attnc.attention(attn.handle, q, q, q, [], "")
    assert o.is_contiguous()
    torch.testing.assert_close(o, attn(q, q, q), rtol=0, atol=0)
