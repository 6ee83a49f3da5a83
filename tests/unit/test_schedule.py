"""compiler.analysis.schedule: the producer/workspace/reducer DAG reproduces the
`split_launch` grids, owners and ledgers (M4.5 §0x03), and `schedules.ragged_two_outputs`
(§0x09G); coverage breaks are PlanErrors; the DOT and JSON exports are deterministic."""
import json

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from attnc.compiler.analysis import layout as lay
from attnc.compiler.analysis import ledger as L
from attnc.compiler.analysis import schedule as sch
from attnc.compiler.analysis import splits as sp
from attnc.compiler.errors import PlanError
from tests.conftest import seed_contracts

FIX = seed_contracts()["split_launch"]
MAIN, TAIL = FIX["ragged_balanced"], FIX["capacity_tail"]
TWO = seed_contracts()["schedules"]["ragged_two_outputs"]
ABIS = {"mlu": dict(abi="mlu", vector_dtype="f32"), "lse_o": dict(abi="lse_o", vector_dtype="bf16")}


def main_graph(abi="mlu", **kw):
    call = L.DecodeCall(MAIN["H_q"], MAIN["H_kv"], MAIN["d"], **ABIS[abi], **kw)
    return sch.build(sp.balanced(MAIN["splits"]).bounds(MAIN["T"]), call), call


# ---------------------------------------------------------------- split_launch
@pytest.mark.parametrize("abi", ["mlu", "lse_o"])
def test_main_fixture_grids_owners_and_ledgers(abi):
    g, call = main_graph(abi)
    grids = sch.launch_grids(g)
    assert list(grids["producer"]) == MAIN["producer_grid"]
    assert list(grids["reducer"]) == MAIN["reducer_grid"]
    assert grids["producer_tasks"] == (len(MAIN["T"]), MAIN["H_kv"], MAIN["splits"])
    own = sch.owner_counts(g)
    assert own["producer_owners"] == MAIN["producer_owners"]
    assert own["reducer_owners"] == MAIN["reducer_owners"]
    assert own["nonempty_binary_merges"] == MAIN["nonempty_binary_merges"]
    assert [sch.split_lengths(g, b) for b in range(2)] == MAIN["split_lengths"]

    led, want = sch.ledger(g), MAIN["ledgers_bytes"]
    assert led.unique_q == want["unique_q"]
    assert led.q_demand == want["q_demand_every_split_loads_q"]
    assert led.unique_kv == want["unique_kv_by_kv_head"]
    assert led.kv_demand == want["kv_demand_per_query_head"]
    assert led.reduction_path == MAIN["reduction_path_bytes"][abi]
    assert led.two_launch_demand == want[f"two_launch_demand_{abi}"] == sch.total_edge_bytes(g)
    assert led == L.decode_ledger(sp.balanced(MAIN["splits"]).bounds(MAIN["T"]), call)
    key = {"mlu": "mlu_fp32_u8valid", "lse_o": "lse_o_bf16O_fp32lse_u8valid"}[abi]
    assert g.graph["workspace_logical_bytes"] == MAIN["workspace_bytes"][key]["configured"]


def test_workspace_nodes_carry_field_shapes_and_dtypes():
    g, _ = main_graph("mlu")
    ws = {n[1]: g.nodes[n] for n in sch.nodes_of(g, "workspace")}
    assert ws["partial_u"]["shape"] == (2, 8, 8, 128) and ws["partial_u"]["dtype"] == "f32"
    assert ws["partial_m"]["shape"] == ws["partial_l"]["shape"] == (2, 8, 8)
    assert ws["partial_valid"]["dtype"] == "u8"
    assert sum(d["allocated_bytes"] for d in ws.values()) == 66688
    g, _ = main_graph("lse_o")
    assert sorted(n[1] for n in sch.nodes_of(g, "workspace")) == ["partial_lse", "partial_o", "partial_valid"]
    assert g.nodes[("workspace", "partial_o")]["dtype"] == "bf16"


