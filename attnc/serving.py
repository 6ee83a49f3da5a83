"""Append-then-attend as one transaction on torch tensors (``Attention.append``, M4.5 §0x08C).

``attn.append(q, k_new, v_new, **cache)`` is what FlashAttention's ``flash_attn_with_kvcache``
and FlashInfer's ``append_paged_kv_cache`` + paged prefill do in serving: the C new tokens' K/V
rows go into the cache and their queries attend over the committed rows and themselves.  Here
it is a transaction, on every backend and cache layout:

1. **validate** (``compiler.append.validate_append``): capacity, page ids, cache-row identity,
   the metadata, the manifest, the mask tensors, and the backend's plan of the post-commit
   view — before anything is written;
2. **stage**: the new rows go to their slots past the committed length, which no reader sees
   (``kv_lens`` still says T);
3. **attend**: the backend's split call over the post-commit view, query row i of request b at
   position ``T_b + i`` (it sees ``[0, T_b + i]``);
4. **commit**: only once the output exists, ``kv_lens`` advances to ``T + C`` in place.

A refusal writes nothing; an error after staging puts the staged slots' old bytes back, so a
failed call leaves every byte of the cache and ``kv_lens`` as it found them.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .compiler import inputs, ir
from .compiler.append import AppendCall, AppendPlan, append_keys, validate_append
from .compiler.errors import InputError, PlanError

BACKENDS = ("numpy", "triton", "ahbm")
_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}


def append(attn, q, k_new, v_new, *, manifest=None, plan: AppendPlan | None = None, request_ids=None,
           return_lse: bool = False, backend: str | None = None, **cache):
    """One append transaction (module docstring); returns O [total_q, H_q, d_v] (and LSE)."""
    txn = _Transaction(attn, q, k_new, v_new, cache, backend, manifest, request_ids)
    if plan is None:
        inner = txn.runner.plan(txn)
    else:
        if not isinstance(plan, AppendPlan):
            raise PlanError(f"plan= takes the AppendPlan of attn.plan_append, got {type(plan).__name__}")
        plan.check(txn.program, txn.backend, txn.call)
        inner = plan.inner
    saved = txn.stage()
    try:
        o, lse = txn.runner.run(txn, inner)
    except BaseException:
        txn.restore(saved)
        raise
    txn.commit()
    return (o, lse) if return_lse else o


def plan_append(attn, q, k_new, v_new, *, manifest=None, request_ids=None, backend: str | None = None,
                **cache) -> AppendPlan:
    """The plan of an append call (validated, nothing written): pass it as ``plan=`` to calls with
    the same manifest and cache metadata; ``plan.manifest`` is the call's manifest."""
    txn = _Transaction(attn, q, k_new, v_new, cache, backend, manifest, request_ids)
    return AppendPlan(ir.digest(txn.program), txn.backend, txn.call.manifest, txn.call.view_digest,
                      txn.runner.plan(txn))


