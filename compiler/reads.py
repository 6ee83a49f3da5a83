"""Tensor reads in range: the one check, before any kernel runs, that a call's mask and score
program read their tensors only inside them (issue 35).

The oracle and the numpy backend raise a PlanError at an out-of-range read where its value is
used (``compiler.interp.load``'s ``care``: the taken branch of ``where``, the deciding side of
``&`` and ``|``); a kernel cannot raise in place, so plans (``compiler.plan``) check first:

1. **Ranges.**  Every subscript's interval over the call (``compiler.ranges.IntRanges`` with
   the call's q, k, b, h, S_q, S_k and the i32 tensors' actual values): inside the axis, the
   read is safe.  This is the common case and costs a walk of the expressions.
2. **Evaluation.**  Otherwise the reads that may leave their tensor are evaluated on the host
   over the call's positions (vectorized, only the axes their expressions use), with the
   oracle's order and guards, so the error is the oracle's: the first score statement, then
   the mask; request by request for split calls.  A guard that reads ``score`` is not
   evaluated (the scores are not known before the kernel): both of its branches count, so such
   a read is refused where it may leave its tensor.
"""
from __future__ import annotations

import numpy as np

from . import ir, resources
from .errors import PlanError
from .interp import evaluate
from .ranges import IntRanges, Range

# bytes per evaluated cell: an int64 subscript, the guards' bools, temporaries
CHECK_BYTES_PER_CELL = 40


class _CallRanges(IntRanges):
    """IntRanges over one call: its variables' ranges, i32 tensors holding their actual values."""

    def __init__(self, heads_q: int, variables: dict[str, Range], tensors: dict):
        super().__init__(heads_q)
        self.variables, self.tensors = variables, tensors
        self._values: dict[str, Range] = {}  # tensor -> (min, max), one pass over each

    def _compute(self, e: ir.Expr) -> Range:
        if isinstance(e, ir.Var) and e.name in self.variables:
            return self.variables[e.name]
        if isinstance(e, ir.Load) and e.tensor in self.tensors and e.type.integer:
            if e.tensor not in self._values:
                a = np.asarray(self.tensors[e.tensor])
                self._values[e.tensor] = (int(a.min()), int(a.max())) if a.size else (0, 0)
            return self._values[e.tensor]
        return super()._compute(e)


def _suspects(program: ir.Program, tensors: dict, variables: dict[str, Range]) -> set[int]:
    """The reads (by node identity) whose subscripts' ranges may leave their tensor."""
    ranges = _CallRanges(program.heads_q, variables, tensors)
    out = set()
    for e in (*program.score, program.mask):
        for n in ir.walk(e):
            if isinstance(n, ir.Load) and n.tensor in tensors:
                shape = np.shape(tensors[n.tensor])
                if any(lo < 0 or hi >= size for (lo, hi), size in zip(map(ranges, n.index), shape)):
                    out.add(id(n))
    return out


def index_reads_tensor(program: ir.Program) -> bool:
    """Whether some subscript reads a tensor (then the check depends on the tensors' values, not
    only on the call's shape)."""
    return any(isinstance(n, ir.Load) and any(ir.loads(i) for i in n.index)
               for e in (*program.score, program.mask) for n in ir.walk(e))


def check_prefill(program: ir.Program, tensors: dict, batch: int, s_q: int, s_k: int) -> None:
    """Refuse a contiguous call (B x S_q rows over S_k keys, bottom-right) that reads a tensor out
    of range where the read's value is used: the oracle's PlanError."""
    if not (batch and s_q and s_k) or not tensors:
        return
    variables = {"q": (s_k - s_q, s_k - 1), "k": (0, s_k - 1), "b": (0, batch - 1),
                 "h": (0, program.heads_q - 1), "S_q": (s_q, s_q), "S_k": (s_k, s_k)}
    suspects = _suspects(program, tensors, variables)
    if suspects:
        _evaluate(program, tensors, suspects, {"b": batch, "h": program.heads_q, "q": s_q, "k": s_k},
                  [_env(np.arange(batch), program.heads_q, s_q, s_k)])


