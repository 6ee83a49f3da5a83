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
4. **check** the output (one reduction on the device, the rows only on failure): a NaN LSE row
   is the non-finite-score error every backend raises (``numerics.check_rows``), a non-finite O
   row (NaN or inf in the V rows its tiles read) is refused too, on every backend alike;
5. **commit**: only once the output exists and is finite, ``kv_lens`` advances to ``T + C`` in
   place.

Validation also refuses what would make a commit unsafe: a ``kv_lens`` dtype that ``T + C``
leaves, a ``kv_lens`` that cannot be written in place (an expanded or inference-mode tensor),
and a written tensor (the K/V storage, ``kv_lens``) that shares memory with any other input.
A refusal writes nothing; any failure after staging, the commit's included, puts the staged
slots' old bytes and ``kv_lens`` back, so a failed call leaves every byte of the cache and
``kv_lens`` as it found them (a retry appends once).
"""
from __future__ import annotations

import numpy as np

from .compiler import inputs, ir, numerics
from .compiler.append import AppendCall, AppendPlan, append_keys, validate_append, validation_key
from .compiler.errors import InputError, PlanError

_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}


def append(attn, q, k_new, v_new, *, manifest=None, plan: AppendPlan | None = None, request_ids=None,
           return_lse: bool = False, backend: str | None = None, **cache):
    """One append transaction (module docstring); returns O [total_q, H_q, d_v] (and LSE)."""
    if plan is not None and not isinstance(plan, AppendPlan):
        raise PlanError(f"plan= takes the AppendPlan of attn.plan_append, got {type(plan).__name__}")
    txn = _Transaction(attn, q, k_new, v_new, cache, backend, manifest, request_ids, plan)
    if plan is None:
        inner = txn.runner.plan(txn)
    else:
        plan.check(txn.program, txn.backend, txn.call)
        inner = plan.inner
    o, lse = txn.execute(inner)
    return (o, lse) if return_lse else o


def plan_append(attn, q, k_new, v_new, *, manifest=None, request_ids=None, backend: str | None = None,
                **cache) -> AppendPlan:
    """The plan of an append call (validated, nothing written): pass it as ``plan=`` to calls with
    the same manifest and cache metadata; ``plan.manifest`` is the call's manifest.  The plan keeps
    the validated call: a call whose validation inputs are equal (``validation_key``: the spec, the
    metadata values, the storage shapes, the rows; e.g. the next layer of a serving step, over its
    own storage) reuses it instead of validating again; its own tensors are still checked."""
    txn = _Transaction(attn, q, k_new, v_new, cache, backend, manifest, request_ids)
    return AppendPlan(ir.digest(txn.program), txn.backend, txn.call.manifest, txn.call.view_digest,
                      txn.runner.plan(txn), txn.call, txn.key)


class _Transaction:
    """One append call, validated: the concrete program, the backend's runner, the cache's
    storage tensors, the mask tensors and the :class:`AppendCall`."""

    def __init__(self, attn, q, k_new, v_new, cache: dict, backend, manifest, request_ids, plan=None):
        import torch
        self.torch = torch
        self.program = p = _program_of_rows(attn, q, k_new, v_new)
        from .compiler.dispatch import device_default, torch_backend, with_capability
        self.backend = backend or device_default("cuda" if q.is_cuda else "cpu")
        able = with_capability("append")
        if self.backend not in able:
            raise InputError(f"inputs: backend must be one of {', '.join(sorted(able))}, got {self.backend!r}")
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
        if self.kv_lens is not None:
            _check_writable_lengths(self.kv_lens)
        _check_aliasing({"q": q, "k_new": k_new, "v_new": v_new, **keys, **self.tensors},
                        (self.k_key, self.v_key, "kv_lens"))
        meta = {k: (v if k in (self.k_key, self.v_key) else _host(v)) for k, v in keys.items()}
        self.key = validation_key(p, meta, q.shape[0], manifest, request_ids)
        if plan is not None and plan.call is not None and plan.validation_key == self.key:
            self.call: AppendCall = plan.call  # (validated when planned, on equal inputs)
        else:
            self.call = validate_append(p, meta, q.shape[0], manifest=manifest, request_ids=request_ids)
        metas = {name: (tuple(t.shape), _kind(t), str(t.dtype)) for name, t in self.tensors.items()}
        inputs._check_tensors(p, metas, {"b": self.call.layout.batch, "h": p.heads_q,
                                         "s": int(self.call.committed.max(initial=0))})
        self.q, self.k_new, self.v_new = q, k_new, v_new
        name = self.backend
        self.runner = torch_backend(name).append_runner(lambda program: attn.kernel(name, program), p)

    # ------------------------------------------------------------ the transaction
    def execute(self, inner):
        """Stage, attend, check the output, commit (module docstring); any failure on the way,
        the commit's included, puts the staged slots' old bytes and ``kv_lens`` back."""
        saved, lengths = [], self.kv_lens.clone()
        try:
            self.stage(saved)
            o, lse = self.runner.run(self, inner)
            self.check_output(o, lse)
            self.commit()
        except BaseException as e:
            self.rollback(saved, lengths, e)
            raise
        return o, lse

    def _index(self, store):
        torch = self.torch
        idx = self.call.device_targets.get(str(store.device))
        if idx is None:  # (once per call and device: the layers of a step share their validated call)
            idx = self.call.device_targets[str(store.device)] = tuple(
                torch.as_tensor(i, device=store.device) for i in self.call.targets)
        return idx if len(idx) == 1 else ((idx[0], slice(None), idx[1]) if self.call.head_major else idx)

    def stage(self, saved: list) -> None:
        """Write the new rows to their slots; ``saved`` collects each store's old contents before
        its write (so a failure between the two writes restores the first)."""
        for store, rows in ((self.k, self.k_new), (self.v, self.v_new)):
            idx = self._index(store)
            saved.append((store, idx, store[idx].clone()))
            store[idx] = rows.detach()

    def rollback(self, saved: list, lengths, error: BaseException) -> None:
        """The staged slots' old bytes and ``kv_lens`` back (each step tried; a step that fails
        is noted on ``error``, which the caller re-raises)."""
        steps = [lambda s=s: s[0].__setitem__(s[1], s[2]) for s in reversed(saved)]
        steps.append(lambda: self.kv_lens.copy_(lengths))
        for step in steps:
            try:
                step()
            except Exception as failed:  # noqa: BLE001 (reported on the error being raised)
                error.add_note(f"attnc: rolling the append back failed too: {failed!r}; the cache may be changed")

    def check_output(self, o, lse) -> None:
        """O and LSE finite where a row saw a key (LSE -inf: it saw none, O = 0): one reduction
        and one host sync; the rows are located only when it fails."""
        torch = self.torch
        lse32 = lse.float()
        total = o.sum(dtype=torch.float32) + torch.where(lse32 == -torch.inf, 0.0, lse32).sum()
        if bool(torch.isfinite(total)):
            return
        _locate_nonfinite(self.call, o.float().cpu().numpy(), lse32.cpu().numpy(), self.program.sink is not None)

    def commit(self) -> None:
        committed = self.torch.as_tensor(self.call.committed, dtype=self.kv_lens.dtype)
        self.kv_lens.copy_(committed.to(self.kv_lens.device))


def _locate_nonfinite(call: AppendCall, o: np.ndarray, lse: np.ndarray, sink: bool = False) -> None:
    """Raise for the first non-finite row in (b, h, q) order: a NaN LSE is the non-finite-score
    error of every backend (numerics.check_rows); a non-finite O row or +inf LSE (a NaN or inf in
    the V rows the row sees) is refused here.  (A finite output whose sum overflowed passes.)"""
    C = np.asarray(call.manifest.C, np.int64)
    indptr = np.concatenate([[0], np.cumsum(C)])
    post = np.asarray(call.committed, np.int64)
    numerics.check_rows(lse, qo_indptr=indptr, kv_lens=post, sink=sink)
    bad = ~np.isfinite(o).all(axis=-1) | (lse == np.inf)
    if not bad.any():
        return
    rows, heads = np.nonzero(bad)
    reqs = np.searchsorted(indptr, rows, side="right") - 1
    qs = post[reqs] - C[reqs] + rows - indptr[reqs]
    first = np.lexsort((qs, heads, reqs))[0]
    raise PlanError(f"append: the output of query row (b={int(reqs[first])}, h={int(heads[first])}, "
                    f"q={int(qs[first])}) is not finite (a NaN or inf in the V rows its tiles read: the cache's "
                    "committed rows or v_new); nothing was committed")


def _check_writable_lengths(kv_lens) -> None:
    """``kv_lens`` is written in place at the commit: refuse, before anything is staged, one whose
    elements share memory (an expanded or stride-0 tensor), an inference-mode tensor outside
    inference mode, or any tensor a same-values write fails on."""
    import torch
    if any(n > 1 and st == 0 for n, st in zip(kv_lens.shape, kv_lens.stride())):
        raise InputError(f"inputs: 'kv_lens' (strides {list(kv_lens.stride())}) repeats one memory location "
                         "(an expanded or stride-0 tensor): it advances in place when the append commits; pass "
                         "a tensor of its own (kv_lens.clone())")
    if kv_lens.is_inference() and not torch.is_inference_mode_enabled():
        raise InputError("inputs: 'kv_lens' was made under torch.inference_mode(), and it advances in place when the "
                         "append commits, which torch allows such a tensor only inside inference mode: call append "
                         "inside torch.inference_mode() or pass kv_lens.clone()")
    try:
        with torch.no_grad():
            kv_lens.copy_(kv_lens.clone())  # the same values: what the commit will do, minus the change
    except RuntimeError as e:
        raise InputError(f"inputs: 'kv_lens' cannot be written in place ({e}); it advances when the append commits: "
                         "pass a writable integer tensor") from None


def _memory(x):
    """(device, first byte, end byte, storage) of a tensor's (or numpy array's) elements, or None
    for an empty one or a non-array."""
    import torch
    if isinstance(x, torch.Tensor):
        if x.numel() == 0:
            return None
        lo = sum(min(0, (n - 1) * st) for n, st in zip(x.shape, x.stride()))
        hi = sum(max(0, (n - 1) * st) for n, st in zip(x.shape, x.stride()))
        size = x.element_size()
        return str(x.device), x.data_ptr() + lo * size, x.data_ptr() + (hi + 1) * size, x
    if isinstance(x, np.ndarray) and x.size:
        lo, hi = np.byte_bounds(x)
        return "cpu", lo, hi, x
    return None


def _elements_overlap(a, b) -> bool:
    """Whether two strided tensors whose byte spans intersect share an element.  Exact for the
    common case (one shape and strides, each stride at least the extent of the smaller ones: the
    K and V halves of one [pages, 2, ...] tensor); any other pair counts as overlapping."""
    import torch
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return True
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return True
    delta = abs(a.data_ptr() - b.data_ptr())
    if delta % a.element_size():
        return True
    delta //= a.element_size()
    dims = sorted((st, n) for n, st in zip(a.shape, a.stride()) if n > 1)
    extent = 0
    for st, n in dims:
        if st <= extent:  # not nested: give up exactness
            return True
        extent += (n - 1) * st
    for st, n in reversed(dims):  # greedy digits of delta in the mixed radix of the strides
        delta -= min(delta // st, n - 1) * st
    return delta == 0


def _check_aliasing(inputs_: dict, written: tuple) -> None:
    """A tensor the append writes (the K and V storage, ``kv_lens``) shares no memory with any
    other input: the same tensor as K and V storage, or a view of one in another, is refused."""
    spans = {n: m for n, m in ((n, _memory(x)) for n, x in inputs_.items()) if m is not None}
    for w in written:
        if w not in spans:
            continue
        dev, lo, hi, x = spans[w]
        for n, (dev2, lo2, hi2, y) in spans.items():
            if n == w or (n in written and written.index(n) < written.index(w)):
                continue
            if dev == dev2 and lo < hi2 and lo2 < hi and _elements_overlap(x, y):
                raise InputError(f"inputs: '{w}' shares memory with '{n}' (the same tensor or overlapping views): "
                                 f"the append writes '{w}' in place, so it must not alias another input")


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
