"""Byte ledgers of a split decode call (M4.5 §0x03D-§0x03G, §0x04I).

Every number is a *logical* byte count derived from shapes and declared dtypes: unique
payload vs logical demand, the workspace round trip of the partial-state ABI, resident
metadata.  None of them is measured DRAM traffic (caches, transaction widths and retries
are invisible here, §0x03F), and the K/V demand is mask-agnostic: a schedule that skips
tiles demands less.

The workspace ABIs (§0x03D):

* ``mlu``   -- ``partial_u [.., d_v]`` + ``partial_m`` + ``partial_l`` (+ ``partial_valid``)
* ``lse_o`` -- ``partial_o [.., d_v]`` + ``partial_lse`` (+ ``partial_valid``)
* ``shared_shift`` -- ``partial_n [.., d_v]`` + ``partial_l`` in the common frame exp(s - phi)
  (+ ``partial_valid``) + ``partial_guard`` (the split saw a score outside the guard's window,
  §0x09C); its fallback recomputes with ``mlu`` (:func:`fallback_fields`)

``valid_dtype = None`` drops the explicit validity field (emptiness encoded as LSE = -inf).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dc_fields

import numpy as np

from attnc.compiler.errors import PlanError

ABIS = ("mlu", "lse_o", "shared_shift")

DTYPE_BYTES = {
    "f64": 8, "fp64": 8, "float64": 8,
    "f32": 4, "fp32": 4, "float32": 4,
    "bf16": 2, "bfloat16": 2, "f16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "e4m3": 1, "e5m2": 1,
    "i64": 8, "int64": 8, "i32": 4, "int32": 4, "i16": 2, "int16": 2,
    "u8": 1, "uint8": 1, "i8": 1, "int8": 1, "bool": 1,
}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name (``'bf16'``, ``'f32'``, ``'u8'``...) or numpy dtype."""
    if isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        return DTYPE_BYTES[dtype.lower()]
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        raise PlanError(f"unknown dtype {dtype!r}") from None


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    if multiple < 1:
        raise PlanError(f"alignment {multiple} must be at least 1")
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------- the call
@dataclass(frozen=True)
class DecodeCall:
    """Shapes and field-level dtypes of a split decode call (§0x03H).

    ``vector_dtype`` stores ``partial_u`` (mlu) or ``partial_o`` (lse_o); ``None`` means the
    article's baseline: float32 ``u`` for mlu, the output dtype for normalized ``O``.
    ``reduce_capacity``: the reducer reads all ``S_cap`` slots (so every inactive slot is
    written with the identity, §0x03G) instead of only the configured ones."""

    heads_q: int
    heads_kv: int
    d_qk: int
    d_v: int | None = None
    abi: str = "lse_o"
    q_dtype: str = "bf16"
    cache_dtype: str = "bf16"
    out_dtype: str = "bf16"
    vector_dtype: str | None = None
    scalar_dtype: str = "f32"
    valid_dtype: str | None = "u8"
    lse_dtype: str = "f32"
    write_lse: bool = True
    vector_alignment: int = 1
    reduce_capacity: bool = True

    def __post_init__(self):
        for name in ("heads_q", "heads_kv", "d_qk", "vector_alignment"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise PlanError(f"{name} = {v!r} must be a positive integer")
        if self.heads_q % self.heads_kv:
            raise PlanError(f"H_q = {self.heads_q} is not a multiple of H_kv = {self.heads_kv}")
        if self.d_v is None:
            object.__setattr__(self, "d_v", self.d_qk)
        abi = getattr(self.abi, "value", self.abi)
        if abi not in ABIS:
            raise PlanError(f"unknown state ABI {self.abi!r}; expected one of {ABIS}")
        object.__setattr__(self, "abi", abi)

    @staticmethod
    def from_program(program, **overrides) -> "DecodeCall":
        """The call of an ``ir.Program``: its heads, head dims, storage dtype and state ABI."""
        base = dict(heads_q=program.heads_q, heads_kv=program.heads_kv, d_qk=program.d_qk,
                    d_v=program.d_v, abi=getattr(program.state, "value", program.state),
                    q_dtype=program.dtype, cache_dtype=program.dtype, out_dtype=program.dtype)
        base.update(overrides)
        return DecodeCall(**base)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def d_v_padded(self) -> int:
        return round_up(self.d_v, self.vector_alignment)

    def state_fields(self) -> tuple["StateField", ...]:
        return state_fields(self.abi, vector_dtype=self.vector_dtype_resolved,
                            scalar_dtype=self.scalar_dtype, valid_dtype=self.valid_dtype)

    @property
    def vector_dtype_resolved(self) -> str:
        if self.vector_dtype is not None:
            return self.vector_dtype
        return vector_dtype(self.abi, self.out_dtype)


# ---------------------------------------------------------------- workspace (§0x03D-E)
def vector_dtype(abi: str, out_dtype: str) -> str:
    """The stored dtype of a state's vector field, the article's baseline (§0x03D, §0x03H) and
    what every backend stores: float32 ``u`` for (m, l, u), whose unnormalized sums can leave the
    storage range; the output dtype for the normalized ``O`` of (LSE, O), a convex combination
    of V rows (it always fits, and rounding it costs at most one output rounding).  The shared
    shift's numerator is an unnormalized sum too: float32."""
    return out_dtype if getattr(abi, "value", abi) == "lse_o" else "f32"


@dataclass(frozen=True)
class StateField:
    """One stored field of a partial state: ``vector`` fields hold ``d_v`` lanes per state."""

    name: str
    dtype: str
    vector: bool

    def bytes_per_state(self, d_v: int) -> int:
        return (d_v if self.vector else 1) * dtype_bytes(self.dtype)


def state_fields(abi: str, *, vector_dtype: str | None = None, scalar_dtype: str = "f32",
                 valid_dtype: str | None = "u8") -> tuple[StateField, ...]:
    """The structure-of-arrays fields of one ABI (§0x03D), in storage order."""
    abi = getattr(abi, "value", abi)
    if abi == "mlu":
        out = [StateField("partial_u", vector_dtype or "f32", True),
               StateField("partial_m", scalar_dtype, False), StateField("partial_l", scalar_dtype, False)]
    elif abi == "lse_o":
        out = [StateField("partial_o", vector_dtype or "bf16", True),
               StateField("partial_lse", scalar_dtype, False)]
    elif abi == "shared_shift":  # raw sums in one frame: float32, never the storage dtype
        out = [StateField("partial_n", vector_dtype or "f32", True), StateField("partial_l", scalar_dtype, False)]
    else:
        raise PlanError(f"unknown state ABI {abi!r}; expected one of {ABIS}")
    if valid_dtype is not None:
        out.append(StateField("partial_valid", valid_dtype, False))
    if abi == "shared_shift":
        out.append(StateField("partial_guard", "u8", False))
    return tuple(out)


def fallback_fields(abi: str) -> tuple[StateField, ...]:
    """The fields a shared-shift call adds for its fallback: the synchronized (m, l, u) path
    writes ``partial_m`` and reuses ``partial_n`` as ``u``, ``partial_l`` and ``partial_valid``.
    Other ABIs have no fallback."""
    return (StateField("partial_m", "f32", False),) if getattr(abi, "value", abi) == "shared_shift" else ()


def bytes_per_state(fields_: tuple[StateField, ...], d_v: int) -> int:
    """``d_v b_u + 2 b_state + b_valid`` (mlu) or ``d_v b_O + b_state + b_valid`` (lse_o)."""
    return sum(f.bytes_per_state(d_v) for f in fields_)


@dataclass(frozen=True)
class Workspace:
    """The partial-state workspace: logical payload vs allocation envelope (§0x03D, §0x03G)."""

    abi: str
    fields: tuple[StateField, ...]
    states: int             # N_cfg: configured logical states
    capacity_states: int    # N_cap: allocated state slots
    d_v: int
    d_v_padded: int

    @property
    def per_state(self) -> int:
        return bytes_per_state(self.fields, self.d_v)

    @property
    def per_state_padded(self) -> int:
        return bytes_per_state(self.fields, self.d_v_padded)

    @property
    def logical(self) -> int:
        """``M^logical = N_cfg (per-state bytes at d_v)``."""
        return self.states * self.per_state

    @property
    def capacity(self) -> int:
        """``M^capacity = N_cap (per-state bytes at d_v_padded)``: the allocation envelope."""
        return self.capacity_states * self.per_state_padded

    @property
    def lane_padding(self) -> int:
        return self.capacity_states * (self.per_state_padded - self.per_state)

    @property
    def slot_padding(self) -> int:
        return (self.capacity_states - self.states) * self.per_state

    @property
    def padding(self) -> int:
        """``capacity - logical`` = lane padding + unconfigured slots."""
        return self.capacity - self.logical

    def field_bytes(self, padded: bool = False) -> dict[str, int]:
        n, d = (self.capacity_states, self.d_v_padded) if padded else (self.states, self.d_v)
        return {f.name: n * f.bytes_per_state(d) for f in self.fields}


def workspace(abi: str, d_v: int, states: int, *, capacity_states: int | None = None,
              vector_dtype: str | None = None, scalar_dtype: str = "f32",
              valid_dtype: str | None = "u8", vector_alignment: int = 1) -> Workspace:
    """The workspace of ``states`` partial states (``capacity_states`` slots allocated)."""
    cap = states if capacity_states is None else capacity_states
    if states < 0 or cap < states:
        raise PlanError(f"workspace needs 0 <= states ({states}) <= capacity states ({cap})")
    fs = state_fields(abi, vector_dtype=vector_dtype, scalar_dtype=scalar_dtype, valid_dtype=valid_dtype)
    return Workspace(getattr(abi, "value", abi), fs, int(states), int(cap), int(d_v),
                     round_up(int(d_v), vector_alignment))


# The alignment of every field of an allocated workspace: the kernels' pointer specialization then
# never changes with the call's size.
FIELD_ALIGNMENT = 16


def allocation(abi: str, total_q: int, heads_q: int, splits: int, d_v: int,
               vector_bytes: int = 4) -> tuple[int, dict[str, tuple[int, int]], int]:
    """(states, {field: (byte offset, elements)}, bytes) of the workspace a split launch allocates:
    ``states`` = (query row, head, split) slots, each a partial O / u / numerator (``d_v``
    elements of ``vector_bytes``: :func:`vector_dtype`), m or LSE, l when the ABI is (m, l, u),
    one valid byte; the shared shift's fields are the numerator, m (its fallback's), l, valid
    and guard, then one ``need`` byte per (row, head).  Every field starts
    :data:`FIELD_ALIGNMENT`-aligned.  The one layout: the Triton backend allocates it and
    ``attnc plan`` reports its bytes."""
    abi = getattr(abi, "value", abi)
    n = int(total_q) * int(heads_q) * int(splits)
    if abi == "shared_shift":
        parts = (("o", n * d_v, 4), ("m", n, 4), ("l", n, 4), ("valid", n, 1), ("guard", n, 1),
                 ("need", int(total_q) * int(heads_q), 1))
    elif abi in ("mlu", "lse_o"):
        parts = (("o", n * d_v, vector_bytes), ("m", n, 4), ("l", n if abi == "mlu" else 0, 4), ("valid", n, 1))
    else:
        raise PlanError(f"unknown state ABI {abi!r}; expected one of {ABIS}")
    fields, offset = {}, 0
    for name, count, size in parts:
        fields[name] = (offset, count)
        offset += round_up(count * size, FIELD_ALIGNMENT)
    return n, fields, offset


def allocated_bytes(abi: str, storage: str, total_q: int, heads_q: int, splits: int, d_v: int) -> int:
    """The bytes of the workspace a split launch allocates (:func:`allocation`, its vector field in
    :func:`vector_dtype` of the spec's ``storage`` dtype): what the Triton launch allocates and
    ``attnc plan`` reports."""
    return allocation(abi, total_q, heads_q, splits, d_v, dtype_bytes(vector_dtype(abi, storage)))[2]


# ---------------------------------------------------------------- payload vs demand (§0x03F)
def q_unique_bytes(q_rows: int, heads_q: int, d_qk: int, q_dtype: str = "bf16") -> int:
    """``sum_b C_b H_q d_qk b_Q``: every query row of every head once."""
    return int(q_rows) * heads_q * d_qk * dtype_bytes(q_dtype)


def kv_unique_bytes(kv_lens, heads_kv: int, d_qk: int, d_v: int, cache_dtype: str = "bf16") -> int:
    """``sum_b T_b H_kv (d_qk + d_v) b_cache``: each K/V head's visible rows once."""
    return int(np.sum(np.asarray(kv_lens, np.int64))) * heads_kv * (d_qk + d_v) * dtype_bytes(cache_dtype)


def kv_demand_bytes(kv_lens, heads_q: int, d_qk: int, d_v: int, cache_dtype: str = "bf16") -> int:
    """``sum_b T_b H_q (d_qk + d_v) b_cache``: every query head loads its K/V group's rows."""
    return kv_unique_bytes(kv_lens, heads_q, d_qk, d_v, cache_dtype)


@dataclass(frozen=True)
class DecodeLedger:
    """Logical bytes of a two-launch split decode (producer + reducer), §0x03F."""

    unique_q: int
    q_demand: int            # every non-empty producer owner loads its Q row(s)
    unique_kv: int           # by K/V head
    kv_demand: int           # per query head
    workspace_write: int     # producer -> workspace
    workspace_read: int      # workspace -> reducer
    final_output: int
    final_lse: int

    @property
    def workspace_roundtrip(self) -> int:
        return self.workspace_write + self.workspace_read

    @property
    def reduction_path(self) -> int:
        """``2 M_partial + B H_q d_v b_O + [write LSE] B H_q b_state``."""
        return self.workspace_roundtrip + self.final_output + self.final_lse

    @property
    def two_launch_demand(self) -> int:
        """Q demand + K/V demand + the reduction path: the full logical demand."""
        return self.q_demand + self.kv_demand + self.reduction_path

    @property
    def kv_reuse_factor(self) -> float:
        return self.kv_demand / self.unique_kv if self.unique_kv else 1.0

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in dc_fields(self)}
        out.update(workspace_roundtrip=self.workspace_roundtrip, reduction_path=self.reduction_path,
                   two_launch_demand=self.two_launch_demand)
        return out


