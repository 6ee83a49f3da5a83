"""Triton functions the generated spec modules call: the language's integer rules and its
functions that Triton lacks.  Kept apart from the kernels so a generated module imports only
what its printed expressions need."""
import os

import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1, read when triton.jit wraps a function, as here) runs
# no inline assembly
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
    """1 - 2 / (e^(2x) + 1): one exp2 and one approximate division (2 ulp), the device's tanh to
    within ~1e-7 absolute (tl.sigmoid's correctly rounded division cost softcap 3x its arithmetic);
    +-inf and large |x| give +-1, NaN stays NaN."""
    return 1.0 - tl.fdiv(2.0, tl.exp2(x * 2.8853900817779268) + 1.0, ieee_rounding=False)


@triton.jit
def _tanh_mufu(x):
    """The GPU's tanh.approx.f32: one MUFU instruction (relative error at most 1.1e-5 measured on
    the H200 over |x| <= 12; the PTX ISA promises 2**-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


# tanh where the storage's tolerance allows tanh.approx.f32 (f16, bf16: backends/triton/emit.py, APPROX_TANH):
# the GPU's instruction on a GPU, _tanh under the interpreter (the one difference between the two)
_tanh_approx = _tanh if INTERPRETED else _tanh_mufu


@triton.jit
def _f32_small(x):
    """float(x) for an integer 0 <= x < 2**23 without a conversion instruction: the float32 whose
    bits are those of 2**23 plus x is 2**23 + x, exactly; one integer addition and one float
    subtraction.  Score programs' fast forms convert positions with it (attnc.compiler.fast_score)."""
    return (x + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
