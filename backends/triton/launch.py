"""The Triton backend's one launch layer: which engine, tiles, warps, stages, walk and schedule a
call runs with (``choose_prefill``, frozen as a ``PrefillConfig``), and the one place kernels are
launched (``Launcher``, ``PrefillLaunch``, ``SplitLaunch``).

The choice, in order of authority: what the caller asked for, else ``attnc tune``'s winner for
the call's dispatch key, else the untuned defaults below (measured on the H200; the numbers live
in bench/results/README.md):

* Hopper (sm_90), f16 / bf16, head dims 64, 128, 192 or 256 (q.k's and v's may differ: 192 /
  128 as in MLA prefill), any S_q and S_k (the tiles across the ends are masked), contiguous bhsd
  tensors: the Gluon engine (``gluon_engine.py``) on ``gluon_default_tiles`` (128 x 128; above
  128, 128 x 64; at most 64, 192 x 128 on three consumer warpgroups), 2 K/V stages, programs
  drawing jobs from a counter; PARTIAL blocks from each row's run of keys where the plan has them
  (documents), else the predicate; at head dim 128 the next block's Q.K^T under this block's
  softmax (``gluon_overlap``), the consumers' turns (``gluon_pingpong``) and 240 consumer
  registers (``gluon_regs``).  FP8 (e4m3) calls with equal head dims of 64, 128 or 256 take it
  too, V read transposed (d 128: 128 x 256 tiles; K's rows in P's operand order where S_k is a
  multiple of 16, ``fp8_key_order``).
* Otherwise the Triton kernel (``prefill.py``): 128 x 128 tiles, 8 warps, 3 stages, TMA on
  Hopper; 64 x 64 tiles for masks that read tensors, for head dims above 128, and (once the
  plan shows it) for short rows (< 16 computed blocks per 128-row tile, on average); the walk
  ``merged`` when the plan's runs average >= 24 blocks, else ``merged_blocks`` (``blocks`` when
  the mask comes from interval vectors).

A launch binds everything a call's key fixes once; a later call with the same key pays a
dictionary lookup, two allocations (O, LSE) and the launch.  ``Launcher`` launches a kernel
through Triton's JIT the first time (compile, specialization) and, after that, through the
compiled kernel's own launcher with the argument tuple, which skips the JIT's per-call binding --
on Triton 3.6 straight to its C function (``raw_launch.py``: TMA descriptors encoded once per
address, no launch metadata while no tool hooks launches).
That is exact only while the arguments' specialization is unchanged (which ints are 1 or
multiples of 16, which pointers are 16-byte aligned): the caller's key must fix them, and
``spec_key`` computes the part a call can change.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from attnc.compiler import ir
from attnc.compiler.analysis.ledger import vector_dtype
from attnc.compiler.fast_score import FAST_POSITIONS
from attnc.compiler.separable import COLUMN_BLOCK
from attnc.compiler.errors import InputError, PlanError

from . import gluon_engine, prefill, raw_launch, split
from .decode import interpreted  # noqa: F401  (the launch layer's, as the tests patch it)

HEAD_GROUP = 4  # heads whose tiles interleave, longest first (``prefill._job``)
GLUON_TILES = (128, 128)
GLUON_WIDE_TILES = (128, 64)  # head dims above 128: two K/V stages fit shared memory on 64-key blocks
GLUON_HEAD_DIMS = (64, 128, 192, 256)  # q.k's (192: loaded as 256 columns, zero-filled)
GLUON_V_DIMS = (64, 128, 256)  # v's and O's (the register tile and the masked tail store need a power of two)
GLUON_STAGES = 2
GLUON_Q_BUFFERS = 2  # at most (gluon_q_buffers)
# the tiles the engine walks: 128 query rows (two consumer warpgroups) by 64, 128 or 256 keys, or 192
# (three; head dims <= 64, FlashAttention-3's tile there) by 64 or 128
GLUON_TILE_SHAPES = ((128, 64), (128, 128), (128, 256), (192, 64), (192, 128))
# Block i+1's Q.K^T issued before block i's softmax (FlashAttention-3's intra-warpgroup overlap), on
# f16 / bf16 at d 128: +3.6% causal, +4.5% full at S = 8K on the H200, no spills at 240 registers
# (study r44 bench/engine_variants_study.py); FP8 calls, whose MMAs take half the time, lose ~1%;
# other head dims lost with it in the r44 bench (d 256: 408 TFLOP/s against r43's 562 without it;
# d 64: 416 against 433), so they keep the r43 engine.
GLUON_OVERLAP = True
GLUON_REGS_D128 = (168, 240, 24)  # d 128's consumer registers (FP8 causal +3% at 240, r44); others: gluon_engine.REGS


def gluon_overlap(d_qk: int, d_v: int, fp8: bool) -> bool:
    """Whether the Gluon engine overlaps the next block's Q.K^T with this block's softmax."""
    return GLUON_OVERLAP and not fp8 and d_qk == d_v == 128


# FlashAttention-3's ping-pong (the consumers take turns issuing their MMAs, block i's Q.K^T with
# block i-1's P.V, each one's softmax under the other's MMAs; ``gluon_engine._ws_blocks``), on
# f16 / bf16 at these head dims: d 128, kernel alone, B4 H16 S8K on the H200 (r45
# bench/engine_variants_study.py): causal 550.1 -> 578.3, full 592.9 -> 626.2; FP8 loses (762.4 -> 681.2)
GLUON_PINGPONG_DIMS = (128,)


def gluon_pingpong(d_qk: int, d_v: int, fp8: bool) -> bool:
    """Whether the Gluon engine's consumers take turns on the tensor cores (PINGPONG)."""
    return not fp8 and d_qk == d_v and d_qk in GLUON_PINGPONG_DIMS


# Three consumer warpgroups (192-row tiles; head dims <= 64): 16 warps with the producer's padded
# warpgroup, so at most 128 registers each at launch; Triton's setmaxnreg then gives the two worker
# consumers 168 and the first (the default partition) the rest, 152 (no spills at d 64)
GLUON_REGS_3WG = (128, 168, 24)


def gluon_default_tiles(d_qk: int, d_v: int, fp8: bool = False) -> tuple[int, int]:
    """The Gluon engine's untuned tiles (measured on the H200, kernel alone, B4 S8K causal / full;
    bench/results/studies/engine_variants_h200_r46.jsonl): head dims above 128, 128 x 64 (two K/V
    stages fit); FP8 at d 128, 128 x 256 (802.9 / 876.2 TFLOP/s against 767.5 / 757.1 on 128 x 128,
    the softmax's per-block work halved); f16 / bf16 at d <= 64, 192 x 128 on three consumer
    warpgroups (FlashAttention-3's tile there; H32: 459.6-463.3 / 496.1 against 419.8-425.6 /
    432.4); else 128 x 128."""
    if max(d_qk, d_v) > 128:
        return GLUON_WIDE_TILES
    if fp8 and d_qk == d_v == 128:
        return (128, 256)
    if not fp8 and max(d_qk, d_v) <= 64:
        return (192, 128)
    return GLUON_TILES