def _q_lens(q_lens, batch: int) -> np.ndarray:
    if q_lens is None:
        return np.ones(batch, np.int64)
    q = np.asarray(q_lens)
    if q.shape != (batch,) or q.dtype == bool or not np.issubdtype(q.dtype, np.integer):
        raise PlanError(f"q_lens must be {batch} integers, got {q.dtype} {list(q.shape)}")
    bad = np.flatnonzero(q < 0)
    if len(bad):
        raise PlanError(f"q_lens[{bad[0]}] = {int(q[bad[0]])} is negative")
    return q.astype(np.int64)


def consumed_slots(bounds, call: DecodeCall) -> np.ndarray:
    """bool [B, S_cap]: the slots a reducer reads (all capacity slots, or the active ones)."""
    return np.ones(bounds.active.shape, bool) if call.reduce_capacity else bounds.active.copy()


def split_workspace(bounds, call: DecodeCall, q_lens=None) -> Workspace:
    """The workspace of a split plan: ``states`` = consumed ``(row, h_q, split)`` states,
    ``capacity_states`` = the ``[rows, H_q, S_cap]`` envelope."""
    q = _q_lens(q_lens, bounds.batch)
    per_row = consumed_slots(bounds, call).sum(axis=1)
    states = int(np.sum(q * per_row)) * call.heads_q
    cap = int(q.sum()) * call.heads_q * bounds.capacity
    return workspace(call.abi, call.d_v, states, capacity_states=cap,
                     vector_dtype=call.vector_dtype_resolved, scalar_dtype=call.scalar_dtype,
                     valid_dtype=call.valid_dtype, vector_alignment=call.vector_alignment)


