"""The policies a spec declares (``cache =``, ``split =``, ``state =``, ``masked_rows =``): one
table of their kinds, typed parameters and defaults.

``check`` reads it to validate a spec's policy statements, and the IR keeps every argument by
the name declared here: ``ir.Split.params`` is an :class:`Args` (a frozen mapping in the table's
order, defaults filled in), ``ir.Cache`` and ``ir.SharedShift`` have a field per declared name.
The analyses and the backends read those names (``analysis.splits.from_ir`` builds a split
policy from ``params`` as keywords), so a parameter added here is one edit for every reader.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

MAX_SIZE = 2**31 - 1  # heads, head dims, axis sizes and policy arguments are i32
# ``state = shared_shift(phi, lower, upper)``'s window bound (``ir.SHIFT_WINDOW`` owns the reason)
SHIFT_WINDOW = 64.0


@dataclass(frozen=True)
class Param:
    name: str
    kind: type  # int, float or str
    choices: tuple[str, ...] = ()
    default: object = None
    required: bool = False
    check: Callable[[object], str | None] | None = None  # returns an error message


def _positive(v):
    if v > MAX_SIZE:
        return f"must be at most {MAX_SIZE}, got {v}"
    return None if v >= 1 else f"must be at least 1, got {v}"


def _within(v, bound):
    return None if math.isfinite(v) and -bound <= v <= bound else f"must be in [-{bound:g}, {bound:g}], got {v}"


def _fraction(v):
    return None if 0 < v <= 1 else f"must be in (0, 1], got {v}"


POLICIES: dict[str, dict[str, tuple[Param, ...]]] = {
    "cache": {
        "contiguous": (Param("layout", str, ("bhsd", "bshd"), "bhsd"),),
        "ragged": (),
        "paged": (Param("page_size", int, required=True, check=_positive),
                  Param("layout", str, ("nhd", "hnd"), "nhd"),
                  Param("table", str, ("dense", "csr"), "dense")),
    },
    "split": {
        "auto": (),
        "balanced": (Param("splits", int, required=True, check=_positive),),
        "chunk": (Param("size", int, required=True, check=_positive),),
        "capacity": (Param("splits", int, required=True, check=_positive),
                     Param("capacity", int, required=True, check=_positive)),
        "heuristic": (Param("fraction", float, required=True, check=_fraction),),
    },
    "state": {"lse_o": (), "mlu": (),
              "shared_shift": (Param("phi", float, required=True, check=lambda v: _within(v, 1e4)),
                               Param("lower", float, required=True, check=lambda v: _within(v, SHIFT_WINDOW)),
                               Param("upper", float, required=True, check=lambda v: _within(v, SHIFT_WINDOW)))},
    "masked_rows": {"zero": ()},
}
POSITIONAL_OK = {"split", "state"}  # cache arguments read better as keywords: page_size = 16


class Args(Mapping):
    """A policy's arguments by their declared names: an immutable, hashable mapping (the IR's
    nodes are frozen and hashed), printed as a dict.  Build it with :func:`args`."""

    __slots__ = ("_items",)

    def __init__(self, items=()):
        self._items = tuple(dict(items).items())

    def __getitem__(self, name: str):
        for n, v in self._items:
            if n == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return repr(dict(self._items))


def args(field: str, kind, given: Mapping[str, object] = Args()) -> Args:
    """``given`` (by name) as the :class:`Args` of ``field = kind``: in the table's order, with
    the defaults of the parameters it leaves out; a name the table does not declare, or a
    required one left out, is a ValueError (``check`` reports a spec's, located)."""
    kind = getattr(kind, "value", kind)
    params = POLICIES[field][kind]
    unknown = sorted(set(given) - {p.name for p in params})
    if unknown:
        raise ValueError(f"{field} = {kind} has no parameter '{unknown[0]}' (it takes "
                         f"{', '.join(p.name for p in params) or 'none'})")
    missing = [p.name for p in params if p.required and p.name not in given]
    if missing:
        raise ValueError(f"{field} = {kind} needs '{missing[0]}'")
    return Args((p.name, given.get(p.name, p.default)) for p in params)


def text(kind, given: Mapping[str, object]) -> str:
    """``kind(v0, v1, ...)`` in the table's order (``kind`` alone without arguments): how a
    policy is written positionally, as the dispatch key's ``split`` coordinate spells it."""
    kind = getattr(kind, "value", kind)
    return f"{kind}({', '.join(str(v) for v in given.values())})" if given else kind