def test_capacity_tail_owners():
    call = L.DecodeCall(TAIL["H_q"], TAIL["H_q"], 16, abi="mlu")
    g = sch.build(sp.capacity(TAIL["splits"], TAIL["split_capacity"]).bounds(TAIL["T"]), call)
    own = sch.owner_counts(g)
    assert own["producer_owners"] == TAIL["producer_owners"]
    assert own["active_owners"] == TAIL["active_owners"]
    assert own["empty_or_inactive_owners"] == TAIL["empty_or_inactive_owners"]
    assert own["reducer_owners"] == TAIL["reducer_owners"]
    assert own["identity_bypasses"] == TAIL["identity_bypasses"]
    assert sch.split_lengths(g, 0) == TAIL["request0_split_lengths"]
    inactive = [n for n in sch.nodes_of(g, "producer") if n[1] == 0 and n[2] == 0 and not g.nodes[n]["active"]]
    assert len(inactive) == TAIL["request0_inactive_slots"]
    # the reducer reads the whole envelope, so every inactive slot gets an identity write
    for n in inactive:
        assert all(d["identity"] for _, _, d in g.out_edges(n, data=True)) and g.out_degree(n) == 4
    # only the active owners load Q or K/V
    assert all(g.in_degree(n) == 0 for n in sch.nodes_of(g, "producer") if g.nodes[n]["empty"])


def test_capacity_tail_with_gqa_tasks_has_the_same_owner_counts():
    call = L.DecodeCall(TAIL["H_q"], 2, 16, abi="mlu")
    g = sch.build(sp.capacity(TAIL["splits"], TAIL["split_capacity"]).bounds(TAIL["T"]), call)
    own = sch.owner_counts(g)
    assert (own["producer_owners"], own["active_owners"], own["producer_tasks"]) == (64, 12, 32)


def test_reducer_without_envelope_reads_only_configured_slots():
    call = L.DecodeCall(4, 4, 16, abi="mlu", reduce_capacity=False)
    g = sch.build(sp.capacity(5, 8).bounds([3, 0]), call)
    assert g.nodes[("reducer", 0, 0)]["splits"] == (0, 1, 2, 3, 4)
    assert sch.owner_counts(g)["identity_bypasses"] == 2 * 4 * 5 - 12
    assert all(g.out_degree(n) == 0 for n in sch.nodes_of(g, "producer") if not g.nodes[n]["active"])


# ---------------------------------------------------------------- coverage and dependencies
@pytest.mark.parametrize("ranges,msg", [
    ([[(0, 6), (5, 10)], [(0, 4)]], r"K/V head 0: request 0: split 0 \[0, 6\) and split 1 \[5, 10\) "
                                    r"overlap on positions \[5, 6\)"),
    ([[(0, 10)], [(0, 1), (2, 4)]], r"request 1: positions \[1, 2\) are covered by no split"),
])
def test_overlap_or_gap_is_a_plan_error(ranges, msg):
    bounds = sp.SplitBounds.from_ranges([10, 4], ranges)
    with pytest.raises(PlanError, match=msg):
        sch.build(bounds, L.DecodeCall(4, 2, 8))
    g = sch.build(bounds, L.DecodeCall(4, 2, 8), check=False)   # built anyway, then checked
    with pytest.raises(PlanError, match=msg):
        sch.validate(g)


def test_unwritten_consumed_slot_is_a_plan_error():
    g, _ = main_graph("mlu")
    g.remove_edge(("producer", 1, 1, 3), ("workspace", "partial_m"))
    with pytest.raises(PlanError, match=r"reads partial_m\[1, 4, 3\], which no producer writes"):
        sch.validate(g)


def test_reducer_dependencies_are_exact():
    g, _ = main_graph("lse_o")
    deps = sch.dependencies(g, ("reducer", 1, 5))
    assert deps == [("producer", 1, 1, s) for s in range(8)]


def test_topological_order_is_deterministic_and_valid():
    g, _ = main_graph("mlu")
    order = sch.topological_order(g)
    assert order == sch.topological_order(g.copy())
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[u] < pos[v] for u, v in g.edges)
    kinds = [n[0] for n in order]
    assert kinds == sorted(kinds, key=sch.KIND_RANK.get)
    assert nx.is_directed_acyclic_graph(g)


# ---------------------------------------------------------------- paged producers
def test_paged_producers_carry_page_segments():
    table = [[1, 4, -1], [7, 3, 9]]
    layout = lay.paged_dense(table, [7, 10], page_size=4, num_pages=10, heads_q=4, heads_kv=2, d_qk=4)
    bounds = sp.SplitBounds.from_ranges([7, 10], [[(0, 7)], [(0, 3), (3, 9), (9, 10)]])
    call = L.DecodeCall(4, 2, 4)
    g = sch.build(bounds, call, layout)
    assert g.nodes[("producer", 1, 0, 1)]["segments"] == ((7, 3, 1), (3, 0, 4), (9, 0, 1))
    assert g.nodes[("producer", 1, 1, 1)]["segments"] == g.nodes[("producer", 1, 0, 1)]["segments"]
    assert g.nodes[("producer", 0, 0, 1)]["segments"] == ()              # inactive slot
    assert ("input", "k_cache") in g and g.graph["layout"] == "paged/nhd/dense"
    segs = sum(len(g.nodes[n]["segments"]) for n in sch.nodes_of(g, "producer"))
    assert L.page_lookups(layout, bounds) == segs
    with pytest.raises(PlanError, match="split bounds were made for kv_lens"):
        sch.build(sp.balanced(2).bounds([7, 11]), call, layout)


