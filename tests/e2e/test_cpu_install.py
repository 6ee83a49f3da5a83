"""A CPU-only install (torch without triton, issue 35): the README's PyTorch example runs on the
numpy backend, and triton is imported only when the Triton backend is chosen."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("torch")

RUN_README = r"""
import re, sys
text = open("README.md").read()
block = re.search(r"## Use it from PyTorch\n\n.*?```python\n(.*?)```", text, re.S).group(1)
# the README's call at a CPU test's size (its shapes, 16x smaller sequences and heads 8x narrower)
block = block.replace("1024", "64").replace("div(256", "div(16").replace(", 128,", ", 16,")
scope = {}
exec(compile(block, "README.md", "exec"), scope)
assert scope["o"].shape == (2, 16, 64, 16) and scope["lse"].shape == (2, 16, 64), scope["o"].shape
assert "triton" not in sys.modules, "a CPU call imported triton"
print("README example ran on", scope["device"])
"""


def test_the_readme_example_runs_with_torch_alone():
    # a CPU-only machine, also on a GPU one: triton hidden (by name, by the fixture's sitecustomize,
    # first on the path; then this checkout, then the parent's path, where attnc's dependencies may
    # live) and no CUDA device visible to torch (the README's example would take it)
    path = [str(ROOT / "tests" / "fixtures" / "no_gpu_stack"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "ATTNC_TEST_HIDE": "triton", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    r = subprocess.run([sys.executable, "-c", RUN_README], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "README example ran on cpu" in r.stdout, r.stderr[-3000:]


def test_the_readme_names_the_extras_it_needs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from PyTorch"):text.index("```python")]
    assert "attnc[torch]" in section and "attnc[gpu]" in section
    extras = re.search(r"\[project.optional-dependencies\](.*?)\n\[", (ROOT / "pyproject.toml").read_text(), re.S)
    assert re.search(r'^torch = \["torch', extras.group(1), re.M) and re.search(r'^gpu = ', extras.group(1), re.M)