def fp8_key_order(s_k: int) -> bool:
    """Whether an FP8 launch loads K's rows in the order that lets P's FP8 operand skip its
    shuffles (``gluon_engine._key_cols``, P_PERM): where every K block starts on a 16-row boundary
    of the [B * H_kv * S_k, d] view (the 5-d TMA box's).  Kernel alone, B4 H16 S8K d128 on the H200:
    causal 801.9 -> 851.0 TFLOP/s, full 876.2 -> 910.9 (128 x 256 tiles; bench/results/studies)."""
    return s_k % 16 == 0


def gluon_consumers(block_m: int) -> int:
    """The consumer warpgroups of a Gluon tile of ``block_m`` query rows (64 rows each)."""
    return block_m // gluon_engine.ROWS


def gluon_regs(d_qk: int, d_v: int, consumers: int = 2) -> tuple:
    """(maxnreg, consumer warpgroups' registers, producer warp's registers) of a Gluon launch."""
    if consumers == 3:
        return GLUON_REGS_3WG
    return GLUON_REGS_D128 if d_qk == d_v == 128 else gluon_engine.REGS
SHORT_ROW_BLOCKS = 16  # computed K/V blocks per 128-row tile under which rows count as short
SHORT_ROW_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3}  # warps follow the tile: 4
MERGED_RUN_BLOCKS = 24  # the merged walk once the plan's runs average this many blocks
INTERPRETER_TILES = (16, 16)
COMBINE_SLOTS = 128  # split slots the combine merges per pass (the untuned rule makes at most MAX_SPLITS = 128)
ENGINES = (None, "gluon", "triton")
MASK_SOURCES = (None, "predicate", "intervals", "rows")


_CAPABILITY: dict = {}


def capability(device=None) -> int:
    """The GPU's compute capability as 10 * major + minor; 0 under the interpreter or without CUDA."""
    if interpreted():
        return 0
    import torch
    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None or getattr(device, "index", None) is None \
        else device.index
    if index not in _CAPABILITY:
        major, minor = torch.cuda.get_device_capability(index)
        _CAPABILITY[index] = 10 * major + minor
    return _CAPABILITY[index]


def sm_count(device) -> int:
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------- prefill: the choice
@dataclass(frozen=True)
class PrefillConfig:
    """How one prefill call runs.  ``origin``: "caller", "tuned" or "default"."""

    engine: str  # "gluon" | "triton"
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    walk: str | None = None  # the Triton kernel's walk (prefill.WALKS)
    mask_source: str = "predicate"  # "predicate" | "intervals" | "rows"
    head_group: int = HEAD_GROUP
    schedule: str = "counter"  # the Gluon engine's (gluon_engine.SCHEDULES)
    origin: str = "default"

    def describe(self) -> str:
        tail = (f"schedule {self.schedule}" if self.engine == "gluon"
                else f"walk {self.walk}, {self.num_warps} warps" + (", TMA" if self.use_tma else ""))
        return (f"{self.engine} {self.block_m}x{self.block_n}, {self.num_stages} stages, {tail}, "
                f"mask from {self.mask_source} ({self.origin})")


def default_prefill_config(d_qk: int, d_v: int, interpreter: bool, capability: int | None = None,
                           reads_tensors: bool = False) -> dict:
    """The Triton kernel's untuned launch before planning (module docstring)."""
    if interpreter:
        bm, bn = INTERPRETER_TILES
        return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "use_tma": False}
    tma = tma_head_dims(d_qk, d_v) and (capability or 0) >= 90
    if max(d_qk, d_v) > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "use_tma": False}
    if reads_tensors:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "use_tma": tma}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "use_tma": tma}


def tma_head_dims(d_qk: int, d_v: int) -> bool:
    """Whether the Triton kernel can copy K/V tiles by TMA at these head dims: its boxes are d
    columns wide and its tiles D_PAD = max(16, the next power of two) wide, equal only for powers
    of two from 16 up (a d = 8 box against 16-wide Q tiles does not compile)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (d_qk, d_v))


def mean_row_blocks(plan) -> float:
    """Computed (FULL or PARTIAL) K/V blocks per query tile, averaged over the plan's tiles."""
    counts = plan.tiles.counts()
    rows = int(np.prod(plan.tiles.classes.shape[:3]))
    return (counts["full"] + counts["partial"]) / rows if rows else 0.0


def short_row_config(plan) -> dict | None:
    """SHORT_ROW_CONFIG when a 128 x 128 plan's rows are short, else None."""
    if (plan.block_m, plan.block_n) == (128, 128) and mean_row_blocks(plan) < SHORT_ROW_BLOCKS:
        return dict(SHORT_ROW_CONFIG)
    return None


def default_walk(mean_merged_run_blocks: float, mask_source: str | None) -> str:
    if mask_source == "intervals":
        return "blocks"
    return "merged" if mean_merged_run_blocks >= MERGED_RUN_BLOCKS else "merged_blocks"


def gluon_spec_refusal(program: ir.Program) -> str | None:
    """Why the Gluon engine cannot run a spec (a sentence), or None."""
    if not gluon_engine.HAS_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if program.dtype not in ("f16", "bf16"):
        return f"the Gluon engine takes f16 / bf16, not {program.dtype}"
    if program.cache.layout is ir.Layout.BSHD:
        return "the Gluon engine reads and writes bhsd tensors (the spec's layout is bshd)"
    if program.d_qk not in GLUON_HEAD_DIMS or program.d_v not in GLUON_V_DIMS:
        return (f"the Gluon engine takes q.k head dims {', '.join(map(str, GLUON_HEAD_DIMS))} and v head dims "
                f"{', '.join(map(str, GLUON_V_DIMS))}, not {program.d_qk} / {program.d_v}")
    return None


def gluon_call_refusal(program: ir.Program, s_q: int, s_k: int, contiguous: bool, device_capability: int,
                       tiles: tuple[int, int] = GLUON_TILES) -> str | None:
    """Why the Gluon engine cannot run this call, or None."""
    if interpreted():
        return "Gluon kernels do not run in Triton's interpreter"
    if device_capability != 90:
        return "the Gluon engine needs an sm_90 GPU (Hopper: wgmma and TMA)"
    reason = gluon_spec_refusal(program)
    if reason:
        return reason
    if tiles not in GLUON_TILE_SHAPES:
        return (f"the Gluon engine walks {', '.join(f'{m} x {n}' for m, n in GLUON_TILE_SHAPES)} tiles, "
                f"not {tiles[0]} x {tiles[1]}")
    if tiles[0] == 192 and max(program.d_qk, program.d_v) > 64:
        return f"the Gluon engine's 192-row tiles (three warpgroups) take head dims up to 64, not {program.d_qk}"
    need = gluon_smem(program.d_qk, program.d_v, tiles[1], stages=1, rows=tiles[0])
    if need > gluon_engine.SMEM:
        return (f"the Gluon engine's buffers for head dims {program.d_qk} / {program.d_v} on {tiles[0]} x {tiles[1]} "
                f"tiles take {need:,} bytes of shared memory, over the {gluon_engine.SMEM:,} a program has")
    if not contiguous:
        return "the Gluon engine reads and writes contiguous bhsd tensors at 16-byte aligned addresses (TMA)"
    return None


