"""The front door: ``attnc.compile(spec)(q, k, v, **tensors)`` on torch tensors, against the float64
oracle; shape-generic specs; the custom op under ``torch.compile``; refusals.  CPU tensors take
the numpy backend; with ATTNC_TEST_GPU=1 the same checks run on CUDA tensors (the Triton
backend), plus CUDA graphs."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attnc.compile takes torch tensors (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.compiler import inputs, numerics, oracle  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

GPU = os.environ.get("ATTNC_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _torch(a, dtype):
    return torch.as_tensor(np.ascontiguousarray(a)).to(DEVICE, dtype)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_through_attnc_compile_matches_the_oracle(path):
    program = inputs.contiguous_variant(compile_file(path))
    attn = attnc.Attention(program)
    s_q, s_k = (32, 48) if GPU else (12, 20)  # an append call: bottom-right positions
    arrays = inputs.sample(program, 2, s_q, s_k, seed=1)
    dtype = TORCH_DTYPES[program.dtype]
    tensors = {t.name: _torch(arrays[t.name].astype(np.int32) if arrays[t.name].dtype.kind in "iu"
                              else arrays[t.name], None) for t in program.tensors}
    q, k, v = (_torch(arrays[n], dtype) for n in ("q", "k", "v"))
    o, lse = attn(q, k, v, return_lse=True, **tensors)
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.device.type == DEVICE and o.shape == q.shape[:3] + (
        program.d_v,)
    call = inputs.validate(program, arrays)
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o.float().cpu().numpy()),
                                      lse.cpu().numpy(), ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))


def test_a_shape_generic_spec_takes_heads_dims_and_dtype_from_each_call():
    attn = attnc.compile("attention g { mask = causal & window(8) }")
    assert attn.program.open_fields == ("heads", "head_dim", "dtype")
    for hq, hkv, d, dtype in ((4, 2, 16, torch.float32), (2, 2, 32, torch.bfloat16), (6, 3, 16, torch.float16)):
        q = torch.randn(1, hq, 24, d).to(DEVICE, dtype)
        k, v = (torch.randn(1, hkv, 24, d).to(DEVICE, dtype) for _ in range(2))
        o, lse = attn(q, k, v, return_lse=True)
        program = attn.specialize(hq, hkv, d, d, {torch.float32: "f32", torch.bfloat16: "bf16",
                                                   torch.float16: "f16"}[dtype])
        ref_o, ref_lse = oracle.reference(program, *(x.float().cpu().numpy() for x in (q, k, v)))
        co, cl = numerics.compare_outputs(program.dtype, o.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse)
        assert co.ok and cl.ok
    assert len(attn._programs) == 3  # one specialisation per shape and dtype


def test_declared_values_are_checks():
    attn = attnc.compile("attention c { heads = 4 / 2 head_dim = 16 mask = causal }")
    q = torch.randn(1, 8, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(InputError, match="declares heads = 4 / 2; the call has heads 8 / 2"):
        attn(q, k, k)
    q = torch.randn(1, 4, 8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(InputError, match="q/k/v have dtypes"):
        attn(q, k, k)


def test_refusals_are_clear_errors():
    attn = attnc.compile("examples/causal_document.attn")
    q = torch.randn(1, 4, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    doc = torch.zeros(1, 16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InputError, match="missing tensor 'doc'"):
        attn(q, q, q)
    with pytest.raises(InputError, match="unknown keyword 'docs'"):
        attn(q, q, q, doc=doc, docs=doc)
    with pytest.raises(InputError, match="tensor 'doc' requires grad"):  # a mask has no gradient
        attn(q, q, q, doc=doc.float().requires_grad_())
    with pytest.raises(InputError, match="rank 3"):
        attn(q[0], q, q, doc=doc)
    with pytest.raises(InputError, match="takes torch tensors"):
        attn(q.float().cpu().numpy(), q, q, doc=doc)
    with pytest.raises(attnc.api.BackendRefused, match="forced backend ahbm rejects the call"):
        attn(q, q, q, doc=doc, backend="ahbm")


class _Toy(torch.nn.Module):
    """Two attention layers with projections: what torch.compile must trace without a break."""

    def __init__(self, attn, d=32, heads=2):
        super().__init__()
        self.attn, self.heads = attn, heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(2))

    def forward(self, x, **tensors):
        b, s, d = x.shape
        for proj in self.qkv:
            q, k, v = proj(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            x = x + self.attn(q, k, v, **tensors).transpose(1, 2).reshape(b, s, d)
        return x


@pytest.mark.parametrize("spec", ["attention t { mask = causal }",
                                  "attention t { tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"])
def test_torch_compile_fullgraph_runs_the_custom_op(spec):
    attn = attnc.compile(spec)
    model = _Toy(attn).to(DEVICE)
    x = torch.randn(2, 24, 32, device=DEVICE)
    tensors = {"doc": torch.as_tensor(np.repeat([[0, 1, 2]], 8, 1).repeat(2, 0), dtype=torch.int32,
                                      device=DEVICE)} if "doc" in spec else {}
    with torch.no_grad():
        eager = model(x, **tensors)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        got = compiled(x, **tensors)
    assert torch.allclose(got, eager, atol=1e-4, rtol=1e-4)


def test_the_plan_cache_replans_a_mask_tensor_changed_in_place():
    """A document tensor mutated in place (its version moves) gets a new plan, and the answer
    follows it, on the Triton kernel (interpreted on the CPU)."""
    attn = attnc.compile("attention d { heads = 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] "
                         "mask = causal & doc[b, q] == doc[b, k] }")
    q, k, v = (torch.randn(1, 2, 32, 16, device=DEVICE) for _ in range(3))
    doc = torch.zeros(1, 32, dtype=torch.int32, device=DEVICE)
    first = attn(q, k, v, doc=doc, backend="triton")
    assert torch.equal(first, attn(q, k, v, doc=doc, backend="triton"))  # cached plan, same answer
    doc[0, 16:] = 1  # two documents now
    second = attn(q, k, v, doc=doc, backend="triton")
    program = attn.specialize(2, 2, 16, 16, "f32")
    ref_o, _ = oracle.reference(program, *(x.cpu().numpy() for x in (q, k, v)), {"doc": doc.cpu().numpy()})
    assert np.allclose(second.cpu().numpy(), ref_o, atol=1e-3)
    assert not torch.allclose(first[:, :, 16:], second[:, :, 16:])


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (ATTNC_TEST_GPU=1)")
def test_a_prefill_call_captured_in_a_cuda_graph_replays_with_new_inputs():
    attn = attnc.compile("attention c { dtype = bf16 mask = causal }")
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn(q, k, v)  # plans before capture
    graph, out = _capture(lambda: attn(q, k, v))
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, attn(q, k, v))


@pytest.mark.skipif(not GPU, reason="torch.compile's CUDA graphs need a GPU (ATTNC_TEST_GPU=1)")
def test_torch_compile_reduce_overhead_on_cuda():
    attn = attnc.compile("attention t { mask = causal }")
    model = _Toy(attn).to("cuda", torch.bfloat16)
    x = torch.randn(2, 128, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            got = compiled(x)
    assert torch.allclose(got.float(), eager.float(), atol=2e-2, rtol=2e-2)


def _capture(fn):
    from attnc.backends.triton.graph import capture
    return capture(fn)


def test_a_plan_made_by_the_caller_runs_and_is_checked():
    """``attn.plan`` / ``attn.run``: the FlashInfer-style plan-once, run-many use; a plan made for
    other lengths is refused by name."""
    attn = attnc.compile("examples/causal_document.attn")
    q, k, v = (torch.randn(2, 4, 32, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    doc = torch.as_tensor(np.repeat(np.arange(4), 8)[None].repeat(2, 0), dtype=torch.int32, device=DEVICE)
    plan = attn.plan(q, k, v, doc=doc)
    with torch.no_grad():
        assert torch.equal(attn.run(q, k, v, plan=plan, doc=doc), attn(q, k, v, doc=doc))
        short = [x[:, :, :16].contiguous() for x in (q, k, v)]
        with pytest.raises(attnc.AttncError, match="plan was made for"):
            attn.run(*short, plan=plan, doc=doc[:, :16])
