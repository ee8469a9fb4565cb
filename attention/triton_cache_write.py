"""Triton kernel that stores a step's new keys and values into the paged KV cache.

Cache layout (shared with ``reference.py``): per layer ``kv_cache [2, num_blocks, block_size * KVH * D]``,
index 0 keys, 1 values; inside a block token-major, then kv head, then channel. Slot ``s`` (= block *
block_size + offset) therefore owns the ``KVH * D`` contiguous elements starting at ``s * KVH * D`` of
``kv_cache[i].view(-1)``. Rows whose slot is -1 (CUDA-graph padding) are skipped, so their K/V never
reach the cache, not even the null block.

An fp8 cache (``torch.float8_e4m3fn``) stores ``value / scale`` rounded to nearest-even and saturated
to the format's largest finite value (+-448) instead of overflowing to NaN; readers multiply by the same
per-tensor scale. The rounding is done explicitly on the float32 value (so the final cast is exact):
the result is the same bit pattern as ``torch``'s cast on every backend, including Triton's CPU
interpreter, whose own float-to-fp8 conversion drops the mantissa carry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.rounding import round_to_e4m3

#: Elements of one token's ``KVH * D`` row that one program stores.
_BLOCK = 1024


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, KVH * D]
    value_ptr,  # [T, KVH * D]
    cache_ptr,  # [2, num_blocks, block_size * KVH * D]
    slot_ptr,  # [T] int64
    stride_key_row,
    stride_value_row,
    stride_cache_kind,  # elements between the key half and the value half
    inv_k_scale,
    inv_v_scale,
    ROW: tl.constexpr,  # KVH * D
    BLOCK: tl.constexpr,
    QUANTIZE: tl.constexpr,  # fp8 cache: divide by the scale, saturate
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token.to(tl.int64) * stride_key_row + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_value_row + offs, mask=mask)
    dst = cache_ptr + slot * ROW + offs
    if QUANTIZE:
        k = round_to_e4m3(k.to(tl.float32) * inv_k_scale)
        v = round_to_e4m3(v.to(tl.float32) * inv_v_scale)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kind, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_kv_heads: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` rows at their cache slots, converting to the cache dtype.

    key, value: [T, KVH * D] (rows may be strided, channels contiguous; e.g. views into a fused QKV
    output), any float dtype; kv_cache: [2, num_blocks, block_size * KVH * D] in the model dtype or
    ``torch.float8_e4m3fn``; slot_mapping: [T] int64, -1 = skip the row. ``k_scale``/``v_scale``
    (Python floats) apply only to an fp8 cache. Launch shape depends on T alone, so the call is safe
    inside a captured CUDA graph; nothing is allocated.
    """
    num_tokens = slot_mapping.shape[0]
    row = key.shape[-1]
    if key.shape != value.shape or key.dim() != 2 or key.shape[0] < num_tokens:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [T, KVH * D]")
    if row % num_kv_heads:
        raise ValueError(f"row width {row} is not a multiple of num_kv_heads ({num_kv_heads})")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value channels must be contiguous")
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] % row:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, block_size * {row}]")
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError("kv_cache blocks must be contiguous")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if num_tokens == 0:
        return
    quantize = kv_cache.dtype == torch.float8_e4m3fn
    grid = (num_tokens, triton.cdiv(row, _BLOCK))
    _write_kv_cache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        1.0 / float(k_scale),
        1.0 / float(v_scale),
        ROW=row,
        BLOCK=min(_BLOCK, triton.next_power_of_2(row)),
        QUANTIZE=quantize,
    )
