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


def test_refusals():
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
    with pytest.raises(InputError, match="no backward pass yet"):
        cp(q.requires_grad_(), k, v, plan=plan)
    with pytest.raises(InputError, match="shard: the tensor has 32 entries along dim 1"):
        plan.shard(doc[:, :32])
    with pytest.raises(InputError, match="a group was given but torch.distributed is not initialized"):
        cpd.ContextParallel(attn, group=object())
    # a multi-rank plan's call on the Triton backend is refused before any message is posted
    two = cpd.ShardPlan(plan_cp(attn.program, 2, 40, 2, {"doc": doc.numpy()}, block=8, strategy="even"), 0, None,
                        {"doc": doc})
    cp.ranks = 2
    with pytest.raises(BackendRefused, match="position offsets in the Triton kernels"):
        cp(*(two.shard(x.detach()) for x in (q, k, v)), plan=two, backend="triton")
    cp.rank = 1
    with pytest.raises(PlanError, match="made for rank 0 of 2; this is rank 1 of 2"):
        cp(q, k, v, plan=two)
