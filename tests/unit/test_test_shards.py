"""ATTNC_TEST_SHARD=i/n (tests/conftest.py, ``.ci/gpu``): the n shards of a collection are disjoint
and together the whole of it, and a malformed value is a usage error (a failing exit), not a silent empty run."""
import os
import subprocess
import sys

from tests.conftest import ROOT

FILES = ["tests/unit/test_readme.py", "tests/unit/test_evidence.py"]


def _collected(shard=None):
    env = {n: v for n, v in os.environ.items() if n != "ATTNC_TEST_SHARD"}
    if shard is not None:
        env["ATTNC_TEST_SHARD"] = shard
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return run.returncode, {line for line in run.stdout.splitlines() if "::" in line}, run.stderr + run.stdout


def test_shards_partition_the_collection():
    code, whole, _ = _collected()
    assert code == 0 and len(whole) > 10
    parts = [_collected(f"{i}/3")[1] for i in (1, 2, 3)]
    assert all(parts)  # (each shard has tests: a stable hash spreads them)
    assert set().union(*parts) == whole
    assert sum(len(p) for p in parts) == len(whole)  # disjoint


def test_a_malformed_shard_is_a_usage_error():
    for bad in ("2", "0/2", "3/2", "a/b"):
        code, _, out = _collected(bad)
        assert code != 0 and "ATTNC_TEST_SHARD" in out, (bad, out[-300:])
