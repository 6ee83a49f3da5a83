"""Runtime inputs: validation against the spec, sample values, storage dtypes.

Every backend validates a call with :func:`validate` before any arithmetic, so
a malformed input is an :class:`InputError` naming the key, its shape and the
expected shape — never a numpy broadcasting error or a wrong answer.
:func:`sample` draws the example inputs `attnc run`/`attnc demo` use when the
user gives none (tensor declarations carry ``~ kind(args)``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import ir
from .errors import InputError


@dataclass(frozen=True)
class Call:
    """A validated call: logical bhsd q/k/v in float32 containers plus tensors."""

    q: np.ndarray  # [B, H_q, S_q, d_qk]
    k: np.ndarray  # [B, H_kv, S_k, d_qk]
    v: np.ndarray  # [B, H_kv, S_k, d_v]
    tensors: dict[str, np.ndarray]

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def s_q(self) -> int:
        return self.q.shape[2]

    @property
    def s_k(self) -> int:
        return self.k.shape[2]


# ---------------------------------------------------------------- storage dtypes
def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even), kept in float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values as the spec's storage dtype holds them (f16 as float16, bf16 and f32 as float32)."""
    x = np.asarray(x, np.float32)
    if dtype == "f16":
        return x.astype(np.float16)
    if dtype == "bf16":
        return round_bf16(x)
    return x


# ---------------------------------------------------------------- validation
def _layout(program: ir.Program) -> str:
    return program.cache.layout.value if program.cache.kind is ir.CacheKind.CONTIGUOUS else "bhsd"


def contiguous_variant(program: ir.Program) -> ir.Program:
    """The same attention over a contiguous bhsd cache (for entry points that take q/k/v arrays)."""
    if program.cache.kind is ir.CacheKind.CONTIGUOUS:
        return program
    return replace(program, cache=ir.Cache())


def expected_shapes(program: ir.Program, batch="B", s_q="S_q", s_k="S_k") -> dict[str, list]:
    p = program
    shapes = {
        "q": [batch, f"H_q={p.heads_q}", s_q, f"d_qk={p.d_qk}"],
        "k": [batch, f"H_kv={p.heads_kv}", s_k, f"d_qk={p.d_qk}"],
        "v": [batch, f"H_kv={p.heads_kv}", s_k, f"d_v={p.d_v}"],
    }
    if _layout(p) == "bshd":
        shapes = {n: [s[0], s[2], s[1], s[3]] for n, s in shapes.items()}
    return shapes


def output_bhsd(program: ir.Program, o: np.ndarray) -> np.ndarray:
    """A backend's O (in the spec's layout) as logical bhsd."""
    return np.asarray(o).transpose(0, 2, 1, 3) if _layout(program) == "bshd" else np.asarray(o)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_shapes(program: ir.Program, metas: dict[str, tuple[tuple[int, ...], str, str]]) -> tuple[int, int, int]:
    """Validate keys, ranks, dtype kinds ('f', 'i', 'u', 'b') and shapes of a call given as
    ``name -> (shape, dtype kind, dtype name)`` in the spec's layout; return (B, S_q, S_k)."""
    if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
        raise InputError(f"spec '{program.name}' declares a {program.cache.kind.value} K/V cache; "
                         "this entry point takes contiguous q/k/v arrays only")
    order = ["q", "k", "v", *(t.name for t in program.tensors)]
    missing = [n for n in order if n not in metas]
    if missing:
        raise InputError(f"inputs: missing key '{missing[0]}' (expected keys: {', '.join(sorted(order))})")
    unknown = sorted(set(metas) - set(order))
    if unknown:
        raise InputError(f"inputs: unknown key '{unknown[0]}' (expected keys: {', '.join(sorted(order))})")
    expect = expected_shapes(program)
    bshd = _layout(program) == "bshd"
    logical = {}
    for n in ("q", "k", "v"):
        shape, kind, dtype_name = metas[n]
        if kind != "f":
            raise InputError(f"inputs: '{n}' has dtype {dtype_name}; expected a floating dtype")
        if len(shape) != 4:
            raise InputError(f"inputs: '{n}' has shape {_fmt(shape)} (rank {len(shape)}); "
                             f"expected {_fmt(expect[n])} (rank 4)")
        logical[n] = (shape[0], shape[2], shape[1], shape[3]) if bshd else tuple(shape)
    batch, s_q, s_k = logical["q"][0], logical["q"][2], logical["k"][2]
    want = {
        "q": (batch, program.heads_q, s_q, program.d_qk),
        "k": (batch, program.heads_kv, s_k, program.d_qk),
        "v": (batch, program.heads_kv, s_k, program.d_v),
    }
    for n in ("q", "k", "v"):
        if logical[n] != want[n]:
            raise InputError(f"inputs: '{n}' has shape {_fmt(metas[n][0])}; expected "
                             f"{_fmt(expected_shapes(program, batch, s_q, s_k)[n])}")
    if s_q > s_k:
        raise InputError(f"inputs: 'q' has S_q = {s_q} rows but 'k' has S_k = {s_k} keys; "
                         "S_q <= S_k (query rows are the last S_q positions)")
    if s_q == 0 or s_k == 0 or batch == 0:
        raise InputError(f"inputs: empty call (B = {batch}, S_q = {s_q}, S_k = {s_k})")
    sizes = {"b": batch, "h": program.heads_q, "s": s_k}
    for t in program.tensors:
        shape, kind, dtype_name = metas[t.name]
        want_shape = tuple(sizes[x] if isinstance(x, str) else x for x in t.axes)
        if kind not in {ir.I32: "iu", ir.F32: "f", ir.BOOL: "b"}[t.dtype]:
            raise InputError(f"inputs: tensor '{t.name}' has dtype {dtype_name}; declared {t.signature()}")
        if tuple(shape) != want_shape:
            decl = _fmt([f"{x}={sizes[x]}" if isinstance(x, str) else x for x in t.axes])
            raise InputError(f"inputs: tensor '{t.name}' has shape {_fmt(shape)}; expected {decl} "
                             f"(declared {t.signature()})")
    return batch, s_q, s_k


