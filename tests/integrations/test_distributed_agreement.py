"""Ranks agree on a call before any K/V message (issue 35): on 2 and 4 gloo ranks, one rank's
local refusal (a wrong shape, dtype, another length, an unknown keyword, a bad plan argument)
gives every rank the same located error within seconds, and calls that are each valid but
differ (another plan, backend or gather) are refused on every rank before any message; a
wrong shard to plan.gather, a rank whose rows fail (NaN) before a gather and a rank whose
backward fails are every rank's error too; the group then still runs a good call.  A regression cannot hang CI: the process
group times out after 60 s and the spawning test kills its ranks after 240 s.  One spawn of 4
ranks runs the cases on all four, then on ranks 0 and 1 as a group of two (the even plan gives
every rank SEQ / ranks tokens)."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="attnc.distributed runs on torch.distributed")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SPEC = "attention cp_agree { heads = 2 head_dim = 8 dtype = f32 mask = causal }"
SEQ = 32


def _cases(cpd, cp, plan, other, shards, other_shards, rank: int, bad: int) -> dict:
    """name -> a call every rank makes, rank ``bad``'s differing."""
    q, k, v = shards
    me = rank == bad

    def backward_fails():  # rank bad's blocks fail in the backward, after the K/V messages
        with torch.enable_grad():
            o = cp(*(x.detach().requires_grad_() for x in shards), plan=plan)
            real = cpd.rank_attention_backward
            if me:
                cpd.rank_attention_backward = lambda *args: (_ for _ in ()).throw(RuntimeError("injected"))
            try:
                o.sum().backward()
            finally:
                cpd.rank_attention_backward = real
    return {
        "wrong_heads": lambda: cp(q[:, :1] if me else q, k, v, plan=plan),
        "other_length": lambda: cp(torch.cat([q, q[:, :, :1]], 2) if me else q, k, v, plan=plan),
        "wrong_dtype": lambda: cp(q.half() if me else q, k, v, plan=plan),
        "unknown_keyword": lambda: cp(q, k, v, plan=plan, **({"scale": 0.5} if me else {})),
        "plan_keyword": lambda: cp.plan(batch=1, seq_len=SEQ, **({"pad": torch.zeros(1, SEQ)} if me else {})),
        "plan_length": lambda: cp.plan(batch=1, seq_len=SEQ + 8 if me else SEQ),
        "other_plan": lambda: cp(*(other_shards if me else shards), plan=other if me else plan),
        "other_backend": lambda: cp(q, k, v, plan=plan, backend="reference" if me else "numpy"),
        "other_gather": lambda: cp(q, k, v, plan=plan, gather=me),
        "gather_shard": lambda: plan.gather(q[:, :, :-1] if me else q),
        "nan_rows_gather": lambda: cp(torch.full_like(q, float("nan")) if me else q, k, v, plan=plan, gather=True),
        "backward_fails": backward_fails,
    }


def _run_cases(attnc, cpd, group, ranks: int, rank: int, posted: list) -> dict:
    """Every case on ``group`` (``ranks`` ranks, this one ``rank`` in it), then a good call."""
    attn = attnc.compile(SPEC)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, SEQ, 8, generator=g) for _ in range(3))
    cp = cpd.ContextParallel(attn, group=group, block=8, strategy="even")
    plan = cp.plan(batch=1, seq_len=SEQ)
    other = cpd.ContextParallel(attn, group=group, block=8, strategy="zigzag").plan(batch=1, seq_len=SEQ)
    assert other.cp.digest() != plan.cp.digest()
    shards = [plan.shard(x) for x in (q, k, v)]
    other_shards = [other.shard(x) for x in (q, k, v)]
    results = {}
    with torch.no_grad():
        for name, call in _cases(cpd, cp, plan, other, shards, other_shards, rank, ranks - 1).items():
            posted.clear()
            start = time.monotonic()
            try:
                call()
                got = None
            except Exception as e:  # noqa: BLE001 (compared across ranks by the test)
                got = [type(e).__name__, str(e)]
            results[name] = {"error": got, "seconds": time.monotonic() - start, "messages": len(posted)}
        o = cp(*shards, plan=plan, gather=True)  # the group still works
        want = attn.kernel("numpy", attn.program)(q.numpy(), k.numpy(), v.numpy())
    results["good_call_error"] = float((o - torch.from_numpy(want)).abs().max())
    return results


