"""Search spaces (M4.5 §0x0BG): a backend family's axes, constraints and untuned default, and
where each backend declares its own (``backends/<name>/tune.py``, found through the registry)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterator, Mapping

from ..dispatch import REGISTRY, DispatchKey, backend_module
from ..errors import TuneError


@dataclass(frozen=True)
class Space:
    """One backend family's search space: named axes (the product is the candidate set),
    constraints that drop configs with a reason, and the untuned heuristic config, which
    is always candidate 0 so every result is compared with what a miss would run."""

    axes: Mapping[str, tuple]
    heuristic: Callable[[DispatchKey], dict]
    constraints: tuple[Callable[[dict, DispatchKey], str | None], ...] = ()

    def candidates(self, key: DispatchKey) -> list[dict]:
        base = self.heuristic(key)
        out = [base]
        names = list(self.axes)
        for values in itertools.product(*(self.axes[n] for n in names)):
            cfg = dict(zip(names, values))
            if cfg != base and not any(c(cfg, key) for c in self.constraints):
                out.append(cfg)
        return out

    def excluded(self, key: DispatchKey) -> list[tuple[dict, str]]:
        names = list(self.axes)
        out = []
        for values in itertools.product(*(self.axes[n] for n in names)):
            cfg = dict(zip(names, values))
            why = next((w for c in self.constraints if (w := c(cfg, key))), None)
            if why:
                out.append((cfg, why))
        return out



def pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tile_fits_rows(cfg, key):
    if "BLOCK_M" in cfg and cfg["BLOCK_M"] > max(16, pow2_at_least(key.max_s_q)):
        return f"BLOCK_M={cfg['BLOCK_M']} exceeds S_q={key.max_s_q}"
    return None


def tile_fits_keys(cfg, key):
    if "BLOCK_N" in cfg and cfg["BLOCK_N"] > max(16, pow2_at_least(max(key.S_k))):
        return f"BLOCK_N={cfg['BLOCK_N']} exceeds S_k={max(key.S_k)}"
    return None


# ---------------------------------------------------------------- each backend's declaration
def declaration(backend: str) -> ModuleType | None:
    """``backends/<backend>/tune.py``: ``SPACES`` (family -> Space), ``family_of(key)`` and
    ``RUNNER`` (the tuning runner class); None when the backend declares no tuning."""
    return backend_module(backend, "tune")


def _declared() -> list[str]:
    return [n for n in REGISTRY if declaration(n) is not None]


class _PerBackend(Mapping[str, object]):
    """Backend name -> one attribute of its tuning declaration (read through the registry)."""

    def __init__(self, attribute: str):
        self.attribute = attribute

    def __getitem__(self, backend: str):
        decl = declaration(backend) if backend in REGISTRY else None
        if decl is None:
            raise KeyError(backend)
        return getattr(decl, self.attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(_declared())

    def __len__(self) -> int:
        return len(_declared())


# backend -> family -> Space.  Family: "prefill" (prefill and append share a kernel) or
# "decode", as the backend's ``family_of`` names it.
SPACES: Mapping[str, Mapping[str, Space]] = _PerBackend("SPACES")
# backend -> its tuning runner class (see ``runner.Runner``)
RUNNERS: Mapping[str, type] = _PerBackend("RUNNER")


def family_of(backend: str, key: DispatchKey) -> str:
    decl = declaration(backend) if backend in REGISTRY else None
    return decl.family_of(key) if decl is not None else "prefill"


def space_for(backend: str, key: DispatchKey) -> Space:
    if backend not in SPACES:
        raise TuneError(f"no search space is declared for backend '{backend}' "
                        f"(declared: {', '.join(sorted(SPACES))})")
    return SPACES[backend][family_of(backend, key)]
