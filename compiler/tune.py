"""Autotuning per dispatch key (DESIGN §6; M4.5 §0x07, §0x0BG-§0x0BH).

For each call shape, ``tune`` freezes the dispatch key (forced to the tuned backend, so an
inadmissible call fails closed with its reasons), walks the backend's declared search space,
checks every candidate against the float64 oracle *before* timing it (a candidate that
fails is recorded and never timed), times the passing ones with synchronized raw samples,
and stores the winner with every raw sample in a JSON cache keyed by the key's digest.

Runtime hooks read that cache: :func:`tuned_config` (by key) and :func:`tuned_tiles` (by
program and call shape) give the tuned launch parameters or ``None``, and
:func:`tuned_split_policy` turns ``split = auto`` into the tuned split count; on a miss
the caller keeps its heuristic.  The cache is a plain JSON document::

    {"format": "attnc-tune", "version": 1,
     "entries": {"<key digest>": {"key": {...}, "backend": "triton", "config": {...},
                                   "samples_ms": [...], "candidates": [...], ...}}}

written atomically (temporary file + ``os.replace``); a corrupt or foreign-version file is
reported and ignored (and set aside as ``FILE.bad`` when the tuner rewrites it).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from . import inputs, ir, numerics
from .dispatch import DispatchKey, Environment, backend as load_backend, select
from .errors import AttncError, InputError

CACHE_FORMAT = "attnc-tune"
CACHE_VERSION = 1
ORACLE_CELLS = 1 << 22  # above this many score cells, the oracle checks a sample of rows

Timer = Callable[[Callable[[], object], int, int], list]  # timer(fn, warmup, repeats) -> samples (ms)


class TuneError(AttncError):
    """Tuning could not run (no admissible backend, no passing candidate, bad --shapes)."""


# ---------------------------------------------------------------- search spaces
@dataclass(frozen=True)
class Space:
    """One backend family's search space: named axes (the product is the candidate set),
    constraints that drop configs with a reason, and the untuned heuristic config, which
    is always candidate 0 so every result is compared with what a miss would run."""

    axes: Mapping[str, tuple]
    heuristic: Callable[[DispatchKey], dict]
    constraints: tuple[Callable[[dict, DispatchKey], str | None], ...] = ()

    def candidates(self, key: DispatchKey) -> list[dict]:
        base = self.heuristic(key)
        out = [base]
        names = list(self.axes)
        for values in itertools.product(*(self.axes[n] for n in names)):
            cfg = dict(zip(names, values))
            if cfg != base and not any(c(cfg, key) for c in self.constraints):
                out.append(cfg)
        return out

    def excluded(self, key: DispatchKey) -> list[tuple[dict, str]]:
        names = list(self.axes)
        out = []
        for values in itertools.product(*(self.axes[n] for n in names)):
            cfg = dict(zip(names, values))
            why = next((w for c in self.constraints if (w := c(cfg, key))), None)
            if why:
                out.append((cfg, why))
        return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tile_fits_rows(cfg, key):
    if "BLOCK_M" in cfg and cfg["BLOCK_M"] > max(16, _pow2_at_least(key.max_s_q)):
        return f"BLOCK_M={cfg['BLOCK_M']} exceeds S_q={key.max_s_q}"
    return None


def _tile_fits_keys(cfg, key):
    if "BLOCK_N" in cfg and cfg["BLOCK_N"] > max(16, _pow2_at_least(max(key.S_k))):
        return f"BLOCK_N={cfg['BLOCK_N']} exceeds S_k={max(key.S_k)}"
    return None


def _tma(cfg, key):
    if not cfg.get("use_tma"):
        return None
    if key.interpreter or key.device_type != "cuda" or (key.compute_capability or 0) < 90:
        return "use_tma needs sm_90+"
    if key.d_qk & (key.d_qk - 1) or key.d_v & (key.d_v - 1):
        return "use_tma needs power-of-two head dims"
    return None


def _shared_memory(cfg, key):
    """K and V tiles per pipeline stage plus the Q tile, in storage bytes, against ~227 KiB (sm_90)."""
    if key.device_type != "cuda" or "BLOCK_N" not in cfg:
        return None
    elem = 4 if key.q_dtype == "f32" else 2
    d_qk, d_v = _pow2_at_least(key.d_qk), _pow2_at_least(key.d_v)
    stages = max(1, cfg.get("num_stages", 2) - 1)
    need = elem * (stages * cfg["BLOCK_N"] * (d_qk + d_v) + cfg.get("BLOCK_M", 16) * d_qk)
    limit = 227 * 1024 if (key.compute_capability or 0) >= 90 else 160 * 1024
    return f"~{need // 1024} KiB of shared memory" if need > limit else None


def _splits_fit(cfg, key):
    if cfg.get("splits") and cfg["splits"] > -(-max(key.S_k) // cfg["BLOCK_N"]):
        return f"splits={cfg['splits']} exceeds the {-(-max(key.S_k) // cfg['BLOCK_N'])} K/V blocks"
    return None


def _triton_prefill_default(key: DispatchKey) -> dict:
    from attnc.backends.triton.runtime import default_prefill_config
    return default_prefill_config(key.d_qk, key.d_v, key.interpreter, key.compute_capability,
                                  key.mask_kind == "tensor")


def _triton_decode_default(key: DispatchKey) -> dict:
    # splits None: the runtime's own occupancy rule picks the split count
    return {"BLOCK_N": 16 if key.interpreter else 64, "splits": None, "num_warps": 4, "num_stages": 2}


def _numpy_default(key: DispatchKey) -> dict:
    from attnc.backends.numpy.emit import BLOCK_M, BLOCK_N
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}


# backend -> family -> Space.  Family: "prefill" (prefill and append share a kernel) or
# "decode"; the Triton interpreter gets tiny spaces of its own (tests, not speed).
SPACES: dict[str, dict[str, Space]] = {
    "triton": {
        "prefill": Space({"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8),
                          "num_stages": (2, 3, 4), "use_tma": (False, True)},
                         _triton_prefill_default, (_tile_fits_rows, _tile_fits_keys, _tma, _shared_memory)),
        # GQA packing (the G query heads of a K/V head in one program) becomes an axis here
        # once the decode kernel takes it as a launch parameter.
        "decode": Space({"BLOCK_N": (32, 64, 128), "splits": (1, 2, 4, 8, 16, 32), "num_warps": (2, 4, 8),
                         "num_stages": (2, 3)},
                        _triton_decode_default, (_tile_fits_keys, _splits_fit, _shared_memory)),
        "interpreter_prefill": Space({"BLOCK_M": (16,), "BLOCK_N": (16, 32), "num_warps": (4,),
                                      "num_stages": (1,), "use_tma": (False,)},
                                     _triton_prefill_default, (_tile_fits_keys,)),
        "interpreter_decode": Space({"BLOCK_N": (16, 32), "splits": (1, 2), "num_warps": (4,),
                                     "num_stages": (1,)}, _triton_decode_default, (_tile_fits_keys, _splits_fit)),
    },
    "numpy": {
        "prefill": Space({"BLOCK_M": (8, 16, 32, 64), "BLOCK_N": (8, 16, 32, 64)}, _numpy_default,
                         (_tile_fits_rows, _tile_fits_keys)),
    },
}


def family_of(backend: str, key: DispatchKey) -> str:
    fam = "decode" if key.phase == "decode" and "decode" in SPACES.get(backend, {}) else "prefill"
    if backend == "triton" and key.interpreter:
        fam = f"interpreter_{fam}"
    return fam


def space_for(backend: str, key: DispatchKey) -> Space:
    if backend not in SPACES:
        raise TuneError(f"no search space is declared for backend '{backend}' "
                        f"(declared: {', '.join(sorted(SPACES))})")
    return SPACES[backend][family_of(backend, key)]


# ---------------------------------------------------------------- timers
def wall_timer(fn: Callable[[], object], warmup: int, repeats: int, sync: Callable[[], None] = lambda: None) -> list:
    """perf_counter around each call, ``sync`` before the clock stops (host code: nothing)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


