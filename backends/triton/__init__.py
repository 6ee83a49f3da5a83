"""Triton backend: generated prefill/append kernels over attnc's tile plan."""
from .emit import emit  # noqa: F401
from .runtime import Kernel, load  # noqa: F401

NAME = "triton"
