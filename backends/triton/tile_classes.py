"""Tile classes by the spec's predicate on the GPU: the Triton backend's tile evaluator
(``compiler.analysis.tile_eval`` describes the contract; ``tiles.plan_tiles`` decides which tiles
need it: those an inexact interval analysis leaves undecided).

One program per undecided tile (``kernels/tile_classes.py``) evaluates the spec's emitted
``visible`` (the function the prefill kernels inline for PARTIAL blocks, with the call's tensors,
TS) over the tile's cells in sub-blocks, and writes SKIP (no cell visible), FULL (every cell) or PARTIAL.  Why a Triton kernel
rather than torch ops on the device: ``visible`` already is the spec's predicate as the kernels
evaluate it, with the language's integer rules (``lang._mod``, ...), tensor reads and lengths, so
the classes come from the very code that masks the cells; a torch translation of the IR would be
a second implementation to keep equal.  The tile list goes up and the classes come back in one
copy each (one host sync per plan; plans are cached, ``plans.PLANS``).  Under
``TRITON_INTERPRET=1`` the same kernel runs on the CPU (the tests).
"""
from __future__ import annotations

import numpy as np

SUB_M_MAX = 32  # rows per step: a 32 x 128 tile of the predicate stays in registers
SUB_N_MAX = 128


def _step(size: int, cap: int) -> int:
    """Rows (or keys) per step: a power of two up to ``cap`` (Triton's aranges), no wider than the
    tile needs."""
    return min(cap, 1 << max(0, size - 1).bit_length())


def tile_evaluator(module, tensors: dict, batch: int, s_q: int, s_k: int, device):
    """What classifies the tiles an inexact mask analysis leaves undecided for a call on
    ``device``: this predicate kernel on a GPU, else None (the plan's default, the host's numpy
    evaluation, ``compiler.analysis.tile_eval``)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    return TritonTileEvaluator(module, tensors, batch, s_q, s_k, device)


class TritonTileEvaluator:
    """The predicate over each undecided tile on ``device``, for one call shape and its tensors
    (torch tensors on that device, as the call passes them)."""

    name = "triton"

    def __init__(self, module, tensors: dict, batch: int, s_q: int, s_k: int, device):
        self.module, self.tensors = module, tensors
        self.batch, self.s_q, self.s_k, self.device = batch, s_q, s_k, device

    def __call__(self, tiles: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
        import torch
        from .kernels.tile_classes import classify
        from .launch import call_tensor_args  # (launch imports the kernels: only when one runs)
        tiles = np.ascontiguousarray(tiles, np.int32).reshape(-1, 4)
        if not len(tiles):
            return np.zeros(0, np.int8)
        up = torch.from_numpy(tiles).to(self.device, non_blocking=False)
        out = torch.empty(len(tiles), dtype=torch.int8, device=self.device)
        ts = call_tensor_args(self.module, self.tensors, self.batch, self.s_q, self.s_k, self.device)
        classify[(len(tiles),)](up, out, ts, self.s_q, self.s_k, self.s_k - self.s_q, block_m, block_n,
                                 VISIBLE=self.module.visible, SUB_M=_step(block_m, SUB_M_MAX),
                                 SUB_N=_step(block_n, SUB_N_MAX), num_warps=4)
        return out.cpu().numpy()
