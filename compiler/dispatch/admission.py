"""Admission (M4.5 §0x07B): the factors a backend may reject a call on, predicates over a
dispatch key that yield rejections, and ``BackendSpec``, a backend's whole declaration.

Every predicate reads only the frozen key (no backend is imported to decide admission), so
``attnc dispatch`` answers on any host.  Each backend declares its ``SPEC`` in
``backends/<name>/admission.py``; the registry reads them in priority order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .environment import distribution_version
from .keys import DispatchKey

FACTORS = {
    "I": "backend installed", "E": "enabled by policy", "P": "phase", "H": "hardware",
    "D": "query/output dtype", "K": "K/V dtype and cache", "Q": "lengths and head dims",
    "G": "head relationship", "L": "layout, strides, page size", "M": "mask semantics",
    "N": "numerics and determinism", "C": "graph capture and lifecycle",
}


@dataclass(frozen=True)
class Rejection:
    factor: str  # one of FACTORS
    reason: str  # "<field>=<value> unsupported": stable, greppable, what a fixture pins
    detail: str = ""  # what the backend supports instead

    def __str__(self) -> str:
        return f"{self.reason} ({self.detail})" if self.detail else self.reason

    def to_json(self) -> dict:
        return {"factor": self.factor, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class Predicate:
    """One admission factor A_{b,i}: ``test(key)`` yields the rejections (empty: admitted)."""

    factor: str
    describe: str
    test: Callable[[DispatchKey], Iterable[Rejection]]

    def __post_init__(self):
        if self.factor not in FACTORS:
            raise ValueError(f"unknown admission factor {self.factor!r}")

    def rejections(self, key: DispatchKey) -> list[Rejection]:
        return list(self.test(key))


def shown(v) -> str:
    """A key value as rejection reasons and ``attnc dispatch`` print it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return ",".join(str(x) for x in v) if len(set(v)) > 1 else str(v[0])
    return str(v)


def allowed(factor: str, name: str, values: Iterable, *, label: str | None = None) -> Predicate:
    """``name`` (every request's value, for per-request lengths) is one of ``values``."""
    values = tuple(values)

    def test(key):
        v = getattr(key, name)
        bad = [x for x in dict.fromkeys(v if isinstance(v, tuple) else (v,)) if x not in values]
        for x in bad:
            yield Rejection(factor, f"{label or name}={shown(x)} unsupported",
                            "supported: " + ", ".join(shown(s) for s in values))
    return Predicate(factor, f"{label or name} in {{{', '.join(shown(s) for s in values)}}}", test)


def bounded(factor: str, name: str, lo: int | None = None, hi: int | None = None, *,
            label: str | None = None) -> Predicate:
    """``lo <= name <= hi`` for every request (per-request lengths) or the one value."""
    def test(key):
        v = getattr(key, name)
        for x in dict.fromkeys(v if isinstance(v, tuple) else (v,)):
            if (lo is not None and x < lo) or (hi is not None and x > hi):
                yield Rejection(factor, f"{label or name}={x} unsupported", _range(label or name, lo, hi))
                return
    return Predicate(factor, _range(label or name, lo, hi), test)


def _range(name, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"needs {lo} <= {name} <= {hi}"
    return f"needs {name} >= {lo}" if lo is not None else f"needs {name} <= {hi}"


def requires(factor: str, name: str, value, *, label: str | None = None, detail: str = "") -> Predicate:
    def test(key):
        v = getattr(key, name)
        if v != value:
            yield Rejection(factor, f"{label or name}={shown(v)} unsupported", detail or f"needs {shown(value)}")
    return Predicate(factor, f"{label or name} == {shown(value)}", test)


def rule(factor: str, describe: str, check: Callable[[DispatchKey], str | None], detail: str = "") -> Predicate:
    """A predicate in plain code: ``check(key)`` returns the rejection reason or None."""
    def test(key):
        reason = check(key)
        if reason:
            yield Rejection(factor, reason, detail)
    return Predicate(factor, describe, test)


def when(describe: str, condition: Callable[[DispatchKey], bool], predicate: Predicate) -> Predicate:
    """``predicate`` applies only to keys where ``condition`` holds."""
    def test(key):
        if condition(key):
            yield from predicate.test(key)
    return Predicate(predicate.factor, f"{describe}: {predicate.describe}", test)


def installed(dist: str, field_name: str | None = None) -> Predicate:
    """I_b: the distribution is present: read from the key's environment field when it has one
    (so a key made elsewhere is judged by its own environment), else from this host."""
    def check(key):
        version = getattr(key, field_name) if field_name else distribution_version(dist)
        return None if version else f"{dist} not installed"
    return rule("I", f"{dist} installed", check)


@dataclass(frozen=True)
class BackendSpec:
    """A backend's admission declaration: candidate domain (platforms x phases) and predicates.

    ``platforms`` are device types; ``interpreter`` admits a CPU key whose environment runs
    Triton's interpreter."""

    name: str
    platforms: tuple[str, ...]
    phases: tuple[str, ...]
    admission: tuple[Predicate, ...]
    description: str = ""

    def in_domain(self, key: DispatchKey) -> list[str]:
        """Why the key is outside this backend's candidate domain (empty: inside)."""
        out = []
        platform_ok = key.device_type in self.platforms or (key.interpreter and "interpreter" in self.platforms)
        if not platform_ok:
            out.append(f"device_type={key.device_type}{' (interpreter)' if key.interpreter else ''} outside "
                       f"platforms {{{', '.join(self.platforms)}}}")
        if key.phase not in self.phases:
            out.append(f"phase={key.phase} outside {{{', '.join(self.phases)}}}")
        return out

    def admit(self, key: DispatchKey) -> list[Rejection]:
        """R_b(D): the complete rejection vector, never just the first reason (§0x07B)."""
        return [r for p in self.admission for r in p.rejections(key)]


# ---------------------------------------------------------------- shared by several backends
STORAGE_DTYPES = ("f16", "bf16", "f32")
FORWARD_ONLY = (requires("N", "training", False, detail="forward only"),
                requires("N", "dropout_p", 0.0, detail="no dropout"))
KV_IN_QUERY_DTYPE = rule("K", "K/V stored in the query dtype",
                         lambda k: None if k.kv_dtype == k.q_dtype else f"kv_dtype={k.kv_dtype} unsupported",
                         detail="K/V in the query dtype")
