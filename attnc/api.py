"""The PyTorch front door: ``attnc.compile(spec)`` and the ``Attention`` it returns.

``attn = attnc.compile("examples/causal_document.attn")`` (a path, or the spec's text), then
``o = attn(q, k, v, doc=doc)`` on torch tensors in the spec's layout (bhsd by default).  CUDA
tensors run the Triton backend, CPU tensors the numpy backend; ``backend=`` forces one, and a
backend that refuses the call says why (the dispatch key's admission, DESIGN §6).  O comes back
as a torch tensor of q's dtype, device and layout -- stored token-major where q is a token-major view
([B, S, H, d] memory seen as [B, H, S, d], as transformers hands it over: ``attnc.layouts``), so that
``o.transpose(1, 2)`` is contiguous (the custom op, under torch.compile: contiguous, as its fake
says); ``return_lse=True`` adds LSE [B, H_q, S_q]
(float32, natural log, -inf on rows that see no key; with a sink, ``sink = ...``, LSE includes it
and is the sink on those rows).

A spec may leave ``heads``, ``head_dim`` and ``dtype`` out: each call then supplies them (GQA
from q's and k's head counts), and the compiled kernel is cached per specialisation, keyed
explicitly by (H_q, H_kv, d_qk, d_v, dtype).  Declared values are checks.

The call is a ``torch.library`` custom op (``attnc::attention``, with a fake implementation), so
``torch.compile(model, fullgraph=True)`` traces through it with no graph break; outside
compilation it runs directly (no dispatcher cost).  Masks that read tensors are planned from
the tensors' values on the host, so their op (``attnc::attention_planned``) is marked unsafe for
CUDA graphs and ``mode="reduce-overhead"`` leaves it out of the captured graph.

The call is differentiable in q, k and v (and in float tensors the score program reads: on the
numpy backend, and on the Triton backend where they are indexed by plain positions): the op's autograd formula saves O and LSE only and runs the backend's backward
(``attnc::attention_backward``, also a custom op, so compiled training traces through it).
float64 tensors on the CPU run the numpy backend in float64 end to end (``gradcheck``).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading
from pathlib import Path

from . import layouts
from .compiler import ir
from .compiler.dispatch.protocol import BackendRefused, require
from .compiler.dispatch.signature import NO_ADDRESS, call_signature, split_signature
from .compiler.errors import InputError

_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}
_TORCH_NAMES = {name: t.split(".")[1] for t, name in _DTYPES.items()}  # "bf16" -> "bfloat16"
_FP8 = "torch.float8_e4m3fn"  # compared with a torch dtype by its string (torch is imported lazily)
_HANDLES: dict[str, "Attention"] = {}
BOUND_CALLS = 64  # bound calls an Attention keeps, one per signature (then it starts over)
_LOCK = threading.Lock()


_TORCH = None


def _torch_module():
    global _TORCH
    if _TORCH is None:  # (imported once: every call asks)
        import torch
        _TORCH = torch
    return _TORCH


def compile(spec: str | os.PathLike, *, name: str | None = None,  # noqa: A001 - the API's name
            deterministic: bool = True) -> "Attention":
    """Parse, check and lower a spec (a path to a ``.attn`` file, or the spec's text).
    ``deterministic`` (default True): gradients bit-identical run to run; False lets the backward add
    partial sums in any order where that is faster (on Hopper the Gluon backward's dQ: 1.09x at
    d 128 on the H200); elsewhere it stays deterministic."""
    from .compiler.lower import compile_file, compile_spec
    text = str(spec)
    looks_like_path = "{" not in text and (text.endswith(".attn") or "/" in text or os.sep in text
                                           or not any(c.isspace() for c in text) or Path(text).is_file())
    if isinstance(spec, os.PathLike) or looks_like_path:  # (spec text always has braces)
        program = compile_file(spec)  # a missing file: "cannot read PATH: No such file or directory"
    else:
        program = compile_spec(text, name or "<spec>")
    return Attention(program, deterministic=deterministic)


class Attention:
    """A compiled spec, callable on torch tensors (module docstring)."""

    def __init__(self, program: ir.Program, *, deterministic: bool = True):
        self.program = program
        self.deterministic = bool(deterministic)
        self.name = program.name
        self.tensor_names = tuple(t.name for t in program.tensors)
        self._name_set = frozenset(self.tensor_names)
        self.reads_tensors = bool(ir.loads(program.mask)) or any(ir.loads(s) for s in program.score)
        self._bshd = program.cache.layout is ir.Layout.BSHD
        self._programs: dict = {}  # (H_q, H_kv, d_qk, d_v, dtype) -> concrete program
        self._kernels: dict = {}  # (backend, program digest) -> backend kernel
        self._routes: dict = {}  # call key -> (backend protocol object, kernel)
        self._bound: dict = {}  # (backend asked, call signature) -> (bound call, route), or False: none binds
        self._bound_backward: dict = {}  # (that key, O / dO / dLSE layouts) -> bound backward, or False: none binds
        self._bound_splits: dict = {}  # split call signature -> bound split call, or False: none binds
        self._differentiable = None  # the tensors with a gradient (_check_grads), once asked
        self.handle = f"{program.name}-{ir.digest(program)[:16]}" + ("" if self.deterministic else "-unordered")
        with _LOCK:
            _HANDLES.setdefault(self.handle, self)

    def __repr__(self) -> str:
        open_ = f", from the call: {', '.join(self.program.open_fields)}" if self.program.open_fields else ""
        return f"attnc.Attention({self.name}{open_})"

    # ------------------------------------------------------------ specialisation
    def _shape_of(self, q, k, v) -> tuple[int, int, int, int, str]:
        for n, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                layout = "[B, S, H, d]" if self._bshd else "[B, H, S, d]"
                raise InputError(f"inputs: '{n}' has shape {list(t.shape)} (rank {t.dim()}); spec '{self.name}' "
                                 f"takes q, k, v as {layout}")
        h_ax = 2 if self._bshd else 1
        dtype = _DTYPES.get(str(q.dtype))
        if str(q.dtype) == _FP8:  # FP8 inputs (attnc.fp8): O in the spec's dtype, bf16 if open
            dtype = "bf16" if "dtype" in self.program.open_fields else self.program.dtype
        elif str(q.dtype) == "torch.float64" and not q.is_cuda:
            # a reference-precision call (numpy backend, float64 throughout): the spec's storage dtype
            # is not applied, so it is not checked against the call
            dtype = "f32" if "dtype" in self.program.open_fields else self.program.dtype
        elif dtype is None:
            raise InputError(f"inputs: 'q' has dtype {q.dtype}; attention takes float16, bfloat16 or float32 "
                             "(or float8_e4m3fn with descales: attnc.fp8)"
                             + (" (float64 runs on the CPU only, on the numpy backend)" if q.is_cuda and
                                str(q.dtype) == "torch.float64" else ""))
        if k.dtype != q.dtype or v.dtype != q.dtype:
            if str(q.dtype) == _FP8:
                from . import fp8
                fp8.check_inputs(q, k, v)  # (FP8's own message: all three as float8_e4m3fn)
            raise InputError(f"inputs: q/k/v have dtypes {q.dtype}/{k.dtype}/{v.dtype}; K and V are stored in "
                             "the query dtype")
        return q.shape[h_ax], k.shape[h_ax], q.shape[3], v.shape[3], dtype

    def specialize(self, heads_q: int, heads_kv: int, d_qk: int, d_v: int, dtype: str) -> ir.Program:
        """The concrete program for one call's head counts, head dims and dtype (cached)."""
        key = (heads_q, heads_kv, d_qk, d_v, dtype)
        p = self._programs.get(key)
        if p is None:
            p = self._programs[key] = ir.specialize(self.program, *key)
        return p

    def kernel(self, backend: str, program: ir.Program):
        """The backend's kernel for a concrete program (compiled once, cached)."""
        from .compiler.dispatch import backend as load_backend
        key = (backend, ir.digest(program))
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = load_backend(backend).load(program)
        return k

    def check_numerics(self) -> None:
        """Raise the non-finite rows that GPU calls since the last check marked without a host
        sync (README, "Limits and failures": non-finite values); one sync."""
        for k in list(self._kernels.values()):
            if hasattr(k, "check_numerics"):
                k.check_numerics()

    def _route(self, program: ir.Program, q, k, backend: str | None) -> tuple[object, object]:
        """Which backend runs calls like this one: the dispatch key's admission (auto, or forced);
        its protocol object (``compiler/dispatch/protocol.py``) and its kernel."""
        from .compiler.dispatch import DispatchError, dispatch, run_environment, torch_backend
        from .compiler.dispatch.environment import device_capability
        cuda = q.is_cuda
        env = run_environment("cuda" if cuda else "cpu", backend or "auto")
        s_axis = 1 if self._bshd else 2
        call = {"B": int(q.shape[0]), "S_q": int(q.shape[s_axis]), "S_k": int(k.shape[s_axis]),
                "device": "cuda" if cuda else "cpu", "last_dim_contiguous": bool(q.stride(-1) == 1 and
                                                                                k.stride(-1) == 1)}
        if cuda:  # (read by dispatch's environment, not a backend: a CPU install needs torch alone)
            call["compute_capability"] = device_capability(q.device)
        if backend is not None:
            call["backend"] = backend
        try:
            selection = dispatch(program, call, env)
            name = selection.require()
        except DispatchError as e:
            raise BackendRefused(str(e)) from None
        return torch_backend(name), self.kernel(name, program)

    # ------------------------------------------------------------ the call
    def __call__(self, q, k, v, *, return_lse: bool = False, backend: str | None = None, **tensors):
        torch = _torch_module()
        try:
            needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
        except AttributeError:
            raise InputError(f"inputs: q, k and v must be torch tensors (attnc.compile(...) takes torch tensors; "
                             f"got {type(q).__name__}, {type(k).__name__}, {type(v).__name__})") from None
        if q.dtype == torch.float8_e4m3fn:
            o, lse = self._fp8_call(q, k, v, tensors, backend)
            return (o, lse) if return_lse else o
        if tensors.keys() != self._name_set:
            self._check_tensors(tensors)
        if torch.is_grad_enabled() and (needs_grad or tensors and any(
                getattr(tensors[n], "requires_grad", False) for n in self.tensor_names)):
            if not torch.compiler.is_compiling():  # (dispatch is host code dynamo does not trace: under
                # torch.compile the backward checks the same when it runs, ``backward``)
                self._check_grads(q, k, v, [n for n in self.tensor_names
                                            if getattr(tensors[n], "requires_grad", False)], tensors, backend)
            listed = [tensors[n] for n in self.tensor_names]
            if _eager(torch, q, k, v):  # the same formula without the custom op's dispatch (host time)
                o, lse = _EagerAttention.apply(self.handle, backend or "", q, k, v, *listed)
            else:
                op = torch.ops.attnc.attention_planned if self.reads_tensors else torch.ops.attnc.attention
                o, lse = op(self.handle, q, k, v, listed, backend or "")
        elif torch.compiler.is_compiling():
            op = torch.ops.attnc.attention_planned if self.reads_tensors else torch.ops.attnc.attention
            o, lse = op(self.handle, q, k, v, [tensors[n] for n in self.tensor_names], backend or "")
        else:
            out, key, _ = self._bound_forward(q, k, v, tensors, backend)
            if out is None:
                out = self.forward(q, k, v, tensors, backend)
                self._bind(key, q, k, v, tensors, backend)
            o, lse = out
        return (o, lse) if return_lse else o

    def _fp8_call(self, q, k, v, tensors: dict, backend: str | None):
        """(O, LSE) of an FP8 call (``attnc.fp8``): float8_e4m3fn q, k, v and the keywords q_descale,
        k_descale, v_descale ([B, H] float32, or numbers; default 1).  Forward only, outside
        torch.compile.  The Triton backend takes it (FP8 tensor cores on the Gluon engine); other
        backends compute the same attention of the dequantized values."""
        from . import fp8 as F
        torch = _torch_module()
        if torch.compiler.is_compiling():
            raise InputError("inputs: FP8 calls are not traced by torch.compile; call the attention outside the "
                             "compiled region, or pass bf16 / f16 tensors")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise InputError("inputs: FP8 calls are forward only (no backward through e4m3 inputs); pass q, k, v "
                             "detached, or bf16 / f16 tensors for training")
        descales = {n: tensors.pop(n) for n in F.DESCALES if n in tensors}
        if set(tensors) != set(self.tensor_names):
            self._check_tensors(tensors)
        be, kernel = self._kernel_for(q, k, v, tensors, backend)
        if "fp8" in be.capabilities:
            return be.forward_fp8(kernel, q, k, v, descales, tensors)
        program = kernel.program
        want = getattr(torch, _TORCH_NAMES[program.dtype])
        axis = 2 if self._bshd else 1
        F.check_inputs(q, k, v)
        deq = [F.dequantize(x.cpu(), F.descale(n, descales.get(n), (q.shape[0], heads), q.device).cpu(),
                            torch.float32, heads_axis=axis)
               for n, x, heads in zip(F.DESCALES, (q, k, v), (program.heads_q, program.heads_kv, program.heads_kv))]
        o, lse = be.forward(kernel, *deq, tensors)
        return o.to(device=q.device, dtype=want), lse.to(q.device)

    def _check_grads(self, q, k, v, asked, tensors: dict, backend: str | None) -> None:
        """Refuse a gradient the backward cannot give, of the tensors named in ``asked``: of a tensor
        the score program (or the sink) does not read as a float (masks, indices), or of a score
        tensor on a backend without its gradient (Triton: tensors read at computed indices,
        ``score_grads.refusal``; other backends: every score tensor).  Before the forward runs, and
        again when the backward does (the only check under torch.compile)."""
        if not asked:
            return
        if self._differentiable is None:
            from .compiler import sinks
            from .compiler.autodiff import score_grad
            names = set(score_grad(self.program).tensors) if self.program.score else set()
            self._differentiable = frozenset(names | set(sinks.tensors_read(self.program)))
        for n in asked:
            if n not in self._differentiable:
                raise InputError(f"inputs: tensor '{n}' requires grad, but spec '{self.name}' has no gradient for it: "
                                 "only float tensors read by the score program or the sink are differentiable "
                                 "(masks and indices are not); pass it detached")
        be, kernel = self._kernel_for(q, k, v, tensors, backend)
        for n in asked:
            why = be.tensor_grad_refusal(kernel, n)
            if why is not None:
                raise BackendRefused(why)

    def _check_tensors(self, tensors: dict) -> None:
        unknown = sorted(set(tensors) - set(self.tensor_names))
        if unknown:
            raise InputError(f"inputs: unknown keyword '{unknown[0]}' (spec '{self.name}' reads "
                             f"{', '.join(self.tensor_names) or 'no tensors'})")
        missing = [n for n in self.tensor_names if n not in tensors]
        raise InputError(f"inputs: missing tensor '{missing[0]}' (spec '{self.name}' reads it)")

    def _kernel_for(self, q, k, v, tensors: dict, backend: str | None):
        """(backend protocol object, kernel) of calls shaped like this one: specialised, checked and selected
        once per (shapes, dtype, devices, backend asked), then looked up."""
        try:  # everything the checks below and the route's admission read (issue 35: a check must not
            # depend on the calls before): shapes, dtypes, devices (every tensor's), last-dim contiguity
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   q.stride()[-1:] == (1,) and k.stride()[-1:] == (1,), backend,  # (no IndexError at rank 0)
                   *[getattr(t, "device", None) for t in tensors.values()])
        except AttributeError:
            raise InputError(f"inputs: q, k and v must be torch tensors (attnc.compile(...) takes torch tensors; "
                             f"got {type(q).__name__}, {type(k).__name__}, {type(v).__name__})") from None
        torch = _torch_module()
        for n, t in tensors.items():  # (every call, whichever backend: the same error on each)
            if not isinstance(t, torch.Tensor):
                raise InputError(f"inputs: '{n}' is a {type(t).__name__}; attnc.compile(...) takes torch tensors "
                                 f"(torch.as_tensor(..., device=q.device))")
        route = self._routes.get(key)
        if route is None:
            program = self.specialize(*self._shape_of(q, k, v))
            for n, t in (("k", k), ("v", v), *tensors.items()):
                if hasattr(t, "device") and t.device != q.device:
                    raise InputError(f"inputs: '{n}' is on {t.device}, q on {q.device}: every tensor of a call "
                                     "lives on one device")
            route = self._routes[key] = self._route(program, q, k, backend)
        return route

    def forward(self, q, k, v, tensors: dict, backend: str | None = None, plan=None, contiguous: bool = False):
        """(O, LSE) of one call, on the backend the call's key selects (no autograd, no tracing).
        O is stored in q's order (``_in_out_order``), or ``contiguous`` (the custom op's: its fake
        fixes the layout, and inductor may hand the op inputs in other strides than the fake saw)."""
        be, kernel = self._kernel_for(q, k, v, tensors, backend)
        o, lse = require(be, "run" if plan is not None else "forward").forward(kernel, q, k, v, tensors, plan)
        if contiguous:
            return (o if o.is_contiguous() else o.contiguous()), lse
        return self._in_out_order(o, q), lse

    def _routed_forward(self, q, k, v, tensors: dict, backend: str | None):
        """(O, LSE, (backend protocol object, kernel), the call's bound-call key or None) of one call:
        :meth:`forward`, keeping the route and the key for the same call's backward (the same q, k, v
        and tensors: the same key; :meth:`_eager_backward`)."""
        out, key, route = self._bound_forward(q, k, v, tensors, backend)
        if out is not None:
            return (*out, route, key)
        route = self._kernel_for(q, k, v, tensors, backend)
        o, lse = require(route[0], "forward").forward(route[1], q, k, v, tensors, None)
        self._bind(key, q, k, v, tensors, backend)
        return self._in_out_order(o, q), lse, route, key

    def _bound_forward(self, q, k, v, tensors: dict, backend: str | None):
        """((O, LSE) or None, the call's key in the table of bound calls or None, its route): the
        call through the bound call of its signature (the backend's ``bound_forward``) where there
        is one and it takes the call (it answers None where a check wants :meth:`forward`; then
        :meth:`_bind`).  Its O is in q's order already (a backend binds calls whose O it allocates
        so: no ``_in_out_order``)."""
        try:
            key = (backend, call_signature(q, k, v, tensors))
        except NO_ADDRESS:
            return None, None, None
        hit = self._bound.get(key)
        if hit:
            out = hit[0](q, k, v, tensors)
            if out is not None:
                return out, key, hit[1]
        return None, key, None

    def _bind(self, key, q, k, v, tensors: dict, backend: str | None) -> None:
        """After a call with bound-call key ``key`` ran through :meth:`forward`: bind calls of its
        signature, unless its backend binds none (kept as False: not asked again) or they are bound
        already; again where the bound call is ``stale`` (its plan left the cache: the call re-made it)."""
        hit = self._bound.get(key) if key is not None else False
        if hit is False or hit is not None and not getattr(hit[0], "stale", True):
            return
        route = self._kernel_for(q, k, v, tensors, backend)
        fast = route[0].bound_forward(route[1], key[1], tensors)
        _keep(self._bound, key, (fast, route) if fast is not None else False)

    def _eager_backward(self, route, key, q, k, v, o, lse, do, dlse, tensors: list, want: list):
        """(dQ, dK, dV, [gradient per index in ``want``]) of an eager call's backward (``_EagerAttention``):
        on the route its forward took, through the bound backward (the backend's ``bound_backward``)
        of its forward's bound-call ``key`` and O's, dO's and dLSE's layouts where there is one and it
        takes the call; else the route's backward, after which calls keyed like it are bound.  Calls
        asking a tensor's gradient (``want``) take the route's backward.  The forward's signature is
        the key's: autograd hands back the tensors it saved, unchanged (its version check)."""
        bkey = None
        if key is not None and not want:
            try:
                bkey = (key, o.stride(), o.data_ptr() % 16 == 0, do.shape, do.stride(), do.data_ptr() % 16 == 0,
                        None if dlse is None else (dlse.shape, dlse.stride(), dlse.data_ptr() % 16 == 0))
            except NO_ADDRESS:
                bkey = None
            hit = self._bound_backward.get(bkey) if bkey is not None else None
            if hit:
                out = hit(q, k, v, o, lse, do, dlse, dict(zip(self.tensor_names, tensors)) if tensors else {})
                if out is not None:
                    return (*out, [])
        names = self.tensor_names
        named = dict(zip(names, tensors))
        dq, dk, dv, dts = require(route[0], "backward").backward(
            route[1], q, k, v, o, lse, do, dlse, named, tuple(names[i] for i in want),
            deterministic=self.deterministic)
        if bkey is not None:
            hit = self._bound_backward.get(bkey)
            if hit is None or hit is not False and hit.stale:
                fast = route[0].bound_backward(route[1], q, k, v, o, lse, do, dlse, named, self.deterministic)
                _keep(self._bound_backward, bkey, fast if fast is not None else False)
        return (_as_input_gradient(dq, q), _as_input_gradient(dk, k), _as_input_gradient(dv, v),
                [as_gradient(dts[names[i]], tensors[i]) for i in want])

    def _in_out_order(self, o, q):
        """O as the call returns it: in the order ``attnc.layouts.out_order`` gives q (a bhsd spec's
        token-major q: O token-major too), copied there only where the backend did not write it so
        (the Triton backend allocates it so; the numpy backend's O comes back contiguous)."""
        if self._bshd or layouts.out_order(q.shape, q.stride()) == layouts.BHSD:
            return o
        if o.stride() == layouts.out_strides(o.shape, layouts.BSHD):
            return o
        out = layouts.new_out(q, o.shape, layouts.BSHD)
        out.copy_(o)
        return out

    def backward(self, q, k, v, o, lse, do, dlse, tensors: dict, backend: str | None = None,
                 want: tuple[str, ...] = ()):
        """(dQ, dK, dV, {tensor: gradient} for the names in ``want``) of one call from its saved O
        and LSE, on the backend that ran its forward."""
        self._check_grads(q, k, v, want, tensors, backend)
        be, kernel = self._kernel_for(q, k, v, tensors, backend)
        return require(be, "backward").backward(kernel, q, k, v, o, lse, do, dlse, tensors, want,
                                                deterministic=self.deterministic)

    def out_shapes(self, q, k, v) -> tuple[tuple, tuple]:
        """The shapes of O and LSE for these inputs (the custom op's fake implementation)."""
        d_v = v.shape[3]
        if self._bshd:
            return (q.shape[0], q.shape[1], q.shape[2], d_v), (q.shape[0], q.shape[2], q.shape[1])
        return (q.shape[0], q.shape[1], q.shape[2], d_v), (q.shape[0], q.shape[1], q.shape[2])

    # ------------------------------------------------------------ plans and split calls
    def plan(self, q, k, v, **tensors):
        """A plan made once for calls shaped like (q, k, v) with these mask tensors, for callers who
        manage plans themselves (pass it back as ``attn.run(q, k, v, plan=...)``).  Calls without
        ``plan=`` find their plan in the process's plan cache, keyed by shape and, for masks that
        read tensors, by the tensors' identity and version."""
        be, kernel = self._kernel_for(q, k, v, tensors, None)
        s_axis = 1 if self._bshd else 2
        return require(be, "plan").plan(kernel, int(q.shape[0]), int(q.shape[s_axis]), int(k.shape[s_axis]), tensors)

    def run(self, q, k, v, *, plan, return_lse: bool = False, **tensors):
        """A call with a plan the caller made (``plan``)."""
        o, lse = self.forward(q, k, v, tensors, None, plan)
        return (o, lse) if return_lse else o

    def decode(self, q, *, return_lse: bool = False, **cache):
        """A split-K/V call (decode, append, mixed batches) over the spec's cache layout: packed
        q [total_q, H_q, d_qk] and the cache by its keys (k_cache / v_cache with block_table and
        kv_lens, or kv_indptr + kv_indices + kv_last_page_len; k / v with kv_lens or kv_indptr),
        optional q_lens / qo_indptr, and the spec's tensors by name.  Returns O [total_q, H_q, d_v]
        (and LSE [total_q, H_q])."""
        out, key = self._bound_decode(q, cache)
        if out is not None:
            return out if return_lse else out[0]
        torch = _torch_module()
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise InputError("inputs: a split call takes q as a torch tensor [total_q, H_q, d_qk]")
        kv = cache.get("k_cache", cache.get("k"))
        vv = cache.get("v_cache", cache.get("v"))
        if kv is None or vv is None:
            raise InputError("inputs: a split call needs the cache: k_cache / v_cache (paged) or k / v")
        route_key = ("decode", q.shape, kv.shape, vv.shape, q.dtype, q.device)
        route = self._routes.get(route_key)
        if route is None:
            from .compiler.dispatch import device_default, torch_backend
            h_ax = {"paged": 2 if self.program.cache.layout.value == "nhd" else 1, "ragged": 1}.get(
                self.program.cache.kind.value, 2 if self._bshd else 1)
            dtype = _DTYPES.get(str(q.dtype))
            if dtype is None:
                raise InputError(f"inputs: 'q' has dtype {q.dtype}; attention takes float16, bfloat16 or float32")
            program = self.specialize(q.shape[1], kv.shape[h_ax], q.shape[2], vv.shape[-1], dtype)
            name = device_default("cuda" if q.is_cuda else "cpu")
            route = self._routes[route_key] = (require(torch_backend(name), "decode"), self.kernel(name, program))
        be, kernel = route
        out = be.decode(kernel, q, return_lse, cache)
        if key is not None and key not in self._bound_splits:  # (bound after a call that ran: never a bad one)
            fast = be.bound_decode(kernel, key, cache)
            _keep(self._bound_splits, key, fast if fast is not None else False)
        return out

    def _bound_decode(self, q, cache: dict):
        """((O, LSE) or None, the call's key in the table of bound split calls or None): the split
        call through the bound call of its signature (``split_signature``; the backend's
        ``bound_decode``) where there is one and it takes the call (it answers None where its
        metadata has no plan in the cache: then :meth:`decode`'s validating path, which binds)."""
        try:
            key = split_signature(q, cache)
        except NO_ADDRESS:
            return None, None
        fast = self._bound_splits.get(key)
        return (fast(q, cache) if fast else None), key

    def append(self, q, k_new, v_new, *, manifest=None, plan=None, request_ids=None, return_lse: bool = False,
               backend: str | None = None, **cache):
        """Append-then-attend as one transaction (``attnc.serving``): packed q [total_q, H_q, d_qk] with
        its new K/V rows k_new / v_new [total_q, H_kv, d], the cache by its keys (``kv_lens`` = the
        committed rows, advanced in place to T + C on commit), optional q_lens / qo_indptr, a
        ``manifest`` (``attnc.MicrobatchManifest``) and a ``plan`` from :meth:`plan_append`; ``backend``
        "numpy", "triton" or "ahbm" (default: triton for CUDA tensors, else numpy)."""
        from .serving import append
        return append(self, q, k_new, v_new, manifest=manifest, plan=plan, request_ids=request_ids,
                      return_lse=return_lse, backend=backend, **cache)

    def plan_append(self, q, k_new, v_new, *, manifest=None, request_ids=None, backend: str | None = None,
                    **cache):
        """The plan of an append call (validated; nothing written), for :meth:`append`'s ``plan=``."""
        from .serving import plan_append
        return plan_append(self, q, k_new, v_new, manifest=manifest, request_ids=request_ids, backend=backend,
                           **cache)


