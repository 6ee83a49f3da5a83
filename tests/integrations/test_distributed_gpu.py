"""Context parallelism on CUDA tensors (issue 19), ATTNC_TEST_GPU=1: 2 processes on this machine's
GPU(s) over gloo (one GPU cannot host two NCCL ranks; gloo stages the K/V and dK/dV messages
through host memory), every block on the Triton kernels at its absolute positions.  Each rank
checks the gathered O, LSE and the gathered gradients of q, k, v against the single-process
differentiable call on the whole sequence, within the declared tolerances, for causal, sliding
window, documents (the last rank's rows padding: nothing visible) and prefix-LM in bf16."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="attnc.distributed runs on torch.distributed")
dist = pytest.importorskip("torch.distributed")

GPU = os.environ.get("ATTNC_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU or not dist.is_available() or not dist.is_gloo_available(),
                                reason="context parallelism on CUDA tensors runs on a GPU (ATTNC_TEST_GPU=1)")

CASES = {  # name -> (spec, B, S)
    "causal": ("attention g_causal { heads = 8 / 2 head_dim = 128 dtype = bf16 mask = causal }", 2, 1000),
    "window": ("attention g_window { heads = 4 head_dim = 64 dtype = bf16 mask = causal & window(200) }", 1, 1536),
    "documents": ("attention g_docs { heads = 4 head_dim = 128 dtype = bf16 tensor doc: i32[b, s] "
                  "mask = causal & doc[b, q] == doc[b, k] & doc[b, q] >= 0 }", 2, 1024),
    "prefix_lm": ("attention g_prefix { heads = 4 head_dim = 64 dtype = bf16 mask = causal | k < 300 }", 1, 1280),
}


def _inputs(name, program, batch, seq, ranks):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, h, seq, d, generator=g).to(torch.bfloat16).cuda() for h, d in
               ((program.heads_q, program.d_qk), (program.heads_kv, program.d_qk), (program.heads_kv, program.d_v)))
    do = torch.randn(batch, program.heads_q, seq, program.d_v, generator=g).to(torch.bfloat16).cuda()
    tensors = {}
    if name == "documents":
        real = seq - seq // ranks
        doc = torch.full((batch, seq), -1, dtype=torch.int32)
        for b in range(batch):
            cuts = torch.cumsum(torch.randint(30, 300, (seq,), generator=g), 0)
            doc[b, :real] = torch.searchsorted(cuts, torch.arange(real), right=True).int()
        tensors["doc"] = doc.cuda()
    return q, k, v, do, tensors


def _worker(rank: int, ranks: int, init: str) -> None:
    import attnc
    import attnc.distributed as cpd
    from attnc.compiler import numerics

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        for name, (text, batch, seq) in CASES.items():
            attn = attnc.compile(text)
            program = attn.program
            q, k, v, do, tensors = _inputs(name, program, batch, seq, ranks)
            # the single-process differentiable call on the whole sequence
            qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
            ref_o, ref_lse = attn(qr, kr, vr, return_lse=True, **tensors)
            (ref_o.float() * do.float()).sum().backward()
            cp = cpd.ContextParallel(attn)
            plan = cp.plan(batch=batch, seq_len=seq, **tensors)
            ql, kl, vl = (plan.shard(x).detach().requires_grad_() for x in (q, k, v))
            o_l, lse_l = cp(ql, kl, vl, plan=plan, return_lse=True)
            (o_l.float() * plan.shard(do).float()).sum().backward()
            where = f"{name}, rank {rank} of {ranks} ({plan.cp.strategy})"
            assert o_l.is_cuda and o_l.dtype == q.dtype and lse_l.dtype == torch.float32, where
            o, lse = plan.gather(o_l.detach()), plan.gather(lse_l.detach(), dim=2)
            for c in numerics.compare_outputs("bf16", o.float().cpu().numpy(), lse.cpu().numpy(),
                                              ref_o.detach().double().cpu().numpy(), ref_lse.detach().double().cpu().numpy()):
                assert c.ok, f"{where}: {c}"
            for n, mine, ref in (("dQ", ql, qr), ("dK", kl, kr), ("dV", vl, vr)):
                got = plan.gather(mine.grad).double().cpu().numpy()
                c = numerics.compare_gradient(n, "bf16", got, ref.grad.double().cpu().numpy())
                assert c.ok, f"{where}: {c}"
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_cuda_tensors_match_the_single_process_call(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2, join=True)
