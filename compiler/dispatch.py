"""The backend registry: the only place the compiler reaches a backend (DESIGN §2).

Backends are imported lazily by name so that, e.g., `attnc check` never
imports numpy-heavy or GPU code.  (Dispatch keys, admission and selection
policies, DESIGN §6, build on this registry.)
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import AttncError

REGISTRY: dict[str, str] = {
    "numpy": "backends.numpy",
    "triton": "backends.triton",
}


def backend(name: str) -> ModuleType:
    """The backend package: `emit(program) -> Source`, `load(program) -> Kernel`."""
    if name not in REGISTRY:
        raise AttncError(f"unknown backend '{name}'; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])
