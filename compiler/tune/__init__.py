"""Autotuning per dispatch key (DESIGN §6; M4.5 §0x07, §0x0BG-§0x0BH).

For each call shape, ``tune`` freezes the dispatch key (forced to the tuned backend, so an
inadmissible call fails closed with its reasons), walks the backend's declared search space,
checks every candidate against the float64 oracle *before* timing it (a candidate that
fails is recorded and never timed), times the passing ones with synchronized raw samples,
and stores the winner with every raw sample in a JSON cache keyed by the key's digest.

Runtime hooks read that cache: :func:`tuned_config` (by key) and :func:`tuned_tiles` (by
program and call shape) give the tuned launch parameters or ``None``, and
:func:`tuned_split_policy` turns ``split = auto`` into the tuned split count; on a miss
the caller keeps its heuristic.  The cache is a plain JSON document::

    {"format": "attnc-tune", "version": 1,
     "entries": {"<key digest>": {"key": {...}, "backend": "triton", "config": {...},
                                   "samples_ms": [...], "candidates": [...], ...}}}

written atomically (temporary file + ``os.replace``) under a lock, merged with what other
processes wrote meanwhile; a corrupt or foreign-version file, or a malformed entry, is reported
and ignored (a bad file is set aside as ``FILE.bad`` when the tuner rewrites it), and a cache
that cannot be written is reported while tuning goes on (``cache``).

What is backend-neutral lives here: ``space`` (``Space`` and the per-backend lookup),
``timers``, ``cache``, ``hooks``, ``shapes``, ``reference`` (the oracle check), ``runner``
(what a backend's runner provides) and ``driver`` (``tune``).  Each backend declares its
search spaces, untuned defaults and runner in ``backends/<name>/tune.py``, found through the
registry.
"""
from __future__ import annotations

from ..errors import TuneError
from .cache import CACHE_FORMAT, CACHE_VERSION, TuneCache, default_cache_path, load_cache
from .driver import TuneResult, tune
from .hooks import call_key, tuned_config, tuned_key, tuned_split_policy, tuned_tiles
from .reference import ORACLE_CELLS, Reference, check_against, reference_for
from .runner import Runner
from .shapes import Shape, parse_shapes
from .space import (RUNNERS, SPACES, Space, declaration, family_of, pow2_at_least, space_for, tile_fits_keys,
                    tile_fits_rows)
from .timers import Timer, cuda_event_timer, do_bench_timer, wall_timer

__all__ = [
    "CACHE_FORMAT", "CACHE_VERSION", "ORACLE_CELLS", "RUNNERS", "SPACES", "Reference", "Runner", "Shape", "Space",
    "Timer", "TuneCache", "TuneError", "TuneResult", "call_key", "check_against", "cuda_event_timer",
    "declaration", "default_cache_path", "do_bench_timer", "family_of", "load_cache", "parse_shapes",
    "pow2_at_least", "reference_for", "space_for", "tile_fits_keys", "tile_fits_rows", "tune", "tuned_config",
    "tuned_key", "tuned_split_policy", "tuned_tiles", "wall_timer",
]
