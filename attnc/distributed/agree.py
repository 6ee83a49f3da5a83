"""Ranks agree on a call before any K/V message (issue 35).

Every collective call of ``attnc.distributed`` (a plan, a multi-rank attention) first runs
:func:`agree`: one small ``all_gather_object`` of the call's signature (shapes, dtypes, keywords,
the plan's and the backend's identity) and of the rank's own verdict (ok, or the error its local
checks raised).  It is the first message of the call on every rank, so it cannot block:

- a rank that refused its call locally (a wrong shape or dtype, an unknown keyword, another
  length) makes every rank raise the same located error, naming that rank, within one round
  trip, instead of leaving its peers blocked in a K/V message until the process group's timeout;
- ranks whose calls are each valid but differ (another plan, backend, dtype, ``gather``) are
  refused before any K/V message, instead of posting messages of different sizes (which gloo
  aborts the process on) or different collectives (which hang).

``plan.gather`` agrees the same way; a call with ``gather=True`` agrees again after its rows
and the backward before its reversed messages (``verb``: a rank whose blocks failed).

The refusal is raised on every rank as the refusing rank's error class (InputError, PlanError,
BackendRefused; another exception becomes a PlanError), chained to the local error where there
is one.  Without an initialized process group (one rank) the local error is raised as it is.
"""
from __future__ import annotations

import torch.distributed as dist

from ..api import BackendRefused
from ..compiler.errors import AttncError, InputError, PlanError

_ERRORS = {cls.__name__: cls for cls in (InputError, PlanError, BackendRefused)}


def _text(error: BaseException) -> str:
    if isinstance(error, AttncError):
        return "; ".join(d.message for d in error.diagnostics)
    return f"{type(error).__name__}: {error}"


def agree(group, ranks: int, what: str, signature: dict, error: BaseException | None, *,
          verb: str = "refused its call") -> None:
    """Every rank of ``group`` calls this once, before the call's first other message, with its
    call's ``signature`` (a dict of picklable values that every rank's valid call shares) and its
    local ``error`` (or None).  Returns only if no rank refused and every signature is the same;
    otherwise every rank raises the same error (module docstring)."""
    if ranks <= 1 or not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    mine = (signature, None if error is None else (type(error).__name__, _text(error)))
    everyone: list = [None] * ranks
    dist.all_gather_object(everyone, mine, group=group)
    refused = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if refused:
        r, (kind, text) = refused[0]
        more = f" (and rank(s) {[s for s, _ in refused[1:]]})" if len(refused) > 1 else ""
        raise _ERRORS.get(kind, PlanError)(f"{what}: rank {r}{more} {verb}, so every rank does: {text}") from error
    first = everyone[0][0]
    for key in first:
        differ = [r for r, (sig, _) in enumerate(everyone) if sig.get(key) != first[key]]
        if differ:
            r = differ[0]
            raise PlanError(f"{what}: rank(s) {differ} called with another {key} than rank 0 (rank 0: "
                            f"{first[key]!r}, rank {r}: {everyone[r][0].get(key)!r}); every rank must make the "
                            "same call, so none runs it")
    extra = sorted({k for sig, _ in everyone for k in sig} - set(first))
    if extra:
        raise PlanError(f"{what}: the ranks' calls differ in {extra[0]}; every rank must make the same call")
