"""Benchmark evidence rows and their validator (M4.5 §0x07I, §0x0B, §0x0C; DESIGN §6).

One row binds one immutable dispatch key to one observation.  Its levels are monotone:

    1 environment   what ran here: device type/name/capability, torch, triton, python, attnc
    2 dispatch      the readable key, its sha256 digest, the policy, the selected backend + config
    3 correctness   reference, max |err| (or a relative error), the tolerance frozen before the
                    run, pass
    4 measurement   warmup policy, synchronization, raw samples (ms), then any summary

The claim of a row is the highest level whose fields, and every lower level's, are present and
consistent (§0x0B: ``L* = max{l : R_1 .. R_l present and consistent}``).  A row may stop
early (a failing candidate stops at level 3), but it may not skip: timing without a passing
correctness check, correctness without a key, a summary without its raw samples and a digest
that is not the key's are rejected.

The estimators of §0x0CB/§0x0CC are here too: reduction <-> speedup, and the three aggregate
speedups, which answer different questions and are never interchangeable.
"""
from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from . import __version__
from .dispatch import KEY_GROUPS, KEY_VERSION, DispatchKey, Environment, canonical_json, sha256_of
from .errors import AttncError

SCHEMA = "attnc-bench-row/1"
MIN_SAMPLES = 20  # the runtime-evidence floor of §0x0BH, not a claim that 20 always suffice
LEVELS = ("environment", "dispatch", "correctness", "measurement")
CLAIMS = {0: "none", 1: "environment_only", 2: "backend_selected_not_executed",
          3: "correctness_checked_not_measured", 4: "measured"}


class EvidenceError(AttncError):
    """A benchmark row that claims more than its fields support."""


# ---------------------------------------------------------------- building rows
def environment_record(env: Environment | None = None, **extra) -> dict:
    """Level 1: the dispatch environment plus the host's python/numpy/attnc (and ``extra``)."""
    import numpy
    env = env or Environment.detect()
    return {**env.to_json(), "python": platform.python_version(), "numpy": numpy.__version__,
            "machine": platform.machine(), "attnc": __version__, **extra}


def summarize(samples: Sequence[float]) -> dict:
    """count, min, median, p95, max of raw samples, computed only from the preserved list."""
    import numpy as np
    a = np.asarray(samples, np.float64)
    return {"count": int(a.size), "min": float(a.min()), "median": float(np.median(a)),
            "p95": float(np.percentile(a, 95)), "max": float(a.max())}


def make_row(*, environment: Mapping, key: DispatchKey, selected: str, config: Mapping,
             policy: str | None = None, candidates: list | None = None, correctness: Mapping | None = None,
             samples_ms: Sequence[float] | None = None, warmup: Mapping | None = None,
             synchronization: str | None = None, excluded: Sequence[str] = (), **extra) -> dict:
    """A row in the schema; levels absent from the arguments are absent from the row."""
    dispatch = {"key": key.to_json(), "digest": key.digest,
                "policy": policy or ("auto" if key.backend_request == "auto" else "forced"),
                "selected": selected, "config": dict(config)}
    if candidates is not None:
        dispatch["candidates"] = candidates
    row = {"schema": SCHEMA, **extra, "environment": dict(environment), "dispatch": dispatch}
    if correctness is not None:
        row["correctness"] = dict(correctness)
    if samples_ms is not None:
        row["measurement"] = {"unit": "ms", "warmup": dict(warmup or {}), "synchronization": synchronization,
                              "excluded": list(excluded), "samples": [float(s) for s in samples_ms],
                              "summary": summarize(samples_ms) if len(samples_ms) else None}
    return row


def correctness_record(reference: str, comparisons, *, tolerance: Mapping | None = None) -> dict:
    """Level 3 from ``compiler.numerics.Comparison`` s (O first, then LSE)."""
    comparisons = list(comparisons)
    o = comparisons[0]
    return {"reference": reference, "max_abs_error": _finite_or_none(o.max_abs_error),
            "worst_excess": _finite_or_none(o.worst_excess),
            "tolerance": dict(tolerance or {"atol": o.atol, "rtol": o.rtol}),
            "pass": all(c.ok for c in comparisons),
            "fields": {c.what: {"max_abs_error": _finite_or_none(c.max_abs_error), "atol": c.atol, "rtol": c.rtol,
                                "pass": c.ok, **({"detail": c.detail} if c.detail else {})} for c in comparisons}}


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


