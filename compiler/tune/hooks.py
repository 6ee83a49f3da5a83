"""Runtime hooks: what a launch asks the tuning cache.  :func:`tuned_config` (by key) and
:func:`tuned_tiles` (by program and call shape) give the tuned launch parameters or None (the
Triton split launch reads them in ``backends/triton/split_choice.py``), and
:func:`tuned_split_policy` turns ``split = auto`` into the tuned split count (``plan.plan_split``,
the numpy backend's split plan); on a miss the caller keeps its heuristic."""
from __future__ import annotations

import os

from .. import ir
from ..analysis import splits
from ..dispatch import DispatchKey, Environment
from ..errors import AttncError, TuneError
from .cache import TuneCache, load_cache


def tuned_key(key: DispatchKey, backend: str) -> DispatchKey:
    """The key a tuning entry is stored under: the call forced to ``backend``."""
    return key if key.backend_request == backend else key.with_(backend_request=backend)


def tuned_config(key: DispatchKey, backend: str | None = None,
                 cache: TuneCache | str | os.PathLike | None = None) -> dict | None:
    """The tuned launch parameters for ``key`` on ``backend`` (default: the key's forced
    backend), or None on a miss: then the caller keeps its heuristic."""
    backend = backend or key.backend_request
    if backend == "auto":
        raise TuneError("tuned_config needs a backend: the key's backend_request is auto")
    c = load_cache(cache)
    if c is None:
        return None
    entry = c.get(tuned_key(key, backend).digest)
    return dict(entry["config"]) if entry else None


def call_key(program: ir.Program, batch: int, s_q, s_k, backend: str, *, env: Environment | None = None,
             **controls) -> DispatchKey:
    """The dispatch key of a runtime call of ``program`` (uniform or per-request lengths)."""
    call = {"B": int(batch), "S_q": s_q if isinstance(s_q, int) else [int(x) for x in s_q],
            "S_k": s_k if isinstance(s_k, int) else [int(x) for x in s_k], "backend_request": backend, **controls}
    return DispatchKey.from_call(program, call, env or Environment.detect())


def tuned_tiles(program: ir.Program, batch: int, s_q, s_k, backend: str = "triton", *,
                cache: TuneCache | str | os.PathLike | None = None, env: Environment | None = None) -> dict | None:
    """:func:`tuned_config` for a runtime call given by its shape (the hook the Triton runtime
    calls before falling back to its default tiles); None on a miss or without a cache file."""
    c = load_cache(cache)
    if c is None or not c.entries:
        return None
    try:
        key = call_key(program, batch, s_q, s_k, backend, env=env)
    except AttncError:
        return None  # a malformed call is the runtime's to report, not the cache's
    return tuned_config(key, backend, c)


def tuned_split_policy(program: ir.Program, key: DispatchKey | None = None,
                       cache: TuneCache | str | os.PathLike | None = None):
    """The split policy to plan with: ``split = auto`` becomes ``balanced(S)`` with the tuned
    S when the cache has ``key``; any other policy, or a miss, is the spec's own (``auto``
    then takes ``analysis.splits.auto_splits``'s untuned count)."""
    policy = splits.from_ir(program.split)
    if isinstance(policy, splits.Auto) and key is not None:
        cfg = tuned_config(key, key.backend_request if key.backend_request != "auto" else "triton", cache)
        if cfg and cfg.get("splits"):
            return splits.balanced(int(cfg["splits"]))
    return policy

