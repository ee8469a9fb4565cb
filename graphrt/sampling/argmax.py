"""Greedy token choice: the argmax of each logits row, in two short passes over the vocabulary.

``torch.argmax`` reduces a row in one thread block, so at batch 1 one SM walks the whole vocabulary
(128k entries for Llama 3) while the others idle. Here every row is split into chunks
reduced in parallel (pass 1: max and first index per chunk), then each row's chunk winners are
reduced (pass 2). Ties go to the lowest token id, as with ``torch.argmax``; the logits are read in
their own dtype (upcasting is exact, so no float32 copy is needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Vocabulary entries one program of pass 1 reduces.
_CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,  # [B, V]
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
    values = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab_size, other=float("-inf"))
    store_chunk_best(values.to(tl.float32), row, chunk, chunk_max_ptr, chunk_index_ptr, num_chunks, CHUNK)


@triton.jit
def store_chunk_best(values, row, chunk, chunk_max_ptr, chunk_index_ptr, num_chunks, CHUNK: tl.constexpr):
    """Pass 1's result for one chunk: the largest of ``values`` ([CHUNK] float32, -inf outside the
    vocabulary) and its column, the lowest on ties."""
    best, best_col = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_index_ptr + row * num_chunks + chunk, chunk * CHUNK + best_col.to(tl.int64))


@triton.jit
def _row_argmax_kernel(
    chunk_max_ptr,  # [B, C] float32
    chunk_index_ptr,  # [B, C] int64
    out_ptr,  # [B] int64
    num_chunks,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    values = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    # The first chunk holding the maximum holds its lowest index.
    _, winner = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(chunk_index_ptr + row * num_chunks + winner))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float (rows may be strided, columns contiguous; finite values) -> ``out``: [B]
    int64 index of each row's maximum, the lowest on ties (allocated when not given). Allocates a
    [B, ceil(V / 4096)] scratch pair; capturable in a CUDA graph (the launch depends on B and V)."""

    def chunk_pass(grid, chunk_max, chunk_index, chunk, num_chunks):
        _chunk_argmax_kernel[grid](logits, chunk_max, chunk_index, logits.stride(0), logits.shape[1], num_chunks,
                                   CHUNK=chunk, num_warps=8)

    return two_pass_argmax(logits, out, chunk_pass)


def two_pass_argmax(logits: torch.Tensor, out: torch.Tensor | None, chunk_pass, max_chunk: int = _CHUNK) -> torch.Tensor:
    """Check ``logits`` ([B, V], contiguous columns) and ``out`` ([B] int64, allocated when None), run
    ``chunk_pass(grid, chunk_max, chunk_index, chunk, num_chunks)`` -- pass 1, a kernel that fills the
    [B, C] scratch pair through ``store_chunk_best`` -- then pass 2, which writes each row's winner to
    ``out``. Returns ``out``. ``max_chunk``: the most columns a chunk holds (a power of two)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous columns, got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits have no columns")
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    elif out.shape != (batch,) or out.dtype != torch.int64:
        raise ValueError(f"out must be [{batch}] int64, got {tuple(out.shape)} {out.dtype}")
    if batch == 0:
        return out
    if max_chunk < 1 or max_chunk & (max_chunk - 1):
        raise ValueError(f"max_chunk must be a power of two, got {max_chunk}")
    chunk = min(max_chunk, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(batch, num_chunks, dtype=torch.int64, device=logits.device)
    chunk_pass((batch, num_chunks), chunk_max, chunk_index, chunk, num_chunks)
    _row_argmax_kernel[(batch,)](chunk_max, chunk_index, out, num_chunks,
                                 CHUNKS_BLOCK=triton.next_power_of_2(num_chunks), num_warps=1)
    return out
