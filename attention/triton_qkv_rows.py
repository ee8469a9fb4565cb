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

``project_rope_and_write_kv_cache_on_rows_kernel`` runs the same epilogue on ``graphrt.kernels.fp8_matmul``'s
rows kernel (16-bit or FP8 weights, K split where the heads are too few to fill the GPU, TMA), taking the
normalised rows: the rows kernel's product followed by ``rope_and_write_kv_cache``, bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from graphrt.attention.triton_rope_cache_write import (check_qkv_projection, check_rope_operands, rotate_halves,
                                                        store_cache)
from graphrt.kernels import fp8_matmul, gemv, gemv_rows
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
    cos, sin, slots = rotary_tables(positions_ptr, cos_ptr, sin_ptr, slot_ptr, rows, row_ok, channel, tile_ok,
                                    stride_table_row, WRITE_CACHE, dtype)
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
    rotate_and_store(first, second, head, channel, tile_ok, rows, cos, sin, slots, qkv_ptr, stride_qkv_row, cache_ptr,
                     stride_cache_kind, inv_k_scale, inv_v_scale, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, WRITE_CACHE,
                     QUANTIZE, dtype)


@triton.jit
def rotate_and_store(first, second, head, channel, tile_ok, rows, cos, sin, slots, qkv_ptr, stride_qkv_row, cache_ptr,
                     stride_cache_kind, inv_k_scale, inv_v_scale, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, WRITE_CACHE: tl.constexpr,
                     QUANTIZE: tl.constexpr, dtype: tl.constexpr):
    """The epilogue of a head's projection: float32 sums of its first-half ``channel``s and of their
    second-half partners [BLOCK_N, BLOCK_M tokens] (bias added) rounded as the projection's output, q and k
    heads rotated with each token's ``cos`` and ``sin`` [BLOCK_N, BLOCK_M], stored into the rows of qkv, and
    k and v stored at the tokens' cache ``slots`` (-1: nothing) where ``tile_ok``."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    first_cols = head * HEAD_SIZE + channel
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


@triton.jit
def rotary_tables(positions_ptr, cos_ptr, sin_ptr, slot_ptr, rows, row_ok, channel, tile_ok, stride_table_row,
                  WRITE_CACHE: tl.constexpr, dtype: tl.constexpr):
    """(cos, sin) [BLOCK_N channels, BLOCK_M tokens] in float32, rounded to ``dtype`` as the unfused ops
    round them, and the tokens' cache slots [BLOCK_M] (-1 without WRITE_CACHE or past the rows): from the
    host's upload, which no kernel of the step writes (readable before a dependent launch's wait)."""
    positions = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    table = positions[None, :] * stride_table_row + channel[:, None]
    cos = round_to(tl.load(cos_ptr + table, mask=tile_ok, other=0.0), dtype).to(tl.float32)
    sin = round_to(tl.load(sin_ptr + table, mask=tile_ok, other=0.0), dtype).to(tl.float32)
    slots = tl.full([rows.shape[0]], -1, dtype=tl.int64)
    if WRITE_CACHE:
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    return cos, sin, slots


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
    width = check_qkv_projection(weight, positions, num_tokens, num_heads, num_kv_heads, head_size)
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


# -- the same epilogue on the rows kernel of graphrt.kernels.fp8_matmul (16-bit or FP8 weights) --------------


@triton.jit
def _weight_rows_qkv_rope_cache_kernel(
    x_ptr,  # [M, K] activations: FP8 codes (X_CODES), else 16-bit or float32 (the normalised rows)
    x_scale_ptr,  # [M] float32 scales of the codes (read only with X_CODES)
    w_ptr,  # [(H + 2 * KVH) * D, K] fused QKV weight (E4M3 codes with W_CODES, else x's dtype)
    w_desc,  # with TMA: a tensor descriptor of w_ptr's rows in [BLOCK_N, BLOCK_K] boxes (else unused)
    w_scale_ptr,  # [(H + 2 * KVH) * D] float32 (read only with W_CODES)
    bias_ptr,  # [(H + 2 * KVH) * D] (unused without HAS_BIAS)
    qkv_ptr,  # [M, (H + 2 * KVH) * D] out: q and k rotated, v as projected
    positions_ptr,  # [M] int64
    cos_ptr,  # [P, D] float32 (both halves equal)
    sin_ptr,  # [P, D] float32
    cache_ptr,  # [2, num_blocks, block_size * KVH * D]
    slot_ptr,  # [M] int64, -1 = store nothing
    partials_ptr,  # split-K scratch (fp8_matmul.gather_split_sums; unused when SPLIT_K == 1)
    arrivals_ptr,
    M,
    K,
    stride_x,
    stride_w,
    stride_qkv_row,
    stride_table_row,
    stride_cache_kind,
    slices_per_split,
    inv_k_scale,
    inv_v_scale,
    norm_w_ptr,  # [K] RMSNorm weight (read only with NORM)
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    X_CODES: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides D / 2 and BLOCK_K divides K
    TMA: tl.constexpr,
    W_CODES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # channels of a head's half a program computes (with their second-half partners)
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,  # x (16-bit or float32) is the residual stream, RMS-normalised first
):
    # Program (p, t, s): channels of one head's first half and their second-half partners (paired rows
    # D / 2 further), tokens tile t, split s of K; fp8_matmul's rows kernel computes the sums.
    HALF: tl.constexpr = HEAD_SIZE // 2
    CHUNKS: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    dtype = qkv_ptr.dtype.element_ty
    head = tl.program_id(0) // CHUNKS
    first_channel = (tl.program_id(0) % CHUNKS) * BLOCK_N
    channel = first_channel + tl.arange(0, BLOCK_N)
    channel_ok = channel < HALF
    first_col = head * HEAD_SIZE + first_channel
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    tile_ok = channel_ok[:, None] & row_ok[None, :]
    cos, sin, slots = rotary_tables(positions_ptr, cos_ptr, sin_ptr, slot_ptr, rows, row_ok, channel, tile_ok,
                                    stride_table_row, WRITE_CACHE, dtype)
    first, second = fp8_matmul.rows_tile_sums(x_ptr, w_ptr, w_desc, first_col, HALF, rows, row_ok, channel_ok, K,
                                              stride_x, stride_w, slices_per_split, True, X_CODES, DOT_F32, EVEN, TMA,
                                              W_CODES, BLOCK_M, BLOCK_N, BLOCK_K, norm_w_ptr, eps, NORM)
    last, first, second = fp8_matmul.gather_split_sums(first, second, partials_ptr, arrivals_ptr, True, SPLIT_K,
                                                       BLOCK_M, BLOCK_N)
    if last:
        first_cols = head * HEAD_SIZE + channel
        first = fp8_matmul.scaled_sums(first, first_cols, channel_ok, rows, row_ok, x_scale_ptr, w_scale_ptr, bias_ptr,
                                       X_CODES, HAS_BIAS, W_CODES)
        second = fp8_matmul.scaled_sums(second, first_cols + HALF, channel_ok, rows, row_ok, x_scale_ptr, w_scale_ptr,
                                        bias_ptr, X_CODES, HAS_BIAS, W_CODES)
        rotate_and_store(first, second, head, channel, tile_ok, rows, cos, sin, slots, qkv_ptr, stride_qkv_row,
                         cache_ptr, stride_cache_kind, inv_k_scale, inv_v_scale, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE,
                         WRITE_CACHE, QUANTIZE, dtype)


def project_rope_and_write_kv_cache_on_rows_kernel(
    x: torch.Tensor | fp8_matmul.QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: fp8_matmul.RowsTile | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The QKV projection of 1 to ``fp8_matmul.TRITON_MAX_ROWS`` normalised tokens on the rows kernel
    (``fp8_matmul``: weight rows on the tensor cores' wide side, K split where the heads are too few to fill
    the GPU, slices through TMA up to 16 tokens on sm_90+), rotated and stored in the cache in its epilogue:
    the rows kernel's product followed by ``rope_and_write_kv_cache``, bit for bit at the same tile.

    x: [M, K] activations (16-bit or float32, columns contiguous) or ``QuantizedRows`` (FP8 codes and
    per-token scales: FP8 x FP8 products); weight: [(H + 2 * KVH) * D, K] contiguous, x's dtype, or FP8
    codes with ``weight_scale`` [(H + 2 * KVH) * D] float32 (16-bit x: W8A16); bias: None or
    [(H + 2 * KVH) * D]; positions, cos, sin, kv_cache, slot_mapping, scales: as ``rope_and_write_kv_cache``
    (kv_cache None: rotate only). ``tile``: its ``block_m``, ``block_k``, stages, warps, split and TMA
    (``block_n`` is ``half_block``'s; default ``fp8_matmul.rows_tile``'s for the launch's programs).
    ``norm_weight`` ([K], x's dtype; 16-bit or float32 x): x is the residual stream, RMS-normalised in the
    kernel first (``eps``), as ``fp8_matmul.rows_matmul``'s prologue.
    Returns qkv [M, (H + 2 * KVH) * D] in the activations' dtype: q and k rotated, v as projected. No host
    sync: safe inside a CUDA graph."""
    quantized = isinstance(x, fp8_matmul.QuantizedRows)
    rows_in = x.codes if quantized else x
    dtype = x.dtype
    if rows_in.dim() != 2 or rows_in.stride(-1) != 1 or rows_in.shape[1] == 0:
        raise ValueError(f"x must be [M, K] with K > 0 and contiguous columns, got {tuple(rows_in.shape)}")
    if quantized:
        fp8_matmul.check_quantized_rows(x)
    if not quantized and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"activations must be 16-bit or float32 (FP8 ones as QuantizedRows), got {dtype}")
    num_tokens, in_features = rows_in.shape
    width = check_qkv_projection(weight, positions, num_tokens, num_heads, num_kv_heads, head_size)
    if weight.shape[1] != in_features or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous with x's {in_features} columns")
    codes_weight = weight.dtype == fp8_matmul.FP8_DTYPE
    if codes_weight != (weight_scale is not None) or (quantized and not codes_weight):
        raise ValueError("FP8 weight codes take their row scales (weight_scale), 16-bit weights none; FP8 "
                         "activations need FP8 weights")
    if not codes_weight and weight.dtype != dtype:
        raise ValueError(f"16-bit weights must be x's dtype ({dtype}), got {weight.dtype}")
    if weight_scale is not None and (weight_scale.shape != (width,) or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be float32 [{width}], got {tuple(weight_scale.shape)} {weight_scale.dtype}")
    fp8_matmul.check_bias(weight, bias)
    if num_tokens > fp8_matmul.TRITON_MAX_ROWS:
        raise ValueError(f"{num_tokens} tokens exceed the rows kernel's {fp8_matmul.TRITON_MAX_ROWS}")
    write = check_rope_operands(positions, cos, sin, kv_cache, slot_mapping, num_tokens, num_kv_heads, head_size)
    fp8_matmul.check_norm_and_residual(rows_in, x.scales if quantized else None, norm_weight, None, False,
                                       (num_tokens, width), dtype)
    out = torch.empty((num_tokens, width), dtype=dtype, device=rows_in.device)
    if num_tokens == 0:
        return out
    block_n = half_block(head_size)
    programs = (num_heads + 2 * num_kv_heads) * triton.cdiv(head_size // 2, block_n)
    # rows_tile counts a launch's programs in 64-row tiles: the split rule sees this launch's programs.
    tile = tile or fp8_matmul.rows_tile(num_tokens, programs * 64, in_features,
                                        fp8_matmul.multiprocessors(rows_in.device),
                                        fp8_matmul.tma_available(rows_in.device), weight.element_size())
    tile = dataclasses.replace(tile, block_n=block_n)
    row_tiles = triton.cdiv(num_tokens, tile.block_m)
    launch = fp8_matmul.rows_launch(weight, weight_scale, tile, out, programs, row_tiles, paired=True)
    _weight_rows_qkv_rope_cache_kernel[(programs, row_tiles, launch.split_k)](
        rows_in, x.scales if quantized else launch.w_scales, weight, launch.w_desc, launch.w_scales,
        weight if bias is None else bias, out, positions, cos, sin, kv_cache if write else out,
        slot_mapping if write else positions, launch.partials, launch.arrivals, num_tokens, in_features,
        rows_in.stride(0), weight.stride(0), out.stride(0), cos.stride(0), kv_cache.stride(0) if write else 0,
        launch.slices_per_split, 1.0 / float(k_scale), 1.0 / float(v_scale),
        weight if norm_weight is None else norm_weight, float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HAS_BIAS=bias is not None,
        WRITE_CACHE=write, QUANTIZE=write and kv_cache.dtype == torch.float8_e4m3fn, X_CODES=quantized,
        DOT_F32=launch.dot_f32, EVEN=(head_size // 2) % block_n == 0 and in_features % tile.block_k == 0,
        TMA=launch.tma, W_CODES=codes_weight, SPLIT_K=launch.split_k, BLOCK_M=tile.block_m, BLOCK_N=block_n,
        BLOCK_K=tile.block_k, NORM=norm_weight is not None, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
