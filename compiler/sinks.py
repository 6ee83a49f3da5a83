"""Learned attention sinks (``sink = expr``): the one definition the oracle, the numpy runtime
and the host-side merges (split decode's combine, context parallelism) share.

A sink is an f32 logit per (request ``b``, query head ``h``) that joins every row's softmax
denominator and carries no value::

    O = sum_k e^(s_k - m) v_k / (e^(sink - m) + sum_k e^(s_k - m)),   m = max(sink, max_k s_k)
    LSE = log(e^sink + sum_k e^s_k)

so a row that sees no key has O = 0 and LSE = sink.  It is the same as merging the rows' sinkless
state (O, LSE) with one more partial state (O = 0, LSE = sink), which is how every backend adds it:
once per row, after its keys (and after a split decode's or a context-parallel call's partials are
merged; never once per partial).  A sink of -inf is no sink; a sink of NaN or +inf marks the row
(O and LSE NaN) like a NaN or +inf visible score, and the call reports it.

Backward: with p_sink = e^(sink - LSE) (LSE including the sink), dLSE/dsink = p_sink and
dO/dsink = -p_sink O, so for a loss L, dL/dsink = sum over the head's rows of
p_sink (dLSE - rowsum(dO * O)).  The keys' gradients keep their form: P = e^(s - LSE) with the
sink's LSE already in it.  A sink's f32 tensor reads get dL/dsink times the sink's derivative with
respect to them (``compiler/autodiff.py``), summed over the (b, h) that read each element.
"""
from __future__ import annotations

import numpy as np

from . import ir
from .autodiff import derivative, f32_loads
from .interp import evaluate


def values(program: ir.Program, batch: int, tensors: dict, *, wide: bool = False) -> np.ndarray:
    """The sink of every (b, h): [batch, H_q], float32 as the language computes it (float64 with
    ``wide``).  A read outside a tensor is a PlanError naming it (``interp.load``)."""
    env = {"b": np.arange(batch).reshape(-1, 1), "h": np.arange(program.heads_q).reshape(1, -1)}
    sink = evaluate(program.sink, env, tensors, wide=wide)
    return np.array(np.broadcast_to(sink, (batch, program.heads_q)), np.float64 if wide else np.float32)


def at(program: ir.Program, env: dict, tensors: dict, *, wide: bool = False) -> np.ndarray:
    """The sink on the oracle's grids (``env``'s b [B,1,1,1] and h [1,H,1,1]): [B or 1, H, 1]."""
    sink = evaluate(program.sink, {"b": env["b"], "h": env["h"]}, tensors, wide=wide)
    return np.asarray(np.broadcast_to(sink, np.broadcast_shapes(np.shape(env["b"]), np.shape(env["h"]))),
                      np.float64)[..., 0]