class _Transaction:
    """One append call, validated: the concrete program, the backend's runner, the cache's
    storage tensors, the mask tensors and the :class:`AppendCall`."""

    def __init__(self, attn, q, k_new, v_new, cache: dict, backend, manifest, request_ids):
        import torch
        self.torch = torch
        self.program = p = _program_of_rows(attn, q, k_new, v_new)
        self.backend = backend or ("triton" if q.is_cuda else "numpy")
        if self.backend not in BACKENDS:
            raise InputError(f"inputs: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        names = set(attn.tensor_names)
        self.tensors = {k: v for k, v in cache.items() if k in names}
        missing = sorted(names - set(self.tensors))
        if missing:
            raise InputError(f"inputs: missing tensor '{missing[0]}' (spec '{attn.name}' reads it)")
        keys = {k: v for k, v in cache.items() if k not in names}
        self.k_key, self.v_key = append_keys(p)[0][:2]
        self.k, self.v = (_storage(p, keys, key, q) for key in (self.k_key, self.v_key))
        for name, t in (("k_new", k_new), ("v_new", v_new), *self.tensors.items(), (self.k_key, self.k),
                        (self.v_key, self.v)):
            if isinstance(t, torch.Tensor) and t.device != q.device:  # (metadata may stay on the host)
                raise InputError(f"inputs: '{name}' is on {t.device}, q on {q.device}: the rows, the cache and "
                                 "the mask tensors live on one device")
        self.kv_lens = keys.get("kv_lens")
        if "kv_lens" in keys and not (isinstance(self.kv_lens, torch.Tensor) and not self.kv_lens.is_floating_point()
                                      and self.kv_lens.dtype != torch.bool):
            raise InputError("inputs: 'kv_lens' (the committed rows) advances in place when the append commits: "
                             f"pass it as an integer torch tensor, got {type(self.kv_lens).__name__}")
        meta = {k: (v if k in (self.k_key, self.v_key) else _host(v)) for k, v in keys.items()}
        self.call: AppendCall = validate_append(p, meta, q.shape[0], manifest=manifest, request_ids=request_ids)
        metas = {name: (tuple(t.shape), _kind(t), str(t.dtype)) for name, t in self.tensors.items()}
        inputs._check_tensors(p, metas, {"b": self.call.layout.batch, "h": p.heads_q,
                                         "s": int(self.call.committed.max(initial=0))})
        self.q, self.k_new, self.v_new = q, k_new, v_new
        self.runner = RUNNERS[self.backend](attn, p)

    # ------------------------------------------------------------ stage, restore, commit
    def _index(self, store):
        torch = self.torch
        idx = tuple(torch.as_tensor(i, device=store.device) for i in self.call.targets)
        return idx if len(idx) == 1 else ((idx[0], slice(None), idx[1]) if self.call.head_major else idx)

    def stage(self):
        """Write the new rows to their slots; returns the slots' old contents."""
        saved = []
        for store, rows in ((self.k, self.k_new), (self.v, self.v_new)):
            idx = self._index(store)
            saved.append(store[idx].clone())
            store[idx] = rows.detach()
        return saved

    def restore(self, saved) -> None:
        for store, old in zip((self.k, self.v), saved):
            store[self._index(store)] = old

    def commit(self) -> None:
        committed = self.torch.as_tensor(self.call.committed, dtype=self.kv_lens.dtype)
        self.kv_lens.copy_(committed.to(self.kv_lens.device))


def _program_of_rows(attn, q, k_new, v_new) -> ir.Program:
    """The concrete program of an append's packed rows (their heads, head dims and dtype), after
    checking q [N, H_q, d_qk], k_new [N, H_kv, d_qk] and v_new [N, H_kv, d_v]."""
    import torch
    for n, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise InputError(f"inputs: an append takes '{n}' as a torch tensor [total_q, heads, d] (packed "
                             f"rows; got {type(t).__name__} {list(getattr(t, 'shape', []))})")
    dtype = _DTYPES.get(str(q.dtype))
    if dtype is None:
        raise InputError(f"inputs: 'q' has dtype {q.dtype}; attention takes float16, bfloat16 or float32")
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise InputError(f"inputs: q/k_new/v_new have dtypes {q.dtype}/{k_new.dtype}/{v_new.dtype}; the new "
                         "rows are stored in the cache's dtype, q's")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_new, v_new)):
        raise InputError("inputs: an append has no backward pass (it mutates the cache): call it under "
                         "torch.no_grad()")
    p = attn.specialize(q.shape[1], k_new.shape[1], q.shape[2], v_new.shape[2], dtype)
    n = q.shape[0]
    for name, t, want in (("k_new", k_new, (n, p.heads_kv, p.d_qk)), ("v_new", v_new, (n, p.heads_kv, p.d_v))):
        if tuple(t.shape) != want:
            raise InputError(f"inputs: '{name}' has shape {list(t.shape)}; q has {n} packed rows, so "
                             f"[{n}, H_kv={p.heads_kv}, {'d_qk' if name == 'k_new' else 'd_v'}={want[2]}]")
    return p


def _storage(program: ir.Program, keys: dict, key: str, q):
    """The K or V storage tensor of an append: a torch tensor of q's dtype (it is written in place)."""
    import torch
    if key not in keys:
        raise InputError(f"inputs: an append over a {inputs.cache_description(program)} needs '{key}'")
    t = keys[key]
    if not isinstance(t, torch.Tensor) or t.dtype != q.dtype:
        raise InputError(f"inputs: '{key}' must be a torch tensor of q's dtype {q.dtype} (the cache is written in "
                         f"place), got {getattr(t, 'dtype', type(t).__name__)}")
    return t


def _host(a) -> np.ndarray:
    """Metadata on the host (a device tensor is copied: one sync per call)."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _kind(t) -> str:
    a = t.detach() if hasattr(t, "detach") else np.asarray(t)
    if a.dtype.is_floating_point if hasattr(a.dtype, "is_floating_point") else a.dtype.kind == "f":
        return "f"
    return "b" if str(a.dtype) in ("torch.bool", "bool") else "i"


def _host_tensors(txn: _Transaction) -> dict:
    return {n: _host(t) for n, t in txn.tensors.items()}


def _f32(t) -> np.ndarray:
    """A torch tensor's values as a float32 numpy array (a view when it already is one on the CPU)."""
    import torch
    return t.detach().to("cpu", torch.float32).numpy()