def tma_ready(*tensors) -> bool:
    """Whether TMA can copy blocks of these tensors: contiguous, at 16-byte aligned addresses (a
    contiguous view at an odd offset, ``x[1:]``, is not)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def gluon_box(d: int) -> int:
    """The columns a TMA copy of a d-wide head moves: d rounded up to a power of two (TMA boxes
    are; the columns past d are zero-filled, so Q.K^T is unchanged)."""
    return 1 << (d - 1).bit_length()


def gluon_smem(d_qk: int, d_v: int, block_n: int, stages: int, schedule: int = 1, fp8: bool = False,
               rows: int = 128, q_bufs: int = 1) -> int:
    """Shared memory bytes of the Gluon engine's buffers: ``q_bufs`` query tiles, O's (unless one
    tile per program with d_qk = d_v in one dtype: O goes out through Q's), ``stages`` K/V blocks,
    1 KiB of barriers and job slots.  Q, K and V take 2 bytes (f16 / bf16) or 1 (``fp8``); O 2."""
    d_qk, d_v = gluon_box(d_qk), gluon_box(d_v)
    elem = 1 if fp8 else 2
    o = 0 if schedule == 0 and d_qk == d_v and not fp8 else 2 * rows * d_v
    return elem * (q_bufs * rows * d_qk + stages * block_n * (d_qk + d_v)) + o + 1024


def gluon_stages(d_qk: int, d_v: int, block_n: int, asked: int, schedule: int = 1, fp8: bool = False,
                 rows: int = 128, q_bufs: int = 1) -> int:
    """K/V stages of a Gluon launch: ``asked``, or as many as fit the shared memory beside the fixed
    buffers (``gluon_smem``), at least one."""
    fixed = gluon_smem(d_qk, d_v, block_n, 0, schedule, fp8, rows, q_bufs)
    per_stage = block_n * (gluon_box(d_qk) + gluon_box(d_v)) * (1 if fp8 else 2)
    return max(1, min(asked, (gluon_engine.SMEM - fixed) // per_stage))


def gluon_q_buffers(d_qk: int, d_v: int, block_n: int, stages: int, schedule: int = 1, fp8: bool = False,
                    rows: int = 128) -> int:
    """Q's buffers in a Gluon launch of ``stages`` K/V stages (``gluon_stages``): GLUON_Q_BUFFERS
    (two: the next tile's Q and K/V load under this tile's last blocks, and the consumers need not
    meet at tile boundaries) where a program runs several tiles (the counter schedule) and the
    second buffer fits beside those stages, else one."""
    if schedule != 1 or GLUON_Q_BUFFERS < 2:
        return 1
    return 2 if gluon_smem(d_qk, d_v, block_n, stages, schedule, fp8, rows, 2) <= gluon_engine.SMEM else 1


def check_options(asked: dict) -> None:
    """Refuse option values no engine knows (before any planning)."""
    if asked.get("engine") not in ENGINES:
        raise ValueError(f"engine must be None, 'gluon' or 'triton', not {asked.get('engine')!r}")
    if asked.get("walk") is not None and asked["walk"] not in prefill.WALKS:
        raise ValueError(f"walk must be one of {sorted(prefill.WALKS)}, not {asked['walk']!r}")
    if asked.get("mask_source") not in MASK_SOURCES:
        raise ValueError(f"mask_source must be None, 'intervals', 'predicate' or 'rows', not {asked['mask_source']!r}")
    if asked.get("head_group") is not None and asked["head_group"] < 1:
        raise ValueError(f"head_group = {asked['head_group']}: must be at least 1")
    if asked.get("schedule") is not None and asked["schedule"] not in gluon_engine.SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(gluon_engine.SCHEDULES)}, not {asked['schedule']!r}")
    if asked.get("mask_source") == "rows" and asked.get("engine") == "triton":
        raise ValueError("mask_source='rows' is an option of the Gluon engine, not of the Triton kernel")


def choose_prefill(program: ir.Program, s_q: int, s_k: int, plan_for, *, asked: dict, tuned: dict | None,
                   contiguous: bool, device_capability: int, given_plan=None, fp8: bool = False):
    """The config and plan of a prefill call (module docstring).  ``plan_for(block_m, block_n)``
    makes (or finds) the plan at those tiles; ``given_plan`` is the caller's.  Returns
    (PrefillConfig, Plan)."""
    check_options(asked)
    interp = interpreted()
    engine = asked.get("engine")
    if engine is None and (asked.get("walk") is not None or asked.get("mask_source") == "intervals"):
        engine = "triton"  # options of the Triton kernel: its defaults, not the Gluon engine's tiles
    tiles_asked = asked.get("block_m") is not None or asked.get("block_n") is not None or given_plan is not None
    tuned = {} if tiles_asked else (tuned or {})
    origin = "caller" if tiles_asked or any(asked.get(n) is not None for n in ("num_warps", "num_stages")) \
        else "tuned" if tuned else "default"
    default = default_prefill_config(program.d_qk, program.d_v, interp, device_capability,
                                     bool(ir.loads(program.mask)))
    if given_plan is not None:
        tiles = (given_plan.block_m, given_plan.block_n)
    elif tiles_asked:
        tiles = (asked.get("block_m") or default["BLOCK_M"], asked.get("block_n") or default["BLOCK_N"])
    elif tuned:
        tiles = (tuned.get("BLOCK_M", default["BLOCK_M"]), tuned.get("BLOCK_N", default["BLOCK_N"]))
    else:
        tiles = None
    # the engine: Gluon where asked, or untuned where this machine, spec and call allow it
    gluon_tiles = gluon_default_tiles(program.d_qk, program.d_v, fp8)
    refusal = gluon_call_refusal(program, s_q, s_k, contiguous, device_capability, tiles or gluon_tiles)
    if engine == "gluon" and refusal:
        raise ValueError(f"engine='gluon': {refusal}")
    gluon = engine == "gluon" or (engine is None and not tuned and refusal is None)
    if asked.get("mask_source") == "rows" and not gluon:
        raise ValueError(f"mask_source='rows' is an option of the Gluon engine, which refuses this call: {refusal}")
    if tiles is None:
        tiles = gluon_tiles if gluon else (default["BLOCK_M"], default["BLOCK_N"])
    plan = given_plan if given_plan is not None else plan_for(*tiles)
    stages = asked.get("num_stages") or tuned.get("num_stages") or (GLUON_STAGES if gluon else default["num_stages"])
    if not gluon and origin == "default" and not interp:  # the default's tiles, chosen again now the rows are known
        short = short_row_config(plan)
        if short:
            plan = plan_for(short["BLOCK_M"], short["BLOCK_N"])
            stages = short["num_stages"]
    warps = asked.get("num_warps") or tuned.get("num_warps")
    if warps is None:  # warps follow the plan's tile
        warps = 4 if interp else (8 if plan.block_m * plan.block_n >= 128 * 128 else 4)
    use_tma = asked.get("use_tma")
    if use_tma and not tma_head_dims(program.d_qk, program.d_v):
        raise ValueError(f"use_tma=True: the Triton kernel copies K/V by TMA at power-of-two head dims from 16 up, "
                         f"not {program.d_qk} / {program.d_v}")
    if use_tma is None:
        use_tma = tuned.get("use_tma", default["use_tma"] and contiguous) and tma_head_dims(program.d_qk, program.d_v)
    mask_source = asked.get("mask_source")
    if mask_source == "intervals" and not plan.mask_from_intervals:
        raise ValueError("mask_source='intervals': this plan has no exact interval vectors for the mask")
    if mask_source == "rows" and plan.rows is None:
        raise ValueError("mask_source='rows': this plan has no run of keys per row for the mask")
    if mask_source is None:
        mask_source = "rows" if gluon and plan.rows is not None else "predicate"
    config = PrefillConfig(
        engine="gluon" if gluon else "triton", block_m=plan.block_m, block_n=plan.block_n, num_warps=warps,
        num_stages=stages, use_tma=bool(use_tma) and not gluon, walk=None if gluon else asked.get("walk"),
        mask_source=mask_source, head_group=asked.get("head_group") or HEAD_GROUP,
        schedule=asked.get("schedule") or "counter", origin=origin)
    return config, plan


def job_order(bh: int, q_tiles: int, head_group: int) -> np.ndarray:
    """``prefill._job`` in numpy: row t = (query tile rank, b * H_q + h) of the launch's t-th job."""
    t = np.arange(bh * q_tiles)
    base = (t // (head_group * q_tiles)) * head_group
    g = np.minimum(bh - base, head_group)
    r = t - base * q_tiles
    return np.stack([r // g, base + r % g], axis=1)


# ---------------------------------------------------------------- launching
def spec_key(args) -> tuple:
    """The part of Triton's specialization an argument list carries: for each int whether it is
    1 or a multiple of 16, for each tensor whether its address is 16-byte aligned."""
    out = []
    for a in args:
        if isinstance(a, bool) or a is None or isinstance(a, float):
            out.append(None)
        elif isinstance(a, int):
            out.append(1 if a == 1 else (16 if a % 16 == 0 else 0))
        elif isinstance(a, tuple):
            out.append(spec_key(a))
        elif hasattr(a, "data_ptr"):
            out.append((str(a.dtype), a.data_ptr() % 16 == 0))
        else:
            out.append(type(a).__name__)
    return tuple(out)


class Launcher:
    """One kernel with fixed constexprs and launch options.  ``launch(grid, args, key)``: the
    first launch under a ``key`` goes through the JIT (compiling if needed) and keeps the
    compiled kernel; later launches under that key call the compiled kernel's launcher with the
    argument tuple (its C function where ``raw_launch`` knows it and no launch hook is set).
    ``key`` must determine the arguments' specialization (``spec_key``); key None always takes the
    JIT."""

    def __init__(self, fn, constexprs: dict, **options):
        self.fn = fn
        self.constexprs = constexprs
        self.options = options
        names = [p.name for p in fn.params] if hasattr(fn, "params") else list(constexprs)
        self.tail = tuple(constexprs[n] for n in names if n in constexprs)
        self.compiled: dict = {}
        self.raw: dict = {}  # key -> raw_launch.raw_launch(compiled kernel), or None where it does not apply
        self.fast = not interpreted()
        self.launches = {"jit": 0, "direct": 0, "raw": 0}

    def launch(self, grid, args: tuple, key=None, stream=None):
        kernel = self.compiled.get(key) if key is not None else None
        if kernel is not None:
            from triton import knobs
            stream = _stream() if stream is None else stream
            g = tuple(grid) + (1,) * (3 - len(grid))
            enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            # (Triton 3.6's hooks are chains, empty unless a tool adds one: no launch metadata then)
            if not (raw_launch.hooked(enter) or raw_launch.hooked(leave)):
                raw = self.raw.get(key)
                if raw is not None:
                    raw(g, stream, args + self.tail)
                    self.launches["raw"] += 1
                    return
                enter = leave = None
            meta = kernel.launch_metadata(g, stream, *args, *self.tail) if enter is not None else None
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, enter, leave,
                       *args, *self.tail)
            self.launches["direct"] += 1
            return
        compiled = self.fn[grid](*args, **self.constexprs, **self.options)
        self.launches["jit"] += 1
        if key is not None and self.fast and compiled is not None and hasattr(compiled, "packed_metadata"):
            compiled._init_handles()  # (the launch above did it; this makes .function and .run ready)
            self.compiled[key] = compiled
            self.raw[key] = raw_launch.raw_launch(compiled)
        elif key is not None and self.fast:  # (recorded for the host-time study)
            self.launches["not_kept"] = type(compiled).__name__

    def output_descriptor(self, key, out, cols: int, make):
        """An output's TMA descriptor argument (O, new each call): where this key's launches go raw,
        a per-call view of its [-1, cols] rows (``raw_launch.TensorView``: no descriptor object made,
        nothing kept that would hold the caller's O); else ``make()``'s descriptor."""
        if key is not None and self.raw.get(key) is not None:
            return raw_launch.TensorView(out, cols)
        return make()


def _stream():
    from triton.runtime import driver
    d = driver.active
    return d.get_current_stream(d.get_current_device())


def fast_scores(end: int | None) -> bool:
    """Whether a call whose positions all lie below ``end`` takes the spec's fast score functions
    (``score_program_fast``, ``score_grad_fast``: the exact ones, bit for bit, on positions below
    fast_score.FAST_POSITIONS; compiler/fast_score.py).  None: the launch does not know its
    positions (split calls: a captured decode graph replays with longer requests)."""
    return end is not None and end <= FAST_POSITIONS


def score_functions(module, end: int | None) -> tuple:
    """(SCORE, SCORE_GRAD): the spec's score program and its derivative for a call whose
    positions all lie below ``end`` -- the fast forms where ``fast_scores`` allows them."""
    if fast_scores(end):
        return module.score_program_fast, getattr(module, "score_grad_fast", module.score_program_fast)
    return module.score_program, getattr(module, "score_grad", module.score_program)


def separable_mode(module, end: int | None, block_n: int = 128) -> int:
    """How a call whose positions all lie below ``end`` takes the spec's separable form on the
    Gluon engine (compiler/separable.py; the module's ``score_scale``, ``score_row`` and
    ``score_column``): with its column part per block (gluon_engine.COLUMN_PER_BLOCK) below the
    module's SEPARABLE_BLOCK_POSITIONS, per key (COLUMN_PER_KEY) below its SEPARABLE_POSITIONS
    (the precision rule's bounds; per block only on blocks of at most separable.COLUMN_BLOCK keys,
    the offsets the rule allows for), else not at all (0).  A module without them (f32 specs, specs
    with no separable form or none precise enough on any call) never does; nor a call whose
    positions are unknown (``end`` None)."""
    if end is None:
        return 0
    if end <= getattr(module, "SEPARABLE_BLOCK_POSITIONS", 0) and block_n <= COLUMN_BLOCK:
        return int(gluon_engine.COLUMN_PER_BLOCK)
    if end <= getattr(module, "SEPARABLE_POSITIONS", 0):
        return int(gluon_engine.COLUMN_PER_KEY)
    return 0


def separable_constexprs(module, end: int | None, block_n: int = 128) -> dict:
    """The Gluon engine's SEPARABLE (``separable_mode``) and the form's functions for a call whose
    positions all lie below ``end`` (None in their place where it does not take the form)."""
    mode = separable_mode(module, end, block_n)
    return {"SEPARABLE": mode, **{n: getattr(module, f) if mode else None for n, f in
                                  (("SCORE_SCALE", "score_scale"), ("SCORE_ROW", "score_row"),
                                   ("SCORE_COLUMN", "score_column"))}}


def position_end(s_q: int, s_k: int, offsets: tuple[int, int] | None) -> int:
    """One past the largest position of a call (rows at Q_OFF.., keys at K_OFF..; ``offsets``
    None: a whole call, bottom-right)."""
    q_off, k_off = offsets if offsets is not None else (s_k - s_q, 0)
    return max(q_off + s_q, k_off + s_k)


def spec_constexprs(module, end: int | None = None) -> dict:
    """What a generated spec module gives the kernels as constexpr arguments, for a call whose
    positions all lie below ``end`` (``score_functions``)."""
    return {"VISIBLE": module.visible, "SCORE": score_functions(module, end)[0], **module.SPEC}


def tensor_args(module, tensors: dict, lengths=None) -> tuple:
    """TS: the spec's tensors, each followed by its strides and sizes, in the module's order;
    then, for a spec that reads S_q or S_k (``module.LENGTHS``), the call's ``lengths``:
    (kv_lens [B], qo_indptr [B + 1]) int32 device tensors."""
    ts = []
    for name in module.TENSORS:
        t = tensors[name]
        ts.append(t)
        for i in range(t.dim()):
            ts += [t.stride(i), t.shape[i]]
    if module.LENGTHS:
        ts += list(lengths)
    return tuple(ts)


def call_tensor_args(module, tensors: dict, batch: int, s_q: int, s_k: int, device) -> tuple:
    """TS of a call whose requests all have S_q rows over S_k keys (the lengths only where the
    spec reads them)."""
    return tensor_args(module, tensors, uniform_lengths(batch, s_q, s_k, device) if module.LENGTHS else None)


def uniform_lengths(batch: int, s_q: int, s_k: int, device) -> tuple:
    """(kv_lens, qo_indptr) of a call whose requests all have S_q rows over S_k keys."""
    import torch
    return (torch.full((batch,), s_k, dtype=torch.int32, device=device),
            torch.arange(batch + 1, dtype=torch.int32, device=device) * s_q)


def qk_scale(module) -> float:
    """The factor from q.k (or the score program's output, in natural units) to base-2 logits."""
    return prefill.LOG2E if module.SPEC["HAS_SCORE"] else module.SPEC["SCALE"] * prefill.LOG2E


_COUNTERS: dict = {}


def _counter(device, stream=None):
    """The Gluon engine's job counter for this device and stream (zero between launches)."""
    import torch
    key = (str(device), _stream() if stream is None else stream)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


class _GluonDescriptors:
    """TMA descriptors for the Gluon programs, made once per tensor (address, shape, strides)."""

    def _cached(self, t, role, make):
        """``make()``'s descriptor of ``t`` for ``role``, reused while the tensor (address, shape,
        strides) is the one it was made for: a descriptor holds nothing else of the tensor."""
        key = (t.data_ptr(), t.shape, t.stride())
        hit = self._descs.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        desc = make()
        self._descs[role] = (key, desc)
        return desc

    def _gluon_layout(self, block: list, dtype):
        key = (*block, str(dtype))
        layout = self._layouts.get(key)
        if layout is None:
            gl = gluon_engine.gl
            gl_dtype = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16,
                        "torch.float8_e4m3fn": gl.float8e4nv}[str(dtype)]
            layout = self._layouts[key] = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return layout


class PrefillLaunch(_GluonDescriptors):
    """A prefill launch bound to a spec, a config, a plan's device arrays and one call shape
    (B, H_q, S_q, S_k, strides, dtypes, alignments): ``__call__(q, k, v, ts, out, lse)``."""

    def __init__(self, module, config: PrefillConfig, arrays: dict, shape: tuple, device,
                 offsets: tuple[int, int] | None = None, fp8: bool = False):
        """``offsets``: the absolute positions (Q_OFF, K_OFF) of the first row and key, for one block
        of a larger call (context parallelism); None: a whole call, bottom-right (S_k - S_q, 0).
        ``fp8``: float8 e4m3 Q, K and V (V transposed: ``__call__``) with descales (the Gluon
        engine only)."""
        self.module, self.config, self.arrays = module, config, arrays
        self.batch, self.s_q, self.s_k = shape
        self.offsets = offsets
        self.fp8 = fp8
        self.p_perm = False
        self.device = device
        end = position_end(self.s_q, self.s_k, offsets)
        spec = spec_constexprs(module, end)
        self.bh = self.batch * module.SPEC["H_Q"]
        self.jobs = arrays["q_tiles"] * self.bh
        c = config
        self._descs = {}  # role -> ((address, shape, strides), TMA descriptor): reused while the tensor is
        q_off, k_off = offsets if offsets is not None else (self.s_k - self.s_q, 0)
        self.ints = (self.s_q, self.s_k, q_off, k_off, arrays["plan_b"], arrays["plan_h"],
                     arrays["q_tiles"], qk_scale(module), self.bh)
        if c.engine == "gluon":
            self.schedule = gluon_engine.SCHEDULES[c.schedule]
            self.grid = (self.jobs,) if self.schedule == 0 else (min(self.jobs, sm_count(device)),)
            d_qk, d_v, bn = module.SPEC["D_QK"], module.SPEC["D_V"], c.block_n
            same = d_qk == d_v
            stages = gluon_stages(d_qk, d_v, bn, c.num_stages, self.schedule, fp8, c.block_m)
            q_bufs = gluon_q_buffers(d_qk, d_v, bn, stages, self.schedule, fp8, c.block_m)
            consumers = gluon_consumers(c.block_m)
            self.p_perm = fp8 and fp8_key_order(self.s_k)
            maxnreg, consumer, producer = gluon_regs(d_qk, d_v, consumers)
            keep = {n: spec[n] for n in ("VISIBLE", "SCORE", "HAS_SCORE", "SCALE", "H_Q", "H_KV", "GROUP")}
            from_rows = c.mask_source == "rows"
            self.launcher = Launcher(gluon_engine._attn_fwd_ws, dict(
                MASK_FROM_ROWS=from_rows, EVEN_Q=self.s_q % c.block_m == 0, EVEN_K=self.s_k % bn == 0,
                ROWS_=gluon_engine.ROWS, BLOCK_N=bn, D=d_v, SAME_D=same, STAGES=stages,
                HEAD_GROUP=c.head_group, CONSUMER_REGS=consumer, PRODUCER_REGS=producer, SCHEDULE=self.schedule,
                FP8=fp8, OVERLAP=gluon_overlap(d_qk, d_v, fp8), ZERO_TAIL=not fp8 and self.s_k % bn != 0,
                PINGPONG=consumers == 2 and gluon_pingpong(d_qk, d_v, fp8),
                CONSUMERS=consumers, P_PERM=self.p_perm, Q_BUFS=q_bufs, **keep,
                **separable_constexprs(module, end, bn)),
                num_warps=4, maxnreg=maxnreg)
            unused = arrays["merged_partial"]
            rows = (arrays["KS"], arrays["KE"]) if from_rows else (unused, unused)
            self._layouts = {}
            self.fixed_tail = (arrays["q_tile_order"], arrays["merged_indptr"], arrays["merged_indices"],
                               arrays["merged_partial"], *rows)
            self.no_descales = (unused, unused, unused)
        else:
            walk = c.walk or default_walk(arrays["mean_merged_run_blocks"], c.mask_source)
            self.config = replace(c, walk=walk)
            self.grid = (self.jobs,)
            from_intervals = c.mask_source == "intervals"
            self.launcher = Launcher(prefill._attn_fwd, dict(
                MASK_FROM_INTERVALS=from_intervals, EVEN_N=(self.s_k % c.block_n == 0), USE_TMA=c.use_tma,
                WALK=prefill.WALKS[walk], BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_GROUP=c.head_group, **spec),
                num_warps=c.num_warps, num_stages=c.num_stages)
            vecs = [arrays.get(n, arrays["partial_indptr"]) for n in ("UTS", "UTE", "LTS", "LTE")]
            self.plan_args = (arrays["q_tile_order"], arrays["full_run_ptr"], arrays["full_run_lo"],
                              arrays["full_run_hi"], arrays["partial_indptr"], arrays["partial_indices"],
                              arrays["full_indptr"], arrays["full_indices"], arrays["merged_run_ptr"],
                              arrays["merged_run_lo"], arrays["merged_run_hi"], arrays["merged_run_base"],
                              arrays["merged_partial"], arrays["merged_indptr"], arrays["merged_indices"], *vecs)

    def __call__(self, q, k, v, ts: tuple, out, lse, key=None, descales: tuple | None = None):
        """Launch on bhsd views (strides carry the layout).  ``key``: the caller's binding key, which
        fixes every argument's specialization (None: through the JIT).  FP8 launches: ``v`` is V^T,
        a [B, H_kv, d_v, S_k] view with unit stride along S_k and 16-byte aligned rows, and
        ``descales`` (q [B * H_q], k [B * H_kv], v [B * H_kv]) float32."""
        if self.config.engine == "gluon":
            desc = self._gluon_descriptor
            stream = _stream()
            counter = _counter(self.device, stream) if self.schedule == 1 else self.arrays["merged_partial"]
            rows, bn = gluon_engine.ROWS, self.config.block_n
            v_desc = self._fp8_v_descriptor(v) if self.fp8 else desc(v, bn, "v")
            k_desc = self._fp8_k_descriptor(k) if self.p_perm else desc(k, bn, "k")
            o_desc = self.launcher.output_descriptor(key, out, self.module.SPEC["D_V"],
                                                     lambda: self._gluon_descriptor(out, rows, "o", keep=False))
            args = (desc(q, rows, "q"), k_desc, v_desc, o_desc, out, lse, counter,
                    *self.fixed_tail, *(descales if self.fp8 else self.no_descales), ts, *self.ints)
            self.launcher.launch(self.grid, args, key, stream)
            return
        desc_k = desc_v = k
        if self.config.use_tma:  # Hopper bulk copies of K/V tiles from a [B * H_kv * S_k, d] view
            desc_k, desc_v = self._tma_descriptor(k, "k"), self._tma_descriptor(v, "v")
        args = (q, k, v, out, lse, desc_k, desc_v, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *self.plan_args, ts, *self.ints)
        self.launcher.launch(self.grid, args, key)

    def _tma_descriptor(self, t, role):
        """The Triton kernel's K or V descriptor over a [-1, d] view in BLOCK_N-row blocks."""
        from triton.tools.tensor_descriptor import TensorDescriptor
        d = t.shape[-1]
        return self._cached(t, role, lambda: TensorDescriptor.from_tensor(t.reshape(-1, d), [self.config.block_n, d]))

    def _gluon_descriptor(self, t, rows, role, keep=True):
        """The Gluon engine's descriptor of ``t`` viewed as [-1, d] in ``rows``-row blocks (d: q and
        k's head dim, or v and o's); kept for the next call unless not ``keep`` (an output: a kept
        descriptor would hold the caller's last O, and the next O could not take its memory)."""
        def make():
            d = self.module.SPEC["D_QK" if role in ("q", "k") else "D_V"]
            box = gluon_box(d)  # (a 192-wide head is loaded as 256 columns, the last 64 zero-filled by TMA)
            layout = self._gluon_layout([rows, box], t.dtype)
            return gluon_engine.TensorDescriptor.from_tensor(t.view(-1, d), [rows, box], layout)
        return self._cached(t, role, make) if keep else make()

    def _fp8_k_descriptor(self, k):
        """K's descriptor for an FP8 launch with P_PERM: the [B * H_kv * S_k, d] view as 5-d
        [rows / 16, 2, 4, 2, d] with strides [16, 2, 4, 1, -] rows, in [BLOCK_N / 16, 2, 4, 2, d]
        boxes: within each 32 rows, TMA writes key 16 a1 + 4 q + 2 a0 + b to row 16 a1 + 8 a0 + 2 q + b
        of the block (``gluon_engine._key_cols``)."""
        d, bn = self.module.SPEC["D_QK"], self.config.block_n
        block = [bn // 16, 2, 4, 2, d]
        layout = self._gluon_layout(block, k.dtype)
        rows = k.numel() // d
        return self._cached(k, "k16", lambda: gluon_engine.TensorDescriptor(
            k, [rows // 16, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], block, layout))

    def _fp8_v_descriptor(self, vt):
        """V^T's descriptor for an FP8 launch: [B * H_kv * d_v, S_k] in [d_v, BLOCK_N] blocks; its row
        stride may exceed S_k (a padded copy), and TMA zero-fills the columns past S_k."""
        d, bn = self.module.SPEC["D_V"], self.config.block_n
        layout = self._gluon_layout([d, bn], vt.dtype)
        rows = vt.shape[0] * vt.shape[1] * d
        return self._cached(vt, "vt", lambda: gluon_engine.TensorDescriptor(vt, [rows, self.s_k], [vt.stride(3), 1],
                                                                           [d, bn], layout))


# ---------------------------------------------------------------- split calls
class SplitLaunch:
    """The split-K/V producer and the combine of one spec with one launch config (warps, stages):
    ``__call__(q, k_cache, v_cache, plan, arrays, ts, out, lse, workspace)``."""

    def __init__(self, module, num_warps: int = 4, num_stages: int = 2):
        self.module = module
        self.num_warps, self.num_stages = num_warps, num_stages
        self._launchers: dict = {}

    def _launcher(self, which, constexprs):
        key = (which, tuple(sorted((n, v) for n, v in constexprs.items() if n not in ("VISIBLE", "SCORE"))))
        lz = self._launchers.get(key)
        if lz is None:
            spec = spec_constexprs(self.module)
            if which == "split":
                lz = Launcher(split._decode_split, {**constexprs, **spec}, num_warps=self.num_warps,
                              num_stages=self.num_stages)
            else:
                keep = {n: spec[n] for n in ("H_Q", "D_V", "D_V_PAD")}
                lz = Launcher(split._combine, {**constexprs, **keep}, num_warps=4)
            self._launchers[key] = lz
        return lz

    def __call__(self, q, k_cache, v_cache, plan: dict, arrays: dict, ts: tuple, out, lse, workspace):
        """Both launches of one split call.  The plan's arrays and the workspace's fields are 16-byte
        aligned by construction, so the arguments' specialization is fixed by the strides, the
        split count, the table's width and the caller's pointers (the key below)."""
        spec = self.module.SPEC
        total_q = q.shape[0]
        if total_q == 0:
            return out, lse
        s_cap = plan["splits"]
        abi_mlu = plan["abi"] == "mlu"
        import torch
        vec = vector_torch_dtype(self.module, plan["abi"])
        n, fields, size = split.workspace_layout(total_q, s_cap, plan["abi"], spec["H_Q"], spec["D_V"], vec.itemsize)
        if workspace.dtype != torch.uint8 or workspace.numel() < size:
            raise PlanError(f"workspace: {workspace.numel()} {workspace.dtype} elements; this call needs {size} uint8")

        def field(name, dtype):
            off, count = fields[name]
            return workspace[off:off + count * dtype.itemsize].view(dtype)
        p_o, p_m, p_valid = field("o", vec), field("m", torch.float32), field("valid", torch.uint8)
        p_l = field("l", torch.float32) if abi_mlu else p_m
        block_q = plan["block_q"]
        ks, vs = plan["k_strides"], plan["v_strides"]
        g_pad = max(split.next_power_of_2(spec["GROUP"]), 16 // block_q)
        producer = self._launcher("split", dict(
            CACHE=plan["cache"], PAGE_SIZE=plan["page_size"], ABI_MLU=abi_mlu, ONE_ROW=bool(plan["one_row"]),
            BLOCK_Q=block_q, BLOCK_N=plan["block_n"], G_PAD=g_pad, BOUNDED=bool(plan["bounded"])))
        args = (q, k_cache, v_cache, p_o, p_m, p_l, p_valid, *q.stride(), *ks, *vs,
                arrays["kv_lens"], arrays["qo_indptr"], arrays["tile_req"], arrays["tile_row0"], arrays["base"],
                arrays["table"], plan["table_stride"], arrays["entry_ptr"], arrays["blocks"], arrays["partial"], ts,
                s_cap, qk_scale(self.module), arrays["split_bounds"])
        aligned = (q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0,
                   workspace.data_ptr() % 16 == 0)
        key = (aligned, spec_key(q.stride() + tuple(ks) + tuple(vs) + (plan["table_stride"], s_cap)), spec_key(ts))
        producer.launch((s_cap, plan["tiles"] * spec["H_KV"]), args, key)
        pad = max(2, split.next_power_of_2(min(s_cap, COMBINE_SLOTS)))
        combine = self._launcher("combine", dict(ABI_MLU=abi_mlu, SPLITS_PAD=pad))
        cargs = (p_o, p_m, p_l, p_valid, out, lse, *out.stride(), s_cap)
        combine.launch((total_q * spec["H_Q"],), cargs,
                       (aligned[3], out.data_ptr() % 16 == 0, spec_key(out.stride() + (s_cap,))))
        return out, lse


def workspace_bytes(module, total_q: int, splits: int, abi: str) -> int:
    if abi == "shared_shift":
        from .shared_shift import workspace_layout
        return workspace_layout(total_q, splits, module.SPEC["H_Q"], module.SPEC["D_V"])[2]
    return split.workspace_layout(total_q, splits, abi, module.SPEC["H_Q"], module.SPEC["D_V"],
                                  vector_torch_dtype(module, abi).itemsize)[2]


def vector_torch_dtype(module, abi: str):
    """The workspace's partial O / u dtype: the ledger's declared one for the spec's storage."""
    return _vector_torch_dtype(abi, module.DTYPE)


@functools.lru_cache(maxsize=None)
def _vector_torch_dtype(abi: str, storage: str):
    import torch
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[vector_dtype(abi, storage)]


def check_device(named: dict, device: str) -> None:
    """Torch inputs must be where the kernel runs (numpy inputs are copied there for the caller)."""
    import torch
    for n, t in named.items():
        if isinstance(t, torch.Tensor) and t.device.type != device:
            raise InputError(f"inputs: '{n}' is a torch tensor on {t.device}; this Triton kernel runs on "
                             f"{device}: move the torch inputs there (numpy inputs are copied for you)")


# ---------------------------------------------------------------- split calls on the Gluon engine
# A split call whose query rows fill at least this share of the engine's 128-row tiles runs on the
# Gluon engine over the cache (``gluon_paged``), without splits; decode rows (one per request) and
# batches of mostly short appends keep the split producer, whose tiles pack a GQA group's rows.
CACHE_ENGINE_FILL = 0.5
CACHE_ENGINE_DIMS = (64, 128, 256)  # q.k and v head dims (the packed views' columns: a power of two)
CACHE_ENGINE_MIN_PAGE = 8  # a page's rows per copy: TMA boxes land on 8-row swizzle atoms


def cache_engine_tiles(d_qk: int, d_v: int) -> tuple[int, int]:
    """(query rows, keys) of the engine's tiles over a cache, as over contiguous tensors."""
    return GLUON_WIDE_TILES if max(d_qk, d_v) > 128 else GLUON_TILES


def cache_engine_refusal(program: ir.Program, kind: str, page_size: int, k, v) -> str | None:
    """Why the Gluon engine cannot run this spec's split calls over this cache (a sentence), or
    None: sm_90, f16 / bf16, head dims 64 / 128 / 256, pages of at least 8 rows that divide or
    are a multiple of the key block, contiguous 16-byte aligned K/V storage in the spec's dtype."""
    if not hasattr(k, "is_cuda") or not k.is_cuda:
        return "the cache is not on a GPU"
    if interpreted():
        return "Gluon kernels do not run in Triton's interpreter"
    if capability(k.device) != 90:
        return "the Gluon engine needs an sm_90 GPU (Hopper: wgmma and TMA)"
    if not gluon_engine.HAS_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if program.dtype not in ("f16", "bf16"):
        return f"the Gluon engine takes f16 / bf16, not {program.dtype}"
    if program.d_qk not in CACHE_ENGINE_DIMS or program.d_v not in CACHE_ENGINE_DIMS:
        return (f"the Gluon engine over a cache takes head dims {', '.join(map(str, CACHE_ENGINE_DIMS))}, "
                f"not {program.d_qk} / {program.d_v}")
    block_n = cache_engine_tiles(program.d_qk, program.d_v)[1]
    if kind == "paged" and (page_size < CACHE_ENGINE_MIN_PAGE or (page_size % block_n and block_n % page_size)):
        return (f"the Gluon engine copies pages of at least {CACHE_ENGINE_MIN_PAGE} rows that divide or are a "
                f"multiple of its {block_n}-key blocks, not {page_size}")
    want = {"f16": "torch.float16", "bf16": "torch.bfloat16"}[program.dtype]
    if str(k.dtype) != want or str(v.dtype) != want:
        return f"the cache holds {k.dtype} / {v.dtype}, not the spec's {program.dtype}"
    if not tma_ready(k, v):
        return "the Gluon engine reads contiguous K/V storage at 16-byte aligned addresses (TMA)"
    return None


def split_engine(program: ir.Program, kind: str, page_size: int, k, v, q_lens: np.ndarray) -> str | None:
    """"gluon" when a split call's rows fill the engine's tiles (CACHE_ENGINE_FILL) and the engine
    takes the spec and cache (``cache_engine_refusal``), else None: the split producer."""
    rows = int(q_lens.sum())
    tiles = int((-(-q_lens // (2 * gluon_engine.ROWS))).sum())
    if rows == 0 or rows < CACHE_ENGINE_FILL * tiles * 2 * gluon_engine.ROWS:
        return None
    return "gluon" if cache_engine_refusal(program, kind, page_size, k, v) is None else None


class CacheLaunch(_GluonDescriptors):
    """The Gluon engine over a cache (``gluon_paged._paged_fwd_ws``) for one spec and one cache
    shape (page size, layout): ``__call__(q, k_cache, v_cache, plan, arrays, ts, out, lse,
    workspace)`` as ``SplitLaunch``'s (the workspace is unused: no split)."""

    def __init__(self, module, block_n: int, paged: bool, page_size: int, device):
        self.module, self.device = module, device
        spec = module.SPEC
        d_qk, d_v = spec["D_QK"], spec["D_V"]
        self.block_n = block_n
        page = page_size if paged else block_n
        maxnreg, consumer, producer = gluon_regs(d_qk, d_v)
        stages = gluon_stages(d_qk, d_v, block_n, GLUON_STAGES)
        q_bufs = gluon_q_buffers(d_qk, d_v, block_n, stages)
        keep = {n: spec[n] for n in ("HAS_SCORE", "SCALE", "H_Q", "GROUP")}
        self.sms = sm_count(device)
        self._descs, self._layouts = {}, {}
        self._constexprs = dict(
            ROWS_=gluon_engine.ROWS, BLOCK_N=block_n, D=d_v, STAGES=stages, CONSUMER_REGS=consumer,
            PRODUCER_REGS=producer, D_QK=d_qk, PAGED=paged, PAGE=page, CHUNK=min(page, block_n),
            OVERLAP=gluon_overlap(d_qk, d_v, False), PINGPONG=gluon_pingpong(d_qk, d_v, False), Q_BUFS=q_bufs,
            **keep)
        self._maxnreg = maxnreg
        self._launchers: dict = {}

    def _launcher(self, end: int | None) -> Launcher:
        """The launch for calls whose positions lie below ``end`` (the fast score forms or not, the
        separable form or not: ``separable_mode``; None, unknown positions: neither)."""
        fast, mode = fast_scores(end), separable_mode(self.module, end, self.block_n)
        lz = self._launchers.get((fast, mode))
        if lz is None:
            from . import gluon_paged
            score, _ = score_functions(self.module, end)
            lz = self._launchers[(fast, mode)] = Launcher(gluon_paged._paged_fwd_ws, dict(
                self._constexprs, VISIBLE=self.module.visible, SCORE=score,
                **separable_constexprs(self.module, end, self.block_n)), num_warps=4, maxnreg=self._maxnreg)
        return lz

    def __call__(self, q, k_cache, v_cache, plan: dict, arrays: dict, ts: tuple, out, lse, workspace):
        spec = self.module.SPEC
        h_q, h_kv, d_qk, d_v = spec["H_Q"], spec["H_KV"], spec["D_QK"], spec["D_V"]
        jobs = plan["tiles"] * h_q
        if jobs == 0:
            return out, lse
        if not tma_ready(q):  # (a fresh copy: a contiguous view at an odd address stays one under .contiguous())
            import torch
            q = torch.empty_like(q, memory_format=torch.contiguous_format).copy_(q)
        if not tma_ready(k_cache, v_cache):
            raise PlanError("the plan runs on the Gluon engine, which reads contiguous K/V storage at 16-byte "
                            "aligned addresses (TMA); this cache is not: make the plan for it (decode_plan) or pass "
                            "engine='split'")
        rows = gluon_engine.ROWS
        token_major = plan["kind"] == "ragged" or plan["order"] in ("nhd", "bshd")
        if token_major:  # [rows, H_kv * d]: a head's keys in its columns
            k2, v2 = k_cache.view(-1, h_kv * d_qk), v_cache.view(-1, h_kv * d_v)
            page_rows, head_rows, k_col, v_col = plan["page_size"], 0, d_qk, d_v
        else:  # [rows, d]: a head's keys in its rows (hnd pages: H_kv * page rows; bhsd: T rows per head)
            k2, v2 = k_cache.view(-1, d_qk), v_cache.view(-1, d_v)
            per_head = plan["page_size"] if plan["kind"] == "paged" else k_cache.shape[2]
            page_rows, head_rows, k_col, v_col = h_kv * per_head, per_head, 0, 0
        bn = self.block_n
        chunk = self._constexprs["CHUNK"]
        desc = gluon_engine.TensorDescriptor.from_tensor

        def make(t, block):
            return lambda: desc(t, block, self._gluon_layout(block, t.dtype))
        ints = (plan["table_stride"], page_rows, head_rows, k_col, v_col)
        key = (spec_key(ints + (jobs,)), spec_key(ts))
        launcher = self._launcher(plan["position_end"])
        q_desc = self._cached(q, "q", make(q.view(-1, h_q * d_qk), [rows, d_qk]))
        o_desc = launcher.output_descriptor(key, out, h_q * d_v, make(out.view(-1, h_q * d_v), [rows, d_v]))
        k_desc = self._cached(k_cache, "k", make(k2, [chunk, d_qk]))
        v_desc = self._cached(v_cache, "v", make(v2, [chunk, d_v]))
        stream = _stream()
        args = (q_desc, k_desc, v_desc, o_desc, out, lse, _counter(self.device, stream), arrays["jobs"],
                arrays["entry_ptr"], arrays["blocks"], arrays["partial"], arrays["kv_lens"], arrays["qo_indptr"],
                arrays["tile_req"], arrays["tile_row0"], arrays["base"], arrays["table"], *ints, ts, jobs,
                qk_scale(self.module))
        launcher.launch((min(jobs, self.sms),), args, key, stream)
        return out, lse