def decode_ledger(bounds, call: DecodeCall, q_lens=None) -> DecodeLedger:
    """The closed-form ledger of a split decode under ``bounds`` (a ``SplitBounds``).

    Producer owners ``(b, h_q, s)`` whose slot is non-empty load Q and their K/V rows; the
    others write the identity without loading (§0x03I).  Each consumed state is written once
    and read once (logical ``d_v`` lanes; lane padding is allocation, not traffic)."""
    q = _q_lens(q_lens, bounds.batch)
    nonempty_per_request = bounds.nonempty.sum(axis=1)
    q_row = call.d_qk * dtype_bytes(call.q_dtype)
    ws = split_workspace(bounds, call, q)
    out_rows = int(q.sum()) * call.heads_q
    read = np.where(q > 0, bounds.kv_lens, 0)  # a request with no query rows reads no K/V
    return DecodeLedger(
        unique_q=q_unique_bytes(int(q.sum()), call.heads_q, call.d_qk, call.q_dtype),
        q_demand=int(np.sum(nonempty_per_request * q)) * call.heads_q * q_row,
        unique_kv=kv_unique_bytes(read, call.heads_kv, call.d_qk, call.d_v, call.cache_dtype),
        kv_demand=kv_demand_bytes(read, call.heads_q, call.d_qk, call.d_v, call.cache_dtype),
        workspace_write=ws.logical,
        workspace_read=ws.logical,
        final_output=out_rows * call.d_v * dtype_bytes(call.out_dtype),
        final_lse=out_rows * dtype_bytes(call.lse_dtype) if call.write_lse else 0,
    )


