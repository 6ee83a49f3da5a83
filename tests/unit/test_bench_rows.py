"""GPU benchmark rows are evidence rows: the row builder the benchmarks use produces rows the
evidence validator accepts, and flags rows that skip a level (runs on the CPU with fake samples)."""
import pytest

from attnc.backends.triton.bench import evidence_row
from attnc.compiler import evidence, tune
from attnc.compiler.dispatch import Environment
from attnc.compiler.lower import compile_spec

PROGRAM = compile_spec("attention b { heads = 16 head_dim = 128 dtype = bf16 mask = causal }")
ENV = Environment(device_type="cpu")


def _row(samples, err=2e-3):
    key = tune.call_key(PROGRAM, 4, 8192, 8192, "triton", env=ENV)
    legacy = {"impl": "attnc", "config": {"BLOCK_M": 128, "BLOCK_N": 128}, "bench": "prefill",
              "reference": "float32 dense softmax on GPU", "tolerance_rel_l2": 1e-2, "rel_l2_error": err,
              "pass": err < 1e-2, "samples_ms": samples, "median_ms": 2.5}
    return evidence_row(legacy, key, evidence.environment_record(ENV), {"warmup_ms": 100, "rep_ms": 500})


def test_timed_row_with_a_passing_check_is_complete_evidence():
    row = _row([2.5 + i * 1e-3 for i in range(40)])
    assert row["validation"]["errors"] == [] and row["validation"]["level"] == evidence.validate_row(row).level
    assert len(row["dispatch"]["digest"]) == 64 and row["dispatch"]["key"]["tensors"]["S_q"]
    assert row["impl"] == row["dispatch"]["selected"] == "attnc"
    assert row["measurement"]["samples"][0] == 2.5


def test_rows_that_skip_a_level_are_flagged_not_passed():
    few = _row([140.0, 141.0, 142.0])  # e.g. a peer that fell back to eager: 3 samples
    assert few["validation"]["errors"]
    failed = _row([2.5] * 40, err=0.5)  # timing after a failing correctness check
    assert failed["validation"]["errors"]


def test_bench_config_strings():
    from attnc.backends.triton.bench import DEFAULT, parse_configs
    assert parse_configs("128x128x8x3t,64x64x4x3tm,128x64x8x3,64x64x4x3tbp,128x128x8x2i,128x128x8x3tss,"
                         "128x128x4x2G") == [
        (128, 128, 8, 3, True, False, None, None, 0, None, "triton"),
        (64, 64, 4, 3, True, False, "merged_blocks", None, 0, None, "triton"),
        (128, 64, 8, 3, False, False, None, None, 0, None, "triton"),
        (64, 64, 4, 3, True, False, "blocks", "predicate", 0, None, "triton"),
        (128, 128, 8, 2, False, False, None, "intervals", 0, None, "triton"),
        (128, 128, 8, 3, True, False, None, None, 2, None, "triton"),
        (128, 128, 4, 2, False, False, None, None, 0, None, "gluon")]
    assert parse_configs("default, 128x128x8x3to") == [DEFAULT, (128, 128, 8, 3, True, False, None, None, 0, 1,
                                                                 "triton")]
    for bad in ("128x128x8", "128x128x8x3z", "ax128x8x3", "defaults", "128x128x8x3tn"):
        with pytest.raises(ValueError, match="expected 'default' or BMxBNxWxS"):
            parse_configs(bad)
