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
