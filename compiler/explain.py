"""`attnc explain`: what the mask analyses say about one call shape (DESIGN §4, §7).

For a spec, concrete lengths and runtime tensors it reports whether FlashMask can
represent the mask (and if not, why), the four vectors ``UTS, UTE, LTS, LTE``, the tile
classes FULL / PARTIAL / SKIP with their counts and density, the fraction of visible
cells, and the resident-metadata ledger of M4.5 §0x06G.  It also exports the mask for
other runtimes: Paddle FlashMask's ``startend_row_indices`` with its ``causal`` flag, and
FlexAttention's BlockMask tensors.

Nothing here evaluates the ``S_q x S_k`` rectangle: everything comes from the analysis'
per-column row sets, so it stays O(S) for interval-representable masks (DESIGN §1), except
:func:`startend_row_indices_to_mask`, the dense restatement of Paddle's semantics that
tests use on small shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from . import inputs, ir, resources
from .analysis import run_plan_pipeline
from .analysis import intervals
from .analysis.intervals import MaskIntervals
from .analysis.tiles import FULL, PARTIAL, SKIP, TilePlan
from .errors import AttncError, InputError

DEFAULT_BLOCK = (128, 64)  # block_m (query rows) x block_n (keys), as in DESIGN §7's example
SAMPLE_BUDGET = 1 << 25  # q/k/v elements `inputs.sample` may draw before explain slims them
FLEX_BYTES_PER_TILE = 120  # kv_indices and full_kv_indices: argsort temporaries and Python lists


# ---------------------------------------------------------------- arguments
def parse_block(text: str) -> tuple[int, int]:
    """``"128x64"`` -> ``(block_m, block_n)``."""
    parts = text.lower().split("x")
    try:
        m, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected BLOCK_MxBLOCK_N such as 128x64, got {text!r}") from None
    if m < 1 or n < 1:
        raise ValueError(f"tile sizes must be positive, got {text!r}")
    return m, n


def call_tensors(program: ir.Program, batch: int, s_q: int, s_k: int,
                 given: dict[str, np.ndarray] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Every declared tensor for one call: the ``given`` arrays, the rest drawn from the
    spec's sample distributions with :func:`inputs.sample` — the same values ``attnc run``
    draws for the same batch, lengths and seed (for calls whose q/k/v would exceed
    ``SAMPLE_BUDGET`` elements, q/k/v are drawn with head_dim 1, which changes the stream).
    Shapes and dtypes are checked as :func:`inputs.validate` checks them."""
    given = dict(given or {})
    declared = [t.name for t in program.tensors]
    for name in given:
        if name not in declared:
            shown = ", ".join(declared) if declared else "none"
            raise InputError(f"--tensor {name}: spec '{program.name}' declares no tensor '{name}' "
                             f"(declared: {shown})")
    if batch < 1 or s_q < 1 or s_k < 1:
        raise InputError(f"explain needs B >= 1, S_q >= 1 and S_k >= 1, got B = {batch}, "
                         f"S_q = {s_q}, S_k = {s_k}")
    if s_q > s_k:
        raise InputError(f"S_q = {s_q} query rows exceed S_k = {s_k} keys; S_q <= S_k "
                         "(query rows are the last S_q positions)")
    # A slim program (head_dim 1, contiguous cache) keeps the q/k/v validate needs small.
    slim = replace(inputs.contiguous_variant(program), d_qk=1, d_v=1)
    missing = [n for n in declared if n not in given]
    if missing:
        p = program
        elements = batch * (p.heads_q * s_q * p.d_qk + p.heads_kv * s_k * (p.d_qk + p.d_v))
        source = program if elements <= SAMPLE_BUDGET else slim
        drawn = inputs.sample(source, batch, s_q, s_k, seed)
        given.update({n: drawn[n] for n in missing})
    return inputs.validate_tensors(program, given, batch, s_k)


# ---------------------------------------------------------------- the ledger
def metadata_ledger(s_q: int, s_k: int, block_n: int, extent: int = 1) -> dict[str, int]:
    """Resident metadata bytes of M4.5 §0x06G for ``extent`` = B' x H' masks of S_q x S_k:
    a one-byte dense mask, four int32 vectors over the columns, eight int32 summaries per
    K/V block.  Arithmetic only — nothing of size S_q x S_k is built."""
    return {
        "dense_u8": s_q * s_k * extent,
        "four_int32_vectors": 4 * 4 * s_k * extent,
        "eight_int32_summaries": 8 * 4 * math.ceil(s_k / block_n) * extent,
    }


