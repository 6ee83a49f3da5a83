"""The Triton backend's engine and configuration choice: which engine, tiles, warps, stages, walk
and schedule a call runs with (``choose_prefill``, frozen as a ``PrefillConfig``), the Gluon
engine's refusals and buffers (stages, Q buffers, registers).  Which split calls run on the Gluon
engine over the cache: ``split_choice.py``.  The launches themselves: ``launch.py``.

The choice, in order of authority: what the caller asked for, else ``attnc tune``'s winner for
the call's dispatch key, else the untuned defaults below (measured on the H200; the numbers live
in bench/results/README.md):

* Hopper (sm_90), f16 / bf16, head dims 64, 128, 192 or 256 (q.k's and v's may differ: 192 /
  128 as in MLA prefill), any S_q and S_k (the tiles across the ends are masked), q, k, v and O
  each contiguous bhsd or token-major bshd (``gluon_layouts``: transformers' transposed views,
  read and written in place): the Gluon engine (``gluon_engine.py``) on ``gluon_default_tiles`` (128 x 128; above
  128, 128 x 64; at most 64, 192 x 128 on three consumer warpgroups, unless its rows are short:
  ``GLUON_SHORT_ROW_BLOCKS``, narrow windows), 2 K/V stages, programs
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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnc import layouts as LO
from attnc.compiler import ir

from .device import interpreted
from .kernels import gluon_engine, prefill
# the Gluon engine's tiles are the split calls' too (declared there)
from .split_choice import GLUON_TILES, GLUON_WIDE_TILES  # noqa: F401  (re-exported)

HEAD_GROUP = 4  # heads whose tiles interleave, longest first (``prefill._job``)
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
# The Gluon engine's 192-row tiles (d <= 64) on rows this short (computed K/V blocks per tile, on
# average) give the call to the Triton kernel's short-row config: gpt-oss's sliding layer (window
# 128, GQA 64/8, d 64, sinks, B4 S8K bf16) on the H200 ran 1005 us on 192 x 128 Gluon tiles (about 3.5
# blocks a tile, 1/3 of their cells visible, ptxas spilling once a sink joins the window's
# epilogue), 622 us on 128 x 128 and 576 us on the Triton kernel's 64 x 64 (FlashAttention-4: 570;
# bench/results/sinks_h200_r53.jsonl)
GLUON_SHORT_ROW_BLOCKS = 4
GLUON_SHORT_ROW_KEYS = 8  # ... of at least this many key blocks (short rows of a long call; small calls stay)
SHORT_ROW_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3}  # warps follow the tile: 4
MERGED_RUN_BLOCKS = 24  # the merged walk once the plan's runs average this many blocks
INTERPRETER_TILES = (16, 16)
ENGINES = (None, "gluon", "triton")
MASK_SOURCES = (None, "predicate", "intervals", "rows")

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
    layouts: tuple = (LO.BHSD,) * 4  # how the Gluon engine's TMA addresses q, k, v and O (``gluon_layouts``)

    def describe(self) -> str:
        tail = (f"schedule {self.schedule}" if self.engine == "gluon"
                else f"walk {self.walk}, {self.num_warps} warps" + (", TMA" if self.use_tma else ""))
        if self.engine == "gluon" and self.layouts != BHSD_LAYOUTS:
            tail += ", q/k/v/o " + "/".join(self.layouts)
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


def short_gluon_rows(plan) -> bool:
    """Whether a plan on the Gluon engine's 192-row tiles has rows too short for them: at most
    ``GLUON_SHORT_ROW_BLOCKS`` computed blocks per tile of at least ``GLUON_SHORT_ROW_KEYS`` key
    blocks (narrow windows at head dims up to 64; a short call keeps the engine)."""
    return (plan.block_m == 192 and plan.tiles.classes.shape[3] >= GLUON_SHORT_ROW_KEYS
            and mean_row_blocks(plan) <= GLUON_SHORT_ROW_BLOCKS)


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
    if program.d_qk not in GLUON_HEAD_DIMS or program.d_v not in GLUON_V_DIMS:
        return (f"the Gluon engine takes q.k head dims {', '.join(map(str, GLUON_HEAD_DIMS))} and v head dims "
                f"{', '.join(map(str, GLUON_V_DIMS))}, not {program.d_qk} / {program.d_v}")
    return None


BHSD_LAYOUTS = (LO.BHSD,) * 4
BHSD_REFUSAL = "the Gluon engine reads and writes contiguous bhsd tensors at 16-byte aligned addresses (TMA)"
FP8_LAYOUT_REFUSAL = "the Gluon engine's FP8 calls read contiguous bhsd q and k at 16-byte aligned addresses (TMA)"


def tensor_layout(shape, strides, address: int, itemsize: int, d: int) -> str | None:
    """How the Gluon engine's TMA copies tiles of a logical bhsd tensor [B, H, S, d] (q, k, v or
    O; ``attnc.layouts``): "bhsd" where it is contiguous (a [B * H * S, d] view; a head's rows
    follow each other, ``gluon_box(d)`` columns, zero-filled past d), "bshd" where it is token-major
    with d a power of two (a [B * S, H * d] view with rows ``token_rows`` apart, [rows, d] boxes at
    column h * d: a box wider than d would read the next head's columns), and only at a 16-byte
    aligned address (and, bshd, row pitch); else None."""
    if address % 16:
        return None
    order = LO.order_of(shape, strides)
    if order == LO.BHSD:
        return LO.BHSD
    if order == LO.BSHD and gluon_box(d) == d and int(shape[0]) * int(shape[2]) > 0 and \
            LO.token_rows(shape, strides) * itemsize % 16 == 0:
        return LO.BSHD
    return None


def gluon_layouts(q, k, v, o_order: str) -> tuple[str, str, str, str] | str:
    """The Gluon engine's layouts of a call's logical bhsd q, k, v (torch tensors, or anything with
    ``shape``, ``stride()``, ``data_ptr()`` and ``element_size()``) and of its O, which the call
    allocates in ``o_order`` (``attnc.layouts.out_order``): ("bhsd" | "bshd",) * 4 for
    (q, k, v, O) (``tensor_layout``), or the sentence saying why the engine cannot read them."""
    out = []
    for n, t in (("q", q), ("k", k), ("v", v)):
        lay = tensor_layout(t.shape, t.stride(), t.data_ptr(), t.element_size(), t.shape[3])
        if lay is None:
            return (f"the Gluon engine reads q, k and v contiguous (bhsd) or token-major (bshd: [B, S, H, d] "
                    f"memory, head dims 64, 128 or 256) at 16-byte aligned addresses (TMA); '{n}' (shape "
                    f"{list(t.shape)}, strides {list(t.stride())}) is neither")
        out.append(lay)
    return (*out, o_order)


def gluon_call_refusal(program: ir.Program, s_q: int, s_k: int, layouts: tuple | str, device_capability: int,
                       tiles: tuple[int, int] = GLUON_TILES) -> str | None:
    """Why the Gluon engine cannot run this call, or None.  ``layouts``: ``gluon_layouts``' answer
    for the call's tensors (a tuple: readable; a sentence: why not)."""
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
    if isinstance(layouts, str):
        return layouts
    return None


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
                   contiguous: bool, device_capability: int, given_plan=None, fp8: bool = False,
                   layouts: tuple | str | None = None):
    """The config and plan of a prefill call (module docstring).  ``plan_for(block_m, block_n)``
    makes (or finds) the plan at those tiles; ``given_plan`` is the caller's.  ``contiguous``: q, k
    and v are contiguous (the Triton kernel's TMA); ``layouts``: ``gluon_layouts``' answer for the
    Gluon engine (None: all bhsd where ``contiguous``, else refused).  Returns (PrefillConfig, Plan)."""
    if layouts is None:
        layouts = BHSD_LAYOUTS if contiguous else BHSD_REFUSAL
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
    refusal = gluon_call_refusal(program, s_q, s_k, layouts, device_capability, tiles or gluon_tiles)
    if engine == "gluon" and refusal:
        raise ValueError(f"engine='gluon': {refusal}")
    gluon = engine == "gluon" or (engine is None and not tuned and refusal is None)
    if asked.get("mask_source") == "rows" and not gluon:
        raise ValueError(f"mask_source='rows' is an option of the Gluon engine, which refuses this call: {refusal}")
    if tiles is None:
        tiles = gluon_tiles if gluon else (default["BLOCK_M"], default["BLOCK_N"])
    plan = given_plan if given_plan is not None else plan_for(*tiles)
    if gluon and engine is None and origin == "default" and short_gluon_rows(plan):
        gluon, tiles = False, (default["BLOCK_M"], default["BLOCK_N"])  # the Triton kernel's rule, below
        plan = plan_for(*tiles)
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
        schedule=asked.get("schedule") or "counter", origin=origin,
        layouts=tuple(layouts) if gluon else BHSD_LAYOUTS)
    return config, plan
