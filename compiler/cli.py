"""`attnc` — thin command line over the library (DESIGN §7).

Every user error prints its located report on stderr and exits 1; `--debug`
re-raises with the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__, inputs, ir, numerics, oracle, resources
from .dispatch import REGISTRY, backend
from .check import DTYPES, MAX_SIZE
from .errors import AttncError, InputError
from .lower import compile_file

# a shape-generic spec's open fields, as the command line gives them
SHAPE_FLAGS = {"heads": "--heads", "head_dim": "--head-dim", "dtype": "--dtype"}
_SHAPE_METAVARS = {"heads": "H[/H_KV]", "head_dim": "D[/D_V]", "dtype": "{" + ",".join(DTYPES) + "}"}


def _concrete(args):
    """The spec of ``args.spec`` for one shape: the spec's own declarations, and ``--heads``,
    ``--head-dim``, ``--dtype`` for what a shape-generic spec leaves open.  The rules are
    ``attnc.compile``'s (``ir.specialize``): a flag that contradicts a declared value is refused
    naming both; an open dtype without ``--dtype`` is bf16, the spec language's default."""
    path = args.spec
    program = compile_file(path)
    given = {n: getattr(args, n, None) for n in SHAPE_FLAGS}
    missing = [n for n in program.generic if given[n] is None]
    if missing:
        flags = " and ".join(f"{SHAPE_FLAGS[n]} {_SHAPE_METAVARS[n]}" for n in missing)
        raise InputError(f"{path}: spec '{program.name}' leaves {' and '.join(missing)} to the call (a "
                         f"shape-generic spec): give {flags} (from Python, attnc.compile(spec) takes them "
                         "from each call's tensors)")
    if all(v is None for v in given.values()):
        return program
    heads = given["heads"] or (program.heads_q, program.heads_kv)
    dims = given["head_dim"] or (program.d_qk, program.d_v)
    return ir.specialize(program, *heads, *dims, given["dtype"] or program.dtype, where=path,
                         flags={n: f for n, f in SHAPE_FLAGS.items() if given[n] is not None})


def _out(text: str, path: str | None) -> None:
    if path:
        try:
            Path(path).write_text(text)
        except OSError as e:  # a directory, a missing folder, a read-only file
            raise AttncError(f"cannot write {path}: {e.strerror or e}") from None
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
            heads = "from the call" if "heads" in p.open_fields else f"{p.heads_q}/{p.heads_kv}"
            dims = "from the call" if "head_dim" in p.open_fields else f"{p.d_qk}/{p.d_v}"
            dtype = "dtype from the call" if "dtype" in p.open_fields else p.dtype
            print(f"{path}: ok ({p.name}: heads {heads}, head_dim {dims}, "
                  f"{dtype}, {len(p.tensors)} tensor(s), {len(p.score)} score statement(s)"
                  + (f", sink {ir.format_expr(p.sink)})" if p.sink is not None else ")"))
    return 1 if failed else 0


def cmd_compile(args) -> int:
    program = _concrete(args)
    _out(backend(args.backend).emit(program).text, args.output)
    return 0


def cmd_ir(args) -> int:
    from .printer import print_program
    _out(print_program(compile_file(args.spec)), args.output)
    return 0