def _worker(rank: int, world: int, init: str, out: str) -> None:
    """The world's ranks run every case, then ranks 0 and 1 again as a group of two."""
    import attnc
    import attnc.distributed as cpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    posted = []
    real_batch = dist.batch_isend_irecv

    def recording(ops):
        posted.extend(ops)
        return real_batch(ops)

    dist.batch_isend_irecv = recording
    try:
        results = {world: _run_cases(attnc, cpd, None, world, rank, posted)}
        pair = dist.new_group([0, 1])  # (every rank creates it)
        if rank < 2:
            results[2] = _run_cases(attnc, cpd, pair, 2, rank, posted)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        dist.batch_isend_irecv = real_batch
        dist.destroy_process_group()


EXPECTED = {  # name -> (error class, what the message says)
    "wrong_heads": ("InputError", "refused its call, so every rank does: inputs: q/k/v have heads 1/2"),
    "other_length": ("InputError", "refused its call, so every rank does: inputs: 'q' has shape [1, 2, "),
    "wrong_dtype": ("InputError", "so every rank does: inputs: q/k/v have heads 2/2, head_dim 8/8, dtype "
                                  "torch.float16/"),
    "unknown_keyword": ("InputError", "refused its call, so every rank does: ContextParallel: unknown keyword 'scale'"),
    "plan_keyword": ("InputError", "refused its call, so every rank does: inputs: unknown keyword 'pad'"),
    "plan_length": ("PlanError", "called with another seq_len than rank 0 (rank 0: 32, rank "),
    "other_plan": ("PlanError", "called with another plan than rank 0"),
    "other_backend": ("PlanError", "called with another backend than rank 0 (rank 0: 'numpy', rank "),
    "other_gather": ("PlanError", "called with another gather than rank 0 (rank 0: False, rank "),
    "gather_shard": ("InputError", "plan.gather: rank {bad} refused its call, so every rank does: gather: the shard "
                                   "has {short} entries along dim 2; rank {bad} owns {tokens} tokens"),
    "nan_rows_gather": ("PlanError", "context-parallel call: rank {bad} failed computing its rows, so every rank "
                                     "does: the score program produced NaN or +inf"),
    "backward_fails": ("PlanError", "context-parallel backward: rank {bad} failed its gradients, so every rank does: "
                                    "RuntimeError: injected"),
}
AFTER_MESSAGES = {"nan_rows_gather", "backward_fails"}  # failures computing rows: the K/V messages were posted


def test_every_rank_gets_the_same_refusal_within_seconds(tmp_path, monkeypatch):
    """Four gloo ranks, then two of them as a group (one spawn: each rank's start costs seconds)."""
    import torch.multiprocessing as mp
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result")
    ctx = mp.spawn(_worker, args=(4, f"file://{tmp_path / 'rendezvous'}", out), nprocs=4, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks did not finish in 240 s (a rank left blocked)")
    per_rank = [json.load(open(f"{out}.{r}")) for r in range(4)]
    for ranks in (4, 2):
        results = [res[str(ranks)] for res in per_rank[:ranks]]
        bad = ranks - 1
        for name, (kind, says) in EXPECTED.items():
            where = f"{name} on {ranks} ranks"
            errors = [res[name]["error"] for res in results]
            assert all(e is not None for e in errors), f"{where}: {errors}"
            assert len({tuple(e) for e in errors}) == 1, f"{where}: the ranks' errors differ: {errors}"
            says = says.format(bad=bad, short=SEQ // ranks - 1, tokens=SEQ // ranks)
            assert errors[0][0] == kind and says in errors[0][1], f"{where}: {errors[0]}"
            assert f"rank {bad}" in errors[0][1] or f"rank(s) [{bad}]" in errors[0][1], f"{where}: {errors[0]}"
            if name not in AFTER_MESSAGES:
                assert all(res[name]["messages"] == 0 for res in results), f"{where}: a K/V message was posted"
            seconds = [res[name]["seconds"] for res in results]
            assert max(seconds) < 10, f"{where}: {seconds}"
        assert all(res["good_call_error"] < 1e-5 for res in results), ranks
