"""`attnc plan` (DESIGN §7): split bounds, grids, workspace bytes and ledgers of a split call,
reproducing the seed's `split_launch` fixtures through the command line, and the schedule
graph written as DOT and JSON."""
import json

import numpy as np
import pytest

from attnc.compiler.analysis import splits as sp
from tests.conftest import ROOT, seed_contracts
from tests.e2e.test_cli import attnc

FIX = seed_contracts()["split_launch"]
MAIN, TAIL = FIX["ragged_balanced"], FIX["capacity_tail"]
SPEC = ROOT / "tests" / "fixtures" / "specs" / "split_launch.attn"
KV = ",".join(map(str, MAIN["T"]))


def plan_json(*args):
    r = attnc("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def spec_variant(tmp_path, **replace):
    """The fixture spec with some statements replaced (``state="mlu"`` -> ``state = mlu``)."""
    text = SPEC.read_text()
    for key, value in replace.items():
        lines = [ln for ln in text.splitlines() if ln.strip().startswith(f"{key} ")]
        assert len(lines) == 1, key
        text = text.replace(lines[0], f"    {key} = {value}")
    path = tmp_path / f"variant_{'_'.join(replace)}.attn"
    path.write_text(text)
    return path


@pytest.mark.parametrize("abi", ["lse_o", "mlu"])
def test_ragged_balanced_fixture_through_the_cli(tmp_path, abi):
    spec = SPEC if abi == "lse_o" else spec_variant(tmp_path, state="mlu")
    doc = plan_json(spec, "--kv-lens", KV)
    assert (doc["heads_q"], doc["heads_kv"], doc["d_qk"], doc["dtype"]) == (MAIN["H_q"], MAIN["H_kv"], MAIN["d"], "bf16")
    assert doc["policy"] == f"balanced({MAIN['splits']})" and doc["state"] == abi
    assert doc["q_lens"] == [1, 1] and doc["phases"] == ["decode", "decode"]
    assert doc["split_lengths"] == MAIN["split_lengths"]
    assert doc["producer_grid"] == MAIN["producer_grid"]
    assert doc["reducer_grid"] == MAIN["reducer_grid"]
    assert doc["producer_tasks"] == [2, MAIN["H_kv"], MAIN["splits"]]      # GQA-packed task grid
    assert doc["owners"]["producer_owners"] == MAIN["producer_owners"]
    assert doc["owners"]["reducer_owners"] == MAIN["reducer_owners"]
    assert doc["owners"]["nonempty_binary_merges"] == MAIN["nonempty_binary_merges"]
    key = {"mlu": "mlu_fp32_u8valid", "lse_o": "lse_o_bf16O_fp32lse_u8valid"}[abi]
    assert doc["workspace_bytes"]["per_state"] == MAIN["workspace_bytes"][key]["per_state"]
    assert doc["workspace_bytes"]["configured"] == MAIN["workspace_bytes"][key]["configured"]
    assert sum(f["bytes"] for f in doc["workspace"]["fields"]) == doc["workspace_bytes"]["capacity"]
    led, want = doc["ledgers"], MAIN["ledgers_bytes"]
    assert led["unique_q"] == want["unique_q"]
    assert led["q_demand"] == want["q_demand_every_split_loads_q"]
    assert led["unique_kv"] == want["unique_kv_by_kv_head"]
    assert led["kv_demand"] == want["kv_demand_per_query_head"]
    assert led["reduction_path"] == MAIN["reduction_path_bytes"][abi]
    assert led["final_output"] == MAIN["reduction_path_bytes"]["final_output_bf16"]
    assert led["final_lse"] == MAIN["reduction_path_bytes"]["final_lse_fp32"]
    assert led["two_launch_demand"] == want[f"two_launch_demand_{abi}"]
    bounds = doc["split_bounds"]
    assert bounds[1][:4] == [[0, 449], [449, 898], [898, 1347], [1347, 1795]] and bounds[1][-1][1] == 3587


def test_text_report():
    r = attnc("plan", SPEC, "--kv-lens", KV)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "split balanced(8), 8 slot(s) per request; state lse_o" in out
    assert "512 x8" in out and "449 x3, 448 x5" in out
    assert "grids: producer [2, 8, 8] (GQA tasks [2, 2, 8]), reducer [2, 8]" in out
    assert "112 non-empty merges" in out
    assert "261 B/state, configured 33,408 B" in out
    assert "reduction path 70,976" in out and "two-launch demand 31,573,312" in out


def test_capacity_tail_fixture_through_the_cli(tmp_path):
    spec = spec_variant(tmp_path, heads=str(TAIL["H_q"]), split=f"capacity({TAIL['splits']}, {TAIL['split_capacity']})")
    doc = plan_json(spec, "--kv-lens", ",".join(map(str, TAIL["T"])))
    own = doc["owners"]
    assert own["producer_owners"] == TAIL["producer_owners"]
    assert own["active_owners"] == TAIL["active_owners"]
    assert own["empty_or_inactive_owners"] == TAIL["empty_or_inactive_owners"]
    assert own["reducer_owners"] == TAIL["reducer_owners"]
    assert own["identity_bypasses"] == TAIL["identity_bypasses"]
    assert doc["split_lengths"][0] == TAIL["request0_split_lengths"]
    assert doc["capacity"] == TAIL["split_capacity"]
    assert TAIL["split_capacity"] - doc["splits_per_request"][0] == TAIL["request0_inactive_slots"]
    # a decode call: one query row per request, the second over an empty context (T = 0), whose
    # four reducers each bypass eight identities
    assert doc["q_lens"] == [1, 1] and doc["phases"] == ["decode", "empty"]
    assert doc["split_lengths"][1] == [0] * TAIL["splits"]


def test_heuristic_split_follows_the_sm_count(tmp_path):
    spec = spec_variant(tmp_path, split="heuristic(0.85)")
    want = sp.num_splits_heuristic(len(MAIN["T"]) * MAIN["H_q"], 2 * 132, -(-max(MAIN["T"]) // 128))
    doc = plan_json(spec, "--kv-lens", KV, "--sms", "132")
    assert doc["num_sms"] == 132 and doc["capacity"] == want > 1
    assert doc["policy"] == f"heuristic(0.85) -> balanced({want})"
    assert plan_json(spec, "--kv-lens", KV, "--sms", "8")["capacity"] == 1   # G >= 0.8 N_SM: one split


def test_paged_mixed_batch_plan():
    doc = plan_json(ROOT / "examples" / "causal_document_gqa.attn", "--kv-lens", "100,37,0,16", "--q-lens", "5,1,0,16")
    assert doc["cache"] == {"kind": "paged", "layout": "nhd", "page_size": 16, "table": "csr"}
    assert doc["phases"] == ["append", "decode", "idle", "prefill"] and doc["qo_indptr"] == [0, 5, 6, 6, 22]
    # packed query rows: the workspace has one row per query row, not per request
    fields = {f["name"]: f for f in doc["workspace"]["fields"]}
    assert fields["partial_o"]["shape"][:2] == [22, 32] and fields["partial_lse"]["dtype"] == "f32"
    # every K/V head looks up each page a slot's [start, end) meets (split = auto cuts the requests)
    pages = sum(-(-e // 16) - s // 16 for ranges in doc["split_bounds"] for s, e in ranges if e > s)
    assert pages >= sum(-(-t // 16) for t in (100, 37, 16))
    assert doc["ledgers"]["page_lookups"] == 8 * pages
    assert doc["ledgers"]["metadata"]["fields"] == {"kv_indptr": 20, "kv_indices": 44, "kv_last_page_len": 16}


def test_graph_is_written_as_dot_and_json(tmp_path):
    dot = tmp_path / "sched.dot"
    doc = plan_json(SPEC, "--kv-lens", KV, "--graph", dot)
    assert doc["graph"] == {"dot": str(dot), "json": str(tmp_path / "sched.json")}
    text = dot.read_text()
    assert text.startswith('digraph "split_launch" {') and text.rstrip().endswith("}")
    assert '"producer/1/1/7" -> "workspace/partial_o"' in text
    graph = json.loads((tmp_path / "sched.json").read_text())
    assert graph["grids"]["producer"] == MAIN["producer_grid"]
    assert graph["ledger"]["two_launch_demand"] == MAIN["ledgers_bytes"]["two_launch_demand_lse_o"]
    assert text.count("->") == len(graph["edges"])
    producers = [n for n in graph["nodes"] if n["kind"] == "producer"]
    assert len(producers) == 2 * MAIN["H_kv"] * MAIN["splits"]
    assert sorted({(n["start"], n["end"]) for n in producers if n["b"] == 1})[0] == (0, 449)
    r = attnc("plan", SPEC, "--kv-lens", KV, "--graph", dot)            # text mode says where
    assert f"schedule graph -> {dot}" in r.stdout


@pytest.mark.parametrize("args, message, code", [
    (["--kv-lens", "10,20", "--q-lens", "1"], "--q-lens has 1 entries, --kv-lens 2", 1),
    (["--kv-lens", "3,5", "--q-lens", "4,1"], "kv_lens[0] = 3 is less than q_lens[0] = 4", 1),
    (["--kv-lens", "10,x"], "expected comma-separated integers", 2),
    (["--kv-lens", "10", "--sms", "0"], "argument --sms: expected an integer >= 1, got '0'", 2),
])
def test_plan_errors(tmp_path, args, message, code):
    spec = spec_variant(tmp_path, split="auto") if "--sms" in args else SPEC
    r = attnc("plan", spec, *args)
    assert r.returncode == code
    assert message in r.stderr, r.stderr


def test_dense_paged_plan_agrees_with_the_contiguous_one(tmp_path):
    """Page size and table change the segments and metadata, not the bounds or bytes."""
    dense = plan_json(spec_variant(tmp_path, cache="paged(page_size = 64, layout = hnd)"), "--kv-lens", KV)
    flat = plan_json(SPEC, "--kv-lens", KV)
    for key in ("split_lengths", "producer_grid", "reducer_grid", "workspace_bytes", "owners"):
        assert dense[key] == flat[key], key
    assert dense["ledgers"]["two_launch_demand"] == flat["ledgers"]["two_launch_demand"]
    lookups = sum(int(np.sum(-(-np.asarray(lens) // 64))) for lens in MAIN["split_lengths"])
    assert dense["ledgers"]["page_lookups"] >= lookups * MAIN["H_kv"]
    assert dense["ledgers"]["metadata"]["fields"]["block_table"] == 2 * 64 * 4
