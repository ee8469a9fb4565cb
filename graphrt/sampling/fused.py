"""Temperature sampling fused into two short passes over the logits (no top-k / top-p).

``graphrt.sampling.sampler.sample`` draws with the exponential race: ``argmax_i exp(x_i / T - max) / E_i`` with
``E_i = -log(U_i)`` and ``U_i`` a counter-based hash of (seed, step, token id). Unfused that is ~25
kernels over [B, V] (a scaled copy, its max, exp, the 64-bit hash chain, log, divide, argmax). Here
pass 1 computes, per chunk of a row, ``x_i / T - log(E_i)`` -- the logarithm of the same race, so the
same draw -- and its maximum; pass 2 (shared with ``graphrt.sampling.argmax``) picks each row's best
chunk. The noise is bit-identical to ``graphrt.sampling.sampler.uniform_noise`` (same hash, same keys) and the
logits are divided as torch divides them; the rest of the arithmetic differs (log domain, no max
subtracted), so the token differs from ``sample``'s only
when two race values tie to within float32 rounding. Greedy rows (temperature 0) take the plain argmax,
ties to the lowest id, exactly as ``sample`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.sampling.argmax import argmax_rows, store_chunk_best, two_pass_argmax
from graphrt.sampling.race_noise import log_race_noise, scale_logits
from graphrt.sampling.sampler import SamplingTensors
from graphrt.sampling.top_k_top_p import sample_top_k_top_p


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
        noise = log_race_noise(cols, tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        values = tl.where(in_vocab, scale_logits(values, temperature) + noise, float("-inf"))
    store_chunk_best(values, row, chunk, chunk_max_ptr, chunk_index_ptr, num_chunks, CHUNK)


def sample_temperature(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row for rows without top-k / top-p: greedy rows take the argmax, the others draw
    from softmax(logits / temperature) with the row's (seed, step) noise.

    logits: [B, V] float (columns contiguous, finite); sampling: B rows on the same device (its top-k
    and top-p are ignored: ``sample_fused`` sends batches with such rows to
    ``graphrt.sampling.top_k_top_p``); out: [B] int64 (allocated when not given). Allocates a
    [B, ceil(V / 4096)] scratch pair; capturable.
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
    """``graphrt.sampling.sampler.sample``'s contract on the fused kernels: greedy rows take the argmax,
    temperature-only rows the fused race above; when any row sets top-k / top-p, the whole batch takes
    ``graphrt.sampling.top_k_top_p``, which races temperature-only rows exactly as above and filters the
    others without sorting. A row's token depends on its own parameters only, never on what else shares
    the batch. logits: [B, V]; returns ``out``: [B] int64. Capturable (the kernels run are chosen by
    ``sampling``'s host flags, the per-row choice on the device)."""
    if sampling.all_greedy:
        return argmax_rows(logits, out=out)
    if sampling.needs_top_k_top_p:
        return sample_top_k_top_p(logits, sampling, out=out)
    return sample_temperature(logits, sampling, out=out)
