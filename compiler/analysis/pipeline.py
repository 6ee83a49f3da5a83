"""The plan-time analyses in the order they run (DESIGN §1, §4), as ``lower.PIPELINE`` lists the
lowering passes.

Each :class:`Step` is a pure function of call inputs (:data:`PLAN_INPUTS`) and earlier steps'
results that adds one result under its name.  :func:`run_plan_pipeline` runs, in this order,
the steps the wanted results need and no others; a result the caller already has is passed in
by name and reused, not recomputed (``Plan.retile`` passes its intervals, ``plan_split`` an
explicit split policy or occupancy, ``SplitPlan.ledgers`` its own layout, bounds and graph).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from .. import ir
from . import ledger, schedule, splits
from .intervals import analyze, require_columns, row_intervals
from .layout import check_fits, slot_segments
from .phases import Manifest
from .tile_eval import numpy_evaluator
from .tiles import plan_tiles, require_tiles

# What a caller gives, by name: one call shape's mask analyses read the first eight, a split
# call over a concrete K/V layout the rest (with ``program``).
PLAN_INPUTS = ("program", "batch", "s_q", "s_k", "tensors", "block_m", "block_n", "method",
               "kv_layout", "q_lens", "num_sms", "block_rows")


@dataclass(frozen=True)
class Step:
    name: str  # the result it adds
    reads: tuple[str, ...]  # call inputs and earlier results, passed positionally in this order
    run: Callable[..., object]


# ---------------------------------------------------------------- one call shape's mask
def row_runs(program, batch, s_q, s_k, tensors, intervals):
    """Each query row's one run of visible keys ``[KS, KE)``, kept only for a mask that reads
    tensors and whose interval analysis is exact: PARTIAL blocks then test ``k`` against the
    row's run instead of gathering the tensors once per block.  None otherwise."""
    if ir.loads(program.mask) and intervals.exact:
        return row_intervals(program, batch, s_q, s_k, tensors)
    return None


# ---------------------------------------------------------------- a split call over a K/V layout
def phase_manifest(layout, q_lens) -> Manifest:
    """Each request's ``(T, C)``: ``q_lens[b]`` new rows over ``layout.kv_lens[b]`` keys."""
    return Manifest.from_lens(layout.kv_lens, q_lens)


def spec_split_policy(program):
    """The spec's ``split =`` policy (a call may pass its own, or ``attnc tune``'s)."""
    return splits.from_ir(program.split)


def occupancy(program, manifest: Manifest, num_sms: int) -> splits.Occupancy:
    return splits.occupancy_for(program, manifest.C, num_sms)


def split_bounds(policy, layout, occupancy) -> splits.SplitBounds:
    return policy.bounds(layout.kv_lens, occupancy)


def schedule_graph(program, bounds, call, layout, manifest: Manifest):
    """The schedule DAG (producers, workspace, reducers), validated for exact coverage."""
    graph = schedule.build(bounds, call, layout, manifest.C)
    graph.graph["name"] = program.name
    return graph


def segments(layout, bounds, manifest: Manifest, block_rows):
    return slot_segments(layout, bounds, manifest.C, block_rows)


def ledgers(graph, bounds, call, layout, manifest: Manifest) -> schedule.SplitLedgers:
    return schedule.split_ledgers(graph, bounds, call, layout, manifest.C)


PLAN_PIPELINE: tuple[Step, ...] = (
    # one call shape's mask (prefill and append plans, explain, split calls' block lists)
    Step("intervals", ("program", "batch", "s_q", "s_k", "tensors"), analyze),
    Step("rows", ("program", "batch", "s_q", "s_k", "tensors", "intervals"), row_runs),
    # the tiles an inexact analysis leaves undecided are classified by the predicate: on the host by
    # default; a backend passes its own evaluator (the Triton backend's runs on the GPU)
    Step("tile_evaluator", ("program", "batch", "s_q", "s_k", "tensors"), numpy_evaluator),
    Step("tiles", ("intervals", "block_m", "block_n", "method", "tile_evaluator"), plan_tiles),
    # a split call (decode, append, mixed batches) over a concrete K/V layout
    Step("layout", ("kv_layout", "program"), check_fits),
    Step("manifest", ("layout", "q_lens"), phase_manifest),
    Step("policy", ("program",), spec_split_policy),
    Step("occupancy", ("program", "manifest", "num_sms"), occupancy),
    Step("bounds", ("policy", "layout", "occupancy"), split_bounds),
    Step("call", ("program",), ledger.DecodeCall.from_program),
    Step("graph", ("program", "bounds", "call", "layout", "manifest"), schedule_graph),
    Step("segments", ("layout", "bounds", "manifest", "block_rows"), segments),
    Step("ledgers", ("graph", "bounds", "call", "layout", "manifest"), ledgers),
)


def _require_budgets(needed: set[str], given: dict) -> None:
    """The memory estimates the call inputs already decide, for every step that will run, before
    the first one allocates: a call its last step would refuse is refused up front."""
    if "intervals" in needed:
        shape = require_columns(given["program"], given["batch"], given["s_k"])
    elif "intervals" in given:
        shape = given["intervals"].shape
    else:
        return
    if "tiles" in needed and "block_m" in given and "block_n" in given:
        s_q = given["intervals"].s_q if "intervals" in given else given["s_q"]
        require_tiles(shape, s_q, given["block_m"], given["block_n"])


def run_plan_pipeline(wanted: Iterable[str], /, **given) -> Mapping[str, object]:
    """The ``wanted`` results (read-only, by name) from the call inputs and known results in
    ``given``: the steps they need run in :data:`PLAN_PIPELINE` order, each once."""
    wanted = tuple(wanted)
    steps = {s.name: s for s in PLAN_PIPELINE}
    unknown = sorted(set(given) - set(PLAN_INPUTS) - set(steps))
    if unknown:
        raise TypeError(f"run_plan_pipeline: '{unknown[0]}' is neither a plan input nor a step's result")
    needed: set[str] = set()
    todo = [n for n in wanted if n not in given]
    while todo:
        name = todo.pop()
        if name in needed or name in given:
            continue
        if name not in steps:
            raise TypeError(f"run_plan_pipeline: '{name}' is needed but neither given nor a step's result")
        needed.add(name)
        todo.extend(steps[name].reads)
    results = dict(given)
    _require_budgets(needed, results)
    for step in PLAN_PIPELINE:
        if step.name in needed:
            results[step.name] = step.run(*(results[n] for n in step.reads))
    return MappingProxyType({n: results[n] for n in wanted})
