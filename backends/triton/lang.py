"""Triton functions the generated spec modules call: the language's integer rules and its
functions that Triton lacks.  Kept apart from the kernels so a generated module imports only
what its printed expressions need."""
import triton
import triton.language as tl


@triton.jit
def _floordiv(a, b):
    """Floor division (the language's rule; Triton's // truncates toward zero)."""
    q = a // b
    return q - (((a % b) != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _mod(a, b):
    """Remainder with the divisor's sign (the language's rule; Triton's % takes the dividend's)."""
    r = a % b
    return r + tl.where((r != 0) & ((r < 0) != (b < 0)), b, 0)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
