"""A call's coordinates, normalised and validated before any backend is asked (M4.5 §0x07A).

A call is a JSON-like mapping in any of the spellings of ``schema.CALL_ALIASES``; checked
against a spec, it becomes the complete, canonical field values of a ``DispatchKey``.  A
malformed call (undefined semantics, not an unsupported one) raises :class:`CallError` with
every problem at once."""
from __future__ import annotations

import os
from typing import Any, Mapping

from .. import resources
from ..errors import AttncError, Diagnostic
from ..resources import MAX_LENGTH
from .coordinates import phase_of_lengths, representable, spec_fields
from .environment import Environment, distribution_version
from .schema import (ALL_FIELDS, CACHE_ALIASES, CACHE_LAYOUTS, CALL_ALIASES, DEVICE_TYPES, DTYPES, KEY_GROUPS,
                     PHASES, SPEC_FIELDS)

# host bytes a request costs a key and a plan at least (its lengths, offsets and row pointers)
REQUEST_BYTES = 64


class CallError(AttncError):
    """A malformed call (M4.5 §0x07A): not 'unsupported by a backend' but undefined semantics."""


def key_fields(program, call: Mapping, env: Environment | Mapping | None = None) -> dict[str, Any]:
    """Every field of the key of ``call`` (a JSON-like mapping; see ``CALL_ALIASES`` for the
    accepted spellings) against ``program`` (an ``ir.Program``, or None for a spec-less key whose
    call names every coordinate).  ``env`` gives the environment defaults (None: detect unless
    the call names the device); fields the call names win."""
    problems: list[str] = []
    raw: dict[str, Any] = {}
    for name, value in dict(call).items():
        canon = CALL_ALIASES.get(name, name)
        if canon not in ALL_FIELDS:
            problems.append(f"unknown call field '{name}'")
        elif canon in raw and raw[canon] != value:
            problems.append(f"'{name}' repeats {canon} with another value ({value!r} vs {raw[canon]!r})")
        else:
            raw[canon] = value
    if problems:
        raise CallError([Diagnostic(p) for p in problems])
    if env is None:
        env = Environment.detect(raw.get("device_type")) if "device_type" not in raw \
            else Environment(device_type=raw["device_type"], interpreter=os.environ.get("TRITON_INTERPRET") == "1",
                             torch=distribution_version("torch"), triton=distribution_version("triton"))
    env_json = env.to_json() if isinstance(env, Environment) else dict(env)
    if env_json.get("device_type") != raw.get("device_type", env_json.get("device_type")):
        # another device than the detected one: the detected device's identity does not apply
        env_json.update(compute_capability=None, device_name=None, cuda_runtime=None)
    values = {**{n: env_json.get(n) for n in KEY_GROUPS["environment"]}, **_defaults()}
    if program is not None:
        values.update(spec_fields(program))
    for n, v in raw.items():
        if program is not None and n in SPEC_FIELDS and n in values and v is not None:
            try:
                same = _normalize(n, v) == values[n]
            except (TypeError, ValueError):
                same = False
            if not same:
                problems.append(f"the call has {n} = {v!r} but spec '{program.name}' declares {values[n]!r}")
                continue
        values[n] = v
    if problems:
        raise CallError([Diagnostic(p) for p in problems])
    values = _validate(values)
    if program is not None and "mask_representable" not in raw:
        values["mask_representable"] = representable(program, values["S_q"], values["S_k"])
    return values


def _defaults() -> dict:
    return {"phase": None, "training": False, "B": None, "S_q": None, "S_k": None, "H_q": None, "H_kv": None,
            "d_qk": None, "d_v": None, "q_dtype": None, "kv_dtype": None, "contiguous": True,
            "last_dim_contiguous": True, "mask_kind": None, "mask_representable": None, "mask_digest": None,
            "score_digest": None, "dropout_p": 0.0, "positions": "bottom_right", "cache_layout": "contiguous_bhsd",
            "page_size": None, "split": "auto", "state": "lse_o", "graph_mode": False, "deterministic": False,
            "backend_request": "auto"}


