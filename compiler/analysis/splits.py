"""Per-request split bounds (M4.5 §0x03B, §0x03G, §0x0AB).

A split policy turns each request's visible length ``T_b`` into ``S_cap`` launch slots with
half-open bounds ``[start, end)``.  Active slots partition ``[0, T_b)`` exactly and disjointly
(§0x02E, checked by :func:`check_coverage`); *inactive* slots (capacity envelope past the
configured split count, or chunks a short request does not need) are empty and receive the
identity state.  A single global ``T / S`` would be wrong for ragged batches (§0x03B), so
every bound here is derived per request, vectorized over the batch with numpy.

Policies (the ``split =`` statement of a spec, DESIGN §3.1):

* :func:`balanced` ``(S)`` -- quotient/remainder: the first ``T % S`` splits get one extra row.
* :func:`chunk` ``(C)`` -- ``ceil(T_b / C)`` chunks of width ``C``, the last one shorter.
* :func:`capacity` ``(S, S_cap)`` -- balanced ``S`` inside ``S_cap`` slots (graph-stable shapes).
* :func:`heuristic` ``(f)`` -- FlashAttention's ``num_splits_heuristic`` picks ``S`` (§0x0AB),
  then the bounds are balanced.
* :func:`auto` -- the backend's choice: untuned, the rule of :func:`auto_splits` (about four
  programs per SM, measured on the H200), then balanced bounds.  The rule lives here only; the
  numpy backend takes it (or a tuned count, ``compiler.tune.tuned_split_policy``), and the Triton
  launch's whole decision -- the caller's splits, `attnc tune`'s winner, this rule, or one
  unsplit pass on the Gluon engine -- is ``backends/triton/split_choice.py``'s, which ``attnc
  plan`` asks too (``compiler/launch_plan.py``) and shows as a :class:`Decided` count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from attnc.compiler.errors import PlanError


def _lens(kv_lens) -> np.ndarray:
    a = np.asarray(kv_lens)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != 1 or a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise PlanError(f"kv_lens must be a 1-D integer array, got {a.dtype} {list(a.shape)}")
    bad = np.flatnonzero(a < 0)
    if len(bad):
        raise PlanError(f"kv_lens[{bad[0]}] = {int(a[bad[0]])} is negative")
    out = a.astype(np.int64)
    out.setflags(write=False)
    return out


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name} = {value!r} is not an integer")
    if value < 1:
        raise PlanError(f"{name} = {value} must be at least 1")
    return int(value)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# ---------------------------------------------------------------- the bounds
@dataclass(frozen=True, eq=False)
class SplitBounds:
    """Split slots of a batch: int64 ``starts``/``ends`` and bool ``active``, all ``[B, S_cap]``.

    ``active[b, s]`` says slot ``s`` is one of request ``b``'s configured splits (it may still
    be empty when ``T_b < S``); an inactive slot is outside the configuration and empty."""

    kv_lens: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    active: np.ndarray
    policy: str

    def __post_init__(self):
        lens = _lens(self.kv_lens)
        starts, ends = (np.asarray(getattr(self, n)) for n in ("starts", "ends"))
        active = np.asarray(self.active, bool)
        if starts.ndim != 2 or starts.shape != ends.shape or starts.shape != active.shape \
                or starts.shape[0] != lens.size:
            raise PlanError(f"split bounds need starts, ends and active of one shape [B = {lens.size}, "
                            f"S_cap]; got {list(starts.shape)}, {list(ends.shape)}, {list(active.shape)}")
        for name, a in (("starts", starts), ("ends", ends)):
            if a.size and (a.dtype == bool or not np.issubdtype(a.dtype, np.integer)):
                raise PlanError(f"split {name} must be integers, got {a.dtype}")
        object.__setattr__(self, "kv_lens", lens)
        object.__setattr__(self, "starts", _frozen(starts.astype(np.int64)))
        object.__setattr__(self, "ends", _frozen(ends.astype(np.int64)))
        object.__setattr__(self, "active", _frozen(active.copy()))

    @staticmethod
    def from_ranges(kv_lens, ranges, capacity: int | None = None, policy: str = "explicit") -> "SplitBounds":
        """Explicit bounds: ``ranges[b]`` is request ``b``'s list of active ``(start, end)``;
        slots past them (up to ``capacity``) are inactive.  Coverage is *not* checked here;
        :func:`check_coverage` (and the schedule) do that."""
        lens = _lens(kv_lens)
        cap = max([len(r) for r in ranges] + [1]) if capacity is None else _count("capacity", capacity)
        starts = np.zeros((lens.size, cap), np.int64)
        ends = np.zeros((lens.size, cap), np.int64)
        active = np.zeros((lens.size, cap), bool)
        for b, rs in enumerate(ranges):
            if len(rs) > cap:
                raise PlanError(f"request {b} has {len(rs)} splits, more than the capacity {cap}")
            starts[b, len(rs):] = ends[b, len(rs):] = lens[b]
            for s, (a, e) in enumerate(rs):
                starts[b, s], ends[b, s], active[b, s] = a, e, True
        return SplitBounds(lens, starts, ends, active, policy)

    @property
    def batch(self) -> int:
        return int(self.kv_lens.size)

    @property
    def capacity(self) -> int:
        """``S_cap``: launch slots per request (the producer grid's split axis)."""
        return int(self.starts.shape[1])

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def nonempty(self) -> np.ndarray:
        """bool [B, S_cap]: active slots that own at least one K/V row."""
        return self.active & (self.lengths > 0)

    @property
    def splits_per_request(self) -> np.ndarray:
        """Configured (active) splits of each request: int64 [B]."""
        return self.active.sum(axis=1).astype(np.int64)

    @property
    def num_splits(self) -> int | None:
        """The configured ``S`` when every request has the same count, else None."""
        per = np.unique(self.splits_per_request)
        return int(per[0]) if per.size == 1 else None

    def split_lengths(self, b: int | None = None):
        """Active split lengths of request ``b`` (a list), or of every request (a list of lists)."""
        if b is None:
            return [self.split_lengths(i) for i in range(self.batch)]
        return self.lengths[b][self.active[b]].tolist()

    def ranges(self, b: int) -> list[tuple[int, int]]:
        """Active ``(start, end)`` of request ``b`` in slot order."""
        return [(int(a), int(e)) for a, e, on in zip(self.starts[b], self.ends[b], self.active[b]) if on]

    def to_json(self) -> dict:
        return {"policy": self.policy, "kv_lens": self.kv_lens.tolist(), "capacity": self.capacity,
                "starts": self.starts.tolist(), "ends": self.ends.tolist(),
                "active": self.active.tolist(), "split_lengths": self.split_lengths()}


def check_coverage(kv_lens, starts, ends, active) -> None:
    """Every request's active ranges partition ``[0, T_b)`` exactly and disjointly, and
    inactive slots are empty; else a PlanError naming the request, the splits and positions."""
    lens = _lens(kv_lens)
    starts, ends, active = (np.asarray(a) for a in (starts, ends, active))
    for b in range(lens.size):
        T = int(lens[b])
        slots = np.arange(starts.shape[1])
        bad = slots[ends[b] < starts[b]]
        if len(bad):
            s = int(bad[0])
            raise PlanError(f"request {b}: split {s} has end {int(ends[b, s])} < start {int(starts[b, s])}")
        live = slots[(ends[b] > starts[b])]
        idle = [s for s in live if not active[b, s]]
        if idle:
            s = idle[0]
            raise PlanError(f"request {b}: inactive slot {s} claims positions [{int(starts[b, s])}, "
                            f"{int(ends[b, s])}); inactive slots must be empty")
        order = live[np.argsort(starts[b, live], kind="stable")]
        pos, prev = 0, None
        for s in order.tolist():
            a, e = int(starts[b, s]), int(ends[b, s])
            if a < pos:
                raise PlanError(f"request {b}: split {prev} [{int(starts[b, prev])}, {pos}) and split {s} "
                                f"[{a}, {e}) overlap on positions [{a}, {min(pos, e)})")
            if a > pos:
                raise PlanError(f"request {b}: positions [{pos}, {a}) are covered by no split "
                                f"(gap before split {s} [{a}, {e}))")
            pos, prev = e, s
        if pos < T:
            raise PlanError(f"request {b}: positions [{pos}, {T}) are covered by no split (T = {T})")
        if pos > T:
            raise PlanError(f"request {b}: split {prev} reads positions [{T}, {pos}) past the "
                            f"request's length T = {T}")


# ---------------------------------------------------------------- closed forms
def balanced_bounds(kv_lens, splits: int) -> tuple[np.ndarray, np.ndarray]:
    """§0x03B: ``q = T // S``, ``r = T % S``; split ``s`` starts at ``s q + min(s, r)`` and
    holds ``q + [s < r]`` rows.  Returns int64 ``starts, ends`` [B, S]."""
    lens = _lens(kv_lens)
    S = _count("splits", splits)
    q, r = (lens // S)[:, None], (lens % S)[:, None]
    s = np.arange(S)[None, :]
    starts = s * q + np.minimum(s, r)
    return starts, starts + q + (s < r)


def chunk_bounds(kv_lens, chunk: int, capacity: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fixed width ``C``: ``ceil(T_b / C)`` chunks, the last one shorter.  Returns ``starts,
    ends, active`` [B, S_cap] with ``S_cap = max_b ceil(T_b / C)`` (at least 1) unless given."""
    lens = _lens(kv_lens)
    C = _count("chunk", chunk)
    n = -(-lens // C)
    need = max(int(n.max(initial=0)), 1)
    cap = need if capacity is None else _count("capacity", capacity)
    if cap < need:
        b = int(np.argmax(n))
        raise PlanError(f"request {b} (T = {int(lens[b])}) needs {need} chunks of {C}, more than "
                        f"the capacity {cap}")
    s = np.arange(cap)[None, :]
    starts = np.minimum(s * C, lens[:, None])
    ends = np.minimum((s + 1) * C, lens[:, None])
    return starts, ends, s < n[:, None]


# ---------------------------------------------------------------- FlashAttention's heuristic
def fa_block_n(head_dim: int) -> int:
    """The split-K/V kernel's K/V block width at the pinned FlashAttention coordinate:
    256 for ``d <= 64``, 128 for ``d <= 128``, else 64 (``set_params_splitkv``)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def split_efficiencies(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                       max_splits: int = 128) -> list[tuple[int, bool, float]]:
    """``(s, eligible, eff(s))`` for ``s = 1 .. min(max_splits, N_SM, N_K)`` (§0x0AB):
    ``w(s) = G s / N_SM``, ``eff = w / ceil(w)``; ``s`` is ineligible when
    ``ceil(N_K / s) == ceil(N_K / (s - 1))`` (the extra split would be empty).  Arithmetic is
    float32 like the C++ source, so ties round the same way."""
    cap = min(max_splits, num_sms, num_n_blocks)
    out = []
    for s in range(1, cap + 1):
        eligible = s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))
        w = np.float32(batch_nheads_mblocks * s) / np.float32(num_sms)
        eff = float(w / np.ceil(w)) if eligible else 0.0
        out.append((s, eligible, eff))
    return out


@functools.lru_cache(maxsize=1024)  # a pure function of a few ints, asked again at every decode step
def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                         max_splits: int = 128, fraction: float = 0.85,
                         fill_exit: float | None = 0.8) -> int:
    """FlashAttention's ``num_splits_heuristic`` (§0x0AB; fixture ``fa_split_heuristic``):
    among eligible ``s``, the smallest with ``eff(s) >= fraction * max eff``.  ``fill_exit``
    is the pinned source's early return (``G >= 0.8 N_SM`` -> 1 split: the unsplit grid
    already almost fills the device); ``None`` evaluates the candidates regardless."""
    G = _count("batch_nheads_mblocks", batch_nheads_mblocks)
    n_sm = _count("num_sms", num_sms)
    if fill_exit is not None and np.float32(G) >= np.float32(fill_exit) * np.float32(n_sm):
        return 1
    table = split_efficiencies(G, n_sm, int(num_n_blocks), _count("max_splits", max_splits))
    best = max((eff for _, ok, eff in table if ok), default=0.0)
    for s, ok, eff in table:
        if ok and eff >= fraction * best:
            return s
    return 1


