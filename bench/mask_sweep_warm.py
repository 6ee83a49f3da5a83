"""A warm-up worker of the mask sweep (``python3 -m bench.mask_sweep --warm-workers N`` starts N
of them): for each mask of its slice, the compiling work of :func:`bench.mask_sweep.time_mask`
and nothing else, so that the timing process finds every kernel in the on-disk caches.

Per mask, at the bench shape (compilation is specialized on it, so a smaller shape would warm
nothing): attnc's public call (its Triton/Gluon kernels land in Triton's cache), and per Flex
backend asked ``create_block_mask`` and one call of ``torch.compile(flex_attention)`` (inductor's
FX graph and AOTAutograd caches, Triton's cache).  The inputs are made exactly as ``time_mask``
makes them (same generator, same document ids), so the graphs and their keys are the same; they
are freed after each mask (q, k, v at B=4 H=16 S=8192 d=128 bf16 are 0.4 GB; a worker holds
about that plus its CUDA context).  Nothing is timed; one row per mask (``mask_sweep_warm``)
gives each step's wall time or its error, and a failing step never stops the worker.

Workers are separate interpreters started with ``subprocess`` (not ``multiprocessing``): a
compiler that crashes the process (a segfault, a CUDA fault) or hangs takes only its worker,
which the sweep can kill by its id; nothing is pickled (the masks are rebuilt from the seed, as
every run does); the command of a worker is a plain command line one can run by hand; and its
output goes to a log file of its own.  The options are the sweep's (:func:`add_mask_options`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from .mask_sweep import Node, add_mask_options, mask_inputs, masks, shared_caches, spec_text


def warm_mask(node: Node, index: int, *, batch: int, heads: int, s: int, head_dim: int, seed: int,
              flex_backends: tuple, device: str = "cuda") -> dict:
    """Compile what ``time_mask`` compiles for this mask; returns a ``mask_sweep_warm`` row with the
    wall time of each step (``ms``) and the error of each step that raised (``errors``)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import attnc
    ms, errors = {}, {}
    cuda = device.startswith("cuda")

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the timing compiles it again and records the error
            errors[name] = f"{type(e).__name__}: {str(e)[-600:]}"
            return None
        ms[name] = (time.perf_counter() - t0) * 1e3
        return out

    q, k, v, doc = mask_inputs(node, index, batch=batch, heads=heads, s=s, head_dim=head_dim, seed=seed,
                               device=device)
    tensors = {"doc": doc} if doc is not None else {}
    step("attnc_call", lambda: attnc.compile(spec_text(node, index))(q, k, v, **tensors))

    def mask_mod(b, h, qi, ki):  # as time_mask writes it: the same closure, the same graph
        return node.flex(b, qi, ki, doc, s, s)

    if flex_backends:
        torch._dynamo.reset()
        block_mask = step("create_block_mask", lambda: create_block_mask(
            mask_mod, batch if doc is not None else None, None, s, s, device=device))
        for name in flex_backends if block_mask is not None else ():
            torch._dynamo.reset()
            opts = {"kernel_options": {"BACKEND": "FLASH"}} if name == "flash" else {}
            compiled = torch.compile(flex_attention)
            step(f"flex_{name}", lambda: compiled(q, k, v, block_mask=block_mask, scale=1.0 / math.sqrt(head_dim),
                                                   **opts))
            del compiled
        del block_mask
    del q, k, v, doc, tensors
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return {"bench": "mask_sweep_warm", "index": index, "mask": node.attn(), "B": batch, "H": heads, "S": s,
            "D": head_dim, "ms": ms, "errors": errors}


def main(argv=None) -> int:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # before torch: no compile pool per worker
    ap = argparse.ArgumentParser(prog="python3 -m bench.mask_sweep_warm", description=__doc__.split("\n\n")[0])
    add_mask_options(ap)
    ap.add_argument("--device", default="cuda", help="cuda (the sweep's); cpu runs the same steps in tests")
    a = ap.parse_args(argv)
    from . import harness as H
    shared_caches()
    rows = H.Rows(a.out, f"python3 -m bench.mask_sweep_warm {' '.join(argv if argv is not None else sys.argv[1:])}")
    flex = tuple(x for x in a.flex.split(",") if x)
    for j, node in enumerate(masks(a.start + a.count, a.seed, a.seq)[a.start:]):
        t0 = time.perf_counter()
        row = warm_mask(node, a.start + j, batch=a.batch, heads=a.heads, s=a.seq, head_dim=a.head_dim, seed=a.seed,
                        flex_backends=flex, device=a.device)
        rows.append({**row, "wall_ms": (time.perf_counter() - t0) * 1e3})
        print(f"{a.start + j:4d} warm {time.perf_counter() - t0:6.1f} s  "
              + "  ".join(f"{n} {x / 1e3:.1f} s" for n, x in row["ms"].items())
              + "".join(f"  {n}: ERROR {e[-200:]}" for n, e in row["errors"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
