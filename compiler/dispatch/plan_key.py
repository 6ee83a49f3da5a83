"""Plan keys (M4.5 §0x07F): the static projection of a dispatch key that a plan freezes, and
the dynamic fields a run may change only through ``Plan.update``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .coordinates import cache_layout_of
from .schema import sha256_of

PLAN_KEY_FIELDS = ("device", "workspace_device", "cache_layout", "page_size", "H_q", "H_kv", "d_qk", "d_v",
                   "q_dtype", "kv_dtype", "graph_mode")
# What a run may change without a new plan, and only through ``Plan.update``.
PLAN_DYNAMIC_FIELDS = ("batch", "s_q", "s_k", "tensors")


@dataclass(frozen=True)
class PlanKey:
    """The static projection P(D) a plan freezes (§0x07F).  ``device`` None: the plan holds host
    arrays only and a runtime binds device copies per device (the tile plan); a plan owning
    device state (workspace, captured pointers) names its device."""

    device: str | None
    workspace_device: str | None
    cache_layout: str
    page_size: int | None
    H_q: int
    H_kv: int
    d_qk: int
    d_v: int
    q_dtype: str
    kv_dtype: str
    graph_mode: bool

    @classmethod
    def of(cls, program, *, device: str | None = None, workspace_device: str | None = None,
           graph_mode: bool = False) -> "PlanKey":
        return cls(device=device, workspace_device=workspace_device or device,
                   cache_layout=cache_layout_of(program), page_size=program.cache.page_size,
                   H_q=program.heads_q, H_kv=program.heads_kv, d_qk=program.d_qk, d_v=program.d_v,
                   q_dtype=program.dtype, kv_dtype=program.dtype, graph_mode=bool(graph_mode))

    def to_json(self) -> dict:
        return {n: getattr(self, n) for n in PLAN_KEY_FIELDS}

    @property
    def digest(self) -> str:
        return sha256_of(self.to_json())

    def changed(self, other: "PlanKey") -> list[tuple[str, Any, Any]]:
        """(field, this plan's value, the run's value) for every static field that differs."""
        return [(n, getattr(self, n), getattr(other, n)) for n in PLAN_KEY_FIELDS
                if getattr(self, n) != getattr(other, n)]

    def replace(self, **changes) -> "PlanKey":
        return replace(self, **changes)

