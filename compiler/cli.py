"""`attnc` — thin command line over the library (DESIGN §7).

Every user error prints its located report on stderr and exits 1; `--debug`
re-raises with the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import inputs, numerics
from .dispatch import REGISTRY, backend
from .errors import AttncError, InputError
from .lower import compile_file

def _out(text: str, path: str | None) -> None:
    if path:
        Path(path).write_text(text)
    else:
        sys.stdout.write(text)


# ---------------------------------------------------------------- commands
def cmd_check(args) -> int:
    failed = 0
    for path in args.spec:
        try:
            p = compile_file(path)
        except AttncError as e:
            print(e, file=sys.stderr)
            failed += 1
            continue
        if not args.quiet:
            print(f"{path}: ok ({p.name}: heads {p.heads_q}/{p.heads_kv}, head_dim {p.d_qk}/{p.d_v}, "
                  f"{p.dtype}, {len(p.tensors)} tensor(s), {len(p.score)} score statement(s))")
    return 1 if failed else 0


def cmd_compile(args) -> int:
    program = compile_file(args.spec)
    _out(backend(args.backend).emit(program).text, args.output)
    return 0


def cmd_ir(args) -> int:
    from .printer import print_program
    _out(print_program(compile_file(args.spec)), args.output)
    return 0


def _load_npz(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read inputs file {path}: {e}") from None


def cmd_run(args) -> int:
    program = compile_file(args.spec)
    if args.inputs:
        arrays = _load_npz(args.inputs)
    else:
        s_k = args.kv_len
        arrays = inputs.sample(program, args.batch, args.q_len or s_k, s_k, args.seed)
    call = inputs.validate(program, arrays)
    kernel = backend(args.backend).load(program)
    t0 = time.perf_counter()
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                    **{t.name: arrays[t.name] for t in program.tensors})
    elapsed = time.perf_counter() - t0
    if args.out:
        np.savez(args.out, o=o, lse=lse)
    print(f"{program.name} on {args.backend}: B={call.batch} S_q={call.s_q} S_k={call.s_k} "
          f"o {list(o.shape)} {o.dtype}, lse {list(lse.shape)} in {elapsed * 1e3:.1f} ms"
          + (f" -> {args.out}" if args.out else ""))
    if args.check:
        ref_o, ref_lse = backend("numpy").oracle.reference(program, call.q, call.k, call.v, call.tensors)
        results = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse,
                                           ref_o, ref_lse)
        for r in results:
            print(f"  vs float64 oracle: {r}")
        return 0 if all(r.ok for r in results) else 1
    return 0


def _load_tensor_args(items: list[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--tensor takes NAME=FILE.npy, got {item!r}")
        if name in out:
            raise InputError(f"--tensor {name} given twice")
        try:
            out[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise InputError(f"cannot read tensor file {path} for '{name}': {e}") from None
        if not isinstance(out[name], np.ndarray):
            raise InputError(f"tensor file {path} for '{name}' is not a .npy array")
    return out


def cmd_explain(args) -> int:
    from . import explain as ex
    if args.out and args.format is None:
        raise InputError("--out writes a --format export (paddle or flex)")
    program = compile_file(args.spec)
    s_k = args.kv_len
    s_q = args.q_len if args.q_len is not None else s_k
    tensors = ex.call_tensors(program, args.batch, s_q, s_k, _load_tensor_args(args.tensor), args.seed)
    block_m, block_n = args.block
    expl = ex.explain(program, args.batch, s_q, s_k, tensors, block_m, block_n)
    if args.format == "paddle":
        pm = ex.paddle_startend_row_indices(expl.intervals, program, args.batch)
        if args.out:
            _save_arrays(args.out, {"startend_row_indices": pm.startend_row_indices,
                                    "causal": np.asarray(pm.causal)})
        text = json.dumps({**pm.to_json(arrays=not args.out), **({"out": args.out} if args.out else {})})
    elif args.format == "flex":
        fx = ex.flex_block_mask(expl.plan, s_q, s_k)
        if args.out:
            if not args.out.endswith(".npz"):
                raise InputError(f"--out {args.out}: the flex export is several arrays; write an .npz")
            arrays = {n: np.asarray(v, np.int32) for n, v in fx.items() if "kv_" in n}
            _save_arrays(args.out, {**arrays, "BLOCK_SIZE": np.asarray(fx["BLOCK_SIZE"], np.int32)})
            fx = {n: v for n, v in fx.items() if "kv_" not in n} | {"out": args.out}
        text = json.dumps(fx)
    elif args.json:
        text = json.dumps(expl.to_json())
    else:
        text = expl.text(args.spec)
    if args.png:
        ex.render_tile_map(expl, args.png)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.png and not (args.json or args.format):
        print(f"tile map -> {args.png}")
    return 0


def _save_arrays(path: str, arrays: dict[str, np.ndarray]) -> None:
    try:
        if path.endswith(".npy"):
            first = next(iter(arrays.values()))
            np.save(path, first)
        elif path.endswith(".npz"):
            np.savez(path, **arrays)
        else:
            raise InputError(f"--out {path}: expected a .npz file (or .npy for the main array alone)")
    except OSError as e:
        raise InputError(f"cannot write {path}: {e}") from None


def _block(text: str) -> tuple[int, int]:
    from .explain import parse_block
    try:
        return parse_block(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args.spec, args.backend, length=args.length, batch=args.batch, seed=args.seed)


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="attnc", description="compiler for attention mask programs")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of located errors")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    backends = sorted(REGISTRY)

    p = sub.add_parser("check", help="parse and check specs; exit 1 with located errors")
    p.add_argument("spec", nargs="+")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("compile", help="print generated source for a backend")
    p.add_argument("spec")
    p.add_argument("--backend", default="numpy", choices=backends)
    p.add_argument("-o", "--output")
    p.set_defaults(fn=cmd_compile)

    p = sub.add_parser("ir", help="print the IR as an MLIR module (generic syntax, attn dialect)")
    p.add_argument("spec")
    p.add_argument("-o", "--output")
    p.set_defaults(fn=cmd_ir)

    p = sub.add_parser("run", help="run a spec on inputs (npz) or on sampled inputs")
    p.add_argument("spec")
    p.add_argument("--backend", default="numpy", choices=backends)
    p.add_argument("--inputs", help="npz with q, k, v and every declared tensor")
    p.add_argument("--out", help="npz to write o and lse to")
    p.add_argument("--check", action="store_true", help="compare with the float64 oracle")
    p.add_argument("--batch", type=int, default=2, help="sampled inputs: B")
    p.add_argument("--q-len", type=int, default=None, help="sampled inputs: S_q (default S_k)")
    p.add_argument("--kv-len", type=int, default=128, help="sampled inputs: S_k")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("explain", help="FlashMask intervals, representability, tile classes and "
                                       "metadata ledger for one call shape; Paddle / Flex exports",
                       description="Analyse the mask for B requests of S_q query rows over S_k keys "
                                   "(bottom-right aligned). Tensors come from --tensor files, else "
                                   "from the spec's sample distributions (the values `attnc run` draws for the "
                                   "same --batch, lengths and --seed).")
    p.add_argument("spec")
    p.add_argument("--q-len", type=int, default=None, help="S_q (default S_k: prefill)")
    p.add_argument("--kv-len", type=int, required=True, help="S_k")
    p.add_argument("--batch", type=int, default=1, help="B (default 1)")
    p.add_argument("--tensor", action="append", default=[], metavar="NAME=FILE.npy",
                   help="a declared tensor's value (repeatable); the others are sampled")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled tensors")
    p.add_argument("--block", type=_block, default=(128, 64), metavar="MxN",
                   help="tile: block_m query rows x block_n keys (default 128x64)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (DESIGN §7 field names)")
    fmt.add_argument("--format", choices=("paddle", "flex"),
                     help="export: Paddle FlashMask startend_row_indices + causal, or "
                          "FlexAttention BlockMask tensors (JSON)")
    p.add_argument("--out", metavar="FILE.npz", help="with --format: write the arrays to an .npz "
                                                     "(paddle: or .npy) instead of listing them")
    p.add_argument("--png", metavar="FILE", help="tile-class map of (b=0, h=0) as a PNG (needs attnc[plot])")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("demo", help="compile and run examples for prefill, append and decode "
                                    "against the float64 oracle")
    p.add_argument("spec", nargs="*", help="specs (default: examples/*.attn)")
    p.add_argument("--backend", default="numpy", choices=backends)
    p.add_argument("--length", type=int, default=128, help="S_k of every phase")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AttncError as e:
        if args.debug:
            raise
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
