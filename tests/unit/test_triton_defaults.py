"""The Triton prefill kernel's untuned defaults (measured on the H200, bench/results/): the launch
config before planning, and the second look at the 128x128 plan's row lengths."""
import pytest

from backends.triton import runtime
from backends.triton.bench import PREFILL_MASKS, spec_text
from compiler import inputs
from compiler.lower import compile_spec
from compiler.plan import plan as make_plan


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
