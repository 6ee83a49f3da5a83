"""`attnc demo`: the main job — every example compiled and run for prefill, append and
decode against the float64 oracle, as a table."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from . import inputs, ir, numerics, oracle
from .dispatch import backend
from .errors import AttncError, BackendUnavailable
from .lower import compile_file

PHASES = {  # name -> (S_q, S_k) for demo length S
    "prefill": lambda s: (s, s),
    "append": lambda s: (max(s // 4, 2), s),
    "decode": lambda s: (1, s),
}


def default_specs() -> list[Path]:
    """The examples shipped with attnc, as package data: examples/ in a source checkout,
    attnc/examples/ in an installed wheel (the package attnc.examples either way)."""
    from importlib.resources import files
    return sorted(Path(str(p)) for p in files("attnc.examples").iterdir() if p.name.endswith(".attn"))


def _mixed(length: int) -> tuple[list[int], list[int]]:
    """A mixed batch (M4.5 §0x08F): a prefill, an append and a decode request, as (kv_lens, q_lens)."""
    half = max(length // 2, 2)
    return [half, half + max(length // 8, 2), length], [half, max(length // 8, 2), 1]


def _split_row(program, kernel, kv_lens, q_lens, seed):
    """Run one split call on a sampled cache (shuffled pages, NaN-poisoned unused rows)."""
    from .analysis.phases import Manifest, visible_cells
    arrays = inputs.sample_cache(program, kv_lens, q_lens, seed)
    call = inputs.validate_cache(program, arrays)
    t0 = time.perf_counter()
    o, lse = kernel.run(arrays, return_lse=True)
    ms = (time.perf_counter() - t0) * 1e3
    ref_o, ref_lse = oracle.reference_cache(program, call)
    m = Manifest.from_lens(call.kv_lens, call.q_lens)
    rect = int((m.C * m.post_commit).sum()) * program.heads_q
    visible = visible_cells(program, m, call.tensors).sum() / max(rect, 1)
    return numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse), ms, visible


def run_demo(specs, backend_name: str, length: int = 128, batch: int = 2, seed: int = 0) -> int:
    specs = [Path(s) for s in specs] or default_specs()
    if not specs:
        print("no specs given and no examples shipped with attnc found", file=sys.stderr)
        return 1
    be = backend(backend_name)
    header = f"{'example':<30} {'heads':>6} {'dtype':>5} {'phase':>7} {'S_q x S_k':>10} " \
             f"{'visible':>7} {'max|dO|':>9} {'tol':>7} {'ms':>7}  result"
    print(f"attnc demo: backend {backend_name}, B={batch}, S_k={length}, seed {seed}; "
          "reference: float64 oracle on the same stored inputs")
    print(header)
    print("-" * len(header))
    failures = rows = 0
    for path in specs:
        try:
            program = compile_file(path)
            if program.generic:  # shape-generic: the demo's calls need a shape
                program = ir.specialize(program, 4, 4, 64, 64, program.dtype)
            kernel = be.load(program)
            split = inputs.is_split_call(program, ())
            note = ""
            if split and not hasattr(kernel, "run"):  # a backend without split calls
                note = f" (spec's {program.cache.kind.value} cache run as contiguous bhsd)"
                program = inputs.contiguous_variant(program)
                kernel, split = be.load(program), False
            elif split:
                paged = program.cache.kind.value == "paged"
                note = f" ({inputs.cache_description(program)}" + (", shuffled pages, NaN-poisoned tails)"
                                                                   if paged else ")")
        except BackendUnavailable as e:  # the same for every spec: say it once
            print(e, file=sys.stderr)
            return 1
        except AttncError as e:
            print(e, file=sys.stderr)
            failures += 1
            rows += 1
            continue
        phases = {name: ([shape(length)[1]] * batch, [shape(length)[0]] * batch) for name, shape in PHASES.items()}
        if split:
            phases["mixed"] = _mixed(length)
        for phase, (kv_lens, q_lens) in phases.items():
            rows += 1
            s_q, s_k = (sum(q_lens), max(kv_lens)) if phase == "mixed" else (q_lens[0], kv_lens[0])
            try:
                if split:
                    (co, cl), ms, visible = _split_row(program, kernel, kv_lens, q_lens, seed)
                else:
                    arrays = inputs.sample(program, batch, s_q, s_k, seed)
                    call = inputs.validate(program, arrays)
                    tensors = {t.name: arrays[t.name] for t in program.tensors}
                    t0 = time.perf_counter()
                    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, **tensors)
                    ms = (time.perf_counter() - t0) * 1e3
                    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
                    visible = oracle.dense_mask(program, call.batch, s_q, s_k, call.tensors).mean()
                    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse,
                                                      ref_o, ref_lse)
            except AttncError as e:
                failures += 1
                print(f"{program.name:<30} {phase:>7}: FAIL {e}")
                continue
            ok = co.ok and cl.ok
            failures += not ok
            verdict = "ok" if ok else f"FAIL {co if not co.ok else cl}"
            extra = f" (T, C) = {[(k - q, q) for k, q in zip(kv_lens, q_lens)]}" if phase == "mixed" else note
            print(f"{program.name:<30} {program.heads_q:>3}/{program.heads_kv:<2} {program.dtype:>5} "
                  f"{phase:>7} {f'{s_q}x{s_k}':>10} {visible:>7.1%} {co.max_abs_error:>9.2e} "
                  f"{co.atol:>7.0e} {ms:>7.1f}  {verdict}{extra}")
    print(f"{rows - failures} passed, {failures} failed")
    return 1 if failures else 0
