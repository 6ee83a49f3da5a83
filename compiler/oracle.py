"""The float64 dense oracle: the definition every backend is tested against (the compiler's
reference, not a backend: tuning, `attnc run --check` and the tests all read it).

It evaluates the IR mask and score program over the whole
``[B, H_q, S_q, S_k]`` score rectangle with an IR interpreter of its own (not
the code generator's printer, so the two check each other), with
bottom-right positions ``q = S_k - S_q + i`` (M4.5 §0x08B) and the all-masked
policy ``O = 0, LSE = -inf`` (§0x02C; ``LSE = sink`` where the spec has a sink, which joins every
row's denominator once: ``compiler/sinks.py``).  Inputs are logical ``bhsd`` arrays.
:func:`reference_backward` is the float64 backward pass, from the score program's symbolic
derivatives (``compiler/autodiff.py``) evaluated by the same interpreter.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler import ir, resources, sinks
from attnc.compiler.autodiff import score_grad
from attnc.compiler.errors import PlanError
from attnc.compiler.interp import evaluate, load  # noqa: F401 (load: re-exported)
from attnc.compiler.numerics import check_rows, check_values
from attnc.compiler.ranges import check_length

def positions(batch: int, heads: int, s_q: int, s_k: int, q_offset: int | None = None,
              k_offset: int = 0, lengths: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Broadcastable b, h, q, k grids over [B, H_q, S_q, S_k]: bottom-right q by default; a block
    of a larger call (context parallelism) puts its rows at ``q_offset + i`` and its keys at
    ``k_offset + j``; and the call's lengths S_q, S_k (a block's: ``lengths``, the whole call's)."""
    check_length(s_k)
    if q_offset is None:
        if s_q > s_k:
            raise PlanError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys; every query row is a "
                            "token whose own key is in the cache (bottom-right alignment)")
        q_offset = s_k - s_q
    return {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(heads).reshape(1, -1, 1, 1),
        "q": (q_offset + np.arange(s_q)).reshape(1, 1, -1, 1),
        "k": (k_offset + np.arange(s_k)).reshape(1, 1, 1, -1),
        "S_q": np.asarray(s_q if lengths is None else lengths[0]),
        "S_k": np.asarray(s_k if lengths is None else lengths[1]),
    }


def dense_mask(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict) -> np.ndarray:
    """The visibility of every cell, bool [B, H_q, S_q, S_k]."""
    resources.require(f"the dense mask ({batch * program.heads_q * s_q * s_k:,} cells)",
                      resources.dense_bytes(batch * program.heads_q * s_q * s_k, 17))
    env = positions(batch, program.heads_q, s_q, s_k)
    m = evaluate(program.mask, env, tensors)
    return np.broadcast_to(m, (batch, program.heads_q, s_q, s_k))


def reference(program: ir.Program, q, k, v, tensors: dict | None = None, *, q_offset: int | None = None,
              k_offset: int = 0, lengths: tuple[int, int] | None = None, wide: bool = False,
              sink: bool = True):
    """Float64 attention: returns (O [B,H_q,S_q,d_v], LSE [B,H_q,S_q]).

    q [B,H_q,S_q,d_qk], k [B,H_kv,S_k,d_qk], v [B,H_kv,S_k,d_v] (bhsd).  ``q_offset``/``k_offset``:
    a block of a larger call, rows and keys at those positions (:func:`positions`), the
    tensors and ``lengths`` (S_q, S_k) the whole call's.  ``wide``: the score program in float64 instead of the language's
    f32 (the backward reference's finite-difference checks).  ``sink=False``: without the spec's
    sink (``sink = ...``, compiler/sinks.py): a partial state that a merge completes once."""
    q = np.asarray(q)
    batch, _, s_q, _ = q.shape
    s_k = np.asarray(k).shape[2]
    check_values(v)
    env = positions(batch, program.heads_q, s_q, s_k, q_offset, k_offset, lengths)
    o, lse = _attend(program, q, k, v, env, tensors or {}, wide, sink)
    check_rows(lse, s_q=s_q, s_k=s_k, sink=sink and program.sink is not None)
    return o, lse


def reference_request(program: ir.Program, b: int, q, k, v, tensors: dict | None = None):
    """Float64 attention of request ``b`` of a batch: ``q [C, H_q, d_qk]`` are its query rows,
    ``k [T, H_kv, d_qk]`` and ``v [T, H_kv, d_v]`` its logical K/V rows (``T >= C``), ``tensors``
    the batch's (``b`` indexes them).  Row i is at position ``T - C + i``.  Returns
    ``(O [C, H_q, d_v], LSE [C, H_q])``."""
    o, lse = _request(program, b, q, k, v, tensors)
    if program.sink is not None:
        o, lse = sinks.join(o, lse, sinks.values(program, b + 1, tensors or {})[b].astype(np.float64))
    check_rows(lse, qo_indptr=np.array([0, lse.shape[0]]), kv_lens=np.array([np.asarray(k).shape[0]]),
               sink=program.sink is not None)
    return o, lse


