"""The non-finite mark of a GPU call (``runtime.Kernel._mark_rows``): one launch that sets a device
flag where a row's LSE is NaN (the kernels' mark of a visible NaN or +inf score), without a host
sync.  Every program that finds one stores the same value, so the order of the stores does not
matter."""
import triton
import triton.language as tl


@triton.jit
def _mark_nan(LSE, FLAG, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(LSE + offs, mask=offs < N, other=0.0)
    bad = tl.max((x != x).to(tl.int32), axis=0)
    if bad > 0:
        tl.store(FLAG, bad)