def check_requests(program: ir.Program, tensors: dict, kv_lens, q_lens=None) -> None:
    """:func:`check_prefill` for a split call: request b's ``q_lens[b]`` rows (default one) are
    the last of its ``kv_lens[b]`` keys; requests with no rows or no keys read nothing."""
    kv = np.asarray(kv_lens, np.int64)
    ql = np.ones_like(kv) if q_lens is None else np.asarray(q_lens, np.int64)
    live = np.flatnonzero((kv > 0) & (ql > 0))
    if not live.size or not tensors:
        return
    kl, qs = kv[live], ql[live]
    variables = {"q": (int((kl - qs).min()), int(kl.max()) - 1), "k": (0, int(kl.max()) - 1),
                 "b": (int(live.min()), int(live.max())), "h": (0, program.heads_q - 1),
                 "S_q": (int(qs.min()), int(qs.max())), "S_k": (int(kl.min()), int(kl.max()))}
    suspects = _suspects(program, tensors, variables)
    if suspects:
        _evaluate(program, tensors, suspects, {"b": 1, "h": program.heads_q, "q": int(qs.max()), "k": int(kl.max())},
                  (_env(np.array([b]), program.heads_q, int(ql[b]), int(kv[b])) for b in live))


def _env(b: np.ndarray, heads: int, s_q: int, s_k: int) -> dict[str, np.ndarray]:
    """The oracle's positions (compiler.oracle.positions) of requests ``b``."""
    return {"b": b.reshape(-1, 1, 1, 1), "h": np.arange(heads).reshape(1, -1, 1, 1),
            "q": (s_k - s_q + np.arange(s_q)).reshape(1, 1, -1, 1), "k": np.arange(s_k).reshape(1, 1, 1, -1),
            "S_q": np.asarray(s_q), "S_k": np.asarray(s_k)}


def _evaluate(program: ir.Program, tensors: dict, suspects: set[int], sizes: dict[str, int], envs) -> None:
    used = set().union(*(ir.free_vars(e) for e in (*program.score, program.mask)))
    cells = int(np.prod([sizes[v] for v in used if v in sizes], dtype=np.float64))
    resources.require(f"the check of '{program.name}''s tensor reads ({cells:,} cells)",
                      resources.dense_bytes(cells, CHECK_BYTES_PER_CELL))
    holds: dict[int, bool] = {}

    def has(e: ir.Expr) -> bool:
        hit = holds.get(id(e))
        if hit is None:
            hit = holds[id(e)] = id(e) in suspects or any(has(c) for c in ir.children(e))
        return hit

    # The oracle evaluates each read over the whole call in turn and raises the first read (in
    # evaluation order) that leaves its tensor anywhere, naming its first such cell.  The envs (a
    # split call's requests, in order) are walked one by one, so each read keeps the error of the
    # first env where it has one, and the read first in evaluation order is raised at the end.
    errors: dict[int, tuple[int, PlanError]] = {}  # id(read) -> (its evaluation order, first error)
    order: dict[int, int] = {}
    for env in envs:
        for e in (*program.score, program.mask):
            if has(e):
                _walk(e, env, tensors, None, has, suspects, _Found(errors, order))
    if errors:
        raise min(errors.values(), key=lambda hit: hit[0])[1]


class _Found:
    """The out-of-range reads the walks find (``errors``, shared by the envs) in evaluation order."""

    def __init__(self, errors: dict, order: dict):
        self.errors, self.order = errors, order

    def read(self, e: ir.Load, run) -> bool:
        """Run ``run()`` (the read's evaluation); record its PlanError: whether it succeeded."""
        position = self.order.setdefault(id(e), len(self.order))
        try:
            run()
            return True
        except PlanError as err:
            self.errors.setdefault(id(e), (position, err))
            return False


def _narrow(care, where):
    return where if care is None else care & where


def _walk(e: ir.Expr, env: dict, tensors: dict, care, has, suspects: set[int], found: _Found) -> bool:
    """Evaluate the suspect reads under ``e`` where their values are used (interp.evaluate's
    guards), recording each out-of-range one (``found``): whether none failed."""
    if not has(e):
        return True
    if isinstance(e, ir.Load) and id(e) in suspects:
        ok = all([_walk(c, env, tensors, care, has, suspects, found) for c in ir.children(e)])  # (subscripts first)
        return ok and found.read(e, lambda: evaluate(e, env, tensors, care))
    guard = e.cond if isinstance(e, ir.Select) else e.left if isinstance(e, ir.Binary) and e.op in ("and", "or") \
        else None
    if guard is None:
        return all([_walk(c, env, tensors, care, has, suspects, found) for c in ir.children(e)])
    if not _walk(guard, env, tensors, care, has, suspects, found):
        return False  # (the guard's read failed: what it guards comes later in evaluation order)
    value = None if "score" in ir.free_vars(guard) else np.asarray(evaluate(guard, env, tensors, care), bool)
    if isinstance(e, ir.Select):
        return all([_walk(branch, env, tensors, care if value is None else _narrow(care, value if taken else ~value),
                          has, suspects, found) for branch, taken in ((e.if_true, True), (e.if_false, False))])
    return _walk(e.right, env, tensors, care if value is None else _narrow(care, value if e.op == "and" else ~value),
                 has, suspects, found)
