"""The dispatch key (M4.5 §0x07A): one frozen record of a call, its canonical JSON and digest."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

from .call import CallError, key_fields
from .environment import Environment
from .plan_key import PlanKey
from .schema import KEY_GROUPS, KEY_VERSION, canonical_json


@dataclass(frozen=True)
class DispatchKey:
    """One immutable dispatch key D = (E, O, T, S, R) (M4.5 §0x07A): readable fields, one
    canonical JSON form and its sha256.  Build it with :meth:`from_call`, which validates the
    call's semantics first (a malformed call raises :class:`CallError`)."""

    # environment
    device_type: str
    compute_capability: int | None
    device_name: str | None
    interpreter: bool
    torch: str | None
    triton: str | None
    cuda_runtime: str | None
    # operation
    phase: str
    training: bool
    # tensors
    B: int
    S_q: tuple[int, ...]  # per request
    S_k: tuple[int, ...]  # per request
    H_q: int
    H_kv: int
    d_qk: int
    d_v: int
    q_dtype: str
    kv_dtype: str
    contiguous: bool
    last_dim_contiguous: bool
    # semantics
    mask_kind: str
    mask_representable: bool | None
    mask_digest: str | None
    score_digest: str | None
    dropout_p: float
    positions: str
    # runtime controls
    cache_layout: str
    page_size: int | None
    split: str
    state: str
    graph_mode: bool
    deterministic: bool
    backend_request: str

    # -- identity
    def to_json(self) -> dict:
        out: dict[str, Any] = {"version": KEY_VERSION}
        for group, names in KEY_GROUPS.items():
            out[group] = {n: (list(v) if isinstance(v := getattr(self, n), tuple) else v) for n in names}
        return out

    def canonical(self) -> str:
        return canonical_json(self.to_json())

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def flat(self) -> dict:
        return {n: v for group in self.to_json().values() if isinstance(group, dict) for n, v in group.items()}

    def with_(self, **changes) -> "DispatchKey":
        """A copy with some coordinates changed, validated again (a key is never malformed)."""
        return DispatchKey.from_call(None, {**self.flat(), **changes}, None)

    @classmethod
    def from_json(cls, obj: Mapping) -> "DispatchKey":
        if obj.get("version") != KEY_VERSION:
            raise CallError(f"dispatch key version {obj.get('version')!r}; this attnc reads {KEY_VERSION}")
        flat = {n: v for g in KEY_GROUPS for n, v in obj.get(g, {}).items()}
        return cls.from_call(None, flat, None)

    def plan_key(self, device: str | None = None, workspace_device: str | None = None) -> "PlanKey":
        return PlanKey(device=device, workspace_device=workspace_device or device,
                       cache_layout=self.cache_layout, page_size=self.page_size, H_q=self.H_q, H_kv=self.H_kv,
                       d_qk=self.d_qk, d_v=self.d_v, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                       graph_mode=self.graph_mode)

    # -- derived views the predicates read
    @property
    def max_s_q(self) -> int:
        return max(self.S_q)

    @property
    def uniform(self) -> bool:
        return len(set(self.S_q)) == 1 and len(set(self.S_k)) == 1

    @property
    def paged(self) -> bool:
        return self.cache_layout.startswith("paged_")

    # -- construction
    @classmethod
    def from_call(cls, program, call: Mapping, env: Environment | Mapping | None = None) -> "DispatchKey":
        """The key of ``call`` (a JSON-like mapping; see ``CALL_ALIASES`` for the accepted
        spellings) against ``program`` (an ``ir.Program``, or None for a spec-less key whose
        call names every coordinate).  ``env`` gives the environment defaults (None: detect
        unless the call names the device); fields the call names win.  A malformed call
        raises :class:`CallError` with every problem."""
        return cls(**key_fields(program, call, env))