# ---------------------------------------------------------------- validation
@dataclass
class RowReport:
    level: int
    errors: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # fields of the next level up that are absent
    failed_check: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def claim(self) -> str:
        if self.level == 3 and self.failed_check:
            return "correctness_failed"
        return CLAIMS[self.level]

    def __str__(self) -> str:
        head = f"level {self.level} ({self.claim})"
        if self.errors:
            head += ": " + "; ".join(self.errors)
        if self.missing:
            head += f" [missing: {', '.join(self.missing)}]"
        return head


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _env_missing(env) -> list[str]:
    if not isinstance(env, Mapping):
        return ["environment"]
    need = ["device_type", "python", "attnc"]
    if env.get("device_type") == "cuda":
        need += ["device_name", "compute_capability"]
    out = [f"environment.{n}" for n in need if env.get(n) in (None, "")]
    if env.get("device_type") not in (None, "cpu", "cuda"):
        out.append("environment.device_type (cpu or cuda)")
    return out


def _dispatch_problems(row) -> tuple[list[str], list[str]]:
    d = row.get("dispatch")
    if not isinstance(d, Mapping):
        return ["dispatch.key", "dispatch.digest", "dispatch.selected", "dispatch.config"], []
    missing = [f"dispatch.{n}" for n in ("key", "digest", "selected", "config", "policy") if d.get(n) in (None, "")]
    errors = []
    key = d.get("key")
    if isinstance(key, Mapping):
        if key.get("version") != KEY_VERSION or not all(isinstance(key.get(g), Mapping) for g in KEY_GROUPS):
            errors.append(f"dispatch.key is not a version-{KEY_VERSION} dispatch key ({', '.join(KEY_GROUPS)})")
        elif d.get("digest") and sha256_of(key) != d["digest"]:
            errors.append("dispatch.digest is not the sha256 of the key's canonical JSON (the call drifted)")
        env = row.get("environment")
        if isinstance(env, Mapping) and not errors:
            kd, ed = key["environment"].get("device_type"), env.get("device_type")
            if ed and kd and kd != ed:
                errors.append(f"the key's device_type={kd} is not the environment's {ed}")
    elif key is not None:
        errors.append("dispatch.key must be an object")
    if d.get("policy") not in (None, "auto", "forced"):
        errors.append(f"dispatch.policy = {d.get('policy')!r} (auto or forced)")
    if d.get("config") is not None and not isinstance(d.get("config"), Mapping):
        errors.append("dispatch.config must be an object of named parameters")
    cands = d.get("candidates")
    if cands is not None and d.get("selected"):
        eligible = {c.get("backend") for c in cands if isinstance(c, Mapping) and c.get("eligible")}
        if d["selected"] not in eligible:
            errors.append(f"selected backend {d['selected']} is not in the observed eligible set "
                          f"{sorted(eligible)}")
    return missing, errors


def _correctness_problems(c) -> tuple[list[str], list[str]]:
    if not isinstance(c, Mapping):
        return ["correctness.reference", "correctness.max_abs_error", "correctness.tolerance",
                "correctness.pass"], []
    missing, errors = [], []
    if not c.get("reference"):
        missing.append("correctness.reference")
    if not (_is_num(c.get("max_abs_error")) or _is_num(c.get("rel_error"))):
        # a failing comparison may have no finite error (NaN, shape): then pass must be false
        if not (c.get("pass") is False and ("max_abs_error" in c or "rel_error" in c)):
            missing.append("correctness.max_abs_error")
    tol = c.get("tolerance")
    if not isinstance(tol, Mapping) or not tol or not all(_is_num(v) for v in tol.values()):
        missing.append("correctness.tolerance")
    if not isinstance(c.get("pass"), bool):
        missing.append("correctness.pass")
    if missing:
        return missing, errors
    verdicts = []
    if _is_num(c.get("worst_excess")):
        verdicts.append(("worst_excess <= 0", c["worst_excess"] <= 0))
    if _is_num(c.get("max_abs_reference")) and {"atol", "rtol"} <= set(tol) and _is_num(c.get("max_abs_error")):
        verdicts.append(("max_abs_error <= atol + rtol * max_abs_reference",
                         c["max_abs_error"] <= tol["atol"] + tol["rtol"] * c["max_abs_reference"]))
    if "rel_l2" in tol and _is_num(c.get("rel_error")):
        verdicts.append(("rel_error <= rel_l2", c["rel_error"] <= tol["rel_l2"]))
    if verdicts and not c["pass"] and all(v for _, v in verdicts) and "fields" not in c:
        errors.append(f"correctness.pass is false but {verdicts[0][0]} holds")
    for what, v in verdicts:
        if c["pass"] and not v:
            errors.append(f"correctness.pass is true but {what} does not hold")
    return missing, errors