def _request(program: ir.Program, b: int, q, k, v, tensors: dict | None):
    q, k, v = (np.asarray(x).transpose(1, 0, 2)[None] for x in (q, k, v))
    env = positions(1, program.heads_q, q.shape[2], k.shape[2])
    env["b"] = np.full((1, 1, 1, 1), b)
    o, lse = _attend(program, q, k, v, env, tensors or {}, sink=False)
    return o[0].transpose(1, 0, 2), lse[0].T


def reference_cache(program: ir.Program, call):
    """Float64 attention of a validated split call (compiler.inputs.CacheCall), request by
    request on its gathered logical K/V: ``(O [total_q, H_q, d_v], LSE [total_q, H_q])``.  The
    rows of a request with no keys see nothing: the all-masked policy (O = 0, LSE = -inf, or the
    sink where the spec has one)."""
    require_rectangle(program, program.heads_q * int((call.q_lens * call.kv_lens).sum()))
    o = np.zeros((call.q.shape[0], program.heads_q, program.d_v))
    lse = np.full((call.q.shape[0], program.heads_q), -np.inf)
    for b in range(call.batch):
        rows = slice(call.qo_indptr[b], call.qo_indptr[b + 1])
        if rows.stop > rows.start and call.kv_lens[b] > 0:
            k, v = call.kv(b)
            o[rows], lse[rows] = _request(program, b, call.q_rows(b), k, v, call.tensors)
    if program.sink is not None:  # once per row, after its keys: rows of an empty request get O = 0, LSE = sink
        request = np.searchsorted(call.qo_indptr, np.arange(call.q.shape[0]), side="right") - 1
        o, lse = sinks.join(o, lse, sinks.values(program, call.batch, call.tensors)[request].astype(np.float64))
    check_rows(lse, qo_indptr=call.qo_indptr, kv_lens=call.kv_lens, sink=program.sink is not None)
    return o, lse


ORACLE_BYTES_PER_CELL = 48  # float64 scores, probabilities and their temporaries, the visibility


def require_rectangle(program: ir.Program, cells: int) -> None:
    """Refuse an oracle evaluation over ``cells`` score cells that exceeds the memory limit
    (callers that would run a kernel first check before it)."""
    resources.require(f"the float64 oracle of '{program.name}' ({cells:,} score cells)",
                      resources.dense_bytes(cells, ORACLE_BYTES_PER_CELL))


def _attend(program: ir.Program, q, k, v, env: dict, tensors: dict, wide: bool = False, sink: bool = True):
    require_rectangle(program, np.shape(q)[0] * program.heads_q * np.shape(q)[2] * np.shape(k)[2])
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kv_head = np.arange(program.heads_q) // program.group
    k, v = k[:, kv_head], v[:, kv_head]  # GQA: query head h reads K/V head h // G
    values, visible = _score_values(program, q, k, env, tensors, wide)
    o, lse = _softmax(values[-1], visible, v)
    if sink and program.sink is not None:
        o, lse = sinks.join(o, lse, sinks.at(program, env, tensors, wide=wide))
    return o, lse


def _score_values(program: ir.Program, q, k, env: dict, tensors: dict, wide: bool = False):
    """``([s_0, ..., s_n], visible)`` over the score rectangle: s_0 = scale * q.k and the value
    of each score statement (a non-finite final score at a visible cell marks its row: _softmax).
    ``k`` is already expanded to the query heads."""
    scores = np.einsum("bhid,bhjd->bhij", q, k) * program.scale
    values = [scores]
    for stmt in program.score:  # the score program in the language's f32, from the float64 q.k
        values.append(np.asarray(np.broadcast_to(evaluate(stmt, {**env, "score": values[-1]}, tensors, wide=wide),
                                                 scores.shape), np.float64))
    visible = np.broadcast_to(evaluate(program.mask, env, tensors), scores.shape)
    return values, visible


