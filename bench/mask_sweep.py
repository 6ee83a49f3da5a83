"""The mask-family sweep (issue 34): masks composed at random from the language's atoms, each
checked for correctness, then timed through the public call against FlexAttention.

Every mask is one random structure (:class:`Node`) written two ways from the same tree: the
``.attn`` expression attnc compiles and a FlexAttention ``mask_mod`` (torch ops on absolute
positions), so the two cannot drift apart; :func:`check_translation` compares the mask_mod with
the compiler's dense oracle mask cell by cell, and :func:`check_mask` runs the public call
(numpy backend on the CPU) against the float64 oracle at a small shape.

Atoms (``ATOMS``): causal (bottom-right ``k <= q`` and top-left ``k <= q - (S_k - S_q)``), sliding
windows, bidirectional bands, prefixes (prefix-LM columns) and sinks ``k < c``, global rows
``q < c``, chunks ``q // c == k // c``, periodic rows and columns ``q % p < c``, dilations
``(q - k) % d == 0``, bitwise patterns ``(q & k & m) == 0``, ``(q & m) == (k & m)``, documents
``doc[b, q] == doc[b, k]``; combined with ``&``, ``|`` and ``!``.  Sizes are drawn for S = 8192
and scaled to the length (``rescale``), so a seed gives the same structures at a tiny shape (the
CPU check) and at the bench shape.

On the GPU (``python3 -m bench.mask_sweep``): for each mask, the correctness check at a small
shape on the CPU first, then B=4 H=16 S=8192 d=128 bf16 (options for smaller) timed in one
process: ``attnc.compile(spec)(q, k, v, **tensors)``, Flex (Triton) ``flex_attention`` compiled,
with ``create_block_mask`` of the mask_mod, and Flex ``kernel_options={"BACKEND": "FLASH"}``
(a row with its error where it raises: it needs flash-attn-4).  Raw rows (samples included) and
one summary row (min / median / max of each ratio, the bottom masks) are JSON lines under
``bench/results/studies/`` with the command in each.

Nearly all of a mask's wall time on the GPU is compilation (attnc's first call: Triton/Gluon JIT
of a kernel whose source inlines the mask; Flex: ``torch.compile`` per mask_mod).
``--warm-workers N`` first runs N worker processes (``bench/mask_sweep_warm.py``) over disjoint
slices of the masks (:func:`slices`) that do that compiling work and nothing else, into the
on-disk caches every process of the user shares (Triton's, pinned by :func:`shared_caches`, and
inductor's FX graph and AOTAutograd caches); when they are done the timing runs as before, one
mask after another in this process, its first calls loading kernels from disk (a row says
``warmed``; ``first_call_ms`` shows the hit).  A worker's failure costs only its warm-up: the
timing compiles what is not cached and records errors per mask as it always did.
``--time-budget SECONDS`` stops starting masks (checks, with ``--check-only``) once the run has
taken that long since :func:`main` began (the warm-up included; the interpreter's start-up is
not); the summary covers what was timed and the last line names the ``--start`` that resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BASE_S = 8192  # the sizes below are for this length; scale() shrinks them with S


@dataclass(frozen=True)
class Node:
    """One node of a mask: an atom (``kind`` and its integer ``args``) or ``&``, ``|``, ``!``."""

    kind: str
    args: tuple = ()
    children: tuple = ()

    # -------------------------------------------------------------- the .attn expression
    def attn(self) -> str:
        k, a = self.kind, self.args
        if k == "and":
            return " & ".join(f"({c.attn()})" for c in self.children)
        if k == "or":
            return " | ".join(f"({c.attn()})" for c in self.children)
        if k == "not":
            return f"!({self.children[0].attn()})"
        return {
            "causal": lambda: "causal",
            "causal_top_left": lambda: "k <= q - (S_k - S_q)",
            "window": lambda: f"window({a[0]})",
            "band": lambda: f"abs(q - k) <= {a[0]}",
            "prefix": lambda: f"k < {a[0]}",
            "sink": lambda: f"k < {a[0]}",
            "global_rows": lambda: f"q < {a[0]}",
            "chunk": lambda: f"q // {a[0]} == k // {a[0]}",
            "periodic_rows": lambda: f"q % {a[0]} < {a[1]}",
            "periodic_cols": lambda: f"k % {a[0]} < {a[1]}",
            "dilation": lambda: f"(q - k) % {a[0]} == 0",
            "bitwise_and": lambda: f"(q & k & {a[0]}) == 0",
            "bitwise_eq": lambda: f"(q & {a[0]}) == (k & {a[0]})",
            "document": lambda: "doc[b, q] == doc[b, k]",
        }[k]()

    # -------------------------------------------------------------- FlexAttention's mask_mod
    def flex(self, b, q, k, doc, s_q: int, s_k: int):
        """The node's visibility as torch ops on absolute positions ``q``, ``k`` (any broadcastable
        tensors: a mask_mod's scalars or a dense plane)."""
        kind, a = self.kind, self.args
        if kind in ("and", "or"):
            out = self.children[0].flex(b, q, k, doc, s_q, s_k)
            for c in self.children[1:]:
                v = c.flex(b, q, k, doc, s_q, s_k)
                out = (out & v) if kind == "and" else (out | v)
            return out
        if kind == "not":
            return ~self.children[0].flex(b, q, k, doc, s_q, s_k)
        if kind == "causal":
            return k <= q
        if kind == "causal_top_left":
            return k <= q - (s_k - s_q)
        if kind == "window":
            return q - k < a[0]
        if kind == "band":
            return (q - k <= a[0]) & (k - q <= a[0])
        if kind in ("prefix", "sink"):
            return k < a[0]
        if kind == "global_rows":
            return q < a[0]
        if kind == "chunk":
            return q // a[0] == k // a[0]
        if kind == "periodic_rows":
            return q % a[0] < a[1]
        if kind == "periodic_cols":
            return k % a[0] < a[1]
        if kind == "dilation":
            return (q - k) % a[0] == 0
        if kind == "bitwise_and":
            return (q & k & a[0]) == 0
        if kind == "bitwise_eq":
            return (q & a[0]) == (k & a[0])
        if kind == "document":
            return doc[b, q] == doc[b, k]
        raise ValueError(kind)

    def reads_doc(self) -> bool:
        return self.kind == "document" or any(c.reads_doc() for c in self.children)

    def atoms(self) -> list[str]:
        return [self.kind] if not self.children else [a for c in self.children for a in c.atoms()]


