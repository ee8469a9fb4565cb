"""Temperature sampling fused into two short passes over the logits (no top-k / top-p).

``graphrt.sampler.sample`` draws with the exponential race: ``argmax_i exp(x_i / T - max) / E_i`` with
``E_i = -log(U_i)`` and ``U_i`` a counter-based hash of (seed, step, token id). Unfused that is ~25
kernels over [B, V] (a scaled copy, its max, exp, the 64-bit hash chain, log, divide, argmax). Here
pass 1 computes, per chunk of a row, ``x_i / T - log(E_i)`` -- the logarithm of the same race, so the
same draw -- and its maximum; pass 2 (shared with ``graphrt.kernels.argmax``) picks each row's best
chunk. The noise is bit-identical to ``graphrt.sampler.uniform_noise`` (same hash, same keys); the
float arithmetic differs (log domain, no max subtracted), so the token differs from ``sample``'s only
when two race values tie to within float32 rounding. Greedy rows (temperature 0) take the plain argmax,
ties to the lowest id, exactly as ``sample`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampler import SamplingTensors, sample
from .argmax import argmax_rows, store_chunk_best, two_pass_argmax

# The constants of graphrt.sampler's hash and row keys (lowbias32 and two salts); constexpr globals,
# the only kind a compiled Triton kernel may read.
_MUL1 = tl.constexpr(0x7FEB352D)
_MUL2 = tl.constexpr(0x846CA68B)
_KEY1_SALT = tl.constexpr(0x6A09E667)
_KEY2_SALT = tl.constexpr(0xBB67AE85)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 values (multiplication wraps mod 2**32), as ``graphrt.sampler.hash32``."""
    x = x ^ (x >> 16)
    x = x * tl.full((), _MUL1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), _MUL2, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _temperature_chunk_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    steps_ptr,  # [B] int64
    chunk_max_ptr,  # [B, C] float32
    chunk_index_ptr,  # [B, C] int64
    stride_row,
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    values = tl.load(logits_ptr + row * stride_row + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        # Row keys from the 64-bit seed and step, chained as graphrt.sampler._row_keys does.
        seed = tl.load(seeds_ptr + row)
        step = tl.load(steps_ptr + row)
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
        values = values / temperature - tl.log(-tl.log(uniform))
        values = tl.where(in_vocab, values, float("-inf"))
    store_chunk_best(values, row, chunk, chunk_max_ptr, chunk_index_ptr, num_chunks, CHUNK)


def sample_temperature(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row for rows without top-k / top-p: greedy rows take the argmax, the others draw
    from softmax(logits / temperature) with the row's (seed, step) noise.

    logits: [B, V] float (columns contiguous, finite); sampling: B rows on the same device (its top-k
    and top-p are ignored: use ``graphrt.sampler.sample`` for rows that set them); out: [B] int64
    (allocated when not given). Allocates a [B, ceil(V / 4096)] scratch pair; capturable.
    """
    if logits.dim() == 2 and sampling.batch_size != logits.shape[0]:  # other shapes: two_pass_argmax says
        raise ValueError(f"logits have {logits.shape[0]} rows, sampling tensors {sampling.batch_size}")

    def chunk_pass(grid, chunk_max, chunk_index, chunk, num_chunks):
        _temperature_chunk_kernel[grid](
            logits, sampling.temperature, sampling.seeds, sampling.steps, chunk_max, chunk_index,
            logits.stride(0), logits.shape[1], num_chunks, CHUNK=chunk, num_warps=8,
        )

    return two_pass_argmax(logits, out, chunk_pass)


def sample_fused(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """``graphrt.sampler.sample``'s contract on the fused kernels: greedy rows take the argmax,
    temperature-only rows the fused race above, rows with top-k / top-p the sampler's sorting path.
    Which path a row takes depends on its own parameters only, so its token never depends on what else
    shares the batch. logits: [B, V]; returns ``out``: [B] int64. Capturable (the paths run are chosen
    by ``sampling``'s host flags, the per-row choice on the device)."""
    if sampling.all_greedy:
        return argmax_rows(logits, out=out)
    out = sample_temperature(logits, sampling, out=out)
    if sampling.needs_top_k_top_p:
        filtered = (sampling.temperature > 0) & ((sampling.top_k > 0) | (sampling.top_p < 1.0))
        out.copy_(torch.where(filtered, sample(logits, sampling), out))
    return out
