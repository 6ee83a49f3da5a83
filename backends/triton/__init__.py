"""Triton backend: the spec's generated module (mask, score, constants) and the library kernels
(prefill, the Gluon engine, split-K/V + combine) launched by one launch layer over cached plans."""
from .emit import emit  # noqa: F401
from .runtime import Kernel, load  # noqa: F401

NAME = "triton"
