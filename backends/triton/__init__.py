"""Triton backend: the spec's generated module (mask, score, constants) and the library kernels
(prefill, the Gluon engine, split-K/V + combine) launched by one launch layer over cached plans.

Importing this package imports neither torch nor triton (``attnc compile --backend triton``
needs neither): ``load`` and ``Kernel`` come from the runtime on first use."""
from .emit import emit  # noqa: F401

NAME = "triton"


def load(program):
    from .runtime import load as _load
    return _load(program)


def __getattr__(name):
    if name == "Kernel":
        from .runtime import Kernel
        return Kernel
    raise AttributeError(name)
