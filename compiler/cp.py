"""Context parallelism at plan time: which rank owns which tokens, what each rank computes and
which K/V it receives (issue 19).  Nothing here needs torch or a GPU: ``attnc plan --ranks N`` and
``bench/cp_study.py`` run it alone; ``attnc.distributed`` runs a plan over torch.distributed.

A call of B requests of S tokens each (S_q = S_k = S: the tokens are the query rows and the
keys) is cut into tiles of ``block`` tokens, and the call's tile plan (``compiler.plan``: SKIP /
PARTIAL / FULL per (query tile, key tile)) says which pairs are computed.  A rank owns whole
tiles: the query rows, keys, values and mask-tensor entries of their tokens, cut the same way in
every request.  Rank r computes the rows it owns against every key tile that one of those rows
does not SKIP; a key tile another rank owns is sent to r, exactly those tiles and once.  A
rank's cost is its computed cells (the non-SKIP tiles' areas over requests and heads: what the
kernels compute, not the tokens it holds); its traffic is the K/V bytes it receives and sends.

Strategies (tiles -> owner):

* ``even``     token-even contiguous ranges: the baseline a mask-blind split gives.
* ``zigzag``   2N equal chunks, rank r takes chunks r and 2N-1-r: causal's pairing (each rank
  gets a short and a long stretch of rows, and the same tokens).
* ``balanced`` N contiguous ranges whose busiest has at most ``1 + slack`` times the least
  possible work; among those, the ones whose worst cut the fewest needed key tiles cross
  (document boundaries where documents allow: document-aware cuts; sliding windows: only the
  neighbour's last window crosses), then the cuts closest to r/N of the work.
* ``auto``     every strategy above, then the least imbalance (within ``AUTO_TOLERANCE`` of the
  best), then the least K/V received by the busiest receiver, then the most even tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np

from . import inputs, ir, resources
from .analysis.ledger import dtype_bytes
from .analysis.partition import BALANCE_SLACK, balanced_owner, cut_crossings, even_owner, zigzag_owner
from .analysis.tiles import SKIP, TilePlan
from .errors import InputError, PlanError
from .plan import plan as tile_plan

STRATEGIES = ("even", "zigzag", "balanced")
DEFAULT_BLOCK = 128
AUTO_TOLERANCE = 0.02  # auto: strategies within this of the least imbalance count as balanced
MAX_TILE_PAIRS = 1 << 30  # the plan holds one byte per (request', head', query tile, key tile)


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Assessment:
    """One assignment of tiles to ranks, with what it costs."""

    strategy: str
    owner: np.ndarray  # int32 [T]
    work: np.ndarray  # int64 [N] computed cells
    tokens: np.ndarray  # int64 [N] tokens (per request)
    need: np.ndarray  # bool [N, T]: key tiles each rank computes against (its own included)
    traffic: np.ndarray  # int64 [N, N]: tokens of K/V rank s sends rank r (traffic[s, r]; s != r)

    @property
    def imbalance(self) -> float:
        """max / mean computed cells per rank (1.0 when nothing is computed)."""
        mean = self.work.mean()
        return float(self.work.max() / mean) if mean > 0 else 1.0

    @property
    def token_imbalance(self) -> float:
        return float(self.tokens.max() / self.tokens.mean())


def _assess(strategy: str, owner: np.ndarray, row_work: np.ndarray, needed: np.ndarray,
            lens: np.ndarray, ranks: int) -> Assessment:
    tiles = len(owner)
    work = np.zeros(ranks, np.int64)
    np.add.at(work, owner, row_work)
    tokens = np.zeros(ranks, np.int64)
    np.add.at(tokens, owner, lens)
    need = np.zeros((ranks, tiles), bool)
    for r, t0, t1 in _segments(owner):
        need[r] |= needed[t0:t1].any(axis=0)
    traffic = np.zeros((ranks, ranks), np.int64)
    for r in range(ranks):
        foreign = need[r] & (owner != r)
        np.add.at(traffic[:, r], owner[foreign], lens[foreign])
    return Assessment(strategy, owner, work, tokens, need, traffic)


def _segments(owner: np.ndarray) -> list[tuple[int, int, int]]:
    """(rank, first tile, end tile) of every maximal run of one owner, in tile order."""
    if owner.size == 0:
        return []
    starts = np.flatnonzero(np.diff(owner)) + 1
    bounds = np.concatenate([[0], starts, [owner.size]])
    return [(int(owner[a]), int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _choose(candidates: dict[str, Assessment]) -> str:
    """auto: the least imbalance within AUTO_TOLERANCE, then the least K/V into the busiest
    receiver, then the most even tokens, then the order of STRATEGIES."""
    best = min(a.imbalance for a in candidates.values())
    eligible = [n for n in STRATEGIES if candidates[n].imbalance <= best * (1 + AUTO_TOLERANCE)]
    return min(eligible, key=lambda n: (int(candidates[n].traffic.sum(axis=0).max()),
                                        candidates[n].token_imbalance, STRATEGIES.index(n)))


@dataclass(frozen=True, eq=False)
class CPPlan:
    """A context-parallel plan: tile ownership, per-rank computed cells and K/V traffic, and for
    ``attnc.distributed`` each rank's blocks (query segment x key run) and messages."""

    program: ir.Program = field(repr=False)
    batch: int
    seq_len: int
    ranks: int
    block: int
    chosen: Assessment = field(repr=False)
    candidates: dict = field(repr=False)  # strategy -> Assessment
    classes: np.ndarray = field(repr=False)  # int8 [B', H', T, T]: the call's tile classes
    tensors: dict = field(repr=False)  # the mask's tensors, validated (whole sequence)
    requested: str = "auto"
    _block_args: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (rows, keys) -> block_args

    @property
    def lengths(self) -> tuple[int, int]:
        """The whole call's (S_q, S_k): what a spec's S_q and S_k mean in every block."""
        return self.seq_len, self.seq_len

    # ------------------------------------------------------------ sizes
    @property
    def strategy(self) -> str:
        return self.chosen.strategy

    @property
    def owner(self) -> np.ndarray:
        return self.chosen.owner

    @property
    def tiles(self) -> int:
        return int(self.owner.size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token position over the batch and the K/V heads."""
        p = self.program
        return self.batch * p.heads_kv * (p.d_qk + p.d_v) * dtype_bytes(p.dtype)

    @property
    def work(self) -> np.ndarray:
        return self.chosen.work

    @property
    def tokens(self) -> np.ndarray:
        return self.chosen.tokens

    @property
    def imbalance(self) -> float:
        return self.chosen.imbalance

    @property
    def recv_bytes(self) -> np.ndarray:
        return self.chosen.traffic.sum(axis=0) * self.kv_bytes_per_token

    @property
    def send_bytes(self) -> np.ndarray:
        return self.chosen.traffic.sum(axis=1) * self.kv_bytes_per_token

    def tile_range(self, t0: int, t1: int) -> tuple[int, int]:
        """Token range of tiles [t0, t1)."""
        return t0 * self.block, min(t1 * self.block, self.seq_len)

    def tile_tokens(self, t0: int, t1: int) -> int:
        """Tokens in tiles [t0, t1)."""
        s0, s1 = self.tile_range(t0, t1)
        return s1 - s0

    # ------------------------------------------------------------ one rank's shard
    def segments(self, rank: int) -> list[tuple[int, int]]:
        """The tile ranges rank owns, in order (its shard is their tokens, concatenated)."""
        return [(a, b) for r, a, b in _segments(self.owner) if r == rank]

    def token_ranges(self, rank: int) -> list[tuple[int, int]]:
        return [self.tile_range(a, b) for a, b in self.segments(rank)]

    def positions(self, rank: int) -> np.ndarray:
        """The absolute token positions of rank's shard, in shard order (for rotary embeddings)."""
        ranges = self.token_ranges(rank)
        return np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else np.zeros(0, np.int64)

    def shard_offset(self, rank: int, t0: int) -> int:
        """Where tile t0 (owned by ``rank``) starts in rank's shard."""
        at = 0
        for a, b in self.segments(rank):
            if a <= t0 < b:
                return at + (t0 - a) * self.block
            at += self.tile_tokens(a, b)
        raise PlanError(f"tile {t0} is not rank {rank}'s")

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """(owner, first tile, end tile) of every run of key tiles rank computes against: its own
        and the ones it receives, each within one owner's segment, in tile order."""
        need = self.chosen.need[rank]
        out = []
        for r, a, b in _segments(self.owner):
            idx = np.flatnonzero(need[a:b])
            if idx.size:
                breaks = np.flatnonzero(np.diff(idx) > 1) + 1
                for part in np.split(idx, breaks):
                    out.append((r, a + int(part[0]), a + int(part[-1]) + 1))
        return out

    def sends(self, rank: int) -> dict[int, list[tuple[int, int]]]:
        """dst -> the runs of rank's key tiles that dst needs (never empty lists)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for dst in range(self.ranks):
            if dst != rank:
                mine = [(a, b) for r, a, b in self.runs(dst) if r == rank]
                if mine:
                    out[dst] = mine
        return out

    def block_args(self, rows: tuple[int, int], keys: tuple[int, int]) -> dict | None:
        """The block kernels' plan for query tiles ``rows`` against key tiles ``keys``: their tile
        lists (the numpy kernel's CSR), ``classes`` (the sub-array of tile classes, int8 [B', H',
        rows, keys]), the positions of the block's first row and key (``q_offset``, ``k_offset``),
        the whole call's ``lengths`` (S_q, S_k) and a partial-state result; None where every tile
        is SKIP.  Made once per (rows, keys) and cached on the plan: callers must not change it (the
        Triton backend keeps the block's launches in it, under "_triton": ``backends/triton/blocks.py``)."""
        key = (tuple(rows), tuple(keys))
        if key in self._block_args:
            return self._block_args[key]
        (i0, i1), (j0, j1) = key
        sub = np.ascontiguousarray(self.classes[:, :, i0:i1, j0:j1])
        if not (sub != SKIP).any():
            self._block_args[key] = None
            return None
        tp = TilePlan.from_classes(sub, self.block, self.block, "cp")
        args = {"block_m": self.block, "block_n": self.block, "plan_b": sub.shape[0], "plan_h": sub.shape[1],
                "q_tiles": i1 - i0, "partial_indptr": tp.partial_indptr, "partial_indices": tp.partial_indices,
                "full_indptr": tp.full_indptr, "full_indices": tp.full_indices, "mask_from_intervals": False,
                "mask_from_rows": False, "q_offset": i0 * self.block, "k_offset": j0 * self.block,
                "lengths": self.lengths, "classes": sub, "partial_state": True}
        self._block_args[key] = args
        return args

    def needs(self, rows: tuple[int, int], keys: tuple[int, int]) -> bool:
        """Whether query tiles ``rows`` compute against any of key tiles ``keys``."""
        return bool((self.classes[:, :, rows[0]:rows[1], keys[0]:keys[1]] != SKIP).any())

    def digest(self) -> str:
        """What every rank must agree on: the spec, the call's shape, the tensors, the owners."""
        h = hashlib.sha256()
        h.update(ir.digest(self.program).encode())
        h.update(repr((self.batch, self.seq_len, self.ranks, self.block, self.strategy)).encode())
        for name in sorted(self.tensors):
            h.update(name.encode())
            h.update(np.ascontiguousarray(self.tensors[name]).tobytes())
        h.update(self.owner.tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------ reports (`attnc plan --ranks`)
    def report(self) -> dict:
        p = self.program
        a = self.chosen
        recv, send = self.recv_bytes, self.send_bytes
        return {
            "name": p.name, "batch": self.batch, "seq_len": self.seq_len, "ranks": self.ranks,
            "block": self.block, "strategy": self.strategy, "requested": self.requested,
            "heads_q": p.heads_q, "heads_kv": p.heads_kv, "d_qk": p.d_qk, "d_v": p.d_v, "dtype": p.dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "imbalance": a.imbalance, "token_imbalance": a.token_imbalance,
            "computed_cells": a.work.tolist(), "tokens": a.tokens.tolist(),
            "segments": [[list(r) for r in self.token_ranges(rank)] for rank in range(self.ranks)],
            "recv_bytes": recv.tolist(), "send_bytes": send.tolist(), "total_bytes": int(recv.sum()),
            "peers": [[int(s) for s in np.flatnonzero(a.traffic[:, r])] for r in range(self.ranks)],
            "candidates": {n: _summary(c, self.kv_bytes_per_token) for n, c in self.candidates.items()},
        }

    def text(self) -> str:
        r = self.report()
        n = lambda x: f"{x:,}"  # noqa: E731
        lines = [f"context-parallel plan {r['name']}: B={r['batch']} x S={n(r['seq_len'])} tokens over "
                 f"{r['ranks']} rank(s), tiles of {r['block']}; heads {r['heads_q']}/{r['heads_kv']}, "
                 f"head_dim {r['d_qk']}/{r['d_v']}, {r['dtype']} (K/V {n(r['kv_bytes_per_token'])} B per token)",
                 f"strategy {r['strategy']}" + (" (auto)" if r["requested"] == "auto" else ""),
                 f"  {'rank':>4} {'tokens':>10} {'computed cells':>18} {'recv K/V B':>15} {'send K/V B':>15}"
                 f"  segments (tokens); receives from"]
        for k in range(self.ranks):
            segs = " ".join(f"{a}:{b}" for a, b in r["segments"][k]) or "-"
            peers = ",".join(str(s) for s in r["peers"][k]) or "-"
            lines.append(f"  {k:>4} {n(r['tokens'][k]):>10} {n(r['computed_cells'][k]):>18} "
                         f"{n(r['recv_bytes'][k]):>15} {n(r['send_bytes'][k]):>15}  {segs}; {peers}")
        lines.append(f"imbalance (max/mean computed cells) {r['imbalance']:.3f}; tokens max/mean "
                     f"{r['token_imbalance']:.3f}; K/V moved {n(r['total_bytes'])} B, at most "
                     f"{n(max(r['recv_bytes']))} B into one rank")
        lines.append("strategies: " + "; ".join(
            f"{name} {c['imbalance']:.3f} (max recv {n(c['max_recv_bytes'])} B)"
            for name, c in r["candidates"].items()))
        return "\n".join(lines) + "\n"


def _summary(a: Assessment, per_token: int) -> dict:
    recv = a.traffic.sum(axis=0) * per_token
    return {"imbalance": a.imbalance, "token_imbalance": a.token_imbalance,
            "max_recv_bytes": int(recv.max()), "total_bytes": int(recv.sum())}


def validated_tensors(program: ir.Program, batch: int, seq_len: int, tensors: dict) -> dict[str, np.ndarray]:
    """The mask's tensors for the whole call, checked as ``inputs.validate`` checks a call's."""
    missing = [t.name for t in program.tensors if t.name not in tensors]
    if missing:
        raise InputError(f"inputs: missing tensor '{missing[0]}' (spec '{program.name}' reads it; a "
                         "context-parallel plan takes the whole sequence's values)")
    slim = replace(inputs.contiguous_variant(program), d_qk=1, d_v=1, cache=ir.Cache())
    shell = {"q": np.zeros((batch, program.heads_q, 1, 1), np.float32),
             "k": np.zeros((batch, program.heads_kv, seq_len, 1), np.float32),
             "v": np.zeros((batch, program.heads_kv, seq_len, 1), np.float32)}
    return inputs.validate(slim, {**shell, **{n: np.asarray(t) for n, t in tensors.items()}}).tensors


@dataclass(frozen=True)
class TileCosts:
    """A call's tile plan reduced to what an assignment reads; made once per call shape and
    mask tensors, assessed for any number of ranks (``plan_cp(..., costs=)``)."""

    program: ir.Program = field(repr=False)
    batch: int
    seq_len: int
    block: int
    classes: np.ndarray = field(repr=False)  # int8 [B', H', T, T]
    tensors: dict = field(repr=False)  # validated, whole sequence
    lens: np.ndarray = field(repr=False)  # int64 [T]: tokens per tile
    row_work: np.ndarray = field(repr=False)  # int64 [T]: computed cells of each query tile (all requests, heads)
    needed: np.ndarray = field(repr=False)  # bool [T, T]: (query tile, key tile) computed for some request/head

    @property
    def tiles(self) -> int:
        return int(self.lens.size)


def tile_costs(program: ir.Program, batch: int, seq_len: int, tensors: dict | None = None, *,
               block: int = DEFAULT_BLOCK) -> TileCosts:
    """The call's tile plan (``compiler.plan``, tiles of ``block`` x ``block``) and what each
    query tile computes."""
    if program.cache.kind is not ir.CacheKind.CONTIGUOUS:
        raise InputError(f"spec '{program.name}' declares a {program.cache.kind.value} K/V cache; context "
                         "parallelism shards a contiguous sequence (cache = contiguous)")
    for name, value in (("block", block), ("batch", batch), ("sequence length", seq_len)):
        if int(value) < 1:
            raise InputError(f"context parallelism needs {name} >= 1, got {value}")
    tiles = -(-seq_len // block)
    if tiles * tiles > MAX_TILE_PAIRS:
        raise PlanError(f"a context-parallel plan of S = {seq_len:,} in tiles of {block} holds {tiles:,}^2 = "
                        f"{tiles * tiles:,} tile pairs (more than {MAX_TILE_PAIRS:,}); use a block of at least "
                        f"{-(-seq_len // 32768)}")
    checked = validated_tensors(program, batch, seq_len, tensors or {})
    classes = tile_plan(program, batch, seq_len, seq_len, checked, block, block).tiles.classes
    if classes.size > MAX_TILE_PAIRS:
        raise PlanError(f"the plan's tile classes hold {classes.size:,} entries ({classes.shape[0]} request(s) x "
                        f"{classes.shape[1]} head(s) x {tiles:,}^2 tiles), more than {MAX_TILE_PAIRS:,}; "
                        "use a larger block")
    lens = np.full(tiles, block, np.int64)
    lens[-1] = seq_len - block * (tiles - 1)
    computed = classes != SKIP
    keys = np.count_nonzero(computed, axis=-1).astype(np.int64) * block - computed[..., -1] * (block - lens[-1])
    mult = (batch if classes.shape[0] == 1 else 1) * (program.heads_q if classes.shape[1] == 1 else 1)
    row_work = (keys * lens).sum(axis=(0, 1)) * mult
    needed = computed.any(axis=(0, 1))
    return TileCosts(program, batch, seq_len, block, classes, checked, lens, row_work, needed)


def plan_cp(program: ir.Program, batch: int, seq_len: int, ranks: int, tensors: dict | None = None, *,
            block: int = DEFAULT_BLOCK, strategy: str = "auto", slack: float = BALANCE_SLACK,
            costs: TileCosts | None = None) -> CPPlan:
    """Plan B requests of ``seq_len`` tokens over ``ranks`` ranks (module docstring); ``costs``
    reuses a :func:`tile_costs` of the same call."""
    if strategy != "auto" and strategy not in STRATEGIES:
        raise InputError(f"unknown context-parallel strategy {strategy!r}; expected auto, {', '.join(STRATEGIES)}")
    if int(ranks) < 1:
        raise InputError(f"context parallelism needs ranks >= 1, got {ranks}")
    if not 0 <= slack < 1:
        raise InputError(f"balance slack must be in [0, 1), got {slack}")
    if costs is None:
        costs = tile_costs(program, batch, seq_len, tensors, block=block)
    elif (ir.digest(costs.program), costs.batch, costs.seq_len) != (ir.digest(program), batch, seq_len):
        raise PlanError("tile costs were made for another spec or call shape")
    c = costs
    owners = {"even": lambda: even_owner(c.tiles, ranks), "zigzag": lambda: zigzag_owner(c.tiles, ranks),
              "balanced": lambda: balanced_owner(c.row_work, cut_crossings(c.needed), ranks, slack)}
    names = STRATEGIES if strategy == "auto" else (strategy,)
    # each candidate's traffic matrix [N, N] (int64) and needed tiles [N, T] (bool)
    resources.require(f"a context-parallel plan over {ranks} ranks",
                      len(names) * (8 * int(ranks) ** 2 + int(ranks) * c.tiles))
    candidates = {n: _assess(n, owners[n](), c.row_work, c.needed, c.lens, ranks) for n in names}
    chosen = candidates[_choose(candidates) if strategy == "auto" else strategy]
    return CPPlan(program, batch, seq_len, ranks, c.block, chosen, candidates, c.classes, c.tensors, strategy)


__all__ = ["CPPlan", "Assessment", "TileCosts", "STRATEGIES", "DEFAULT_BLOCK", "plan_cp", "tile_costs",
           "validated_tensors"]
