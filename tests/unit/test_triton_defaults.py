"""The launch layer's untuned choices (``backends/triton/launch.py``), as host logic: no kernel is
loaded or launched.  The choices themselves were measured on the H200 (bench/results/)."""
import numpy as np
import pytest

from attnc.backends.triton import choice
from attnc.compiler import inputs
from attnc.compiler.lower import compile_spec
from attnc.compiler.plan import plan as make_plan

MASKS = {
    "causal": ("causal", ""),
    "sliding_window_1024": ("causal & window(1024)", ""),
    "causal_document": ("causal & doc[b, q] == doc[b, k]", "tensor doc: i32[b, s] ~ segments(256, 2048)"),
    "prefix_lm_2048": ("causal | k < 2048", ""),
    "full": ("true", ""),
    "chunked_causal_1024": ("causal & q // 1024 == k // 1024", ""),
}


def _spec(mask, head_dim=128, dtype="bf16"):
    src, decls = MASKS[mask]
    return compile_spec(f"attention m {{ heads = 2 head_dim = {head_dim} dtype = {dtype} {decls} mask = {src} }}")


def _choose(program, s=8192, capability=90, asked=None, tuned=None, contiguous=True, monkeypatch=None):
    tensors = {n: a for n, a in inputs.sample(program, 2, s, s, 0).items() if n not in ("q", "k", "v")} \
        if program.tensors else {}
    tensors = {n: a.astype(np.int64) for n, a in tensors.items()}
    with monkeypatch.context() as m:
        m.setattr(choice, "interpreted", lambda: False)
        return choice.choose_prefill(program, s, s, lambda bm, bn: make_plan(program, 2, s, s, tensors, bm, bn),
                                     asked=asked or {}, tuned=tuned, contiguous=contiguous,
                                     device_capability=capability)


def test_default_launch_config():
    cfg = choice.default_prefill_config
    assert cfg(128, 128, False, 90) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
                                         "use_tma": True}
    assert cfg(128, 128, False, 80)["use_tma"] is False  # TMA is Hopper's
    assert cfg(96, 96, False, 90)["use_tma"] is False  # padded head dims take pointer loads
    assert cfg(8, 8, False, 90)["use_tma"] is False and cfg(4, 16, False, 90)["use_tma"] is False  # (D_PAD = 16)
    assert cfg(16, 16, False, 90)["use_tma"] is True
    assert cfg(128, 128, False, 90, reads_tensors=True)["BLOCK_M"] == 64
    assert cfg(256, 256, False, 90) == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                         "use_tma": False}
    assert cfg(128, 128, True)["BLOCK_M"] == 16  # the interpreter's tiny tiles


@pytest.mark.parametrize("mask,short", [("causal", False), ("prefix_lm_2048", False), ("full", False),
                                        ("sliding_window_1024", True), ("chunked_causal_1024", True),
                                        ("causal_document", True)])
def test_short_rows_take_64_tiles_on_the_triton_kernel(mask, short, monkeypatch):
    """Off Hopper (sm_80 here), the 128 x 128 plan's rows decide: short rows re-tile to 64 x 64."""
    program = _spec(mask)
    config, plan = _choose(program, capability=80, monkeypatch=monkeypatch)
    assert config.engine == "triton"
    if program.tensors:  # masks that read tensors start at 64 x 64
        assert (config.block_m, config.num_warps) == (64, 4)
        return
    assert (config.block_m, config.block_n) == ((64, 64) if short else (128, 128))
    assert config.num_warps == (4 if short else 8)
    assert config.walk is None  # the plan decides it at bind time (choice.default_walk)


@pytest.mark.parametrize("mask", list(MASKS))
def test_untuned_calls_on_hopper_take_the_gluon_engine(mask, monkeypatch):
    """Every bench mask, short rows included: 128 x 128 tiles, 2 stages, jobs from a counter;
    documents' PARTIAL blocks test each row's run of keys, the closed forms their predicate."""
    config, plan = _choose(_spec(mask), monkeypatch=monkeypatch)
    assert (config.engine, config.block_m, config.block_n, config.num_stages) == ("gluon", 128, 128,
                                                                                  choice.GLUON_STAGES)
    assert config.schedule == "counter"
    assert config.mask_source == ("rows" if mask == "causal_document" else "predicate")