# ---------------------------------------------------------------- the report
@dataclass(frozen=True)
class Explanation:
    """``intervals`` and ``plan`` are the analysis' (the tiles a kernel plans with); ``columns``
    are the mask's per-column rows as exactly as they are known: the analysis' where it is exact,
    else the per-column evaluation's (``analysis.intervals.evaluate_columns``) when the budget
    allows it.  Representability, the FlashMask vectors and the visible fraction come from
    ``columns``: they depend on the mask, not on how it is written."""

    program: ir.Program
    batch: int
    intervals: MaskIntervals
    plan: TilePlan
    evaluated: MaskIntervals | None = None  # the per-column evaluation, where the analysis is inexact
    skipped: str | None = None  # why that evaluation did not run (over the budget)

    @property
    def columns(self) -> MaskIntervals:
        return self.evaluated if self.evaluated is not None else self.intervals

    @property
    def _rows(self) -> MaskIntervals:
        """Per-column visible rows to count cells with (an unrepresentable evaluation keeps none)."""
        e = self.evaluated
        return e if e is not None and e.representable else self.intervals

    @property
    def s_q(self) -> int:
        return self.intervals.s_q

    @property
    def s_k(self) -> int:
        return self.intervals.s_k

    @property
    def extent(self) -> int:
        """B' x H': how many distinct masks the analysis kept (1 when the mask reads neither
        b nor h)."""
        return self.intervals.shape[0] * self.intervals.shape[1]

    def visible_cells(self) -> tuple[int, int]:
        """(cells certainly visible, cells possibly visible) over B' x H' x S_q x S_k;
        equal when the analysis is exact.  Counted from the row sets, per column."""
        vis = self._rows.visible
        return int(vis.must.cells_in(0, self.s_q).sum()), int(vis.may.cells_in(0, self.s_q).sum())

    def rectangle(self) -> int:
        return self.extent * self.s_q * self.s_k

    def visible_fraction(self) -> float | None:
        """Visible cells / rectangle when the analysis is exact, else None."""
        lo, hi = self.visible_cells()
        if lo != hi or not self.rectangle():
            return None
        return lo / self.rectangle()

    def paddle(self) -> "PaddleMask":
        """The Paddle FlashMask export of the mask (:func:`paddle_startend_row_indices` of
        ``columns``); when the evaluation was over budget, the error says so."""
        try:
            return paddle_startend_row_indices(self.columns, self.program, self.batch)
        except AttncError as e:
            if not self.skipped:
                raise
            raise AttncError(f"{e.diagnostics[0].message}; the per-column evaluation that decides it "
                             f"exactly was skipped: {self.skipped}") from None

    def ledger(self) -> dict[str, int]:
        return metadata_ledger(self.s_q, self.s_k, self.plan.block_n, self.extent)

    def to_json(self) -> dict:
        mi, plan = self.columns, self.plan
        lo, hi = self.visible_cells()
        rect = self.rectangle() or 1
        out = {
            "spec": self.program.name,
            "representable": mi.representable,
            "reason": mi.reason,
            "exact": self.intervals.exact,  # the analysis (its tiles are what a kernel plans)
            "analysis_reason": None if self.intervals.exact else self.intervals.reason,
            "columns_from": mi.method,  # "analysis", or "evaluation" where the analysis is inexact
            "evaluation_skipped": self.skipped,
            "batch": self.batch,
            "shape": list(mi.shape),
            "s_q": self.s_q,
            "s_k": self.s_k,
            "block": {"m": plan.block_m, "n": plan.block_n},
            "tile_grid": list(plan.classes.shape),
            "tiles": plan.counts(),
            "density": plan.density(),
            "method": plan.method,
            # which method classified the tiles: the interval analysis alone, or the predicate
            # evaluated over the tiles it left undecided (analysis.tile_eval)
            "tiles_classified_by": "evaluation" if plan.evaluated_by else "analysis",
            "tiles_undecided": plan.undecided,
            "tiles_evaluated_by": plan.evaluated_by,
            "tiles_exact": plan.exact,
            "tiles_evaluation_skipped": plan.skipped,
            "visible_fraction": self.visible_fraction(),
            "visible_fraction_bounds": [lo / rect, hi / rect],
            "metadata_bytes": self.ledger(),
        }
        for name, v in mi.vectors().items():
            out[name] = v.tolist() if mi.representable else None
        return out

    def text(self, source: str | None = None) -> str:
        mi, plan = self.columns, self.plan
        b_, h_, _ = mi.shape
        where = f" ({source})" if source else ""
        lines = [f"{self.program.name}{where}: B={self.batch} S_q={self.s_q} S_k={self.s_k}, "
                 f"tiles {plan.block_m}x{plan.block_n} (block_m query rows x block_n keys)"]
        if mi.representable:
            lines.append(f"representable: yes (FlashMask UTS/UTE/LTS/LTE, shape [{b_}, {h_}, {self.s_k}])")
        else:
            lines.append(f"representable: no: {mi.reason}")
        if self.evaluated is not None:
            lines.append(f"  by per-column evaluation of the mask: the interval analysis is not exact here "
                         f"({self.intervals.reason})")
        elif self.skipped:
            lines.append(f"  per-column evaluation skipped: {self.skipped}")
        c = plan.counts()
        t_r, t_c = plan.classes.shape[2:]
        lines.append(f"tiles ({b_} x {h_} x {t_r} x {t_c} = {plan.classes.size}, method {plan.method}): "
                     f"full {c['full']}, partial {c['partial']}, skip {c['skip']}; classified by "
                     f"{plan.classified_by()}")
        frac = self.visible_fraction()
        if frac is None:
            lo, hi = self.visible_cells()
            vis = f"between {lo / self.rectangle():.4f} and {hi / self.rectangle():.4f}"
        else:
            vis = f"{frac:.4f}"
        lines.append(f"density: {plan.density():.4f} of tiles computed; visible cells: {vis} of the rectangle")
        led = self.ledger()
        lines.append(f"metadata bytes (B'*H' = {self.extent}): dense u8 {led['dense_u8']:,}, "
                     f"four int32 vectors {led['four_int32_vectors']:,}, "
                     f"eight int32 summaries {led['eight_int32_summaries']:,}")
        return "\n".join(lines) + "\n"


