"""attnc: a compiler for attention mask programs.

``attnc.compile(spec)`` turns a ``.attn`` file (or its text) into a callable that takes torch
tensors; ``attnc.compiler`` holds the language, the IR and the analyses, ``attnc.backends`` the
numpy, Triton and AHBM backends.  Nothing here imports torch until a call needs it.
"""
from __future__ import annotations

import os as _os

from .version import __version__

# A source checkout keeps compiler/, backends/, bench/, grammar/, templates/ and examples/ beside this
# folder (an installed wheel puts them inside it): make them this package's subpackages.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "compiler")) and _os.path.isdir(_os.path.join(_root, "compiler")):
    __path__.append(_root)  # noqa: F821 - the package's own __path__

__all__ = ["compile", "Attention", "AttncError", "MicrobatchManifest", "__version__"]


def __getattr__(name: str):
    # lazily: `import attnc` stays cheap (no torch, no lark) until the API is used
    if name in ("compile", "Attention"):
        from .api import Attention, compile
        return {"compile": compile, "Attention": Attention}[name]
    if name == "MicrobatchManifest":
        from .compiler.analysis.microbatch import MicrobatchManifest
        return MicrobatchManifest
    if name in ("distributed", "fp8"):  # context parallelism, FP8 inputs (they import torch when used)
        import importlib
        return importlib.import_module(f".{name}", __name__)
    if name == "AttncError":
        from .compiler.errors import AttncError
        return AttncError
    raise AttributeError(f"module 'attnc' has no attribute {name!r}")
