"""The Gluon dK/dV pass (``backends/triton/gluon_backward.py``) on an sm_90 GPU (ATTNC_TEST_GPU=1 on
an H100 / H200): dQ, dK, dV against the float64 reference backward and against the Triton
backward, on masks with FULL and PARTIAL blocks, GQA, a score program, a mask reading a tensor,
tiles across S_q and S_k and bottom-right calls; bit-identical gradients run to run.  On the CPU:
the group column lists against the plan, and where the pass is refused."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402
from attnc.backends.triton import gluon_backward as GB, runtime  # noqa: E402
from tests.conftest import to_triton  # noqa: E402

HOPPER = (not runtime.interpreted() and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an sm_90 GPU (ATTNC_TEST_GPU=1)")

SPECS = {
    "gqa_d128_causal": "attention g { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }",
    "d64_full": "attention f { heads = 4 head_dim = 64 dtype = bf16 mask = true }",
    "f16_window": "attention w { heads = 4 / 2 head_dim = 128 dtype = f16 mask = causal & q - k < 200 }",
    "documents": "attention d { heads = 4 head_dim = 64 dtype = bf16 tensor doc: i32[b, s] ~ segments(16, 300) "
                 "mask = causal & doc[b, q] == doc[b, k] }",
    "softcap_gqa": "attention s { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal "
                   "score = 30.0 * tanh(score / 30.0) }",
    "prefix_lm": "attention p { heads = 4 head_dim = 128 dtype = bf16 mask = causal | k < 100 }",
}
SHAPES = {"tails": (333, 333), "append_tails": (77, 400)}  # (tiles across S_q and S_k; the study runs S = 8192)
# every launch on the default; the other dK/dV kernel and dQ modes on two of the calls, beside the Triton backward
CONFIGS = {"triton_dq": dict(dq="triton"), "plain_atomic": dict(warp_specialize=False, dq="atomic"),
           "fused": dict(dq="fused"), "fused_atomic": dict(dq="fused_atomic"),
           "fused_two_tiles": dict(dq="fused", dq_buffers=2)}
WIDE = {("gqa_d128_causal", "tails"), ("softcap_gqa", "append_tails"), ("documents", "tails"), ("d64_full", "tails")}


def _call(program, s_q, s_k, seed, batch=2):
    kernel = runtime.load(program)
    arrays = inputs.sample(program, batch, s_q, s_k, seed=seed)
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[program.dtype]
    q, k, v = (torch.as_tensor(np.ascontiguousarray(arrays[n]), device="cuda").to(dt) for n in ("q", "k", "v"))
    tensors = {t.name: torch.as_tensor(arrays[t.name].astype(np.int32), device="cuda") for t in program.tensors}
    o, lse = kernel(q, k, v, return_lse=True, **tensors)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device)
    return kernel, arrays, (q, k, v, o, lse, do), tensors


@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SPECS)
def test_gluon_backward_matches_the_reference_and_the_triton_backward(name, shape):
    program = compile_spec(SPECS[name])
    s_q, s_k = SHAPES[shape]
    kernel, arrays, args, tensors = _call(program, s_q, s_k, seed=11)
    call = inputs.validate(program, {n: arrays[n] for n in ("q", "k", "v")} | {n: arrays[n] for n in tensors})
    ref = oracle.reference_backward(program, call.q, call.k, call.v, args[5].double().cpu().numpy(), call.tensors)
    default = GB.default_config(program.d_qk)
    configs = {"default": default}
    if (name, shape) in WIDE:
        configs.update({n: GB.GluonBackwardConfig(**{**default.__dict__, **c}) for n, c in CONFIGS.items()})
        triton = kernel.backward(*args, **tensors)
    for cname, config in configs.items():
        got = kernel.backward(*args, config=config, **tensors)
        for i, n in enumerate(("dQ", "dK", "dV")):
            c = numerics.compare_gradient(n, program.dtype, got[i].float().cpu().numpy(), ref[i])
            assert c.ok, f"{cname}: {c}"
            if (name, shape) in WIDE:
                t = triton[i].float()
                err = ((got[i].float() - t).norm() / t.norm().clamp_min(1e-30)).item()
                assert err < 1e-2, f"{cname} {n}: rel-L2 {err} from the Triton backward"


@hopper
@pytest.mark.parametrize("dq", ["gluon", "fused", "fused_two_tiles"])
@pytest.mark.parametrize("name", ["softcap_gqa", "gqa_d128_causal", "d64_full"])
def test_gluon_backward_is_deterministic(name, dq):
    """Bit-identical gradients run to run: the default, and the fused dQ whose K/V tiles add into
    each query tile's float32 dQ in turn (its counters); the fused dQ also matches the default's
    gradients within rounding."""
    program = compile_spec(SPECS[name])
    kernel, _, args, tensors = _call(program, 1000, 1000, seed=5)
    asked = {"dq": "fused", "dq_buffers": 2} if dq == "fused_two_tiles" else {"dq": dq}
    config = GB.GluonBackwardConfig(**{**GB.default_config(program.d_qk).__dict__, **asked})
    first = kernel.backward(*args, config=config, **tensors)
    for _ in range(3):
        again = kernel.backward(*args, config=config, **tensors)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    if dq != "gluon":
        base = kernel.backward(*args, config=GB.GluonBackwardConfig(dq="gluon"), **tensors)
        for a, b in zip(first, base):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


@hopper
def test_the_public_call_takes_the_gluon_backward_by_default(monkeypatch):
    """``attn(q, k, v)`` under autograd: the default backward is the Gluon one on an eligible call,
    also when autograd hands dO over as an expanded view (``o.sum()``: copied for TMA); its
    gradients match the Triton backward's (``gluon_backward.DEFAULT`` off)."""
    import attnc
    attn = attnc.compile("attention c { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }")
    g = torch.Generator(device="cuda").manual_seed(3)
    leaves = [torch.randn((2, h, 700, 128), device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
              for h in (8, 2, 2)]
    grads = {}
    for default in (True, False):
        monkeypatch.setattr(GB, "DEFAULT", default)
        grads[default] = torch.autograd.grad(attn(*leaves).sum(), leaves)
    for a, b in zip(grads[True], grads[False]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    assert not all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))  # two engines, two roundings


