"""The backend registry: the only place the compiler reaches a backend (DESIGN §2).

Backends are imported lazily by name so that, e.g., `attnc check` never
imports numpy-heavy or GPU code.  (Dispatch keys, admission and selection
policies, DESIGN §6, build on this registry.)
"""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

from .errors import AttncError

REGISTRY: dict[str, str] = {
    "numpy": "attnc.backends.numpy",
    "triton": "attnc.backends.triton",
    "ahbm": "attnc.backends.ahbm",
}


def backend(name: str) -> ModuleType:
    """The backend package: `emit(program) -> Source`, `load(program) -> Kernel`."""
    if name not in REGISTRY:
        raise AttncError(f"unknown backend '{name}'; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])


# ================================================================ dispatch keys (M4.5 §0x07A)
# Everything below is pure data over one frozen call description: no backend is imported to
# decide admission, so `attnc dispatch` answers on any host.
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass, fields, replace  # noqa: E402
from functools import lru_cache  # noqa: E402
from typing import Any, Callable, Iterable, Mapping  # noqa: E402

from .errors import Diagnostic  # noqa: E402

KEY_VERSION = 1
PHASES = ("prefill", "append", "decode", "mixed")
DEVICE_TYPES = ("cpu", "cuda", "ahbm")  # ahbm: the mesh simulator (backends/ahbm/sim)
CACHE_LAYOUTS = ("contiguous_bhsd", "contiguous_bshd", "ragged", "paged_nhd", "paged_hnd")
_CACHE_ALIASES = {"contiguous": "contiguous_bhsd", "contiguous_hnd": "contiguous_bhsd",
                  "contiguous_nhd": "contiguous_bshd"}
_DTYPES = {"f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
           "bf16": "bf16", "bfloat16": "bf16",
           "f32": "f32", "fp32": "f32", "float32": "f32", "float": "f32",
           "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "float8_e5m2": "fp8_e5m2"}
# The five coordinate families of §0x07A, in canonical order.
KEY_GROUPS: dict[str, tuple[str, ...]] = {
    "environment": ("device_type", "compute_capability", "device_name", "interpreter", "torch", "triton",
                    "cuda_runtime"),
    "operation": ("phase", "training"),
    "tensors": ("B", "S_q", "S_k", "H_q", "H_kv", "d_qk", "d_v", "q_dtype", "kv_dtype", "contiguous",
                "last_dim_contiguous"),
    "semantics": ("mask_kind", "mask_representable", "mask_digest", "score_digest", "dropout_p", "positions"),
    "runtime": ("cache_layout", "page_size", "split", "state", "graph_mode", "deterministic",
                "backend_request"),
}
# Call-file spellings: the seed's teaching key (§0x07A) and §0x0BE's call key map onto ours.
CALL_ALIASES = {
    "device": "device_type", "batch": "B", "q_len": "S_q", "kv_len": "S_k", "kv_lens": "S_k",
    "S_k_per_request": "S_k", "q_lens": "S_q", "num_q_heads": "H_q", "num_kv_heads": "H_kv",
    "head_dim_qk": "d_qk", "head_dim_vo": "d_v", "head_dim": "d_qk", "dtype": "q_dtype",
    "cuda_graph": "graph_mode", "requires_deterministic": "deterministic", "backend": "backend_request",
    "mask": "mask_kind",
}
# Fields a spec fixes: a call may repeat them, never contradict them.
_SPEC_FIELDS = ("H_q", "H_kv", "d_qk", "d_v", "q_dtype", "kv_dtype", "cache_layout", "page_size", "split",
                "state", "mask_kind", "mask_digest", "score_digest")


class CallError(AttncError):
    """A malformed call (M4.5 §0x07A): not 'unsupported by a backend' but undefined semantics."""


class DispatchError(AttncError):
    """No backend may run the call under the policy; carries the selection with every reason."""

    def __init__(self, message: str, selection: "Selection"):
        self.selection = selection
        super().__init__(message)


def canonical_json(obj) -> str:
    """Sorted keys, no whitespace, ASCII, no NaN: the bytes every digest in attnc hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_of(obj) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Environment:
    """The environment coordinate: which code objects can exist and run here (§0x07A).

    Versions come from distribution metadata (no import); the device is probed through torch
    only when the caller does not name it."""

    device_type: str = "cpu"
    compute_capability: int | None = None  # major * 10 + minor (90 = sm_90)
    device_name: str | None = None
    interpreter: bool = False  # TRITON_INTERPRET=1: Triton kernels run on the CPU
    torch: str | None = None
    triton: str | None = None
    cuda_runtime: str | None = None

    @classmethod
    def detect(cls, device_type: str | None = None) -> "Environment":
        return _detect(device_type)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@lru_cache(maxsize=4)
def _detect(device_type: str | None) -> Environment:
    import importlib.util
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    env = {"interpreter": interp, "torch": _version("torch"), "triton": _version("triton")}
    if device_type is None:
        device_type = "cpu"
        if not interp and env["torch"] and importlib.util.find_spec("torch") is not None:
            import torch
            if torch.cuda.is_available():
                device_type = "cuda"
    if device_type == "cuda" and env["torch"]:
        # a broken driver leaves the fields unknown, not a crash
        with contextlib.suppress(Exception):
            import torch
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                env.update(compute_capability=10 * major + minor, device_name=torch.cuda.get_device_name(),
                           cuda_runtime=torch.version.cuda)
    return Environment(device_type=device_type, **env)


# ---------------------------------------------------------------- spec-derived coordinates
def cache_layout_of(program) -> str:
    kind, layout = program.cache.kind.value, program.cache.layout.value
    return kind if kind == "ragged" else f"{kind}_{layout}"


def mask_kind_of(program) -> str:
    """``full`` | ``causal`` | ``window`` (causal sliding window) | ``position`` (any other mask of
    positions only) | ``tensor`` (reads runtime tensors: a data-dependent, custom mask)."""
    from . import ir
    text = ir.format_expr(program.mask)
    if ir.loads(program.mask):
        return "tensor"
    if text == "true":
        return "full"
    if text == "k <= q":
        return "causal"
    m = program.mask
    if isinstance(m, ir.Binary) and m.op == "and" and ir.format_expr(m.left) == "k <= q":
        r = m.right
        if isinstance(r, ir.Compare) and r.op == "lt" and ir.format_expr(r.left) == "q - k" \
                and isinstance(r.right, ir.Const):
            return "window"
    return "position"


def mask_digest_of(program) -> str:
    decls = tuple((t.name, t.dtype.value, tuple(t.axes)) for t in program.tensors)
    return hashlib.sha256(repr((program.mask, decls)).encode()).hexdigest()


def score_digest_of(program) -> str:
    return hashlib.sha256(repr((program.score, program.scale, program.masked_rows)).encode()).hexdigest()


def _representable(program, s_q: tuple[int, ...], s_k: tuple[int, ...]) -> bool | None:
    """FlashMask representability of the mask for this call's lengths; None when the mask reads
    runtime tensors (their values decide it, at plan time)."""
    from . import ir
    if ir.loads(program.mask):
        return None
    pairs = sorted(set(zip(s_q, s_k)))
    if len(pairs) > 4:  # O(S) each; the extremes stand for the rest
        pairs = [pairs[0], pairs[-1]]
    return all(_representable_at(program.mask, program.heads_q, len(s_q), q, k) for q, k in pairs)


@lru_cache(maxsize=256)
def _representable_at(mask, heads_q: int, batch: int, s_q: int, s_k: int) -> bool:
    """Memoized: a runtime hook builds the same key on every call of one shape.  (The analysis
    widens over b and h only when the mask names them.)"""
    from . import ir
    from .analysis.intervals import analyze
    probe = ir.Program("probe", heads_q, 1, 1, 1, "f32", 1.0, (), (), mask)
    return analyze(probe, batch, s_q, s_k).representable


def _phase_of(s_q: tuple[int, ...], s_k: tuple[int, ...]) -> str:
    from .analysis.phases import phase_of
    phases = {phase_of(k - q, q) for q, k in zip(s_q, s_k)}
    return phases.pop() if len(phases) == 1 else "mixed"


# ---------------------------------------------------------------- the key
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
    def from_call(cls, program, call: Mapping, env: "Environment | Mapping | None" = None) -> "DispatchKey":
        """The key of ``call`` (a JSON-like mapping; see :data:`CALL_ALIASES` for the accepted
        spellings) against ``program`` (an ``ir.Program``, or None for a spec-less key whose
        call names every coordinate).  ``env`` gives the environment defaults (None: detect
        unless the call names the device); fields the call names win."""
        problems: list[str] = []
        raw: dict[str, Any] = {}
        for name, value in dict(call).items():
            canon = CALL_ALIASES.get(name, name)
            if canon not in _ALL_FIELDS:
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
                                 torch=_version("torch"), triton=_version("triton"))
        env_json = env.to_json() if isinstance(env, Environment) else dict(env)
        if env_json.get("device_type") != raw.get("device_type", env_json.get("device_type")):
            # another device than the detected one: the detected device's identity does not apply
            env_json.update(compute_capability=None, device_name=None, cuda_runtime=None)
        values = {**{n: env_json.get(n) for n in KEY_GROUPS["environment"]}, **_defaults()}
        if program is not None:
            values.update(_from_program(program))
        for n, v in raw.items():
            if program is not None and n in _SPEC_FIELDS and n in values and v is not None:
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
            values["mask_representable"] = _representable(program, values["S_q"], values["S_k"])
        return cls(**values)


_ALL_FIELDS = frozenset(n for names in KEY_GROUPS.values() for n in names)


def _defaults() -> dict:
    return {"phase": None, "training": False, "B": None, "S_q": None, "S_k": None, "H_q": None, "H_kv": None,
            "d_qk": None, "d_v": None, "q_dtype": None, "kv_dtype": None, "contiguous": True,
            "last_dim_contiguous": True, "mask_kind": None, "mask_representable": None, "mask_digest": None,
            "score_digest": None, "dropout_p": 0.0, "positions": "bottom_right", "cache_layout": "contiguous_bhsd",
            "page_size": None, "split": "auto", "state": "lse_o", "graph_mode": False, "deterministic": False,
            "backend_request": "auto"}


def _from_program(program) -> dict:
    split = program.split.kind.value + (f"({', '.join(str(a) for a in program.split.args)})"
                                        if program.split.args else "")
    return {"H_q": program.heads_q, "H_kv": program.heads_kv, "d_qk": program.d_qk, "d_v": program.d_v,
            "q_dtype": program.dtype, "kv_dtype": program.dtype, "cache_layout": cache_layout_of(program),
            "page_size": program.cache.page_size, "split": split, "state": program.state.value,
            "mask_kind": mask_kind_of(program), "mask_digest": mask_digest_of(program),
            "score_digest": score_digest_of(program)}


def _normalize(name: str, value):
    if name in ("q_dtype", "kv_dtype"):
        return _DTYPES[str(value).lower()]
    if name == "cache_layout":
        v = str(value).lower()
        return _CACHE_ALIASES.get(v, v)
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
        for n in ("S_q", "S_k"):
            if _is_int(v[n]):
                v[n] = (v[n],) * v["B"]
        for b, (q, k) in enumerate(zip(v["S_q"], v["S_k"])):
            if q < 1 or k < 1:
                bad.append(f"request {b}: S_q = {q}, S_k = {k}; both must be positive")
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
            v[name] = _DTYPES[str(x).lower()]
        except KeyError:
            bad.append(f"{name} = {x!r} is not a dtype ({', '.join(sorted(set(_DTYPES.values())))})")
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
        derived = _phase_of(v["S_q"], v["S_k"])
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


# ---------------------------------------------------------------- plan keys (§0x07F)
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


# ---------------------------------------------------------------- admission (§0x07B)
FACTORS = {
    "I": "backend installed", "E": "enabled by policy", "P": "phase", "H": "hardware",
    "D": "query/output dtype", "K": "K/V dtype and cache", "Q": "lengths and head dims",
    "G": "head relationship", "L": "layout, strides, page size", "M": "mask semantics",
    "N": "numerics and determinism", "C": "graph capture and lifecycle",
}


@dataclass(frozen=True)
class Rejection:
    factor: str  # one of FACTORS
    reason: str  # "<field>=<value> unsupported": stable, greppable, what a fixture pins
    detail: str = ""  # what the backend supports instead

    def __str__(self) -> str:
        return f"{self.reason} ({self.detail})" if self.detail else self.reason

    def to_json(self) -> dict:
        return {"factor": self.factor, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class Predicate:
    """One admission factor A_{b,i}: ``test(key)`` yields the rejections (empty: admitted)."""

    factor: str
    describe: str
    test: Callable[[DispatchKey], Iterable[Rejection]]

    def __post_init__(self):
        if self.factor not in FACTORS:
            raise ValueError(f"unknown admission factor {self.factor!r}")

    def rejections(self, key: DispatchKey) -> list[Rejection]:
        return list(self.test(key))


def _shown(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return ",".join(str(x) for x in v) if len(set(v)) > 1 else str(v[0])
    return str(v)


def allowed(factor: str, name: str, values: Iterable, *, label: str | None = None) -> Predicate:
    """``name`` (every request's value, for per-request lengths) is one of ``values``."""
    values = tuple(values)

    def test(key):
        v = getattr(key, name)
        bad = [x for x in dict.fromkeys(v if isinstance(v, tuple) else (v,)) if x not in values]
        for x in bad:
            yield Rejection(factor, f"{label or name}={_shown(x)} unsupported",
                            "supported: " + ", ".join(_shown(s) for s in values))
    return Predicate(factor, f"{label or name} in {{{', '.join(_shown(s) for s in values)}}}", test)


def bounded(factor: str, name: str, lo: int | None = None, hi: int | None = None, *,
            label: str | None = None) -> Predicate:
    """``lo <= name <= hi`` for every request (per-request lengths) or the one value."""
    def test(key):
        v = getattr(key, name)
        for x in dict.fromkeys(v if isinstance(v, tuple) else (v,)):
            if (lo is not None and x < lo) or (hi is not None and x > hi):
                yield Rejection(factor, f"{label or name}={x} unsupported", _range(label or name, lo, hi))
                return
    return Predicate(factor, _range(label or name, lo, hi), test)


def _range(name, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"needs {lo} <= {name} <= {hi}"
    return f"needs {name} >= {lo}" if lo is not None else f"needs {name} <= {hi}"


def requires(factor: str, name: str, value, *, label: str | None = None, detail: str = "") -> Predicate:
    def test(key):
        v = getattr(key, name)
        if v != value:
            yield Rejection(factor, f"{label or name}={_shown(v)} unsupported", detail or f"needs {_shown(value)}")
    return Predicate(factor, f"{label or name} == {_shown(value)}", test)


def rule(factor: str, describe: str, check: Callable[[DispatchKey], str | None], detail: str = "") -> Predicate:
    """A predicate in plain code: ``check(key)`` returns the rejection reason or None."""
    def test(key):
        reason = check(key)
        if reason:
            yield Rejection(factor, reason, detail)
    return Predicate(factor, describe, test)


def when(describe: str, condition: Callable[[DispatchKey], bool], predicate: Predicate) -> Predicate:
    """``predicate`` applies only to keys where ``condition`` holds."""
    def test(key):
        if condition(key):
            yield from predicate.test(key)
    return Predicate(predicate.factor, f"{describe}: {predicate.describe}", test)


def installed(dist: str, field_name: str | None = None) -> Predicate:
    """I_b: the distribution is present: read from the key's environment field when it has one
    (so a key made elsewhere is judged by its own environment), else from this host."""
    def check(key):
        version = getattr(key, field_name) if field_name else _version(dist)
        return None if version else f"{dist} not installed"
    return rule("I", f"{dist} installed", check)


@dataclass(frozen=True)
class BackendSpec:
    """A backend's admission declaration: candidate domain (platforms x phases) and predicates.

    ``platforms`` are device types; ``interpreter`` admits a CPU key whose environment runs
    Triton's interpreter."""

    name: str
    platforms: tuple[str, ...]
    phases: tuple[str, ...]
    admission: tuple[Predicate, ...]
    description: str = ""

    def in_domain(self, key: DispatchKey) -> list[str]:
        """Why the key is outside this backend's candidate domain (empty: inside)."""
        out = []
        platform_ok = key.device_type in self.platforms or (key.interpreter and "interpreter" in self.platforms)
        if not platform_ok:
            out.append(f"device_type={key.device_type}{' (interpreter)' if key.interpreter else ''} outside "
                       f"platforms {{{', '.join(self.platforms)}}}")
        if key.phase not in self.phases:
            out.append(f"phase={key.phase} outside {{{', '.join(self.phases)}}}")
        return out

    def admit(self, key: DispatchKey) -> list[Rejection]:
        """R_b(D): the complete rejection vector, never just the first reason (§0x07B)."""
        return [r for p in self.admission for r in p.rejections(key)]


def _contiguous(key) -> str | None:
    return None if key.cache_layout.startswith("contiguous_") else f"cache_layout={key.cache_layout} unsupported"


def _uniform(key) -> str | None:
    if key.uniform:
        return None
    return f"S_k={_shown(key.S_k)} unsupported" if len(set(key.S_k)) > 1 else f"S_q={_shown(key.S_q)} unsupported"


_STORAGE = ("f16", "bf16", "f32")
_FORWARD_ONLY = (requires("N", "training", False, detail="forward only"),
                 requires("N", "dropout_p", 0.0, detail="no dropout"))

def _triton_graph(k: DispatchKey) -> str | None:
    """graph_mode: the split kernels replay from a CUDA graph (backends/triton/graph.py); the
    interpreter has no graphs and the contiguous prefill launcher is not captured."""
    if not k.graph_mode:
        return None
    if k.device_type != "cuda" or k.interpreter:
        return "graph_mode=true unsupported without a CUDA device"
    if k.phase == "prefill" and k.cache_layout.startswith("contiguous"):
        return "graph_mode=true unsupported for prefill on a contiguous cache"
    return None


# The backends' declarations (DESIGN §6), in priority order: `auto` takes the first eligible.
ADMISSION: dict[str, BackendSpec] = {
    "triton": BackendSpec(
        "triton", platforms=("cuda", "interpreter"), phases=("prefill", "append", "decode", "mixed"),
        description="generated Triton kernels: prefill/append over the tile CSR on contiguous K/V; "
                    "split-K/V producer + combine for decode, append and mixed batches over paged, "
                    "ragged or per-request contiguous caches",
        admission=(
            installed("triton", "triton"), installed("torch", "torch"),
            rule("H", "compute capability >= 80 on CUDA",
                 lambda k: f"compute_capability={k.compute_capability} unsupported"
                 if k.device_type == "cuda" and k.compute_capability is not None and k.compute_capability < 80
                 else None, detail="needs sm_80 or newer"),
            allowed("D", "q_dtype", _STORAGE),
            rule("K", "K/V stored in the query dtype",
                 lambda k: None if k.kv_dtype == k.q_dtype else f"kv_dtype={k.kv_dtype} unsupported",
                 detail="K/V in the query dtype"),
            bounded("Q", "d_qk", 1, 256), bounded("Q", "d_v", 1, 256),
            requires("L", "last_dim_contiguous", True, detail="unit stride in the head dim"),
            *_FORWARD_ONLY,
            rule("C", "graph_mode: split calls on a CUDA device", _triton_graph,
                 detail="Kernel.decode_graph captures the split-K/V calls (decode, append, mixed, prefill "
                        "over pages) on a GPU; the contiguous prefill launcher allocates per call"),
        )),
    "numpy": BackendSpec(
        "numpy", platforms=("cpu", "cuda"), phases=("prefill", "append", "decode", "mixed"),
        description="the numpy programs: tiled (contiguous, one S_q/S_k) and split (paged, ragged, "
                    "per-request lengths, mixed batches); host memory, any device's arrays are copied",
        admission=(
            installed("numpy"),
            allowed("D", "q_dtype", _STORAGE),
            rule("K", "K/V stored in the query dtype",
                 lambda k: None if k.kv_dtype == k.q_dtype else f"kv_dtype={k.kv_dtype} unsupported",
                 detail="K/V in the query dtype"),
            *_FORWARD_ONLY,
            requires("C", "graph_mode", False, detail="host code cannot be captured in a CUDA graph"),
        )),
    "ahbm": BackendSpec(
        "ahbm", platforms=("ahbm",), phases=("prefill", "append", "decode"),
        description="greenlet tl programs on the AHBM mesh simulator (ADR-0060): decode with or without "
                    "SP, prefill without SP or as a ring",
        admission=(
            installed("greenlet"),
            allowed("D", "q_dtype", _STORAGE),
            rule("L", "contiguous K/V", _contiguous, detail="the mesh programs read contiguous K/V"),
            rule("L", "one S_q and S_k for the batch", _uniform, detail="one call shape per launch"),
            *_FORWARD_ONLY,
            requires("C", "graph_mode", False, detail="a simulator has no CUDA graphs"),
        )),
}


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
            shown = " ".join(f"{n}={_brief(n, getattr(k, n))}" for n in names
                             if not (n.endswith("_digest") and getattr(k, n) is None))
            lines.append(f"  {group:12} {shown}")
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
    return f"{v[:12]}..." if name.endswith("_digest") else _shown(v)


class Registry:
    """Registered backends in priority order (first = preferred), the set `select` narrows by
    candidate domain, admission and policy (§0x07C).  ``disabled`` is the runtime policy's E_b."""

    def __init__(self, specs: Iterable[BackendSpec], disabled: Iterable[str] = ()):
        self.specs = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"backend registered twice: {names}")
        self.disabled = frozenset(disabled)

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.specs)

    def __getitem__(self, name: str) -> BackendSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def candidate(self, spec: BackendSpec, priority: int, key: DispatchKey) -> Candidate:
        outside = spec.in_domain(key)
        rejections = [] if outside else spec.admit(key)
        if spec.name in self.disabled and not outside:
            rejections.insert(0, Rejection("E", f"backend={spec.name} disabled", "runtime policy"))
        return Candidate(spec.name, priority, tuple(outside), tuple(rejections))

    def select(self, key: DispatchKey) -> Selection:
        request = key.backend_request
        if request != "auto":
            if request not in self:
                raise CallError(f"malformed call: backend_request = {request!r} is not a registered backend "
                                f"({', '.join(('auto',) + self.names)})")
            priority = self.names.index(request) + 1
            c = self.candidate(self[request], priority, key)
            reasons = list(c.outside) + [str(r) for r in c.rejections]
            error = None if c.eligible else f"forced backend {request} rejects the call: " + "; ".join(reasons)
            return Selection(key, "forced", request if c.eligible else None, (c,), error)
        cands = tuple(self.candidate(s, i + 1, key) for i, s in enumerate(self.specs))
        winner = next((c.name for c in cands if c.eligible), None)
        error = None
        if winner is None:
            in_domain = [c for c in cands if c.in_domain]
            if not in_domain:
                error = "no registered backend has this call in its candidate domain"
            else:
                error = "every candidate rejects the call: " + "; ".join(
                    f"{c.name}: {', '.join(str(r) for r in c.rejections)}" for c in in_domain)
        return Selection(key, "auto", winner, cands, error)


def default_registry() -> Registry:
    """attnc's own backends with admission declarations, in :data:`ADMISSION` order."""
    disabled = {n.strip() for n in os.environ.get("ATTNC_DISABLE_BACKENDS", "").split(",") if n.strip()}
    return Registry(ADMISSION.values(), disabled)


def select(key: DispatchKey, registry: Registry | None = None) -> Selection:
    return (registry or default_registry()).select(key)


def dispatch(program, call: Mapping, env: Environment | Mapping | None = None,
             registry: Registry | None = None) -> Selection:
    """Validate ``call`` against ``program``, freeze its key, select under its policy."""
    return select(DispatchKey.from_call(program, call, env), registry)
