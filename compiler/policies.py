"""The policies a spec declares (``cache =``, ``split =``, ``state =``, ``masked_rows =``): one
table of their kinds, typed parameters and defaults.

``check`` reads it to validate a spec's policy statements; the IR keeps a policy's arguments in
this table's parameter order, and :func:`named` gives them back by name, so the analyses and
the backends read ``split.args`` by the names declared here (``analysis.splits.from_ir``) and a
parameter added here is one edit for every reader.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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


def named(field: str, kind, args) -> dict[str, object]:
    """A policy's arguments (the IR's tuple, in the table's order) by their declared names, with
    the defaults of those it leaves out."""
    kind = getattr(kind, "value", kind)
    params = POLICIES[field][kind]
    if len(args) > len(params):
        raise ValueError(f"{field} = {kind} takes {len(params)} arguments, got {len(args)}")
    values = dict(zip((p.name for p in params), args))
    return {p.name: values.get(p.name, p.default) for p in params}
