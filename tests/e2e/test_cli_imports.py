"""Commands that compile, print or analyse a spec never import torch or triton (issue 16): each
runs in a fresh interpreter, which then reports what it imported."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CAUSAL = ROOT / "examples" / "causal.attn"
PAGED = ROOT / "examples" / "causal_document_gqa.attn"
CALL = {"B": 2, "S_q": 1, "S_k": [4096, 100], "device": "cuda", "compute_capability": 90, "graph_mode": False}

COMMANDS = {
    "check": ["check", CAUSAL, PAGED],
    "compile numpy": ["compile", PAGED, "--backend", "numpy"],
    "compile triton": ["compile", PAGED, "--backend", "triton"],
    "compile ahbm": ["compile", CAUSAL, "--backend", "ahbm"],
    "ir": ["ir", PAGED],
    "plan": ["plan", CAUSAL, "--kv-lens", "4096"],
    "plan paged": ["plan", PAGED, "--kv-lens", "4096,300", "--q-lens", "1,4", "--json"],
    "plan ranks": ["plan", CAUSAL, "--ranks", "4", "--kv-lens", "4096"],
    "explain": ["explain", PAGED, "--kv-len", "512", "--json"],
    "dispatch": ["dispatch", PAGED, "--call", "CALL_JSON"],  # the call names its device: nothing to detect
}

CHILD = """
import contextlib, io, json, sys
from attnc.compiler.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "triton": "triton" in sys.modules}))
"""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_imports_neither_torch_nor_triton(name, tmp_path):
    call = tmp_path / "call.json"
    call.write_text(json.dumps(CALL))
    args = [str(call) if a == "CALL_JSON" else str(a) for a in COMMANDS[name]]
    # as a user runs it: without the interpreter (under TRITON_INTERPRET=1 no device is probed); `plan`
    # then reports an assumed sm_90 device's launch and reads no tuning cache (`--device here` would,
    # and detecting the device imports torch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ATTNC_TUNE_CACHE"] = str(tmp_path / "no-tune-cache.json")
    r = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got == {"rc": 0, "torch": False, "triton": False}, (name, got, r.stderr)
