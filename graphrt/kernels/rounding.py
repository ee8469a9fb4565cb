"""Rounding a float32 Triton value to the model dtype, or to FP8 E4M3, the way torch's cast rounds it.

``x.to(tl.bfloat16)`` rounds to nearest-even on the GPU but truncates under Triton's CPU interpreter
(Triton 3.6), so the interpreter would disagree with torch in about half the elements; its float-to-fp8
conversion drops the mantissa carry. Rounding the float32 bits first (nearest, ties to even) makes the
final cast exact on both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` -> the nearest DTYPE value (ties to even), as DTYPE."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        # Adding 0x7FFF plus the lowest kept bit, then clearing the low half, rounds to nearest-even.
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


#: Largest finite float8_e4m3fn value; larger magnitudes are clamped before the cast.
FP8_MAX_VALUE: tl.constexpr = tl.constexpr(448.0)


@triton.jit
def round_to_e4m3(x):
    """float32 -> nearest float8_e4m3fn value (ties to even, saturating at +-448), still as float32:
    its cast to ``tl.float8e4nv`` is then exact."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.minimum(tl.abs(x), FP8_MAX_VALUE)
    biased_exp = (magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # Subnormals (below 2**-6) share the spacing of the smallest normal binade: 2**-9.
    biased_exp = tl.maximum(biased_exp, 127 - 6)
    ulp = ((biased_exp - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_ulp = ((257 - biased_exp) << 23).to(tl.float32, bitcast=True)
    steps = magnitude * inv_ulp  # exact (power of two), below 16
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds to the nearest integer, ties to even
    rounded = (steps * ulp).to(tl.int32, bitcast=True) | (bits & -2147483648)  # restore the sign bit
    return rounded.to(tl.float32, bitcast=True)
