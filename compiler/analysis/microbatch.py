"""The frozen microbatch manifest of a serving call (M4.5 §0x08F, §0x08H).

A scheduler chooses which requests run together; attention then needs, per request, more
than its lengths: a stable request id (whose output rows are whose), the cache row its K/V
live in (not its transient position in the batch, §0x04A), ``T`` committed rows, ``C`` new
query rows (= rows staged and committed by an append), its packed query rows
``[qo_indptr[b], qo_indptr[b+1])`` and the output rows they scatter back to.

:meth:`MicrobatchManifest.freeze` builds one and refuses duplicate request ids and duplicate
cache rows; the result is immutable and carries a digest of its content.  Anything that
changes a batch (a new token, a reordered or admitted request) is a new manifest with a new
digest, and a plan made for the old one is refused (``compiler.append.AppendPlan``).  The
lengths part is :class:`compiler.analysis.phases.Manifest` (ledgers, phases).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from attnc.compiler.errors import PlanError

from .phases import Manifest, _lengths, phase_of


@dataclass(frozen=True)
class ManifestEntry:
    """One request of a microbatch; row ranges are half-open ``(start, end)`` packed rows."""

    request_id: int | str
    cache_row: int
    T: int
    C: int
    phase: str
    q_rows: tuple[int, int]
    out_rows: tuple[int, int]
    post_length: int

    def as_dict(self) -> dict:
        return {"request_id": self.request_id, "cache_row": self.cache_row, "T": self.T, "C": self.C,
                "phase": self.phase, "q_rows": list(self.q_rows), "out_rows": list(self.out_rows),
                "post_length": self.post_length}


def _request_ids(ids, batch: int) -> tuple:
    ids = list(np.asarray(ids).tolist()) if isinstance(ids, np.ndarray) else list(ids)
    if len(ids) != batch:
        raise PlanError(f"request_ids has {len(ids)} entries, the batch has {batch} requests")
    for b, r in enumerate(ids):
        if isinstance(r, bool) or not isinstance(r, (int, np.integer, str)):
            raise PlanError(f"request_ids[{b}] = {r!r}: a request id is an integer or a string")
    ids = [r if isinstance(r, str) else int(r) for r in ids]
    first: dict = {}
    for b, r in enumerate(ids):
        if r in first:
            raise PlanError(f"request_ids[{b}] = {r!r} duplicates request_ids[{first[r]}]: a request "
                            "appears once in a microbatch")
        first[r] = b
    return tuple(ids)


@dataclass(frozen=True, eq=False)
class MicrobatchManifest:
    """An immutable microbatch: one :class:`ManifestEntry` per request, in packed order."""

    entries: tuple[ManifestEntry, ...]

    @staticmethod
    def freeze(request_ids, cache_rows, T, C) -> "MicrobatchManifest":
        """The manifest of requests ``request_ids`` (unique ints or strings) living in
        ``cache_rows`` (unique), with ``T`` committed and ``C`` new rows each; query rows are
        packed in this order.  Every contract break is a PlanError naming the entry."""
        lengths = Manifest(T, C)
        batch = len(lengths)
        ids = _request_ids(request_ids, batch)
        rows = _lengths("cache_rows", cache_rows)
        if rows.size != batch:
            raise PlanError(f"cache_rows has {rows.size} entries, the batch has {batch} requests")
        first: dict[int, int] = {}
        for b, c in enumerate(rows.tolist()):
            if c in first:
                raise PlanError(f"cache_rows[{b}] = {c} duplicates cache_rows[{first[c]}]: two requests "
                                "would append to one cache row")
            first[c] = b
        ptr = lengths.qo_indptr.tolist()
        entries = tuple(ManifestEntry(ids[b], int(rows[b]), int(t), int(c), phase_of(t, c), (ptr[b], ptr[b + 1]),
                                      (ptr[b], ptr[b + 1]), int(t + c))
                        for b, (t, c) in enumerate(zip(lengths.T.tolist(), lengths.C.tolist())))
        return MicrobatchManifest(entries)

    # ------------------------------------------------------------ identity
    @cached_property
    def digest(self) -> str:
        """sha256 of the manifest's content (ids, cache rows, T, C in packed order)."""
        content = [[e.request_id, e.cache_row, e.T, e.C] for e in self.entries]
        return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, MicrobatchManifest) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        reqs = ", ".join(f"{e.request_id!r}@{e.cache_row}:({e.T},{e.C})" for e in self.entries)
        return f"MicrobatchManifest({self.digest[:12]}: {reqs})"

    # ------------------------------------------------------------ columns
    @cached_property
    def lengths(self) -> Manifest:
        """The (T, C) part: phases, packed offsets, ledgers."""
        return Manifest([e.T for e in self.entries], [e.C for e in self.entries])

    @property
    def request_ids(self) -> tuple:
        return tuple(e.request_id for e in self.entries)

    @cached_property
    def cache_rows(self) -> np.ndarray:
        out = np.array([e.cache_row for e in self.entries], np.int64)
        out.setflags(write=False)
        return out

    @property
    def T(self) -> np.ndarray:
        return self.lengths.T

    @property
    def C(self) -> np.ndarray:
        return self.lengths.C

    @property
    def qo_indptr(self) -> np.ndarray:
        return self.lengths.qo_indptr

    @property
    def post_length(self) -> np.ndarray:
        return self.lengths.post_commit

    def index(self, request_id) -> int:
        """The packed position of ``request_id``."""
        for b, e in enumerate(self.entries):
            if e.request_id == request_id:
                return b
        raise PlanError(f"request {request_id!r} is not in manifest {self.digest[:12]}")

    # ------------------------------------------------------------ use
    def scatter(self, out) -> dict:
        """Packed output rows ``out [total_q, ...]`` back to their requests: ``{request_id: rows}``
        (a request without query rows gets none)."""
        total = int(self.qo_indptr[-1])
        if len(out) != total:
            raise PlanError(f"the output has {len(out)} packed rows; manifest {self.digest[:12]} has {total}")
        return {e.request_id: out[e.out_rows[0]:e.out_rows[1]] for e in self.entries}

    def check_same(self, other: "MicrobatchManifest", what: str = "plan") -> None:
        """Refuse ``other`` unless it is this manifest, naming the first difference."""
        if other.digest == self.digest:
            return
        if len(other) != len(self):
            why = f"{len(self)} requests, the call has {len(other)}"
        else:
            b, mine, theirs = next((b, m, t) for b, (m, t) in enumerate(zip(self.entries, other.entries)) if m != t)
            field = next(f for f in ("request_id", "cache_row", "T", "C") if getattr(mine, f) != getattr(theirs, f))
            why = (f"{field} = {getattr(mine, field)!r} at packed position {b}, the call has "
                   f"{getattr(theirs, field)!r}")
        raise PlanError(f"the {what} was made for manifest {self.digest[:12]} ({why}): a new token or a "
                        f"reordered batch is a new manifest ({other.digest[:12]}); plan it again")

    def to_json(self) -> dict:
        """A JSON-able dict: the digest, every entry, the packed offsets and the ledger totals."""
        return {"digest": self.digest, "requests": [e.as_dict() for e in self.entries],
                "qo_indptr": self.qo_indptr.tolist(), "rows_appended": self.lengths.rows_appended}