def join(o, lse, sink):
    """(O, LSE) of rows without the sink -> with it.  ``o [..., d]``, ``lse [...]``, ``sink``
    broadcastable to ``lse``; the arithmetic in the inputs' precision."""
    o, lse = np.asarray(o), np.asarray(lse)
    sink = np.broadcast_to(np.asarray(sink, lse.dtype), lse.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.logaddexp(lse, sink)
        empty = np.isneginf(out)  # no key and a sink of -inf: O = 0, LSE = -inf
        factor = np.where(empty, 0.0, np.exp(lse - np.where(empty, 0.0, out))).astype(lse.dtype)
    bad = np.isnan(sink) | (sink == np.inf)  # marked like a NaN or +inf visible score
    out = np.where(bad, np.nan, out).astype(lse.dtype)
    o = np.where(bad[..., None], np.nan, o * factor[..., None]).astype(o.dtype)
    return o, out


def row_gradient(o, lse, do, dlse, sink) -> np.ndarray:
    """dL/dsink per row, float64: p_sink (dLSE - rowsum(dO * O)) with p_sink = e^(sink - LSE)
    (0 where LSE is -inf: no key and no sink).  ``o``, ``do`` [..., d]; ``lse``, ``dlse``
    (None: 0) and ``sink`` broadcastable to [...]."""
    o, do, lse = (np.asarray(x, np.float64) for x in (o, do, lse))
    sink = np.broadcast_to(np.asarray(sink, np.float64), lse.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(np.isfinite(lse), np.exp(sink - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    delta = (do * o).sum(axis=-1)
    g = -delta if dlse is None else np.asarray(dlse, np.float64) - delta
    return p * g


def tensor_gradients(program: ir.Program, dsink, tensors: dict) -> dict[str, np.ndarray]:
    """The gradients of the f32 tensors the sink reads, from ``dsink`` [batch, H_q] = dL/dsink
    of each (b, h): each load gets dsink * d sink / d load, summed over the (b, h) that read the
    same element.  Float64, each in its tensor's shape."""
    dsink = np.asarray(dsink, np.float64)
    env = {"b": np.arange(dsink.shape[0]).reshape(-1, 1), "h": np.arange(dsink.shape[1]).reshape(1, -1)}
    out: dict[str, np.ndarray] = {}
    for load in f32_loads(program.sink):
        d = np.broadcast_to(evaluate(derivative(program.sink, load), env, tensors, wide=True), dsink.shape)
        index = tuple(np.broadcast_to(evaluate(i, env, tensors), dsink.shape) for i in load.index)
        grad = out.setdefault(load.tensor, np.zeros(np.shape(tensors[load.tensor])))
        np.add.at(grad, index, dsink * d)
    return out


class Reduction:
    """How the gradients of a sink's tensors come from dsink [batch, H_q] without their values: the
    sink's reads and its derivatives do not depend on tensor values, and every element read is read
    by the same number of (b, h).  Then ``grad(T).flat[targets[T]] = (dsink * scale[T]).flat[order[T]]
    .reshape(-1, count[T]).sum(1)``: a gather and a fixed-order sum per element, the same bits every
    run, on whichever device dsink is (no tensor goes to the host).  ``sink = sinks[h]``: each head's
    element summed over the batch."""

    def __init__(self, parts: dict[str, tuple]):
        self.parts = parts  # tensor -> (scale [B, H] f64, order [n] i64, targets [m] i64, count)


def reduction(program: ir.Program, batch: int, shapes: dict) -> Reduction | None:
    """The :class:`Reduction` of the sink's tensor gradients at ``batch`` (the tensors' ``shapes``),
    or None where the host must evaluate them (:func:`tensor_gradients`): reads or derivatives that
    depend on tensor values, a tensor read twice, or elements read by different numbers of (b, h)."""
    if program.sink is None or reads_by_value(program):
        return None
    loads = f32_loads(program.sink)
    if len({ld.tensor for ld in loads}) != len(loads):
        return None
    env = {"b": np.arange(batch).reshape(-1, 1), "h": np.arange(program.heads_q).reshape(1, -1)}
    full = (batch, program.heads_q)
    parts = {}
    for load in loads:
        d = derivative(program.sink, load)
        if ir.loads(d):
            return None
        scale = np.array(np.broadcast_to(evaluate(d, env, {}, wide=True), full), np.float64)
        shape = tuple(shapes[load.tensor])
        index = tuple(np.broadcast_to(evaluate(i, env, {}), full).reshape(-1) for i in load.index)
        if any(((i < 0) | (i >= n)).any() for i, n in zip(index, shape)):
            return None  # (the host's evaluation names the read)
        flat = np.ravel_multi_index(index, shape) if shape else np.zeros(scale.size, np.int64)
        order = np.argsort(flat, kind="stable")
        targets, counts = np.unique(flat[order], return_counts=True)
        if len(counts) and (counts != counts[0]).any():
            return None
        parts[load.tensor] = (scale, order.astype(np.int64), targets.astype(np.int64), int(counts[0]) if len(counts) else 1)
    return Reduction(parts)


def tensors_read(program: ir.Program) -> tuple[str, ...]:
    """The f32 tensors the sink reads (they get gradients), in declaration order."""
    if program.sink is None:
        return ()
    read = {load.tensor for load in f32_loads(program.sink)}
    return tuple(t.name for t in program.tensors if t.name in read)


def reads_by_value(program: ir.Program) -> bool:
    """Whether which tensor elements the sink reads depends on tensor values (a subscript or a
    where() condition that reads a tensor): then only evaluating it can check its reads."""
    for n in ir.walk(program.sink):
        if isinstance(n, ir.Load) and any(ir.loads(i) for i in n.index):
            return True
        if isinstance(n, ir.Select) and ir.loads(n.cond):
            return True
    return False


def check_reads(program: ir.Program, batch: int, shapes: dict) -> None:
    """The sink's tensor reads at every (b, h) of a call against the tensors' ``shapes``, for a sink
    whose reads do not depend on tensor values (:func:`reads_by_value`): a read outside a tensor is
    the PlanError the IR interpreter raises (``interp.load``), as on the backends that evaluate the
    sink on the host.  Needs no tensor values (kernels that clamp their reads check with this)."""
    zeros = {n: np.broadcast_to(np.zeros((), np.float32), tuple(s)) for n, s in shapes.items()}
    env = {"b": np.arange(batch).reshape(-1, 1), "h": np.arange(program.heads_q).reshape(1, -1)}
    with np.errstate(all="ignore"):
        evaluate(program.sink, env, zeros)


def may_be_nonfinite(program: ir.Program) -> bool:
    """Whether the sink can be NaN or +inf (a kernel that marks such rows then checks its output, as
    for a score program that can: ``ranges.may_be_nonfinite``)."""
    from .ranges import IntRanges, float_range
    _, hi, nan = float_range(program.sink, IntRanges(program.heads_q), finite_tensors=True)
    return nan or hi == float("inf")
