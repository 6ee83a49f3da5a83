"""The AHBM backend behind the backend protocol (``compiler/dispatch/protocol.py``): torch
tensors are copied to float32 host arrays for the mesh simulator, O and LSE come back on the
inputs' device.  Forward only: no backward, no split (decode) call outside an append."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from attnc.compiler import ir
from attnc.compiler.dispatch.protocol import BackendBase
from attnc.compiler.errors import PlanError


def _f32(t) -> np.ndarray:
    import torch
    return t.detach().to("cpu", torch.float32).numpy()


def _host(tensors: dict) -> dict:
    return {n: t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t) for n, t in tensors.items()}


class AhbmAppend:
    """An append transaction's attend step (``attnc.serving``): ADR-0060's programs on the mesh
    simulator.  Each request's committed and staged rows are laid out on its PEs (ADR-0060 P3:
    the new K/V rows are in the cache before the kernel), and the decode program (C = 1) or the
    prefill program (C > 1) attends at bottom-right positions."""

    def __init__(self, kernel, program):
        self.program = program  # the request's rows are handed over as contiguous bhsd K/V
        self.kernel = kernel

    def plan(self, txn):
        sink = (self.program.sink,) if self.program.sink is not None else ()
        for expr in (self.program.mask, *self.program.score, *sink):
            if _reads_b_as_value(self.program, expr):
                raise PlanError(f"ahbm: an append runs one request per launch, and {ir.format_expr(expr)} reads "
                                "the request index b other than as a tensor's b subscript")
        return None

    def run(self, txn, plan):
        from attnc.compiler.analysis.layout import gather_kv
        torch, p, call = txn.torch, self.program, txn.call
        storage = {txn.k_key: _f32(txn.k), txn.v_key: _f32(txn.v)}
        q = _f32(txn.q)
        tensors = _host(txn.tensors)
        o = np.zeros((q.shape[0], p.heads_q, p.d_v), np.float32)
        lse = np.full((q.shape[0], p.heads_q), -np.inf, np.float32)
        for b, e in enumerate(call.manifest.entries):
            if e.C == 0:
                continue
            k, v = gather_kv(call.layout, storage, b)
            rows = slice(*e.q_rows)
            mine = {n: _request_slice(p.tensor(n).axes, t, b, e.post_length) for n, t in tensors.items()}
            # (simulate: the rows unchecked; the transaction checks the whole batch's, as on every backend)
            run = self.kernel.simulate(q[rows].transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                       v.transpose(1, 0, 2)[None], case="decode" if e.C == 1 else "prefill", **mine)
            o[rows], lse[rows] = run.o[0].transpose(1, 0, 2), run.lse[0].T
        return torch.from_numpy(o).to(txn.q.device, txn.q.dtype), torch.from_numpy(lse).to(txn.q.device)


def _reads_b_as_value(program: ir.Program, e) -> bool:
    """Whether ``e`` uses ``b`` other than as the subscript of a tensor's ``b`` axis."""
    if isinstance(e, ir.Var):
        return e.name == "b"
    if isinstance(e, ir.Load):
        axes = program.tensor(e.tensor).axes
        return any(not (a == "b" and isinstance(i, ir.Var) and i.name == "b") and _reads_b_as_value(program, i)
                   for a, i in zip(axes, e.index))
    return any(_reads_b_as_value(program, c) for c in ir.children(e))


def _request_slice(axes, t: np.ndarray, b: int, length: int) -> np.ndarray:
    """A declared tensor cut to one request: its ``b`` axis to row b, its ``s`` axis to the
    request's ``T + C`` positions."""
    index = tuple(slice(b, b + 1) if a == "b" else slice(0, length) if a == "s" else slice(None) for a in axes)
    return np.ascontiguousarray(t[index])


class AhbmBackend(BackendBase):
    name = "ahbm"
    capabilities = frozenset({"forward", "run", "plan", "append"})

    def forward(self, kernel, q, k, v, tensors, plan=None):
        import torch
        arrays = {n: t.detach().cpu().numpy() if hasattr(t, "detach") else t for n, t in tensors.items()}
        qkv = [x.detach().to("cpu", torch.float32).numpy() for x in (q, k, v)]
        o, lse = kernel(*qkv, return_lse=True, plan=plan, **arrays)
        return (torch.from_numpy(o).to(device=q.device, dtype=q.dtype),
                torch.from_numpy(lse).to(device=q.device, dtype=torch.float32))

    def append_runner(self, kernel_of, program):
        return AhbmAppend(kernel_of(replace(program, cache=ir.Cache())), program)


BACKEND = AhbmBackend()