@dataclass(frozen=True)
class Occupancy:
    """What the heuristic reads from the call and the device.

    ``num_sms`` is the physical SM count; FlashAttention passes ``num_sms * ctas_per_sm``
    (= 2: "128 threads per block") as the effective ``N_SM``.  ``G`` is the unsplit
    producer-block count ``B H M_q`` with ``M_q = ceil(q_len / block_m)`` (§0x0AB);
    ``pack_gqa`` packs the G query heads of a K/V head into the row axis (FlashAttention's
    decode swap): ``H = H_kv``, rows ``= q_len * H_q / H_kv``."""

    num_sms: int
    heads_q: int
    heads_kv: int | None = None
    q_len: int = 1
    head_dim: int = 128
    block_n: int | None = None
    block_m: int = 64
    ctas_per_sm: int = 2
    max_splits: int = 128
    pack_gqa: bool = False
    tiles: int | None = None  # the split launch's query tiles (auto); None: one per request (decode)

    def producer_blocks(self, batch: int) -> int:
        heads_kv = self.heads_kv or self.heads_q
        if self.pack_gqa:
            heads, rows = heads_kv, self.q_len * (self.heads_q // heads_kv)
        else:
            heads, rows = self.heads_q, self.q_len
        return batch * heads * -(-rows // self.block_m)

    def kv_blocks(self, max_len: int) -> int:
        bn = self.block_n or fa_block_n(self.head_dim)
        return -(-max_len // bn)

    @property
    def effective_sms(self) -> int:
        return self.num_sms * self.ctas_per_sm


def occupancy_for(program, q_lens, num_sms: int, **overrides) -> Occupancy:
    """What the split heuristic reads for a call of ``program`` with per-request ``q_lens``
    query rows on ``num_sms`` SMs; ``overrides`` replace fields."""
    q = np.asarray(q_lens, np.int64)
    base = dict(num_sms=num_sms, heads_q=program.heads_q, heads_kv=program.heads_kv,
                q_len=max(int(q.max(initial=1)), 1), head_dim=program.d_qk,
                tiles=query_tiles(q, auto_block_q(program.group, q)))
    return Occupancy(**{**base, **overrides})


# ---------------------------------------------------------------- auto's untuned rule
# Programs a split launch aims for per SM, the most splits, and the K/V block the rule counts in
# (the Triton split producer's untuned tile; ``backends/triton/decode.py``'s default_decode_config
# cites the H200 rows behind each number).
PROGRAMS_PER_SM = 4
MAX_SPLITS = 128
AUTO_BLOCK_N = 64


def auto_block_q(group: int, q_lens, interpreter: bool = False) -> int:
    """Query rows per tile of a split call: 1 when every request has one row (decode: the tile
    is the request); else enough rows that a tile of rows x the G heads of a K/V head fills a
    16-row dot (64 rows on a GPU, 16 in Triton's interpreter), never more than the longest
    request needs."""
    q_lens = np.asarray(q_lens, np.int64)
    if q_lens.size and np.all(q_lens == 1):
        return 1
    g_pad = 1 << max(int(group) - 1, 0).bit_length()
    target = 16 if interpreter else 64
    longest = 1 << max(int(q_lens.max(initial=1)) - 1, 0).bit_length()
    return max(16 // g_pad, 1, min(target // g_pad, longest))


def query_tiles(q_lens, block_q: int) -> int:
    """The split launch's query tiles: ``sum_b ceil(q_lens[b] / block_q)`` (one per request for
    decode)."""
    q = np.asarray(q_lens, np.int64)
    if q.size and np.all(q == 1):
        return int(q.size)
    return int((-(-q // block_q)).sum())


def auto_splits(heads_kv: int, tiles: int, longest: int, num_sms: int, block_n: int = AUTO_BLOCK_N) -> int:
    """``split = auto`` untuned: about ``PROGRAMS_PER_SM`` programs per SM, a program per (query
    tile, K/V head, split): ``round(4 * num_sms / (tiles * H_kv))``, at least 1, at most the
    longest request's ``block_n``-row blocks and ``MAX_SPLITS``."""
    most = -(-max(int(longest), 1) // int(block_n))
    want = PROGRAMS_PER_SM * int(num_sms) / max(int(tiles) * int(heads_kv), 1)
    return min(max(int(want + 0.5), 1), max(min(most, MAX_SPLITS), 1))


# ---------------------------------------------------------------- policies
@dataclass(frozen=True)
class Balanced:
    splits: int

    def __post_init__(self):
        _count("splits", self.splits)

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        lens = _lens(kv_lens)
        starts, ends = balanced_bounds(lens, self.splits)
        return SplitBounds(lens, starts, ends, np.ones(starts.shape, bool), str(self))

    def __str__(self):
        return f"balanced({self.splits})"


@dataclass(frozen=True)
class Chunk:
    size: int
    capacity: int | None = None

    def __post_init__(self):
        _count("chunk", self.size)
        if self.capacity is not None:
            _count("capacity", self.capacity)

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        lens = _lens(kv_lens)
        starts, ends, active = chunk_bounds(lens, self.size, self.capacity)
        return SplitBounds(lens, starts, ends, active, str(self))

    def __str__(self):
        return f"chunk({self.size})" if self.capacity is None else f"chunk({self.size}, {self.capacity})"


@dataclass(frozen=True)
class Capacity:
    splits: int
    capacity: int

    def __post_init__(self):
        _count("splits", self.splits)
        _count("capacity", self.capacity)
        if self.capacity < self.splits:
            raise PlanError(f"split capacity {self.capacity} is smaller than the split count {self.splits}")

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        lens = _lens(kv_lens)
        s0, e0 = balanced_bounds(lens, self.splits)
        pad = np.repeat(lens[:, None], self.capacity - self.splits, axis=1)
        starts, ends = np.hstack([s0, pad]), np.hstack([e0, pad])
        active = np.arange(self.capacity)[None, :] < self.splits
        return SplitBounds(lens, starts, ends, np.broadcast_to(active, starts.shape), str(self))

    def __str__(self):
        return f"capacity({self.splits}, {self.capacity})"


@dataclass(frozen=True)
class Heuristic:
    fraction: float = 0.85
    fill_exit: float | None = 0.8

    def __post_init__(self):
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise PlanError(f"heuristic fraction = {f!r} must be in (0, 1]")

    def choose(self, kv_lens, occupancy: Occupancy | None) -> int:
        """The split count for this call."""
        if occupancy is None:
            raise PlanError(f"split = {self} needs the launch occupancy (num_sms, heads): "
                            "pass an Occupancy")
        lens = _lens(kv_lens)
        if lens.size == 0:
            return 1
        return num_splits_heuristic(occupancy.producer_blocks(lens.size), occupancy.effective_sms,
                                    occupancy.kv_blocks(int(lens.max())), occupancy.max_splits,
                                    self.fraction, self.fill_exit)

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        lens = _lens(kv_lens)
        b = Balanced(self.choose(lens, occupancy)).bounds(lens)
        return SplitBounds(b.kv_lens, b.starts, b.ends, b.active, f"{self} -> balanced({b.capacity})")

    def __str__(self):
        return f"heuristic({self.fraction:g})"


@dataclass(frozen=True)
class Auto:
    """``auto`` untuned: :func:`auto_splits`'s count for the occupancy, balanced (a backend that
    has a tuned or an engine's count plans with that instead: :class:`Decided`, or
    ``compiler.tune.tuned_split_policy``'s ``balanced(S)``)."""

    def choose(self, kv_lens, occupancy: Occupancy | None) -> int:
        if occupancy is None:
            raise PlanError("split = auto needs the launch occupancy (num_sms, heads): pass an Occupancy")
        lens = _lens(kv_lens)
        if lens.size == 0:
            return 1
        tiles = lens.size if occupancy.tiles is None else occupancy.tiles
        return auto_splits(occupancy.heads_kv or occupancy.heads_q, tiles, int(lens.max()), occupancy.num_sms,
                           occupancy.block_n or AUTO_BLOCK_N)

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        lens = _lens(kv_lens)
        b = Balanced(self.choose(lens, occupancy)).bounds(lens)
        return SplitBounds(b.kv_lens, b.starts, b.ends, b.active, f"auto -> balanced({b.capacity})")

    def __str__(self):
        return "auto"


@dataclass(frozen=True)
class Decided:
    """A split count a backend's launch decided for ``split = auto`` (``attnc tune``'s winner, the
    untuned rule, or one unsplit pass on an engine that does not split), as balanced bounds;
    ``why`` names the decision in the bounds' policy (``auto (tuned) -> balanced(8)``).  What
    ``attnc plan`` plans with to report a launch (``compiler/launch_plan.py``)."""

    splits: int
    why: str = "auto"

    def __post_init__(self):
        _count("splits", self.splits)

    def bounds(self, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
        b = Balanced(self.splits).bounds(kv_lens)
        return SplitBounds(b.kv_lens, b.starts, b.ends, b.active, f"{self.why} -> balanced({self.splits})")

    def __str__(self):
        return f"{self.why} -> balanced({self.splits})"


SplitPolicy = Balanced | Chunk | Capacity | Heuristic | Auto | Decided


def balanced(S: int) -> Balanced:
    return Balanced(S)


def chunk(C: int, capacity: int | None = None) -> Chunk:
    return Chunk(C, capacity)


def capacity(S: int, S_cap: int) -> Capacity:
    return Capacity(S, S_cap)


def heuristic(f: float = 0.85) -> Heuristic:
    return Heuristic(f)


def auto() -> Auto:
    """The untuned ``auto`` (see :class:`Auto`)."""
    return Auto()


# ``split = <kind>(...)`` -> its policy, built from the arguments by their declared names
# (``compiler/policies.py``: the policies' fields are the table's parameter names)
POLICY_CLASSES = {"auto": Auto, "balanced": Balanced, "chunk": Chunk, "capacity": Capacity, "heuristic": Heuristic}


def from_ir(split) -> SplitPolicy:
    """The policy of an ``ir.Split``: its class for ``kind``, built from ``params`` by name."""
    kind = getattr(split.kind, "value", split.kind)
    if kind not in POLICY_CLASSES:
        raise PlanError(f"unknown split policy {kind!r}")
    return POLICY_CLASSES[kind](**split.params)


def split_bounds(policy: SplitPolicy, kv_lens, occupancy: Occupancy | None = None) -> SplitBounds:
    """The split bounds of ``kv_lens`` under ``policy``."""
    return policy.bounds(kv_lens, occupancy)
