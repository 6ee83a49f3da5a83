"""Shared test fixtures.

Golden files are compared byte for byte; `pytest --update-golden` rewrites
them deliberately (never automatically) — review the diff and commit it with
the reason.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

# Triton kernels run on the CPU through Triton's interpreter unless a GPU run is asked for;
# the variable must be set before triton is imported.
if os.environ.get("ATTNC_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.attn"))
GOLDEN = ROOT / "tests" / "golden"
SHARED_CONTRACTS = ROOT.parent / "shared" / "fixtures" / "seed_contracts.json"
VENDORED_CONTRACTS = ROOT / "tests" / "fixtures" / "seed_contracts.json"


def seed_contracts() -> dict:
    """shared/fixtures/seed_contracts.json (the acceptance numbers of the seeds).

    Read from shared/ beside the checkout when it is there; a clone without it uses the
    vendored copy, which tests/unit/test_contracts_copy.py keeps identical."""
    import json
    path = SHARED_CONTRACTS if SHARED_CONTRACTS.exists() else VENDORED_CONTRACTS
    return json.loads(path.read_text())


def prefill_launches(monkeypatch) -> list:
    """The Triton backend's prefill launches (``launch.PrefillLaunch``) made from here on, in order
    (a call with options makes its own): the tests read the config and constexprs a call ran with.
    The process's plan cache is emptied first: a launch an earlier test left there for the same call
    would be reused, and none made here."""
    from attnc.backends.triton import launch, plans
    plans.PLANS.clear()
    made = []
    init = launch.PrefillLaunch.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(launch.PrefillLaunch, "__init__", spy)
    return made


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden files from the current output")


@pytest.fixture
def golden(request):
    """golden(relative_path, actual_text): compare with tests/golden/<relative_path>."""
    update = request.config.getoption("--update-golden")

    def compare(rel: str, actual: str) -> None:
        path = GOLDEN / rel
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(actual)
            return
        assert path.exists(), f"missing golden file {path}; run pytest --update-golden and review it"
        expected = path.read_text()
        assert actual == expected, f"{path} differs from the current output (pytest --update-golden rewrites it)"

    return compare


def triton_device() -> str:
    """The device the Triton backend's kernels run on in this test run: "cuda" in a GPU run
    (ATTNC_TEST_GPU=1 with a CUDA device), else "cpu" (Triton's interpreter takes CPU tensors).
    The Triton backend refuses torch tensors on any other device, so tests hand it theirs here."""
    if os.environ.get("ATTNC_TEST_GPU") == "1":
        import torch
        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def triton_setting() -> tuple:
    """(device, whether it is a GPU, torch dtype, spec dtype, call keywords) of a test of the Triton
    backend through torch calls: bf16 on the GPU; f16 in Triton's interpreter, where CPU tensors
    need ``backend="triton"`` (they route to the numpy backend by default)."""
    import torch
    dev = triton_device()
    gpu = dev == "cuda"
    return (dev, gpu, torch.bfloat16 if gpu else torch.float16, "bf16" if gpu else "f16",
            {} if gpu else {"backend": "triton"})


def bound_answers(monkeypatch, cls) -> list:
    """The calls a bound-call class (``cls``, e.g. ``bound.BoundPrefill``) answered: True per call
    of ``cls.__call__`` that took its call, False per one that declined (answered None).  On the CPU
    (Triton's interpreter; skipped without it) the calls are put on a GPU call's non-finite path
    (``runtime.marks_on_device``) and CPU tensors on the Triton backend."""
    from attnc.backends.triton import runtime
    if triton_device() != "cuda":
        if not runtime.interpreted():
            import pytest
            pytest.skip("CPU tensors through Triton's interpreter (TRITON_INTERPRET=1); the GPU run covers the rest")
        from attnc.compiler import dispatch
        monkeypatch.setattr(runtime, "marks_on_device", lambda t: True)
        monkeypatch.setattr(dispatch, "device_default", lambda device: "triton")  # (CPU calls: the numpy backend)
    seen = []
    original = cls.__call__

    def spy(self, *args):
        out = original(self, *args)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(cls, "__call__", spy)
    return seen


def to_triton(x):
    """``x`` (a torch tensor or array-like) as a torch tensor on ``triton_device()``; a tensor
    keeps its dtype, an array becomes the torch tensor ``torch.as_tensor`` makes of it."""
    import torch
    return torch.as_tensor(x).to(triton_device())


def shard_of(nodeid: str, count: int) -> int:
    """The shard (0 .. count - 1) a test belongs to under ATTNC_TEST_SHARD: by a stable hash of its
    node id, the same on every machine and run."""
    return zlib.crc32(nodeid.encode()) % count


def pytest_collection_modifyitems(config, items):
    """ATTNC_TEST_SHARD=i/n (1 <= i <= n) keeps the i-th of n disjoint shards of the collected tests
    (``.ci/gpu``: the GPU list in runs that fit a machine's per-command limit); the n shards together
    are the whole list."""
    spec = os.environ.get("ATTNC_TEST_SHARD")
    if not spec:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"ATTNC_TEST_SHARD={spec!r}: expected i/n, for example 1/2") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"ATTNC_TEST_SHARD={spec!r}: i must be between 1 and n")
    keep, drop = [], []
    for item in items:
        (keep if shard_of(item.nodeid, n) == i - 1 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep

