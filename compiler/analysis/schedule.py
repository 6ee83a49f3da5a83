"""The schedule graph of a split decode (M4.5 §0x03C-§0x03I, DESIGN §4).

One ``networkx.DiGraph`` per plan, the single source of launch grids, coverage checks and
byte ledgers:

* ``("producer", b, kv_head, s)`` -- one task per (request, K/V head, split slot).  It reads
  the K/V rows ``[start, end)`` once for the G query heads that share its K/V head (its
  ``owners``; the seed's producer owner is ``(b, h_q, s)``, so a task holds G owners) and,
  for a paged cache, carries the bounded page ``segments`` of that range (§0x04E).
* ``("workspace", field)`` -- one buffer per ABI field (``partial_u``, ``partial_m``, ...)
  with its allocation ``shape`` ``[rows, H_q, S_cap(, d_v_padded)]`` and ``dtype``.
* ``("reducer", b, h_q)`` -- the output owner: merges its consumed split states.
* ``("input", name)`` / ``("output", name)`` -- Q, K, V and O, LSE.

Edges are data dependencies, each with the logical ``bytes`` it moves; workspace edges also
carry the ``slots`` written or read so exact dependencies survive the per-field buffer
nodes.  The sum of all edge bytes is the full two-launch demand of §0x03F.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from typing import Iterable

import networkx as nx
import numpy as np

from attnc.compiler.errors import PlanError

from . import ledger as L
from .layout import PAGED, KVLayout, page_segments
from .splits import SplitBounds, balanced_bounds, check_coverage, chunk_bounds

KIND_RANK = {"input": 0, "producer": 1, "workspace": 2, "reducer": 3, "output": 4}


def node_name(n: tuple) -> str:
    """A node's printable id: ``producer/0/1/3``."""
    return "/".join(str(x) for x in n)


# ---------------------------------------------------------------- building
def build(bounds: SplitBounds, call: L.DecodeCall, layout: KVLayout | None = None, q_lens=None,
          check: bool = True) -> nx.DiGraph:
    """The schedule graph of ``bounds`` for ``call`` (optionally over a concrete ``layout``,
    which adds page segments and must agree on lengths and heads).  ``check`` runs
    :func:`validate` so a gap, overlap or unwritten consumed slot is a PlanError."""
    B, Hq, Hkv, G, S_cap = bounds.batch, call.heads_q, call.heads_kv, call.group, bounds.capacity
    q = L._q_lens(q_lens, B)
    if layout is not None:
        if not np.array_equal(layout.kv_lens, bounds.kv_lens):
            raise PlanError(f"split bounds were made for kv_lens {bounds.kv_lens.tolist()}, the layout "
                            f"has {layout.kv_lens.tolist()}")
        if (layout.heads_q, layout.heads_kv) != (Hq, Hkv):
            raise PlanError(f"layout heads {layout.heads_q}/{layout.heads_kv} differ from the call's {Hq}/{Hkv}")
    ws = L.split_workspace(bounds, call, q)
    consumed = L.consumed_slots(bounds, call)
    decode_rows = bool(q.size == 0 or q.max() <= 1)
    lead = (B,) if decode_rows else (int(q.sum()),)  # decode: [B, H_q, S]; else packed rows

    g = nx.DiGraph(
        batch=B, heads_q=Hq, heads_kv=Hkv, group=G, capacity=S_cap, policy=bounds.policy,
        kv_lens=bounds.kv_lens.tolist(), q_lens=q.tolist(), abi=call.abi, d_qk=call.d_qk, d_v=call.d_v,
        d_v_padded=call.d_v_padded, reduce_capacity=call.reduce_capacity,
        layout=None if layout is None else f"{layout.kind}/{layout.order}"
        + (f"/{layout.table}" if layout is not None and layout.table else ""),
        q_dtype=call.q_dtype, cache_dtype=call.cache_dtype, out_dtype=call.out_dtype,
        lse_dtype=call.lse_dtype, write_lse=call.write_lse)

    k_name, v_name = layout.array_keys if layout is not None else ("k", "v")
    cache_b, q_b, out_b = (L.dtype_bytes(d) for d in (call.cache_dtype, call.q_dtype, call.out_dtype))
    g.add_node(("input", "q"), kind="input", tensor="q", dtype=call.q_dtype)
    g.add_node(("input", k_name), kind="input", tensor=k_name, dtype=call.cache_dtype, z="k")
    g.add_node(("input", v_name), kind="input", tensor=v_name, dtype=call.cache_dtype, z="v")
    g.add_node(("output", "o"), kind="output", tensor="o", dtype=call.out_dtype, shape=(int(q.sum()), Hq, call.d_v))
    if call.write_lse:
        g.add_node(("output", "lse"), kind="output", tensor="lse", dtype=call.lse_dtype, shape=(int(q.sum()), Hq))

    fields = call.state_fields()
    for f in fields:
        tail = (call.d_v_padded,) if f.vector else ()
        logical_tail = (call.d_v,) if f.vector else ()
        shape = lead + (Hq, S_cap) + tail
        g.add_node(("workspace", f.name), kind="workspace", field=f.name, dtype=f.dtype, vector=f.vector,
                   shape=shape, logical_shape=lead + (Hq, S_cap) + logical_tail,
                   allocated_bytes=int(np.prod(shape)) * L.dtype_bytes(f.dtype))

    paged = layout is not None and layout.kind == PAGED
    for b in range(B):
        segs_of = {}
        for s in range(S_cap):
            a, e, on = int(bounds.starts[b, s]), int(bounds.ends[b, s]), bool(bounds.active[b, s])
            rows = e - a
            empty = (not on) or rows <= 0 or q[b] == 0
            if paged and on and rows > 0:
                segs_of[s] = tuple(tuple(x) for x in page_segments(layout, b, a, e))
            for h in range(Hkv):
                owners = tuple(range(h * G, (h + 1) * G))
                node = ("producer", b, h, s)
                attrs = dict(kind="producer", b=b, kv_head=h, split=s, start=a, end=e, rows=max(rows, 0),
                             active=on, empty=empty, owners=owners, q_rows=int(q[b]))
                if paged:
                    attrs["segments"] = segs_of.get(s, ())
                g.add_node(node, **attrs)
                if not empty:
                    n_own = len(owners) * int(q[b])
                    g.add_edge(("input", "q"), node, kind="load", bytes=n_own * call.d_qk * q_b)
                    for name, d in ((k_name, call.d_qk), (v_name, call.d_v)):
                        g.add_edge(("input", name), node, kind="load", bytes=rows * len(owners) * d * cache_b,
                                   unique_bytes=rows * d * cache_b)
                if consumed[b, s]:
                    for f in fields:
                        g.add_edge(node, ("workspace", f.name), kind="write", identity=empty,
                                   slots={"b": b, "heads": owners, "splits": (s,)},
                                   bytes=len(owners) * int(q[b]) * f.bytes_per_state(call.d_v))
        splits = tuple(int(s) for s in np.flatnonzero(consumed[b]))
        nonempty = int(sum(bounds.nonempty[b, s] for s in splits)) if q[b] else 0
        for hq in range(Hq):
            node = ("reducer", b, hq)
            g.add_node(node, kind="reducer", b=b, h_q=hq, kv_head=hq // G, splits=splits, q_rows=int(q[b]),
                       nonempty_states=nonempty, identity_bypasses=(len(splits) - nonempty) * int(q[b]),
                       merges=max(nonempty - 1, 0) * int(q[b]))
            for f in fields:
                g.add_edge(("workspace", f.name), node, kind="read", slots={"b": b, "heads": (hq,), "splits": splits},
                           bytes=len(splits) * int(q[b]) * f.bytes_per_state(call.d_v))
            g.add_edge(node, ("output", "o"), kind="store", bytes=int(q[b]) * call.d_v * out_b)
            if call.write_lse:
                g.add_edge(node, ("output", "lse"), kind="store",
                           bytes=int(q[b]) * L.dtype_bytes(call.lse_dtype))
    g.graph["workspace_logical_bytes"] = ws.logical
    g.graph["workspace_capacity_bytes"] = ws.capacity
    if check:
        validate(g)
    return g


def plan_schedule(policy, call: L.DecodeCall, layout_or_kv_lens, q_lens=None, occupancy=None) -> nx.DiGraph:
    """Split ``layout_or_kv_lens`` (a ``KVLayout`` or lengths) with ``policy``, then :func:`build`."""
    layout = layout_or_kv_lens if isinstance(layout_or_kv_lens, KVLayout) else None
    lens = layout.kv_lens if layout is not None else layout_or_kv_lens
    return build(policy.bounds(lens, occupancy), call, layout, q_lens)


# ---------------------------------------------------------------- queries
def nodes_of(g: nx.DiGraph, kind: str) -> list[tuple]:
    """Nodes of one kind in deterministic order."""
    return sorted(n for n, k in g.nodes(data="kind") if k == kind)


def launch_grids(g: nx.DiGraph) -> dict[str, tuple[int, ...]]:
    """Teaching launch grids (§0x03C): the producer grid ``[B, H_q, S_cap]`` (one conceptual
    owner per (b, h_q, s)), the GQA-packed grid ``[B, H_kv, S_cap]`` of the producer task
    nodes, and the reducer grid ``[B, H_q]``.  Derived from the nodes present."""
    prods, reds = nodes_of(g, "producer"), nodes_of(g, "reducer")
    b_n = 1 + max((n[1] for n in prods + reds), default=-1)
    kv_n = 1 + max((n[2] for n in prods), default=-1)
    s_n = 1 + max((n[3] for n in prods), default=-1)
    hq_n = 1 + max((n[2] for n in reds), default=-1)
    if len(prods) != b_n * kv_n * s_n or len(reds) != b_n * hq_n:
        raise PlanError("the schedule's producer/reducer nodes do not form a dense grid")
    return {"producer": (b_n, hq_n, s_n), "producer_tasks": (b_n, kv_n, s_n), "reducer": (b_n, hq_n)}


def owner_counts(g: nx.DiGraph) -> dict[str, int]:
    """Owner ledger (§0x03C, §0x03G): conceptual producer owners (b, h_q, s), how many own
    a non-empty range, how many are empty or inactive (identity writers), reducer owners,
    identity bypasses in the reducers' validity branch, and non-empty binary merges."""
    prods = [d for _, d in g.nodes(data=True) if d["kind"] == "producer"]
    reds = [d for _, d in g.nodes(data=True) if d["kind"] == "reducer"]
    total = sum(len(d["owners"]) for d in prods)
    active = sum(len(d["owners"]) for d in prods if not d["empty"])
    return {"producer_owners": total, "active_owners": active, "empty_or_inactive_owners": total - active,
            "producer_tasks": len(prods), "reducer_owners": len(reds),
            "identity_bypasses": sum(d["identity_bypasses"] for d in reds),
            "nonempty_binary_merges": sum(d["merges"] for d in reds)}


def split_lengths(g: nx.DiGraph, b: int) -> list[int]:
    """Request ``b``'s active split lengths, from its K/V head 0 producer tasks."""
    return [g.nodes[n]["rows"] for n in nodes_of(g, "producer")
            if n[1] == b and n[2] == 0 and g.nodes[n]["active"]]


def dependencies(g: nx.DiGraph, reducer: tuple) -> list[tuple]:
    """The producer tasks whose written slots a reducer reads (exact, through slot sets)."""
    wants = set()
    for ws, _, d in g.in_edges(reducer, data=True):
        wants |= {(d["slots"]["b"], h, s) for h in d["slots"]["heads"] for s in d["slots"]["splits"]}
    out = set()
    for ws in g.predecessors(reducer):
        for p, _, d in g.in_edges(ws, data=True):
            slots = {(d["slots"]["b"], h, s) for h in d["slots"]["heads"] for s in d["slots"]["splits"]}
            if slots & wants:
                out.add(p)
    return sorted(out)


def validate(g: nx.DiGraph) -> None:
    """Exact coverage and disjointness of every (request, K/V head)'s split ranges; every
    query head owned once per slot; every consumed workspace slot written by a producer of
    every ABI field; acyclic.  Any break is a PlanError naming request and positions."""
    if not nx.is_directed_acyclic_graph(g):
        raise PlanError("the schedule graph has a cycle")
    B, Hq, cap = g.graph["batch"], g.graph["heads_q"], g.graph["capacity"]
    lens = np.asarray(g.graph["kv_lens"], np.int64)
    by_head: dict[int, dict[int, dict]] = {}
    owners: dict[tuple[int, int], list[int]] = {}
    for n, d in g.nodes(data=True):
        if d["kind"] != "producer":
            continue
        by_head.setdefault(d["kv_head"], {}).setdefault(d["b"], {})[d["split"]] = d
        owners.setdefault((d["b"], d["split"]), []).extend(d["owners"])
    for h, per_b in sorted(by_head.items()):
        starts = np.zeros((B, cap), np.int64)
        ends = np.zeros((B, cap), np.int64)
        active = np.zeros((B, cap), bool)
        for b, slots in per_b.items():
            for s, d in slots.items():
                starts[b, s], ends[b, s], active[b, s] = d["start"], d["end"], d["active"]
        try:
            check_coverage(lens, starts, ends, active)
        except PlanError as err:
            raise PlanError(f"K/V head {h}: {err.diagnostics[0].message}") from None
    for (b, s), hs in sorted(owners.items()):
        if sorted(hs) != list(range(Hq)):
            raise PlanError(f"request {b}, split {s}: query heads {sorted(hs)} are not owned exactly once")
    written: dict[str, set] = {}
    for p, ws, d in g.edges(data=True):
        if d.get("kind") == "write":
            written.setdefault(ws[1], set()).update(
                (d["slots"]["b"], h, s) for h in d["slots"]["heads"] for s in d["slots"]["splits"])
    for ws, r, d in g.edges(data=True):
        if d.get("kind") == "read":
            missing = sorted((d["slots"]["b"], h, s) for h in d["slots"]["heads"] for s in d["slots"]["splits"]
                             if (d["slots"]["b"], h, s) not in written.get(ws[1], set()))
            if missing:
                b, h, s = missing[0]
                raise PlanError(f"reducer (b={r[1]}, h_q={r[2]}) reads {ws[1]}[{b}, {h}, {s}], which no "
                                "producer writes (an unwritten slot would be consumed as data)")


def ledger(g: nx.DiGraph) -> L.DecodeLedger:
    """The byte ledger from the graph's edges (cross-checks :func:`ledger.decode_ledger`)."""
    tot: dict[str, int] = {}
    unique_kv = 0
    for u, v, d in g.edges(data=True):
        if u[0] == "input":
            key = "q_demand" if u[1] == "q" else "kv_demand"
            unique_kv += d.get("unique_bytes", 0) if key == "kv_demand" else 0
        elif d["kind"] == "write":
            key = "workspace_write"
        elif d["kind"] == "read":
            key = "workspace_read"
        else:
            key = "final_output" if v[1] == "o" else "final_lse"
        tot[key] = tot.get(key, 0) + d["bytes"]
    q_rows = sum(g.graph["q_lens"])
    unique_q = L.q_unique_bytes(q_rows, g.graph["heads_q"], g.graph["d_qk"], g.graph["q_dtype"])
    # unique K/V: the union of ranges per (b, K/V head); split ranges are disjoint once validated
    return L.DecodeLedger(unique_q, tot.get("q_demand", 0), unique_kv, tot.get("kv_demand", 0),
                          tot.get("workspace_write", 0), tot.get("workspace_read", 0),
                          tot.get("final_output", 0), tot.get("final_lse", 0))


@dataclass(frozen=True)
class SplitLedgers:
    """A split plan's ledgers (M4.5 §0x04, §0x08F): its workspace, the bytes its schedule moves,
    the resident metadata of its layout and the page-table lookups its producers make."""

    workspace: L.Workspace
    traffic: L.DecodeLedger
    metadata: L.MetadataLedger
    page_lookups: int


def split_ledgers(g: nx.DiGraph, bounds: SplitBounds, call: L.DecodeCall, layout: KVLayout,
                  q_lens) -> SplitLedgers:
    return SplitLedgers(L.split_workspace(bounds, call, q_lens), ledger(g), L.metadata_bytes(layout),
                        L.page_lookups(layout, bounds))


def total_edge_bytes(g: nx.DiGraph) -> int:
    return sum(d["bytes"] for _, _, d in g.edges(data=True))


def topological_order(g: nx.DiGraph) -> list[tuple]:
    """A deterministic topological order: inputs, producers, workspace, reducers, outputs,
    lexicographic within a kind."""
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (KIND_RANK[n[0]], n[1:])))


# ---------------------------------------------------------------- export
def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def to_json(g: nx.DiGraph, indent: int | None = None) -> str:
    """The graph as one JSON object: ``graph`` attributes, ``nodes`` in topological order
    (``id`` + attributes), ``edges`` (``source``, ``target`` + attributes), derived
    ``grids``, ``owners`` and ``ledger``."""
    order = topological_order(g)
    rank = {n: i for i, n in enumerate(order)}
    doc = {
        "graph": dict(g.graph),
        "grids": launch_grids(g),
        "owners": owner_counts(g),
        "ledger": ledger(g).as_dict(),
        "nodes": [{"id": node_name(n), **g.nodes[n]} for n in order],
        "edges": [{"source": node_name(u), "target": node_name(v), **d}
                  for u, v, d in sorted(g.edges(data=True), key=lambda e: (rank[e[0]], rank[e[1]]))],
    }
    return json.dumps(doc, indent=indent, default=_json_default)


def _dot_id(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(n: tuple, d: dict) -> str:
    kind = d["kind"]
    if kind == "producer":
        text = f"P b{d['b']} kv{d['kv_head']} s{d['split']}\\n[{d['start']}, {d['end']})"
        if not d["active"]:
            text += "\\ninactive"
        elif d["empty"]:
            text += "\\nempty"
        if d.get("segments"):
            text += f"\\n{len(d['segments'])} page segs"
        return text
    if kind == "reducer":
        return f"R b{d['b']} h{d['h_q']}"
    if kind == "workspace":
        return f"{d['field']}\\n{d['dtype']} {list(d['shape'])}"
    return d["tensor"]


_SHAPES = {"input": "ellipse", "producer": "box", "workspace": "cylinder", "reducer": "box",
           "output": "ellipse"}


def to_dot(g: nx.DiGraph, name: str = "schedule") -> str:
    """Plain-text Graphviz DOT (no pygraphviz), deterministic."""
    order = topological_order(g)
    rank = {n: i for i, n in enumerate(order)}
    lines = [f"digraph {_dot_id(name)} {{", "  rankdir=LR;", "  node [fontsize=10];"]
    for n in order:
        d = g.nodes[n]
        style = ', style=dashed' if d["kind"] == "producer" and d["empty"] else ""
        lines.append(f"  {_dot_id(node_name(n))} [label={_dot_id(_label(n, d))}, "
                     f"shape={_SHAPES[d['kind']]}{style}];")
    for u, v, d in sorted(g.edges(data=True), key=lambda e: (rank[e[0]], rank[e[1]])):
        lines.append(f"  {_dot_id(node_name(u))} -> {_dot_id(node_name(v))} "
                     f"[label={_dot_id(str(d['bytes']) + ' B')}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- work partitions (§0x09G)
@dataclass(frozen=True)
class WorkBalance:
    """Chunks of per-output work units assigned to workers; ``chunks[i] = (output, start,
    end)`` goes to worker ``assignment[i]``."""

    strategy: str
    work: tuple[int, ...]
    workers: int
    chunks: tuple[tuple[int, int, int], ...]
    assignment: tuple[int, ...]
    chunk_limit: int | None = None

    @property
    def chunk_sizes(self) -> list[int]:
        return [e - a for _, a, e in self.chunks]

    @property
    def loads(self) -> list[int]:
        out = [0] * self.workers
        for (_, a, e), w in zip(self.chunks, self.assignment):
            out[w] += e - a
        return out

    @property
    def total(self) -> int:
        return sum(self.work)

    @property
    def mean(self) -> float:
        return self.total / self.workers

    @property
    def max_over_mean(self) -> float:
        """``rho = max load / mean load`` (1.0 is perfect balance)."""
        return max(self.loads) / self.mean if self.total else 1.0

    @property
    def efficiency(self) -> float:
        """``eta = W / (workers * max load)``."""
        return self.total / (self.workers * max(self.loads)) if self.total else 1.0

    def outputs_of(self, worker: int) -> dict[int, int]:
        """Work units per output identity held by ``worker`` (several: it publishes several states)."""
        out: dict[int, int] = {}
        for (o, a, e), w in zip(self.chunks, self.assignment):
            if w == worker:
                out[o] = out.get(o, 0) + e - a
        return out


def _work(work: Iterable[int], workers: int) -> tuple[tuple[int, ...], int]:
    w = tuple(int(x) for x in work)
    if any(x < 0 for x in w):
        raise PlanError(f"work units {list(w)} must not be negative")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise PlanError(f"workers = {workers!r} must be a positive integer")
    return w, int(workers)


def least_loaded(sizes: Iterable[int], workers: int) -> tuple[int, ...]:
    """Deterministic least-loaded assignment in the given order: each chunk goes to the
    worker with the smallest load so far, ties to the lowest worker index."""
    heap = [(0, w) for w in range(workers)]
    out = []
    for n in sizes:
        load, w = heapq.heappop(heap)
        out.append(w)
        heapq.heappush(heap, (load + n, w))
    return tuple(out)


def fixed_splits(work: Iterable[int], workers: int, splits_per_output: int) -> WorkBalance:
    """Each output split into ``splits_per_output`` balanced chunks, chunk ``i`` on worker
    ``i % workers`` (the simple per-output mapping)."""
    w, n = _work(work, workers)
    starts, ends = balanced_bounds(np.asarray(w, np.int64), splits_per_output)
    chunks = tuple((o, int(a), int(e)) for o in range(len(w)) for a, e in zip(starts[o], ends[o]))
    return WorkBalance(f"fixed({splits_per_output})", w, n, chunks, tuple(i % n for i in range(len(chunks))))


def global_equal(work: Iterable[int], workers: int) -> WorkBalance:
    """The flattened work split into ``workers`` balanced intervals; an interval that
    crosses an output boundary becomes one fragment per output on the same worker."""
    w, n = _work(work, workers)
    ws, we = balanced_bounds(np.asarray([sum(w)], np.int64), n)
    offs = np.concatenate([[0], np.cumsum(w)]).astype(np.int64)
    chunks, assign = [], []
    for k in range(n):
        a, e = int(ws[0, k]), int(we[0, k])
        for o in range(len(w)):
            lo, hi = max(a, int(offs[o])), min(e, int(offs[o + 1]))
            if hi > lo:
                chunks.append((o, lo - int(offs[o]), hi - int(offs[o])))
                assign.append(k)
    return WorkBalance("global_equal", w, n, tuple(chunks), tuple(assign))


def planned_chunks(work: Iterable[int], workers: int, chunk_limit: int | None = None) -> WorkBalance:
    """FlashInfer-style teaching plan: the integer chunk limit ``ceil(W / workers)``, each
    output chunked independently (no chunk crosses an output), chunks sorted longest first
    (stable) and placed least-loaded."""
    w, n = _work(work, workers)
    limit = chunk_limit if chunk_limit is not None else max(-(-sum(w) // n), 1)
    starts, ends, active = chunk_bounds(np.asarray(w, np.int64), limit)
    chunks = [(o, int(a), int(e)) for o in range(len(w))
              for a, e, on in zip(starts[o], ends[o], active[o]) if on]
    chunks.sort(key=lambda c: -(c[2] - c[1]))
    return WorkBalance(f"planned({limit})", w, n, tuple(chunks),
                       least_loaded([e - a for _, a, e in chunks], n), limit)
