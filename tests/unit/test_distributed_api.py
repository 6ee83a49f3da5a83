"""attnc.distributed in one process (issue 19): a one-rank plan is the plain call (bit for bit),
the float64 reference path agrees with the oracle, and bad calls are refused with the reason.
Multi-rank runs: tests/integrations/test_distributed.py (gloo) and tests/numerics/test_cp_blocks.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnc  # noqa: E402
import attnc.distributed as cpd  # noqa: E402
from attnc.api import BackendRefused  # noqa: E402
from attnc.compiler import oracle  # noqa: E402
from attnc.compiler.cp import plan_cp  # noqa: E402
from attnc.compiler.errors import InputError, PlanError  # noqa: E402

DOCS = "attention d { heads = 2 head_dim = 8 dtype = f32 tensor doc: i32[b, s] mask = causal & doc[b, q] == doc[b, k] }"


def _inputs(seq=40):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, seq, 8, generator=g) for _ in range(3))
    doc = (torch.arange(seq) // 13).repeat(2, 1).int()
    return q, k, v, doc


def test_one_rank_is_the_plain_call():
    attn = attnc.compile(DOCS)
    q, k, v, doc = _inputs()
    cp = cpd.ContextParallel(attn, block=8)
    assert (cp.ranks, cp.rank) == (1, 0) and "rank 0 of 1" in repr(cp)
    plan = cp.plan(batch=2, seq_len=40, doc=doc)
    assert plan.shard(q) is q and plan.tokens == 40 and torch.equal(plan.positions, torch.arange(40))
    with torch.no_grad():
        o, lse = cp(q, k, v, plan=plan, return_lse=True, gather=True)
        want_o, want_lse = attn(q, k, v, doc=doc, return_lse=True)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        o64, lse64 = cp(q, k, v, plan=plan, return_lse=True, backend="reference")
    ref_o, ref_lse = oracle.reference(attn.program, *(x.double().numpy() for x in (q, k, v)), {"doc": doc.numpy()})
    assert o64.dtype == torch.float64 and np.abs(o64.numpy() - ref_o).max() <= 1e-12
    assert np.abs(lse64.numpy() - ref_lse).max() <= 1e-12
    assert plan.report()["ranks"] == 1 and plan.report()["total_bytes"] == 0


def test_refusals(monkeypatch):
    attn = attnc.compile(DOCS)
    q, k, v, doc = _inputs()
    cp = cpd.ContextParallel(attn, block=8)
    with pytest.raises(InputError, match="missing tensor 'doc'"):
        cp.plan(batch=2, seq_len=40)
    with pytest.raises(InputError, match="unknown keyword 'pad'"):
        cp.plan(batch=2, seq_len=40, doc=doc, pad=doc)
    with pytest.raises(InputError, match="leaves heads, head_dim, dtype to the call"):
        cpd.ContextParallel("attention g { mask = causal }").plan(batch=1, seq_len=16)
    plan = cp.plan(batch=2, seq_len=40, doc=doc)
    with pytest.raises(InputError, match="shard holds B = 2 requests of 40 tokens"):
        cp(q[:, :, :32], k, v, plan=plan)
    with pytest.raises(InputError, match="shard: the tensor has 32 entries along dim 1"):
        plan.shard(doc[:, :32])
    with pytest.raises(InputError, match="a group was given but torch.distributed is not initialized"):
        cpd.ContextParallel(attn, group=object())
    # a multi-rank plan's calls are refused before any message is posted: Triton on CPU tensors
    # outside Triton's interpreter, a group that cannot move the tensors, a spec tensor that requires
    # grad, float64 tensors off the reference path
    two = cpd.ShardPlan(plan_cp(attn.program, 2, 40, 2, {"doc": doc.numpy()}, block=8, strategy="even"), 0, None,
                        {"doc": doc})
    cp.ranks = 2
    shards = [two.shard(x.detach()) for x in (q, k, v)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendRefused, match="TRITON_INTERPRET=1"):
        cp(*shards, plan=two, backend="triton")
    monkeypatch.setattr(cpd.shards, "_backend_config", lambda group: {"cuda": "nccl"})
    with pytest.raises(BackendRefused, match="backend is 'cuda:nccl' and q, k, v are on cpu"):
        cp(*shards, plan=two)
    monkeypatch.setattr(cpd.shards, "_backend_config", lambda group: {"cpu": "gloo", "cuda": "gloo"})
    assert two.transport("cpu") == "device" and two.transport("cuda") == "host"
    learned = cpd.ShardPlan(two.cp, 0, None, {"doc": doc.float().requires_grad_()})
    with pytest.raises(InputError, match="tensor 'doc' requires grad"):
        cp(*(x.requires_grad_() for x in shards), plan=learned)
    with pytest.raises(InputError, match="q is float64, which runs on backend 'reference' only"):
        cp(*(x.detach().double() for x in shards), plan=two, backend="numpy")
    cp.rank = 1
    with pytest.raises(PlanError, match="made for rank 0 of 2; this is rank 1 of 2"):
        cp(q, k, v, plan=two)


def test_one_rank_is_differentiable():
    """One rank: the plain call's autograd (bit for bit), and the float64 reference path through
    the context-parallel autograd node (blocks, merges, the blockwise backward) within 1e-10 of
    the float64 plain call; LSE in the loss, and through gather=True."""
    attn = attnc.compile(DOCS)
    q, k, v, doc = _inputs()
    cp = cpd.ContextParallel(attn, block=8)
    plan = cp.plan(batch=2, seq_len=40, doc=doc)
    g = torch.Generator().manual_seed(3)
    g_o, g_lse = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, generator=g)

    def grads(fn, dtype):
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, lse = fn(*x)
        ((o * g_o.to(dtype)).sum() + (torch.where(lse.isfinite(), lse, 0) * g_lse.to(dtype)).sum()).backward()
        return [t.grad for t in x]

    plain = grads(lambda *x: attn(*x, doc=doc, return_lse=True), torch.float32)
    for got, want in zip(grads(lambda *x: cp(*x, plan=plan, return_lse=True, gather=True), torch.float32), plain):
        assert torch.equal(got, want)
    wide = grads(lambda *x: attn(*x, doc=doc, return_lse=True), torch.float64)
    ref = grads(lambda *x: cp(*x, plan=plan, return_lse=True, backend="reference"), torch.float64)
    for got, want in zip(ref, wide):
        assert got.dtype == torch.float64 and (got - want).abs().max() <= 1e-10
