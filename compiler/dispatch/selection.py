"""The outcome of selection (M4.5 §0x07C): each candidate with its complete rejection vector,
the winner, the fallbacks, and how ``attnc dispatch`` prints them."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import AttncError
from .admission import Rejection, shown
from .keys import DispatchKey
from .schema import KEY_GROUPS


class DispatchError(AttncError):
    """No backend may run the call under the policy; carries the selection with every reason."""

    def __init__(self, message: str, selection: "Selection"):
        self.selection = selection
        super().__init__(message)


@dataclass(frozen=True)
class Candidate:
    name: str
    priority: int
    outside: tuple[str, ...]  # why it left the candidate domain (empty: in the domain)
    rejections: tuple[Rejection, ...]

    @property
    def in_domain(self) -> bool:
        return not self.outside

    @property
    def eligible(self) -> bool:
        return self.in_domain and not self.rejections

    def to_json(self) -> dict:
        return {"backend": self.name, "priority": self.priority, "in_domain": self.in_domain,
                "outside": list(self.outside), "eligible": self.eligible,
                "rejections": [r.to_json() for r in self.rejections]}


@dataclass(frozen=True)
class Selection:
    """The outcome of a policy over one key: the winner (or None), the candidates with their
    complete rejection vectors, and the fallback event (§0x07C)."""

    key: DispatchKey
    policy: str  # "auto" (ordered first eligible) | "forced" (fail closed)
    selected: str | None
    candidates: tuple[Candidate, ...]
    error: str | None

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """In-domain backends of higher priority than the winner that were rejected."""
        if self.selected is None:
            return ()
        out = []
        for c in self.candidates:
            if c.name == self.selected:
                break
            if c.in_domain and c.rejections:
                out.append(c.name)
        return tuple(out)

    @property
    def fallback(self) -> bool:
        return bool(self.fallbacks)

    def rejections(self, name: str) -> tuple[Rejection, ...]:
        return next(c.rejections for c in self.candidates if c.name == name)

    def require(self) -> str:
        """The selected backend; raises :class:`DispatchError` with every reason otherwise."""
        if self.selected is None:
            raise DispatchError(self.error or "no backend selected", self)
        return self.selected

    def to_json(self) -> dict:
        return {"digest": self.key.digest, "key": self.key.to_json(), "policy": self.policy,
                "selected": self.selected, "fallback": self.fallback, "fallbacks": list(self.fallbacks),
                "candidates": [c.to_json() for c in self.candidates], "error": self.error}

    def text(self) -> str:
        k = self.key
        lines = [f"dispatch key {k.digest}"]
        for group, names in KEY_GROUPS.items():
            values = " ".join(f"{n}={_brief(n, getattr(k, n))}" for n in names
                              if not (n.endswith("_digest") and getattr(k, n) is None))
            lines.append(f"  {group:12} {values}")
        policy = {"auto": "auto (ordered first eligible)", "forced": f"forced {k.backend_request} (fail closed)"}
        lines.append(f"policy: {policy[self.policy]}")
        for c in self.candidates:
            if not c.in_domain:
                lines.append(f"  {c.priority}. {c.name:14} outside the candidate domain: {'; '.join(c.outside)}")
            elif c.eligible:
                mark = "  <- selected" if c.name == self.selected else ""
                lines.append(f"  {c.priority}. {c.name:14} eligible{mark}")
            else:
                lines.append(f"  {c.priority}. {c.name:14} rejected:")
                lines += [f"       [{r.factor}] {r}" for r in c.rejections]
        if self.selected:
            fb = f" (backend fallback from {', '.join(self.fallbacks)})" if self.fallback else ""
            lines.append(f"selected: {self.selected}{fb}")
        else:
            lines.append(f"error: {self.error}")
        return "\n".join(lines) + "\n"


def _brief(name: str, v) -> str:
    if v is None:
        return "-"
    return f"{v[:12]}..." if name.endswith("_digest") else shown(v)
