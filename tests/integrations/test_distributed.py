"""Context parallelism over real processes (issue 19): 2 and 4 gloo ranks, spawned once per world
size, run causal, sliding window, documents (with a padded tail: a rank whose rows see nothing)
and prefix-LM on the numpy backend.  Every rank checks the gathered O and LSE against the
single-process call within the declared tolerance, and the float64 reference path against the
float64 oracle within 1e-12; the messages it posts are exactly the plan's (a rank never receives
from an owner its rows do not need).

The backward pass: every rank's dQ, dK, dV of its shards (through torch.autograd, the dK/dV
shares of other ranks' keys sent back to their owners) against the single-process call's
autograd gradients at its positions within the declared gradient tolerance, and the float64
reference path (float64 shards) against the float64 single-process call within 1e-10; LSE
enters the loss in the documents case (dLSE), and O is gathered (``gather=True``, replicated
loss) in the causal case.  The backward posts the forward's K/V messages again and the reversed
ones (the dK/dV shares, float32 or float64)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="attnc.distributed runs on torch.distributed")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

CASES = {  # name -> (spec, B, S, strategy)
    "causal": ("attention cp_causal { heads = 4 / 2 head_dim = 16 dtype = f32 mask = causal }", 2, 72, "auto"),
    "window": ("attention cp_window { heads = 2 head_dim = 8 dtype = bf16 cache = contiguous(layout = bshd) "
               "mask = causal & window(12) }", 1, 64, "even"),
    "documents": ("attention cp_docs { heads = 2 head_dim = 8 dtype = f32 tensor doc: i32[b, s] "
                  "mask = causal & doc[b, q] == doc[b, k] & doc[b, q] >= 0 }", 2, 64, "even"),
    "prefix_lm": ("attention cp_prefix { heads = 2 head_dim = 8 dtype = f16 mask = causal | k < 20 }", 1, 56, "auto"),
    "tiny": ("attention cp_tiny { heads = 2 head_dim = 8 dtype = f32 mask = causal }", 1, 20, "even"),
    # a learned sink per head, added once per row after the blocks merge (padding rows: LSE = sink)
    "sinks": ("attention cp_sinks { heads = 4 / 2 head_dim = 8 dtype = f32 tensor doc: i32[b, s] "
              "tensor sinks: f32[h] mask = causal & doc[b, q] == doc[b, k] & doc[b, q] >= 0 sink = sinks[h] }",
              1, 64, "even"),
}
BLOCK = 8


def _inputs(name: str, program, batch: int, seq: int, ranks: int):
    """The same inputs on every rank (seeded)."""
    g = torch.Generator().manual_seed(7)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[program.dtype]
    bshd = program.cache.layout.value == "bshd"
    shape = lambda h, d: (batch, seq, h, d) if bshd else (batch, h, seq, d)  # noqa: E731
    q, k, v = (torch.randn(*shape(h, d), generator=g).to(dtype) for h, d in
               ((program.heads_q, program.d_qk), (program.heads_kv, program.d_qk), (program.heads_kv, program.d_v)))
    tensors = {}
    if any(t.name == "sinks" for t in program.tensors):
        tensors["sinks"] = torch.randn(program.heads_q, generator=g)
    if any(t.name == "doc" for t in program.tensors):  # documents of 3..17 tokens, the last 1/ranks of the tokens padding (-1)
        real = seq - seq // ranks
        doc = torch.full((batch, seq), -1, dtype=torch.int32)
        for b in range(batch):
            cuts = torch.cumsum(torch.randint(3, 18, (seq,), generator=g), 0)
            doc[b, :real] = torch.searchsorted(cuts, torch.arange(real), right=True).int()
        tensors["doc"] = doc
    return q, k, v, tensors


GRAD_CASES = {"causal": "gather", "window": "o", "documents": "lse", "prefix_lm": "o", "sinks": "lse"}  # what the loss reads


def _loss(name: str, o, lse, g_o, g_lse):
    """A loss with these incoming gradients (LSE's -inf rows of padding contribute nothing)."""
    loss = (o.to(g_o.dtype) * g_o).sum()
    if GRAD_CASES[name] == "lse":
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).to(g_lse.dtype) * g_lse).sum()
    return loss