def scale(x: int, s: int) -> int:
    """A size chosen for S = 8192, at length ``s`` (at least 1)."""
    return max(1, x * s // BASE_S)


def _pow2_at_most(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def atom(rng: random.Random, kind: str) -> Node:
    """One atom of ``kind`` with random sizes for S = 8192 (:func:`rescale` shrinks them)."""
    if kind in ("causal", "causal_top_left", "document"):
        return Node(kind)
    if kind == "window":
        return Node(kind, (rng.choice([128, 256, 512, 1024, 2048, 4096]),))
    if kind == "band":
        return Node(kind, (rng.choice([64, 256, 512, 1024]),))
    if kind == "prefix":
        return Node(kind, (rng.choice([512, 1024, 2048, 4096]),))
    if kind == "sink":
        return Node(kind, (rng.choice([4, 16, 64, 128]),))
    if kind == "global_rows":
        return Node(kind, (rng.choice([16, 64, 256]),))
    if kind == "chunk":
        return Node(kind, (rng.choice([128, 512, 1024, 2048]),))
    if kind in ("periodic_rows", "periodic_cols"):
        return Node(kind, (rng.choice([256, 512, 1024, 2048]), rng.choice([16, 32, 64, 128])))
    if kind == "dilation":
        return Node(kind, (rng.choice([2, 3, 4]),))
    if kind == "bitwise_and":  # one or two high bits: a Sierpinski-like pattern of blocks
        return Node(kind, (sum(1 << i for i in rng.sample(range(6, 13), rng.choice([1, 2]))),))
    if kind == "bitwise_eq":  # the same residue of a high bit: block-diagonal stripes
        return Node(kind, (1 << rng.randrange(8, 13),))
    raise ValueError(kind)


def rescale(node: Node, s: int) -> Node:
    """``node`` (sizes for S = 8192) at length ``s``: sizes scaled, bits moved down as many places,
    dilations kept."""
    if node.children:
        return Node(node.kind, node.args, tuple(rescale(c, s) for c in node.children))
    a = node.args
    if node.kind in ("periodic_rows", "periodic_cols"):
        p = scale(a[0], s)
        return Node(node.kind, (p, max(1, min(p, scale(a[1], s)))))
    if node.kind in ("bitwise_and", "bitwise_eq"):
        bits = [1 << i for i in range(a[0].bit_length()) if a[0] >> i & 1]
        return Node(node.kind, (sum({_pow2_at_most(scale(b, s)) for b in bits}),))
    if node.kind == "dilation" or not a:
        return node
    return Node(node.kind, tuple(scale(x, s) for x in a))


# a mask is a base (what most attention is built on) refined by one to three more atoms
BASES = ("causal", "causal", "causal_top_left", "window", "band", "chunk", "document", "prefix")
REFINE = ("window", "band", "prefix", "sink", "global_rows", "chunk", "periodic_rows", "periodic_cols",
          "dilation", "bitwise_and", "bitwise_eq", "document", "causal")
ATOMS = tuple(sorted(set(BASES) | set(REFINE)))


def random_mask(rng: random.Random) -> Node:
    """A base atom combined with one to three more: ``base & x``, ``base & (x | y)``, ``base | x``,
    ``base & !x`` ... (the shapes of real masks: sinks, global tokens, strided and periodic
    patterns on top of causal, windows, chunks or documents)."""
    base_kind = rng.choice(BASES)
    base = atom(rng, base_kind)
    kinds = rng.sample([x for x in REFINE if x != base_kind], rng.randint(1, 3))  # distinct atoms
    extra = [atom(rng, kind) for kind in kinds]
    shape = rng.random()
    if shape < 0.45:  # base & (x | y | ...): a window with sinks and global rows, ...
        inner = extra[0] if len(extra) == 1 else Node("or", children=tuple(extra))
        return Node("and", children=(base, inner))
    if shape < 0.65:  # base & x & y
        return Node("and", children=(base, *extra))
    if shape < 0.85:  # (base & x) | y: global rows/columns added to a restricted base
        if len(extra) == 1:
            return Node("or", children=(base, extra[0]))
        return Node("or", children=(Node("and", children=(base, extra[0])), *extra[1:]))
    return Node("and", children=(base, Node("not", children=(extra[0],)), *extra[1:2]))  # base & !x


def masks(count: int, seed: int, s: int = BASE_S) -> list[Node]:
    """``count`` distinct masks (by their .attn text at S = 8192) from ``seed``, at length ``s``:
    the same structures at every length."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < count:
        m = random_mask(rng)
        if m.attn() not in seen:
            seen.add(m.attn())
            out.append(m)
    return [rescale(m, s) for m in out]


def spec_text(node: Node, index: int, heads: int | None = None, head_dim: int | None = None) -> str:
    """A shape-generic spec (heads, head dims from the call) of the mask, bf16."""
    decl = "tensor doc: i32[b, s] ~ segments(256, 2048) " if node.reads_doc() else ""
    shape = f"heads = {heads} head_dim = {head_dim} " if heads else ""
    return f"attention sweep_{index} {{ {shape}dtype = bf16 {decl}mask = {node.attn()} }}"


def documents(rng: np.random.Generator, batch: int, s: int) -> np.ndarray:
    """Document ids int32 [batch, s]: contiguous runs of scaled lengths 256..2048."""
    lo, hi = scale(256, s), max(scale(2048, s), scale(256, s) + 1)
    out = np.empty((batch, s), np.int32)
    for row in out:
        lens = []
        while sum(lens) < s:
            lens.append(int(rng.integers(lo, hi + 1)))
        row[:] = np.repeat(np.arange(len(lens)), lens)[:s]
    return out


# ------------------------------------------------------------------ correctness (CPU)
def check_translation(node: Node, program, batch: int, s: int, doc: np.ndarray | None) -> None:
    """The mask_mod (torch ops on a dense plane) equals the compiler's dense oracle mask."""
    import torch
    from attnc.compiler.oracle import dense_mask
    tensors = {"doc": doc.astype(np.int64)} if doc is not None else {}
    want = dense_mask(program, batch, s, s, tensors)[:, 0]
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    d = torch.as_tensor(doc, dtype=torch.int64) if doc is not None else None
    for b in range(batch):
        got = node.flex(b, q, k, d, s, s).expand(s, s).numpy()
        if not np.array_equal(got, want[b]):
            i, j = (int(x[0]) for x in np.nonzero(got != want[b]))
            raise AssertionError(f"mask_mod of {node.attn()!r} differs from the oracle at b={b} q={i} k={j}")


def check_mask(node: Node, index: int, *, batch: int = 2, heads: int = 2, s: int = 96, head_dim: int = 16,
               seed: int = 0, backend: str = "numpy", tol: float = 1e-2) -> dict:
    """The public call on the CPU against the float64 oracle at a small shape, and the mask_mod
    against the oracle's mask.  Returns the check's figures; raises AssertionError on a mismatch."""
    import torch
    import attnc
    from attnc.compiler import oracle
    attn = attnc.compile(spec_text(node, index))
    program = attn.specialize(heads, heads, head_dim, head_dim, "bf16")
    rng = np.random.default_rng(seed)
    doc = documents(rng, batch, s) if node.reads_doc() else None
    check_translation(node, program, batch, s, doc)
    q, k, v = (torch.from_numpy(rng.standard_normal((batch, heads, s, head_dim)).astype(np.float32))
               .to(torch.bfloat16) for _ in range(3))
    tensors = {"doc": torch.from_numpy(doc)} if doc is not None else {}
    o = attn(q, k, v, backend=backend, **tensors)
    ref, _ = oracle.reference(program, *(x.float().numpy() for x in (q, k, v)),
                              {"doc": doc.astype(np.int64)} if doc is not None else {})
    err = float(np.linalg.norm(o.float().numpy() - ref) / max(np.linalg.norm(ref), 1e-30))
    if not err < tol:
        raise AssertionError(f"{node.attn()!r}: relative L2 error {err:.2e} >= {tol} against the float64 oracle")
    return {"rel_l2_error": err, "s": s, "backend": backend}


# ------------------------------------------------------------------ timing (GPU)
def _visible_cells(program, batch: int, s: int, doc) -> int | None:
    """Visible cells of one head over the batch, from the plan's exact per-column analysis or,
    where it is not exact, the dense mask on the GPU by row blocks."""
    from attnc.compiler.analysis.intervals import analyze
    tensors = {"doc": doc.cpu().numpy().astype(np.int64)} if doc is not None else {}
    mi = analyze(program, batch, s, s, tensors)
    if mi.exact:
        per = mi.visible.must.cells_in(0, s).reshape(mi.shape).sum(-1)[:, 0]
        return int(np.broadcast_to(per, (batch,)).sum())
    return None


def _dense_count(node: Node, batch: int, s: int, doc, device) -> int:
    import torch
    total = 0
    k = torch.arange(s, device=device)[None, :]
    for b in range(batch if doc is not None else 1):
        for r0 in range(0, s, 1024):
            q = torch.arange(r0, min(s, r0 + 1024), device=device)[:, None]
            total += int(node.flex(b, q, k, doc, s, s).expand(q.shape[0], s).sum())
    return total if doc is not None else total * batch


def _reference(node: Node, q, k, v, doc, planes):
    import torch
    s = q.shape[2]
    qi = torch.arange(s, device=q.device)[:, None]
    ki = torch.arange(s, device=q.device)[None, :]
    scale_ = 1.0 / math.sqrt(q.shape[-1])
    out = []
    for b, h in planes:
        vis = node.flex(b, qi, ki, doc, s, s).expand(s, s)
        sc = (q[b, h].float() @ k[b, h].float().T) * scale_
        p = torch.softmax(sc.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
        out.append(p @ v[b, h].float())
        del sc, p, vis
    return out


def mask_inputs(node: Node, index: int, *, batch: int, heads: int, s: int, head_dim: int, seed: int, device):
    """(q, k, v, doc or None) of mask ``index`` at the bench shape, the same in the timing and in
    the warm-up (``mask_sweep_warm``: what it compiles is what is timed)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed + index)
    q, k, v = (torch.randn(batch, heads, s, head_dim, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    doc = (torch.as_tensor(documents(np.random.default_rng(seed + index), batch, s), device=device)
           if node.reads_doc() else None)
    return q, k, v, doc


def time_mask(node: Node, index: int, rows, *, batch: int, heads: int, s: int, head_dim: int, seed: int,
              flex_backends: tuple, env: dict, warmed: bool = False) -> None:
    """One mask at the bench shape: attnc's public call, Flex (Triton) and Flex FLASH, each checked
    against a float32 dense reference of two (b, h) planes first.  ``warmed``: a warm-up worker
    compiled this mask without an error (recorded in the rows)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import attnc
    from . import harness as H
    dev = "cuda"
    q, k, v, doc = mask_inputs(node, index, batch=batch, heads=heads, s=s, head_dim=head_dim, seed=seed, device=dev)
    tensors = {"doc": doc} if doc is not None else {}
    attn = attnc.compile(spec_text(node, index))
    program = attn.specialize(heads, heads, head_dim, head_dim, "bf16")
    visible = _visible_cells(program, batch, s, doc)
    if visible is None:
        visible = _dense_count(node, batch, s, doc, dev)
    flops = H.prefill_flops(visible, heads, head_dim, head_dim)
    planes = [(0, 0), (batch - 1, heads - 1)]
    check = H.plane_check(_reference(node, q, k, v, doc, planes), planes)
    record = {"bench": "mask_sweep", "index": index, "mask": node.attn(), "atoms": node.atoms(),
              "spec": spec_text(node, index), "B": batch, "H": heads, "S": s, "D": head_dim, "dtype": "bf16",
              "visible_cells": visible, "density": visible / (batch * s * s), "flops": flops,
              "flop_formula": H.FLOP_FORMULA, "env": env, "warmed": warmed}
    label = f"{index:4d}"
    try:
        t0 = time.perf_counter()
        attn(q, k, v, **tensors)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        _, kernel = attn._kernel_for(q, k, v, tensors, None)
        cfg = kernel.config_for(q, k, v, **tensors)
        t0 = time.perf_counter()
        plan = kernel.plan(batch, s, s, tensors, cfg.block_m, cfg.block_n)  # the call's tiles, planned again
        torch.cuda.synchronize()
        plan_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # noqa: BLE001 - a failing call is a row
        rows.append({**record, "impl": "attnc_call", "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
        print(f"{label} attnc_call: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)
        return
    extra = {"first_call_ms": first_ms, "config": cfg.describe(), "plan_ms": plan_ms, "tiles": plan.tiles.counts(),
             "tile_density": plan.tiles.density(), "tiles_undecided": plan.tiles.undecided,
             "tiles_evaluated_by": plan.tiles.evaluated_by}
    H.timed(lambda: attn(q, k, v, **tensors), check, {**record, "impl": "attnc_call", **extra}, rows,
            f"{label} attnc_call ", flops, "TFLOPs")
    def mask_mod(b, h, qi, ki):  # prefill: query row i is at position i
        return node.flex(b, qi, ki, doc, s, s)

    torch._dynamo.reset()
    try:
        t0 = time.perf_counter()
        block_mask = create_block_mask(mask_mod, batch if doc is not None else None, None, s, s, device=dev)
        torch.cuda.synchronize()
        bm_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # noqa: BLE001
        for name in flex_backends:
            rows.append({**record, "impl": f"flex_{name}", "error": f"create_block_mask: {type(e).__name__}: {e}"})
        return
    for name in flex_backends:
        torch._dynamo.reset()
        opts = {"kernel_options": {"BACKEND": "FLASH"}} if name == "flash" else {}
        compiled = torch.compile(flex_attention)
        H.timed(lambda: compiled(q, k, v, block_mask=block_mask, scale=1.0 / math.sqrt(head_dim), **opts), check,
                {**record, "impl": f"flex_{name}", "block_mask_ms": bm_ms,
                 "config": {"flex": name, "kernel_options": opts.get("kernel_options")}},
                rows, f"{label} flex_{name:6}", flops, "TFLOPs")
        del compiled
    del block_mask, q, k, v


def summarize(rows: list, bottom: int = 10) -> dict:
    """Per mask, attnc's TFLOP/s over each Flex backend's (the call's median against theirs, on the
    same visible cells): min, median and max of each ratio and the masks at the bottom."""
    by = {}
    for r in rows:
        if r.get("bench") == "mask_sweep" and r.get("pass"):
            by.setdefault(r["index"], {})[r["impl"]] = r
    out = {"bench": "mask_sweep_summary",
           "masks": len({r["index"] for r in rows if r.get("bench") == "mask_sweep" and "index" in r}),
           "masks_timed": len(by)}
    for peer in ("flex_triton", "flex_flash"):
        ratios = sorted(((m[peer]["median_ms"] / m["attnc_call"]["median_ms"], i, m["attnc_call"]["mask"])
                         for i, m in by.items() if "attnc_call" in m and peer in m), key=lambda x: x[0])
        if not ratios:
            out[peer] = None
            continue
        vals = [x[0] for x in ratios]
        out[peer] = {"n": len(vals), "min": vals[0], "median": float(np.median(vals)), "max": vals[-1],
                     "below_goal": sum(v < (1.3 if peer == "flex_triton" else 1.0) for v in vals),
                     "goal": 1.3 if peer == "flex_triton" else 1.0,
                     "bottom": [{"index": i, "mask": m, "ratio": r} for r, i, m in ratios[:bottom]]}
    errors = [r for r in rows if r.get("error")]
    out["error_rows"] = len(errors)
    out["errors_by_impl"] = {impl: sum(r.get("impl") == impl for r in errors) for impl in
                             sorted({r.get("impl") for r in errors})}
    return out


# ------------------------------------------------------------------ warm-up, budget, command line
def shared_caches() -> str:
    """The compile caches the timing process and the warm-up workers share; returns Triton's.

    ``TRITON_CACHE_DIR``, when unset, is set to Triton's own default (``~/.triton/cache``, under
    ``TRITON_HOME`` when that is set): inductor sets the variable to its own directory the first
    time it builds a Triton kernel in a process (``CachingAutotuner``), so without this attnc's
    kernels would go to one directory before a process's first Flex compile and to another after
    it, and a kernel a worker compiled first would sit where the timing process does not look.
    Set before the workers start, they inherit it: one directory for all, not one per process.
    Inductor's FX graph cache and AOTAutograd cache (across processes: the compiled Flex graph
    of a mask_mod, constants included) are on: their defaults in torch 2.11, set explicitly."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    os.environ["TRITON_CACHE_DIR"] = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return os.environ["TRITON_CACHE_DIR"]


def slices(start: int, count: int, workers: int) -> list[tuple[int, int]]:
    """``(start, count)`` of each worker: masks ``start .. start + count - 1`` cut in order into at
    most ``workers`` contiguous, non-empty runs whose lengths differ by at most one."""
    n = max(0, min(workers, count))
    base, extra = divmod(count, n) if n else (0, 0)
    out, at = [], start
    for i in range(n):
        c = base + (i < extra)
        out.append((at, c))
        at += c
    return out


def worker_command(a, start: int, count: int, out: str) -> list[str]:
    """The command of one warm-up worker: the sweep's masks and shape, its slice, its own rows."""
    return [sys.executable, "-m", f"{__package__}.mask_sweep_warm", "--start", str(start), "--count", str(count),
            "--seed", str(a.seed), "--batch", str(a.batch), "--heads", str(a.heads), "--seq", str(a.seq),
            "--head-dim", str(a.head_dim), "--flex", a.flex, "--out", out]


def warm_up(a, out: str, rows, deadline: float | None = None) -> set[int]:
    """Run ``a.warm_workers`` workers over the masks ``a.start ..`` and wait for them (killing
    those still running at ``deadline``, a :func:`_now` time); their rows (``mask_sweep_warm``,
    one per mask, and one ``mask_sweep_warm_worker`` per worker) join ``rows``.  Each worker's
    output is in ``<out>.warm/worker<i>.log``.  Returns the indices warmed without an error."""
    folder = Path(out).with_suffix(".warm")
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no pool of compile processes per worker
    t0, procs = _now(), []
    try:
        for i, (start, count) in enumerate(slices(a.start, a.count, a.warm_workers)):
            part, log = folder / f"worker{i}.jsonl", folder / f"worker{i}.log"
            part.unlink(missing_ok=True)
            with open(log, "w") as f:
                p = subprocess.Popen(worker_command(a, start, count, str(part)), stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
            procs.append((i, start, count, part, log, p))
        print(f"warm-up: {len(procs)} workers over masks {a.start}..{a.start + a.count - 1} (logs in {folder})",
              flush=True)
        for _, _, _, _, _, p in procs:
            try:
                p.wait(timeout=None if deadline is None else max(0.0, deadline - _now()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for _, _, _, _, _, p in procs:
            if p.poll() is None:  # past the deadline, or this process is going down
                p.kill()
                p.wait()
    ok = set()
    for i, start, count, part, log, p in procs:
        warm = _complete_rows(part)
        for r in warm:
            rows.append(r)
            if not r.get("errors"):
                ok.add(r["index"])
        part.unlink(missing_ok=True)
        rows.append({"bench": "mask_sweep_warm_worker", "worker": i, "start": start, "count": count,
                     "returncode": p.returncode, "masks_done": len(warm), "log": str(log)})
        print(f"warm-up worker {i}: masks {start}..{start + count - 1}, exit {p.returncode}, {len(warm)} done, "
              f"{sum(bool(r.get('errors')) for r in warm)} with errors", flush=True)
    print(f"warm-up: {len(ok)} of {a.count} masks compiled without an error in {_now() - t0:.1f} s", flush=True)
    return ok


def _complete_rows(path: Path) -> list[dict]:
    """The JSON rows of a worker's file, without a last line a kill cut short (not JSON)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _now() -> float:
    return time.monotonic()


def add_mask_options(ap: argparse.ArgumentParser) -> None:
    """The options that name the masks and the shape (the sweep's and a warm-up worker's)."""
    ap.add_argument("--count", type=int, default=200, help="masks (default 200)")
    ap.add_argument("--start", type=int, default=0, help="first mask index (resume a run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--flex", default="triton,flash", help="Flex backends to time: triton, flash (or '')")
    ap.add_argument("--out", default=None,
                    help="JSON lines (default bench/results/studies/mask_sweep_<time>.jsonl: not the evidence schema)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m bench.mask_sweep", description=__doc__.split("\n\n")[0])
    add_mask_options(ap)
    ap.add_argument("--check-seq", type=int, default=256, help="length of the CPU correctness check")
    ap.add_argument("--check-only", action="store_true", help="the CPU correctness checks only (no GPU)")
    ap.add_argument("--warm-workers", type=int, default=0, metavar="N",
                    help="compile every mask first in N worker processes (default 0: no warm-up)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="start no mask once the run has taken this long; the last line names the --start "
                         "that resumes (default: no budget)")
    return ap


def main(argv=None) -> int:
    t_start = _now()
    ap = parser()
    a = ap.parse_args(argv)
    if a.warm_workers < 0 or (a.warm_workers and a.check_only):
        ap.error("--warm-workers takes N >= 0 and has nothing to compile with --check-only")
    if a.time_budget is not None and a.time_budget < 0:
        ap.error("--time-budget takes SECONDS >= 0")
    from . import harness as H
    # default: bench/results/studies/ under the current directory (a checkout's root), never inside an
    # install; not bench/results/ itself, whose rows are the evidence schema's (tests/unit/test_evidence.py)
    stamp = time.strftime('%Y%m%d_%H%M%S', time.gmtime())
    out = a.out or str(Path("bench") / "results" / "studies" / f"mask_sweep_{stamp}.jsonl")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    command = "python3 -m bench.mask_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = H.Rows(out, command)
    if not a.check_only:
        print(f"Triton cache: {shared_caches()}", flush=True)
    env = {} if a.check_only else H.environment()
    deadline = None if a.time_budget is None else t_start + a.time_budget
    warmed = warm_up(a, out, rows, deadline) if a.warm_workers else set()
    # the structures depend on the length only through their sizes: the same seed, the same family
    big = masks(a.start + a.count, a.seed, a.seq)[a.start:]
    small = masks(a.start + a.count, a.seed, a.check_seq)[a.start:]
    flex = tuple(x for x in a.flex.split(",") if x)
    resume = None
    for j, (node, tiny) in enumerate(zip(big, small)):
        index = a.start + j
        if deadline is not None and _now() >= deadline:
            resume = index
            break
        t_mask = _now()
        try:
            fig = check_mask(tiny, index, s=a.check_seq)
        except Exception as e:  # noqa: BLE001 - a wrong answer is a row and the mask is not timed
            rows.append({"bench": "mask_sweep", "index": index, "mask": node.attn(), "impl": "check",
                         "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
            print(f"{index:4d} check FAILED: {e}", flush=True)
            continue
        rows.append({"bench": "mask_sweep", "index": index, "mask": node.attn(), "impl": "check",
                     "check_mask": tiny.attn(), "pass": True, **fig})
        if not a.check_only:
            time_mask(node, index, rows, batch=a.batch, heads=a.heads, s=a.seq, head_dim=a.head_dim,
                      seed=a.seed, flex_backends=flex, env=env, warmed=index in warmed)
            print(f"{index:4d} wall {_now() - t_mask:.1f} s (run {_now() - t_start:.0f} s)", flush=True)
    stop = None
    if resume is not None:
        stop = {"stopped_by_time_budget": True, "time_budget_s": a.time_budget, "elapsed_s": _now() - t_start,
                "next_start": resume, "next_count": a.start + a.count - resume}
    if not a.check_only:
        summary = {**summarize(list(rows)), "warm_workers": a.warm_workers, **(stop or {})}
        rows.append(summary)
        print(json.dumps(summary, indent=1))
    elif stop:
        rows.append({"bench": "mask_sweep_stop", **stop})
    print(f"wrote {out}")
    if stop:
        print(f"stopped by --time-budget {a.time_budget:g} after {stop['elapsed_s']:.0f} s: resume with "
              f"--start {resume} --count {stop['next_count']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
