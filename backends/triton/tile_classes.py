"""Tile classes by the spec's predicate on the GPU: the Triton backend's tile evaluator
(``compiler.analysis.tile_eval`` describes the contract; ``tiles.plan_tiles`` decides which tiles
need it: those an inexact interval analysis leaves undecided).

One program per undecided tile evaluates the spec's emitted ``visible`` (the function the prefill
kernels inline for PARTIAL blocks, with the call's tensors, TS) over the tile's cells in
sub-blocks, and writes SKIP (no cell visible), FULL (every cell) or PARTIAL.  Why a Triton kernel
rather than torch ops on the device: ``visible`` already is the spec's predicate as the kernels
evaluate it, with the language's integer rules (``lang._mod``, ...), tensor reads and lengths, so
the classes come from the very code that masks the cells; a torch translation of the IR would be
a second implementation to keep equal.  The tile list goes up and the classes come back in one
copy each (one host sync per plan; plans are cached, ``plans.PLANS``).  Under
``TRITON_INTERPRET=1`` the same kernel runs on the CPU (the tests).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

SUB_M_MAX = 32  # rows per step: a 32 x 128 tile of the predicate stays in registers
SUB_N_MAX = 128


@triton.jit
def _classify(TILES, OUT, TS, S_Q, S_K, Q_OFF, BLOCK_M, BLOCK_N,
              VISIBLE: tl.constexpr, SUB_M: tl.constexpr, SUB_N: tl.constexpr):
    """The class of tile ``TILES[i] = (b', h', q tile, k tile)``: rows and keys past the tile's
    end (or S_Q, S_K) repeat its last row or key, cells already counted."""
    i = tl.program_id(0)
    b = tl.load(TILES + 4 * i)
    h = tl.load(TILES + 4 * i + 1)
    row0 = tl.load(TILES + 4 * i + 2) * BLOCK_M
    key0 = tl.load(TILES + 4 * i + 3) * BLOCK_N
    row_last = tl.minimum(row0 + BLOCK_M, S_Q) - 1
    key_last = tl.minimum(key0 + BLOCK_N, S_K) - 1
    seen = tl.zeros([SUB_M, SUB_N], tl.int32)
    hidden = tl.zeros([SUB_M, SUB_N], tl.int32)
    for r in range(row0, row0 + BLOCK_M, SUB_M):
        q = Q_OFF + tl.minimum(r + tl.arange(0, SUB_M), row_last)
        for c in range(key0, key0 + BLOCK_N, SUB_N):
            k = tl.minimum(c + tl.arange(0, SUB_N), key_last)
            v = VISIBLE(b, h, q[:, None], k[None, :], TS).to(tl.int32) + tl.zeros([SUB_M, SUB_N], tl.int32)
            seen = tl.maximum(seen, v)
            hidden = tl.maximum(hidden, 1 - v)
    any_seen = tl.max(tl.max(seen, 1), 0)
    any_hidden = tl.max(tl.max(hidden, 1), 0)
    # SKIP 0, PARTIAL 1, FULL 2 (compiler.ir.TileClass)
    tl.store(OUT + i, tl.where(any_seen > 0, tl.where(any_hidden > 0, 1, 2), 0).to(tl.int8))


def _step(size: int, cap: int) -> int:
    """Rows (or keys) per step: a power of two up to ``cap`` (Triton's aranges), no wider than the
    tile needs."""
    return min(cap, triton.next_power_of_2(max(1, size)))


class TritonTileEvaluator:
    """The predicate over each undecided tile on ``device``, for one call shape and its tensors
    (torch tensors on that device, as the call passes them)."""

    name = "triton"

    def __init__(self, module, tensors: dict, batch: int, s_q: int, s_k: int, device):
        self.module, self.tensors = module, tensors
        self.batch, self.s_q, self.s_k, self.device = batch, s_q, s_k, device

    def __call__(self, tiles: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
        import torch
        from .launch import call_tensor_args
        tiles = np.ascontiguousarray(tiles, np.int32).reshape(-1, 4)
        if not len(tiles):
            return np.zeros(0, np.int8)
        up = torch.from_numpy(tiles).to(self.device, non_blocking=False)
        out = torch.empty(len(tiles), dtype=torch.int8, device=self.device)
        ts = call_tensor_args(self.module, self.tensors, self.batch, self.s_q, self.s_k, self.device)
        _classify[(len(tiles),)](up, out, ts, self.s_q, self.s_k, self.s_k - self.s_q, block_m, block_n,
                                 VISIBLE=self.module.visible, SUB_M=_step(block_m, SUB_M_MAX),
                                 SUB_N=_step(block_n, SUB_N_MAX), num_warps=4)
        return out.cpu().numpy()