def cmd_run(args) -> int:
    program = _concrete(args)
    if args.check and not args.inputs:  # the oracle's rectangle, refused before anything is drawn
        s_q = args.kv_len if args.q_len is None else args.q_len
        oracle.require_rectangle(program, args.batch * program.heads_q * s_q * args.kv_len)
    if args.inputs:
        arrays = inputs.load_npz(args.inputs)
    elif program.cache.kind.value != "contiguous":  # a sampled paged/ragged cache (shuffled pages)
        arrays = inputs.sample_cache(program, [args.kv_len] * args.batch,
                                     [args.kv_len if args.q_len is None else args.q_len] * args.batch, args.seed)
    else:
        s_k = args.kv_len
        arrays = inputs.sample(program, args.batch, s_k if args.q_len is None else args.q_len, s_k, args.seed)
    if inputs.is_split_call(program, arrays):
        return _run_split(args, program, arrays)

    if args.cuda_graph:
        raise InputError("--cuda-graph replays split calls (a paged or ragged cache, or per-request lengths); "
                         "this is a prefill over a contiguous cache, which the launcher runs directly")
    call = inputs.validate(program, arrays)
    if args.check:  # refused before the kernel runs, not after
        oracle.require_rectangle(program, call.batch * program.heads_q * call.s_q * call.s_k)
    name = _select_backend(args, program, [call.s_q] * call.batch, [call.s_k] * call.batch)
    if (args.sp or args.report) and name != "ahbm":
        raise InputError("--sp and --report run on the AHBM mesh simulator: add --backend ahbm")
    kernel = backend(name).load(program, **({"sp": args.sp} if args.sp else {}))
    t0 = time.perf_counter()
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                    **{t.name: arrays[t.name] for t in program.tensors})
    elapsed = time.perf_counter() - t0
    _save_outputs(args.out, o, lse)
    print(f"{program.name} on {name}: B={call.batch} S_q={call.s_q} S_k={call.s_k} "
          f"o {list(o.shape)} {o.dtype}, lse {list(lse.shape)} in {elapsed * 1e3:.1f} ms"
          + (f" -> {args.out}" if args.out else ""))
    if args.report:  # the simulated latency per engine and the op-log counters
        sys.stdout.write(kernel.report())
    if args.check:
        ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
        results = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse,
                                           ref_o, ref_lse)
        for r in results:
            print(f"  vs float64 oracle: {r}")
        return 0 if all(r.ok for r in results) else 1
    return 0


def _select_backend(args, program, s_q: list[int], s_k: list[int]) -> str:
    """The backend this call runs on: dispatch admission under ``--backend`` (auto: the first
    eligible by priority; a name: that backend or an error with every reason it refuses)."""
    from .dispatch import dispatch, run_environment
    request = args.backend
    env = run_environment("ahbm" if request == "ahbm" else None, request)
    call = {"B": len(s_k), "S_q": [int(x) for x in s_q], "S_k": [int(x) for x in s_k],
            "graph_mode": bool(args.cuda_graph), "backend_request": request}
    return dispatch(program, call, env).require()


def _save_outputs(path: str | None, o, lse) -> None:
    if path:
        try:
            np.savez(path, o=o, lse=lse)
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def _run_split(args, program, arrays) -> int:
    """`attnc run` over a paged/ragged cache or with per-request lengths (DESIGN §5 keys):
    packed q, o [total_q, H_q, d_v], lse [total_q, H_q]."""
    call = inputs.validate_cache(program, arrays)
    if args.check:
        oracle.require_rectangle(program, program.heads_q * int((call.q_lens * call.kv_lens).sum()))
    active = np.flatnonzero((call.q_lens > 0) & (call.kv_lens > 0))  # (rows over no keys see nothing)
    if not active.size:
        raise InputError("inputs: no request has both query rows and keys: nothing to compute")
    name = _select_backend(args, program, call.q_lens[active].tolist(), call.kv_lens[active].tolist())
    kernel = backend(name).load(program)
    if not hasattr(kernel, "run"):
        raise InputError(f"the {name} backend does not run {inputs.cache_description(program)} "
                         "calls yet; use --backend numpy")
    t0 = time.perf_counter()
    o, lse = kernel.run(arrays, return_lse=True, **({"cuda_graph": True} if args.cuda_graph else {}))
    elapsed = time.perf_counter() - t0
    _save_outputs(args.out, o, lse)
    lens = call.kv_lens.tolist()
    print(f"{program.name} on {name}: B={call.batch} over a {inputs.cache_description(program)}, "
          f"kv_lens {lens}, q_lens {call.q_lens.tolist()}: o {list(o.shape)} {o.dtype}, "
          f"lse {list(lse.shape)} in {elapsed * 1e3:.1f} ms" + (" (captured, replayed)" if args.cuda_graph else "")
          + (f" -> {args.out}" if args.out else ""))
    if args.check:
        ref_o, ref_lse = oracle.reference_cache(program, call)
        results = numerics.compare_outputs(program.dtype, o, lse, ref_o, ref_lse)
        for r in results:
            print(f"  vs float64 oracle: {r}")
        return 0 if all(r.ok for r in results) else 1
    return 0


