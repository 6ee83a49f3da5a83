"""The float64 dense oracle: the definition every backend is tested against.

It evaluates the IR mask and score program over the whole
``[B, H_q, S_q, S_k]`` score rectangle with an IR interpreter of its own (not
the code generator's printer, so the two check each other), with
bottom-right positions ``q = S_k - S_q + i`` (M4.5 §0x08B) and the all-masked
policy ``O = 0, LSE = -inf`` (§0x02C).  Inputs are logical ``bhsd`` arrays.
"""
from __future__ import annotations

import numpy as np

from compiler import ir
from compiler.errors import PlanError
from compiler.interp import evaluate, load  # noqa: F401 (load: re-exported)

def positions(batch: int, heads: int, s_q: int, s_k: int) -> dict[str, np.ndarray]:
    """Broadcastable b, h, q, k grids over [B, H_q, S_q, S_k] with bottom-right q."""
    if s_q > s_k:
        raise PlanError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys; every query row is a "
                        "token whose own key is in the cache (bottom-right alignment)")
    return {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(heads).reshape(1, -1, 1, 1),
        "q": (s_k - s_q + np.arange(s_q)).reshape(1, 1, -1, 1),
        "k": np.arange(s_k).reshape(1, 1, 1, -1),
    }


def dense_mask(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict) -> np.ndarray:
    """The visibility of every cell, bool [B, H_q, S_q, S_k]."""
    env = positions(batch, program.heads_q, s_q, s_k)
    m = evaluate(program.mask, env, tensors)
    return np.broadcast_to(m, (batch, program.heads_q, s_q, s_k))


def reference(program: ir.Program, q, k, v, tensors: dict | None = None):
    """Float64 attention: returns (O [B,H_q,S_q,d_v], LSE [B,H_q,S_q]).

    q [B,H_q,S_q,d_qk], k [B,H_kv,S_k,d_qk], v [B,H_kv,S_k,d_v] (bhsd)."""
    tensors = tensors or {}
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, _, s_q, _ = q.shape
    s_k = k.shape[2]
    kv_head = np.arange(program.heads_q) // program.group
    k, v = k[:, kv_head], v[:, kv_head]  # GQA: query head h reads K/V head h // G
    scores = np.einsum("bhid,bhjd->bhij", q, k) * program.scale
    env = positions(batch, program.heads_q, s_q, s_k)
    for stmt in program.score:
        scores = np.broadcast_to(evaluate(stmt, {**env, "score": scores}, tensors), scores.shape)
    visible = dense_mask(program, batch, s_q, s_k, tensors)
    bad = visible & ~np.isfinite(scores)
    if bad.any():
        b, h, i, j = (int(x[0]) for x in np.nonzero(bad))
        raise PlanError(f"the score program produced {scores[b, h, i, j]} at visible cell "
                        f"(b={b}, h={h}, q={s_k - s_q + i}, k={j})")
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    valid = np.isfinite(m)
    p = np.exp(scores - np.where(valid, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    o = np.where(valid, (p @ v) / np.where(valid, l, 1.0), 0.0)
    lse = np.where(valid, m + np.log(np.where(valid, l, 1.0)), -np.inf)[..., 0]
    return o, lse