@pytest.mark.parametrize("mask, sink, engine", [
    ("causal & window(128)", True, "triton"), ("causal & window(128)", False, "triton"),
    ("causal & window(512)", True, "gluon"), ("causal", True, "gluon"), ("true", False, "gluon")])
def test_narrow_windows_at_d64_leave_the_192_row_tiles(mask, sink, engine, monkeypatch):
    """gpt-oss's sliding layer (window 128, d 64): about 3.5 computed blocks per 192-row Gluon tile
    (``choice.GLUON_SHORT_ROW_BLOCKS``) run on the Triton kernel's short-row tiles; wider windows and
    causal keep the Gluon engine's 192 x 128 tiles; asking for the engine or tiles keeps them."""
    decls = "tensor sinks: f32[h] ~ uniform(-1, 1) " if sink else ""
    program = compile_spec(f"attention w {{ heads = 8 / 2 head_dim = 64 dtype = bf16 {decls}mask = {mask}"
                           f"{' sink = sinks[h]' if sink else ''} }}")
    config, plan = _choose(program, monkeypatch=monkeypatch)
    assert config.engine == engine, (mask, choice.mean_row_blocks(plan))
    assert (config.block_m, config.block_n) == ((64, 64) if engine == "triton" else (192, 128))
    assert config.origin == "default"
    if engine == "triton":
        for asked in ({"engine": "gluon"}, {"block_m": 192, "block_n": 128}):
            assert _choose(program, asked=asked, monkeypatch=monkeypatch)[0].engine == "gluon"
        assert _choose(program, s=500, monkeypatch=monkeypatch)[0].engine == "gluon"  # a short call keeps it


def test_engine_choice_by_hand_by_spec_and_by_shape(monkeypatch):
    config, _ = _choose(_spec("causal_document"), asked={"engine": "gluon"}, monkeypatch=monkeypatch)
    assert (config.engine, config.origin) == ("gluon", "default")
    config, plan = _choose(_spec("causal"), asked={"engine": "triton"}, monkeypatch=monkeypatch)
    assert (config.engine, config.block_m, config.num_stages) == ("triton", 128, 3)
    assert _choose(_spec("causal", dtype="f32"), monkeypatch=monkeypatch)[0].engine == "triton"  # spec
    assert _choose(_spec("causal", head_dim=96), monkeypatch=monkeypatch)[0].engine == "triton"
    assert _choose(_spec("causal"), s=8000, monkeypatch=monkeypatch)[0].engine == "gluon"  # tails are masked
    assert _choose(_spec("causal"), contiguous=False, monkeypatch=monkeypatch)[0].engine == "triton"
    with pytest.raises(ValueError, match="engine='gluon': the Gluon engine needs an sm_90 GPU"):
        _choose(_spec("causal"), capability=80, asked={"engine": "gluon"}, monkeypatch=monkeypatch)
    # an option only the Triton kernel has takes the Triton kernel's defaults
    assert _choose(_spec("causal"), asked={"walk": "blocks"}, monkeypatch=monkeypatch)[0].engine == "triton"


def test_a_tuned_winner_keeps_the_triton_kernel(monkeypatch):
    tuned = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4, "use_tma": True}
    config, plan = _choose(_spec("causal"), tuned=tuned, monkeypatch=monkeypatch)
    assert (config.engine, config.block_n, config.num_stages, config.origin) == ("triton", 64, 4, "tuned")


@pytest.mark.parametrize("bad, match", [({"engine": "cuda"}, "engine must be"), ({"walk": "zigzag"}, "walk must be"),
                                        ({"head_group": 0}, "head_group = 0"), ({"schedule": "ring"}, "schedule must"),
                                        ({"mask_source": "rows", "engine": "triton"}, "option of the Gluon engine")])
def test_unknown_options_are_refused_before_planning(bad, match):
    with pytest.raises(ValueError, match=match):
        choice.check_options(bad)
