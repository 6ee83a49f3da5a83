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
def _floordiv_total(a, b):
    """The language's `//` by a divisor that may be 0: x // 0 = 0."""
    zero = b == 0
    return tl.where(zero, 0, _floordiv(a, tl.where(zero, 1, b)))


@triton.jit
def _mod_total(a, b):
    """The language's `%` by a divisor that may be 0: x % 0 = x."""
    zero = b == 0
    return tl.where(zero, a, _mod(a, tl.where(zero, 1, b)))


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
