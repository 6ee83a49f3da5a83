"""Triton backend: the spec's generated module (mask, score, constants) and the library kernels
(prefill, the Gluon engine, split-K/V + combine) launched by one launch layer over cached plans.

Importing this package imports neither torch nor triton (``attnc compile --backend triton``
needs neither): ``load`` and ``Kernel`` come from the runtime on first use."""
from .emit import emit  # noqa: F401

NAME = "triton"


GPU_STACK = ("torch", "triton")


def _unavailable(e: ModuleNotFoundError):
    """A missing torch or triton as the one clear BackendUnavailable (anything else re-raised)."""
    from attnc.compiler.errors import BackendUnavailable
    if (e.name or "").split(".")[0] not in GPU_STACK:
        raise e
    return BackendUnavailable(f"the triton backend needs torch and triton, and '{e.name}' cannot be imported "
                              "here; install them with pip install 'attnc[gpu]', or use --backend numpy")


def load(program):
    try:
        from .runtime import load as _load
        return _load(program)
    except ModuleNotFoundError as e:
        raise _unavailable(e) from None


def __getattr__(name):
    if name == "Kernel":
        try:
            from .runtime import Kernel
        except ModuleNotFoundError as e:
            raise _unavailable(e) from None
        return Kernel
    raise AttributeError(name)
