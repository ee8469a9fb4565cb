"""Rotary embedding fused with the KV-cache write: one kernel per step and layer instead of about
fifteen (table gathers and casts, the rotate-half negation and concatenation, four multiplies and two
adds for q and k, then the cache write).

One program per token rotates that token's q and k heads in place inside the fused QKV row (prefill
attention reads them from there) and stores the rotated k and the v into the token's cache slot.
Rotation is HF's "rotate half": channel ``d < D/2`` pairs with ``d + D/2``::

    out[d]       = x[d] * cos - x[d + D/2] * sin
    out[d + D/2] = x[d + D/2] * cos + x[d] * sin

with cos/sin rounded to the model dtype and each product and sum rounded to it, as the unfused torch
ops are (so both paths give the same bits). Cache layout and the fp8 conversion are those of
``triton_cache_write``; slot -1 (CUDA-graph padding) rotates but stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.dependent_launch import launch_options, wait_for_previous_kernel
from graphrt.kernels.rounding import round_to

from .triton_cache_write import _round_to_e4m3_grid


@triton.jit
def _rotate_halves(first, second, cos, sin, DTYPE: tl.constexpr):
    """float32 halves -> rotated halves in DTYPE (products and sums rounded to DTYPE)."""
    new_first = round_to(first * cos, DTYPE).to(tl.float32) - round_to(second * sin, DTYPE).to(tl.float32)
    new_second = round_to(second * cos, DTYPE).to(tl.float32) + round_to(first * sin, DTYPE).to(tl.float32)
    return round_to(new_first, DTYPE), round_to(new_second, DTYPE)


@triton.jit
def _store_cache(ptrs, values, inv_scale, mask, QUANTIZE: tl.constexpr):
    """Store ``values`` in the cache's dtype; an fp8 cache gets ``values / scale``, saturated and rounded."""
    if QUANTIZE:
        values = _round_to_e4m3_grid(values.to(tl.float32) * inv_scale)
    tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_write_kernel(
    qkv_ptr,  # [T, (H + 2 * KVH) * D]: q heads, k heads, v heads; q and k rotated in place
    positions_ptr,  # [T] int64
    cos_ptr,  # [P, D] float32 (both halves equal)
    sin_ptr,  # [P, D] float32
    cache_ptr,  # [2, num_blocks, block_size * KVH * D]
    slot_ptr,  # [T] int64, -1 = store nothing
    stride_qkv_row,
    stride_table_row,
    stride_cache_kind,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,  # power of two >= max(H, KVH)
    HALF_BLOCK: tl.constexpr,  # power of two >= D / 2
    WRITE_CACHE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    row_ptr = qkv_ptr + token.to(tl.int64) * stride_qkv_row
    dtype = qkv_ptr.dtype.element_ty
    half = tl.arange(0, HALF_BLOCK)
    heads = tl.arange(0, HEADS_BLOCK)
    half_mask = half < HEAD_SIZE // 2
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_table_row + half, mask=half_mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table_row + half, mask=half_mask, other=0.0)
    cos = round_to(cos, dtype).to(tl.float32)[None, :]
    sin = round_to(sin, dtype).to(tl.float32)[None, :]
    within_head = heads[:, None] * HEAD_SIZE + half[None, :]  # [HEADS_BLOCK, HALF_BLOCK], first halves

    q_mask = (heads[:, None] < NUM_HEADS) & half_mask[None, :]
    q_ptrs = row_ptr + within_head
    q_first = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q_second = tl.load(q_ptrs + HEAD_SIZE // 2, mask=q_mask, other=0.0).to(tl.float32)
    q_first, q_second = _rotate_halves(q_first, q_second, cos, sin, dtype)
    tl.store(q_ptrs, q_first, mask=q_mask)
    tl.store(q_ptrs + HEAD_SIZE // 2, q_second, mask=q_mask)

    kv_mask = (heads[:, None] < NUM_KV_HEADS) & half_mask[None, :]
    k_ptrs = row_ptr + NUM_HEADS * HEAD_SIZE + within_head
    k_first = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k_second = tl.load(k_ptrs + HEAD_SIZE // 2, mask=kv_mask, other=0.0).to(tl.float32)
    k_first, k_second = _rotate_halves(k_first, k_second, cos, sin, dtype)
    tl.store(k_ptrs, k_first, mask=kv_mask)
    tl.store(k_ptrs + HEAD_SIZE // 2, k_second, mask=kv_mask)

    if WRITE_CACHE:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            v_ptrs = row_ptr + (NUM_HEADS + NUM_KV_HEADS) * HEAD_SIZE + within_head
            v_first = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            v_second = tl.load(v_ptrs + HEAD_SIZE // 2, mask=kv_mask, other=0.0)
            key_dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_SIZE) + within_head
            value_dst = key_dst + stride_cache_kind
            _store_cache(key_dst, k_first, inv_k_scale, kv_mask, QUANTIZE)
            _store_cache(key_dst + HEAD_SIZE // 2, k_second, inv_k_scale, kv_mask, QUANTIZE)
            _store_cache(value_dst, v_first, inv_v_scale, kv_mask, QUANTIZE)
            _store_cache(value_dst + HEAD_SIZE // 2, v_second, inv_v_scale, kv_mask, QUANTIZE)

def rope_and_write_kv_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dependent_launch: bool = False,
) -> None:
    """Rotate q and k inside ``qkv`` in place and store the rotated k and the v at their cache slots.

    qkv: [T, (H + 2 * KVH) * D] contiguous, fp16/bf16/fp32 (the fused QKV projection's output);
    positions: [T] int64, each < P; cos, sin: [P, D] float32 tables of ``graphrt.models.layers.RotaryEmbedding``;
    kv_cache: [2, num_blocks, block_size * KVH * D] in the model dtype or ``torch.float8_e4m3fn``
    (then ``k_scale``/``v_scale`` apply), or None to rotate only (memory profiling);
    slot_mapping: [T] int64 (-1 = store nothing), ignored without a cache.
    One program per token, nothing allocated: safe inside a captured CUDA graph.
    ``dependent_launch``: launch as a programmatic dependent of the previous kernel (needs
    ``graphrt.kernels.dependent_launch.dependent_launch_available``).
    """
    num_tokens = positions.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.dim() != 2 or qkv.shape[1] != width or not qkv.is_contiguous() or qkv.shape[0] < num_tokens:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be a contiguous [T, {width}] fused QKV output")
    if positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64, got {positions.dtype}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_size or cos.dtype != torch.float32:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be float32 [P, {head_size}]")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos and sin must have contiguous, equally strided rows")
    write = kv_cache is not None
    if write:
        row = num_kv_heads * head_size
        if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] % row:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, block_size * {row}]")
        if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
            raise ValueError("kv_cache blocks must be contiguous")
        if slot_mapping is None or slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < num_tokens:
            raise ValueError("slot_mapping must be int64 with one entry per token")
    if num_tokens == 0:
        return
    _rope_cache_write_kernel[(num_tokens,)](
        qkv, positions, cos, sin,
        kv_cache if write else qkv, slot_mapping if write else positions,
        qkv.stride(0), cos.stride(0), kv_cache.stride(0) if write else 0,
        1.0 / float(k_scale), 1.0 / float(v_scale),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_BLOCK=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        HALF_BLOCK=triton.next_power_of_2(head_size // 2),
        WRITE_CACHE=write, QUANTIZE=write and kv_cache.dtype == torch.float8_e4m3fn, num_warps=4,
        **launch_options(dependent_launch),
    )
