"""What the AHBM backend admits (DESIGN §6, M4.5 §0x07B): its candidate domain and predicates."""
from __future__ import annotations

from attnc.compiler.dispatch.admission import (FORWARD_ONLY, STORAGE_DTYPES, BackendSpec, allowed, installed,
                                               requires, rule, shown)
from attnc.compiler.dispatch.keys import DispatchKey


def _contiguous(key: DispatchKey) -> str | None:
    return None if key.cache_layout.startswith("contiguous_") else f"cache_layout={key.cache_layout} unsupported"


def _uniform(key: DispatchKey) -> str | None:
    if key.uniform:
        return None
    return f"S_k={shown(key.S_k)} unsupported" if len(set(key.S_k)) > 1 else f"S_q={shown(key.S_q)} unsupported"


SPEC = BackendSpec(
    "ahbm", platforms=("ahbm",), phases=("prefill", "append", "decode"),
    description="greenlet tl programs on the AHBM mesh simulator (ADR-0060): decode with or without "
                "SP, prefill without SP or as a ring",
    admission=(
        installed("greenlet"),
        allowed("D", "q_dtype", STORAGE_DTYPES),
        rule("L", "contiguous K/V", _contiguous, detail="the mesh programs read contiguous K/V"),
        rule("L", "one S_q and S_k for the batch", _uniform, detail="one call shape per launch"),
        *FORWARD_ONLY,
        requires("C", "graph_mode", False, detail="a simulator has no CUDA graphs"),
    ))