def validate(program: ir.Program, arrays: dict[str, np.ndarray]) -> Call:
    """Check keys, ranks, dtypes and shapes; return the call in logical bhsd."""
    arrays = {n: np.asarray(a) for n, a in arrays.items()}
    for n, a in arrays.items():
        if a.dtype.kind not in "fiub":
            raise InputError(f"inputs: '{n}' has dtype {a.dtype}")
    check_shapes(program, {n: (a.shape, a.dtype.kind, str(a.dtype)) for n, a in arrays.items()})
    qkv = {n: arrays[n] if _layout(program) == "bhsd" else arrays[n].transpose(0, 2, 1, 3)
           for n in ("q", "k", "v")}
    tensors = {}
    for t in program.tensors:
        a = arrays[t.name]
        if t.dtype is ir.I32:
            if a.size and (a.min() < -2**31 or a.max() >= 2**31):
                raise InputError(f"inputs: tensor '{t.name}' has values outside the i32 range")
            a = a.astype(np.int64)
        elif t.dtype is ir.F32:
            a = a.astype(np.float32)
        tensors[t.name] = a
    return Call(*(qkv[n].astype(np.float32) for n in ("q", "k", "v")), tensors)


# ---------------------------------------------------------------- samples
def _segments(rng, shape, lo, hi):
    out = np.empty(shape, np.int32)
    flat = out.reshape(-1, shape[-1])
    for row in flat:
        pos, doc = 0, 0
        while pos < len(row):
            n = int(rng.integers(max(lo, 1), max(hi, lo, 1) + 1))
            row[pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def _prefix_ends(rng, doc, lo, hi):
    out = np.empty(doc.shape, np.int32)
    for src, dst in zip(doc.reshape(-1, doc.shape[-1]), out.reshape(-1, doc.shape[-1])):
        starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
        ends = np.r_[starts[1:], len(src)]
        for st, en in zip(starts, ends):
            dst[st:en] = st + min(int(rng.integers(max(lo, 1), max(hi, lo, 1) + 1)), en - st)
    return out


def sample(program: ir.Program, batch: int, s_q: int, s_k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Example inputs in the spec's layout: q/k/v ~ N(0, 1) rounded to the storage dtype, and
    every declared tensor drawn from its ``~ kind(args)``."""
    rng = np.random.default_rng(seed)
    p = program
    arrays = {
        "q": rng.standard_normal((batch, p.heads_q, s_q, p.d_qk), np.float32),
        "k": rng.standard_normal((batch, p.heads_kv, s_k, p.d_qk), np.float32),
        "v": rng.standard_normal((batch, p.heads_kv, s_k, p.d_v), np.float32),
    }
    arrays = {n: to_storage(a, p.dtype) for n, a in arrays.items()}
    if _layout(p) == "bshd":
        arrays = {n: np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for n, a in arrays.items()}
    sizes = {"b": batch, "h": p.heads_q, "s": s_k}
    for t in p.tensors:
        shape = tuple(sizes[x] if isinstance(x, str) else x for x in t.axes)
        if t.sample is None:
            raise InputError(f"tensor '{t.name}' ({t.signature()}) has no sample distribution; "
                             "give its value in the inputs file (or declare it with '~ kind(args)')")
        kind, args = t.sample.kind, t.sample.args
        if kind == "segments":
            a = _segments(rng, shape, *args)
        elif kind == "prefix_ends":
            a = _prefix_ends(rng, arrays[args[0]], *args[1:])
        elif kind == "randint":
            a = rng.integers(args[0], args[1], shape).astype(np.int32)
        elif kind == "uniform":
            a = rng.uniform(args[0], args[1], shape).astype(np.float32)
        elif kind == "bernoulli":
            a = rng.random(shape) < args[0]
        elif kind == "const":
            a = np.full(shape, args[0], np.int32 if t.dtype is ir.I32 else np.float32)
        else:  # the checker admits only the kinds above
            raise AssertionError(kind)
        arrays[t.name] = a
    return arrays
