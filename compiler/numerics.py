"""Declared tolerances and the comparison every numerics test and `attnc run --check` use.

The candidate computes in float32 from inputs held in the storage dtype and
rounds O to the storage dtype; the reference is the float64 oracle on the same
stored inputs.  So the tolerance is the storage dtype's rounding of O (its
relative precision, with headroom for accumulation order) plus a float32
accumulation term.  LSE is float32 in every backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# dtype -> (atol, rtol) on O.  Unit roundoff: f32 6e-8, f16 4.9e-4, bf16 3.9e-3.
O_TOLERANCE = {"f32": (2e-5, 2e-5), "f16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
LSE_TOLERANCE = (1e-4, 1e-5)


@dataclass(frozen=True)
class Comparison:
    what: str
    max_abs_error: float
    worst_excess: float  # max(|x - ref| - (atol + rtol |ref|)); <= 0 passes
    atol: float
    rtol: float
    ok: bool
    detail: str = ""

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAIL {self.detail}"
        return f"{self.what}: max |err| {self.max_abs_error:.2e} (atol {self.atol:g}, rtol {self.rtol:g}) {verdict}"


def compare(what: str, x, ref, atol: float, rtol: float) -> Comparison:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        return Comparison(what, np.inf, np.inf, atol, rtol, False, f"shape {x.shape} != {ref.shape}")
    if np.isnan(x).any():
        idx = tuple(int(i[0]) for i in np.nonzero(np.isnan(x)))
        return Comparison(what, np.inf, np.inf, atol, rtol, False, f"NaN at {idx}")
    inf_mismatch = (np.isinf(x) != np.isinf(ref)) | (np.isinf(x) & (np.sign(x) != np.sign(ref)))
    if inf_mismatch.any():
        idx = tuple(int(i[0]) for i in np.nonzero(inf_mismatch))
        return Comparison(what, np.inf, np.inf, atol, rtol, False,
                          f"infinity mismatch at {idx}: {x[idx]} vs {ref[idx]}")
    finite = np.isfinite(ref)
    with np.errstate(invalid="ignore"):  # -inf - -inf on rows with nothing visible: masked out below
        err = np.where(finite, np.abs(x - ref), 0.0)
    excess = err - (atol + rtol * np.abs(np.where(finite, ref, 0.0)))
    worst = float(excess.max()) if excess.size else 0.0
    detail = ""
    if worst > 0:
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
        detail = f"at {idx}: {x[idx]} vs {ref[idx]}"
    return Comparison(what, float(err.max()) if err.size else 0.0, worst, atol, rtol, worst <= 0, detail)


def compare_outputs(dtype: str, o, lse, ref_o, ref_lse) -> tuple[Comparison, Comparison]:
    return (compare("O", o, ref_o, *O_TOLERANCE[dtype]), compare("LSE", lse, ref_lse, *LSE_TOLERANCE))


# An FP8 call (attnc.fp8) against the float64 oracle of its dequantized inputs.  The FP8 engine
# rounds P to e4m3 (3 mantissa bits: within 2^-4 relative) before P.V, so O's error is P's rounding
# summed over a row's keys: bounded in relative L2 over the output, with an elementwise backstop
# that a row dominated by one key (p near 1, |v| up to 4) can reach.  Q.K^T is exact products of
# e4m3 values, so LSE keeps float32's accuracy up to the accumulation order.
FP8_O_REL_L2 = 4e-2
FP8_O_TOLERANCE = (0.15, 0.1)
FP8_LSE_TOLERANCE = (1e-3, 1e-4)


def compare_fp8_outputs(o, lse, ref_o, ref_lse) -> tuple[Comparison, Comparison]:
    """An FP8 call's O (relative L2 within FP8_O_REL_L2, and elementwise within the backstop) and
    LSE against the oracle of its dequantized inputs."""
    o64, r64 = np.asarray(o, np.float64), np.asarray(ref_o, np.float64)
    c = compare("O", o64, r64, *FP8_O_TOLERANCE)
    if c.ok and o64.shape == r64.shape:
        rel = float(np.linalg.norm(o64 - r64) / max(np.linalg.norm(r64), 1e-30))
        if rel > FP8_O_REL_L2:
            c = Comparison("O", c.max_abs_error, c.worst_excess, c.atol, c.rtol, False,
                           f"relative L2 error {rel:.3e} over {FP8_O_REL_L2:g}")
    return c, compare("LSE", lse, ref_lse, *FP8_LSE_TOLERANCE)


# dtype -> (atol as a fraction of the reference's largest magnitude, rtol) on dQ, dK, dV and score-tensor
# gradients.  A backward rounds P and dS to the storage dtype before its GEMMs (FlashAttention's
# practice), so its error scales with the gradient's magnitude, not elementwise with each entry.
GRAD_TOLERANCE = {"f32": (1e-4, 1e-4), "f16": (1e-2, 1e-2), "bf16": (4e-2, 4e-2)}


def compare_gradient(what: str, dtype: str, g, ref) -> Comparison:
    """One gradient against the float64 reference with the dtype's declared tolerance."""
    ref = np.asarray(ref, np.float64)
    frac, rtol = GRAD_TOLERANCE[dtype]
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    return compare(what, g, ref, frac * max(scale, 1e-6), rtol)


