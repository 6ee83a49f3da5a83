"""Runtime inputs: validation against the spec, sample values, storage dtypes.

Every backend validates a call with :func:`validate` before any arithmetic, so
a malformed input is an :class:`InputError` naming the key, its shape and the
expected shape — never a numpy broadcasting error or a wrong answer.
:func:`sample` draws the example inputs `attnc run`/`attnc demo` use when the
user gives none (tensor declarations carry ``~ kind(args)``).
"""
from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass, replace

import numpy as np

from . import ir, resources
from .errors import InputError, PlanError


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


# ---------------------------------------------------------------- input files
_NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (np.savez), an empty one
_NPY_MAGIC = b"\x93NUMPY"
# what numpy, zipfile and zlib raise on a damaged file
_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def _file_kind(path: str, what: str) -> str:
    """'npz' or 'npy' from the file's first bytes; an InputError for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not head:
        raise InputError(f"{what} {path} is empty")
    if head.startswith(_NPZ_MAGIC):
        return "npz"
    if head.startswith(_NPY_MAGIC):
        return "npy"
    raise InputError(f"{what} {path} is neither a numpy .npz archive nor a .npy array "
                     f"(it starts with {head!r})")


def load_npz(path: str) -> dict[str, np.ndarray]:
    """The named arrays of an ``.npz`` inputs file (``np.savez``); an InputError naming the
    file for anything else (an empty file, a ``.npy`` array, a damaged archive, pickled objects)."""
    what = "inputs file"
    if _file_kind(path, what) == "npy":
        raise InputError(f"{what} {path} is a single .npy array; --inputs takes an .npz archive of named "
                         "arrays (q, k, v and every declared tensor): np.savez(path, q=q, k=k, v=v, ...)")
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: np.asarray(f[k]) for k in f.files}
    except _READ_ERRORS as e:
        raise InputError(f"{what} {path} is damaged or not readable: {type(e).__name__}: {e}") from None


def load_npy(path: str, what: str) -> np.ndarray:
    """The array of a ``.npy`` file; an InputError naming ``what`` and the file otherwise."""
    if _file_kind(path, what) == "npz":
        raise InputError(f"{what} {path} is an .npz archive; it takes one .npy array (np.save)")
    try:
        return np.asarray(np.load(path, allow_pickle=False))
    except _READ_ERRORS as e:
        raise InputError(f"{what} {path} is damaged or not readable: {type(e).__name__}: {e}") from None


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
    resources.check_length("S_k", s_k)
    if s_q > s_k:
        raise InputError(f"inputs: 'q' has S_q = {s_q} rows but 'k' has S_k = {s_k} keys; "
                         "S_q <= S_k (query rows are the last S_q positions)")
    if s_q == 0 or s_k == 0 or batch == 0:
        raise InputError(f"inputs: empty call (B = {batch}, S_q = {s_q}, S_k = {s_k})")
    _check_tensors(program, metas, {"b": batch, "h": program.heads_q, "s": s_k})
    return batch, s_q, s_k


def _check_tensors(program: ir.Program, metas, sizes: dict[str, int]) -> None:
    for t in program.tensors:
        shape, kind, dtype_name = metas[t.name]
        want_shape = tuple(sizes[x] if isinstance(x, str) else x for x in t.axes)
        if kind not in {ir.I32: "iu", ir.F32: "f", ir.BOOL: "b"}[t.dtype]:
            raise InputError(f"inputs: tensor '{t.name}' has dtype {dtype_name}; declared {t.signature()}")
        if tuple(shape) != want_shape:
            decl = _fmt([f"{x}={sizes[x]}" if isinstance(x, str) else x for x in t.axes])
            raise InputError(f"inputs: tensor '{t.name}' has shape {_fmt(shape)}; expected {decl} "
                             f"(declared {t.signature()})")


def check_i32_values(name: str, a) -> None:
    """Refuse an integer tensor declared i32 whose values leave i32 (an int64 document id past
    2**31 would otherwise wrap where a backend reads it as int32): every backend's check."""
    a = np.asarray(a)
    if a.dtype.kind in "iu" and a.size and a.dtype.itemsize >= 4 and (a.min() < -2**31 or a.max() >= 2**31):
        raise InputError(f"inputs: tensor '{name}' has values outside the i32 range")


