"""The backend protocol: what attnc's torch front doors ask of a backend.

``attnc/api.py`` (forward, backward, plan, run, decode), ``attnc/serving.py`` (append) and
``attnc/distributed.py`` (block) reach a backend only through this protocol: each backend
declares one object, ``backends/<name>/torch_api.py: BACKEND``, that implements
:class:`Backend`, and :func:`registry.torch_backend` finds it by name.  The front doors never
compare a backend's name; what differs between backends (the host copy of the numpy backend,
the Triton launch's device tensors, AHBM's per-request programs) lives in the backend.

A backend that lacks a capability says so: it leaves the name out of ``capabilities`` and
:meth:`Backend.refusal` words the refusal; the caller raises :class:`BackendRefused` with it.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..errors import AttncError

# What a front door may ask of a backend.  ``tensor_grads``: gradients of the float tensors the
# score program reads (besides dQ, dK, dV); ``fp8``: float8_e4m3fn inputs on the device itself.
CAPABILITIES = ("forward", "run", "plan", "backward", "tensor_grads", "decode", "append", "block", "fp8")


class BackendRefused(AttncError):
    """The backend asked for (or every backend) refuses the call; the message has every reason."""


@runtime_checkable
class Backend(Protocol):
    """One backend, seen from torch tensors (every method takes and returns torch tensors)."""

    name: str
    capabilities: frozenset

    def forward(self, kernel, q, k, v, tensors: dict, plan=None) -> tuple:
        """(O, LSE) of one call; ``plan`` a plan from :meth:`plan` (``run``) or None."""

    def bound_forward(self, kernel, signature: tuple, tensors: dict) -> Any:
        """A bound call ``fast(q, k, v, tensors)`` -> (O, LSE) or None (then :meth:`forward`) for calls
        with this ``signature`` (``signature.call_signature``), made after one such call ran; or
        None where the backend binds none.  A bound call that declines a call because what it bound
        is gone sets ``stale``: the front door binds again after the validating path."""

    def forward_fp8(self, kernel, q, k, v, descales: dict, tensors: dict) -> tuple:
        """(O, LSE) of a float8_e4m3fn call with its descales (``attnc.fp8``)."""

    def backward(self, kernel, q, k, v, o, lse, do, dlse, tensors: dict, want: tuple,
                 deterministic: bool = True) -> tuple:
        """(dQ, dK, dV, {name: gradient} for the tensors in ``want``).  ``deterministic`` False lets
        the backend add partial sums in any order where that is faster (``attnc.compile``)."""

    def bound_backward(self, kernel, q, k, v, o, lse, do, dlse, tensors: dict, deterministic: bool = True) -> Any:
        """A bound backward ``fast(q, k, v, o, lse, do, dlse, tensors)`` -> (dQ, dK, dV) or None (then
        :meth:`backward`) for calls keyed like this one (its forward's signature and O's, dO's and
        dLSE's layouts; no tensor gradient), made after one such call ran; or None where the backend
        binds none.  ``stale`` as :meth:`bound_forward`'s."""

    def tensor_grad_refusal(self, kernel, tensor: str) -> str | None:
        """Why this backend gives no gradient of score tensor ``tensor`` (the message of the
        caller's BackendRefused), or None when its backward gives one."""

    def plan(self, kernel, batch: int, s_q: int, s_k: int, tensors: dict) -> Any:
        """A plan for calls of this shape, for :meth:`forward`'s ``plan``."""

    def decode(self, kernel, q, return_lse: bool, cache: dict) -> Any:
        """A split-K/V call over the spec's cache layout (``Attention.decode``)."""

    def bound_decode(self, kernel, signature: tuple, cache: dict) -> Any:
        """A bound split call ``fast(q, cache)`` -> (O, LSE) or None (then :meth:`decode`) for calls
        with this ``signature`` (``signature.split_signature``), made after one such call ran; or
        None where the backend binds none."""

    def append_runner(self, kernel_of, program) -> Any:
        """The runner of an append transaction (``attnc.serving``): ``plan(txn)``, ``run(txn, plan)``.
        ``kernel_of(program)`` compiles a program on this backend."""

    def block_runner(self, attn, cp, device, dtype) -> Any:
        """The block runner of a multi-rank call (``attnc.distributed``): ``prepare``, ``forward``,
        ``backward``, ``output`` over ``cp``'s blocks (``attn.kernel(name, program)`` compiles)."""

    def device_refusal(self, device) -> str | None:
        """Why this backend cannot run on tensors of ``device`` here, or None."""

    def refusal(self, capability: str, **context) -> str:
        """Why this backend does not do ``capability`` (the message of the caller's BackendRefused)."""


class BackendBase:
    """Defaults for :class:`Backend`: every capability missing, refused in a message that names
    the backend.  A backend subclasses it and overrides what it does."""

    name = ""
    capabilities: frozenset = frozenset()

    def refusal(self, capability: str, **context) -> str:
        if capability == "backward":
            return (f"the {self.name} backend has no backward pass; run the call on the numpy or Triton "
                    "backend")
        if capability == "tensor_grads":
            return (f"inputs: tensor '{context.get('tensor', '?')}' requires grad: the {self.name} backward gives "
                    "dQ, dK, dV only (gradients of score tensors come from the numpy and Triton backends); pass "
                    "the tensor detached")
        return f"the {self.name} backend has no {capability} path"

    def _missing(self, capability: str, **context):
        raise BackendRefused(self.refusal(capability, **context))

    def forward(self, kernel, q, k, v, tensors, plan=None):
        self._missing("forward")

    def bound_forward(self, kernel, signature, tensors):
        return None

    def forward_fp8(self, kernel, q, k, v, descales, tensors):
        self._missing("fp8")

    def backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, want, deterministic=True):
        self._missing("backward")

    def bound_backward(self, kernel, q, k, v, o, lse, do, dlse, tensors, deterministic=True):
        return None

    def tensor_grad_refusal(self, kernel, tensor):
        return None if "tensor_grads" in self.capabilities else self.refusal("tensor_grads", tensor=tensor)

    def plan(self, kernel, batch, s_q, s_k, tensors):
        return kernel.plan(batch, s_q, s_k, tensors)

    def decode(self, kernel, q, return_lse, cache):
        self._missing("decode")

    def bound_decode(self, kernel, signature, cache):
        return None

    def append_runner(self, kernel_of, program):
        self._missing("append")

    def block_runner(self, attn, cp, device, dtype):
        self._missing("block")

    def device_refusal(self, device):
        return None


def require(backend: Backend, capability: str, **context) -> Backend:
    """``backend`` if it has ``capability``, else its refusal as :class:`BackendRefused`."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}")
    if capability not in backend.capabilities:
        raise BackendRefused(backend.refusal(capability, **context))
    return backend


def implements(obj) -> list[str]:
    """What ``obj`` lacks of :class:`Backend` (empty: it implements the protocol)."""
    problems = [f"no attribute {n}" for n in ("name", "capabilities") if not hasattr(obj, n)]
    for n, member in vars(Backend).items():
        if callable(member) and not n.startswith("_") and not callable(getattr(obj, n, None)):
            problems.append(f"no method {n}")
    unknown = set(getattr(obj, "capabilities", ())) - set(CAPABILITIES)
    if unknown:
        problems.append(f"unknown capabilities {sorted(unknown)}")
    return problems
