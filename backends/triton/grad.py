"""The backward pass's host side: its block lists from a prefill plan, its config and its three
launches (``backward.py`` has the kernels).

A backward call is planned from the same mask analysis as the forward (``Plan.retile`` for the
backward's tiles: the costly interval analysis is reused), and its block lists are kept in the
process's plan cache (``plans.PLANS``) under the forward's key plus "backward", so a training
loop plans once.  The dQ pass reads the plan by rows (the forward's walk); the dK/dV pass reads
it by columns: for each K/V block, the query blocks whose class is not SKIP, ascending.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnc.compiler.plan import Plan
from . import plans as P
from .kernels import backward as K
from .launch import Launcher, position_end, score_functions


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles and warps of the two passes: dK/dV (BLOCK_M1 query rows per step over a BLOCK_N1
    key block) and dQ (BLOCK_M2 query rows, BLOCK_N2 keys per step)."""

    block_m1: int = 64
    block_n1: int = 128
    block_m2: int = 128
    block_n2: int = 64
    num_warps: int = 8
    num_stages: int = 3
    fused: bool = True  # both passes in one launch (False: dK/dV, then dQ)
    head_group: int = 1  # jobs run heads in groups of this many, each head's heaviest tile first
    deterministic: bool = True  # False: dQ by float32 atomics in the dK/dV pass (5 GEMMs a block, not 7)

    def tiles(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (self.block_m1, self.block_n1), (self.block_m2, self.block_n2)


def default_backward_config(d_qk: int, d_v: int, interpreted: bool, f32: bool = False) -> BackwardConfig:
    """The untuned backward launch: FlashAttention-2's tiles on a GPU (smaller ones for wide heads,
    which would not fit registers), 16-row tiles under the CPU interpreter.  ``f32``: the spec's
    dtype is f32, whose dots multiply in full f32 (``input_precision="ieee"``), which Triton lowers
    to FMAs unrolled per thread, not to tensor-core MMAs: :func:`f32_backward_config`."""
    if interpreted:
        return BackwardConfig(16, 16, 16, 16, 4, 1)
    if f32:
        return f32_backward_config(d_qk, d_v)
    if max(d_qk, d_v) > 128:
        return BackwardConfig(32, 64, 64, 32, 8, 2)
    if max(d_qk, d_v) <= 64:
        return BackwardConfig(64, 128, 128, 64, 4, 3)
    return BackwardConfig(64, 128, 128, 64, 8, 3)


# Per thread, an f32 ("ieee") dot of an M x N tile over d columns is M * N * d / (32 * warps) FMAs,
# unrolled in the kernel's code; the fused backward has seven such dots, each inlined twice (its FULL
# and its PARTIAL loop).  FlashAttention-2's tiles make that 4096 FMAs a dot at d 64 on 4 warps: 71K
# lines of PTX, which Triton 3.6 compiled for sm_90 in 65-80 s on one core (LLVM's passes about
# 20 s, its PTX about 20 s, ptxas about 30 s), again for each specialization (three in a test of the
# blocks of a CP call or of a fast and an exact score form: 176-200 s on the H200's host), and which
# ptxas spilled (32 registers, 165 KB of spill stores).  These tiles keep it at 256 FMAs a dot on
# 8 warps (d padded to a power of two: up to 64, 32 x 32; 128, 16 x 32; above, 16 x 16): no spills,
# 3-4 s a compile on one core.
F32_TILES = ((64, (32, 32, 32, 32)), (128, (16, 32, 32, 16)), (None, (16, 16, 16, 16)))


def f32_backward_config(d_qk: int, d_v: int) -> BackwardConfig:
    """The untuned backward launch of an f32 spec on a GPU: ``F32_TILES`` by the wider head dim,
    8 warps, 2 stages."""
    d = max(d_qk, d_v)
    tiles = next(t for top, t in F32_TILES if top is None or d <= top)
    return BackwardConfig(*tiles, num_warps=8, num_stages=2)


def _lists(classes: np.ndarray, by_columns: bool) -> dict:
    """The computed blocks of every (plane, row) -- or, ``by_columns``, of every (plane, column):
    FULL blocks ascending, then PARTIAL blocks ascending.  ``ptr[2 r]``, ``ptr[2 r + 1]``,
    ``ptr[2 r + 2]`` bound row r's FULL and PARTIAL runs in ``idx`` (a kernel walks each in its
    own loop: the FULL loop has no mask and no branch)."""
    c = classes.reshape(-1, *classes.shape[2:])  # [planes, q_tiles, k_tiles]
    if by_columns:
        c = c.transpose(0, 2, 1)
    c = c.reshape(-1, c.shape[2])
    n = len(c)
    rows, idx = np.nonzero(c)
    partial = c[rows, idx] == 1
    order = np.lexsort((idx, partial, rows))  # by row, FULL before PARTIAL, ascending
    ptr = np.zeros(2 * n + 1, np.int32)
    counts = np.zeros((n, 2), np.int64)
    np.add.at(counts, (rows, partial.astype(np.int64)), 1)
    np.cumsum(counts.reshape(-1), out=ptr[1:])
    return {"ptr": ptr, "idx": idx[order].astype(np.int32)}


def _column_order(classes: np.ndarray) -> np.ndarray:
    """Each plane's key blocks by descending computed query blocks, flattened: the dK/dV jobs'
    order (the columns' twin of ``Plan.q_tile_order``, which orders the dQ jobs)."""
    work = (classes != 0).sum(axis=2)
    return np.argsort(-work, axis=2, kind="stable").reshape(-1).astype(np.int32)


class BackwardLaunch:
    """The backward of one call shape, bound to its plan's block lists on the device.  Its kernels
    launch through ``launch.Launcher``: after the first call with a binding key (the caller's,
    which fixes every argument's specialization) the compiled kernels are called directly,
    without the JIT's argument binding."""

    def __init__(self, module, config: BackwardConfig, dkdv_plan: Plan, dq_plan: Plan, shape: tuple, device,
                 offsets: tuple[int, int] | None = None):
        """``offsets``: the absolute positions (Q_OFF, K_OFF) of the first row and key, for one block
        of a larger call (context parallelism); None: a whole call, bottom-right (S_k - S_q, 0)."""
        self.module, self.config = module, config
        self.batch, self.s_q, self.s_k = shape
        cc, rc = dkdv_plan.tiles.classes, dq_plan.tiles.classes
        cols, rows = _lists(cc, True), _lists(rc, False)
        host = {"c_order": _column_order(cc), "c_ptr": cols["ptr"], "c_idx": cols["idx"],
                "r_order": dq_plan.q_tile_order(), "r_ptr": rows["ptr"], "r_idx": rows["idx"],
                "r_cls": rc.reshape(-1)}  # the dQ tiles' classes, dense (score_grads' walk)
        self.arrays = P.upload(host, device, {"r_cls": "int8"})
        spec = module.SPEC
        c = config
        self.h_q, self.h_kv = spec["H_Q"], spec["H_KV"]
        self.tensor_grad_launchers: dict = {}  # score_grads.tensor_gradients': one per load and kept axes
        k_tiles, q_tiles = cc.shape[3], rc.shape[2]
        self.jobs = (k_tiles * self.batch * self.h_kv, q_tiles * self.batch * self.h_q)
        q_off, k_off = offsets if offsets is not None else (self.s_k - self.s_q, 0)
        self.ints = (self.s_q, self.s_k, q_off, k_off, *cc.shape[:2], k_tiles, q_tiles,
                     self.batch * self.h_kv, self.batch * self.h_q, self.jobs[0])
        score_grad = self.score_grad = score_functions(module, position_end(self.s_q, self.s_k, offsets))[1]
        consts = dict(VISIBLE=module.visible, SCORE_GRAD=score_grad,
                      HAS_SCORE=spec["HAS_SCORE"], SCALE=spec["SCALE"], H_Q=spec["H_Q"], H_KV=spec["H_KV"],
                      GROUP=spec["GROUP"], D_QK=spec["D_QK"], D_V=spec["D_V"], D_QK_PAD=spec["D_QK_PAD"],
                      D_V_PAD=spec["D_V_PAD"], DOT_PRECISION=spec["DOT_PRECISION"],
                      EVEN_M1=self.s_q % c.block_m1 == 0, EVEN_N1=self.s_k % c.block_n1 == 0,
                      EVEN_M2=self.s_q % c.block_m2 == 0, EVEN_N2=self.s_k % c.block_n2 == 0,
                      BLOCK_M1=c.block_m1, BLOCK_N1=c.block_n1, BLOCK_M2=c.block_m2, BLOCK_N2=c.block_n2,
                      HEAD_GROUP=c.head_group, ATOMIC_DQ=not c.deterministic)
        self.delta = {n: Launcher(K._bwd_delta, dict(H_Q=spec["H_Q"], HAS_DLSE=n, BLOCK=DELTA_ROWS, D_V=spec["D_V"],
                                                     D_V_PAD=spec["D_V_PAD"])) for n in (False, True)}
        passes = (1,) if not c.deterministic else (3,) if c.fused else (1, 2)
        self.store = Launcher(K._bwd_dq_store, dict(H_Q=spec["H_Q"], BLOCK=DELTA_ROWS, D_QK=spec["D_QK"],
                                                   D_QK_PAD=spec["D_QK_PAD"], SCALE=spec["SCALE"], COUNTED=False))
        self.d_qk_pad = spec["D_QK_PAD"]
        self.passes = [(Launcher(K._bwd_main, dict(PASSES=n, **consts), num_warps=c.num_warps,
                                 num_stages=c.num_stages), {3: sum(self.jobs), 1: self.jobs[0], 2: self.jobs[1]}[n])
                       for n in passes]
        self.nbytes = P.nbytes_of(self.arrays)

    def __call__(self, q, k, v, o, lse, do, dlse, ts: tuple, dq, dk, dv, key=None):
        """Launch on bhsd views (strides carry the layout); writes dq, dk, dv and returns the delta
        pass's D - dLSE [B, H_q, S_q] (a sink's gradient is read from it).  ``key``: the caller's
        binding key (None: through the JIT)."""
        import torch
        a = self.arrays
        delta = q.new_empty((self.batch, self.h_q, self.s_q), dtype=torch.float32)
        has_dlse = dlse is not None
        self.delta[has_dlse].launch(
            (triton_cdiv(self.s_q, DELTA_ROWS), self.batch * self.h_q),
            (o, do, dlse if has_dlse else delta, delta, *o.stride(), *do.stride(), self.s_q), key)
        dqa = delta
        if not self.config.deterministic:
            dqa = torch.zeros((self.batch * self.h_q * self.s_q * self.d_qk_pad,), device=q.device,
                              dtype=torch.float32)
        args = (q, k, v, do, dq, dk, dv, lse, delta, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                *dq.stride(), *dk.stride(), *dv.stride(), a["c_order"], a["c_ptr"], a["c_idx"], a["r_order"],
                a["r_ptr"], a["r_idx"], ts, *self.ints)
        for launcher, jobs in self.passes:
            launcher.launch((jobs,), args, key)
        if not self.config.deterministic:
            self.store.launch((triton_cdiv(self.s_q, DELTA_ROWS), self.batch * self.h_q),
                              (dqa, dq, dqa, *dq.stride(), self.s_q, self.s_q), key)
        return delta


DELTA_ROWS = 64


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
