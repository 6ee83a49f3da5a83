"""The Triton prefill kernel's untuned defaults (measured on the H200, bench/results/): the launch
config before planning, and the second look at the 128x128 plan's row lengths."""
import pytest

from attnc.backends.triton import runtime
from attnc.backends.triton.bench import PREFILL_MASKS, spec_text
from attnc.compiler import inputs
from attnc.compiler.lower import compile_spec
from attnc.compiler.plan import plan as make_plan


def test_default_launch_config():
    cfg = runtime.default_prefill_config
    assert cfg(128, 128, False, 90) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
                                         "use_tma": True}
    assert cfg(128, 128, False, 80)["use_tma"] is False  # TMA is Hopper's
    assert cfg(96, 96, False, 90)["use_tma"] is False  # padded head dims take pointer loads
    assert cfg(128, 128, False, 90, reads_tensors=True)["BLOCK_M"] == 64
    assert cfg(256, 256, False, 90) == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                         "use_tma": False}
    assert cfg(128, 128, True)["BLOCK_M"] == 16  # the interpreter's tiny tiles


@pytest.mark.parametrize("mask,short", [("causal", False), ("prefix_lm_2048", False), ("full", False),
                                        ("sliding_window_1024", True), ("chunked_causal_1024", True),
                                        ("causal_document", True)])
def test_short_rows_take_64_tiles(mask, short):
    src, decls = PREFILL_MASKS[mask]
    program = compile_spec(spec_text(mask, 1, 16, src, decls))  # the plan reads the mask only
    tensors = {n: a for n, a in inputs.sample(program, 4, 8192, 8192, 0).items() if n not in ("q", "k", "v")} \
        if program.tensors else {}
    plan = make_plan(program, 4, 8192, 8192, tensors, 128, 128)
    assert (runtime.mean_row_blocks(plan) < runtime.SHORT_ROW_BLOCKS) == short
    assert runtime.short_row_config(plan) == (runtime.SHORT_ROW_CONFIG if short else None)
    assert runtime.short_row_config(make_plan(program, 4, 8192, 8192, tensors, 64, 64)) is None


# ---- the Gluon engine's share of the untuned default, on a pretend sm_90 (the policy is host code)
@pytest.fixture
def pretend_hopper(monkeypatch):
    """Plan and launch choices as runtime.Kernel makes them on an H200 (no launch happens): the
    kernel loads (under the interpreter, or on the GPU with ATTNC_TEST_GPU=1), then the runtime
    is told it is on sm_90."""
    def launch(mask, dtype="bf16", engine=None):
        src, decls = PREFILL_MASKS[mask]
        program = compile_spec(spec_text(mask, 2, 128, src, decls).replace("dtype = bf16", f"dtype = {dtype}"))
        kernel = runtime.load(program)
        tensors = {n: a for n, a in inputs.sample(program, 2, 8192, 8192, 0).items() if n not in ("q", "k", "v")} \
            if program.tensors else {}
        with monkeypatch.context() as m:
            m.setattr(runtime, "interpreted", lambda: False)
            m.setattr(runtime, "_capability", lambda: 90)
            plan, config, _ = kernel.prefill_launch(2, 8192, 8192, tensors, engine=engine)
            return kernel, kernel.gluon_engine(), plan, config
    return launch


@pytest.mark.parametrize("mask", ["causal", "full", "prefix_lm_2048", "sliding_window_1024", "causal_document",
                                  "chunked_causal_1024"])
def test_untuned_calls_on_hopper_take_the_gluon_engine(pretend_hopper, mask):
    """Every bench mask, short rows (documents, chunks) included: 128 x 128 tiles, 2 stages, the
    programs drawing their tiles from a counter."""
    kernel, gluon, plan, launch = pretend_hopper(mask)
    assert gluon
    assert ((plan.block_m, plan.block_n), launch["engine"]) == ((128, 128), None)
    assert launch["num_stages"] == runtime.GLUON_STAGES
    module = kernel.module
    assert module.SCHEDULE_NAMES[module.gluon_schedule(plan.kernel_args())] == "counter"
    # documents: PARTIAL blocks test each row's run of keys, the closed forms their predicate
    assert plan.kernel_args()["mask_from_rows"] is (mask == "causal_document")


def test_engine_choice_by_hand_and_by_spec_on_hopper(pretend_hopper):
    kernel, _, plan, launch = pretend_hopper("causal_document", engine="gluon")  # asked for
    assert ((plan.block_m, plan.block_n), launch["engine"]) == ((128, 128), "gluon")
    kernel, _, plan, launch = pretend_hopper("causal", engine="triton")  # the Triton kernel's default
    assert ((plan.block_m, plan.block_n), launch["num_stages"], launch["engine"]) == ((128, 128), 3, "triton")
    kernel, gluon, plan, launch = pretend_hopper("causal", dtype="f32")  # a spec the engine does not take
    assert not gluon and launch["engine"] == "triton"


def test_a_tuned_winner_keeps_the_triton_kernel(pretend_hopper, monkeypatch):
    from attnc.compiler import tune
    monkeypatch.setattr(tune, "tuned_tiles", lambda *a, **k: {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
                                                              "num_stages": 3, "use_tma": True})
    kernel, _, plan, launch = pretend_hopper("causal")
    assert launch["engine"] == "triton" and launch["num_stages"] == 3
