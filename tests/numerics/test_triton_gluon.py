"""The Triton backend's Gluon engine (``backends/triton/gluon_engine.py``, the warp-specialized
Hopper program ``_attn_fwd_ws``) against the float64 oracle on an sm_90 GPU (ATTNC_TEST_GPU=1 on an H100 /
H200), and where it is refused: everywhere else, every call takes the Triton kernel."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import choice, device, launch, runtime  # noqa: E402
from attnc.backends.triton.kernels import gluon_engine  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from tests.conftest import EXAMPLES, prefill_launches  # noqa: E402

HOPPER = (not runtime.interpreted() and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon engine runs on an sm_90 GPU (ATTNC_TEST_GPU=1)")

# every example the engine can run (f16 / bf16, one head dim of 64 or 128), and specs the examples lack
ELIGIBLE = [p for p in EXAMPLES if choice.gluon_spec_refusal(compile_file(p)) is None]
SPECS = {
    "gqa_d128_causal": "attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }",
    "f16_documents": "attention d { heads = 4 head_dim = 128 dtype = f16 tensor doc: i32[b, s] ~ segments(16, 200) "
                     "mask = causal & doc[b, q] == doc[b, k] }",
    "softcap_window": "attention w { heads = 4 / 4 head_dim = 128 dtype = bf16 mask = causal & q - k < 100 "
                      "score = 30.0 * tanh(score / 30.0) }",
    "softcap_f16": "attention s { heads = 4 / 2 head_dim = 64 dtype = f16 mask = causal score = softcap(score, 30.0) }",
    "alibi_bf16": "attention a { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal "
                  "score = score - exp(-(h + 1) * log(2.0)) * (q - k) }",
    "alibi_f16": "attention a { heads = 4 head_dim = 64 dtype = f16 mask = causal "
                 "score = score - exp(-(h + 1) * log(2.0) * 8.0 / 16.0) * (q - k) }",
    "key_bias_bf16": "attention k { heads = 4 / 2 head_dim = 128 dtype = bf16 tensor kb: f32[b, s] ~ uniform(-4, 4) "
                     "mask = causal & q - k < 300 score = score + kb[b, k] }",
    "alibi_key_bias_f16": "attention k { heads = 4 / 2 head_dim = 128 dtype = f16 "
                          "tensor kb: f32[b, s] ~ uniform(-4, 4) mask = causal "
                          "score = score * 0.5 - exp(-(h + 1) * log(2.0)) * (q - k) + kb[b, k] }",
    "all_masked_rows": "attention e { heads = 2 head_dim = 64 dtype = bf16 mask = q >= 200 & causal }",
    "mla_192_128": "attention m { heads = 4 head_dim = 192 / 128 dtype = bf16 mask = causal }",
    "d256_window": "attention w { heads = 2 head_dim = 256 dtype = f16 mask = causal & q - k < 150 }",
}
PHASES = {"prefill": (256, 256), "append": (128, 384),  # S_q and S_k multiples of the 128-row tile
          "tails": (200, 200), "append_tails": (77, 333)}  # tiles across S_q and S_k: masked
# how the engine takes each separable spec's score program (launch.separable_mode): ALiBi's column part
# per block, a key tensor's per key
SEPARABLE = {"alibi_bf16": int(gluon_engine.COLUMN_PER_BLOCK), "alibi_f16": int(gluon_engine.COLUMN_PER_BLOCK),
             "key_bias_bf16": int(gluon_engine.COLUMN_PER_KEY), "alibi_key_bias_f16": int(gluon_engine.COLUMN_PER_KEY)}


def _check(program, s_q, s_k, seed, schedule=None, monkeypatch=None, mask_source=None, engine="gluon", scale=1):
    """The call on ``engine`` against the oracle; ``scale`` multiplies q and k (a power of two: the
    values stay those of the storage dtype)."""
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, s_q, s_k, seed=seed)
    arrays["q"], arrays["k"] = arrays["q"] * scale, arrays["k"] * scale
    call = inputs.validate(program, arrays)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, engine=engine, mask_source=mask_source,
                    schedule=schedule, **{t.name: arrays[t.name] for t in program.tensors})
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    assert np.isfinite(o).all()


@hopper
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("path", ELIGIBLE, ids=lambda p: p.stem)
def test_gluon_engine_matches_oracle_on_examples(path, phase):
    _check(inputs.contiguous_variant(compile_file(path)), *PHASES[phase], seed=3)


@hopper
@pytest.mark.parametrize("schedule", ["one_tile", "counter"])
@pytest.mark.parametrize("name", SPECS)
def test_gluon_engine_matches_oracle_on_specs(name, schedule, monkeypatch):
    _check(compile_spec(SPECS[name]), 256, 384, seed=4, schedule=schedule, monkeypatch=monkeypatch)


@hopper
@pytest.mark.parametrize("engine", ["gluon", "triton"])
@pytest.mark.parametrize("name", ["alibi_bf16", "softcap_window", "softcap_f16"])
def test_score_programs_on_both_engines_with_scores_of_a_few_units(name, engine):
    """ALiBi's fast form (positions converted on the row and key vectors) and softcap's tanh (the
    GPU's tanh.approx.f32 in f16 and bf16: an error of about s * 1e-5 on a capped score s) on the
    Gluon engine and the Triton kernel, q and k doubled (scores of std about 4), against the
    oracle; tiles across S_q and S_k."""
    _check(compile_spec(SPECS[name]), 200, 333, seed=6, engine=engine, scale=2)


@hopper
@pytest.mark.parametrize("phase", ["prefill", "append_tails"])
@pytest.mark.parametrize("name", SEPARABLE)
def test_separable_score_programs_on_the_engine(name, phase, monkeypatch):
    """The score program's separable form (compiler/separable.py): per cell one FMA on q.k and the
    column part, the row part added to LSE; O and LSE against the oracle, q and k doubled (scores
    of a few units), tiles across S_q and S_k in append_tails."""
    made = prefill_launches(monkeypatch)
    _check(compile_spec(SPECS[name]), *PHASES[phase], seed=8, scale=2)
    assert made and {x.launcher.constexprs["SEPARABLE"] for x in made} == {SEPARABLE[name]}


@hopper
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["per_cell", "column_per_key", "column_per_block"])
@pytest.mark.parametrize("schedule", ["one_tile", "counter"])
def test_alibi_each_way_the_engine_takes_it(mode, schedule, monkeypatch):
    """ALiBi per cell (the score program), and in the separable form with its column part per key
    and per block: each against the oracle."""
    monkeypatch.setattr(launch, "separable_mode", lambda module, end, block_n=128: mode)
    made = prefill_launches(monkeypatch)
    _check(compile_spec(SPECS["alibi_bf16"]), 200, 333, seed=9, schedule=schedule, scale=2)
    assert made and {x.launcher.constexprs["SEPARABLE"] for x in made} == {mode}


@hopper
def test_separable_alibi_far_from_position_zero(monkeypatch):
    """128 query rows at the end of 32K keys: the parts read positions from each run of rows'
    origin, so they stay of the order of the cells' own values (read from position 0, they would
    cancel by slope * 32K: LSE off by about 3e-3, over its tolerance)."""
    monkeypatch.setenv("ATTNC_MEMORY_LIMIT", "16GiB")
    made = prefill_launches(monkeypatch)
    _check(compile_spec(SPECS["alibi_f16"]), 128, 32768, seed=10)
    assert made and {x.launcher.constexprs["SEPARABLE"] for x in made} == {int(gluon_engine.COLUMN_PER_BLOCK)}


@hopper
@pytest.mark.parametrize("mask_source", ["rows", "predicate"])
@pytest.mark.parametrize("name", ["f16_documents", "bidirectional_documents"])
def test_gluon_engine_masks_from_row_runs_or_the_predicate(name, mask_source):
    """Masks that read tensors: PARTIAL blocks test each row's run of keys (the default where the
    plan has them) or evaluate the mask expression, both against the oracle."""
    program = compile_spec(SPECS["f16_documents"].replace("causal & ", "") if name == "bidirectional_documents"
                           else SPECS[name])
    doc = {"doc": inputs.sample(program, 2, 256, 384, seed=4)["doc"]}
    assert runtime.load(program).plan(2, 256, 384, doc).rows is not None
    _check(program, 256, 384, seed=4, mask_source=mask_source)


@hopper
@pytest.mark.parametrize("schedule", ["one_tile", "counter"])
def test_persistent_programs_take_many_tiles_each(schedule, monkeypatch):
    """More tiles than SMs: each program drawing from the counter runs several, its K/V ring and
    Q stage carried from one tile to the next (B=2, 16 heads, 2048 rows: 512 tiles on 132 SMs);
    and one program per tile."""
    program = compile_spec(SPECS["f16_documents"].replace("heads = 4", "heads = 16"))
    monkeypatch.setenv("ATTNC_MEMORY_LIMIT", "16GiB")  # the float64 oracle of 134M cells: about 6 GiB
    _check(program, 2048, 2048, seed=5, schedule=schedule, monkeypatch=monkeypatch)


@hopper
def test_untuned_calls_take_the_engine_and_odd_lengths_fall_back():
    program = compile_spec("attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = q - k < 2048 }")
    kernel = runtime.load(program)
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    config = kernel.config_for(q, k, v)  # rows of 8 blocks: the engine's
    assert (config.engine, config.block_m, config.block_n, config.num_stages) == ("gluon", 128, 128, 2)
    auto = kernel(q, k, v)
    assert torch.equal(auto, kernel(q, k, v, engine="gluon"))
    short = [x[:, :, :256].contiguous() for x in (q, k, v)]
    assert kernel.config_for(*short).engine == "gluon"  # short rows too
    # 1000 rows and keys: not a multiple of the tile; the engine masks the tiles across the ends, its
    # O rows past S_q are never written (the next head's rows are intact), and keys past S_k are hidden
    k2, v2 = k[:, :, :1000].contiguous(), v[:, :, :1000].contiguous()
    q2 = q[:, :, :1000].contiguous()
    assert kernel.config_for(q2, k2, v2).engine == "gluon"
    ref = kernel(q2, k2, v2, engine="triton")
    got = kernel(q2, k2, v2)
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    assert torch.isfinite(got).all()


@hopper
@pytest.mark.parametrize("schedule", ["one_tile", "counter"])
def test_tail_tiles_write_only_their_rows(schedule):
    """The tile across S_q stores its rows under a mask: were it to store all 128 rows, it would
    overwrite the next head's first rows (O is one [B * H * S_q, d] buffer), which every head's
    comparison with the oracle would catch, whatever order the tiles ran in."""
    program = compile_spec("attention t { heads = 4 head_dim = 128 dtype = bf16 mask = q - k < 90 }")
    kernel = runtime.load(program)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ref = kernel(q, k, v, engine="triton")
    o = kernel(q, k, v, engine="gluon", schedule=schedule)
    assert (o.float() - ref.float()).abs().max().item() < 2e-2
    call = inputs.validate(program, {"q": q.float().cpu().numpy(), "k": k.float().cpu().numpy(),
                                     "v": v.float().cpu().numpy()})
    ref_o, _ = oracle.reference(program, call.q, call.k, call.v, {})
    assert np.abs(o.float().cpu().numpy() - ref_o).max() < 2e-2


def test_programs_the_engine_takes():
    refusal = choice.gluon_spec_refusal
    if not gluon_engine.HAS_GLUON:  # (asked directly: a wrong refusal of a valid spec must fail, not skip)
        pytest.skip("this Triton has no Gluon")
    for spec in ("heads = 4 head_dim = 64 dtype = f16", "heads = 4 head_dim = 256 dtype = bf16",
                 "heads = 4 head_dim = 192 / 128 dtype = bf16", "heads = 4 head_dim = 128 / 64 dtype = f16"):
        assert refusal(compile_spec(f"attention a {{ {spec} mask = causal }}")) is None, spec
    for spec in ("heads = 4 head_dim = 128 dtype = f32", "heads = 4 head_dim = 96 dtype = bf16",
                 "heads = 4 head_dim = 128 / 96 dtype = bf16"):
        assert refusal(compile_spec(f"attention a {{ {spec} mask = causal }}")), spec


@pytest.mark.skipif(HOPPER, reason="off sm_90 only")
def test_elsewhere_every_call_takes_the_triton_kernel():
    program = compile_spec("attention a { heads = 2 head_dim = 64 dtype = bf16 mask = causal }")
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 1, 16, 16, seed=1)
    q, k, v = (torch.as_tensor(arrays[n]).to(kernel.device, torch.float16 if runtime.interpreted() else torch.bfloat16)
               for n in ("q", "k", "v"))
    if not runtime.interpreted():
        assert kernel.config_for(q, k, v).engine == "triton"
    with pytest.raises(ValueError, match="engine='gluon': "):
        kernel(arrays["q"], arrays["k"], arrays["v"], engine="gluon")
    with pytest.raises(ValueError, match="engine must be None, 'gluon' or 'triton'"):
        kernel(arrays["q"], arrays["k"], arrays["v"], engine="cuda")
    # each row's run of keys is a mask source of the engine only
    with pytest.raises(ValueError, match="mask_source='rows' is an option of the Gluon engine"):
        kernel(arrays["q"], arrays["k"], arrays["v"], mask_source="rows")
    docs = compile_spec(SPECS["f16_documents"])
    arrays = inputs.sample(docs, 1, 128, 128, seed=1)
    with pytest.raises(ValueError, match="mask_source='rows' is an option of the Gluon engine"):
        runtime.load(docs)(arrays["q"], arrays["k"], arrays["v"], doc=arrays["doc"], mask_source="rows")


def test_overlap_and_registers_follow_the_head_dim():
    """The launch layer's rule (measured on the H200, r44): the intra-warpgroup overlap on f16/bf16
    at head dim 128 only, with 240 consumer registers there; FP8 and the other head dims without."""
    assert choice.gluon_overlap(128, 128, fp8=False) and not choice.gluon_overlap(128, 128, fp8=True)
    assert not any(choice.gluon_overlap(dq, dv, fp8=False) for dq, dv in ((64, 64), (256, 256), (192, 128)))
    assert choice.gluon_regs(128, 128)[1] == 240
    assert choice.gluon_regs(256, 256) == choice.gluon_regs(64, 64) == gluon_engine.REGS


def test_pingpong_follows_the_head_dim():
    """FlashAttention-3's ping-pong on f16/bf16 at head dim 128 (r45: +5% causal, +6% full); FP8
    and head dims 64 (causal) and 256 lost with it."""
    assert choice.gluon_pingpong(128, 128, fp8=False) and not choice.gluon_pingpong(128, 128, fp8=True)
    assert not any(choice.gluon_pingpong(dq, dv, fp8=False) for dq, dv in ((64, 64), (256, 256), (192, 128)))


def test_two_q_buffers_where_they_cost_no_stage():
    """Persistent programs double-buffer Q where the second buffer fits beside the K/V stages they
    would have anyway (r48: FP8 causal / full +3% / +4% at d 128, bf16 unchanged); one tile per
    program, or a head dim whose Q tile would cost a stage (d 256 and 192 on 64-key blocks), keeps one."""
    for d_qk, d_v, bn, fp8, rows in ((128, 128, 128, False, 128), (128, 128, 256, True, 128),
                                     (64, 64, 128, False, 192)):
        assert choice.gluon_q_buffers(d_qk, d_v, bn, 2, 1, fp8, rows) == 2
        assert choice.gluon_smem(d_qk, d_v, bn, choice.gluon_stages(d_qk, d_v, bn, 2, 1, fp8, rows), 1, fp8, rows,
                                 q_bufs=2) <= gluon_engine.SMEM
        assert choice.gluon_q_buffers(d_qk, d_v, bn, 2, 0, fp8, rows) == 1  # one tile per program
    for d_qk, d_v in ((256, 256), (192, 128)):
        stages = choice.gluon_stages(d_qk, d_v, 64, 2)
        assert choice.gluon_q_buffers(d_qk, d_v, 64, 2) == 1
        assert choice.gluon_smem(d_qk, d_v, 64, stages, q_bufs=2) > gluon_engine.SMEM


def test_tma_takes_contiguous_tensors_at_aligned_addresses():
    """A contiguous view at an odd offset would fail TMA's descriptor with an assertion: the launch
    layer sends such calls to the Triton kernel without TMA instead (``device.tma_ready``)."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert device.tma_ready(x, x[2:])
    assert not device.tma_ready(x.view(-1)[1:]) and not device.tma_ready(x.t())
    program = compile_spec(SPECS["gqa_d128_causal"])
    odd = torch.zeros(2 * 8 * 256 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 8, 256, 128)
    refusal = choice.gluon_call_refusal(program, 256, 256, choice.gluon_layouts(odd, odd, odd, "bhsd"), 90)
    assert refusal is not None and (runtime.interpreted() or "16-byte aligned" in refusal)


