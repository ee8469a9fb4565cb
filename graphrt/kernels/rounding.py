"""Rounding a float32 Triton value to the model dtype the way a torch op rounds its result.

``x.to(tl.bfloat16)`` rounds to nearest-even on the GPU but truncates under Triton's CPU interpreter
(Triton 3.6), so the interpreter would disagree with torch in about half the elements. Rounding the
float32 bits first (nearest, ties to even) makes the final cast exact on both.
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