def explain(program: ir.Program, batch: int, s_q: int, s_k: int, tensors: dict | None = None,
            block_m: int = DEFAULT_BLOCK[0], block_n: int = DEFAULT_BLOCK[1]) -> Explanation:
    """Intervals and tile plan of ``program``'s mask for one call shape; ``tensors`` as
    :func:`call_tensors` returns them.  The pipeline's intervals -> tiles (``analysis.PLAN_PIPELINE``)."""
    r = run_plan_pipeline(("intervals", "tiles"), program=program, batch=batch, s_q=s_q, s_k=s_k,
                          tensors=tensors or {}, block_m=block_m, block_n=block_n, method="auto")
    evaluated = skipped = None
    if not r["intervals"].exact:  # representability is the mask's: evaluate it column by column
        cells = intervals.evaluation_cells(program, batch, s_q, s_k)
        try:
            resources.require(f"the per-column evaluation of the mask ({cells:,} cells)",
                              cells * intervals.EVAL_BYTES_PER_CELL)
        except resources.ResourceError as e:
            skipped = e.diagnostics[0].message
        else:
            evaluated = intervals.evaluate_columns(program, batch, s_q, s_k, tensors)
    return Explanation(program, batch, r["intervals"], r["tiles"], evaluated, skipped)


# ---------------------------------------------------------------- Paddle FlashMask
@dataclass(frozen=True)
class PaddleMask:
    """Paddle FlashMask's ``startend_row_indices`` (int32 ``[B, 1 or H, S_k, n]``) and
    ``causal`` flag for one call shape.  ``n`` and its columns (Paddle's
    ``flashmask_attention``): causal ``[LTS]`` or ``[LTS, LTE]``; not causal ``[LTS, UTE]``
    or ``[LTS, LTE, UTS, UTE]``.  Values are query row indices in ``[0, S_q]``."""

    causal: bool
    startend_row_indices: np.ndarray
    s_q: int
    s_k: int

    def to_json(self, arrays: bool = True) -> dict:
        out = {"causal": self.causal, "shape": list(self.startend_row_indices.shape),
               "s_q": self.s_q, "s_k": self.s_k}
        if arrays:
            out["startend_row_indices"] = self.startend_row_indices.tolist()
        if self.s_q != self.s_k:
            out["note"] = (f"S_q = {self.s_q} < S_k = {self.s_k}: values are row indices of the last "
                           f"{self.s_q} positions and causal is bottom-right aligned, as in Paddle's "
                           "startend_row_indices_to_attn_bias; flashmask(sri, causal) in a spec reads "
                           "values as absolute positions, so bring back the prefill export (S_q = S_k)")
        return out


