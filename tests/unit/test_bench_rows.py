"""GPU benchmark rows are evidence rows: the row builder the benchmarks use produces rows the
evidence validator accepts, and flags rows that skip a level (runs on the CPU with fake samples)."""
import pytest

from attnc.bench.harness import evidence_row
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