def _check_backward(name, attn, program, cp, plan, q, k, v, tensors, posted, rank, ranks, where):
    """Rank ``rank``'s gradients of its shards against the single-process call's (module docstring)."""
    from attnc.compiler import numerics
    g = torch.Generator().manual_seed(11)
    bshd = program.cache.layout.value == "bshd"
    g_o = torch.randn(*(q.shape[:-1]), program.d_v, generator=g, dtype=torch.float64)  # O's shape (q's layout)
    g_lse = torch.randn(q.shape[0], program.heads_q, plan.cp.seq_len, generator=g, dtype=torch.float64)
    gather = GRAD_CASES[name] == "gather"
    for wide in (False, True):
        # the single-process call, differentiated by torch.autograd through attnc.compile(...)
        whole = [x.detach().to(torch.float64 if wide else x.dtype).requires_grad_() for x in (q, k, v)]
        o, lse = attn(*whole, return_lse=True, backend="numpy", **tensors)
        _loss(name, o, lse, g_o, g_lse).backward()
        shards = [plan.shard(x.detach()).requires_grad_() for x in whole]
        posted.clear()
        o_l, lse_l = cp(*shards, plan=plan, return_lse=True, gather=gather,
                        backend="reference" if wide else None)
        if gather:
            _loss(name, o_l, lse_l, g_o, g_lse).backward()
        else:
            _loss(name, o_l, lse_l, plan.shard(g_o), plan.shard(g_lse, dim=2)).backward()
        for n, shard, x in zip("qkv", shards, whole):
            assert shard.grad.dtype == shard.dtype, where
            want = plan.shard(x.grad).double().numpy()
            if wide:
                err = np.abs(shard.grad.numpy() - want).max(initial=0.0)
                assert err <= 1e-10 * max(1.0, np.abs(want).max(initial=0.0)), f"{where}: float64 d{n} off by {err}"
            else:
                c = numerics.compare_gradient(f"d{n}", program.dtype, shard.grad.double().numpy(), want)
                assert c.ok, f"{where}: {c}"
        # the backward's messages: the forward's K/V messages again, then the reversed ones (the dK/dV
        # shares in the accumulation dtype: the same element counts)
        cpp, per = plan.cp, q.shape[0] * program.heads_kv * (program.d_qk + program.d_v)
        fwd = [("isend", dst, int(cpp.chosen.traffic[rank, dst]) * per) for dst in range(ranks)
               if cpp.chosen.traffic[rank, dst]] + \
              [("irecv", src, int(cpp.chosen.traffic[src, rank]) * per) for src in range(ranks)
               if cpp.chosen.traffic[src, rank]]
        back = [("irecv" if op == "isend" else "isend", peer, n) for op, peer, n in fwd]
        assert sorted(posted) == sorted(fwd * 2 + back), f"{where}: posted {sorted(posted)}"
        if name == "documents" and rank == ranks - 1:  # padding rows: no gradient anywhere
            assert not any(s.grad.any() for s in shards), where


def _check_triton_blocks(rank: int, ranks: int, device: str) -> None:
    """The Triton blocks through the same exchange: a GQA document mask's O and gradients against
    the single-process numpy call.  ``device`` is the Triton backend's (tests.conftest.triton_device):
    CPU tensors in the interpreter, or in a GPU run (ATTNC_TEST_GPU=1) CUDA tensors, both ranks on
    the one GPU, their messages staged through host memory by gloo (test_distributed_gpu runs larger
    bf16 calls so)."""
    import attnc
    import attnc.distributed as cpd
    from attnc.compiler import numerics
    text = ("attention cp_tri { heads = 4 / 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] "
            "mask = causal & doc[b, q] == doc[b, k] & doc[b, q] >= 0 }")
    attn = attnc.compile(text)
    program = attn.program
    q, k, v, tensors = _inputs("documents", program, 1, 48, ranks)
    cp = cpd.ContextParallel(attn, block=BLOCK, strategy="auto")
    plan = cp.plan(batch=1, seq_len=48, **{n: t.to(device) for n, t in tensors.items()})
    g_o = torch.randn(1, program.heads_q, 48, program.d_v, generator=torch.Generator().manual_seed(2))
    whole = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = attn(*whole, return_lse=True, backend="numpy", **tensors)
    (o * g_o).sum().backward()
    shards = [plan.shard(x.detach()).to(device).requires_grad_() for x in (q, k, v)]
    o_l, lse_l = cp(*shards, plan=plan, return_lse=True, backend="triton")
    assert o_l.device.type == device
    (o_l * plan.shard(g_o).to(device)).sum().backward()
    where = f"triton blocks, rank {rank} of {ranks}"
    for c in numerics.compare_outputs("f32", o_l.detach().cpu().numpy(), lse_l.detach().cpu().numpy(),
                                      plan.shard(o).detach().numpy(), plan.shard(lse, dim=2).detach().numpy()):
        assert c.ok, f"{where}: {c}"
    for n, shard, x in zip("qkv", shards, whole):
        c = numerics.compare_gradient(f"d{n}", "f32", shard.grad.double().cpu().numpy(),
                                      plan.shard(x.grad).double().numpy())
        assert c.ok, f"{where}: {c}"