@hopper
@pytest.mark.parametrize("name", ["causal_gqa_d64", "documents_d64"])
def test_head_dim_64_runs_three_warpgroups_on_192_row_tiles(name, monkeypatch):
    """Head dims up to 64 take 192-row tiles, three consumer warpgroups (``choice.gluon_default_tiles``);
    against the oracle with tiles across S_q and S_k, and the same O as two warpgroups on 128 rows."""
    text = {"causal_gqa_d64": "attention c { heads = 8 / 2 head_dim = 64 dtype = bf16 mask = causal }",
            "documents_d64": SPECS["f16_documents"].replace("head_dim = 128", "head_dim = 64")}[name]
    program = compile_spec(text)
    made = prefill_launches(monkeypatch)
    _check(program, 333, 500, seed=12)
    assert made and all(x.config.block_m == 192 and x.launcher.constexprs["CONSUMERS"] == 3 for x in made)
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, 333, 500, seed=12)
    qkv = [arrays[n] for n in "qkv"]
    tensors = {t.name: arrays[t.name] for t in program.tensors}
    three = np.asarray(kernel(*qkv, **tensors), dtype=np.float32)
    two = np.asarray(kernel(*qkv, block_m=128, block_n=128, engine="gluon", **tensors), dtype=np.float32)
    assert made[-1].launcher.constexprs["CONSUMERS"] == 2
    np.testing.assert_allclose(three, two, atol=1e-2, rtol=1e-2)