def _softmax(scores, visible, v):
    # a visible score of -inf drops its cell; NaN or +inf marks the row (LSE NaN), reported by
    # the caller with numerics.check_rows as on every backend
    bad = (visible & (np.isnan(scores) | (scores == np.inf))).any(axis=-1)
    scores = np.where(visible & ~bad[..., None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    valid = np.isfinite(m)
    p = np.exp(scores - np.where(valid, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    o = np.where(valid, (p @ v) / np.where(valid, l, 1.0), 0.0)
    lse = np.where(valid, m + np.log(np.where(valid, l, 1.0)), -np.inf)[..., 0]
    return np.where(bad[..., None], np.nan, o), np.where(bad, np.nan, lse)


def reference_backward(program: ir.Program, q, k, v, do, tensors: dict | None = None, *, o=None, lse=None,
                       dlse=None, q_offset: int | None = None, k_offset: int = 0,
                       lengths: tuple[int, int] | None = None, sink: bool = True):
    """Float64 gradients of attention for the incoming ``do [B,H_q,S_q,d_v]`` (bhsd, like
    :func:`reference`): returns ``(dq, dk, dv, dtensors)`` with ``dtensors`` mapping each f32
    tensor the score program reads to its gradient (its own shape; a tensor element read by
    many cells sums them).  The score program's derivatives are
    :func:`compiler.autodiff.score_grad`'s expressions evaluated by the IR interpreter (the
    numpy backend prints the same expressions: the two check each other).  P comes from the
    forward's LSE: ``P = exp(s_n - LSE)`` on visible cells, zero on rows with no visible key.

    ``dlse`` (bhs) is the gradient of LSE (it enters as D - dLSE).  A block of a larger call
    (context parallelism): ``q_offset``, ``k_offset`` and ``lengths`` as in :func:`reference`,
    and ``o``, ``lse`` the rows' final O and LSE over the whole call's keys (not the block's):
    the gradients are then the block's share, and the shares of every block add up to the
    call's (dK, dV of the block's keys, summed over each K/V head's query group).

    A spec with a sink: ``o`` and ``lse`` include it, and ``dtensors`` includes the gradients of
    the f32 tensors the sink reads (``compiler/sinks.py``: dL/dsink = sum over rows of
    p_sink (dLSE - rowsum(dO * O))); ``sink=False`` leaves that term out (the blocks of a
    context-parallel call but one)."""
    grad = score_grad(program)
    tensors = tensors or {}
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    batch, _, s_q, _ = q.shape
    env = positions(batch, program.heads_q, s_q, k.shape[2], q_offset, k_offset, lengths)
    kv_head = np.arange(program.heads_q) // program.group
    kx, vx = k[:, kv_head], v[:, kv_head]
    values, visible = _score_values(program, q, kx, env, tensors, wide=True)
    sink_at = sinks.at(program, env, tensors, wide=True) if program.sink is not None else None
    if o is None or lse is None:
        o, lse = _softmax(values[-1], visible, vx)
        if sink_at is not None:
            o, lse = sinks.join(o, lse, sink_at)
        check_rows(lse, s_q=s_q, s_k=k.shape[2], sink=program.sink is not None)
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    row = lse[..., None]  # -inf on rows with no visible key, and those rows have no visible cell
    p = np.exp(np.where(visible, values[-1] - np.where(np.isfinite(row), row, 0.0), -np.inf))
    delta = (do * o).sum(axis=-1, keepdims=True)
    if dlse is not None:
        delta = delta - np.where(np.isfinite(row), np.asarray(dlse, np.float64)[..., None], 0.0)
    ds = p * (do @ vx.swapaxes(-1, -2) - delta)
    dtensors = {n: np.zeros(np.shape(tensors[n])) for n in grad.tensors}
    shape = ds.shape
    for i in reversed(range(len(grad.forward))):
        at = {**env, "score": values[i]}
        for _, read, d in (x for x in grad.dloads if x[0] == i):
            index = tuple(np.broadcast_to(evaluate(x, env, tensors, wide=True), shape) for x in read.index)
            np.add.at(dtensors[read.tensor], index, ds * _derivative(d, at, tensors, visible, i, ir.format_expr(read)))
        ds = ds * _derivative(grad.dscore[i], at, tensors, visible, i, "score")
    if sink_at is not None and sink:
        dsink = sinks.row_gradient(o, lse, do, dlse, sink_at).sum(axis=-1)
        dsink = np.broadcast_to(dsink, (batch, program.heads_q))
        for name, g in sinks.tensor_gradients(program, dsink, tensors).items():
            dtensors[name] = dtensors.get(name, 0.0) + g
    dq = program.scale * ds @ kx
    group = (batch, program.heads_kv, program.group)
    dk = (program.scale * ds.swapaxes(-1, -2) @ q).reshape(*group, *k.shape[2:]).sum(axis=2)
    dv = (p.swapaxes(-1, -2) @ do).reshape(*group, *v.shape[2:]).sum(axis=2)
    return dq, dk, dv, dtensors


def _derivative(expr: ir.Expr, env: dict, tensors: dict, visible, statement: int, wrt: str):
    """A score derivative over the rectangle: finite where visible (else a PlanError naming the
    cell), zero where hidden."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        value = np.broadcast_to(evaluate(expr, env, tensors, wide=True), visible.shape).astype(np.float64)
    bad = visible & ~np.isfinite(value)
    if bad.any():
        idx = tuple(int(x[0]) for x in np.nonzero(bad))
        b, q_pos = (int(np.broadcast_to(env[n], visible.shape)[idx]) for n in ("b", "q"))
        raise PlanError(f"the derivative of score statement {statement + 1} with respect to {wrt} is "
                        f"{value[idx]} at visible cell (b={b}, h={idx[1]}, q={q_pos}, k={idx[3]})")
    return np.where(visible, value, 0.0)
