"""How the Triton backend launches a split call (decode, append, mixed batches), decided in one
place: :func:`choose`.  The launch (``decode.decode_plan``) and ``attnc plan`` (through the
registry: ``compiler/launch_plan.py``) both ask it, with the same device facts, so the plan
reports the slots and workspace bytes the launch allocates.

In order of authority:

* **the engine**: what the caller asked for (``engine=``); else, for an untuned, unconstrained
  call under ``split = auto`` whose query rows fill at least :data:`CACHE_ENGINE_FILL` of the
  Gluon engine's 128-row tiles, the Gluon engine over the cache (``kernels/gluon_paged.py``: one
  launch, unsplit, no workspace) where :func:`engine_refusal` has no objection (sm_90, Gluon,
  f16 / bf16, head dims 64 / 128 / 256, pages of 8 rows or more; the cache's tensors on
  the GPU in the spec's dtype, contiguous and 16-byte aligned); else the split producer and
  combine;
* **the split slots**: the caller's ``splits``; else the spec's declared ``split =`` policy's
  bounds (``compiler/analysis/splits.py``); else ``attnc tune``'s winner for the call's dispatch
  key (read from this host's tuning cache, :func:`tuned_config`); else ``split = auto``'s
  untuned rule, ``splits.auto_splits`` (about four programs per SM of ``DeviceFacts.num_sms``);
* **the tiles, warps and stages**: the caller's, else the tuned winner's, else the defaults
  (``decode.default_decode_config`` cites the H200 rows behind them);
* **the workspace** the launch allocates: ``ledger.allocation`` for its slots (none on the
  Gluon engine).

The device is read only through :class:`device.DeviceFacts`, so a plan made on a host without
the GPU passes assumed facts (:func:`device_facts`) and says which.  Importing this module
imports neither torch nor triton.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import numpy as np

from attnc.compiler import ir, tune
from attnc.compiler.analysis import ledger
from attnc.compiler.analysis import splits as policies
from attnc.compiler.errors import InputError, PlanError
from attnc.compiler.plan import DEFAULT_SMS

from .admission import shared_shift_refusal
from .device import DeviceFacts, interpreted, tma_ready
from .device import facts as read_facts

# ---------------------------------------------------------------- the Gluon engine over a cache
# A split call whose query rows fill at least this share of the engine's 128-row tiles runs on the
# Gluon engine over the cache (``gluon_paged``), without splits; decode rows (one per request) and
# batches of mostly short appends keep the split producer, whose tiles pack a GQA group's rows.
CACHE_ENGINE_FILL = 0.5
CACHE_ENGINE_DIMS = (64, 128, 256)  # q.k and v head dims (the packed views' columns: a power of two)
CACHE_ENGINE_MIN_PAGE = 8  # a page's rows per copy: TMA boxes land on 8-row swizzle atoms
# The Gluon engine's (query rows, keys) tiles, over a cache and over contiguous tensors (choice.py)
GLUON_TILES = (128, 128)
GLUON_WIDE_TILES = (128, 64)  # head dims above 128: two K/V stages fit shared memory on 64-key blocks


def cache_engine_tiles(d_qk: int, d_v: int) -> tuple[int, int]:
    """(query rows, keys) of the engine's tiles over a cache, as over contiguous tensors."""
    return GLUON_WIDE_TILES if max(d_qk, d_v) > 128 else GLUON_TILES


