"""Call shapes to tune (``attnc tune --shapes B:S_q:S_k,...``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Shape:
    batch: int
    s_q: int
    s_k: int

    def __str__(self) -> str:
        return f"{self.batch}:{self.s_q}:{self.s_k}"


def parse_shapes(text: str) -> list[Shape]:
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            b, q, k = (int(x) for x in parts)
        except ValueError:
            raise InputError(f"--shapes: '{item}' is not B:S_q:S_k (three integers)") from None
        if min(b, q, k) < 1 or q > k:
            raise InputError(f"--shapes: '{item}' needs B, S_q, S_k >= 1 and S_q <= S_k")
        out.append(Shape(b, q, k))
    if not out:
        raise InputError("--shapes: no shape given")
    return out
