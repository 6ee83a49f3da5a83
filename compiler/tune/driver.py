"""The tuner: per call shape, freeze the dispatch key (forced to the tuned backend, so an
inadmissible call fails closed with its reasons), walk the backend's search space, check every
candidate against the float64 oracle before timing it, time the passing ones, store the winner
with every raw sample."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from .. import evidence as ev
from .. import ir
from ..dispatch import DispatchKey, Environment, select
from ..errors import TuneError
from .cache import CacheWriteError, TuneCache, report_to_stderr
from .reference import ORACLE_CELLS, check_against
from .shapes import Shape
from .space import RUNNERS, Space, family_of, space_for
from .timers import Timer


@dataclass
class TuneResult:
    shape: Shape
    key: DispatchKey
    entry: dict
    cached: bool = False
    rows: list = field(default_factory=list)  # evidence rows, one per candidate

    @property
    def config(self) -> dict:
        return self.entry["config"]


def _median(samples) -> float:
    return float(np.median(samples)) if len(samples) else math.nan


def tune(program: ir.Program, shapes: Sequence[Shape], backend: str = "triton", *,
         cache: TuneCache | str | os.PathLike | None = None, timer: Timer | None = None,
         warmup: int = 5, repeats: int = 20, seed: int = 0, env: Environment | None = None,
         progress: Callable[[str], None] | None = None, retune: bool = False,
         space: Space | None = None, max_cells: int = ORACLE_CELLS, evidence: bool = True) -> list[TuneResult]:
    """Tune ``program`` on ``backend`` for each shape; store the winners in ``cache`` and
    return one :class:`TuneResult` per shape (``cached`` when the cache already had it and
    ``retune`` is false)."""
    progress = progress or report_to_stderr
    store = cache if isinstance(cache, TuneCache) else TuneCache(cache, report=progress)
    env = env or Environment.detect()
    env_record = ev.environment_record(env)
    results = []
    for si, shape in enumerate(shapes, 1):
        key = DispatchKey.from_call(program, {"B": shape.batch, "S_q": shape.s_q, "S_k": shape.s_k,
                                              "backend_request": backend}, env)
        sel = select(key)
        if sel.selected is None:  # forced: fails closed with every reason
            raise TuneError(f"shape {shape}: {sel.error}")
        head = f"[{si}/{len(shapes)}] B={shape.batch} S_q={shape.s_q} S_k={shape.s_k} key {key.digest[:12]}"
        old = store.get(key.digest)
        if old is not None and not retune:
            progress(f"{head}: cached ({_fmt_cfg(old['config'])}, median {old['median_ms']:.4g} ms)")
            results.append(TuneResult(shape, key, old, cached=True))
            continue
        sp = space or space_for(backend, key)
        cands = sp.candidates(key)
        progress(f"{head}: {len(cands)} candidates on {backend} ({family_of(backend, key)})")
        if backend not in RUNNERS:
            raise TuneError(f"no tuning runner for backend '{backend}' (runners: {', '.join(sorted(RUNNERS))})")
        runner = RUNNERS[backend](program, shape, key, seed, max_cells)
        ref = runner.reference
        clock = timer or runner.default_timer()
        sync_desc = getattr(clock, "synchronization", getattr(clock, "__name__", "injected timer"))
        warm = {"iterations": warmup, "per_candidate": True, "first_call_untimed": True}
        records, rows = [], []
        for ci, cfg in enumerate(cands):
            label = f"  {ci + 1}/{len(cands)} {_fmt_cfg(cfg)}{' (untuned)' if ci == 0 else ''}"
            rec = {"config": cfg, "untuned": ci == 0}
            try:
                launch, host = runner.prepare(cfg)
                o, lse = host(launch())  # also compiles: never inside the timed region
                comps = check_against(program, ref, o, lse)
            except TuneError:
                raise
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a result)
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[-300:]}")
                records.append(rec)
                progress(f"{label}: error {rec['error'][:120]}")
                continue
            correctness = ev.correctness_record(ref.description, comps)
            rec["correctness"] = correctness
            if not correctness["pass"]:
                rec["status"] = "failed"
                records.append(rec)
                rows.append(ev.make_row(environment=env_record, key=key, selected=backend, config=cfg,
                                        correctness=correctness, bench="tune"))
                progress(f"{label}: FAILED correctness ({'; '.join(str(c) for c in comps)}); not timed")
                continue
            samples = [float(s) for s in clock(launch, warmup, repeats)]
            rec.update(status="timed", samples_ms=samples, median_ms=_median(samples))
            records.append(rec)
            rows.append(ev.make_row(environment=env_record, key=key, selected=backend, config=cfg,
                                    correctness=correctness, samples_ms=samples, warmup=warm,
                                    synchronization=sync_desc, excluded=runner.excluded, bench="tune"))
            progress(f"{label}: ok (max |err| {comps[0].max_abs_error:.1e}), median {rec['median_ms']:.4g} ms "
                     f"over {len(samples)} samples")
        timed = [r for r in records if r.get("status") == "timed" and r["samples_ms"]]
        if not timed:
            raise TuneError(f"shape {shape}: no candidate passed the correctness check; see the progress log")
        win = min(timed, key=lambda r: r["median_ms"])
        base = records[0]
        entry = {"digest": key.digest, "key": key.to_json(), "backend": backend, "family": family_of(backend, key),
                 "config": win["config"], "median_ms": win["median_ms"], "samples_ms": win["samples_ms"],
                 "correctness": win["correctness"], "untuned": {"config": base["config"],
                                                               "median_ms": base.get("median_ms"),
                                                               "status": base.get("status")},
                 "speedup_vs_untuned": (base["median_ms"] / win["median_ms"]) if base.get("status") == "timed" else None,
                 "warmup": warm, "synchronization": sync_desc, "excluded": list(runner.excluded),
                 "environment": env_record, "shape": str(shape), "spec": program.name, "seed": seed,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "candidates": records}
        store.put(entry)
        try:
            store.save()
        except CacheWriteError as e:  # the result stands; the next shape is tuned all the same
            why = e.diagnostics[0].message
            if why not in store.write_errors:
                store.write_errors.append(why)
                progress(f"attnc tune: {why}; this result is not stored")
        sp_txt = f", {entry['speedup_vs_untuned']:.2f}x vs untuned" if entry["speedup_vs_untuned"] else ""
        progress(f"{head}: winner {_fmt_cfg(win['config'])} median {win['median_ms']:.4g} ms{sp_txt}")
        results.append(TuneResult(shape, key, entry, rows=rows if evidence else []))
    return results


def _fmt_cfg(cfg: Mapping) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())