def _measurement_problems(m, min_samples: int) -> tuple[list[str], list[str]]:
    if not isinstance(m, Mapping):
        return ["measurement.samples", "measurement.warmup", "measurement.synchronization"], []
    missing, errors = [], []
    samples = m.get("samples")
    if samples is None or (isinstance(samples, list) and not samples):
        missing.append("measurement.samples")
        if m.get("summary") or any(n in m for n in ("median", "median_ms", "mean", "min")):
            errors.append("a summary without raw samples")
    elif not isinstance(samples, list) or not all(_is_num(s) and s > 0 for s in samples):
        errors.append("measurement.samples must be positive finite numbers")
    elif len(samples) < min_samples:
        errors.append(f"{len(samples)} raw samples; the schema needs at least {min_samples}")
    elif isinstance(m.get("summary"), Mapping):
        want = summarize(samples)
        for n, v in m["summary"].items():
            if n in want and not (_is_num(v) and math.isclose(v, want[n], rel_tol=1e-9, abs_tol=1e-12)):
                errors.append(f"measurement.summary.{n} = {v} is not what the raw samples give ({want[n]})")
    warm = m.get("warmup")
    if not isinstance(warm, Mapping) or not warm:
        missing.append("measurement.warmup")
    if not m.get("synchronization"):
        missing.append("measurement.synchronization")
    if m.get("unit", "ms") != "ms":
        errors.append(f"measurement.unit = {m.get('unit')!r}; samples are milliseconds")
    return missing, errors


def validate_row(row: Mapping, *, min_samples: int = MIN_SAMPLES) -> RowReport:
    """The highest defensible level of ``row`` and every reason it cannot claim more."""
    if not isinstance(row, Mapping):
        return RowReport(0, ["a row is a JSON object"])
    errors: list[str] = []
    if row.get("schema") != SCHEMA:
        errors.append(f"schema = {row.get('schema')!r}; expected {SCHEMA!r}")
    present = {lvl: lvl in row and row[lvl] is not None for lvl in LEVELS}
    checks = [
        ("environment", (_env_missing(row.get("environment")), [])),
        ("dispatch", _dispatch_problems(row)),
        ("correctness", _correctness_problems(row.get("correctness"))),
        ("measurement", _measurement_problems(row.get("measurement"), min_samples)),
    ]
    level, missing_next, failed = 0, [], False
    broken_at = None
    for i, (name, (missing, errs)) in enumerate(checks, start=1):
        errors += errs
        if broken_at is None and (missing or errs or not present[name]):
            broken_at = i
            missing_next = missing
        if broken_at is None:
            level = i
        elif present[name] and i > broken_at:
            # a higher level without the one below it: the promotion §0x0BI forbids
            below = LEVELS[broken_at - 1]
            if name == "measurement":
                errors.append(f"timing without a passing correctness check ({below} level incomplete)"
                              if broken_at == 3 else f"timing without a complete {below} level")
            else:
                errors.append(f"{name} without a complete {below} level")
    c = row.get("correctness")
    if isinstance(c, Mapping) and c.get("pass") is False:
        failed = True
        if present["measurement"] and row["measurement"].get("samples"):
            errors.append("timing without a passing correctness check (pass = false)")
        if level == 4:
            level = 3
    return RowReport(level, list(dict.fromkeys(errors)), missing_next, failed)


def check_row(row: Mapping, *, min_samples: int = MIN_SAMPLES) -> RowReport:
    """:func:`validate_row`, raising :class:`EvidenceError` on any error."""
    report = validate_row(row, min_samples=min_samples)
    if not report.ok:
        raise EvidenceError(f"benchmark row rejected: {report}")
    return report


# ---------------------------------------------------------------- rows written before this schema
# What attnc's earlier benchmark writers record (backends/triton/bench.py prefill/decode rows,
# bench/plan_cost.py), mapped onto the schema so the validator can say what each lacks.
def schema_gaps(row: Mapping) -> list[str]:
    """Every required field of every level that ``row`` lacks (a level that is absent as a
    whole is named once: ``correctness``, ``measurement``)."""
    gaps = [] if row.get("schema") == SCHEMA else ["schema"]
    gaps += _env_missing(row.get("environment"))
    gaps += _dispatch_problems(row)[0]
    for name, check in (("correctness", _correctness_problems), ("measurement", None)):
        part = row.get(name)
        if not isinstance(part, Mapping):
            gaps.append(name)
        elif check is not None:
            gaps += check(part)[0]
        else:
            gaps += _measurement_problems(part, 0)[0]
    return gaps