# ---------------------------------------------------------------- non-finite scores
# A row whose LSE (natural log) has a magnitude of SCORE_LIMIT or more is an error like a NaN score,
# on every backend: float32 kernels cannot weigh such a row's scores (on a GPU the fused
# multiply-add of s * scale - m leaves the largest term exp2 of the product's rounding error, tens
# of units of base 2 from 2^30 on: garbage, or 0 and +inf sums), while float64 numpy answers; the
# rule makes them agree.  A row's LSE lies within log(S) of its largest visible score, so the limit
# reads "the largest visible score, after scale, within +-2^30": -1e9 fills of masked cells pass.
SCORE_LIMIT = 2.0 ** 30
NONFINITE_SCORE = ("the score program produced NaN or +inf at a visible key of query row (b={b}, h={h}, q={q}), "
                   "or a largest visible score of magnitude 2^30 or more; a visible cell's score must be finite "
                   "and within +-2^30 at the row's largest, or -inf to drop the cell (NaN or inf in q or K, "
                   "or a scale that overflows q.k, make one too)")
NONFINITE_ROW = ("query row (b={b}, h={h}, q={q}) is NaN: the score program produced NaN or +inf at a visible key, "
                 "or a largest visible score of magnitude 2^30 or more, or the row's sink is NaN or +inf; a "
                 "visible cell's score and a sink must be finite and within +-2^30 at the row's largest, or -inf "
                 "to drop them (NaN or inf in q or K, or a scale that overflows q.k, make one too)")


def nonfinite_message(b: int, h: int, q: int, sink: bool = False) -> str:
    """The error of a marked row (its LSE NaN): a spec with a sink (``sink = ...``) names both causes,
    since the kernels mark a NaN or +inf sink like a NaN or +inf visible score."""
    return (NONFINITE_ROW if sink else NONFINITE_SCORE).format(b=b, h=h, q=q)


def bad_rows(lse):
    """Where ``check_rows`` finds an error (numpy or torch ``lse``, natural log): NaN (a kernel's mark),
    or finite with a magnitude of SCORE_LIMIT or more; -inf (a row that saw nothing) is not one."""
    if hasattr(lse, "isnan"):
        return lse.isnan() | (lse.isfinite() & (lse.abs() >= SCORE_LIMIT))
    with np.errstate(invalid="ignore"):
        return np.isnan(lse) | (np.isfinite(lse) & (np.abs(lse) >= SCORE_LIMIT))


def check_rows(lse, *, s_q: int | None = None, s_k: int | None = None, qo_indptr=None, kv_lens=None,
               sink: bool = False) -> None:
    """The language's policy for a non-finite score at a visible cell, on every backend: the
    kernel marks the row's LSE NaN (its O too), and the call raises a PlanError naming the first
    such row in (b, h, q) order.  ``lse`` is [B, H_q, S_q] (with ``s_q``, ``s_k``) or packed
    [total_q, H_q] (with the call's ``qo_indptr`` and ``kv_lens``); numpy or torch.  ``sink``: the
    spec has a sink (the message names it too)."""
    from .errors import PlanError
    if hasattr(lse, "isnan"):  # torch: one reduction on the device, the rows only when one is marked
        if not bool(bad_rows(lse).any()):
            return
        lse = lse.detach().float().cpu().numpy()
    lse = np.asarray(lse)
    bad = bad_rows(lse)
    if not bad.any():
        return
    if lse.ndim == 3:
        b, h, i = (int(x[0]) for x in np.nonzero(bad))  # row-major: the first in (b, h, q) order
        q = s_k - s_q + i
    else:  # packed rows: the first in (b, h, q) order too, so every layout names the same row
        host = lambda x: np.asarray(x.cpu() if hasattr(x, "cpu") else x).reshape(-1)  # noqa: E731
        indptr, lens = host(qo_indptr), host(kv_lens)
        rows, heads = np.nonzero(bad)
        reqs = np.searchsorted(indptr, rows, side="right") - 1
        qs = lens[reqs] - (indptr[reqs + 1] - indptr[reqs]) + rows - indptr[reqs]
        first = np.lexsort((qs, heads, reqs))[0]
        b, h, q = int(reqs[first]), int(heads[first]), int(qs[first])
    raise PlanError(nonfinite_message(b, h, q, sink))


# ---------------------------------------------------------------- non-finite values
def check_values(v, bshd: bool = False) -> None:
    """V must be finite: a NaN or inf in a V row reaches the O of every row whose tiles read it
    (hidden keys included, p = 0 times NaN is NaN), and which rows' tiles read it depends on the
    backend's tiles, so a contiguous call checks the whole of V before it attends, on every backend
    that has V on the host (numpy, AHBM, the oracle, Triton on the CPU; on a GPU only with
    ATTNC_CHECK_FINITE=1, since it costs a pass over V and a host sync).  ``v`` is [B, H_kv, S_k,
    d_v] (``bshd``: [B, S_k, H_kv, d_v]), numpy or torch.  Raises an InputError naming the first
    such element in (b, h, k) order."""
    from .errors import InputError
    if hasattr(v, "isfinite"):  # torch: one reduction on the tensor's device (FP8 widened first)
        if bool((v if v.element_size() > 1 else v.float()).isfinite().all()):
            return
        v = v.detach().float().cpu().numpy()
    v = np.asarray(v)
    bad = ~np.isfinite(v)
    if not bad.any():
        return
    if bshd:
        bad = bad.transpose(0, 2, 1, 3)
    b, h, k, d = (int(x[0]) for x in np.nonzero(bad))
    raise InputError(f"inputs: 'v' holds NaN or inf at (b={b}, h={h}, k={k}, d={d}): V must be finite (a NaN or "
                     "inf would reach the output of every row whose tiles read that key)")