def test_plan_schedule_from_a_layout():
    layout = lay.ragged([0, 10, 17, 22], heads_q=4, heads_kv=2, d_qk=4)
    g = sch.plan_schedule(sp.chunk(4), L.DecodeCall(4, 2, 4), layout)
    assert [sch.split_lengths(g, b) for b in range(3)] == [[4, 4, 2], [4, 3], [4, 1]]
    assert sch.launch_grids(g)["producer"] == (3, 4, 3)


# ---------------------------------------------------------------- exports
def test_json_and_dot_exports():
    g, _ = main_graph("mlu")
    doc = json.loads(sch.to_json(g))
    assert doc["grids"]["producer"] == MAIN["producer_grid"]
    assert doc["owners"]["nonempty_binary_merges"] == MAIN["nonempty_binary_merges"]
    assert doc["ledger"]["two_launch_demand"] == MAIN["ledgers_bytes"]["two_launch_demand_mlu"]
    assert len(doc["nodes"]) == g.number_of_nodes() and len(doc["edges"]) == g.number_of_edges()
    assert doc["nodes"][0]["id"] == "input/k"
    assert sch.to_json(g) == sch.to_json(g.copy())
    dot = sch.to_dot(g)
    assert dot.startswith('digraph "schedule" {') and dot.rstrip().endswith("}")
    assert '"producer/1/1/7" -> "workspace/partial_u"' in dot
    assert dot.count("->") == g.number_of_edges()
    assert dot == sch.to_dot(g.copy())


# ---------------------------------------------------------------- §0x09G
def test_ragged_two_outputs_fixed_splits():
    fixed = sch.fixed_splits(TWO["work"], TWO["workers"], TWO["fixed_splits_per_output"])
    assert fixed.loads == TWO["fixed_split_loads"]
    assert fixed.max_over_mean == pytest.approx(TWO["fixed_max_over_mean"])
    assert fixed.efficiency == pytest.approx(TWO["fixed_efficiency"])


def test_ragged_two_outputs_global_equal_work():
    eq = sch.global_equal(TWO["work"], TWO["workers"])
    assert eq.loads == TWO["global_equal_loads"] and eq.max_over_mean == 1.0
    assert eq.outputs_of(6) == {0: 256, 1: 384}          # CTA 6 publishes two output states


def test_ragged_two_outputs_planned_chunks():
    plan = sch.planned_chunks(TWO["work"], TWO["workers"])
    assert plan.chunk_limit == TWO["planned_chunk_limit"]
    assert plan.chunk_sizes == TWO["planned_sorted_chunks"]
    assert plan.loads == TWO["planned_loads"]
    last_two = plan.assignment[-2:]
    assert last_two[0] == last_two[1]                    # the 384 and 256 chunks share a CTA
    assert all(len({o for o, _, _ in [c]}) == 1 for c in plan.chunks)


# ---------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4),
       st.one_of(st.integers(1, 6).map(sp.balanced), st.integers(1, 12).map(sp.chunk),
                 st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: sp.capacity(t[0], t[0] + t[1]))),
       st.sampled_from([(1, 1), (4, 2), (4, 1), (6, 3)]), st.sampled_from(["mlu", "lse_o"]), st.booleans(),
       st.data())
def test_graph_ledger_equals_closed_form(T, policy, heads, abi, envelope, data):
    q_lens = data.draw(st.lists(st.integers(0, 3), min_size=len(T), max_size=len(T)))
    call = L.DecodeCall(heads[0], heads[1], 8, d_v=4, abi=abi, reduce_capacity=envelope)
    bounds = policy.bounds(T)
    g = sch.build(bounds, call, q_lens=q_lens)
    assert sch.ledger(g) == L.decode_ledger(bounds, call, q_lens)
    assert sch.total_edge_bytes(g) == sch.ledger(g).two_launch_demand
    own = sch.owner_counts(g)
    assert own["producer_owners"] == len(T) * heads[0] * bounds.capacity
    assert own["active_owners"] + own["empty_or_inactive_owners"] == own["producer_owners"]
