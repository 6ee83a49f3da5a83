"""compiler.analysis.ledger: workspace bytes per ABI and dtype, the reduction path, unique
vs demanded Q and K/V, and resident metadata (M4.5 §0x03D-§0x03G, §0x04I)."""
import pytest

from attnc.compiler.analysis import ledger as L
from attnc.compiler.analysis import splits as sp
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_spec
from tests.conftest import seed_contracts

FIX = seed_contracts()["split_launch"]
MAIN, WIDTH = FIX["ragged_balanced"], FIX["head_width_tail"]
WS, RP, LED = MAIN["workspace_bytes"], MAIN["reduction_path_bytes"], MAIN["ledgers_bytes"]

# the fixture's two declared ABIs (§0x03E): fp32 (m,l,u) + u8 valid; bf16 O + fp32 LSE + u8 valid
MLU = dict(abi="mlu", vector_dtype="f32", scalar_dtype="f32", valid_dtype="u8")
LSE_O = dict(abi="lse_o", vector_dtype="bf16", scalar_dtype="f32", valid_dtype="u8")


def main_call(**abi):
    return L.DecodeCall(heads_q=MAIN["H_q"], heads_kv=MAIN["H_kv"], d_qk=MAIN["d"], q_dtype="bf16",
                        cache_dtype="bf16", out_dtype="bf16", lse_dtype="f32", **abi)


def main_bounds():
    return sp.balanced(MAIN["splits"]).bounds(MAIN["T"])


@pytest.mark.parametrize("abi,key", [(MLU, "mlu_fp32_u8valid"), (LSE_O, "lse_o_bf16O_fp32lse_u8valid")])
def test_workspace_bytes_per_abi(abi, key):
    states = len(MAIN["T"]) * MAIN["H_q"] * MAIN["splits"]                   # N_cfg = B H_q S
    w = L.workspace(abi["abi"], MAIN["d"], states, vector_dtype=abi["vector_dtype"],
                    scalar_dtype=abi["scalar_dtype"], valid_dtype=abi["valid_dtype"])
    assert w.per_state == WS[key]["per_state"]
    assert w.logical == WS[key]["configured"]
    assert L.split_workspace(main_bounds(), main_call(**abi)).logical == WS[key]["configured"]


def test_default_dtypes_are_the_article_baseline():
    assert L.DecodeCall(8, 2, 128, abi="mlu").vector_dtype_resolved == "f32"
    assert L.DecodeCall(8, 2, 128, abi="lse_o", out_dtype="bf16").vector_dtype_resolved == "bf16"
    assert L.decode_ledger(main_bounds(), L.DecodeCall(8, 2, 128, abi="mlu")).reduction_path == RP["mlu"]
    assert L.decode_ledger(main_bounds(), L.DecodeCall(8, 2, 128, abi="lse_o")).reduction_path == RP["lse_o"]


@pytest.mark.parametrize("abi,name", [(MLU, "mlu"), (LSE_O, "lse_o")])
def test_reduction_path_and_demand_ledgers(abi, name):
    led = L.decode_ledger(main_bounds(), main_call(**abi))
    assert led.final_output == RP["final_output_bf16"]
    assert led.final_lse == RP["final_lse_fp32"]
    assert led.reduction_path == RP[name]
    assert led.workspace_write == led.workspace_read == WS[{"mlu": "mlu_fp32_u8valid",
                                                            "lse_o": "lse_o_bf16O_fp32lse_u8valid"}[name]]["configured"]
    assert led.unique_q == LED["unique_q"]
    assert led.q_demand == LED["q_demand_every_split_loads_q"]
    assert led.unique_kv == LED["unique_kv_by_kv_head"]
    assert led.kv_demand == LED["kv_demand_per_query_head"]
    assert led.kv_reuse_factor == MAIN["H_q"] / MAIN["H_kv"]
    assert led.two_launch_demand == LED[f"two_launch_demand_{name}"]


def test_no_lse_write_and_no_validity_field():
    led = L.decode_ledger(main_bounds(), main_call(**MLU, write_lse=False))
    assert led.final_lse == 0 and led.reduction_path == RP["mlu"] - RP["final_lse_fp32"]
    w = L.workspace("lse_o", 128, 128, vector_dtype="bf16", valid_dtype=None)
    assert w.per_state == 128 * 2 + 4


def test_head_width_tail_padding():
    w = L.workspace("mlu", WIDTH["d_v"], WIDTH["states"], vector_alignment=WIDTH["vector_alignment"])
    assert w.d_v_padded == WIDTH["d_v_padded"]
    assert w.logical == WIDTH["logical_bytes_mlu"]
    assert w.capacity == WIDTH["capacity_bytes_mlu"]
    assert w.padding == w.lane_padding == WIDTH["padding_bytes"] and w.slot_padding == 0


def test_capacity_envelope_counts_unconfigured_slots():
    b = sp.capacity(5, 8).bounds([3, 0])
    call = L.DecodeCall(4, 4, 16, abi="mlu", reduce_capacity=False)
    w = L.split_workspace(b, call)
    assert (w.states, w.capacity_states) == (2 * 4 * 5, 2 * 4 * 8)
    assert w.slot_padding == w.padding == 2 * 4 * 3 * w.per_state
    full = L.split_workspace(b, L.DecodeCall(4, 4, 16, abi="mlu"))       # reducer reads the envelope
    assert full.states == full.capacity_states == 64
    led = L.decode_ledger(b, L.DecodeCall(4, 4, 16, abi="mlu"))
    assert led.q_demand == 12 * 16 * 2                                   # only the 12 active owners load Q


def test_mixed_query_rows_scale_states_and_outputs():
    b = sp.balanced(2).bounds([8, 4])
    led = L.decode_ledger(b, L.DecodeCall(2, 1, 4, abi="lse_o"), q_lens=[3, 1])
    assert led.unique_q == 4 * 2 * 4 * 2
    assert led.final_output == 4 * 2 * 4 * 2 and led.final_lse == 4 * 2 * 4
    assert led.workspace_write == 4 * 2 * 2 * (4 * 2 + 4 + 1)


def test_from_program_and_dtype_names():
    p = compile_spec("attention t { heads = 32 / 8 head_dim = 192 / 128 dtype = f16 state = mlu }")
    c = L.DecodeCall.from_program(p)
    assert (c.heads_q, c.heads_kv, c.d_qk, c.d_v, c.abi, c.out_dtype) == (32, 8, 192, 128, "mlu", "f16")
    assert [f.name for f in c.state_fields()] == ["partial_u", "partial_m", "partial_l", "partial_valid"]
    assert L.dtype_bytes("bf16") == 2 and L.dtype_bytes("float32") == 4 and L.dtype_bytes("u8") == 1
    with pytest.raises(PlanError, match="unknown dtype 'f13'"):
        L.dtype_bytes("f13")
    with pytest.raises(PlanError, match="unknown state ABI"):
        L.DecodeCall(8, 2, 128, abi="mx")
    with pytest.raises(PlanError, match="H_q = 6 is not a multiple of H_kv = 4"):
        L.DecodeCall(6, 4, 128)
