"""Where a GPU call's host time goes, layer by layer (issues 33, 34): the inclusive time of each
layer of the call path per call, timed with perf_counter wrappers (cProfile's table rounds every
entry of a 50 us call to 0.000 s and its own overhead doubles the call).

Each case of ``bench.host_time`` (``--cases``) is called back to back after warm calls; every
wrapped function adds its inclusive time to its row (a wrapper costs about 0.2 us, counted in its
callers' rows).  The C launcher is wrapped too (``raw_launch``'s launch closures call it), so its
row is the driver's launch alone.  A study script:

  python3 -m bench.host_breakdown [--cases prefill_causal,backward_direct,decode_paged] [--calls N]
                                  [--out FILE.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (module, owner attribute path, function name): the layers of the call path, outermost first
LAYERS = (
    ("attnc.api", "Attention", "__call__"),
    ("attnc.api", "Attention", "forward"),
    ("attnc.api", "Attention", "decode"),
    ("attnc.api", "Attention", "_kernel_for"),
    ("attnc.api", "Attention", "_bound_forward"),
    ("attnc.api", "Attention", "_eager_backward"),
    ("attnc.backends.triton.bound_backward", "BoundBackward", "__call__"),
    ("attnc.backends.triton.bound", "BoundPrefill", "__call__"),
    ("attnc.backends.triton.bound", "BoundLaunch", "__call__"),
    ("attnc.api", "Attention", "_bound_decode"),
    ("attnc.backends.triton.bound_decode", "BoundDecode", "__call__"),
    ("attnc.backends.triton.bound_decode", "BoundSplit", "__call__"),
    ("attnc.backends.triton.torch_api", "TritonBackend", "forward"),
    ("attnc.backends.triton.torch_api", "TritonBackend", "backward"),
    ("attnc.backends.triton.prefill_calls", "PrefillCalls", "__call__"),
    ("attnc.backends.triton.prefill_calls", "PrefillCalls", "_launch"),
    ("attnc.backends.triton.prefill_calls", "PrefillCalls", "_run_launch"),
    ("attnc.backends.triton.runtime", "Kernel", "_row_check"),
    ("attnc.backends.triton.runtime", "Kernel", "_key"),
    ("attnc.backends.triton.runtime", "Kernel", "_check_scores"),
    ("attnc.backends.triton.backward_calls", "BackwardCalls", "_backward"),
    ("attnc.backends.triton.split_calls", "SplitCalls", "decode"),
    ("attnc.backends.triton.launch", "PrefillLaunch", "__call__"),
    ("attnc.backends.triton.launch", "Launcher", "launch"),
    ("attnc.backends.triton.launch", None, "_stream"),
    ("attnc.backends.triton.gluon_backward", "GluonBackwardLaunch", "__call__"),
    ("attnc.backends.triton.gluon_backward", "GluonBackwardLaunch", "delta_pass"),
    ("attnc.backends.triton.gluon_backward", "GluonBackwardLaunch", "dkdv_pass"),
    ("attnc.backends.triton.gluon_backward", "GluonBackwardLaunch", "dq_pass"),
)


class Timers:
    """Inclusive perf_counter time per wrapped function while in the ``with`` block."""

    def __init__(self):
        self.spent: dict = {}
        self.undo: list = []

    def wrap(self, owner, name: str, label: str):
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None or not callable(fn):
            return
        spent = self.spent

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)
        self.undo.append((owner, name, fn))

    def wrap_c_launchers(self, launchers):
        """Each raw launch closure's C launcher (its ``c_launch`` cell), timed as "C launcher"."""
        for launcher in launchers:
            for key, raw in list(launcher.raw.items()):
                if raw is None or not raw.__closure__:
                    continue
                names = raw.__code__.co_freevars
                cell = raw.__closure__[names.index("c_launch")] if "c_launch" in names else None
                if cell is None:
                    continue
                inner, spent = cell.cell_contents, self.spent

                def timed(*args, inner=inner):
                    t = time.perf_counter()
                    try:
                        return inner(*args)
                    finally:
                        spent["C launcher"] = spent.get("C launcher", 0.0) + time.perf_counter() - t
                cell.cell_contents = timed
                self.undo.append((cell, "cell_contents", inner))

    def restore(self):
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)
        self.undo.clear()


def launchers_in_use():
    """Every Launcher object alive (the call's launches keep theirs)."""
    import gc
    import warnings
    from attnc.backends.triton.launch import Launcher
    with warnings.catch_warnings():  # (isinstance on every object touches deprecated module attributes)
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, Launcher)]


def main(argv=None):
    import importlib
    from . import host_time as H
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="prefill_causal,backward_direct,decode_paged")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None, metavar="FILE.jsonl")
    ap.add_argument("--mode", choices=("gpu", "stub"), default="gpu",
                    help="stub: host_time's small CPU cases, kernels interpreted (checks the script, times nothing real)")
    a = ap.parse_args(argv)
    H.setup(a.mode)
    import torch
    cases = H.make_cases([c for c in a.cases.split(",") if c], a.mode)
    if a.mode == "stub":
        torch.cuda.synchronize = lambda *args: None
    rows = []
    for name, (fn, shape) in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        timers = Timers()
        for mod, owner, fname in LAYERS:
            m = importlib.import_module(mod)
            target = getattr(m, owner) if owner else m
            timers.wrap(target, fname, f"{owner + '.' if owner else mod.rsplit('.', 1)[1] + '.'}{fname}")
        timers.wrap_c_launchers(launchers_in_use())
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            wall = (time.perf_counter() - t0) / a.calls * 1e6
            torch.cuda.synchronize()
        finally:
            timers.restore()
        layers = {k: round(v / a.calls * 1e6, 2) for k, v in sorted(timers.spent.items(), key=lambda kv: -kv[1])}
        print(f"{name}: {wall:.1f} us/call (wrapped)")
        for k, v in layers.items():
            print(f"  {v:8.2f}  {k}")
        rows.append({"bench": "host_breakdown", "case": name, "shape": shape, "wall_us_wrapped": round(wall, 2),
                     "calls": a.calls, "inclusive_us": layers, "env": H.environment(a.mode),
                     "command": "python3 -m bench.host_breakdown " + " ".join(argv or sys.argv[1:])})
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