def _convert_tensors(program: ir.Program, arrays, float_dtype=np.float32) -> dict[str, np.ndarray]:
    tensors = {}
    for t in program.tensors:
        a = arrays[t.name]
        if t.dtype is ir.I32:
            check_i32_values(t.name, a)
            a = a.astype(np.int64)
        elif t.dtype is ir.F32:
            a = a.astype(float_dtype)
        tensors[t.name] = a
    return tensors


def check_flashmask(program: ir.Program, tensors: dict) -> None:
    """The values of every tensor ``flashmask(tensor, causal)`` reads keep Paddle's
    ``startend_row_indices`` contract (its docstring; the generators of
    flashmask/tests/generate_startend_row_indices.py), over ``S`` rows = the tensor's ``s`` axis:
    every bound >= 0; a range's end (LTE, UTE) <= S and >= its start (LTS <= LTE, UTS <= UTE);
    the hidden upper rows end where the lower ones start or before (UTE <= LTS, where both are
    non-empty).  An open tail's start (LTS without LTE) may exceed S: it hides nothing.  A
    PlanError names the tensor, the index and the values."""
    for c in program.flashmask:
        if c.tensor not in tensors:
            continue  # (a missing tensor is the caller's error to name)
        a = np.asarray(tensors[c.tensor]).astype(np.int64, copy=False)
        if not a.size:
            continue
        s = a.shape[2]
        col = {n: a[..., j] for j, n in enumerate(c.columns)}
        where = {n: j for j, n in enumerate(c.columns)}

        def refuse(bad: np.ndarray, why) -> None:
            if bad.any():
                idx = tuple(int(x) for x in np.argwhere(bad)[0])
                at = lambda n: f"{c.tensor}[{', '.join(map(str, idx))}, {where[n]}] = {int(col[n][idx])}"  # noqa: E731
                raise PlanError(f"flashmask({c.tensor}, {'true' if c.causal else 'false'}): {why(at)} "
                                f"(Paddle's startend_row_indices [{', '.join(c.columns)}]; S = {s} rows)")

        for n in c.columns:
            refuse(col[n] < 0, lambda at, n=n: f"{at(n)}: {n} is negative; bounds are row indices in [0, S]")
        for start, end in (("LTS", "LTE"), ("UTS", "UTE")):
            if end in col:
                refuse(col[end] > s, lambda at, end=end: f"{at(end)}: {end} exceeds S = {s}")
                if start in col:
                    refuse(col[start] > col[end], lambda at, start=start, end=end:
                           f"{at(start)} > {at(end)}: {start} > {end} (the hidden rows [{start}, {end}) are reversed)")
        if not c.causal:  # the upper range [UTS or 0, UTE) ends before the lower [LTS, LTE or S) starts
            upper = col["UTE"] > col.get("UTS", 0)
            lower = col["LTS"] < col.get("LTE", s)
            refuse(upper & lower & (col["UTE"] > col["LTS"]), lambda at:
                   f"{at('UTE')} > {at('LTS')}: the hidden upper rows end after the hidden lower rows start "
                   "(UTE > LTS: the ranges overlap)")


def validate_tensors(program: ir.Program, arrays: dict, batch: int, s_k: int) -> dict[str, np.ndarray]:
    """The declared tensors of a call of ``batch`` requests over ``s_k`` keys, without q/k/v:
    keys, dtypes and shapes checked and values converted as :func:`validate` does them."""
    arrays = {n: np.asarray(a) for n, a in arrays.items()}
    names = [t.name for t in program.tensors]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise InputError(f"inputs: missing tensor '{missing[0]}'")
    _check_tensors(program, {n: (arrays[n].shape, arrays[n].dtype.kind, str(arrays[n].dtype)) for n in names},
                   {"b": batch, "h": program.heads_q, "s": s_k})
    tensors = _convert_tensors(program, arrays)
    check_flashmask(program, tensors)
    return tensors


