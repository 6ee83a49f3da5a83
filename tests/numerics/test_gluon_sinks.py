"""Learned sinks (``sink = expr``) on Hopper's Gluon engines and the Gluon backward, against the
float64 oracle on an sm_90 GPU (ATTNC_TEST_GPU=1 on an H100 / H200): prefill with rows that see
no key (O = 0, LSE = the sink), a sink of -inf (no sink) and one above every score, GQA, gpt-oss's
layers (sliding window 128 and causal, d 64, 64 / 8 heads' group of 8), the separable form and
FP8 with a sink, appends over a paged cache; dQ, dK, dV and the sink's gradient through autograd
on the Gluon backward, bit for bit run to run.  On the CPU: the launch layer hands the sink to
both engines (not to a block of a larger call, whose merge adds it), and a call that wants only
the sink's gradient keeps the Gluon backward (a score tensor's gradient takes the Triton passes).
The kernels' compilation for sm_90: tests/numerics/test_triton_gluon_ptx.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.backends.common import load_module  # noqa: E402
from attnc.backends.triton import choice, gluon_backward as GB, launch, plans, runtime  # noqa: E402
from attnc.backends.triton.emit import emit  # noqa: E402
from attnc.backends.triton.kernels import gluon_engine  # noqa: E402
from attnc.compiler import inputs, numerics, oracle, sinks  # noqa: E402
from attnc.compiler.errors import PlanError  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from tests.conftest import ROOT, prefill_launches, triton_device  # noqa: E402

HOPPER = (not runtime.interpreted() and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon engines run on an sm_90 GPU (ATTNC_TEST_GPU=1)")
needs_gluon = pytest.mark.skipif(not gluon_engine.HAS_GLUON, reason="this Triton has no Gluon")

SINK = "tensor sinks: f32[h] ~ uniform(-2.0, 2.0)"
SPECS = {
    # GQA; positions 4, 300 and 350 see no key (O = 0, LSE = the sink); the sink reads b too
    "gqa_unseen_rows_d128": "attention s { heads = 8 / 2 head_dim = 128 dtype = bf16 %s mask = causal & "
                            "(k > 0 | q > 2) & q != 4 & q != 300 & q != 350 sink = sinks[h] * 0.5 + b }" % SINK,
    "gpt_oss_window_d64": "attention g { heads = 16 / 2 head_dim = 64 dtype = bf16 %s mask = causal & window(128) "
                          "sink = sinks[h] }" % SINK,
    "gpt_oss_causal_d64": "attention g { heads = 16 / 2 head_dim = 64 dtype = bf16 %s mask = causal "
                          "sink = sinks[h] }" % SINK,
    # the separable form: the row part joins LSE before the sink does
    "alibi_f16_d64": "attention a { heads = 4 head_dim = 64 dtype = f16 %s mask = causal "
                     "score = score - exp(-(h + 1) * log(2.0)) * (q - k) sink = sinks[h] }" % SINK,
}
PHASES = {"tails": (333, 333), "append_tails": (77, 400)}  # tiles across S_q and S_k


def _sinks(program, arrays):
    """The sampled sinks with head 0's -inf (no sink) and head 1's 6.0 (above every score)."""
    s = np.array(arrays["sinks"], np.float32)
    s[0], s[1] = -np.inf, 6.0
    return s


def _cuda(program, arrays):
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[program.dtype]
    qkv = [torch.as_tensor(np.ascontiguousarray(arrays[n]), dtype=torch.float32).to("cuda", dt) for n in "qkv"]
    return qkv, {"sinks": torch.as_tensor(arrays["sinks"]).cuda()}


def _unseen_rows(program, call):
    """[B, H, S_q]: True where a row sees no key (the oracle's LSE without sinks is -inf there)."""
    none = np.full(np.shape(call.tensors["sinks"]), -np.inf, np.float32)
    return np.isneginf(oracle.reference(program, call.q, call.k, call.v, {**call.tensors, "sinks": none})[1])


@hopper
@pytest.mark.parametrize("schedule", ["one_tile", "counter"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", SPECS)
def test_prefill_with_sinks_on_the_engine_matches_the_oracle(name, phase, schedule, monkeypatch):
    program = compile_spec(SPECS[name])
    s_q, s_k = PHASES[phase]
    arrays = inputs.sample(program, 2, s_q, s_k, seed=5)
    arrays["sinks"] = _sinks(program, arrays)
    call = inputs.validate(program, arrays)
    made = prefill_launches(monkeypatch)
    (q, k, v), tensors = _cuda(program, arrays)
    o, lse = runtime.load(program)(q, k, v, return_lse=True, engine="gluon", schedule=schedule, **tensors)
    assert made and all(x.config.engine == "gluon" and x.launcher.constexprs["HAS_SINK"] for x in made)
    o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    assert np.isfinite(o).all()
    # rows that see no key: O = 0 and LSE = the sink (-inf on head 0, whose sink is none)
    empty = _unseen_rows(program, call)
    sink = np.broadcast_to(sinks.values(program, 2, call.tensors)[..., None], lse.shape)
    assert empty.any() == (name == "gqa_unseen_rows_d128")
    assert not o[empty].any()
    np.testing.assert_allclose(lse[empty], sink[empty], rtol=0, atol=1e-6)


@hopper
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_sink_tensor_marks_its_rows_without_a_host_sync(bad, monkeypatch):
    """``sink = sinks[h]`` makes no non-finite value from finite inputs, so a GPU call does not check
    its rows at the call (a host sync per call: 456 us of host time in r52's gpt-oss layer): a
    NaN or +inf in the tensor marks its head's rows NaN and the device flag (the engine's epilogue
    sets it: no marking launch), check_numerics raises, and ATTNC_CHECK_FINITE=1 raises at the call
    naming the first row."""
    program = compile_spec(SPECS["gpt_oss_window_d64"])
    arrays = inputs.sample(program, 1, 256, 256, seed=7)
    arrays["sinks"] = np.array(arrays["sinks"], np.float32)
    arrays["sinks"][3] = bad
    (q, k, v), tensors = _cuda(program, arrays)
    kernel = runtime.load(program)
    monkeypatch.delenv(runtime.CHECK_FINITE_VAR, raising=False)
    assert kernel._row_check(q)[0] is False, "a tensor sink took the host check"
    o, lse = kernel(q, k, v, return_lse=True, **tensors)
    rows = lse.isnan().any(dim=-1)[0].cpu().numpy()
    assert rows.tolist() == [h == 3 for h in range(program.heads_q)]
    assert kernel._mark is None, "a launch of its own marked the call (the engine marks its NaN rows itself)"
    with pytest.raises(PlanError, match="or a NaN or \\+inf sink"):
        kernel.check_numerics()
    kernel.check_numerics()  # (cleared)
    monkeypatch.setenv(runtime.CHECK_FINITE_VAR, "1")
    with pytest.raises(PlanError, match=r"query row \(b=0, h=3, q=0\) is NaN"):
        kernel(q, k, v, **tensors)


@hopper
@pytest.mark.parametrize("tiles", [(128, 128), (192, 64)])
def test_gpt_oss_window_with_sinks_on_other_tiles(tiles, monkeypatch):
    """d 64's other tiles (two consumer warpgroups on 128 rows; three on 192 rows with 64 keys):
    the sink's join is the same per consumer."""
    program = compile_spec(SPECS["gpt_oss_window_d64"])
    arrays = inputs.sample(program, 2, 333, 333, seed=6)
    arrays["sinks"] = _sinks(program, arrays)
    call = inputs.validate(program, arrays)
    made = prefill_launches(monkeypatch)
    (q, k, v), tensors = _cuda(program, arrays)
    o, lse = runtime.load(program)(q, k, v, return_lse=True, engine="gluon", block_m=tiles[0], block_n=tiles[1],
                                   **tensors)
    assert made and (made[-1].config.block_m, made[-1].config.block_n) == tiles
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))


@hopper
def test_fp8_with_a_sink_on_the_engine():
    """FP8 e4m3 Q, K, V^T with per-head descales and ALiBi's separable form: the sink scales O
    through the divisor the V descale multiplies (``gluon_engine._ws_rows_out``)."""
    from attnc import fp8
    program = compile_spec("attention a { heads = 4 / 2 head_dim = 128 dtype = bf16 %s mask = causal "
                           "score = score - exp(-(h + 1) * log(2.0)) * (q - k) sink = sinks[h] }" % SINK)
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 2, 200, 333, seed=7)
    arrays["sinks"] = _sinks(program, arrays)
    call = inputs.validate(program, arrays)
    q, k, v = (torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32).cuda() for x in (call.q, call.k, call.v))
    (q8, dq), (k8, dk), (v8, dv) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v, transposed=True)
    d = {"q_descale": dq, "k_descale": dk, "v_descale": dv}
    o, lse = kernel(q8, k8, v8, return_lse=True, sinks=torch.as_tensor(arrays["sinks"]).cuda(), **d)
    assert next(iter(kernel._bound.values()))[1], "the FP8 call did not take the engine"
    deq = [fp8.dequantize(x, d[n], torch.float64).cpu().numpy() for x, n in ((q8, "q_descale"), (k8, "k_descale"),
                                                                             (v8, "v_descale"))]
    ref_o, ref_lse = oracle.reference(program, *deq, call.tensors)
    co, cl = numerics.compare_fp8_outputs(o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))


