"""Triton backend: generated prefill/append kernels over attnc's tile plan."""
from . import bench  # noqa: F401  (GPU benchmarks; imports torch only when run)
from .emit import emit  # noqa: F401
from .runtime import Kernel, load  # noqa: F401

NAME = "triton"