@hopper
def test_a_key_launches_raw_after_its_first_call_with_the_same_output(monkeypatch):
    """A key's first call compiles and launches through Triton's JIT; the next ones go straight to
    the C launcher (``raw_launch.raw_launch``), each TMA descriptor encoded once per address: the same
    O bit for bit, with inputs at the first call's addresses and at new ones, bf16 and FP8."""
    from attnc import fp8
    program = compile_spec("attention r { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }")
    kernel = runtime.load(program)
    made = prefill_launches(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, h, 320, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    first = kernel(q, k, v).clone()
    again = kernel(q, k, v)
    moved = kernel(q.clone(), k.clone(), v.clone())
    launcher = made[-1].launcher
    assert launcher.launches["jit"] == 1 and launcher.launches["raw"] == 2, launcher.launches
    assert torch.equal(first, again) and torch.equal(first, moved)
    (q8, dq), (k8, dk), (v8, dv) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v, transposed=True)
    f1 = kernel(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv).clone()
    f2 = kernel(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv)
    assert made[-1].launcher.launches == {"jit": 1, "direct": 0, "raw": 1} and torch.equal(f1, f2)


# ---------------------------------------------------------------- token-major (bshd) q, k, v and O
def _token_major(b, h, s, d, dtype, gen, extra=0, scale=1.0):
    """transformers' view: a [B, S, H * d (+ extra)] projection viewed [B, S, H, d], transposed."""
    x = (torch.randn(b, s, h * d + extra, device="cuda", generator=gen) * scale).to(dtype)
    return x[..., :h * d].view(b, s, h, d).transpose(1, 2)