def _worker(rank: int, ranks: int, init: str, triton_device: str) -> None:
    import attnc
    import attnc.distributed as cpd
    from attnc.compiler import numerics, oracle

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    posted = []
    real_batch = dist.batch_isend_irecv

    def recording(ops):  # what the call really posts: (isend|irecv, peer, elements)
        posted.extend((op.op.__name__, op.peer, op.tensor.numel()) for op in ops)
        return real_batch(ops)

    cpd.dist.batch_isend_irecv = recording
    try:
        for name, (text, batch, seq, strategy) in CASES.items():
            attn = attnc.compile(text)
            program = attn.program
            q, k, v, tensors = _inputs(name, program, batch, seq, ranks)
            cp = cpd.ContextParallel(attn, block=BLOCK, strategy=strategy)
            plan = cp.plan(batch=batch, seq_len=seq, **tensors)
            shards = [plan.shard(x) for x in (q, k, v)]
            posted.clear()
            with torch.no_grad():
                o_local, lse_local = cp(*shards, plan=plan, return_lse=True)
                o, lse = plan.gather(o_local), plan.gather(lse_local, dim=2)
                # the single-process call on the numpy backend (the kernel attn(q, k, v) runs for CPU
                # tensors, taken directly: the public call's dispatch would import Triton in every rank)
                ref_o, ref_lse = attn.kernel("numpy", program)(*(x.float().numpy() for x in (q, k, v)),
                                                               return_lse=True, **{n: t.numpy() for n, t in tensors.items()})
            where = f"{name}, rank {rank} of {ranks} ({plan.cp.strategy})"
            assert o_local.dtype == q.dtype and torch.equal(plan.shard(o), o_local), where
            for c in numerics.compare_outputs(program.dtype, o.float().numpy(), lse.numpy(), ref_o, ref_lse):
                assert c.ok, f"{where}: {c}"
            # the messages posted are the plan's, to and from exactly its peers
            cpp, per = plan.cp, batch * program.heads_kv * (program.d_qk + program.d_v)
            want = sorted([("isend", dst, int(cpp.chosen.traffic[rank, dst]) * per) for dst in range(ranks)
                           if cpp.chosen.traffic[rank, dst]] +
                          [("irecv", src, int(cpp.chosen.traffic[src, rank]) * per) for src in range(ranks)
                           if cpp.chosen.traffic[src, rank]])
            assert sorted(posted) == want, f"{where}: posted {sorted(posted)}, plan {want}"
            if name == "window":  # a window needs its left neighbour's keys only
                assert {p for _, p, _ in posted} <= {rank - 1, rank + 1}, where
            if name == "documents" and rank == ranks - 1:  # padding only: nothing visible, nothing received
                assert torch.isinf(lse_local).all() and not o_local.any() and not [p for p in posted if p[0] == "irecv"]
            if name == "sinks" and rank == ranks - 1:  # padding: no key, so O = 0 and LSE = the head's sink, once
                want_sink = tensors["sinks"][None, :, None].expand_as(lse_local)
                assert not o_local.any() and torch.equal(lse_local, want_sink), where
            # float64 reference per block against the float64 oracle on the whole call
            o64, lse64 = cp(*shards, plan=plan, return_lse=True, gather=True, backend="reference")
            bhsd = (lambda t: t.transpose(1, 2)) if program.cache.layout.value == "bshd" else (lambda t: t)  # noqa: E731
            want_o, want_lse = oracle.reference(program, *(bhsd(x).double().numpy() for x in (q, k, v)),
                                                {n: t.numpy() for n, t in tensors.items()})
            assert np.abs(bhsd(o64).numpy() - want_o).max() <= 1e-12, where
            assert np.array_equal(np.isinf(lse64.numpy()), np.isinf(want_lse)), where
            finite = np.isfinite(want_lse)
            assert np.abs(lse64.numpy()[finite] - want_lse[finite]).max() <= 1e-12, where
            if name in GRAD_CASES:
                _check_backward(name, attn, program, cp, plan, q, k, v, tensors, posted, rank, ranks, where)
        if ranks == 2:
            _check_triton_blocks(rank, ranks, triton_device)
        if ranks == 4:  # the tiny case's even split leaves rank 0 without a token
            assert cpd.ContextParallel(attnc.compile(CASES["tiny"][0]), block=BLOCK, strategy="even").plan(
                batch=1, seq_len=20).tokens == (0, 8, 8, 4)[rank]
        # every rank's messages are done, and nothing of them is left for the interpreter's exit, before
        # any rank tears its group down (without both, a gloo runloop thread still releasing a message
        # at interpreter exit aborted about 1 run in 5)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [2, 4])
def test_gloo_ranks_match_the_single_process_call(ranks, tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    init = f"file://{tmp_path / 'rendezvous'}"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks share this machine's cores
    from tests.conftest import triton_device
    mp.spawn(_worker, args=(ranks, init, triton_device()), nprocs=ranks, join=True)
