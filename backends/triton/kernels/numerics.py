"""The non-finite mark of a GPU call (``runtime.Kernel._mark_rows``): one launch that sets a device
flag where a row's LSE is NaN (the kernels' mark of a visible NaN or +inf score), without a host
sync.  Every program that finds one stores the same value, so the order of the stores does not
matter.  ``_checked_sum``: how the Triton kernels' epilogues make that NaN of a row whose scores left
float32's range."""
import triton
import triton.language as tl


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
    marks it -- where the running max m (base 2) or l is +inf: a visible score past float32's range
    once scaled to base 2.  In exact arithmetic exp2(s - m) of such a row is NaN; on a GPU the fused
    multiply-add of s * scale - m is -inf or +inf instead, so the row would end with l = 0 (O = 0, LSE
    -inf: read as a row that saw nothing) or l = +inf, unmarked."""
    return tl.where((m_i == float("inf")) | (l_i == float("inf")), float("nan"), l_i)