@hopper
@pytest.mark.parametrize("layout", ["paged(page_size = 16, layout = nhd, table = dense)",
                                    "paged(page_size = 128, layout = hnd, table = csr)"], ids=["nhd16", "hnd128"])
def test_appends_with_sinks_over_a_paged_cache(layout):
    """The engine over a cache joins request b's sink once per row (no split to merge): a long
    append, one whose tile crosses its end, an idle request, an append over no history."""
    program = compile_spec("attention c { heads = 16 / 2 head_dim = 64 dtype = bf16 %s mask = causal & window(128) "
                           "sink = sinks[h] + 0.25 * b cache = %s }" % (SINK, layout))
    kv_lens, q_lens = [700, 333, 0, 129], [300, 200, 0, 129]
    arrays = inputs.sample_cache(program, kv_lens, q_lens, 3, cache_rows=len(kv_lens) + 1)
    arrays["sinks"] = _sinks(program, arrays)
    kernel = runtime.load(program)
    dev = {n: torch.from_numpy(np.ascontiguousarray(a, np.float32)).cuda() if n == "sinks" else
           torch.from_numpy(np.ascontiguousarray(a, np.float32)).to("cuda", torch.bfloat16)
           if np.asarray(a).dtype.kind == "f" else torch.from_numpy(np.ascontiguousarray(a, np.int32)).cuda()
           for n, a in arrays.items()}
    q = dev.pop("q")
    assert kernel.decode_plan(dict(dev), total_q=int(q.shape[0]))["engine"] == "gluon"
    o, lse = kernel.decode(q, return_lse=True, **dev)
    ref_o, ref_lse = oracle.reference_cache(program, inputs.validate_cache(program, arrays))
    co, cl = numerics.compare_outputs("bf16", o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    split = kernel.decode(q, return_lse=True, engine="split", **dev)  # the split producer and combine
    assert torch.allclose(split[1], lse, atol=1e-4, rtol=0)


def _backward(program_text, s_q, s_k, seed, default=True, monkeypatch=None):
    attn = attnc.compile(program_text)
    p = attn.program
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, p.heads_q, s_q, p.d_qk), (2, p.heads_kv, s_k, p.d_qk), (2, p.heads_kv, s_k, p.d_v)]
    q, k, v = (torch.randn(s, generator=g).to("cuda", torch.bfloat16).requires_grad_() for s in shapes)
    s = (torch.rand(p.heads_q, generator=g) * 4 - 2)
    s[0] = -float("inf")
    s = s.cuda().requires_grad_()
    monkeypatch.setattr(GB, "DEFAULT", default)
    o, lse = attn(q, k, v, sinks=s, return_lse=True)
    g_o = torch.randn(o.shape, generator=g).to("cuda", o.dtype)
    g_lse = torch.randn(lse.shape, generator=g).cuda()
    grads = torch.autograd.grad((o.float() * g_o).sum() + (torch.where(lse.isinf(), 0, lse) * g_lse).sum(),
                                (q, k, v, s))
    return attn, (q, k, v, s), (o, lse, g_o, g_lse), grads


