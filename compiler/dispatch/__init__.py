"""Dispatch (DESIGN §6; M4.5 §0x07): from a call to the backend that runs it.

In the order a call goes through it:

* ``schema``      the key's coordinates, the spellings a call may use, canonical JSON + sha256
* ``environment`` the environment coordinate (installed versions, the device)
* ``coordinates`` the coordinates a spec decides (layout, mask kind and digests, phase)
* ``call``        a call's fields normalised and validated (``CallError``: every problem at once)
* ``keys``        ``DispatchKey``: the frozen key with its digest
* ``plan_key``    ``PlanKey``: the static projection a plan freezes
* ``admission``   rejection factors, predicates, ``BackendSpec`` (each backend declares its own
                  in ``backends/<name>/admission.py``)
* ``selection``   candidates, rejection vectors, the winner and its fallbacks
* ``protocol``    ``Backend``: what the torch front doors ask of a backend (each backend
                  implements it in ``backends/<name>/torch_api.py``)
* ``registry``    the registered backends in priority order, ``select`` and ``dispatch``; the
                  only place the compiler reaches a backend
"""
from __future__ import annotations

from .admission import (FACTORS, FORWARD_ONLY, KV_IN_QUERY_DTYPE, STORAGE_DTYPES, BackendSpec, Predicate,
                        Rejection, allowed, bounded, installed, requires, rule, shown, when)
from .call import CallError, key_fields
from .coordinates import (cache_layout_of, mask_digest_of, mask_kind_of, phase_of_lengths, representable,
                          score_digest_of, spec_fields)
from .environment import Environment, distribution_version, run_environment
from .keys import DispatchKey
from .plan_key import PLAN_DYNAMIC_FIELDS, PLAN_KEY_FIELDS, PlanKey
from .protocol import CAPABILITIES, Backend, BackendBase, BackendRefused, require
from .registry import (ADMISSION, DEVICE_DEFAULT, REGISTRY, Registry, backend, backend_module, default_registry,
                       device_default, dispatch, select, torch_backend, with_capability)
from .schema import (CACHE_LAYOUTS, CALL_ALIASES, DEVICE_TYPES, KEY_GROUPS, KEY_VERSION, PHASES, canonical_json,
                     sha256_of)
from .selection import Candidate, DispatchError, Selection

__all__ = [
    "CAPABILITIES", "Backend", "BackendBase", "BackendRefused", "require", "DEVICE_DEFAULT", "device_default",
    "torch_backend", "with_capability", "ADMISSION", "CACHE_LAYOUTS", "CALL_ALIASES", "DEVICE_TYPES", "FACTORS", "FORWARD_ONLY", "KEY_GROUPS",
    "KEY_VERSION", "KV_IN_QUERY_DTYPE", "PHASES", "PLAN_DYNAMIC_FIELDS", "PLAN_KEY_FIELDS", "REGISTRY",
    "STORAGE_DTYPES", "BackendSpec", "CallError", "Candidate", "DispatchError", "DispatchKey", "Environment",
    "PlanKey", "Predicate", "Registry", "Rejection", "Selection", "allowed", "backend", "backend_module", "bounded",
    "cache_layout_of", "canonical_json", "default_registry", "dispatch", "distribution_version", "installed",
    "key_fields", "mask_digest_of", "mask_kind_of", "phase_of_lengths", "representable", "requires", "rule",
    "run_environment", "score_digest_of", "select", "sha256_of", "shown", "spec_fields", "when",
]