def engine_refusal(program: ir.Program, facts: DeviceFacts, k=None, v=None) -> str | None:
    """Why the Gluon engine cannot run this spec's split calls on this device over this cache (a
    sentence), or None.  ``k``, ``v``: the call's cache tensors; None (``attnc plan``): assumed on
    the GPU in the spec's dtype, contiguous and 16-byte aligned."""
    if k is not None and (not hasattr(k, "is_cuda") or not k.is_cuda):
        return "the cache is not on a GPU"
    if facts.interpreter:
        return "Gluon kernels do not run in Triton's interpreter"
    if facts.capability != 90:
        return "the Gluon engine needs an sm_90 GPU (Hopper: wgmma and TMA)"
    if not facts.gluon:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if program.dtype not in ("f16", "bf16"):
        return f"the Gluon engine takes f16 / bf16, not {program.dtype}"
    if program.d_qk not in CACHE_ENGINE_DIMS or program.d_v not in CACHE_ENGINE_DIMS:
        return (f"the Gluon engine over a cache takes head dims {', '.join(map(str, CACHE_ENGINE_DIMS))}, "
                f"not {program.d_qk} / {program.d_v}")
    block_n = cache_engine_tiles(program.d_qk, program.d_v)[1]
    page_size = program.cache.page_size or 0
    if program.cache.kind is ir.CacheKind.PAGED and (page_size < CACHE_ENGINE_MIN_PAGE
                                                     or (page_size % block_n and block_n % page_size)):
        return (f"the Gluon engine copies pages of at least {CACHE_ENGINE_MIN_PAGE} rows that divide or are a "
                f"multiple of its {block_n}-key blocks, not {page_size}")
    if k is None:
        return None
    want = {"f16": "torch.float16", "bf16": "torch.bfloat16"}[program.dtype]
    if str(k.dtype) != want or str(v.dtype) != want:
        return f"the cache holds {k.dtype} / {v.dtype}, not the spec's {program.dtype}"
    if not tma_ready(k, v):
        return "the Gluon engine reads contiguous K/V storage at 16-byte aligned addresses (TMA)"
    return None


