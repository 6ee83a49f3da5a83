"""Phases: per-request ``(T, C)``, packed offsets and logical score-cell ledgers (M4.5 §0x08).

Per request, ``T`` = K/V rows committed before the call and ``C`` = new query rows (= rows
staged); query row ``i`` is at absolute position ``T + i`` (bottom-right, §0x08B), so a mixed
batch needs a per-request manifest, not one phase label (§0x08F).  A request with no keys at
all may still have query rows ("empty", the capacity tail of §0x03G: a decode step over an
empty context): ``T = -C``, its rows see nothing and take the all-masked policy.  Ledgers count *logical*
score cells per (request, head), not FLOPs/tiles/bytes, in O(B); :func:`visible_cells` is
the dense reference.  ``C = 0`` is allowed ("idle"): the runtime API passes lengths for
every batch slot, and a slot with no new rows keeps its index while touching nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from attnc.compiler import ir
from attnc.compiler.errors import PlanError
from attnc.compiler.interp import evaluate

PHASES = ("idle", "prefill", "append", "decode", "empty")


def _lengths(name: str, values) -> np.ndarray:
    """``values`` as a read-only int64 vector; a PlanError names ``name[i]`` and the value."""
    a = np.asarray(values)
    a = a.astype(np.int64) if a.size == 0 else a
    if a.ndim != 1 or a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise PlanError(f"{name} must be a 1-D integer array of lengths, got {a.dtype} {list(a.shape)}")
    neg = np.flatnonzero(a < 0)
    if len(neg):
        raise PlanError(f"{name}[{neg[0]}] = {int(a[neg[0]])} is negative")
    out = a.astype(np.int64)
    out.setflags(write=False)
    return out


# ---------------------------------------------------------------- closed forms (§0x08B)
def rect_cells(T, C):
    """``C (T + C)``: C query rows by the T + C keys this call can address."""
    return C * (T + C)


def causal_visible_cells(T, C):
    """``sum_i (T + i + 1) = C T + C (C + 1) / 2``: row i reads all old rows and staged rows <= itself
    (0 for an empty request, ``T = -C``: no keys)."""
    return np.where(np.add(T, C) > 0, C * T + C * (C + 1) // 2, 0)


def causal_masked_cells(T, C):
    """``C (C - 1) / 2``, independent of T: only the chunk's own future rows are hidden (0 for an
    empty request: its rectangle has no cell)."""
    return np.where(np.add(T, C) > 0, C * (C - 1) // 2, 0)


def phase_of(T: int, C: int) -> str:
    """The phase of one request (§0x08B), one of :data:`PHASES`.  Causal training over S
    tokens is ``(0, S)``, so it reads "prefill": same visibility; the state it owns instead
    (backward, LSE/RNG, no cache mutation, §0x08E) is invisible in (T, C)."""
    if C > 0 and T == -C:  # a request with no keys whose rows see nothing
        return "empty"
    r = Request(T, C)  # validates: integers, not negative
    return "idle" if r.C == 0 else "prefill" if r.T == 0 else "decode" if r.C == 1 else "append"


@dataclass(frozen=True)
class Request:
    """One request: ``T`` committed K/V rows before the call, ``C`` new query rows."""

    T: int
    C: int

    def __post_init__(self):
        for name in ("T", "C"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PlanError(f"{name} = {value!r} is not an integer")
            if value < 0:
                raise PlanError(f"{name} = {value} is negative")
            object.__setattr__(self, name, int(value))

    @staticmethod
    def training(S: int) -> "Request":
        """Causal training over S tokens sees what a prefill of S sees: ``(0, S)`` (§0x08E)."""
        return Request(0, S)


@dataclass(frozen=True, eq=False)
class Manifest:
    """The immutable manifest of one (mixed) batch: read-only int64 ``T`` and ``C`` [B]."""

    T: np.ndarray
    C: np.ndarray

    def __post_init__(self):
        C = _lengths("C", self.C)
        T = np.asarray(self.T)
        empty = None  # T = -C < 0 marks an empty request (no keys; its rows see nothing)
        if T.shape == C.shape and T.dtype.kind in "iu" and ((T == -C) & (C > 0)).any():
            empty = (T == -C) & (C > 0)
            T = np.where(empty, 0, T)
        T = _lengths("T", T)
        if T.shape != C.shape:
            raise PlanError(f"T has {T.size} entries but C has {C.size}")
        if empty is not None:
            T = np.where(empty, -C, T)
            T.setflags(write=False)
        object.__setattr__(self, "T", T)
        object.__setattr__(self, "C", C)

    @staticmethod
    def from_requests(requests: Iterable[Request | tuple[int, int]]) -> "Manifest":
        """From ``Request`` s or ``(T, C)`` pairs; errors name ``T[b]``/``C[b]``."""
        pairs = [(r.T, r.C) if isinstance(r, Request) else tuple(r) for r in requests]
        pairs = np.asarray(pairs).reshape(-1, 2)
        return Manifest(pairs[:, 0], pairs[:, 1])

    @staticmethod
    def from_lens(kv_lens, q_lens) -> "Manifest":
        """From the runtime API's post-commit K/V lengths and new query lengths.  Each new
        query row's own key is staged in the cache, so ``kv_len >= q_len``, except that a
        request with no keys may have rows that see nothing (``T = -C``, phase "empty")."""
        kv, q = _lengths("kv_lens", kv_lens), _lengths("q_lens", q_lens)
        if kv.shape != q.shape:
            raise PlanError(f"kv_lens has {kv.size} entries but q_lens has {q.size}")
        short = np.flatnonzero((kv < q) & (kv > 0))
        if len(short):
            b = short[0]
            raise PlanError(f"kv_lens[{b}] = {kv[b]} is less than q_lens[{b}] = {q[b]}: a request's "
                            "new query rows are also keys it must see, so kv_len >= q_len (only a "
                            "request with no keys at all may have rows: they see nothing)")
        return Manifest(kv - q, q)

    def __len__(self) -> int:
        return int(self.T.size)

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple("empty" if c and t == -c else phase_of(t, c) for t, c in zip(self.T.tolist(), self.C.tolist()))

    @property
    def q_offset(self) -> np.ndarray:
        """Absolute position of each request's query row 0 (row i is at ``T + i``)."""
        return self.T

    @property
    def post_commit(self) -> np.ndarray:
        """``T + C``: each request's visible K/V length now and committed length after."""
        return self.T + self.C

    kv_lens = post_commit  # the runtime API's names
    q_lens = property(lambda self: self.C)

    @property
    def qo_indptr(self) -> np.ndarray:
        """Packed query offsets, ``qo_indptr[b+1] = qo_indptr[b] + C_b``: int64 [B+1]."""
        return np.concatenate([[0], np.cumsum(self.C)]).astype(np.int64)

    @property
    def kv_indptr(self) -> np.ndarray:
        """Ragged K/V offsets over the post-commit lengths: int64 [B+1]."""
        return np.concatenate([[0], np.cumsum(self.post_commit)]).astype(np.int64)

    @property
    def rows_appended(self) -> int:
        return int(self.C.sum())

    @property
    def padded_envelope(self) -> int:
        """``B * max C * max (T + C)`` (§0x08F): what a padded fallback allocates; a shape,
        not executed work (a masked backend need not touch those cells)."""
        return len(self) * int(self.C.max(initial=0)) * int(self.post_commit.max(initial=0))