# ---------------------------------------------------------------- the torch.library operators
SCHEMA = "(str handle, Tensor q, Tensor k, Tensor v, Tensor[] tensors, str backend) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = ("(str handle, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor? dlse, "
                   "Tensor[] tensors, int[] want, str backend) -> (Tensor, Tensor, Tensor, Tensor[])")


def gradient_buffer(x):
    """The layout of every gradient ``attnc::attention_backward`` returns, for the fake and the real
    implementation alike: a contiguous tensor of x's shape, dtype and device, whatever x's strides
    (q, k, v permuted out of a fused projection included: the fake must not inherit a layout the
    real backward does not produce, or inductor's stride assertion fails)."""
    return x.new_empty(x.shape)


def as_gradient(g, x):
    """A backend's gradient ``g`` of ``x`` in :func:`gradient_buffer`'s layout (no copy when it is)."""
    if g.shape == x.shape and g.stride() == _contiguous_strides(x.shape) and g.dtype == x.dtype and \
            g.device == x.device:
        return g
    out = gradient_buffer(x)
    out.copy_(g)
    return out


def _as_input_gradient(g, x):
    """``g`` as autograd takes it for ``x`` outside tracing: as it is where it has x's shape and dtype."""
    return g if g.dtype == x.dtype and g.shape == x.shape else as_gradient(g, x)