def _overlap(lo, hi, s, e):
    return np.clip(np.minimum(hi, e) - np.maximum(lo, s), 0, None)


def paddle_startend_row_indices(mi: MaskIntervals, program: ir.Program, batch: int) -> PaddleMask:
    """The most compact exact Paddle encoding of an analysed mask: ``causal=True`` with one
    bound (``[LTS]``) or two (``[LTS, LTE]``) when every column hides its whole causal upper
    triangle and at most one more run; else ``causal=False`` with ``[LTS, UTE]`` when each
    column's hidden rows are a head ``[0, UTE)`` and a tail ``[LTS, S_q)``; else the four
    bounds.  Raises :class:`AttncError` with the reason when Paddle cannot express the mask."""
    if not mi.representable:
        raise AttncError(f"'{program.name}' is not FlashMask-representable at S_q = {mi.s_q}, "
                         f"S_k = {mi.s_k}: {mi.reason}")
    R = mi.s_q
    v = {n: a.astype(np.int64) for n, a in mi.vectors().items()}
    k = np.arange(mi.s_k)
    diag = np.clip(k - mi.q_offset, 0, R)  # rows above the diagonal (q < k): [0, diag)
    # The two hidden runs of each column, either possibly empty, earlier one first.
    a_s, a_e, b_s, b_e = v["UTS"], v["UTE"], v["LTS"], v["LTE"]
    swap = (b_e > b_s) & ((a_e <= a_s) | (b_s < a_s))
    p_s, p_e = np.where(swap, b_s, a_s), np.where(swap, b_e, a_e)
    q_s, q_e = np.where(swap, a_s, b_s), np.where(swap, a_e, b_e)
    has_p, has_q = p_e > p_s, q_e > q_s

    # causal: [0, diag) hidden, and what remains below it is at most one run [rs, re)
    covered = _overlap(0, diag, p_s, p_e) + _overlap(0, diag, q_s, q_e) == diag
    pr_s, qr_s = np.maximum(p_s, diag), np.maximum(q_s, diag)
    p_rest, q_rest = p_e > pr_s, q_e > qr_s
    causal_ok = covered & ~(p_rest & q_rest)
    rs = np.where(p_rest, pr_s, np.where(q_rest, qr_s, R))
    re = np.where(p_rest, p_e, np.where(q_rest, q_e, R))

    # not causal, two bounds: every hidden run is a head [0, UTE) or a tail [LTS, S_q)
    head_end = np.maximum(np.where(has_p & (p_s == 0), p_e, 0), np.where(has_q & (q_s == 0), q_e, 0))
    p_tail, q_tail = has_p & (p_s > 0), has_q & (q_s > 0)
    two_ok = (~p_tail | (p_e == R)) & (~q_tail | (q_e == R))
    tail_start = np.minimum(np.where(p_tail, p_s, R), np.where(q_tail, q_s, R))

    if causal_ok.all() and (re == R).all():
        causal, cols = True, [rs]
    elif causal_ok.all():
        causal, cols = True, [rs, re]
    elif two_ok.all():
        causal, cols = False, [tail_start, head_end]
    else:
        # two runs: the earlier is the upper pair; a single run is upper when it starts at
        # row 0 or lies wholly above the diagonal (as in Paddle's figures), else lower
        single_up = has_p & ~has_q & ((p_s == 0) | (p_e <= diag))
        up = (has_p & has_q) | single_up
        lo_s = np.where(has_q, q_s, np.where(has_p & ~single_up, p_s, R))
        lo_e = np.where(has_q, q_e, np.where(has_p & ~single_up, p_e, R))
        causal, cols = False, [lo_s, lo_e, np.where(up, p_s, 0), np.where(up, p_e, 0)]
    sri = np.stack(cols, axis=-1).astype(np.int32)  # [B', H', S_k, n]
    sri = _paddle_heads(sri, program)
    sri = np.ascontiguousarray(np.broadcast_to(sri, (batch,) + sri.shape[1:]))
    return PaddleMask(causal, sri, mi.s_q, mi.s_k)