@dataclass(frozen=True, eq=False)
class Ledger:
    """Logical score cells per request (int64 [B]), the padded envelope and what lies beyond."""

    rect: np.ndarray
    visible: np.ndarray
    masked: np.ndarray
    padded_envelope: int
    cells_beyond_request_rectangles: int  # envelope cells outside every request rectangle

    @staticmethod
    def of(m: Manifest, visible) -> "Ledger":
        """The ledger of ``m`` for per-request visible counts from any mask (closed form or dense)."""
        rect, visible = rect_cells(m.T, m.C), np.asarray(visible, np.int64)
        return Ledger(rect, visible, rect - visible, m.padded_envelope, m.padded_envelope - int(rect.sum()))

    def totals(self) -> dict[str, int]:
        return {"rect": int(self.rect.sum()), "visible": int(self.visible.sum()),
                "masked": int(self.masked.sum()), "padded_envelope": self.padded_envelope,
                "cells_beyond_request_rectangles": self.cells_beyond_request_rectangles}


def causal_ledger(m: Manifest) -> Ledger:
    """The closed-form ledger of bottom-right causal attention, O(B)."""
    return Ledger.of(m, causal_visible_cells(m.T, m.C))


def visible_cells(program: ir.Program, m: Manifest, tensors: dict | None = None) -> np.ndarray:
    """Visible cells of ``program.mask`` per request and query head: int64 [B, H_q].

    The dense reference, O(sum C (T + C)): the mask is evaluated over each request's own
    ``C x (T + C)`` rectangle at the oracle's bottom-right positions ``q = T + i``, with
    ``b`` = the request's batch index so tensors such as ``doc[b, s]`` read its row."""
    heads, tensors = program.heads_q, tensors or {}
    out = np.zeros((len(m), heads), np.int64)
    for b, (t, c) in enumerate(zip(m.T.tolist(), m.C.tolist())):
        if t + c == 0:  # no keys (idle or empty): no cell, and no position to evaluate
            continue
        env = {"b": np.full((1, 1, 1, 1), b, np.int64), "h": np.arange(heads).reshape(1, -1, 1, 1),
               "q": (t + np.arange(c)).reshape(1, 1, -1, 1), "k": np.arange(t + c).reshape(1, 1, 1, -1),
               "S_q": np.asarray(c), "S_k": np.asarray(t + c)}
        mask = np.broadcast_to(evaluate(program.mask, env, tensors), (1, heads, c, t + c))
        out[b] = mask.sum(axis=(0, 2, 3))
    return out