# ---------------------------------------------------------------- backends
class _NumpyRunner:
    """The numpy backend's split program over the post-commit view (``Kernel.run``)."""

    def __init__(self, attn, program):
        self.kernel = attn.kernel("numpy", program)

    def _arrays(self, txn: _Transaction) -> dict:
        return {"q": _f32(txn.q), txn.k_key: _f32(txn.k), txn.v_key: _f32(txn.v), **txn.call.view,
                **_host_tensors(txn)}

    def plan(self, txn: _Transaction):
        from .compiler.plan import plan_split
        return plan_split(txn.program, txn.call.layout, txn.call.manifest.C, num_sms=self.kernel.num_sms)

    def run(self, txn: _Transaction, plan):
        torch = txn.torch
        o, lse = self.kernel.run(self._arrays(txn), plan=plan, return_lse=True)
        return torch.from_numpy(o).to(txn.q.device, txn.q.dtype), torch.from_numpy(lse).to(txn.q.device)


class _TritonRunner:
    """The Triton split-K/V kernels over the post-commit view (``Kernel.decode`` with a plan)."""

    def __init__(self, attn, program):
        self.kernel = attn.kernel("triton", program)

    def plan(self, txn: _Transaction):
        storage = {txn.k_key: txn.k, txn.v_key: txn.v}
        return self.kernel.decode_plan({**storage, **txn.call.view}, tensors=dict(txn.tensors),
                                       total_q=int(txn.q.shape[0]))

    def run(self, txn: _Transaction, plan):
        from .backends.triton.device import interpreted
        q, k, v = txn.q, txn.k, txn.v
        carry = interpreted() and q.dtype == txn.torch.bfloat16  # the interpreter reads bf16 as garbage
        if carry:
            q, k, v = q.float(), k.float(), v.float()
        o, lse = self.kernel.decode(q, plan=plan, return_lse=True, **{txn.k_key: k, txn.v_key: v}, **txn.tensors)
        return (o.to(txn.q.dtype) if carry else o), lse


class _AhbmRunner:
    """ADR-0060's programs on the mesh simulator: each request's committed and staged rows are laid
    out on its PEs (ADR-0060 P3: the new K/V rows are in the cache before the kernel), and the
    decode program (C = 1) or the prefill program (C > 1) attends at bottom-right positions."""

    def __init__(self, attn, program):
        self.program = program  # the request's rows are handed over as contiguous bhsd K/V
        self.kernel = attn.kernel("ahbm", replace(program, cache=ir.Cache()))

    def plan(self, txn: _Transaction):
        sink = (self.program.sink,) if self.program.sink is not None else ()
        for expr in (self.program.mask, *self.program.score, *sink):
            if _reads_b_as_value(self.program, expr):
                raise PlanError(f"ahbm: an append runs one request per launch, and {ir.format_expr(expr)} reads "
                                "the request index b other than as a tensor's b subscript")
        return None

    def run(self, txn: _Transaction, plan):
        from .compiler.analysis.layout import gather_kv
        torch, p, call = txn.torch, self.program, txn.call
        storage = {txn.k_key: _f32(txn.k), txn.v_key: _f32(txn.v)}
        q = _f32(txn.q)
        tensors = _host_tensors(txn)
        o = np.zeros((q.shape[0], p.heads_q, p.d_v), np.float32)
        lse = np.full((q.shape[0], p.heads_q), -np.inf, np.float32)
        for b, e in enumerate(call.manifest.entries):
            if e.C == 0:
                continue
            k, v = gather_kv(call.layout, storage, b)
            rows = slice(*e.q_rows)
            mine = {n: _request_slice(p.tensor(n).axes, t, b, e.post_length) for n, t in tensors.items()}
            o_b, lse_b = self.kernel(q[rows].transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                     v.transpose(1, 0, 2)[None], return_lse=True,
                                     case="decode" if e.C == 1 else "prefill", **mine)
            o[rows], lse[rows] = o_b[0].transpose(1, 0, 2), lse_b[0].T
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


RUNNERS = {"numpy": _NumpyRunner, "triton": _TritonRunner, "ahbm": _AhbmRunner}