def _paddle_heads(sri: np.ndarray, program: ir.Program) -> np.ndarray:
    """Paddle's head axis is 1 or H_kv; ours is 1 or H_q."""
    if sri.shape[1] == 1:
        return sri
    if (sri == sri[:, :1]).all():
        return sri[:, :1]
    g = program.group
    if g == 1:
        return sri
    grouped = sri.reshape(sri.shape[0], program.heads_kv, g, *sri.shape[2:])
    same = (grouped == grouped[:, :, :1]).all(axis=(2, 3, 4))
    if not same.all():
        b, kv = (int(x[0]) for x in np.nonzero(~same))
        raise AttncError(f"'{program.name}' differs between query heads {kv * g}..{kv * g + g - 1} "
                         f"(b={b}) that share K/V head {kv}; Paddle's startend_row_indices has 1 "
                         f"or H_kv = {program.heads_kv} heads")
    return grouped[:, :, 0]


def startend_row_indices_to_mask(sri: np.ndarray, causal: bool, s_q: int, heads: int | None = None) -> np.ndarray:
    """Visible cells ``bool [B, heads, S_q, S_k]`` of a Paddle ``startend_row_indices``: a
    numpy restatement of ``startend_row_indices_to_attn_bias`` (PaddlePaddle/flash-attention,
    flashmask/tests/generate_startend_row_indices.py): half-open row ranges, causal aligned
    to the bottom-right corner, a head axis of 1 or ``heads / G`` repeated.  Dense: tests
    and small shapes only."""
    sri = np.asarray(sri, np.int64)
    batch, nh, s_k, n = sri.shape
    if (causal and n not in (1, 2)) or (not causal and n not in (2, 4)):
        raise ValueError(f"causal={causal} takes 1 or 2 bounds (causal) or 2 or 4 (not), got {n}")
    rows = np.arange(s_q).reshape(1, 1, -1, 1)
    col = lambda j: sri[:, :, None, :, j]  # noqa: E731  [B, nh, 1, S_k]
    has_end = (causal and n == 2) or (not causal and n == 4)
    masked = (rows >= col(0)) & (rows < col(1)) if has_end else rows >= col(0)
    if causal:
        masked |= rows < np.arange(s_k) - (s_k - s_q)
    elif has_end:
        masked |= (rows >= col(2)) & (rows < col(3))
    else:
        masked |= rows < col(1)
    visible = ~masked
    heads = heads or nh
    return np.repeat(visible, heads // nh, axis=1)


# ---------------------------------------------------------------- FlexAttention
def flex_block_mask(plan: TilePlan, s_q: int, s_k: int) -> dict:
    """FlexAttention ``BlockMask.from_kv_blocks`` arguments as JSON-ready lists: PARTIAL
    blocks (``kv_num_blocks``/``kv_indices``, mask_mod applied) and FULL blocks
    (``full_kv_*``, mask_mod skipped), ``BLOCK_SIZE = (block_m, block_n)``, shape
    ``[B', H', T_r(, T_c)]``."""
    resources.require(f"the FlexAttention export of {plan.classes.size:,} tiles (index arrays and their JSON lists)",
                      FLEX_BYTES_PER_TILE * plan.classes.size)
    out = {"BLOCK_SIZE": [plan.block_m, plan.block_n], "seq_lengths": [s_q, s_k],
           "shape": list(plan.classes.shape)}
    for name, a in plan.flex_block_mask().items():
        out[name] = a.tolist()
    if s_q != s_k:
        out["note"] = (f"query block rows count from the first of the last {s_q} positions; "
                       f"a mask_mod sees q_idx + {s_k - s_q} as the absolute position")
    return out


# ---------------------------------------------------------------- the tile map
CLASS_COLOURS = {SKIP: "#d9d9d9", PARTIAL: "#f4a261", FULL: "#2a6f97"}
MAX_PIXELS = 600  # tiles per axis drawn one to one; larger maps are reduced


def _downsample(tiles: np.ndarray, limit: int) -> tuple[np.ndarray, int]:
    """Reduce a class map by an integer factor so neither side exceeds ``limit``; each
    pixel keeps the costliest class among its tiles (PARTIAL > FULL > SKIP), so a thin
    band of computed tiles never disappears."""
    f = max(1, -(-max(tiles.shape) // limit))
    if f == 1:
        return tiles, 1
    cost = np.array([0, 2, 1])  # by class value SKIP=0, PARTIAL=1, FULL=2
    back = np.array([SKIP, FULL, PARTIAL])
    r, c = -(-tiles.shape[0] // f), -(-tiles.shape[1] // f)
    padded = np.zeros((r * f, c * f), np.int64)
    padded[:tiles.shape[0], :tiles.shape[1]] = cost[tiles]
    return back[padded.reshape(r, f, c, f).max(axis=(1, 3))].astype(np.int8), f


def render_tile_map(expl: Explanation, path: str, title: str | None = None) -> None:
    """The tile-class map of (b=0, h=0) as a PNG: K/V tile index across, Q tile index down
    (as in an attention matrix).  Needs matplotlib (``pip install attnc[plot]``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise AttncError("--png needs matplotlib, which is not installed; install the plot extra: "
                         "pip install 'attnc[plot]'") from None
    plan = expl.plan
    b_, h_, t_r, t_c = plan.classes.shape
    tiles = plan.classes[0, 0]
    names = {SKIP: "SKIP", PARTIAL: "PARTIAL", FULL: "FULL"}
    counts = {c: int((tiles == c).sum()) for c in (FULL, PARTIAL, SKIP)}
    image, f = _downsample(tiles, MAX_PIXELS)
    # Each tile is block_m tall and block_n wide, so the map has the attention matrix's shape.
    aspect = plan.block_m / plan.block_n
    width = 7.0
    height = float(np.clip(width * (t_r * plan.block_m) / max(t_c * plan.block_n, 1), 2.0, 9.0))
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    cmap = ListedColormap([CLASS_COLOURS[SKIP], CLASS_COLOURS[PARTIAL], CLASS_COLOURS[FULL]])
    rows, cols = image.shape
    ax.imshow(image, cmap=cmap, vmin=-0.5, vmax=2.5, interpolation="nearest", aspect=aspect,
              extent=(-0.5, cols * f - 0.5, rows * f - 0.5, -0.5))
    ax.set_xlim(-0.5, t_c - 0.5)
    ax.set_ylim(t_r - 0.5, -0.5)  # Q tile 0 at the top, as in an attention matrix
    if t_c <= 64 and t_r <= 64:  # tile borders while they are visible
        ax.set_xticks(np.arange(-0.5, t_c, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, t_r, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel(f"K/V tile index (block_n = {plan.block_n} keys)")
    ax.set_ylabel(f"Q tile index\n(block_m = {plan.block_m} rows)")
    shown = f"; b=0 h=0 of B'={b_} H'={h_}" if b_ * h_ > 1 else ""
    pixels = f"\neach pixel {f}x{f} tiles, costliest class shown (PARTIAL > FULL > SKIP)" if f > 1 else ""
    head = title or expl.program.name
    ax.set_title(f"{head}: S_q={expl.s_q} S_k={expl.s_k}, tiles {plan.block_m}x{plan.block_n}{shown}\n"
                 f"FULL {counts[FULL]}  PARTIAL {counts[PARTIAL]}  SKIP {counts[SKIP]}  "
                 f"({t_r}x{t_c} tiles, {plan.method}){pixels}", fontsize=10)
    handles = [Patch(facecolor=CLASS_COLOURS[c], edgecolor="#555555", label=f"{names[c]} ({counts[c]})")
               for c in (FULL, PARTIAL, SKIP)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