@functools.lru_cache(maxsize=256)
def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_EagerAttention = None  # the torch.autograd.Function _register_ops defines (it closes over the op's parts)


def _eager(torch, *xs) -> bool:
    """Whether a call runs outside any tracing (plain tensors, no dispatch mode, not dynamo): then
    autograd takes ``_EagerAttention`` instead of the custom op (the same formula)."""
    # (is_compiling first: dynamo, tracing this, does not trace the dispatch-stack query)
    return (not torch.compiler.is_compiling() and all(type(x) is torch.Tensor for x in xs)
            and not torch._C._len_torch_dispatch_stack())


def _gradients(ctx, grad_o, grad_lse, run):
    """(dQ, dK, dV, [gradient or None per tensor]) of a saved call, by ``run`` (the backward op, or
    :meth:`Attention._eager_backward`)."""
    q, k, v, o, lse, *tensors = ctx.saved_tensors
    if grad_o is None:
        import torch
        grad_o = torch.zeros_like(o)
    dq, dk, dv, dts = run(ctx.handle, q, k, v, o, lse, grad_o.contiguous(), grad_lse, tensors, ctx.want,
                          ctx.backend)
    grads = [None] * ctx.n_tensors
    for i, g in zip(ctx.want, dts):
        grads[i] = g
    return dq, dk, dv, grads


