"""The non-finite mark of a GPU call (``runtime.Kernel._mark_rows``): one launch that sets a device
flag where a row's LSE is NaN (the kernels' mark of a visible NaN or +inf score), without a host
sync.  Every program that finds one stores the same value, so the order of the stores does not
matter.  ``_checked_sum``: how the Triton kernels' epilogues make that NaN of a row whose scores left
float32's range; ``_checked_lse``: the row whose LSE reached ``compiler.numerics.SCORE_LIMIT``."""
import triton
import triton.language as tl

from attnc.compiler.numerics import SCORE_LIMIT

SCORE_LIMIT_C = tl.constexpr(SCORE_LIMIT)  # (readable inside a kernel: compiled Triton reads only constexpr globals)


@triton.jit
def _mark_nan(LSE, FLAG, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(LSE + offs, mask=offs < N, other=0.0)
    bad = tl.max((x != x).to(tl.int32), axis=0)
    if bad > 0:
        tl.store(FLAG, bad)


@triton.jit
def _checked_sum(m_i, l_i):
    """A row's running sum l as an epilogue reads it: NaN -- the row marked, as a visible NaN score
    marks it -- where the running max m (base 2) or l is +inf (a visible score past float32's range
    once scaled to base 2), or where l is 0 under a finite m other than the 0 the kernels put for a
    row with nothing visible (the largest term exp2(s_max - m) is 1 in exact arithmetic: l >= 1).  On
    a GPU the fused multiply-add of s * scale - m leaves the product unrounded, so beyond float32's
    range, or at |s * scale| of about 2^30 and more (the product's rounding error, 2^-24 of it, is
    then tens of units of base 2), the largest term is exp2 of -inf / +inf or of a large residual:
    the row would end with l = 0 (O = 0, LSE -inf: read as a row that saw nothing) or l = +inf,
    unmarked."""
    finite = (m_i != 0.0) & (m_i > float("-inf")) & (m_i < float("inf"))
    broken = (m_i == float("inf")) | (l_i == float("inf")) | ((l_i == 0.0) & finite)
    return tl.where(broken, float("nan"), l_i)


@triton.jit
def _checked_lse(lse):
    """A row's LSE (natural log) as stored: NaN -- the row marked -- where it is finite with a
    magnitude of 2^30 or more (``compiler.numerics.SCORE_LIMIT``: every backend's error, so that a
    GPU, whose largest term is then off by the product's rounding, and float64 numpy agree); -inf
    (nothing seen) and NaN stay."""
    far = (tl.abs(lse) >= SCORE_LIMIT_C) & (lse > float("-inf"))
    return tl.where(far, float("nan"), lse)