def _integer(text: str, lo: int, hi: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
    if hi is not None and value > hi:
        raise argparse.ArgumentTypeError(f"{value} exceeds {hi} (2^30): the language's limit on positions")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _count(text: str) -> int:
    return _integer(text, 0)


def _length(text: str) -> int:
    """A sequence length: 1 <= n <= 2^30 (the language's limit on positions)."""
    return _integer(text, 1, resources.MAX_LENGTH)


def _pair(text: str) -> tuple[int, int]:
    """``--heads``/``--head-dim``: N, or A/B as the spec language writes them (heads = 16 / 4)."""
    first, sep, second = text.partition("/")
    values = [_integer(x.strip(), 1) for x in ((first, second) if sep else (first,))]
    if max(values) > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{max(values)} exceeds {MAX_SIZE}: sizes are i32")
    return (values[0], values[-1])


def _size(text: str) -> int:
    try:
        return resources.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lengths_arg(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected non-negative lengths, got {text!r}")
    too_long = [x for x in out if x > resources.MAX_LENGTH]
    if too_long:
        raise argparse.ArgumentTypeError(f"length {too_long[0]} exceeds {resources.MAX_LENGTH} (2^30): the "
                                         "language's limit on positions")
    return out


def _ids_arg(text: str) -> list:
    """Comma-separated request ids: integers where they parse as one, else strings."""
    return [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in text.split(",")]


def cmd_plan(args) -> int:
    from .analysis import schedule
    from .launch_plan import plan_launch
    from .plan import logical_layout
    program = _concrete(args)
    if args.ranks is not None:
        return _plan_ranks(args, program)
    kv = args.kv_lens
    q = args.q_lens if args.q_lens is not None else [1] * len(kv)  # decode, as the kernels' default
    if len(q) != len(kv):
        raise InputError(f"--q-lens has {len(q)} entries, --kv-lens {len(kv)}")
    plan = plan_launch(program, logical_layout(program, kv), np.asarray(q, np.int64), device=args.device,
                       num_sms=args.sms)
    if args.graph:
        dot = Path(args.graph)
        try:
            dot.write_text(schedule.to_dot(plan.graph, program.name))
            dot.with_suffix(".json").write_text(schedule.to_json(plan.graph, indent=1) + "\n")
        except OSError as e:
            raise InputError(f"cannot write {dot}: {e}") from None
    if args.json:
        report = plan.report(args.request_ids, args.cache_rows)
        if args.graph:
            report["graph"] = {"dot": str(dot), "json": str(dot.with_suffix(".json"))}
        print(json.dumps(report))
    else:
        sys.stdout.write(plan.text())
        if args.graph:
            print(f"schedule graph -> {dot}, {dot.with_suffix('.json')}")
    return 0


def _plan_ranks(args, program) -> int:
    """`attnc plan --ranks N`: a context-parallel plan of B prefill requests of one length."""
    from .cp import plan_cp
    from .explain import call_tensors
    kv = args.kv_lens
    if args.q_lens is not None and args.q_lens != kv:
        raise InputError("--ranks plans prefill (every token a query row and a key): drop --q-lens")
    if len(set(kv)) != 1:
        raise InputError(f"--ranks: the requests of a context-parallel call share one length; --kv-lens has "
                         f"{', '.join(str(x) for x in sorted(set(kv)))}")
    if args.graph:
        raise InputError("--graph writes a split call's schedule; it does not apply with --ranks")
    batch, seq = len(kv), kv[0]
    tensors = call_tensors(program, batch, seq, seq, _load_tensor_args(args.tensor), args.seed)
    plan = plan_cp(program, batch, seq, args.ranks, tensors, block=args.block, strategy=args.strategy)
    sys.stdout.write(json.dumps(plan.report()) + "\n" if args.json else plan.text())
    return 0


def _load_tensor_args(items: list[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--tensor takes NAME=FILE.npy, got {item!r}")
        if name in out:
            raise InputError(f"--tensor {name} given twice")
        out[name] = inputs.load_npy(path, f"tensor file for '{name}'")
    return out


def cmd_explain(args) -> int:
    from . import explain as ex
    if args.out and args.format is None:
        raise InputError("--out writes a --format export (paddle or flex)")
    program = _concrete(args)
    s_k = args.kv_len
    s_q = args.q_len if args.q_len is not None else s_k
    tensors = ex.call_tensors(program, args.batch, s_q, s_k, _load_tensor_args(args.tensor), args.seed)
    block_m, block_n = args.block
    expl = ex.explain(program, args.batch, s_q, s_k, tensors, block_m, block_n)
    if args.format == "paddle":
        pm = expl.paddle()
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


def cmd_bench(args) -> int:
    """The GPU benchmark harness: attnc.bench (bench/ in a checkout), imported here only."""
    try:
        import torch
    except ImportError:
        raise AttncError("attnc bench needs torch and triton on a CUDA machine (pip install 'attnc[gpu]')") from None
    if not torch.cuda.is_available():
        raise AttncError("attnc bench measures GPU kernels; no CUDA device is visible")
    from ..bench import harness
    args.out = _bench_out(args.out, args.what)
    command = "attnc bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [args.what])
    if args.what == "decode":
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")] if args.cases else None
        rows = harness.run_decode(cases=cases, out=args.out, command=command, graph=not args.no_graph,
                                  configs=() if args.no_configs else harness.DECODE_CONFIGS)
    elif args.what == "append":
        from ..bench.append import check_scores, run_append
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")] if args.cases else None
        if cases and any(len(c) != 4 for c in cases):
            raise AttncError("attnc bench append --cases: B:T:C:page_size,... (e.g. 4:8192:2048:16)")
        scores = tuple("" if n == "none" else n for n in (args.scores or "none").split(","))
        try:
            check_scores(scores)
        except ValueError as e:
            raise AttncError(f"attnc bench append --scores: {e}") from None
        rows = run_append(cases=cases, out=args.out, command=command, flex=bool(args.flex_modes), scores=scores)
    elif args.what == "backward":
        from ..bench.backward import run_backward
        rows = run_backward(**_bench_shape(args), masks=args.masks.split(",") if args.masks else None, out=args.out,
                            command=command, flex_modes=tuple(m for m in args.flex_modes.split(",") if m),
                            sdpa=not args.no_sdpa, flex_flash=not args.no_flex_flash, fa4=not args.no_fa4)
    elif args.cases:  # prefill: issue 21's cases, by name (the table's shapes)
        if args.masks:
            raise AttncError("attnc bench prefill: give --cases or --masks, not both (--cases names the masks too)")
        if args.heads is not None or args.head_dim is not None:
            raise AttncError("attnc bench prefill --cases: heads and head dims are the cases' own "
                             "(--batch and --seq may replace every case's, for a smaller run)")
        try:
            cases = harness.select_cases(args.cases, batch=args.batch, seq=args.seq)
        except ValueError as e:
            raise AttncError(f"attnc bench prefill --cases: {e}") from None
        rows = harness.run_prefill(cases=cases, out=args.out, command=command,
                                   flex_modes=tuple(m for m in args.flex_modes.split(",") if m),
                                   sdpa=not args.no_sdpa, issue21=True, flex_flash=not args.no_flex_flash,
                                   fa4=not args.no_fa4)
    else:
        rows = harness.run_prefill(**_bench_shape(args), masks=args.masks.split(",") if args.masks else None,
                                   out=args.out, command=command,
                                   flex_modes=tuple(m for m in args.flex_modes.split(",") if m),
                                   sdpa=not args.no_sdpa, flex_flash=not args.no_flex_flash, fa4=not args.no_fa4)
    print(harness.summary(rows))
    return 0


def _bench_out(path: str | None, what: str) -> str:
    """Where the rows go: --out, else ./bench-results/WHAT-<UTC time>.jsonl under the current
    directory (never beside the installed package)."""
    if path is None:
        path = str(Path("bench-results") / f"{what}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.jsonl")
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"attnc bench: cannot write {path}: {e.strerror or e}") from None
    if target.is_dir() or not os.access(target if target.exists() else target.parent, os.W_OK):
        raise InputError(f"attnc bench: cannot write {path}")
    print(f"attnc bench {what}: rows -> {path}", file=sys.stderr)
    return path


def _bench_shape(args) -> dict:
    """The bench's shape options with their defaults (B 4, H 16, S 8192, d 128)."""
    given = {"batch": args.batch, "heads": args.heads, "seq": args.seq, "head_dim": args.head_dim}
    defaults = {"batch": 4, "heads": 16, "seq": 8192, "head_dim": 128}
    return {n: defaults[n] if x is None else x for n, x in given.items()}


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args.spec, args.backend, length=args.length, batch=args.batch, seed=args.seed)


def _load_call(path: str) -> dict:
    try:
        call = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read call file {path}: {e}") from None
    if not isinstance(call, dict):
        raise InputError(f"call file {path}: expected one JSON object of call fields")
    return call


def cmd_dispatch(args) -> int:
    from .dispatch import CALL_ALIASES, DispatchKey, select
    program = _concrete(args)
    call = _load_call(args.call)
    if args.force:  # the command line's request replaces the file's, whatever its spelling
        call = {n: v for n, v in call.items() if CALL_ALIASES.get(n, n) != "backend_request"}
        call["backend_request"] = args.force
    sel = select(DispatchKey.from_call(program, call))
    sys.stdout.write(json.dumps(sel.to_json()) + "\n" if args.json else sel.text())
    return 0 if sel.selected else 1


def cmd_tune(args) -> int:
    from . import evidence, tune
    program = _concrete(args)
    shapes = tune.parse_shapes(args.shapes)
    if args.evidence and args.repeats < evidence.MIN_SAMPLES:
        raise InputError(f"--evidence rows need at least {evidence.MIN_SAMPLES} raw samples; "
                         f"--repeats is {args.repeats}")
    cache = tune.TuneCache(args.cache)
    results = tune.tune(program, shapes, args.backend, cache=cache, warmup=args.warmup, repeats=args.repeats,
                        seed=args.seed, retune=args.retune)
    if args.evidence:
        rows = [r for res in results for r in res.rows]
        for r in rows:
            evidence.check_row(r)
        try:
            with open(args.evidence, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        except OSError as e:
            raise InputError(f"cannot write evidence rows to {args.evidence}: {e.strerror or e}") from None
    stored = not cache.write_errors  # (each failure was reported on stderr as it happened)

    def untuned(e) -> dict:  # an entry from the file may predate these fields
        return e["untuned"] if isinstance(e.get("untuned"), dict) else {}

    if args.json:
        print(json.dumps({"spec": program.name, "backend": args.backend, "cache": str(cache.path), "stored": stored,
                          "results": [{"shape": str(r.shape), "digest": r.key.digest, "cached": r.cached,
                                       "config": r.config, "median_ms": r.entry["median_ms"],
                                       "untuned": untuned(r.entry),
                                       "speedup_vs_untuned": r.entry.get("speedup_vs_untuned")} for r in results]}))
        return 0 if stored else 1
    print(f"{program.name} on {args.backend}: tuning cache {cache.path}")
    print(f"  {'B:S_q:S_k':14} {'key':12}  {'median ms':>10} {'untuned ms':>10} {'speedup':>7}  winner")
    for r in results:
        e = r.entry
        base = untuned(e).get("median_ms")
        base = base if isinstance(base, (int, float)) and not isinstance(base, bool) else None
        speedup = e.get("speedup_vs_untuned")
        sp = f"{speedup:.2f}x" if isinstance(speedup, (int, float)) and speedup else "-"
        cfg = " ".join(f"{k}={v}" for k, v in e["config"].items())
        print(f"  {str(r.shape):14} {r.key.digest[:12]}  {e['median_ms']:10.4g} "
              f"{base if base is None else format(base, '10.4g'):>10} {sp:>7}  {cfg}"
              + ("  (cached)" if r.cached else ""))
    if args.evidence:
        print(f"evidence rows -> {args.evidence}")
    if not stored:
        print(f"not stored: {cache.write_errors[0]}", file=sys.stderr)
    return 0 if stored else 1


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="attnc", description="compiler for attention mask programs")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of located errors")
    ap.add_argument("--version", action="version", version=f"attnc {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    backends = sorted(REGISTRY)
    limits = argparse.ArgumentParser(add_help=False)  # the commands that plan, sample or evaluate
    limits.add_argument("--memory-limit", type=_size, default=None, metavar="SIZE",
                        help=f"refuse a call whose estimated host memory exceeds SIZE (e.g. 8GiB; default "
                             f"${resources.ENV_VAR} or {resources.format_size(resources.DEFAULT_MEMORY_LIMIT)})")

    shape = argparse.ArgumentParser(add_help=False)  # the commands that need a call's shape
    g = shape.add_argument_group(
        "shape", "what a shape-generic spec leaves to the call; where the spec declares a value, the flag "
                 "must agree with it (as attnc.compile checks a call's tensors)")
    g.add_argument("--heads", type=_pair, default=None, metavar=_SHAPE_METAVARS["heads"],
                   help="query heads H, or H_q/H_kv for GQA (e.g. 16/4: 4 K/V heads, each shared by 4 query heads)")
    g.add_argument("--head-dim", type=_pair, default=None, metavar=_SHAPE_METAVARS["head_dim"],
                   help="head dim of q, k and v, or d_qk/d_v (e.g. 192/128)")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="storage dtype of q, k, v and o (default: the spec's; bf16 where it leaves dtype open)")

    p = sub.add_parser("check", help="parse and check specs; exit 1 with located errors")
    p.add_argument("spec", nargs="+")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("compile", parents=[shape], help="print generated source for a backend")
    p.add_argument("spec")
    p.add_argument("--backend", default="numpy", choices=backends)
    p.add_argument("-o", "--output")
    p.set_defaults(fn=cmd_compile)

    p = sub.add_parser("ir", help="print the IR as an MLIR module (generic syntax, attn dialect)")
    p.add_argument("spec")
    p.add_argument("-o", "--output")
    p.set_defaults(fn=cmd_ir)

    p = sub.add_parser("run", parents=[limits, shape], help="run a spec on inputs (npz) or on sampled inputs")
    p.add_argument("spec")
    p.add_argument("--backend", default="auto", choices=["auto", *backends],
                   help="auto (default): the first backend whose admission takes the call (attnc dispatch "
                        "explains the choice); a name forces that backend or fails with every reason")
    p.add_argument("--inputs", help="npz with q, k, v and every declared tensor")
    p.add_argument("--out", help="npz to write o and lse to")
    p.add_argument("--check", action="store_true", help="compare with the float64 oracle")
    p.add_argument("--batch", type=_positive, default=2, help="sampled inputs: B")
    p.add_argument("--q-len", type=_length, default=None, help="sampled inputs: S_q (default S_k)")
    p.add_argument("--kv-len", type=_length, default=128, help="sampled inputs: S_k")
    p.add_argument("--seed", type=_count, default=0)
    p.add_argument("--sp", type=_positive, default=None, metavar="N",
                   help="ahbm: N PEs per (request, K/V head): decode round-robin + tree, prefill ring")
    p.add_argument("--report", action="store_true",
                   help="ahbm: print the simulated latency per engine and PE, and the op-log counters")
    p.add_argument("--cuda-graph", action="store_true",
                   help="triton on a GPU, split calls (paged or ragged cache, per-request lengths): capture the "
                        "call in a CUDA graph and replay it (graph_mode; Kernel.decode_graph)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser(
        "explain", parents=[limits, shape], help="FlashMask intervals, representability, tile classes and "
                                                 "metadata ledger for one call shape; Paddle / Flex exports",
        description="Analyse the mask for B requests of S_q query rows over S_k keys "
                    "(bottom-right aligned). Tensors come from --tensor files, else "
                    "from the spec's sample distributions (the values `attnc run` draws for the "
                    "same --batch, lengths and --seed).")
    p.add_argument("spec")
    p.add_argument("--q-len", type=_length, default=None, help="S_q (default S_k: prefill)")
    p.add_argument("--kv-len", type=_length, required=True, help="S_k")
    p.add_argument("--batch", type=_positive, default=1, help="B (default 1)")
    p.add_argument("--tensor", action="append", default=[], metavar="NAME=FILE.npy",
                   help="a declared tensor's value (repeatable); the others are sampled")
    p.add_argument("--seed", type=_count, default=0, help="seed of the sampled tensors")
    p.add_argument("--block", type=_block, default=(128, 64), metavar="MxN",
                   help="tile: block_m query rows x block_n keys (default 128x64)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (stable field names)")
    fmt.add_argument("--format", choices=("paddle", "flex"),
                     help="export: Paddle FlashMask startend_row_indices + causal, or "
                          "FlexAttention BlockMask tensors (JSON)")
    p.add_argument("--out", metavar="FILE.npz", help="with --format: write the arrays to an .npz "
                                                     "(paddle: or .npy) instead of listing them")
    p.add_argument("--png", metavar="FILE", help="tile-class map of (b=0, h=0) as a PNG (needs attnc[plot])")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser(
        "plan", parents=[limits, shape], help="split bounds, launch grids, workspace bytes and ledgers of a "
                                              "split call; the schedule graph",
        description="Plan a split-K/V call of B requests (bottom-right positions): the "
                    "spec's split policy and state ABI, its heads, head_dim, dtype and "
                    "cache (pages are allocated in request order), as the GPU backend launches it "
                    "(engine, slots, workspace: its own decision, given the --device facts).")
    p.add_argument("spec")
    p.add_argument("--kv-lens", type=_lengths_arg, required=True, metavar="T0,T1,...",
                   help="visible K/V length of each request (its query rows included)")
    p.add_argument("--q-lens", type=_lengths_arg, default=None, metavar="C0,C1,...",
                   help="query rows of each request (default 1 per request: decode; a request with "
                        "kv_len 0 then has one row that sees nothing)")
    p.add_argument("--device", default=None, metavar="here|sm_XY",
                   help="the GPU whose launch the plan reports: 'here' reads this host's (its tuning cache applies; "
                        "Triton's interpreter under TRITON_INTERPRET=1), sm_90 assumes one (132 SMs, Gluon) and reads "
                        "nothing (default: here under the interpreter, else sm_90)")
    p.add_argument("--sms", type=_positive, default=None,
                   help="SMs the heuristic/auto split plans for (default: the device's; 132 when assumed)")
    p.add_argument("--request-ids", type=_ids_arg, default=None,
                   metavar="ID0,ID1,...", help="the manifest's request ids (default 0,1,...)")
    p.add_argument("--cache-rows", type=_lengths_arg, default=None, metavar="R0,R1,...",
                   help="the manifest's cache row of each request (default 0,1,...)")
    p.add_argument("--json", action="store_true", help="one JSON object (stable field names), with the "
                                                       "frozen microbatch manifest")
    p.add_argument("--graph", metavar="FILE.dot", help="write the schedule graph as DOT, and as JSON beside it")
    cp = p.add_argument_group("context parallelism (--ranks): B prefill requests of --kv-lens tokens each")
    cp.add_argument("--ranks", type=_positive, default=None, metavar="N",
                    help="plan the call over N ranks: tokens, computed cells and K/V bytes per rank")
    cp.add_argument("--strategy", default="auto", choices=("auto", "even", "zigzag", "balanced"),
                    help="how tiles are assigned to ranks (default auto)")
    cp.add_argument("--block", type=_positive, default=128, help="tokens per tile (default 128)")
    cp.add_argument("--tensor", action="append", default=[], metavar="NAME=FILE.npy",
                    help="a declared tensor's value (repeatable); the others are sampled")
    cp.add_argument("--seed", type=_count, default=0, help="seed of the sampled tensors")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("dispatch", parents=[shape], help="the dispatch key of a call, every backend's admission "
                                        "and the selection (or every reason there is none)",
                       description="Freeze the dispatch key of the call in CALL.json (B, S_q, S_k per "
                                   "request, device, phase, graph_mode, ...; the README's \"The command line\" has an "
                                   "example) against the spec, check its semantics, and "
                                   "apply the policy: auto takes the first eligible backend by priority, "
                                   "--force fails closed.  Exit 1 when no backend is selected.")
    p.add_argument("spec")
    p.add_argument("--call", required=True, metavar="CALL.json", help="one JSON object of call fields")
    p.add_argument("--force", metavar="BACKEND", help="forced policy: this backend or an error with every reason")
    p.add_argument("--json", action="store_true", help="one JSON object: key, digest, candidates, selection")
    p.set_defaults(fn=cmd_dispatch)

    p = sub.add_parser(
        "tune", parents=[limits, shape], help="search a backend's launch configs per dispatch key; store the "
                                              "winners with raw samples in the tuning cache",
        description="For each B:S_q:S_k shape, check every candidate config against the "
                    "float64 oracle before timing it, time the passing ones (synchronized "
                    "raw samples) and store the winner in the JSON cache keyed by the "
                    "dispatch key's digest.  Progress goes to stderr.")
    p.add_argument("spec")
    p.add_argument("--shapes", required=True, metavar="B:S_q:S_k,...", help="call shapes to tune")
    p.add_argument("--backend", default="triton", help="backend whose space is searched (default triton)")
    p.add_argument("--cache", metavar="FILE", default=None,
                   help="tuning cache (default $ATTNC_TUNE_CACHE or ~/.cache/attnc/tune.json; a directory "
                        "means DIR/tune.json)")
    p.add_argument("--warmup", type=_count, default=5, help="untimed calls before the samples (default 5)")
    p.add_argument("--repeats", type=_positive, default=20, help="raw samples per candidate (default 20)")
    p.add_argument("--seed", type=_count, default=0, help="seed of the sampled inputs")
    p.add_argument("--retune", action="store_true", help="tune keys the cache already has again")
    p.add_argument("--evidence", metavar="FILE.jsonl", help="append one validated evidence row per candidate")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("bench", help="GPU: our Triton kernels against FlexAttention and SDPA in one "
                                     "process; JSON lines with correctness and raw samples")
    p.add_argument("what", choices=["prefill", "decode", "backward", "append"])
    p.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="JSON lines, appended (default ./bench-results/WHAT-<UTC time>.jsonl)")
    p.add_argument("--masks", default=None, help="prefill: comma-separated subset of "
                                                 "causal,sliding_window_1024,causal_document,prefix_lm_2048,full")
    p.add_argument("--batch", type=_positive, default=None, help="default 4 (with prefill --cases: replaces "
                                                                   "every case's B)")
    p.add_argument("--heads", type=_positive, default=None, help="default 16 (not with prefill --cases)")
    p.add_argument("--seq", type=_length, default=None, help="default 8192 (with prefill --cases: replaces "
                                                               "every case's S)")
    p.add_argument("--head-dim", type=_positive, default=None, help="default 128 (not with prefill --cases)")
    p.add_argument("--flex-modes", default="default,max-autotune-no-cudagraphs", help="comma-separated "
                   "torch.compile modes of FlexAttention (eager: uncompiled, to check the bench itself); empty: "
                   "no FlexAttention")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--no-flex-flash", action="store_true", help="prefill, backward: no Flex "
                   "kernel_options={'BACKEND': 'FLASH'} rows (they need flash_attn.cute importable)")
    p.add_argument("--no-fa4", action="store_true", help="prefill, backward: no FlashAttention-4 rows "
                   "(flash_attn.cute)")
    p.add_argument("--cases", default=None, help="prefill: 'all' or a comma list of issue 21's cases "
                   "(causal, sliding_window_1024, causal_document, prefix_lm_2048, full, causal_s8000, "
                   "causal_d64_h32, alibi, softcap30_gqa, mla_192_128, causal_d256, fp8_causal; each at its own "
                   "shape), ending with issue 21's summary; decode: B:T,... (default 8:8192,32:8192,1:131072,64:2048); "
                   "append: B:T:C:page,... (default 4:8192:2048:16,4:8192:2048:128,8:2048:1024:16,1:2048:2048:16)")
    p.add_argument("--scores", default=None, help="append: comma-separated score programs, each case timed "
                   "with each: none, alibi, softcap30 (default none)")
    p.add_argument("--no-graph", action="store_true", help="decode: no CUDA-graph rows")
    p.add_argument("--no-configs", action="store_true", help="decode: no fixed-config rows")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("demo", parents=[limits], help="compile and run examples for prefill, append and decode "
                                    "against the float64 oracle")
    p.add_argument("spec", nargs="*", help="specs (default: every example shipped with attnc)")
    p.add_argument("--backend", default="numpy", choices=backends)
    p.add_argument("--length", type=_length, default=128, help="S_k of every phase")
    p.add_argument("--batch", type=_positive, default=2)
    p.add_argument("--seed", type=_count, default=0)
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with resources.overridden(getattr(args, "memory_limit", None)):
            return args.fn(args)
    except AttncError as e:
        if args.debug:
            raise
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