wall_timer.synchronization = "perf_counter; the call returns host arrays (synchronous)"


def cuda_event_timer(fn: Callable[[], object], warmup: int, repeats: int) -> list:
    """CUDA events on the current stream around each call; each end event synchronized before
    the sample is read (§0x0BH).  The device is synchronized after warmup."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)))
    return samples


cuda_event_timer.synchronization = "torch.cuda.Event per sample, end event synchronized"


def do_bench_timer(fn: Callable[[], object], warmup: int, repeats: int) -> list:
    """triton.testing.do_bench's raw samples (it flushes L2 between samples)."""
    import triton.testing
    return [float(s) for s in triton.testing.do_bench(fn, warmup=warmup, rep=repeats, return_mode="all")]


do_bench_timer.synchronization = "triton.testing.do_bench (CUDA events, L2 flushed), return_mode=all"


# ---------------------------------------------------------------- the cache
def default_cache_path() -> Path:
    if os.environ.get("ATTNC_TUNE_CACHE"):
        return Path(os.environ["ATTNC_TUNE_CACHE"])
    root = os.environ.get("ATTNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnc")
    return Path(root) / "tune.json"


class TuneCache:
    """The JSON tuning cache.  ``problems`` lists what was wrong with the file when it was
    read (corrupt, foreign format or version, a malformed entry); those parts are ignored."""

    def __init__(self, path: str | os.PathLike | None = None, report: Callable[[str], None] | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.entries: dict[str, dict] = {}
        self.problems: list[str] = []
        self._bad = False
        self._load()
        for p in self.problems:
            (report or _stderr)(f"attnc tune: {p}")

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            self.problems.append(f"cannot read tuning cache {self.path}: {e}; ignoring it")
            self._bad = True
            return
        try:
            doc = json.loads(text)
        except ValueError as e:
            self.problems.append(f"tuning cache {self.path} is corrupt ({e}); ignoring it")
            self._bad = True
            return
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            self.problems.append(f"{self.path} is not an attnc tuning cache; ignoring it")
            self._bad = True
            return
        if doc.get("version") != CACHE_VERSION:
            self.problems.append(f"tuning cache {self.path} has version {doc.get('version')!r}; this attnc "
                                 f"reads version {CACHE_VERSION}; ignoring it")
            self._bad = True
            return
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            self.problems.append(f"tuning cache {self.path} has no entries object; ignoring it")
            self._bad = True
            return
        for digest, e in entries.items():
            if not isinstance(e, dict) or not isinstance(e.get("config"), dict) or e.get("digest") != digest:
                self.problems.append(f"tuning cache {self.path}: entry {digest[:12]} is malformed; ignoring it")
                continue
            self.entries[digest] = e

    def get(self, digest: str) -> dict | None:
        return self.entries.get(digest)

    def put(self, entry: dict) -> None:
        self.entries[entry["digest"]] = entry

    def save(self) -> None:
        """Atomic: a reader sees the old file or the new one, never half of either."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._bad and self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            self._bad = False
        doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION,
               "entries": {d: self.entries[d] for d in sorted(self.entries)}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _MEMO.pop(str(self.path), None)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- runtime hooks
_MEMO: dict[str, tuple[float, TuneCache]] = {}


def _cache(cache: TuneCache | str | os.PathLike | None) -> TuneCache | None:
    if isinstance(cache, TuneCache):
        return cache
    path = Path(cache) if cache is not None else default_cache_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _MEMO.get(str(path))
    if hit is None or hit[0] != mtime:
        hit = (mtime, TuneCache(path))
        _MEMO[str(path)] = hit
    return hit[1]


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
    c = _cache(cache)
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
    c = _cache(cache)
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
    then falls back to ``heuristic(0.85)``)."""
    from .analysis import splits
    policy = splits.from_ir(program.split)
    if isinstance(policy, splits.Auto) and key is not None:
        cfg = tuned_config(key, key.backend_request if key.backend_request != "auto" else "triton", cache)
        if cfg and cfg.get("splits"):
            return splits.balanced(int(cfg["splits"]))
    return policy


# ---------------------------------------------------------------- shapes
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


# ---------------------------------------------------------------- correctness
@dataclass
class Reference:
    """The oracle's answer and how to cut the candidate's output down to what it covers."""

    o: np.ndarray
    lse: np.ndarray
    take: Callable[[np.ndarray, np.ndarray], tuple]
    description: str


def _slice_tensors(program: ir.Program, tensors: dict, b: slice) -> dict:
    out = {}
    for t in program.tensors:
        idx = tuple(b if ax == "b" else slice(None) for ax in t.axes)
        out[t.name] = tensors[t.name][idx]
    return out


def reference_for(program: ir.Program, call: inputs.Call, max_cells: int = ORACLE_CELLS) -> Reference:
    """The float64 oracle on a contiguous call: every cell when it is small, else the last
    rows of request 0 (bottom-right positions keep their absolute q when leading rows drop)."""
    from attnc.compiler import oracle
    batch, heads, s_q, s_k = call.batch, program.heads_q, call.s_q, call.s_k
    if batch * heads * s_q * s_k <= max_cells:
        o, lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
        return Reference(o, lse, lambda o, lse: (o, lse), "float64 oracle, every cell")
    rows = max(1, min(s_q, max_cells // (heads * s_k)))
    b = slice(0, 1)
    o, lse = oracle.reference(program, call.q[b, :, s_q - rows:], call.k[b], call.v[b],
                              _slice_tensors(program, call.tensors, b))
    return Reference(o, lse, lambda o, lse: (o[b, :, s_q - rows:], lse[b, :, s_q - rows:]),
                     f"float64 oracle on request 0, query rows [{s_q - rows}, {s_q}) of {s_q}")


def check_against(program: ir.Program, ref: Reference, o: np.ndarray, lse: np.ndarray):
    o, lse = ref.take(np.asarray(o), np.asarray(lse))
    return numerics.compare_outputs(program.dtype, o, lse, ref.o, ref.lse)


# ---------------------------------------------------------------- runners
class _Runner:
    """Samples the shape's inputs and the oracle's answer once; ``prepare(cfg)`` builds one
    candidate's plan and device arguments outside the timed region and returns a
    zero-argument launch plus a converter of its result to host ``(o, lse)``."""

    synchronization = wall_timer.synchronization
    excluded = ("plan construction", "input upload")

    def default_timer(self) -> Timer:
        return wall_timer


class _NumpyRunner(_Runner):
    def __init__(self, program: ir.Program, shape: Shape, key: DispatchKey, seed: int, max_cells: int):
        if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
            raise TuneError(f"the numpy search space tiles the contiguous program; spec '{program.name}' "
                            f"declares a {program.cache.kind.value} cache")
        self.program = program
        self.arrays = inputs.sample(program, shape.batch, shape.s_q, shape.s_k, seed)
        self.call = inputs.validate(program, self.arrays)
        self.reference = reference_for(program, self.call, max_cells)
        self.kernel = load_backend("numpy").load(program)
        self.tensors = {t.name: self.arrays[t.name] for t in program.tensors}

    def prepare(self, cfg: dict):
        c, a = self.call, self.arrays
        plan = self.kernel.plan(c.batch, c.s_q, c.s_k, c.tensors, cfg["BLOCK_M"], cfg["BLOCK_N"])

        def launch():
            return self.kernel(a["q"], a["k"], a["v"], plan=plan, return_lse=True, **self.tensors)

        def host(result):
            o, lse = result
            return inputs.output_bhsd(self.program, o), np.asarray(lse)
        return launch, host


class _TritonRunner(_Runner):
    """Prefill/append: the tile-plan kernel on contiguous q/k/v.  Decode: the split-K/V kernel
    over the spec's own cache (paged pages handed out shuffled, tails poisoned with NaN)."""

    def __init__(self, program: ir.Program, shape: Shape, key: DispatchKey, seed: int, max_cells: int):
        import torch
        from attnc.backends.triton import runtime
        self.torch, self.program = torch, program
        self.kernel = runtime.load(program)
        self.device = self.kernel.device
        self.dtype = getattr(torch, runtime.TORCH_DTYPES[program.dtype])
        # the interpreter reads bf16 as garbage: carry bf16-rounded values in float32, as the runtime does
        self.emulate = runtime.interpreted() and self.dtype == torch.bfloat16
        self.carry = torch.float32 if self.emulate else self.dtype
        self.decode = family_of("triton", key).endswith("decode")
        if self.device == "cuda":
            self.synchronization = cuda_event_timer.synchronization
        if self.decode:
            self._init_decode(shape, seed)
        else:
            self._init_prefill(shape, seed, max_cells)

    def default_timer(self) -> Timer:
        return cuda_event_timer if self.device == "cuda" else wall_timer

    def _upload(self, a: np.ndarray):
        t = self.torch.as_tensor(np.ascontiguousarray(a), device=self.device)
        if a.dtype.kind == "f":
            return t.to(self.dtype).to(self.carry)
        return t.to(self.torch.int32) if a.dtype.kind in "iu" else t

    def _host(self, o, lse):
        if self.emulate:
            o = o.to(self.torch.bfloat16)
        return o.float().cpu().numpy(), lse.float().cpu().numpy()

    def prepare(self, cfg: dict):
        return self._prepare_decode(cfg) if self.decode else self._prepare_prefill(cfg)

    # -- prefill / append
    def _init_prefill(self, shape: Shape, seed: int, max_cells: int):
        program = self.program
        arrays = inputs.sample(program, shape.batch, shape.s_q, shape.s_k, seed)
        self.call = call = inputs.validate(program, arrays)
        self.reference = reference_for(program, call, max_cells)
        self.bshd = program.cache.layout is ir.Layout.BSHD
        # logical bhsd views over storage in the spec's layout, as the runtime passes them
        if self.bshd:
            self.q, self.k, self.v = (self._upload(x.transpose(0, 2, 1, 3)).transpose(1, 2)
                                      for x in (call.q, call.k, call.v))
        else:
            self.q, self.k, self.v = (self._upload(x) for x in (call.q, call.k, call.v))
        self.tensors = {n: self._upload(t) for n, t in call.tensors.items()}

    def _prepare_prefill(self, cfg):
        torch, c, p = self.torch, self.call, self.program
        plan = self.kernel.plan(c.batch, c.s_q, c.s_k, c.tensors, cfg["BLOCK_M"], cfg["BLOCK_N"])
        args = self.kernel.device_plan(plan, self.q.device)
        extra = {"use_tma": True} if cfg.get("use_tma") else {}  # older launchers lack the argument
        if hasattr(self.kernel.module, "gluon_reason"):  # the configs are the Triton kernel's
            extra["engine"] = "triton"

        def launch():
            out = None
            if self.bshd:
                out = torch.empty(c.batch, c.s_q, p.heads_q, p.d_v, device=self.q.device,
                                  dtype=self.q.dtype).transpose(1, 2)
            return self.kernel.module.attention(self.q, self.k, self.v, args, out=out, num_warps=cfg["num_warps"],
                                                num_stages=cfg["num_stages"], **extra, **self.tensors)

        return launch, lambda r: self._host(*r)

    # -- decode
    def _init_decode(self, shape: Shape, seed: int):
        from attnc.compiler import oracle
        if not hasattr(self.kernel, "decode_plan"):
            raise TuneError("this Triton backend has no split-K/V decode kernel to tune")
        program = self.program
        arrays = inputs.sample_cache(program, [shape.s_k] * shape.batch, [1] * shape.batch, seed)
        call = inputs.validate_cache(program, arrays)
        o, lse = oracle.reference_cache(program, call)
        self.reference = Reference(o, lse, lambda o, lse: (o, lse), "float64 oracle per request, every cell")
        names = {t.name for t in program.tensors}
        self.q = self._upload(arrays["q"])
        self.cache = {n: self._upload(a) for n, a in arrays.items() if n not in names and n not in ("q", "q_lens")}
        self.tensors = {n: self._upload(arrays[n]) for n in names}

    def _prepare_decode(self, cfg):
        plan = self.kernel.decode_plan(self.cache, block_n=cfg["BLOCK_N"], splits=cfg.get("splits"),
                                       tensors=self.tensors)
        launch_args = self.kernel.decode_args(plan, self.q.device)  # uploaded once, launched per sample
        k = self.cache.get("k_cache", self.cache.get("k"))
        v = self.cache.get("v_cache", self.cache.get("v"))

        def launch():
            return self.kernel.module.decode(self.q, k, v, launch_args, num_warps=cfg["num_warps"],
                                             num_stages=cfg["num_stages"], **self.tensors)

        return launch, lambda r: self._host(*r)


RUNNERS = {"numpy": _NumpyRunner, "triton": _TritonRunner}


# ---------------------------------------------------------------- tuning
@dataclass
class TuneResult:
    shape: Shape
    key: DispatchKey
    entry: dict
    cached: bool = False
    rows: list = field(default_factory=list)  # evidence rows, one per candidate

    @property
    def config(self) -> dict:
        return self.entry["config"]


def _median(samples) -> float:
    return float(np.median(samples)) if len(samples) else math.nan


def tune(program: ir.Program, shapes: Sequence[Shape], backend: str = "triton", *,
         cache: TuneCache | str | os.PathLike | None = None, timer: Timer | None = None,
         warmup: int = 5, repeats: int = 20, seed: int = 0, env: Environment | None = None,
         progress: Callable[[str], None] | None = None, retune: bool = False,
         space: Space | None = None, max_cells: int = ORACLE_CELLS, evidence: bool = True) -> list[TuneResult]:
    """Tune ``program`` on ``backend`` for each shape; store the winners in ``cache`` and
    return one :class:`TuneResult` per shape (``cached`` when the cache already had it and
    ``retune`` is false)."""
    from . import evidence as ev
    progress = progress or _stderr
    store = cache if isinstance(cache, TuneCache) else TuneCache(cache, report=progress)
    env = env or Environment.detect()
    env_record = ev.environment_record(env)
    results = []
    for si, shape in enumerate(shapes, 1):
        key = DispatchKey.from_call(program, {"B": shape.batch, "S_q": shape.s_q, "S_k": shape.s_k,
                                              "backend_request": backend}, env)
        sel = select(key)
        if sel.selected is None:  # forced: fails closed with every reason
            raise TuneError(f"shape {shape}: {sel.error}")
        head = f"[{si}/{len(shapes)}] B={shape.batch} S_q={shape.s_q} S_k={shape.s_k} key {key.digest[:12]}"
        old = store.get(key.digest)
        if old is not None and not retune:
            progress(f"{head}: cached ({_fmt_cfg(old['config'])}, median {old['median_ms']:.4g} ms)")
            results.append(TuneResult(shape, key, old, cached=True))
            continue
        sp = space or space_for(backend, key)
        cands = sp.candidates(key)
        progress(f"{head}: {len(cands)} candidates on {backend} ({family_of(backend, key)})")
        if backend not in RUNNERS:
            raise TuneError(f"no tuning runner for backend '{backend}' (runners: {', '.join(sorted(RUNNERS))})")
        runner = RUNNERS[backend](program, shape, key, seed, max_cells)
        ref = runner.reference
        clock = timer or runner.default_timer()
        sync_desc = getattr(clock, "synchronization", getattr(clock, "__name__", "injected timer"))
        warm = {"iterations": warmup, "per_candidate": True, "first_call_untimed": True}
        records, rows = [], []
        for ci, cfg in enumerate(cands):
            label = f"  {ci + 1}/{len(cands)} {_fmt_cfg(cfg)}{' (untuned)' if ci == 0 else ''}"
            rec = {"config": cfg, "untuned": ci == 0}
            try:
                launch, host = runner.prepare(cfg)
                o, lse = host(launch())  # also compiles: never inside the timed region
                comps = check_against(program, ref, o, lse)
            except TuneError:
                raise
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a result)
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[-300:]}")
                records.append(rec)
                progress(f"{label}: error {rec['error'][:120]}")
                continue
            correctness = ev.correctness_record(ref.description, comps)
            rec["correctness"] = correctness
            if not correctness["pass"]:
                rec["status"] = "failed"
                records.append(rec)
                rows.append(ev.make_row(environment=env_record, key=key, selected=backend, config=cfg,
                                        correctness=correctness, bench="tune"))
                progress(f"{label}: FAILED correctness ({'; '.join(str(c) for c in comps)}); not timed")
                continue
            samples = [float(s) for s in clock(launch, warmup, repeats)]
            rec.update(status="timed", samples_ms=samples, median_ms=_median(samples))
            records.append(rec)
            rows.append(ev.make_row(environment=env_record, key=key, selected=backend, config=cfg,
                                    correctness=correctness, samples_ms=samples, warmup=warm,
                                    synchronization=sync_desc, excluded=runner.excluded, bench="tune"))
            progress(f"{label}: ok (max |err| {comps[0].max_abs_error:.1e}), median {rec['median_ms']:.4g} ms "
                     f"over {len(samples)} samples")
        timed = [r for r in records if r.get("status") == "timed" and r["samples_ms"]]
        if not timed:
            raise TuneError(f"shape {shape}: no candidate passed the correctness check; see the progress log")
        win = min(timed, key=lambda r: r["median_ms"])
        base = records[0]
        entry = {"digest": key.digest, "key": key.to_json(), "backend": backend, "family": family_of(backend, key),
                 "config": win["config"], "median_ms": win["median_ms"], "samples_ms": win["samples_ms"],
                 "correctness": win["correctness"], "untuned": {"config": base["config"],
                                                               "median_ms": base.get("median_ms"),
                                                               "status": base.get("status")},
                 "speedup_vs_untuned": (base["median_ms"] / win["median_ms"]) if base.get("status") == "timed" else None,
                 "warmup": warm, "synchronization": sync_desc, "excluded": list(runner.excluded),
                 "environment": env_record, "shape": str(shape), "spec": program.name, "seed": seed,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "candidates": records}
        store.put(entry)
        store.save()
        sp_txt = f", {entry['speedup_vs_untuned']:.2f}x vs untuned" if entry["speedup_vs_untuned"] else ""
        progress(f"{head}: winner {_fmt_cfg(win['config'])} median {win['median_ms']:.4g} ms{sp_txt}")
        results.append(TuneResult(shape, key, entry, rows=rows if evidence else []))
    return results


def _fmt_cfg(cfg: Mapping) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())