def fills_engine_tiles(program: ir.Program, q_lens: np.ndarray) -> bool:
    """Whether a call's query rows fill at least :data:`CACHE_ENGINE_FILL` of the engine's tiles."""
    rows = int(q_lens.sum())
    tile = cache_engine_tiles(program.d_qk, program.d_v)[0]
    return rows > 0 and rows >= CACHE_ENGINE_FILL * int((-(-q_lens // tile)).sum()) * tile


# ---------------------------------------------------------------- the decision
@dataclass(frozen=True)
class SplitChoice:
    """A split call's launch.  ``engine`` "split": the producer over ``slots`` split slots per
    query tile (``splits`` balanced shares of each tile's K/V blocks, or the spec's policy's
    ``bounds``) and the combine, through a workspace; "gluon": the Gluon engine over the cache,
    one launch, unsplit (one slot), no workspace.  ``decided_by`` names what set the slots
    ("caller", "policy", "tuned", "auto", "engine"); ``tuning_cache`` says what the cache gave;
    ``refusal``, when set, is why this launch cannot run (the launch raises it)."""

    engine: str
    splits: int
    bounds: object | None  # compiler.analysis.splits.SplitBounds of the spec's declared policy
    policy: object | None  # that policy (compiler.analysis.splits), or None
    block_n: int
    block_q: int
    num_warps: int
    num_stages: int
    decided_by: str
    tuning_cache: str
    facts: DeviceFacts
    assumed: tuple[str, ...] = ()
    refusal: str | None = None

    @property
    def slots(self) -> int:
        """Split slots per query tile: the producer grid's split axis, the workspace's states."""
        return self.bounds.capacity if self.bounds is not None else self.splits

    def workspace_bytes(self, program: ir.Program, total_q: int) -> int:
        return launch_workspace_bytes(program, self.engine, total_q, self.slots)

    def plan_policy(self):
        """The split policy ``attnc plan`` plans with to show this launch: the spec's declared one,
        else the decided count as balanced slots, named by what decided it."""
        if self.policy is not None:
            return self.policy
        why = {"auto": "auto", "tuned": "auto (tuned)", "engine": "auto (Gluon engine, unsplit)"}
        return policies.Decided(self.splits, why.get(self.decided_by, self.decided_by))

    def report(self, program: ir.Program, total_q: int) -> dict:
        """The launch as `attnc plan --json` reports it."""
        return {"engine": self.engine, "slots": self.slots, "workspace_bytes": self.workspace_bytes(program, total_q),
                "block_n": self.block_n, "block_q": self.block_q, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "decided_by": self.decided_by, "tuning_cache": self.tuning_cache,
                "device": self.facts.to_json(), "assumed": list(self.assumed)}


def launch_workspace_bytes(program: ir.Program, engine: str, total_q: int, slots: int,
                           vector_bytes: int | None = None) -> int:
    """The bytes of the workspace a split launch allocates: every (query row, head, slot) state
    in the ledger's layout (``ledger.allocation``, its vector field ``vector_bytes`` wide: the
    launch passes the width its views take, None the ledger's dtype for the spec); none on the
    Gluon engine."""
    if engine == "gluon":
        return 0
    abi = program.state.value
    if vector_bytes is None:
        return ledger.allocated_bytes(abi, program.dtype, total_q, program.heads_q, slots, program.d_v)
    return ledger.allocation(abi, total_q, program.heads_q, slots, program.d_v, vector_bytes)[2]


_LOOK_UP = object()


def choose(program: ir.Program, kv_lens: np.ndarray, q_lens: np.ndarray, facts: DeviceFacts, *,
           one_row: bool, asked: dict | None = None, cache: tuple | None = None,
           tuned=_LOOK_UP) -> SplitChoice:
    """The launch of a split call of ``program``: ``kv_lens`` / ``q_lens`` per request (int64;
    ``one_row``: one query row each, decode) on a device with ``facts``.  ``asked``: the caller's
    ``engine``, ``splits``, ``block_n``, ``block_q`` (None: left to the decision); ``cache``: the
    call's ``(k, v)`` tensors (None: assumed, see :func:`engine_refusal`); ``tuned``: ``attnc
    tune``'s winner ({} a miss, None not read); left out, looked up in this host's tuning cache
    when ``facts.here`` and the caller gives no ``splits``."""
    p = program
    asked = asked or {}
    engine, splits, block_n, block_q = (asked.get(n) for n in ("engine", "splits", "block_n", "block_q"))
    batch = int(kv_lens.size)
    longest = int(kv_lens.max()) if batch else 0
    policy = None if splits is not None or p.split.kind is ir.SplitKind.AUTO else policies.from_ir(p.split)
    refusal = (shared_shift_refusal(str(policy)) if policy is not None and isinstance(p.state, ir.SharedShift)
               else None)
    if tuned is _LOOK_UP:
        tuned = tuned_config(p, kv_lens, q_lens, one_row) if splits is None and facts.here else None
    if splits is not None:
        status = "not read (the caller's splits)"
    elif tuned is None:
        status = "not read (an assumed device: its entries are keyed by the device they were measured on)"
    else:
        status = "hit" if tuned else "miss"
    decided_by = "caller" if splits is not None else "policy" if policy is not None else None
    num_warps, num_stages = 4, 2
    if tuned and splits is None:
        splits = None if policy is not None else tuned.get("splits")
        decided_by = decided_by or ("tuned" if splits is not None else None)
        block_n = block_n if block_n is not None else tuned.get("BLOCK_N")
        block_q = block_q if block_q is not None else tuned.get("BLOCK_Q")
        num_warps, num_stages = tuned.get("num_warps", num_warps), tuned.get("num_stages", num_stages)
    k, v = cache if cache is not None else (None, None)
    if engine == "gluon":
        why = engine_refusal(p, facts, k, v)
        if why is None and policy is not None:
            why = "the spec's split policy cuts the keys into slots, which the engine does not split"
        if why:
            raise ValueError(f"engine='gluon': {why}")
    elif engine is None and not (one_row or tuned or policy is not None or block_n is not None
                                 or splits is not None or block_q is not None):
        # untuned, unconstrained: the Gluon engine where the rows fill its tiles
        if fills_engine_tiles(p, q_lens) and engine_refusal(p, facts, k, v) is None:
            engine = "gluon"
    engine = "gluon" if engine == "gluon" else "split"
    if engine == "gluon":
        block_q, block_n = cache_engine_tiles(p.d_qk, p.d_v)
        splits, decided_by = 1, decided_by or "engine"
    # the split count is `split = auto`'s rule (compiler/analysis/splits.py), counted in a GPU's query
    # tiles, so an interpreted launch allocates what a GPU's would; tiles or block_n given count as given
    rule_q = block_q
    if block_q is None:
        block_q = 1 if one_row else policies.auto_block_q(p.group, q_lens, facts.interpreter)
        rule_q = 1 if one_row else policies.auto_block_q(p.group, q_lens)
    if block_q < 1 or block_q & (block_q - 1):
        raise PlanError(f"block_q = {block_q} must be a positive power of two")
    block_n = policies.AUTO_BLOCK_N if block_n is None else int(block_n)
    if splits is None:
        tiles = batch if one_row else policies.query_tiles(q_lens, rule_q)
        splits = policies.auto_splits(p.heads_kv, tiles, longest, facts.num_sms, block_n)
        decided_by = decided_by or "auto"
    bounds = None
    if policy is not None and refusal is None:
        bounds = policy.bounds(kv_lens, policies.occupancy_for(p, q_lens, facts.num_sms))
    assumed = facts.assumed + (("cache",) if cache is None else ())
    return SplitChoice(engine, int(splits), bounds, policy, block_n, int(block_q), int(num_warps), int(num_stages),
                       decided_by, status, facts, assumed, refusal)


# ---------------------------------------------------------------- the tuning cache
_TUNE_PATH: dict = {}
# what tune.default_cache_path reads, as os.environ stores the names
_ENV_NAMES = ("ATTNC_TUNE_CACHE", "ATTNC_CACHE", "XDG_CACHE_HOME", "HOME")
_ENV_KEYS = tuple(getattr(os.environ, "encodekey", lambda k: k)(n) for n in _ENV_NAMES)


def tuned_config(program: ir.Program, kv_lens: np.ndarray, q_lens: np.ndarray, one_row: bool) -> dict:
    """`attnc tune`'s winner for the call on this host (``compiler.tune.tuned_tiles``, the Triton
    backend's entry for the call's dispatch key), {} on a miss.  Its cache file's path is worked
    out once per environment (``tune.default_cache_path``) and a missing file costs one stat:
    the lookup itself builds the call's dispatch key."""
    data = getattr(os.environ, "_data", None)  # (os.environ.get costs half a microsecond a name)
    env = (tuple(data.get(k) for k in _ENV_KEYS) if isinstance(data, dict)
           else tuple(os.environ.get(n) for n in _ENV_NAMES))
    path = _TUNE_PATH.get(env)
    if path is None:
        path = _TUNE_PATH[env] = str(tune.default_cache_path())
    if not os.path.exists(path):
        return {}
    s_q = 1 if one_row else q_lens
    return tune.tuned_tiles(program, int(kv_lens.size), s_q, kv_lens, "triton", cache=path) or {}


# ---------------------------------------------------------------- device facts for a plan
# The device a plan made without one assumes: the H200 (sm_90, 132 SMs) the defaults were measured
# on, with a Triton that has Gluon.
ASSUMED_CAPABILITY = 90


def device_facts(device: str | None = None, num_sms: int | None = None) -> DeviceFacts:
    """The facts ``attnc plan`` decides a launch with.  ``device``: "here" (this host's GPU, read
    through torch; Triton's interpreter under TRITON_INTERPRET=1), or "sm_XY" (an assumed GPU of
    compute capability XY: no device is read, so no tuning cache applies); None: "here" under the
    interpreter, else "sm_90".  ``num_sms`` replaces the SM count either way."""
    if device is None:
        device = "here" if interpreted() else f"sm_{ASSUMED_CAPABILITY}"
    if device == "here":
        facts = read_facts()
        if not facts.interpreter and facts.capability == 0:
            raise InputError("--device here: this host has no CUDA GPU and TRITON_INTERPRET is not 1, so no Triton "
                             "split launch runs here; plan for an assumed GPU with --device sm_90")
    else:
        m = re.fullmatch(r"sm_(\d{2,3})", device)
        if m is None:
            raise InputError(f"--device {device!r}: expected 'here' or a compute capability such as sm_90")
        facts = DeviceFacts(interpreter=False, capability=int(m.group(1)), num_sms=DEFAULT_SMS, gluon=True,
                            here=False, assumed=("capability", "num_sms", "gluon"))
    if num_sms is not None:
        facts = replace(facts, num_sms=int(num_sms), assumed=tuple(a for a in facts.assumed if a != "num_sms"))
    return facts
