"""A stand-in for Triton's CUDA driver that names an sm_90 target, so that the JIT compiles Hopper
kernels on a machine without a GPU (warmup launches nothing).  The compile tests' subprocess
scripts import it (``from tests.sm90 import SM90``; the checkout root is on their PYTHONPATH) and
activate it with ``triton.runtime.driver.set_active(SM90())``."""
from triton.backends.compiler import GPUTarget


class SM90:
    """A driver that names an sm_90 target: enough for the JIT to compile (warmup launches nothing)."""
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)


# The head of a compile script: skip (a JSON line) where this Triton has no NVIDIA backend, else
# make the stand-in driver the active one.
PREAMBLE = r'''
import json, sys
from triton.runtime import driver
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)
from tests.sm90 import SM90
driver.set_active(SM90())
'''


def compile_script(script: str, *args: str, timeout: int = 600) -> dict:
    """Run a compile script in a subprocess without TRITON_INTERPRET (the tests' conftest sets it:
    the kernels are compiled, not interpreted), the checkout root on its PYTHONPATH; its last
    stdout line, JSON, is returned, or the test skipped where the script says so."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    root = str(Path(__file__).resolve().parent.parent)
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out
