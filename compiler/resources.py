"""Resource limits: what a call may ask of the host before anything is allocated.

Two limits, each owned here:

* **positions** — every kernel indexes query and key positions in int32, so a length (``S_q``,
  ``S_k``, a request's ``kv_len``, a cache's token count) is at most ``MAX_LENGTH = 2**30``
  (``compiler.ranges.MAX_LENGTH``: integer arithmetic on positions is proved to fit from it).
  :func:`check_length` / :func:`check_lengths` refuse longer ones naming the value.
* **memory** — plan-time work (interval analysis, tile grids, split plans, dense masks, sampled
  inputs, the float64 oracle) estimates its bytes with the functions below and calls
  :func:`require` first; a call over the limit is refused with the estimate and the limit
  (a :class:`ResourceError`), never left to the operating system's out-of-memory killer.

The memory limit is ``ATTNC_MEMORY_LIMIT`` (bytes, or a size such as ``512MiB``, ``8GiB``,
``2G``), else :data:`DEFAULT_MEMORY_LIMIT`; the CLI's ``--memory-limit`` overrides both for
one command.  Estimates are the peak working set measured for each step (tracemalloc, see
tests/unit/test_resources.py), rounded up: they are estimates, not promises.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Iterator

from . import ranges as _ranges
from .errors import AttncError

MAX_LENGTH = _ranges.MAX_LENGTH  # the language's limit on positions (compiler/ranges.py owns it)
DEFAULT_MEMORY_LIMIT = 4 << 30  # 4 GiB of plan-time host memory per call
ENV_VAR = "ATTNC_MEMORY_LIMIT"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}
_override: list[int] = []


class ResourceError(AttncError):
    """A call that would exceed a resource limit (memory estimate, int32 positions)."""


# ---------------------------------------------------------------- sizes
def parse_size(text: str, minimum: int = 1) -> int:
    """``"4GiB"``, ``"512M"``, ``"1000000"`` -> bytes (K, M, G, T are binary; KB, MB, GB, TB
    decimal).  ValueError on anything else, or on a size below ``minimum``.  The one parser of
    byte sizes: ``ATTNC_MEMORY_LIMIT``, ``--memory-limit`` and ``ATTNC_PLAN_CACHE_BYTES``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 4GiB, 512MiB or a number of bytes, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < minimum or not math.isfinite(value):
        raise ValueError(f"a size of at least {minimum} byte{'s' if minimum != 1 else ''} is needed, got {text!r}")
    return int(value)


def env_size(name: str, default: int, minimum: int = 1) -> int:
    """The byte size in environment variable ``name`` (:func:`parse_size`), ``default`` when it
    is unset or empty; a :class:`ResourceError` naming the variable when it cannot be read."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return parse_size(text, minimum)
    except ValueError as e:
        raise ResourceError(f"{name}={text!r}: {e}") from None


def format_size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def memory_limit() -> int:
    """The limit in force: an :func:`overridden` value, else ``ATTNC_MEMORY_LIMIT``, else the default."""
    if _override:
        return _override[-1]
    return env_size(ENV_VAR, DEFAULT_MEMORY_LIMIT)


@contextlib.contextmanager
def overridden(limit: int | None) -> Iterator[None]:
    """Run a block under another memory limit (the CLI's ``--memory-limit``); None changes nothing."""
    if limit is None:
        yield
        return
    _override.append(int(limit))
    try:
        yield
    finally:
        _override.pop()


def require(what: str, estimate: float) -> None:
    """Refuse ``what`` when its estimated bytes exceed the memory limit."""
    limit = memory_limit()
    if estimate > limit:
        raise ResourceError(f"{what} needs about {format_size(estimate)} of host memory, over the limit of "
                            f"{format_size(limit)}; raise it with {ENV_VAR} (or --memory-limit) if the "
                            "machine has the memory, or ask for less")


# ---------------------------------------------------------------- positions
def check_length(name: str, value: int) -> int:
    if value > MAX_LENGTH:
        raise ResourceError(f"{name} = {value} exceeds {MAX_LENGTH} (2^30): the language's limit "
                            "on positions")
    return value


def check_lengths(name: str, values) -> None:
    """Every entry of ``values`` (an integer array) fits int32 positions; names the first that does not."""
    import numpy as np
    a = np.asarray(values)
    if a.size and int(a.max()) > MAX_LENGTH:
        i = int(np.argmax(a > MAX_LENGTH))
        raise ResourceError(f"{name}[{i}] = {int(a.flat[i])} exceeds {MAX_LENGTH} (2^30): the language's "
                            "limit on positions")


# ---------------------------------------------------------------- estimates (bytes)
# Peak bytes per unit, measured with tracemalloc on the steps below and rounded up.
COLUMN_BYTES = 420  # interval analysis: per analysed column (B' x H' x S_k); measured 180-410
TILE_BYTES = 24  # tile plan: per tile of the [B', H', T_r, T_c] grid (classes, CSR lists); measured 7-22
PAGE_BYTES = 400  # split plan: per storage run (a page, or a piece of block_rows rows); measured 250-270
CELL_BYTES = 3  # a dense boolean mask evaluated in column chunks: per cell, with its temporaries


def intervals_bytes(columns: int) -> int:
    return COLUMN_BYTES * columns


def tiles_bytes(extent: int, s_q: int, s_k: int, block_m: int, block_n: int) -> int:
    return TILE_BYTES * extent * -(-s_q // block_m) * -(-s_k // block_n)


def split_plan_bytes(runs: int) -> int:
    return PAGE_BYTES * runs


def dense_bytes(cells: int, per_cell: float = CELL_BYTES) -> int:
    return int(per_cell * cells)


# the exact tile classifier (analysis.tiles.classify_exact): per analysed column (its offsets into
# the counts, int64), per run slot of the widest row set (a count's int64 tile ranges), and per
# tile of one step (the int64 difference array with the second bincount or the running counts, and
# the bool masks); fits tracemalloc's peaks within 0.5% (16K-64K columns, 1-2 slots, 64K-1M tiles)
EXACT_COLUMN_BYTES = 16
EXACT_RUN_BYTES = 8
EXACT_TILE_BYTES = 17


def exact_classify_bytes(columns: int, runs: int, step_tiles: int) -> int:
    return columns * (EXACT_COLUMN_BYTES + EXACT_RUN_BYTES * runs) + step_tiles * EXACT_TILE_BYTES


def array_bytes(obj, seen: set | None = None, depth: int = 0) -> int:
    """The bytes of the numpy arrays reachable from ``obj`` (dataclasses, mappings, sequences, a
    few levels deep), each buffer counted once: what a result keeps alive."""
    import numpy as np
    seen = set() if seen is None else seen
    if isinstance(obj, np.ndarray):
        base = obj if not isinstance(obj.base, np.ndarray) else obj.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    if depth > 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return 0
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dataclass_fields__"):
        items = [getattr(obj, f, None) for f in obj.__dataclass_fields__]
    else:
        return 0
    return sum(array_bytes(x, seen, depth + 1) for x in items)

