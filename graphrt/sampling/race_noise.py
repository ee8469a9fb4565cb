"""The exponential race's noise in Triton, bit-identical to ``graphrt.sampling.sampler.uniform_noise``, and the
temperature scaling the race applies to the logits.

``graphrt.sampling.sampler.sample`` draws token ``argmax_i w_i / E_i`` with ``E_i = -log(U_i)`` and ``U_i`` a
counter-based hash of (seed, step, token id). The fused samplers race in the log domain instead:
``x_i - log(E_i)`` with ``x = logits / temperature`` has the same argmax (the row's max, subtracted
in ``w``, is a constant), so they need only ``-log(E_i)``, which ``log_race_noise`` returns.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The constants of graphrt.sampling.sampler's hash and row keys (lowbias32 and two salts); constexpr globals,
# the only kind a compiled Triton kernel may read.
_MUL1 = tl.constexpr(0x7FEB352D)
_MUL2 = tl.constexpr(0x846CA68B)
_KEY1_SALT = tl.constexpr(0x6A09E667)
_KEY2_SALT = tl.constexpr(0xBB67AE85)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 values (multiplication wraps mod 2**32), as ``graphrt.sampling.sampler.hash32``."""
    x = x ^ (x >> 16)
    x = x * tl.full((), _MUL1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), _MUL2, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def log_race_noise(cols, seed, step):
    """``-log(-log(U))`` for token ids ``cols`` (any shape, int32) of a row with 64-bit ``seed`` and
    ``step`` (int64 scalars): float32, the same shape. ``U`` is ``uniform_noise``'s value bit for bit."""
    # Row keys from the 64-bit seed and step, chained as graphrt.sampling.sampler._row_keys does.
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    t_lo = (step & 0xFFFFFFFF).to(tl.uint32)
    t_hi = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key1 = _hash32(s_lo ^ tl.full((), _KEY1_SALT, tl.uint32))
    key1 = _hash32(key1 ^ s_hi)
    key1 = _hash32(key1 ^ t_hi)
    key1 = _hash32(key1 ^ t_lo)
    key2 = _hash32(s_hi ^ tl.full((), _KEY2_SALT, tl.uint32))
    key2 = _hash32(key2 ^ t_hi)
    key2 = _hash32(key2 ^ s_lo)
    key2 = _hash32(key2 ^ t_lo)
    bits = _hash32(_hash32(cols.to(tl.uint32) ^ key1) ^ key2)
    uniform = ((bits >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)  # odd multiples of 2**-24
    return -tl.log(-tl.log(uniform))


@triton.jit
def temperature_divisor(temperature):
    """What a row's logits are divided by: its temperature, or 1 for a greedy row (temperature 0), whose
    logits stay as they are."""
    return tl.where(temperature > 0, temperature, 1.0)


@triton.jit
def scale_logits(logits, temperature):
    """float32 ``logits / temperature`` rounded as torch divides it (IEEE; Triton's ``/`` is approximate
    on the GPU), so that the fused samplers scale exactly as ``graphrt.sampling.sampler`` does; greedy rows
    (temperature 0) keep their logits."""
    return tl.math.div_rn(logits, temperature_divisor(temperature))