# ---------------------------------------------------------------- metadata (§0x04I)
@dataclass(frozen=True)
class MetadataLedger:
    """Resident metadata bytes of a K/V layout, per tensor.  ``table`` counts the page-table
    encoding only (dense ``block_table``, or CSR ``kv_indptr + kv_indices + kv_last_page_len``);
    ``total`` adds lengths, row pointers and ``cache_batch_idx``.  Resident bytes are not
    traffic: lookups and measured transfers are separate ledgers."""

    fields: dict[str, int] = field(default_factory=dict)
    table_fields: tuple[str, ...] = ()

    @property
    def table(self) -> int:
        return sum(self.fields[k] for k in self.table_fields)

    @property
    def total(self) -> int:
        return sum(self.fields.values())


def metadata_bytes(layout, index_dtype: str = "i32") -> MetadataLedger:
    """The resident metadata of a ``KVLayout`` with every index stored as ``index_dtype``."""
    eb = dtype_bytes(index_dtype)
    sizes: dict[str, int] = {}
    table: tuple[str, ...] = ()
    if layout.kind == "ragged":
        sizes["kv_indptr"] = layout.indptr.size
        if not np.array_equal(np.diff(layout.indptr), layout.kv_lens):  # regions with room
            sizes["kv_lens"] = layout.kv_lens.size
    elif layout.kind == "paged" and layout.table == "dense":
        sizes["block_table"] = layout.block_table.size
        sizes["kv_lens"] = layout.kv_lens.size
        table = ("block_table",)
    elif layout.kind == "paged":
        sizes.update(kv_indptr=layout.kv_indptr.size, kv_indices=layout.kv_indices.size,
                     kv_last_page_len=layout.kv_last_page_len.size)
        table = ("kv_indptr", "kv_indices", "kv_last_page_len")
    else:
        sizes["kv_lens"] = layout.kv_lens.size
    if layout.cache_batch_idx is not None:
        sizes["cache_batch_idx"] = layout.cache_batch_idx.size
    return MetadataLedger({k: n * eb for k, n in sizes.items()}, table)


def page_lookups(layout, bounds) -> int:
    """Logical lookup demand: one page-table read per (producer task, intersected page)
    per K/V head (§0x04E), for the split ``bounds`` over a paged ``layout``."""
    if layout.kind != "paged":
        return 0
    p = layout.page_size
    a, e = bounds.starts, bounds.ends
    segs = np.where(e > a, 1 + (e - 1) // p - a // p, 0) * bounds.active
    return int(segs.sum()) * layout.heads_kv