def upgrade_legacy(row: Mapping) -> tuple[dict, list[str]]:
    """(the row in the schema as far as its own fields allow, :func:`schema_gaps` of that)."""
    env = dict(row.get("env") or {})
    environment = {n: env.get(n) for n in ("python", "attnc", "torch", "triton", "numpy") if n in env}
    if env.get("gpu"):
        environment.update(device_type="cuda", device_name=env["gpu"])
    elif row.get("bench") == "plan_cost":
        environment["device_type"] = "cpu"  # plan construction runs on the host
    out: dict = {"schema": None, "bench": row.get("bench"), "environment": environment}
    config = row.get("config")
    if row.get("impl") or config is not None:
        out["dispatch"] = {"selected": row.get("impl"), "config": config if isinstance(config, Mapping) else None}
    if "pass" in row or "rel_l2_error" in row or "max_abs_error" in row:
        tol = {"rel_l2": row["tolerance_rel_l2"]} if _is_num(row.get("tolerance_rel_l2")) else None
        out["correctness"] = {k: v for k, v in (("reference", row.get("reference")), ("rel_error", row.get("rel_l2_error")),
                                                ("max_abs_error", row.get("max_abs_error")), ("tolerance", tol),
                                                ("pass", row.get("pass"))) if v is not None}
    samples = row.get("samples_ms")
    if samples is None and row.get("samples_s") is not None:
        samples = [1e3 * s for s in row["samples_s"]]
    if samples is not None or "median_ms" in row:
        out["measurement"] = {"unit": "ms", "samples": samples, "median_ms": row.get("median_ms")}
    return out, schema_gaps(out)


# ---------------------------------------------------------------- comparability (§0x0CE)
COMPARISON_FIELDS = ("environment.device_name", "environment.compute_capability", "environment.torch",
                     "environment.triton", "dispatch.key.operation", "dispatch.key.tensors",
                     "dispatch.key.semantics", "correctness.reference", "measurement.synchronization",
                     "measurement.unit")


def _get(row: Mapping, path: str):
    cur = row
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def comparison_gaps(a: Mapping, b: Mapping, fields=COMPARISON_FIELDS) -> list[str]:
    """The fields that stop rows ``a`` and ``b`` from being compared: unequal, or unknown in
    either (an unknown never equals anything).  Empty: one workload point, two observations."""
    gaps = []
    for f in fields:
        x, y = _get(a, f), _get(b, f)
        if x is None or y is None or canonical_json(x) != canonical_json(y):
            gaps.append(f)
    return gaps


# ---------------------------------------------------------------- estimators (§0x0CB, §0x0CC)
def speedup_from_reduction(reduction: float) -> float:
    """A latency reduction R = 1 - T_cand / T_base is the speedup S = 1 / (1 - R): 69% is 3.226x."""
    if not 0 <= reduction < 1:
        raise ValueError(f"a latency reduction is in [0, 1), got {reduction}")
    return 1.0 / (1.0 - reduction)


def reduction_from_speedup(speedup: float) -> float:
    if speedup <= 0:
        raise ValueError(f"a speedup is positive, got {speedup}")
    return 1.0 - 1.0 / speedup


def _pairs(base: Sequence[float], cand: Sequence[float]) -> list[tuple[float, float]]:
    if len(base) != len(cand) or not base:
        raise ValueError(f"need one candidate latency per baseline case, got {len(base)} and {len(cand)}")
    if any(not (_is_num(x) and x > 0) for x in (*base, *cand)):
        raise ValueError("latencies must be positive numbers")
    return list(zip(base, cand))


def arith_mean_speedup(base: Sequence[float], cand: Sequence[float]) -> float:
    """Every case's ratio weighs the same: mean of b_i / c_i."""
    p = _pairs(base, cand)
    return sum(b / c for b, c in p) / len(p)


def ratio_of_sums(base: Sequence[float], cand: Sequence[float]) -> float:
    """Cases weigh by their latency: sum b_i / sum c_i."""
    p = _pairs(base, cand)
    return sum(b for b, _ in p) / sum(c for _, c in p)


def geo_mean_speedup(base: Sequence[float], cand: Sequence[float]) -> float:
    """Symmetric in ratio space: exp(mean log(b_i / c_i))."""
    p = _pairs(base, cand)
    return math.exp(sum(math.log(b / c) for b, c in p) / len(p))