BSHD_CASES = {  # name: (spec, B, S_q, S_k, extra columns of q's projection, K/V token-major)
    "gqa_d128_tails": ("attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }", 3, 200, 200, 0, True),
    "gqa_d128_append": ("attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }", 2, 77, 333, 0, True),
    "d64_three_consumers": ("attention c { heads = 8 / 2 head_dim = 64 dtype = bf16 mask = causal }", 2, 333, 333, 0,
                            True),
    "fused_q_kv_contiguous": ("attention f { heads = 4 head_dim = 128 dtype = f16 mask = true }", 2, 300, 300, 1024,
                              False),
    "documents_rows": ("attention d { heads = 4 / 2 head_dim = 128 dtype = bf16 tensor doc: i32[b, s] "
                       "mask = causal & doc[b, q] == doc[b, k] }", 2, 250, 250, 0, True),
    "sink_window_d64": ("attention s { heads = 8 / 2 head_dim = 64 dtype = bf16 tensor sinks: f32[h] "
                        "mask = causal & window(100) sink = sinks[h] }", 2, 300, 300, 0, True),
    "d256": ("attention w { heads = 2 head_dim = 256 dtype = f16 mask = causal }", 2, 190, 190, 0, True),
}


@hopper
@pytest.mark.parametrize("name", BSHD_CASES)
def test_gluon_engine_reads_token_major_views_bit_for_bit(name, monkeypatch):
    """q, k, v as token-major views ([B, S, H, d] memory; B > 1 with S across the tiles, so the
    tiles across S read the next request's rows): the Gluon engine reads them in place (every
    layout bshd, or q's alone over contiguous K/V) and writes O token-major, the same O and LSE
    bit for bit as on contiguous copies, and O and LSE against the float64 oracle."""
    text, b, s_q, s_k, extra, kv_bshd = BSHD_CASES[name]
    program = compile_spec(text)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[program.dtype]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = _token_major(b, program.heads_q, s_q, program.d_qk, dtype, gen, extra)
    k, v = (_token_major(b, program.heads_kv, s_k, d, dtype, gen) for d in (program.d_qk, program.d_v))
    if not kv_bshd:
        k, v = k.contiguous(), v.contiguous()
    tensors = {}
    if "doc" in text:
        tensors["doc"] = (torch.arange(s_k, device="cuda") // 60).to(torch.int32).repeat(b, 1)
    if "sinks" in text:
        tensors["sinks"] = torch.randn(program.heads_q, device="cuda", generator=gen)
    kernel = runtime.load(program)
    made = prefill_launches(monkeypatch)
    o, lse = kernel(q, k, v, return_lse=True, **tensors)
    torch.cuda.synchronize()
    assert made[-1].config.engine == "gluon"
    assert made[-1].config.layouts == ("bshd", "bshd" if kv_bshd else "bhsd", "bshd" if kv_bshd else "bhsd", "bshd")
    assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous()
    o_ref, lse_ref = kernel(q.contiguous(), k.contiguous(), v.contiguous(), return_lse=True, **tensors)
    assert made[-1].config.engine == "gluon" and made[-1].config.layouts == choice.BHSD_LAYOUTS
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    host = {n: t.cpu().numpy() for n, t in tensors.items()}
    ref_o, ref_lse = oracle.reference(program, *(x.float().cpu().numpy() for x in (q, k, v)), host)
    co, cl = numerics.compare_outputs(program.dtype, o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)


@hopper
def test_token_major_views_through_the_public_call_and_autograd(monkeypatch):
    """``attnc.compile(spec)(q, k, v)`` on transformers-style views: O token-major (no copy for the
    caller's transpose), equal to contiguous inputs' bit for bit; the backward copies the views
    for the Gluon passes (``gluon_backward.takes_copies``) and gives the contiguous call's gradients."""
    import attnc
    from attnc.backends.triton import gluon_backward
    made = []
    takes = gluon_backward.takes_copies
    monkeypatch.setattr(gluon_backward, "takes_copies", lambda *a: made.append(takes(*a)) or made[-1])
    attn = attnc.compile("attention g { mask = causal }")
    gen = torch.Generator(device="cuda").manual_seed(9)
    b, s = 2, 333
    q, k, v = (_token_major(b, h, s, 128, torch.bfloat16, gen) for h in (8, 2, 2))
    o = attn(q, k, v)
    assert o.transpose(1, 2).is_contiguous()
    assert torch.equal(o, attn(q.contiguous(), k.contiguous(), v.contiguous()))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    copies = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    g = torch.randn(b, s, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    (attn(*leaves).transpose(1, 2) * g).float().sum().backward()
    assert made == [True], made  # (the views' backward: copied for the Gluon passes)
    (attn(*copies).transpose(1, 2) * g).float().sum().backward()
    for x, y in zip(leaves, copies):
        torch.testing.assert_close(x.grad, y.grad, rtol=2e-2, atol=2e-2)


@hopper
@pytest.mark.parametrize("stmt,fails", [("scale = 1e9", True), ("score = score * 0.001 - 2e9", True),
                                        ("scale = 0.0883883", False), ("score = score * 0.001 - 1e9", False)])
def test_rows_past_the_score_limit_are_the_error_on_the_engine(stmt, fails, monkeypatch):
    """A bf16 causal call on the Gluon engine whose rows' largest scores reach 2^30 in magnitude
    (``scale`` 1e9 times q.k of a few units; every score near -2e9) is the non-finite score error, as
    on numpy and the oracle (compiler.numerics.SCORE_LIMIT): the engine's epilogue marks the row
    however its fused multiply-add left the sums; inside the limit (-1e9 included) the call answers."""
    import attnc
    from attnc.compiler.errors import PlanError
    monkeypatch.setenv("ATTNC_CHECK_FINITE", "1")  # (raise at the call, naming the row)
    made = prefill_launches(monkeypatch)
    attn = attnc.compile(f"attention far {{ heads = 4 head_dim = 128 dtype = bf16 {stmt} mask = causal }}")
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    if fails:
        with pytest.raises(PlanError, match=r"2\^30"):
            attn(q, k, v)
    else:
        assert torch.isfinite(attn(q, k, v)).all()
    assert made and {x.config.engine for x in made} == {"gluon"}
