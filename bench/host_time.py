"""Host (CPU) time per call of the public API, and the launches each call makes (issues 33, 34).

Cases, each after warm calls (plan made, launch bound; the plan reused):
  prefill_causal     ``attn(q, k, v)`` under torch.no_grad, a closed-form mask;
  prefill_doc        ``attn(q, k, v, doc=doc)`` under torch.no_grad, a mask reading a tensor;
  prefill_sinks      ``attn(q, k, v, sinks=sinks)`` under torch.no_grad, gpt-oss's sliding layer
                     (``sink = sinks[h]``, window 128, GQA 8:1, d 64);
  prefill_grad       ``attn(q, k, v)`` with q, k, v requiring grad (a training forward);
  backward           ``torch.autograd.grad(o, (q, k, v), do, retain_graph=True)`` on a graph made
                     once (``attnc bench backward``'s bwd phase);
  backward_direct    the same backward called on this thread, as the eager autograd formula calls it
                     (``Attention._eager_backward``: the bound backward of the forward's signature, or
                     with ``--bound 0`` the route's ``backward``), without autograd's engine: on a GPU
                     autograd runs the backward on its device thread, which cProfile (``--profile``)
                     does not see;
  decode_paged       ``attn.decode(q, k_cache=, v_cache=, block_table=, kv_lens=)``, GQA 32/8, d 128,
                     paged nhd cache (page 16), metadata on the host, as ``attnc bench decode``
                     (after the warm calls: its bound split call, ``bound_decode.py``).

``--bound 0`` makes every call (prefill, backward and decode) take the validating path (the A/B's other arm).

Two modes:
  gpu   (a CUDA device): real launches; host us per call over back-to-back calls (synchronized
        before and after each round, not inside), shapes of issue 34 (B=1 H=16 S=2048 d=128 bf16
        prefill, B=8 T=8K decode); launches per call counted twice: ``Launcher.launch`` calls and
        the CUDA kernels, memsets and copies the profiler sees.
  stub  (any machine; the default without CUDA): ``Launcher.launch`` replaced by a counter, so the
        Python path alone is timed (no kernel runs), small shapes, f16, the Triton kernels'
        interpreter (TRITON_INTERPRET=1) never entered.  The calls take the GPU's path for their
        rows' non-finite check (``runtime.marks_on_device``: marked on the device, no host check);
        the backward takes the Gluon passes as on the H200 (``--stub-backward gluon``, the default:
        ``gluon_backward.refusal`` and Triton's stream query stood in for) or the interpreter's
        Triton passes (``triton``).  Stub mode runs on one thread: it cannot see the GPU's hand-off
        of autograd's backward to its device thread.
        ``device_ops`` lists the torch operations of a call that would launch a kernel on a GPU
        (zeros, copies...), from the profiler's CPU events; ``syncs`` counts host syncs (.item()).

  python3 -m bench.host_time [--mode gpu|stub] [--cases a,b] [--calls N] [--rounds R]
                             [--bound 1|0] [--stub-backward gluon|triton] [--profile CASE]
                             [--out FILE.jsonl]

Rows (JSON lines, appended, each with its command) go to --out (default
bench/results/studies/host_time_<mode>.jsonl).  --profile CASE prints cProfile's table of that
case instead of timing.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

CASES = ("prefill_causal", "prefill_doc", "prefill_sinks", "prefill_grad", "backward", "backward_direct",
         "decode_paged")
# torch operations that never launch a kernel on a GPU (allocation, views, metadata)
NO_KERNEL = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::permute", "aten::as_strided",
    "aten::expand", "aten::detach", "aten::alias", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::t", "aten::contiguous", "aten::clone", "aten::_to_copy", "aten::to", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::set_", "aten::_reshape_alias", "aten::result_type",
    "aten::zeros", "aten::zeros_like", "aten::ones_like", "aten::full", "aten::is_nonzero", "aten::item"})
SYNC_OPS = frozenset({"aten::_local_scalar_dense"})


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("gpu", "stub"), default=None,
                    help="gpu: real launches (needs CUDA); stub: launches replaced by a counter (default without CUDA)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--calls", type=int, default=None, help="calls per round (default: gpu 50, stub 300)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds; the best round's mean is reported")
    ap.add_argument("--profile", default=None, metavar="CASE", help="print cProfile's table of CASE, no timing")
    ap.add_argument("--bound", type=int, choices=(0, 1), default=1,
                    help="1: calls take their bound calls (backends/triton/bound.py, bound_decode.py, "
                         "bound_backward.py); 0: every call validates (A/B)")
    ap.add_argument("--stub-backward", choices=("gluon", "triton"), default="gluon",
                    help="stub mode: the backward's passes, the H200's Gluon ones (default) or the interpreter's "
                         "Triton ones")
    ap.add_argument("--out", default=None, metavar="FILE.jsonl")
    a = ap.parse_args(argv)
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases + ([a.profile] if a.profile else []) if c not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r} (cases: {', '.join(CASES)})")
    return a


def setup(mode: str):
    """Import attnc for ``mode``: stub mode sets TRITON_INTERPRET before triton is imported."""
    if mode == "stub":
        os.environ["TRITON_INTERPRET"] = "1"
    if not __package__:  # run as a file from a checkout: its attnc
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# ---------------------------------------------------------------- counting launches
class Launches:
    """``Launcher.launch`` wrapped while in the ``with`` block: each launch counted by kernel name
    (``counts``) and, where it ran, by the path it took (``paths``: the JIT, the compiled kernel's
    launcher, or its C launcher straight, ``raw_launch``); ``stub``: nothing launched."""

    def __init__(self, stub: bool):
        from attnc.backends.triton import bound, bound_decode, launch as L
        self.L, self.bound, self.bound_decode, self.stub, self.counts, self.paths = L, bound, bound_decode, stub, {}, {}
        self.original, self.original_go = L.Launcher.launch, bound.BoundLaunch._go
        self.original_split_go = bound_decode.BoundSplit._go

    def __enter__(self):
        counts, paths, original, stub = self.counts, self.paths, self.original, self.stub

        def launch(launcher, grid, args, key=None, stream=None):
            fn = getattr(launcher.fn, "fn", launcher.fn)  # (the interpreter wraps the function)
            name = getattr(fn, "__name__", "?")
            counts[name] = counts.get(name, 0) + 1
            if stub:
                return
            before = dict(launcher.launches)
            original(launcher, grid, args, key, stream)
            for way, n in launcher.launches.items():
                if isinstance(n, int) and n > before.get(way, 0):
                    paths[f"{name}:{way}"] = paths.get(f"{name}:{way}", 0) + 1
        self.L.Launcher.launch = launch

        original_go = self.original_go

        def go(run, raw, stream, args):  # a bound call's launch straight to the C launcher (bound.py)
            fn = getattr(run.launcher.fn, "fn", run.launcher.fn)
            name = getattr(fn, "__name__", "?")
            counts[name] = counts.get(name, 0) + 1
            paths[f"{name}:bound"] = paths.get(f"{name}:bound", 0) + 1
            if not stub:
                original_go(run, raw, stream, args)
        self.bound.BoundLaunch._go = go
        original_split_go = self.original_split_go

        def split_go(launcher, raw, grid, stream, args):  # a bound split call's (bound_decode.py)
            fn = getattr(launcher.fn, "fn", launcher.fn)
            name = getattr(fn, "__name__", "?")
            counts[name] = counts.get(name, 0) + 1
            paths[f"{name}:bound"] = paths.get(f"{name}:bound", 0) + 1
            if not stub:
                original_split_go(launcher, raw, grid, stream, args)
        self.bound_decode.BoundSplit._go = staticmethod(split_go)
        return self

    def __exit__(self, *exc):
        self.L.Launcher.launch = self.original
        self.bound.BoundLaunch._go = self.original_go
        self.bound_decode.BoundSplit._go = staticmethod(self.original_split_go)

    def take(self) -> tuple[dict, dict]:
        """(launches by kernel, launches by kernel and path) since the last take."""
        out = dict(self.counts), dict(self.paths)
        self.counts.clear()
        self.paths.clear()
        return out


def torch_ops(fn, calls: int = 4) -> tuple[dict, float]:
    """({op: per call} of the torch operations ``fn`` runs that would launch a kernel on a GPU,
    host syncs per call), from the profiler's CPU events (leaves of the op tree only; the legacy
    profiler: Kineto's first start costs seconds)."""
    from torch.autograd.profiler import profile
    try:
        with profile(use_kineto=False) as prof:
            for _ in range(calls):
                fn()
        events = prof.function_events
    except (RuntimeError, ValueError, AssertionError):  # (a build without the legacy profiler)
        from torch.profiler import ProfilerActivity, profile as kineto
        with kineto(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
        events = prof.events()
    ops, syncs = {}, 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        if e.name in SYNC_OPS:
            syncs += 1
        elif e.name not in NO_KERNEL and not any(c.name.startswith("aten::") for c in e.cpu_children):
            ops[e.name] = ops.get(e.name, 0) + 1
    return {n: c / calls for n, c in sorted(ops.items())}, syncs / calls


def cuda_kernels(fn, calls: int = 10) -> dict:
    """{kind: per call} of the GPU work ``fn`` issues, from the profiler's CUDA activity."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kinds: dict = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            kinds[e.name] = kinds.get(e.name, 0) + 1
    return {n: c / calls for n, c in sorted(kinds.items())}


# ---------------------------------------------------------------- the cases
def make_cases(names, mode: str) -> dict:
    """name -> (call, shape description)."""
    import torch
    import attnc
    gpu = mode == "gpu"
    dev = "cuda" if gpu else "cpu"
    dt, dts = (torch.bfloat16, "bf16") if gpu else (torch.float16, "f16")
    kw = {} if gpu else {"backend": "triton"}
    g = torch.Generator(device=dev).manual_seed(0)
    b, h, s, d = (1, 16, 2048, 128) if gpu else (1, 2, 64, 128)  # (d 128: the GPU's Gluon backward config)
    out = {}

    def qkv(grad=False):
        return [torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g).requires_grad_(grad) for _ in range(3)]
    causal = attnc.compile(f"attention host_causal {{ dtype = {dts} mask = causal }}")
    shape = {"B": b, "H": h, "S": s, "d": d, "dtype": dts}
    if "prefill_causal" in names:
        q, k, v = qkv()

        def prefill_causal():
            with torch.no_grad():
                return causal(q, k, v, **kw)
        out["prefill_causal"] = (prefill_causal, shape)
    if "prefill_doc" in names:
        q, k, v = qkv()
        docs = attnc.compile(f"attention host_doc {{ dtype = {dts} tensor doc: i32[b, s] "
                             "mask = causal & doc[b, q] == doc[b, k] }")
        doc = (torch.arange(s, device=dev) // max(1, s // 4)).to(torch.int32).expand(b, s).contiguous()

        def prefill_doc():
            with torch.no_grad():
                return docs(q, k, v, doc=doc, **kw)
        out["prefill_doc"] = (prefill_doc, {**shape, "mask": "causal documents, 4 per row"})
    if "prefill_sinks" in names:
        bs, hq, hkv, ss, ds = (1, 64, 8, 8192, 64) if gpu else (1, 16, 2, 64, 64)
        sink_attn = attnc.compile(f"attention host_sinks {{ heads = {hq}/{hkv} head_dim = {ds} dtype = {dts} "
                                  "tensor sinks: f32[h] mask = causal & window(128) sink = sinks[h] }")
        qs = torch.randn(bs, hq, ss, ds, device=dev, dtype=dt, generator=g)
        ks, vs = (torch.randn(bs, hkv, ss, ds, device=dev, dtype=dt, generator=g) for _ in range(2))
        sinks = torch.randn(hq, device=dev, dtype=torch.float32, generator=g)

        def prefill_sinks():
            with torch.no_grad():
                return sink_attn(qs, ks, vs, sinks=sinks, **kw)
        out["prefill_sinks"] = (prefill_sinks, {"B": bs, "H_q": hq, "H_kv": hkv, "S": ss, "d": ds, "dtype": dts,
                                                "mask": "causal & window(128)", "sink": "sinks[h]"})
    if "prefill_grad" in names or "backward" in names:
        q, k, v = qkv(grad=True)
        if "prefill_grad" in names:
            out["prefill_grad"] = (lambda: causal(q, k, v, **kw), shape)
        if "backward" in names:
            o = causal(q, k, v, **kw)
            do = torch.randn_like(o)
            out["backward"] = (lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), shape)
    if "backward_direct" in names:
        qb, kb, vb = qkv()  # (names of its own: the lambdas above read q, k, v when called)
        ob, lseb, route, key = causal._routed_forward(qb, kb, vb, {}, kw.get("backend"))
        dob = torch.randn_like(ob)
        out["backward_direct"] = (lambda: causal._eager_backward(route, key, qb, kb, vb, ob, lseb, dob, None, [], []),
                                  shape)
    if "decode_paged" in names:
        from attnc.compiler import dispatch
        if not gpu:  # split calls on CPU tensors default to the numpy backend: time the Triton path
            dispatch.device_default = lambda device: "triton"
        bd, t, hq, hkv, dd, page = (8, 8192, 32, 8, 128, 16) if gpu else (4, 256, 32, 8, 128, 16)
        dec = attnc.compile(f"attention host_decode {{ dtype = {dts} mask = causal "
                            f"cache = paged(page_size = {page}, layout = nhd) }}")
        pages = bd * t // page
        qd = torch.randn(bd, hq, dd, device=dev, dtype=dt, generator=g)
        kc, vc = (torch.randn(pages, page, hkv, dd, device=dev, dtype=dt, generator=g) for _ in range(2))
        table = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).view(bd, t // page).to(torch.int32)
        lens = torch.full((bd,), t, dtype=torch.int32)  # host metadata, as serving engines keep it
        cache = {"k_cache": kc, "v_cache": vc, "block_table": table, "kv_lens": lens}
        out["decode_paged"] = (lambda: dec.decode(qd, **cache),
                               {"B": bd, "T": t, "H_q": hq, "H_kv": hkv, "d": dd, "page": page, "dtype": dts})
    return {n: out[n] for n in names}


# ---------------------------------------------------------------- timing
def time_cases(cases: dict, calls: int, rounds: int, gpu: bool) -> tuple[dict, dict]:
    """name -> the best round's mean host us per call, wall clock and this thread's CPU time (the
    latter leaves out the time a loaded machine runs other processes), cases interleaved (the
    machine's load hits each alike)."""
    sync = __import__("torch").cuda.synchronize if gpu else (lambda: None)
    wall = {n: float("inf") for n in cases}
    cpu = dict(wall)
    for _ in range(rounds):
        for n, (fn, _) in cases.items():
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            wall[n] = min(wall[n], (time.perf_counter() - t0) / calls * 1e6)
            cpu[n] = min(cpu[n], (time.thread_time() - c0) / calls * 1e6)
            sync()
    return wall, cpu


def environment(mode: str) -> dict:
    import torch
    import triton
    import attnc
    return {"mode": mode, "device": torch.cuda.get_device_name() if mode == "gpu" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "attnc": attnc.__version__, "cpus": os.cpu_count()}


def main(argv=None) -> int:
    a = parse(argv)
    import torch  # (not triton: stub mode sets TRITON_INTERPRET before triton is imported)
    if a.mode is None:
        a.mode = "gpu" if torch.cuda.is_available() else "stub"
    if a.mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs a CUDA device")
    setup(a.mode)
    gpu = a.mode == "gpu"
    calls = a.calls or (50 if gpu else 300)
    from attnc.backends.triton import runtime
    if not gpu:
        runtime.marks_on_device = lambda t: True  # the GPU's row check: a device flag, no host check
        if a.stub_backward == "gluon":
            stub_gluon_backward()
    if not a.bound:  # (the A/B's other arm: no call finds a bound call, none is bound)
        from attnc import api
        api.Attention._bound_forward = lambda self, q, k, v, tensors, backend: (None, None, None)
        api.Attention._bound_decode = lambda self, q, cache: (None, None)
    with Launches(stub=not gpu) as counter:
        cases = make_cases([a.profile] if a.profile else a.cases, a.mode)
        for fn, _ in cases.values():  # warm: plans made, launches bound (and compiled, on a GPU)
            fn()
            fn()
        if gpu:
            torch.cuda.synchronize()
        counter.take()
        if a.profile:
            profile(cases[a.profile][0], calls)
            return 0
        launches, paths = {}, {}
        for n, (fn, _) in cases.items():
            for _ in range(4):
                fn()
            counts, ways = counter.take()
            launches[n] = {k: c / 4 for k, c in counts.items()}
            paths[n] = {k: c / 4 for k, c in ways.items()}
        ops = {n: torch_ops(fn) for n, (fn, _) in cases.items()}
        kernels = {n: cuda_kernels(fn) for n, (fn, _) in cases.items()} if gpu else {}
        if not gpu:  # (the stub stands in for the launches: timed inside)
            host, cpu = time_cases(cases, calls, a.rounds, gpu)
    if gpu:  # timed without the counting wrapper
        host, cpu = time_cases(cases, calls, a.rounds, gpu)
    command = "python3 -m bench.host_time " + " ".join(sys.argv[1:] if argv is None else argv)
    out = a.out or f"bench/results/studies/host_time_{a.mode}.jsonl"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    env = environment(a.mode)
    with open(out, "a") as f:
        for n, (_, shape) in cases.items():
            row = {"command": command, "bench": "host", "case": n, "mode": a.mode, "shape": shape,
                   "host_us": round(host[n], 2), "host_cpu_us": round(cpu[n], 2), "calls": calls,
                   "rounds": a.rounds, "launches": sum(launches[n].values()), "launches_by_kernel": launches[n],
                   "device_ops": ops[n][0], "syncs": ops[n][1], "bound_calls": bool(a.bound), "env": env}
            if not gpu:
                row["stub_backward"] = a.stub_backward
            if gpu:
                row["launch_paths"] = paths[n]
                row["cuda_kernels"] = sum(kernels[n].values())
                row["cuda_kernels_by_name"] = kernels[n]
            f.write(json.dumps(row) + "\n")
            extra = f"  cuda kernels {row['cuda_kernels']:.1f} {paths[n]}" if gpu else ""
            print(f"{n:16s} {host[n]:7.1f} us/call (cpu {cpu[n]:6.1f})  launches {row['launches']:.1f} "
                  f"{launches[n]}  torch ops {ops[n][0]}  syncs {ops[n][1]:.1f}{extra}", flush=True)
    print(f"rows -> {out}", file=sys.stderr)
    return 0


def stub_gluon_backward() -> None:
    """Stub mode: the backward takes the Gluon passes, as on the H200 (their launches are stubbed
    like every other; the interpreter cannot run them): their refusal answers None and Triton's
    stream query, which has no driver on a CPU, answers stream 0."""
    from types import SimpleNamespace
    from triton.runtime import driver
    from attnc.backends.triton import gluon_backward
    gluon_backward.refusal = lambda *a, **k: None
    driver._active = SimpleNamespace(get_current_stream=lambda device: 0, get_current_device=lambda: 0)


def profile(fn, calls: int) -> None:
    """cProfile's tables (own time, cumulative) of ``calls`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    sys.exit(main())
