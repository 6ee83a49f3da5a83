"""What exact tile classes cost (issue 34): masks the interval analysis cannot solve (periodic,
modular, bitwise atoms), whose undecided tiles the predicate classifies, at the bench shapes.

For each mask and length, one JSON line per method:
  plan_host     ``compiler.plan.plan`` on the host, the numpy tile evaluator (what a CPU call pays);
                ``tiles_by_bounds``: undecided tiles its bounds decided without a cell;
  plan_stub     ``compiler.plan.plan`` with the undecided tiles' classes known in advance (an
                evaluator that looks them up): the host's part of plan_gpu alone (analysis,
                classifier, CSR), also without a GPU;
  plan_gpu      ``Kernel.plan`` of the Triton backend with CUDA tensors: the analysis on the host,
                the undecided tiles on the GPU (``backends/triton/tile_classes.py``), the CSR on the
                host (what a CUDA call pays once per plan; later calls find it in the plan cache);
  eval_gpu      the GPU tile evaluator alone on the undecided tiles (upload, kernel, download);
  flex_block_mask  torch's ``create_block_mask`` of the same predicate as a mask_mod at the same
                shape and block size, as it is and under ``torch.compile``; ``same_classes_as_ours``
                compares its FULL and PARTIAL block counts with the plan's (both are exact).
Each row has the tile counts, the undecided tiles and the samples (ms).  ``--no-gpu`` times the
host path alone (no torch.cuda).  Run: ``python3 -m bench.tile_class_cost [--seq 8192,32768]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .mask_sweep import Node, documents, spec_text

N = Node
MASKS = {
    # the example: a window, sinks and periodic global rows under causal
    "window_sinks_periodic_rows": N("and", children=(N("causal"), N("or", children=(
        N("window", (512,)), N("sink", (16,)), N("periodic_rows", (1024, 16)))))),
    "dilated_window": N("and", children=(N("causal"), N("window", (1024,)), N("dilation", (2,)))),
    "bitwise_or_window": N("or", children=(N("bitwise_and", (1024 + 2048,)), N("and", children=(
        N("causal"), N("window", (128,)))))),
    "window_periodic_columns": N("and", children=(N("causal"), N("or", children=(
        N("window", (1024,)), N("periodic_cols", (512, 16)))))),
    "documents_periodic_rows": N("and", children=(N("causal"), N("document"), N("or", children=(
        N("window", (256,)), N("periodic_rows", (512, 8)))))),
}


class Known:
    """A tile evaluator that looks the classes up (plan_stub: the host's part of a plan alone)."""

    name = "known"

    def __init__(self, classes):
        self.classes = classes

    def __call__(self, tiles, block_m, block_n):
        return self.classes[tuple(tiles.T)]


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _row(rows_file, command, **row):
    import json
    row = {"command": command, "bench": "tile_class_cost", **row}
    if "samples_ms" in row:
        row["median_ms"] = statistics.median(row["samples_ms"])
    print({k: v for k, v in row.items() if k not in ("samples_ms", "command")}, flush=True)
    with open(rows_file, "a") as f:
        f.write(json.dumps(row) + "\n")


def run(seqs, block, masks, batch, repeats, gpu, host_max_seq, out, command, device="cuda"):
    import attnc
    from attnc.compiler.plan import plan as make_plan
    bm, bn = block
    for name in masks:
        node = MASKS[name]
        attn = attnc.compile(spec_text(node, 0))
        program = attn.specialize(16, 16, 128, 128, "bf16")
        for s in seqs:
            doc = documents(np.random.default_rng(0), batch, s) if node.reads_doc() else None
            host = {"doc": doc.astype(np.int64)} if doc is not None else {}
            common = {"mask": name, "expr": node.attn(), "B": batch, "S": s, "block": [bm, bn]}
            p = None
            if s <= host_max_seq:
                samples = _times(lambda: make_plan(program, batch, s, s, host, bm, bn), repeats)
                p = make_plan(program, batch, s, s, host, bm, bn)
                _row(out, command, **common, method="plan_host", samples_ms=samples, tiles=p.tiles.counts(),
                     undecided=p.tiles.undecided, density=p.tiles.density(),
                     cells_evaluated=p.tile_evaluator.cells, tiles_by_bounds=p.tile_evaluator.by_bounds)
                known = Known(p.tiles.classes)
                _row(out, command, **common, method="plan_stub", undecided=p.tiles.undecided,
                     samples_ms=_times(lambda: make_plan(program, batch, s, s, host, bm, bn, tile_evaluator=known),
                                       repeats))
            if not gpu:
                continue
            import torch
            from torch.nn.attention.flex_attention import create_block_mask
            from attnc.compiler.analysis.intervals import analyze
            from attnc.compiler.analysis.tiles import classify_exact
            from attnc.backends.triton.tile_classes import TritonTileEvaluator
            dev = torch.device(device)  # ("cpu" under TRITON_INTERPRET=1: a smoke test of this script)

            def sync():
                if dev.type == "cuda":
                    torch.cuda.synchronize()

            tensors = {"doc": torch.as_tensor(doc, device=dev)} if doc is not None else {}
            q = torch.empty(batch, 16, s, 128, device=dev, dtype=torch.bfloat16)
            _, kernel = attn._kernel_for(q, q, q, tensors, "triton")

            def gpu_plan():
                r = kernel.plan(batch, s, s, tensors, bm, bn)
                sync()
                return r

            gp = gpu_plan()  # (compiles the tile kernel)
            samples = _times(gpu_plan, repeats)
            if p is not None and not np.array_equal(p.tiles.classes, gp.tiles.classes):
                raise AssertionError(f"{name} S={s}: the GPU's tile classes differ from the host's")
            _row(out, command, **common, method="plan_gpu", samples_ms=samples, tiles=gp.tiles.counts(),
                 undecided=gp.tiles.undecided, evaluated_by=gp.tiles.evaluated_by, density=gp.tiles.density())
            if p is None:  # (past --host-max-seq: the host's part with the GPU's classes)
                known = Known(gp.tiles.classes)
                _row(out, command, **common, method="plan_stub", undecided=gp.tiles.undecided,
                     samples_ms=_times(lambda: make_plan(program, batch, s, s, host, bm, bn, tile_evaluator=known),
                                       repeats))
            mi = analyze(program, batch, s, s, host)
            und = np.zeros((mi.shape[0], mi.shape[1], -(-s // bm), -(-s // bn)), bool)
            classify_exact(mi, bm, bn, undecided=und)
            todo = np.argwhere(und).astype(np.int64)
            ev = TritonTileEvaluator(kernel.module, tensors, batch, s, s, dev)
            _row(out, command, **common, method="eval_gpu", undecided=len(todo),
                 samples_ms=_times(lambda: ev(todo, bm, bn), repeats))
            d = tensors.get("doc")

            def mask_mod(b, h, qi, ki):
                return node.flex(b, qi, ki, d, s, s)

            ours = gp.tiles.counts()
            compiled_bm = torch.compile(create_block_mask)
            for compiled in (False, True):
                make_mask = compiled_bm if compiled else create_block_mask
                try:
                    def make(f=make_mask):
                        m = f(mask_mod, batch if d is not None else None, None, s, s, device=dev, BLOCK_SIZE=(bm, bn))
                        sync()
                        return m
                    first = _times(make, 1)
                    bmask = make()
                    full = int(bmask.full_kv_num_blocks.sum()) if bmask.full_kv_num_blocks is not None else 0
                    partial = int(bmask.kv_num_blocks.sum())
                    _row(out, command, **common, method="flex_block_mask", compiled=compiled, first_ms=first[0],
                         samples_ms=_times(make, repeats), flex_full=full, flex_partial=partial,
                         same_classes_as_ours=(full, partial) == (ours["full"], ours["partial"]))
                    del bmask
                except Exception as e:  # noqa: BLE001 - a row, not the end of the run
                    _row(out, command, **common, method="flex_block_mask", compiled=compiled,
                         error=f"{type(e).__name__}: {str(e)[-600:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.tile_class_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="8192,16384,32768,131072")
    ap.add_argument("--block", default="128x128")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-gpu", action="store_true", help="the host path only")
    ap.add_argument("--host-max-seq", type=int, default=32768, help="longest length the host path is timed at")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels in Triton's interpreter "
                    "(TRITON_INTERPRET=1, tiny shapes: a check of this script, not a measurement)")
    a = ap.parse_args(argv)
    bm, bn = (int(x) for x in a.block.lower().split("x"))
    # default: bench/results/ under the current directory (a checkout's root), never inside an install
    stamp = time.strftime('%Y%m%d_%H%M%S', time.gmtime())
    out = a.out or str(Path("bench") / "results" / f"tile_class_cost_{stamp}.jsonl")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    command = "python3 -m bench.tile_class_cost " + " ".join(argv if argv is not None else sys.argv[1:])
    run([int(x) for x in a.seq.split(",")], (bm, bn), a.masks.split(","), a.batch, a.repeats, not a.no_gpu,
        a.host_max_seq, out, command, a.device)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