@hopper
@pytest.mark.parametrize("shape", [(333, 333), (77, 400)], ids=["tails", "append_tails"])
@pytest.mark.parametrize("text", [SPECS["gpt_oss_window_d64"], SPECS["gqa_unseen_rows_d128"].replace(" + b", "")],
                         ids=["gpt_oss_window_d64", "gqa_unseen_rows_d128"])
def test_backward_with_sinks_on_the_gluon_passes(text, shape, monkeypatch):
    """dQ, dK, dV and dSinks through autograd (the sinks' tensor wants its gradient): the Gluon passes
    run (D and LSE carry the sink; dSinks from LSE and D on the host), against the float64 reference,
    the Triton backward's within bf16's error, and bit for bit on a second run."""
    calls = []
    call = GB.GluonBackwardLaunch.__call__
    monkeypatch.setattr(GB.GluonBackwardLaunch, "__call__",
                        lambda self, *a, **kw: calls.append(1) or call(self, *a, **kw))
    attn, leaves, (o, lse, g_o, g_lse), grads = _backward(text, *shape, seed=2, monkeypatch=monkeypatch)
    assert calls, "the call took the Triton backward"
    f64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    q, k, v, s = leaves
    dlse = np.where(np.isinf(f64(lse)), 0.0, f64(g_lse))
    want = oracle.reference_backward(attn.program, f64(q), f64(k), f64(v), f64(g_o.float()), {"sinks": f64(s)},
                                     dlse=dlse)
    for name, got, ref in zip(("dQ", "dK", "dV"), grads[:3], want[:3]):
        c = numerics.compare_gradient(name, "bf16", f64(got), ref)
        assert c.ok, str(c)
    c = numerics.compare_gradient("dsinks", "bf16", f64(grads[3]), want[3]["sinks"])
    assert c.ok, str(c)
    assert grads[3][0] == 0  # the -inf sink: no probability, no gradient
    again = _backward(text, *shape, seed=2, monkeypatch=monkeypatch)[3]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    triton = _backward(text, *shape, seed=2, default=False, monkeypatch=monkeypatch)[3]
    for a, b in zip(grads, triton):
        assert ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() < 1e-2


