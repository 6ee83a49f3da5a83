"""The float64 dense oracle: the definition every backend is tested against (the compiler's
reference, not a backend: tuning, `attnc run --check` and the tests all read it).

It evaluates the IR mask and score program over the whole
``[B, H_q, S_q, S_k]`` score rectangle with an IR interpreter of its own (not
the code generator's printer, so the two check each other), with
bottom-right positions ``q = S_k - S_q + i`` (M4.5 §0x08B) and the all-masked
policy ``O = 0, LSE = -inf`` (§0x02C).  Inputs are logical ``bhsd`` arrays.
"""
from __future__ import annotations

import numpy as np

from attnc.compiler import ir
from attnc.compiler.errors import PlanError
from attnc.compiler.interp import evaluate, load  # noqa: F401 (load: re-exported)
from attnc.compiler.numerics import check_rows
from attnc.compiler.ranges import check_length

def positions(batch: int, heads: int, s_q: int, s_k: int) -> dict[str, np.ndarray]:
    """Broadcastable b, h, q, k grids over [B, H_q, S_q, S_k] with bottom-right q, and the
    call's lengths S_q, S_k."""
    check_length(s_k)
    if s_q > s_k:
        raise PlanError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys; every query row is a "
                        "token whose own key is in the cache (bottom-right alignment)")
    return {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(heads).reshape(1, -1, 1, 1),
        "q": (s_k - s_q + np.arange(s_q)).reshape(1, 1, -1, 1),
        "k": np.arange(s_k).reshape(1, 1, 1, -1),
        "S_q": np.asarray(s_q), "S_k": np.asarray(s_k),
    }


def dense_mask(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict) -> np.ndarray:
    """The visibility of every cell, bool [B, H_q, S_q, S_k]."""
    env = positions(batch, program.heads_q, s_q, s_k)
    m = evaluate(program.mask, env, tensors)
    return np.broadcast_to(m, (batch, program.heads_q, s_q, s_k))


def reference(program: ir.Program, q, k, v, tensors: dict | None = None):
    """Float64 attention: returns (O [B,H_q,S_q,d_v], LSE [B,H_q,S_q]).

    q [B,H_q,S_q,d_qk], k [B,H_kv,S_k,d_qk], v [B,H_kv,S_k,d_v] (bhsd)."""
    q = np.asarray(q)
    batch, _, s_q, _ = q.shape
    s_k = np.asarray(k).shape[2]
    o, lse = _attend(program, q, k, v, positions(batch, program.heads_q, s_q, s_k), tensors or {})
    check_rows(lse, s_q=s_q, s_k=s_k)
    return o, lse


def reference_request(program: ir.Program, b: int, q, k, v, tensors: dict | None = None):
    """Float64 attention of request ``b`` of a batch: ``q [C, H_q, d_qk]`` are its query rows,
    ``k [T, H_kv, d_qk]`` and ``v [T, H_kv, d_v]`` its logical K/V rows (``T >= C``), ``tensors``
    the batch's (``b`` indexes them).  Row i is at position ``T - C + i``.  Returns
    ``(O [C, H_q, d_v], LSE [C, H_q])``."""
    o, lse = _request(program, b, q, k, v, tensors)
    check_rows(lse, qo_indptr=np.array([0, lse.shape[0]]), kv_lens=np.array([np.asarray(k).shape[0]]))
    return o, lse


def _request(program: ir.Program, b: int, q, k, v, tensors: dict | None):
    q, k, v = (np.asarray(x).transpose(1, 0, 2)[None] for x in (q, k, v))
    env = positions(1, program.heads_q, q.shape[2], k.shape[2])
    env["b"] = np.full((1, 1, 1, 1), b)
    o, lse = _attend(program, q, k, v, env, tensors or {})
    return o[0].transpose(1, 0, 2), lse[0].T


def reference_cache(program: ir.Program, call):
    """Float64 attention of a validated split call (compiler.inputs.CacheCall), request by
    request on its gathered logical K/V: ``(O [total_q, H_q, d_v], LSE [total_q, H_q])``."""
    o = np.zeros((call.q.shape[0], program.heads_q, program.d_v))
    lse = np.full((call.q.shape[0], program.heads_q), -np.inf)
    for b in range(call.batch):
        rows = slice(call.qo_indptr[b], call.qo_indptr[b + 1])
        if rows.stop > rows.start:
            k, v = call.kv(b)
            o[rows], lse[rows] = _request(program, b, call.q_rows(b), k, v, call.tensors)
    check_rows(lse, qo_indptr=call.qo_indptr, kv_lens=call.kv_lens)
    return o, lse


def _attend(program: ir.Program, q, k, v, env: dict, tensors: dict):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kv_head = np.arange(program.heads_q) // program.group
    k, v = k[:, kv_head], v[:, kv_head]  # GQA: query head h reads K/V head h // G
    scores = np.einsum("bhid,bhjd->bhij", q, k) * program.scale
    for stmt in program.score:  # the score program in the language's f32, from the float64 q.k
        scores = np.broadcast_to(evaluate(stmt, {**env, "score": scores}, tensors), scores.shape)
    scores = np.asarray(scores, np.float64)
    visible = np.broadcast_to(evaluate(program.mask, env, tensors), scores.shape)
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