def validate(program: ir.Program, arrays: dict[str, np.ndarray], float_dtype=np.float32) -> Call:
    """Check keys, ranks, dtypes and shapes; return the call in logical bhsd (q, k, v and f32
    tensors as ``float_dtype``: float64 for the float64 references)."""
    arrays = {n: np.asarray(a) for n, a in arrays.items()}
    for n, a in arrays.items():
        if a.dtype.kind not in "fiub":
            raise InputError(f"inputs: '{n}' has dtype {a.dtype}")
    check_shapes(program, {n: (a.shape, a.dtype.kind, str(a.dtype)) for n, a in arrays.items()})
    qkv = {n: arrays[n] if _layout(program) == "bhsd" else arrays[n].transpose(0, 2, 1, 3)
           for n in ("q", "k", "v")}
    tensors = _convert_tensors(program, arrays, float_dtype)
    check_flashmask(program, tensors)
    # the values the kernels compute with: the inputs rounded to the storage dtype (a float32 array
    # for a bf16 spec is held as bf16, as every backend stores it); a float64 call (the backward
    # reference, gradcheck) keeps its values: it is not a storage-dtype call
    if np.dtype(float_dtype) == np.float64:
        return Call(*(qkv[n].astype(np.float64) for n in ("q", "k", "v")), tensors)
    return Call(*(to_storage(qkv[n], program.dtype).astype(np.float32) for n in ("q", "k", "v")), tensors)


# ---------------------------------------------------------------- backward calls
SAVED_KEYS = ("o", "lse", "do")


def contiguous_only(program: ir.Program, keys=()) -> None:
    """The backward pass takes contiguous calls: one S_q and S_k for the whole batch."""
    if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
        raise InputError(f"spec '{program.name}' declares a {program.cache.kind.value} K/V cache; the backward "
                         "pass takes contiguous calls (q, k, v arrays with one S_q and S_k for the batch): "
                         "train with a contiguous variant of the spec (cache = contiguous)")
    split = [n for n in SPLIT_KEYS if n in keys]
    if split:
        raise InputError(f"inputs: '{split[0]}' describes a split call; the backward pass takes contiguous "
                         "calls (q, k, v arrays with one S_q and S_k for the batch)")


def validate_backward(program: ir.Program, arrays: dict[str, np.ndarray]) -> tuple[Call, dict[str, np.ndarray]]:
    """Check a backward call: the forward's keys (q, k, v, tensors, as :func:`validate`, kept in
    float64) plus the saved outputs ``o`` (q's layout, head dim d_v) and ``lse [B, H_q, S_q]``
    (natural log, -inf on rows with no visible key) and the incoming gradient ``do`` (o's
    shape).  Returns the call and ``{"o", "lse", "do"}`` as float64 arrays in the spec's layout."""
    contiguous_only(program, arrays)
    call = validate(program, {n: a for n, a in arrays.items() if n not in SAVED_KEYS}, np.float64)
    logical = (call.batch, program.heads_q, call.s_q, program.d_v)
    want = {"o": logical, "do": logical, "lse": logical[:3]}
    named = {"o": ["B", f"H_q={program.heads_q}", "S_q", f"d_v={program.d_v}"]}
    if _layout(program) == "bshd":
        want["o"] = want["do"] = (logical[0], logical[2], logical[1], logical[3])
        named["o"] = [named["o"][i] for i in (0, 2, 1, 3)]
    named.update(do=named["o"], lse=["B", f"H_q={program.heads_q}", "S_q"])
    saved = {}
    for n in SAVED_KEYS:
        if n not in arrays:
            raise InputError(f"inputs: missing key '{n}' (a backward call takes q, k, v, o, lse, do and the "
                             "declared tensors)")
        a = np.asarray(arrays[n])
        if a.dtype.kind != "f":
            raise InputError(f"inputs: '{n}' has dtype {a.dtype}; expected a floating dtype")
        if a.shape != want[n]:
            raise InputError(f"inputs: '{n}' has shape {_fmt(a.shape)}; expected {_fmt(named[n])} = "
                             f"{_fmt(want[n])} for this call")
        saved[n] = a.astype(np.float64)
    bad = np.isnan(saved["lse"]) | np.isposinf(saved["lse"])
    if bad.any():
        where = tuple(int(x[0]) for x in np.nonzero(bad))
        raise InputError(f"inputs: 'lse' is {saved['lse'][where]} at [b, h, i] = {list(where)}; the saved LSE "
                         "is finite, or -inf on a row with no visible key")
    return call, saved


# ---------------------------------------------------------------- K/V caches (split calls)
# DESIGN §5: the keys of a call over a ragged or paged cache, or over a contiguous cache with
# per-request lengths.  The query is packed, ``q [total_q, H_q, d_qk]``: request b owns rows
# qo_indptr[b]:qo_indptr[b+1] (from ``q_lens`` or ``qo_indptr``; one row each by default).
SPLIT_KEYS = ("kv_lens", "cache_batch_idx", "q_lens", "qo_indptr")
ROW_KEYS = ("q_lens", "qo_indptr")