@hopper
def test_the_public_call_asked_for_an_unordered_backward_adds_dq_unordered(monkeypatch):
    """``attnc.compile(spec, deterministic=False)``: the Gluon backward takes dQ fused and unordered
    (``fused_atomic``); its gradients match the deterministic call's within rounding."""
    import attnc
    text = "attention c { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }"
    made = []
    init = GB.GluonBackwardLaunch.__init__

    def spy(self, module, config, *a, **kw):
        made.append(config.dq)
        init(self, module, config, *a, **kw)
    monkeypatch.setattr(GB.GluonBackwardLaunch, "__init__", spy)
    from attnc.backends.triton import plans
    plans.PLANS.clear()  # (launches an earlier test left for these calls would be reused: none made here)
    g = torch.Generator(device="cuda").manual_seed(5)
    base = [torch.randn((2, h, 700, 128), device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2)]
    grads = {}
    for deterministic in (True, False):
        attn = attnc.compile(text, deterministic=deterministic)
        leaves = [x.clone().requires_grad_() for x in base]
        grads[deterministic] = torch.autograd.grad(attn(*leaves).square().sum(), leaves)
    assert made == ["gluon", "fused_atomic"]
    for a, b in zip(grads[True], grads[False]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_group_lists_walk_the_plans_columns():
    """Every (query block, head) the plan computes for a key tile, once, with its PARTIAL flag: a
    plan that depends on the head (per-head planes) and one that does not (one plane, broadcast
    over the group)."""
    rng = np.random.default_rng(0)
    for planes_h in (1, 8):
        classes = rng.integers(0, 3, size=(2, planes_h, 5, 4)).astype(np.int8)
        lists = GB.group_lists(classes, 4)
        ptr, ent = lists["ptr"], lists["ent"]
        kv_planes = lists["kv_planes"]
        assert kv_planes == (2 if planes_h == 8 else 1)
        for pb in range(2):
            for kvp in range(kv_planes):
                for n in range(4):
                    col = (pb * kv_planes + kvp) * 4 + n
                    got = sorted((int(e) >> 8, (int(e) >> 1) & 127, int(e) & 1) for e in ent[ptr[col]:ptr[col + 1]])
                    want = sorted((m, g, int(classes[pb, kvp * 4 + g if planes_h > 1 else 0, m, n] == 1))
                                  for g in range(4) for m in range(5)
                                  if classes[pb, kvp * 4 + g if planes_h > 1 else 0, m, n] != 0)
                    assert got == want
            order = lists["order"].reshape(2, kv_planes, 4)[pb]
            work = np.diff(ptr).reshape(2, kv_planes, 4)[pb]
            for kvp in range(kv_planes):
                assert list(work[kvp][order[kvp]]) == sorted(work[kvp], reverse=True)


@pytest.mark.skipif(not GB.HAS_GLUON, reason="this Triton has no Gluon")
def test_group_lists_give_the_fused_dq_its_turns():
    """The fused dQ's walk: each key tile's query blocks descending, and every entry's turn the
    number of key tiles launched before its own (the plane's ``order``) that compute the same
    (query block, head) -- so the turns of a cell are 0, 1, ... in launch order.  On a causal plane
    each key tile's j-th entry follows its predecessor's j-th entry (waits one entry deep)."""
    rng = np.random.default_rng(1)
    for planes_h, group in ((1, 4), (8, 4), (2, 1)):
        classes = rng.integers(0, 3, size=(2, planes_h, 6, 5)).astype(np.int8)
        plain, fused = GB.group_lists(classes, group), GB.group_lists(classes, group, fused=True)
        assert "turn" not in plain and np.array_equal(plain["ptr"], fused["ptr"])
        assert np.array_equal(plain["order"], fused["order"])
        ptr, ent, turn, order = fused["ptr"], fused["ent"], fused["turn"], fused["order"]
        kt, planes = 5, len(ptr[:-1]) // 5
        for plane in range(planes):
            ranks = {int(n): r for r, n in enumerate(order[plane * kt:(plane + 1) * kt])}
            cells = {}
            for n in range(kt):
                col = plane * kt + n
                got = [(int(e) >> 1) & 127 for e in ent[ptr[col]:ptr[col + 1]]]
                assert got == sorted(got)  # heads in turn
                blocks = [(int(e) >> 1 & 127, int(e) >> 8) for e in ent[ptr[col]:ptr[col + 1]]]
                assert all(a[0] < b[0] or a[1] > b[1] for a, b in zip(blocks, blocks[1:]))  # descending blocks
                for (g, m), t in zip(blocks, turn[ptr[col]:ptr[col + 1]]):
                    cells.setdefault((g, m), []).append((ranks[n], int(t)))
            for seen in cells.values():
                assert [t for _, t in sorted(seen)] == list(range(len(seen)))
    causal = np.zeros((1, 1, 8, 4), np.int8)  # 64-row query blocks, 128-key tiles
    for m in range(8):
        for n in range(4):
            causal[0, 0, m, n] = 2 if m >= 2 * n + 2 else 1 if m >= 2 * n else 0
    lists = GB.group_lists(causal, 1, fused=True)
    ptr, ent, turn = lists["ptr"], lists["ent"], lists["turn"]
    assert list(lists["order"]) == [0, 1, 2, 3]  # heaviest first: the launch order
    for n in range(1, 4):
        mine, before = ent[ptr[n]:ptr[n + 1]] >> 8, ent[ptr[n - 1]:ptr[n]] >> 8
        assert list(mine) == list(before[:len(mine)])  # entry j: the same query block as the predecessor's
        assert list(turn[ptr[n]:ptr[n + 1]]) == [n] * len(mine)


def test_the_fused_dq_store_scales_and_zeroes_the_tiles_nobody_wrote():
    """``_bwd_dq_store`` with COUNTED (the fused dQ's cast; in the interpreter, or compiled on the GPU
    under ATTNC_TEST_GPU=1): dQ = SCALE * the
    float32 workspace where a tile's count is positive, 0 where no K/V tile wrote it (the workspace
    there is never written: garbage that must not leak); tiles across S_q."""
    from attnc.backends.triton import launch as L
    from attnc.backends.triton.kernels import backward as K
    b, h, s, d, block = 1, 2, 100, 16, 32
    tiles = -(-s // block)
    dqa = to_triton(torch.randn(b * h * s * d, dtype=torch.float32))  # (on the Triton backend's device)
    counts = to_triton(torch.tensor([1, 0, 3, 2, 0, 0, 1, 5], dtype=torch.int32))  # [b * h, tiles]
    dq = to_triton(torch.empty(b, h, s, d, dtype=torch.float32))
    store = L.Launcher(K._bwd_dq_store, dict(H_Q=h, BLOCK=block, D_QK=d, D_QK_PAD=d, SCALE=0.25, COUNTED=True))
    store.launch((tiles, b * h), (dqa, dq, counts, *dq.stride(), s, s), None)
    want = (dqa.cpu().view(b, h, s, d) * 0.25).clone()
    for bh in range(b * h):
        for t in range(tiles):
            if counts[bh * tiles + t] == 0:
                want[0, bh, t * block:(t + 1) * block] = 0.0
    assert torch.equal(dq.cpu(), want)


def test_where_the_gluon_backward_is_refused():
    cfg = GB.GluonBackwardConfig()
    ok = compile_spec(SPECS["gqa_d128_causal"])
    assert GB.refusal(ok, 1, 512, 512, True, 90, False, cfg) is None
    assert "interpreter" in GB.refusal(ok, 1, 512, 512, True, 90, True, cfg)
    assert "sm_90" in GB.refusal(ok, 1, 512, 512, True, 80, False, cfg)
    assert "contiguous" in GB.refusal(ok, 1, 512, 512, False, 90, False, cfg)
    assert "rows" in GB.refusal(ok, 1, 8, 8, True, 90, False, cfg)  # 16 rows of K/V in all
    f32 = compile_spec("attention x { heads = 2 head_dim = 64 dtype = f32 mask = causal }")
    assert "f16 / bf16" in GB.refusal(f32, 1, 512, 512, True, 90, False, cfg)
    mla = compile_spec("attention m { heads = 2 head_dim = 192 / 128 dtype = bf16 mask = causal }")
    assert "head dims" in GB.refusal(mla, 1, 512, 512, True, 90, False, cfg)


def test_config_refuses_what_no_kernel_runs():
    with pytest.raises(ValueError, match="dq must be one of"):
        GB.GluonBackwardConfig(dq="fast")
    with pytest.raises(ValueError, match="warp_specialize=False"):
        GB.GluonBackwardConfig(dq="atomic")
    with pytest.raises(ValueError, match="128-key tiles"):
        GB.GluonBackwardConfig(block_n=64)
    for dq in ("fused", "fused_atomic"):
        with pytest.raises(ValueError, match="warp_specialize=True"):
            GB.GluonBackwardConfig(dq=dq, warp_specialize=False)
    assert GB.GluonBackwardConfig(block_n=64, warp_specialize=False, dq="atomic").dq == "atomic"
    with pytest.raises(ValueError, match="dq_split must be 0"):
        GB.GluonBackwardConfig(dq="fused", dq_split=4)


def test_the_fused_dq_split_is_the_head_dims_unless_asked():
    """``dq_split`` 0 takes the head dim's (d 128: two 64-column halves; d 64: whole entries in turn);
    1 at d 128 (one warpgroup per entry, the study's variant) fits shared memory with its 128-column
    float32 dQ tiles."""
    fused = GB.GluonBackwardConfig(dq="fused")
    assert (fused.split(128), fused.split(64)) == (2, 1)
    single = GB.GluonBackwardConfig(dq="fused", dq_split=1)
    assert single.split(128) == 1 and "dQ split 1" in single.describe()
    assert GB.smem_bytes(128, fused) < GB.smem_bytes(128, single) <= GB.SMEM


@pytest.mark.skipif(not GB.HAS_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("dq", ["gluon", "triton", "atomic", "fused", "fused_atomic"])
def test_the_launch_binds_its_passes_on_the_calls_plan(dq):
    """The host side of every dQ mode (the kernels launch on an sm_90 GPU only): one dK/dV program per
    (key tile, request * K/V head), one dQ program per (query tile, request * query head), the group
    column lists over the whole GQA group."""
    program = compile_spec(SPECS["gqa_d128_causal"])  # heads 8 / 2
    kernel = runtime.load(program)
    config = GB.GluonBackwardConfig(dq=dq, **({"warp_specialize": False} if dq == "atomic" else {}))
    plan = kernel.plan(2, 333, 400, {}, 128, 64)
    launch = GB.GluonBackwardLaunch(kernel.module, config, plan.retile, (2, 333, 400), "cpu")
    assert launch.grid == (4 * 2 * 2,)  # ceil(400 / 128) key tiles, 2 requests, 2 K/V heads
    assert int(launch.arrays["ptr"][-1]) == len(launch.arrays["ent"])
    entries = launch.arrays["ent"].numpy()
    assert set((entries >> 1) & 127) == {0, 1, 2, 3}  # every query head of the group
    if dq == "gluon":
        assert launch.dq_grid == (3 * 2 * 8,)  # ceil(333 / 128) query tiles, 2 requests, 8 query heads
    assert (launch.triton is not None) == (dq == "triton")
    if dq.startswith("fused"):  # a turn beside every entry; the cast on the dK/dV pass's 64-row tiles
        assert len(launch.arrays["turn"]) == len(entries) and launch.q_tiles == 6
        assert launch.store.constexprs["BLOCK"] == 64 and launch.store.constexprs["COUNTED"] == (dq == "fused")