def _normalize(name: str, value):
    if name in ("q_dtype", "kv_dtype"):
        return DTYPES[str(value).lower()]
    if name == "cache_layout":
        v = str(value).lower()
        return CACHE_ALIASES.get(v, v)
    if name in ("H_q", "H_kv", "d_qk", "d_v", "page_size") and value is not None:
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(value)
        return int(value)
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(v: dict) -> dict:
    """Semantic checks before any backend is asked (§0x07A): every problem, then one error."""
    bad: list[str] = []

    def need_int(name, lo=1):
        x = v.get(name)
        if not _is_int(x) or x < lo:
            bad.append(f"{name} = {x!r} must be an integer >= {lo}")
            return False
        return True

    def need_bool(name):
        if not isinstance(v.get(name), bool):
            bad.append(f"{name} = {v.get(name)!r} must be true or false")

    if v.get("device_type") not in DEVICE_TYPES:
        bad.append(f"device_type = {v.get('device_type')!r} must be one of {', '.join(DEVICE_TYPES)}")
    cc = v.get("compute_capability")
    if cc is not None and (not _is_int(cc) or cc < 10):
        bad.append(f"compute_capability = {cc!r} must be an integer like 90 (sm_90)")
    for name in ("interpreter", "training", "contiguous", "last_dim_contiguous", "graph_mode", "deterministic"):
        need_bool(name)
    # lengths: S_q / S_k are per request; a scalar means every request
    for name in ("S_q", "S_k"):
        x = v.get(name)
        if _is_int(x):
            continue
        if isinstance(x, (list, tuple)) and x and all(_is_int(i) for i in x):
            v[name] = tuple(x)
        else:
            bad.append(f"{name} = {x!r} must be a positive integer or a non-empty list of them")
            v[name] = None
    lists = [len(v[n]) for n in ("S_q", "S_k") if isinstance(v.get(n), tuple)]
    if v.get("B") is None and lists:
        v["B"] = lists[0]
    if v.get("B") is None and not lists:
        v["B"] = 1
    if need_int("B") and lists:
        for n in ("S_q", "S_k"):
            if isinstance(v[n], tuple) and len(v[n]) != v["B"]:
                bad.append(f"{n} lists {len(v[n])} requests but B = {v['B']}")
    if not bad:
        # every request gets its lengths here and its rows of the plan's arrays later
        resources.require(f"a call of B = {v['B']} requests", REQUEST_BYTES * v["B"])
        for n in ("S_q", "S_k"):
            if _is_int(v[n]):
                v[n] = (v[n],) * v["B"]
        for b, (q, k) in enumerate(zip(v["S_q"], v["S_k"])):
            if q < 1 or k < 1:
                bad.append(f"request {b}: S_q = {q}, S_k = {k}; both must be positive")
            elif k > MAX_LENGTH:
                bad.append(f"request {b}: S_k = {k} exceeds {MAX_LENGTH} (2^30): the language's limit on positions")
            elif q > k:
                bad.append(f"request {b}: S_q = {q} query rows exceed S_k = {k} keys (bottom-right "
                           "positions: every query row's own key is in the cache)")
    heads_ok = need_int("H_q") & need_int("H_kv")
    if heads_ok and v["H_q"] % v["H_kv"]:
        bad.append(f"H_q = {v['H_q']} is not a multiple of H_kv = {v['H_kv']} (GQA maps query head h to "
                   "K/V head h // (H_q / H_kv))")
    need_int("d_qk")
    need_int("d_v")
    for name in ("q_dtype", "kv_dtype"):
        x = v.get(name)
        if x is None and name == "kv_dtype" and v.get("q_dtype") is not None:
            x = v["q_dtype"]
        try:
            v[name] = DTYPES[str(x).lower()]
        except KeyError:
            bad.append(f"{name} = {x!r} is not a dtype ({', '.join(sorted(set(DTYPES.values())))})")
    p = v.get("dropout_p")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        bad.append(f"dropout_p = {p!r} must be in [0, 1]")
    else:
        v["dropout_p"] = float(p)
    layout = _normalize("cache_layout", v.get("cache_layout") or "")
    if layout not in CACHE_LAYOUTS:
        bad.append(f"cache_layout = {v.get('cache_layout')!r} must be one of {', '.join(CACHE_LAYOUTS)}")
    v["cache_layout"] = layout
    ps = v.get("page_size")
    if layout.startswith("paged_"):
        if not _is_int(ps) or ps < 1:
            bad.append(f"cache_layout = {layout} needs page_size > 0, got {ps!r}")
    elif ps is not None:
        bad.append(f"page_size = {ps!r} given for a {layout} cache (only paged caches have pages)")
    kind = v.get("mask_kind")
    if not isinstance(kind, str) or not kind.isidentifier():
        bad.append(f"mask_kind = {kind!r} must be a name (full, causal, window, position, tensor, ...)")
    rep = v.get("mask_representable")
    if rep is not None and not isinstance(rep, bool):
        bad.append(f"mask_representable = {rep!r} must be true, false or null")
    for name in ("split", "state", "positions", "backend_request"):
        if not isinstance(v.get(name), str) or not v[name]:
            bad.append(f"{name} = {v.get(name)!r} must be a non-empty string")
    if v.get("positions") not in (None, "bottom_right"):
        bad.append(f"positions = {v.get('positions')!r}: attnc aligns query rows bottom-right")
    if not bad:
        phase = v.get("phase")
        derived = phase_of_lengths(v["S_q"], v["S_k"])
        if phase is None:
            v["phase"] = derived
        elif phase not in PHASES:
            bad.append(f"phase = {phase!r} must be one of {', '.join(PHASES)}")
        elif derived == "mixed" and phase != "mixed":
            # a uniform batch may name its phase (chunked prefill is often called prefill);
            # a batch whose requests are in different phases is a mixed batch, whatever its label
            bad.append(f"phase = {phase} but the requests (S_q = {list(v['S_q'])}, S_k = {list(v['S_k'])}) "
                       "mix phases; call it mixed")
    if bad:
        raise CallError([Diagnostic(f"malformed call: {b}") for b in bad])
    return v