def cache_keys(program: ir.Program) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) input keys of a split call of ``program``, besides its tensors."""
    c = program.cache
    if c.kind is ir.CacheKind.CONTIGUOUS:
        return ("q", "k", "v"), ("kv_lens", "cache_batch_idx", *ROW_KEYS)
    if c.kind is ir.CacheKind.RAGGED:  # kv_lens: each region's visible rows (default: all of it)
        return ("q", "k", "v", "kv_indptr"), ("kv_lens", *ROW_KEYS)
    if (c.table or "dense") == "csr":
        return ("q", "k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_last_page_len"), ROW_KEYS
    return ("q", "k_cache", "v_cache", "block_table", "kv_lens"), ("cache_batch_idx", *ROW_KEYS)


def is_split_call(program: ir.Program, keys) -> bool:
    """Whether a call with these input keys runs as a split call: always over a ragged or paged
    cache; over a contiguous one when it names per-request lengths or packed query rows."""
    return program.cache.kind is not ir.CacheKind.CONTIGUOUS or any(k in keys for k in SPLIT_KEYS)


def cache_description(program: ir.Program) -> str:
    c = program.cache
    if c.kind is ir.CacheKind.PAGED:
        return f"paged {c.layout.value} cache (page_size {c.page_size}, {c.table or 'dense'} table)"
    if c.kind is ir.CacheKind.RAGGED:
        return "ragged cache"
    return f"contiguous {c.layout.value} cache"


def storage_shapes(program: ir.Program) -> dict[str, list]:
    """The K/V storage shapes of the spec's cache (symbolic where the call decides)."""
    p, c = program, program.cache
    hk, dk, dv = f"H_kv={p.heads_kv}", f"d_qk={p.d_qk}", f"d_v={p.d_v}"
    if c.kind is ir.CacheKind.CONTIGUOUS:
        lead = (["B_c", "T_c", hk] if c.layout is ir.Layout.BSHD else ["B_c", hk, "T_c"])
        return {"k": lead + [dk], "v": lead + [dv]}
    if c.kind is ir.CacheKind.RAGGED:
        return {"k": ["total", hk, dk], "v": ["total", hk, dv]}
    page = f"page_size={c.page_size}"
    lead = ["pages", page, hk] if c.layout is ir.Layout.NHD else ["pages", hk, page]
    return {"k_cache": lead + [dk], "v_cache": lead + [dv]}