# ---------------------------------------------------------------- the host side, everywhere
@needs_gluon
def test_the_gluon_engines_take_a_sink_spec():
    assert choice.gluon_spec_refusal(compile_file(ROOT / "examples" / "sink_attention.attn")) is None


def test_the_launch_layer_hands_the_sink_to_both_engines(monkeypatch):
    """The prefill engine's launch takes HAS_SINK and the spec's ``sink_value`` (a block of a larger
    call does not: the merge adds the sink once per row); the engine over a cache takes them too."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    program = compile_spec(SPECS["gpt_oss_window_d64"])
    module = load_module(*(lambda x: (x.text, x.module_stem))(emit(program)))
    arrays = plans.upload(plans.walk_arrays(runtime.load(program).plan(1, 384, 384, {}, 192, 128)), "cpu")
    config = choice.PrefillConfig(engine="gluon", block_m=192, block_n=128, num_warps=4, num_stages=2)
    whole = launch.PrefillLaunch(module, config, arrays, (1, 384, 384), "cpu")
    assert whole.launcher.fn is gluon_engine._attn_fwd_ws
    assert whole.launcher.constexprs["HAS_SINK"] and whole.launcher.constexprs["SINK"] is module.sink_value
    block = launch.PrefillLaunch(module, config, arrays, (1, 384, 384), "cpu", offsets=(0, 0))
    assert not block.launcher.constexprs["HAS_SINK"] and block.launcher.constexprs["SINK"] is None
    cache = launch.CacheLaunch(module, 128, True, 16, "cpu")._launcher(4096)
    assert cache.constexprs["HAS_SINK"] and cache.constexprs["SINK"] is module.sink_value
    plain = load_module(*(lambda x: (x.text, x.module_stem))(emit(compile_spec(
        "attention c { heads = 16 / 2 head_dim = 64 dtype = bf16 mask = causal }"))))
    assert not launch.CacheLaunch(plain, 128, True, 16, "cpu")._launcher(4096).constexprs["HAS_SINK"]


@pytest.mark.parametrize("body, gluon", [("sink = sinks[h]", True),
                                         ("score = score + sinks[h] sink = sinks[h] * 2.0", False)],
                         ids=["sink_only", "score_and_sink"])
def test_a_call_wanting_the_sinks_gradient_keeps_the_gluon_backward(body, gluon, monkeypatch):
    """The sink's tensors' gradients come from LSE and D (``BackwardCalls._sink_grads``), which both
    backwards give: such a call keeps the Gluon passes; a tensor the score program reads needs the
    Triton passes' plan rows (``score_grads``).  ``gluon_backward.choose`` stands in (the passes run
    on an sm_90 GPU only)."""
    chosen = GB.default_config(64)
    monkeypatch.setattr(GB, "choose", lambda *a, **kw: chosen)
    kernel = runtime.load(compile_spec("attention g { heads = 4 / 2 head_dim = 64 dtype = bf16 tensor sinks: f32[h] "
                                       f"mask = causal {body} }}"))
    dev = triton_device()
    q, k, v = (torch.zeros(1, h, 8, 64, dtype=torch.bfloat16, device=dev) for h in (4, 2, 2))
    lse = torch.zeros(1, 4, 8, device=dev)
    tensors = {"sinks": torch.zeros(4, device=dev)}
    got = kernel._backward_bind(q, k, v, q, lse, q, None, tensors, None, ("sinks",))[1]
    assert (got is chosen) == gluon
    assert kernel._backward_bind(q, k, v, q, lse, q, None, tensors, None, ())[1] is chosen
