"""The backend registry: the only place the compiler reaches a backend (DESIGN §2).

``REGISTRY`` names each backend's package, in priority order (``auto`` selection takes the
first eligible).  Backends are imported lazily, by module name: ``backend(name)`` for the
package (``emit``, ``load``), ``backend_module(name, part)`` for one declaration module of it
(``admission``: its ``SPEC``; ``tune``: its search spaces and tuning runner), so ``attnc check``
never imports numpy-heavy or GPU code and the compiler never imports a backend by name.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from types import ModuleType
from typing import Iterable, Iterator, Mapping

from ..errors import AttncError
from .admission import BackendSpec, Rejection
from .call import CallError
from .environment import Environment
from .keys import DispatchKey
from .protocol import Backend, BackendRefused, implements
from .selection import Candidate, Selection

REGISTRY: dict[str, str] = {
    "triton": "attnc.backends.triton",
    "numpy": "attnc.backends.numpy",
    "ahbm": "attnc.backends.ahbm",
}


def backend(name: str) -> ModuleType:
    """The backend package: `emit(program) -> Source`, `load(program) -> Kernel`."""
    if name not in REGISTRY:
        raise AttncError(f"unknown backend '{name}'; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])


@lru_cache(maxsize=None)
def backend_module(name: str, part: str) -> ModuleType | None:
    """``backends/<name>/<part>.py`` (e.g. ``admission``, ``tune``), or None when the backend
    declares no such module."""
    backend(name)  # an unknown name is reported as one
    module = f"{REGISTRY[name]}.{part}"
    return importlib.import_module(module) if importlib.util.find_spec(module) is not None else None


# The backend a call on a device's tensors runs when the caller names none and dispatch is not
# asked (split calls, appends, multi-rank blocks): the device's own backend.
DEVICE_DEFAULT: dict[str, str] = {"cuda": "triton", "cpu": "numpy"}


def torch_backend(name: str) -> Backend:
    """The backend's :class:`~.protocol.Backend` (``backends/<name>/torch_api.py: BACKEND``)."""
    module = backend_module(name, "torch_api")
    if module is None:
        raise BackendRefused(f"the {name} backend takes no torch tensors")
    obj = module.BACKEND
    problems = implements(obj)
    if problems:
        raise TypeError(f"backend {name} does not implement the backend protocol: {'; '.join(problems)}")
    return obj


def device_default(device_type: str) -> str:
    """The name of the backend that runs calls on ``device_type`` ("cuda", "cpu") by default."""
    return DEVICE_DEFAULT["cuda" if device_type == "cuda" else "cpu"]


def with_capability(capability: str) -> tuple[str, ...]:
    """The registered backends (priority order) whose protocol object has ``capability``."""
    return tuple(n for n in REGISTRY if backend_module(n, "torch_api") is not None
                 and capability in torch_backend(n).capabilities)


class _Admission(Mapping[str, BackendSpec]):
    """Backend name -> its admission declaration (``backends/<name>/admission.py: SPEC``), in
    :data:`REGISTRY` order; a backend's module is imported when its entry is first read."""

    def __getitem__(self, name: str) -> BackendSpec:
        module = backend_module(name, "admission") if name in REGISTRY else None
        if module is None:
            raise KeyError(name)
        return module.SPEC

    def __iter__(self) -> Iterator[str]:
        return (n for n in REGISTRY if backend_module(n, "admission") is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# The backends' declarations (DESIGN §6), in priority order: `auto` takes the first eligible.
ADMISSION: Mapping[str, BackendSpec] = _Admission()


class Registry:
    """Registered backends in priority order (first = preferred), the set `select` narrows by
    candidate domain, admission and policy (§0x07C).  ``disabled`` is the runtime policy's E_b."""

    def __init__(self, specs: Iterable[BackendSpec], disabled: Iterable[str] = ()):
        self.specs = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"backend registered twice: {names}")
        self.disabled = frozenset(disabled)

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.specs)

    def __getitem__(self, name: str) -> BackendSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def candidate(self, spec: BackendSpec, priority: int, key: DispatchKey) -> Candidate:
        outside = spec.in_domain(key)
        rejections = [] if outside else spec.admit(key)
        if spec.name in self.disabled and not outside:
            rejections.insert(0, Rejection("E", f"backend={spec.name} disabled", "runtime policy"))
        return Candidate(spec.name, priority, tuple(outside), tuple(rejections))

    def select(self, key: DispatchKey) -> Selection:
        request = key.backend_request
        if request != "auto":
            if request not in self:
                raise CallError(f"malformed call: backend_request = {request!r} is not a registered backend "
                                f"({', '.join(('auto',) + self.names)})")
            priority = self.names.index(request) + 1
            c = self.candidate(self[request], priority, key)
            reasons = list(c.outside) + [str(r) for r in c.rejections]
            error = None if c.eligible else f"forced backend {request} rejects the call: " + "; ".join(reasons)
            return Selection(key, "forced", request if c.eligible else None, (c,), error)
        cands = tuple(self.candidate(s, i + 1, key) for i, s in enumerate(self.specs))
        winner = next((c.name for c in cands if c.eligible), None)
        error = None
        if winner is None:
            in_domain = [c for c in cands if c.in_domain]
            if not in_domain:
                error = "no registered backend has this call in its candidate domain"
            else:
                error = "every candidate rejects the call: " + "; ".join(
                    f"{c.name}: {', '.join(str(r) for r in c.rejections)}" for c in in_domain)
        return Selection(key, "auto", winner, cands, error)


def default_registry() -> Registry:
    """attnc's own backends with admission declarations, in :data:`ADMISSION` order."""
    disabled = {n.strip() for n in os.environ.get("ATTNC_DISABLE_BACKENDS", "").split(",") if n.strip()}
    return Registry(ADMISSION.values(), disabled)


def select(key: DispatchKey, registry: Registry | None = None) -> Selection:
    return (registry or default_registry()).select(key)


def dispatch(program, call: Mapping, env: Environment | Mapping | None = None,
             registry: Registry | None = None) -> Selection:
    """Validate ``call`` against ``program``, freeze its key, select under its policy."""
    return select(DispatchKey.from_call(program, call, env), registry)