def _keep(table: dict, key, value) -> None:
    """``table[key] = value`` in one of an Attention's tables of bound calls, which keep at most
    BOUND_CALLS entries (then start over)."""
    if len(table) >= BOUND_CALLS:
        table.clear()
    table[key] = value


def _eager_run(route, key, handle, q, k, v, o, lse, do, dlse, tensors, want, backend):
    """``_gradients``' ``run`` of an eager call: :meth:`Attention._eager_backward` on its forward's
    route and bound-call key (``backend`` is the route's already)."""
    return _HANDLES[handle]._eager_backward(route, key, q, k, v, o, lse, do, dlse, tensors, want)


def _register_ops() -> None:
    import torch

    def impl(handle, q, k, v, tensors, backend):
        attn = _HANDLES[handle]
        # (O contiguous, as the fake's: under torch.compile the op's layout is fixed by its fake)
        o, lse = attn.forward(q, k, v, dict(zip(attn.tensor_names, tensors)), backend or None, contiguous=True)
        return o, lse

    def fake(handle, q, k, v, tensors, backend):
        attn = _HANDLES[handle]
        o_shape, lse_shape = attn.out_shapes(q, k, v)
        return q.new_empty(o_shape), q.new_empty(lse_shape, dtype=torch.float32)

    def backward_impl(handle, q, k, v, o, lse, do, dlse, tensors, want, backend):
        attn = _HANDLES[handle]
        named = dict(zip(attn.tensor_names, tensors))
        dq, dk, dv, dts = attn.backward(q, k, v, o, lse, do, dlse, named, backend or None,
                                        tuple(attn.tensor_names[i] for i in want))
        return (as_gradient(dq, q), as_gradient(dk, k), as_gradient(dv, v),
                [as_gradient(dts[attn.tensor_names[i]], tensors[i]) for i in want])

    def backward_fake(handle, q, k, v, o, lse, do, dlse, tensors, want, backend):
        return (gradient_buffer(q), gradient_buffer(k), gradient_buffer(v),
                [gradient_buffer(tensors[i]) for i in want])

    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    bwd = torch.library.custom_op("attnc::attention_backward", backward_impl, mutates_args=(),
                                  tags=(unsafe,) if unsafe else (), schema=BACKWARD_SCHEMA)
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        handle, q, k, v, tensors, backend = inputs
        o, lse = output
        # an output the loss does not read gets None, not a zeroed tensor: LSE's gradient is absent
        # in most calls (no memset launched, and the backward's delta pass reads no dLSE)
        ctx.set_materialize_grads(False)
        ctx.handle, ctx.backend, ctx.n_tensors = handle, backend, len(tensors)
        ctx.want = [i for i, t in enumerate(tensors) if t.requires_grad]
        ctx.save_for_backward(q, k, v, o, lse, *tensors)

    def grad_fn(ctx, grad_o, grad_lse):
        dq, dk, dv, grads = _gradients(ctx, grad_o, grad_lse, bwd)
        return None, dq, dk, dv, grads, None

    global _EagerAttention

    class _EagerAttention(torch.autograd.Function):
        """The op's autograd formula for calls outside tracing (``_eager``): the same saved tensors
        and backward, without the custom op's dispatch and argument flattening on every call."""

        @staticmethod
        def forward(ctx, handle, backend, q, k, v, *tensors):
            attn = _HANDLES[handle]
            o, lse, route, key = attn._routed_forward(q, k, v, dict(zip(attn.tensor_names, tensors)), backend or None)
            ctx.run = functools.partial(_eager_run, route, key)  # (the backward's: made here, once per forward)
            setup_context(ctx, (handle, q, k, v, tensors, backend), (o, lse))
            ctx.want = [i for i in range(len(tensors)) if ctx.needs_input_grad[5 + i]]
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            dq, dk, dv, grads = _gradients(ctx, grad_o, grad_lse, ctx.run)
            return None, None, dq, dk, dv, *grads

    for name, tags in (("attnc::attention", ()), ("attnc::attention_planned", (unsafe,) if unsafe else ())):
        op = torch.library.custom_op(name, impl, mutates_args=(), tags=tags, schema=SCHEMA)
        op.register_fake(fake)
        op.register_autograd(grad_fn, setup_context=setup_context)


if importlib.util.find_spec("torch") is not None:  # attnc.compile needs torch; the compiler alone does not
    _register_ops()
