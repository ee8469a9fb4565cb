"""The QKV projection of a few tokens (2 to ``gemv_rows.MAX_ROWS``: a verify step's rows, a small batch)
with the input RMSNorm, the rotary embedding and the cache write fused in, on tensor cores: what
``triton_rope_cache_write.project_rope_and_write_kv_cache`` does for one token, with each weight read
once for every token (``graphrt.kernels.gemv_rows``).

A program computes ``block_n`` channels of one head's first half and the matching channels of its
second half for every token (the channels past the half masked when ``block_n`` does not divide it),
rotates q and k heads with each token's position, writes the rows and stores k and v at the tokens'
cache slots (slot -1, CUDA-graph padding: rotated, never stored). Rounding as the one-token kernel:
the projection rounded to the model dtype, then the rotation as the unfused torch ops round it; the
float32 sums run in the tensor cores' order, so a projected value may sit a rounding away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.attention.triton_rope_cache_write import check_rope_operands, rotate_halves, store_cache
from graphrt.kernels import gemv, gemv_rows
from graphrt.kernels.dependent_launch import launch_options
from graphrt.kernels.rounding import round_to


@triton.jit
def _rows_qkv_rope_cache_kernel(
    x_ptr,  # [T, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [(H + 2 * KVH) * D, K] fused QKV weight: q heads, k heads, v heads
    bias_ptr,  # [(H + 2 * KVH) * D] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    qkv_ptr,  # [T, (H + 2 * KVH) * D] out: q and k rotated, v as projected
    positions_ptr,  # [T] int64
    cos_ptr,  # [P, D] float32 (both halves equal)
    sin_ptr,  # [P, D] float32
    cache_ptr,  # [2, num_blocks, block_size * KVH * D]
    slot_ptr,  # [T] int64, -1 = store nothing
    M,
    K,
    stride_x,
    stride_w,
    stride_qkv_row,
    stride_table_row,
    stride_cache_kind,
    eps,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    DOT_F32: tl.constexpr,  # float32 products (gemv_rows.dot_in_float32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # channels of a head's half a program computes (with their second-half partners)
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    HALF: tl.constexpr = HEAD_SIZE // 2
    CHUNKS: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    dtype = qkv_ptr.dtype.element_ty
    head = tl.program_id(0) // CHUNKS
    channel = (tl.program_id(0) % CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    channel_ok = channel < HALF
    first_cols = head * HEAD_SIZE + channel
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    tile_ok = channel_ok[:, None] & row_ok[None, :]
    # Positions, rotary rows and slots come from the host's upload, which no kernel of the step writes,
    # and the bias is static: all read before waiting for the previous kernel.
    positions = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    table = positions[None, :] * stride_table_row + channel[:, None]  # [BLOCK_N, BLOCK_M]
    cos = round_to(tl.load(cos_ptr + table, mask=tile_ok, other=0.0), dtype).to(tl.float32)
    sin = round_to(tl.load(sin_ptr + table, mask=tile_ok, other=0.0), dtype).to(tl.float32)
    if WRITE_CACHE:
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    if HAS_BIAS:
        first_bias = tl.load(bias_ptr + first_cols, mask=channel_ok, other=0.0).to(tl.float32)
        second_bias = tl.load(bias_ptr + first_cols + HALF, mask=channel_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    first, second = gemv_rows.rows_products(x_ptr, w_ptr, norm_w_ptr, rows, row_ok, first_cols, first_cols + HALF,
                                            channel_ok, stride_x, stride_w, K, eps, NORM, True, DOT_F32, BLOCK_M,
                                            BLOCK_N, BLOCK_K, dtype)
    if HAS_BIAS:
        first += first_bias[:, None]
        second += second_bias[:, None]
    # The projection's output tensor, then the rotation rope_and_write_kv_cache would apply to it.
    first = round_to(first, dtype)
    second = round_to(second, dtype)
    rotated_first, rotated_second = rotate_halves(first.to(tl.float32), second.to(tl.float32), cos, sin, dtype)
    rotate = head < NUM_HEADS + NUM_KV_HEADS  # q and k heads; v heads are stored as projected
    first = tl.where(rotate, rotated_first, first)
    second = tl.where(rotate, rotated_second, second)
    out_ptrs = qkv_ptr + rows.to(tl.int64)[None, :] * stride_qkv_row + first_cols[:, None]
    tl.store(out_ptrs, first, mask=tile_ok)
    tl.store(out_ptrs + HALF, second, mask=tile_ok)

    if WRITE_CACHE:
        if head >= NUM_HEADS:  # k and v heads
            is_value = head >= NUM_HEADS + NUM_KV_HEADS
            kv_head = head - NUM_HEADS - tl.where(is_value, NUM_KV_HEADS, 0)
            destination = (cache_ptr + tl.where(is_value, stride_cache_kind, 0)
                           + slots.to(tl.int64)[None, :] * (NUM_KV_HEADS * HEAD_SIZE) + kv_head * HEAD_SIZE
                           + channel[:, None])
            inv_scale = tl.where(is_value, inv_v_scale, inv_k_scale)
            stored = tile_ok & (slots >= 0)[None, :]  # real tokens only
            store_cache(destination, first, inv_scale, stored, QUANTIZE)
            store_cache(destination + HALF, second, inv_scale, stored, QUANTIZE)


def half_block(head_size: int) -> int:
    """Channels of a head's half a program takes: the largest power of two of 16 to 64 dividing the half,
    else 16 (the last chunk of each half then masked)."""
    half = head_size // 2
    for block in (64, 32, 16):
        if half % block == 0:
            return block
    return 16


def project_rope_and_write_kv_cache_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    dependent_launch: bool = False,
    weight_scale: torch.Tensor | None = None,
    config: gemv_rows.RowsTileConfig | None = None,
) -> torch.Tensor:
    """``triton_rope_cache_write.project_rope_and_write_kv_cache`` for up to ``gemv_rows.MAX_ROWS``
    tokens, each weight read once for all: the same arguments and result. 16-bit or float32 weights in
    x's dtype (``weight_scale`` is refused). ``config``: its ``block_k``, ``num_warps`` and
    ``num_stages`` (``block_n`` is ``half_block``'s). Nothing is allocated when ``out`` is given, and
    the launch depends on shapes only: safe inside a CUDA graph."""
    if weight_scale is not None or weight.dtype == gemv.FP8_WEIGHT_DTYPE:
        raise ValueError("the few-row kernels take 16-bit or float32 weights in x's dtype, not FP8 codes")
    num_tokens, in_features = gemv.check_operands(x, weight, bias, norm_weight)
    gemv_rows.check_rows(num_tokens)
    width = (num_heads + 2 * num_kv_heads) * head_size
    if weight.shape[0] != width:
        raise ValueError(f"weight {tuple(weight.shape)} is not a fused QKV weight of {width} rows "
                         f"({num_heads} + 2 x {num_kv_heads} heads of {head_size})")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} must hold one position per row of x ({num_tokens})")
    write = check_rope_operands(positions, cos, sin, kv_cache, slot_mapping, num_tokens, num_kv_heads, head_size)
    out = gemv.output_for(x, out, width)
    if num_tokens == 0:
        return out
    config = config or gemv_rows.RowsTileConfig()
    block_n = half_block(head_size)
    heads = num_heads + 2 * num_kv_heads
    _rows_qkv_rope_cache_kernel[(heads * triton.cdiv(head_size // 2, block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, out,
        positions, cos, sin, kv_cache if write else out, slot_mapping if write else positions,
        num_tokens, in_features, x.stride(0), weight.stride(0), out.stride(0), cos.stride(0),
        kv_cache.stride(0) if write else 0, float(eps), 1.0 / float(k_scale), 1.0 / float(v_scale),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, WRITE_CACHE=write, QUANTIZE=write and kv_cache.dtype == torch.float8_e4m3fn,
        DOT_F32=gemv_rows.dot_in_float32(x), BLOCK_M=gemv_rows.MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=min(config.block_k, max(16, triton.next_power_of_2(in_features))),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(dependent_launch),
    )
    return out