@dataclass(frozen=True)
class CacheCall:
    """A validated split call: the K/V layout (metadata checked by
    compiler.analysis.layout), the packed query, the storage tensors and the per-request
    query rows.  Arrays are float32 containers holding storage-dtype values."""

    layout: object               # compiler.analysis.layout.KVLayout
    q: np.ndarray                # [total_q, H_q, d_qk]
    k: np.ndarray                # K storage, the layout's tensor_shape('k')
    v: np.ndarray                # V storage
    q_lens: np.ndarray           # int64 [B]
    qo_indptr: np.ndarray        # int64 [B + 1]
    tensors: dict[str, np.ndarray]

    @property
    def batch(self) -> int:
        return int(self.q_lens.size)

    @property
    def kv_lens(self) -> np.ndarray:
        return self.layout.kv_lens

    @property
    def s_k(self) -> int:
        """The size of a declared tensor's ``s`` axis: the longest request's K/V length."""
        return int(self.kv_lens.max(initial=0))

    def storage(self) -> dict[str, np.ndarray]:
        keys = self.layout.array_keys
        return {keys[0]: self.k, keys[1]: self.v}

    def kv(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Request b's logical K [T_b, H_kv, d_qk] and V [T_b, H_kv, d_v] (visible rows only)."""
        from .analysis.layout import gather_kv
        return gather_kv(self.layout, self.storage(), b)

    def q_rows(self, b: int) -> np.ndarray:
        """Request b's query rows [C_b, H_q, d_qk], at positions kv_lens[b] - C_b + i."""
        return self.q[self.qo_indptr[b]:self.qo_indptr[b + 1]]


def query_rows(arrays, batch: int, total_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_lens, qo_indptr) from the keys that name them, checked against q's packed rows."""
    from .analysis.layout import _check_indptr, _ints
    from .errors import PlanError
    q_lens = qo = None
    if "q_lens" in arrays:
        q_lens = _ints("q_lens", arrays["q_lens"], 1)
        if q_lens.size != batch:
            raise InputError(f"inputs: 'q_lens' has {q_lens.size} entries; the cache holds B = {batch} requests")
        neg = np.flatnonzero(q_lens < 0)
        if len(neg):
            raise PlanError(f"q_lens[{neg[0]}] = {int(q_lens[neg[0]])} is negative")
    if "qo_indptr" in arrays:
        qo = _ints("qo_indptr", arrays["qo_indptr"], 1)
        if qo.size != batch + 1:
            raise InputError(f"inputs: 'qo_indptr' has {qo.size} entries; expected B + 1 = {batch + 1}")
        _check_indptr("qo_indptr", qo, total_q, "the packed query rows (q.shape[0])")
        if q_lens is not None and not np.array_equal(np.diff(qo), q_lens):
            b = int(np.flatnonzero(np.diff(qo) != q_lens)[0])
            raise InputError(f"inputs: q_lens[{b}] = {int(q_lens[b])} disagrees with qo_indptr "
                             f"(qo_indptr[{b + 1}] - qo_indptr[{b}] = {int(qo[b + 1] - qo[b])})")
        q_lens = np.diff(qo)
    if q_lens is None:
        if total_q != batch:
            raise InputError(f"inputs: 'q' has {total_q} packed rows for B = {batch} requests; give "
                             "'q_lens' or 'qo_indptr' when a request has other than one query row")
        q_lens = np.ones(batch, np.int64)
    if int(q_lens.sum()) != total_q:
        raise InputError(f"inputs: 'q' has {total_q} packed rows but q_lens sums to {int(q_lens.sum())}")
    out = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return q_lens.astype(np.int64), out


def short_request(b: int, q_lens, kv_lens) -> InputError:
    """The error for request ``b`` with more query rows than keys (every backend's words).  A
    request with no keys at all may have rows (a decode step over an empty context, M4.5
    §0x03G's capacity tail): they see nothing, O = 0 and LSE = -inf."""
    return InputError(f"inputs: request {b} has q_lens[{b}] = {int(q_lens[b])} query rows but only "
                      f"kv_len = {int(kv_lens[b])} keys; a query row is a token whose own key is in the "
                      "cache, so kv_len >= q_len (only a request with no keys at all may have rows: "
                      "they see nothing)")


def validate_cache(program: ir.Program, arrays: dict[str, np.ndarray]) -> CacheCall:
    """Check a split call's keys, dtypes, shapes and cache metadata (DESIGN §5); every
    contract break is an InputError or a PlanError naming the key, the index and the value."""
    from .analysis import layout as lay
    from .analysis.ledger import dtype_bytes
    arrays = {n: np.asarray(a) for n, a in arrays.items()}
    p = program
    required, optional = cache_keys(p)
    names = [t.name for t in p.tensors]
    expected = ", ".join(sorted([*required, *names])) + (f" (optional: {', '.join(optional)})" if optional else "")
    for n in [*required, *names]:
        if n not in arrays:
            raise InputError(f"inputs: missing key '{n}' for a {cache_description(p)} "
                             f"(expected keys: {expected})")
    unknown = sorted(set(arrays) - {*required, *optional, *names})
    if unknown:
        raise InputError(f"inputs: unknown key '{unknown[0]}' for a {cache_description(p)} "
                         f"(expected keys: {expected})")
    kv_keys = [n for n in required if n in ("k", "v", "k_cache", "v_cache")]
    shapes = storage_shapes(p)
    for n in ["q", *kv_keys]:
        a = arrays[n]
        if a.dtype.kind != "f":
            raise InputError(f"inputs: '{n}' has dtype {a.dtype}; expected a floating dtype")
    q = arrays["q"]
    want_q = ["total_q", f"H_q={p.heads_q}", f"d_qk={p.d_qk}"]
    if q.ndim != 3 or q.shape[1:] != (p.heads_q, p.d_qk):
        raise InputError(f"inputs: 'q' has shape {_fmt(q.shape)}; a split call packs its query rows "
                         f"as {_fmt(want_q)}")
    for n in kv_keys:
        a, want = arrays[n], shapes[n]
        fixed = [(i, int(x.split("=")[1])) for i, x in enumerate(want) if "=" in str(x)]
        if a.ndim != len(want) or any(a.shape[i] != x for i, x in fixed):
            raise InputError(f"inputs: '{n}' has shape {_fmt(a.shape)}; expected {_fmt(want)} "
                             f"for a {cache_description(p)}")
    layout = lay.from_inputs(p.cache, arrays, heads_q=p.heads_q, heads_kv=p.heads_kv,
                             elem_bytes=dtype_bytes(p.dtype))
    k, v = lay.check_arrays(layout, arrays)
    if layout.batch == 0:
        raise InputError("inputs: empty call (the cache metadata describes B = 0 requests)")
    q_lens, qo_indptr = query_rows(arrays, layout.batch, q.shape[0])
    short = np.flatnonzero((layout.kv_lens < q_lens) & (layout.kv_lens > 0))
    if len(short):
        raise short_request(int(short[0]), q_lens, layout.kv_lens)
    sizes = {"b": layout.batch, "h": p.heads_q, "s": int(layout.kv_lens.max(initial=0))}
    _check_tensors(p, {t: (arrays[t].shape, arrays[t].dtype.kind, str(arrays[t].dtype)) for t in names}, sizes)
    tensors = _convert_tensors(p, arrays)
    check_flashmask(p, tensors)
    return CacheCall(layout, *(to_storage(x, p.dtype).astype(np.float32) for x in (q, k, v)),
                     q_lens, qo_indptr, tensors)


def sample_cache(program: ir.Program, kv_lens, q_lens=None, seed: int = 0, *, spare_pages: int = 3,
                 cache_rows: int | None = None, poison: bool = True) -> dict[str, np.ndarray]:
    """Example inputs of a split call over the spec's cache, with DESIGN §5's keys.

    Each request's logical K/V rows ~ N(0, 1) (rounded to the storage dtype) are scattered into
    the spec's storage: a paged cache gets a pool of ``sum ceil(T_b / P) + spare_pages`` pages
    handed out in shuffled order (a dense ``block_table`` is ``-1`` past a request's pages);
    a contiguous cache gets ``cache_rows`` rows (default B) of ``max T_b + 3`` slots, requests
    in shuffled rows named by ``cache_batch_idx`` when there are spare rows.  With ``poison``,
    every stored element that is no request's visible row (page tails, unused pages, slots past
    a length) is NaN: a kernel that reads one cannot hide it.  ``q`` is packed
    ``[sum q_lens, H_q, d_qk]``; ``q_lens`` defaults to one row per non-empty request."""
    rng = np.random.default_rng(seed)
    p, c = program, program.cache
    kv = np.asarray(kv_lens, np.int64)
    q_lens = (kv > 0).astype(np.int64) if q_lens is None else np.asarray(q_lens, np.int64)
    B = max(kv.size, 1)
    _require_sample(p, B, -(-int(q_lens.sum()) // B), int(kv.max(initial=0)) + (c.page_size or 3))
    B, fill = kv.size, np.nan if poison else 0.0
    store = np.float16 if p.dtype == "f16" else np.float32
    q = to_storage(rng.standard_normal((int(q_lens.sum()), p.heads_q, p.d_qk), np.float32), p.dtype)
    ks = [to_storage(rng.standard_normal((int(t), p.heads_kv, p.d_qk), np.float32), p.dtype) for t in kv]
    vs = [to_storage(rng.standard_normal((int(t), p.heads_kv, p.d_v), np.float32), p.dtype) for t in kv]
    out: dict[str, np.ndarray] = {"q": q}
    if c.kind is ir.CacheKind.RAGGED:
        out.update(k=np.concatenate(ks).reshape(-1, p.heads_kv, p.d_qk),
                   v=np.concatenate(vs).reshape(-1, p.heads_kv, p.d_v),
                   kv_indptr=np.concatenate([[0], np.cumsum(kv)]).astype(np.int32))
    elif c.kind is ir.CacheKind.CONTIGUOUS:
        rows = B if cache_rows is None else cache_rows
        order = rng.permutation(rows)[:B] if rows > B else np.arange(B)
        t_c = int(kv.max(initial=0)) + 3
        k = np.full((rows, t_c, p.heads_kv, p.d_qk), fill, store)
        v = np.full((rows, t_c, p.heads_kv, p.d_v), fill, store)
        for b, r in enumerate(order):
            k[r, :kv[b]], v[r, :kv[b]] = ks[b], vs[b]
        if c.layout is ir.Layout.BHSD:
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
        out.update(k=k, v=v, kv_lens=kv.astype(np.int32))
        if rows > B:
            out["cache_batch_idx"] = order.astype(np.int32)
    else:
        P = c.page_size
        n_pages = -(-kv // P)
        pool = int(n_pages.sum()) + spare_pages
        ids = rng.permutation(pool)
        first = np.concatenate([[0], np.cumsum(n_pages)])
        pages = [ids[first[b]:first[b + 1]] for b in range(B)]
        k = np.full((pool, P, p.heads_kv, p.d_qk), fill, store)
        v = np.full((pool, P, p.heads_kv, p.d_v), fill, store)
        for b in range(B):
            t = np.arange(kv[b])
            k[pages[b][t // P], t % P], v[pages[b][t // P], t % P] = ks[b], vs[b]
        if c.layout is ir.Layout.HND:
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
        out.update(k_cache=k, v_cache=v)
        if (c.table or "dense") == "csr":
            last = np.where(n_pages > 0, kv - P * (n_pages - 1), 0)
            out.update(kv_indptr=first.astype(np.int32), kv_indices=ids[:first[-1]].astype(np.int32),
                       kv_last_page_len=last.astype(np.int32))
        else:
            table = np.full((B, int(n_pages.max(initial=0)) + 1), -1, np.int32)
            for b in range(B):
                table[b, :n_pages[b]] = pages[b]
            out.update(block_table=table, kv_lens=kv.astype(np.int32))
    out["q_lens"] = q_lens.astype(np.int32)
    out.update(_sample_tensors(p, rng, {"b": B, "h": p.heads_q, "s": int(kv.max(initial=0))}, out))
    return out


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


def sample_bytes(program: ir.Program, batch: int, s_q: int, s_k: int) -> int:
    """Peak bytes of :func:`sample` (and of a split call's :func:`sample_cache` over as many rows):
    q/k/v drawn in float32 and rounded to the storage dtype through 64-bit integers (measured 25.4
    bytes per element), tensors drawn as int64 or float64."""
    p = program
    qkv = batch * (p.heads_q * s_q * p.d_qk + p.heads_kv * s_k * (p.d_qk + p.d_v))
    sizes = {"b": batch, "h": p.heads_q, "s": s_k}
    tensors = sum(int(np.prod([sizes[x] if isinstance(x, str) else x for x in t.axes])) for t in p.tensors)
    return 28 * qkv + 16 * tensors


def _require_sample(program: ir.Program, batch: int, s_q: int, s_k: int) -> None:
    resources.check_length("S_k", s_k)
    resources.require(f"sampled inputs of '{program.name}' (B = {batch}, S_q = {s_q}, S_k = {s_k})",
                      sample_bytes(program, batch, s_q, s_k))


def sample(program: ir.Program, batch: int, s_q: int, s_k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Example inputs in the spec's layout: q/k/v ~ N(0, 1) rounded to the storage dtype, and
    every declared tensor drawn from its ``~ kind(args)``."""
    _require_sample(program, batch, s_q, s_k)
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
    arrays.update(_sample_tensors(p, rng, {"b": batch, "h": p.heads_q, "s": s_k}, arrays))
    return arrays


def sample_tensors(program: ir.Program, batch: int, s_k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Only the declared tensors, drawn from their ``~ kind(args)`` (a call whose q/k/v come from
    elsewhere, such as a benchmark's on the GPU; the values differ from :func:`sample`'s, which
    draws q/k/v first)."""
    resources.require(f"sampled tensors of '{program.name}' (B = {batch}, S_k = {s_k})",
                      16 * sum(int(np.prod([{"b": batch, "h": program.heads_q, "s": s_k}.get(x, x) for x in t.axes]))
                               for t in program.tensors))
    return _sample_tensors(program, np.random.default_rng(seed), {"b": batch, "h": program.heads_q, "s": s_k}, {})


def _sample_tensors(p: ir.Program, rng, sizes: dict[str, int], arrays: dict) -> dict[str, np.ndarray]:
    """Every declared tensor drawn from its ``~ kind(args)`` (``arrays`` holds earlier draws)."""
    arrays = dict(arrays)
    out = {}
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
        arrays[t.name] = out[t.name] = a
    return out
