"""The split-state algebra of M4.5 §0x02, executable.

A split summarizes the allowed (unmasked) scores of a disjoint K/V range as
``State(valid, m, l, u)``; :func:`merge_state` combines two states exactly,
branching on validity *before* any exponential so that empty splits (ragged
tails, fully masked ranges, over-partitioned rows) are the identity instead of
``exp(-inf - -inf) = NaN``.  ``(LSE, O)`` is the equivalent normalized ABI
(§0x02F).  Every function takes an optional ``dtype`` so the same code runs as
the float64 oracle and as a round-after-each-operation float16 model
(§0x02H): numpy rounds each scalar operation to the operands' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class State:
    """Canonical summary of an allowed set: (valid, m, l, u) with u unnormalized."""

    valid: bool
    m: np.floating
    l: np.floating  # noqa: E741 - the article's name
    u: np.ndarray


@dataclass(frozen=True)
class OutputState:
    """The normalized partial ABI: (valid, LSE, O)."""

    valid: bool
    lse: np.floating
    o: np.ndarray


def empty_state(d: int, dtype=np.float64) -> State:
    """The identity e = (false, -inf, 0, 0)."""
    return State(False, dtype(-np.inf), dtype(0), np.zeros(d, dtype))


def summarize(scores: Sequence[float | None], values, dtype=np.float64) -> State:
    """Summarize one split; ``None`` scores are masked positions (their values are never read)."""
    values = np.asarray(values, dtype)
    if values.ndim == 1:
        values = values[:, None]
    d = values.shape[1]
    allowed = [i for i, s in enumerate(scores) if s is not None]
    if not allowed:
        return empty_state(d, dtype)
    s = np.asarray([scores[i] for i in allowed], dtype)
    m = s.max()
    p = np.exp(s - m)
    u = np.zeros(d, dtype)
    l = dtype(0)  # noqa: E741
    for w, i in zip(p, allowed):  # element by element, so a float16 model rounds like a kernel loop
        l = dtype(l + w)
        u = (u + w * values[i]).astype(dtype)
    return State(True, dtype(m), l, u)


def merge_state(a: State, b: State) -> State:
    """(valid, m, l, u) ⊕ (valid, m, l, u), M4.5 §0x02B–C."""
    if not a.valid:
        return b
    if not b.valid:
        return a
    dtype = type(a.m)
    m = max(a.m, b.m)
    alpha = dtype(np.exp(dtype(a.m - m)))
    beta = dtype(np.exp(dtype(b.m - m)))
    l = dtype(dtype(alpha * a.l) + dtype(beta * b.l))  # noqa: E741
    u = ((alpha * a.u).astype(dtype) + (beta * b.u).astype(dtype)).astype(dtype)
    return State(True, m, l, u)


def finalize(s: State) -> tuple[np.ndarray, np.floating]:
    """(O, LSE); the all-masked policy gives O = 0, LSE = -inf."""
    dtype = type(s.m)
    if not s.valid:
        return np.zeros_like(s.u), dtype(-np.inf)
    return (s.u / s.l).astype(dtype), dtype(s.m + np.log(s.l))


def to_output_state(s: State) -> OutputState:
    o, lse = finalize(s)
    return OutputState(s.valid, lse, o)


def merge_output_state(a: OutputState, b: OutputState) -> OutputState:
    """(LSE, O) ⊕ (LSE, O), M4.5 §0x02F: weights exp(LSE_x - LSE), never an average.

    One row (scalar ``valid`` and ``lse``, ``o [d]``) or many at once (``valid``/``lse`` of any
    shape, ``o`` with one more axis of d): validity decides first, so rows invalid on one side
    take the other side as it is and only rows valid on both reach the exponentials."""
    va, vb = np.asarray(a.valid, bool), np.asarray(b.valid, bool)
    both = va & vb
    la, lb = np.asarray(a.lse), np.asarray(b.lse)
    dtype = la.dtype.type
    sa, sb = np.where(both, la, 0), np.where(both, lb, 0)  # finite stand-ins off the merged rows
    p = np.maximum(sa, sb)
    lse = p + np.log(np.exp(sa - p) + np.exp(sb - p))
    o = np.exp(sa - lse)[..., None] * a.o + np.exp(sb - lse)[..., None] * b.o
    lse = np.where(both, lse, np.where(va, la, lb)).astype(dtype)
    o = np.where(both[..., None], o, np.where(va[..., None], a.o, b.o)).astype(dtype)
    if va.ndim == 0:
        return OutputState(bool(va | vb), dtype(lse), o)
    return OutputState(va | vb, lse, o)


def reduce_sequential(states: Iterable[State]) -> State:
    return reduce(merge_state, states)


def reduce_balanced(states: Sequence[State]) -> State:
    """Pairwise tree: ((s0 ⊕ s1) ⊕ (s2 ⊕ s3)) ⊕ ..."""
    states = list(states)
    while len(states) > 1:
        states = [merge_state(*states[i:i + 2]) if i + 1 < len(states) else states[i]
                  for i in range(0, len(states), 2)]
    return states[0]


def dense_attention_row(scores: Sequence[float | None], values) -> tuple[np.ndarray, float]:
    """Unsplit float64 reference for one query row: (O, LSE)."""
    return finalize(summarize(scores, values))
