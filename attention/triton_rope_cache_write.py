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

``project_rope_and_write_kv_cache`` goes one kernel further for a decode step at batch 1: the QKV
projection itself (the batch-1 GEMV of ``graphrt.kernels.gemv``, input RMSNorm fused in) computes each
head's matching first- and second-half outputs in the same program and rotates and stores them in its
epilogue, so a layer runs one kernel fewer. Its results are those of the GEMV followed by
``rope_and_write_kv_cache`` up to a rounding of the projection (its tile differs from the GEMV's, so its
float32 sums may run in another order; the rotation and the cache write round alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels import gemv
from graphrt.kernels.dependent_launch import launch_options, wait_for_previous_kernel
from graphrt.kernels.rounding import round_to, round_to_e4m3


@triton.jit
def rotate_halves(first, second, cos, sin, DTYPE: tl.constexpr):
    """float32 halves -> rotated halves in DTYPE (products and sums rounded to DTYPE)."""
    new_first = round_to(first * cos, DTYPE).to(tl.float32) - round_to(second * sin, DTYPE).to(tl.float32)
    new_second = round_to(second * cos, DTYPE).to(tl.float32) + round_to(first * sin, DTYPE).to(tl.float32)
    return round_to(new_first, DTYPE), round_to(new_second, DTYPE)


@triton.jit
def store_cache(ptrs, values, inv_scale, mask, QUANTIZE: tl.constexpr):
    """Store ``values`` in the cache's dtype; an fp8 cache gets ``values / scale``, saturated and rounded."""
    if QUANTIZE:
        values = round_to_e4m3(values.to(tl.float32) * inv_scale)
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
    q_first, q_second = rotate_halves(q_first, q_second, cos, sin, dtype)
    tl.store(q_ptrs, q_first, mask=q_mask)
    tl.store(q_ptrs + HEAD_SIZE // 2, q_second, mask=q_mask)

    kv_mask = (heads[:, None] < NUM_KV_HEADS) & half_mask[None, :]
    k_ptrs = row_ptr + NUM_HEADS * HEAD_SIZE + within_head
    k_first = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k_second = tl.load(k_ptrs + HEAD_SIZE // 2, mask=kv_mask, other=0.0).to(tl.float32)
    k_first, k_second = rotate_halves(k_first, k_second, cos, sin, dtype)
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
            store_cache(key_dst, k_first, inv_k_scale, kv_mask, QUANTIZE)
            store_cache(key_dst + HEAD_SIZE // 2, k_second, inv_k_scale, kv_mask, QUANTIZE)
            store_cache(value_dst, v_first, inv_v_scale, kv_mask, QUANTIZE)
            store_cache(value_dst + HEAD_SIZE // 2, v_second, inv_v_scale, kv_mask, QUANTIZE)

@triton.jit
def _qkv_rope_cache_kernel(
    x_ptr,  # [T, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [(H + 2 * KVH) * D, K] fused QKV weight: q heads, k heads, v heads
    bias_ptr,  # [(H + 2 * KVH) * D] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    scale_ptr,  # [(H + 2 * KVH) * D] float32 per-row scales of an FP8 weight (unused without W_SCALED)
    qkv_ptr,  # [T, (H + 2 * KVH) * D] out: q and k rotated, v as projected
    positions_ptr,  # [T] int64
    cos_ptr,  # [P, D] float32 (both halves equal)
    sin_ptr,  # [P, D] float32
    cache_ptr,  # [2, num_blocks, block_size * KVH * D]
    slot_ptr,  # [T] int64, -1 = store nothing
    stride_x,
    stride_w,
    stride_qkv_row,
    stride_table_row,
    stride_cache_kind,
    eps,
    K,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALED: tl.constexpr,  # w holds FP8 codes, real values code * scale[row]
    WRITE_CACHE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # first-half channels a program computes (with their second halves); divides D / 2
    BLOCK_K: tl.constexpr,
    THREAD_SUM: tl.constexpr,  # gemv.TileConfig.thread_sum
    NORM_BLOCK: tl.constexpr,  # row elements the norm's sum of squares loads at once (gemv.norm_block)
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    HALF = HEAD_SIZE // 2
    token = tl.program_id(0)  # tokens first: one tile's programs for every token run back to back
    dtype = qkv_ptr.dtype.element_ty
    # Program p covers channels [c, c + BLOCK_N) of one head's first half and the matching channels of
    # its second half: outputs head * D + c + i and head * D + D / 2 + c + i.
    head = (tl.program_id(1) * BLOCK_N) // HALF
    channel = (tl.program_id(1) * BLOCK_N) % HALF + tl.arange(0, BLOCK_N)
    first_cols = head * HEAD_SIZE + channel
    every = channel < HALF  # all true: BLOCK_N divides D / 2 (the mask shape the GEMV expects)
    x_row = x_ptr + token.to(tl.int64) * stride_x
    # The position, its rotary rows and the slot come from the host's upload, which no kernel of the
    # step writes: loaded before row_products waits for the previous kernel (see dependent_launch), so
    # these two dependent loads do not follow the products.
    position = tl.load(positions_ptr + token)
    cos = round_to(tl.load(cos_ptr + position * stride_table_row + channel), dtype).to(tl.float32)
    sin = round_to(tl.load(sin_ptr + position * stride_table_row + channel), dtype).to(tl.float32)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + token)
    if HAS_BIAS:  # static, like the weights
        first_bias = tl.load(bias_ptr + first_cols).to(tl.float32)
        second_bias = tl.load(bias_ptr + first_cols + HALF).to(tl.float32)
    first, second, _ = gemv.row_products(x_row, w_ptr, stride_w, first_cols, first_cols + HALF, every, norm_w_ptr,
                                         x_row, scale_ptr, K, eps, NORM, True, False, W_SCALED, BLOCK_K, THREAD_SUM,
                                         NORM_BLOCK, PDL, dtype)
    if HAS_BIAS:
        first += first_bias
        second += second_bias
    # The projection's output tensor, then the rotation rope_and_write_kv_cache would apply to it.
    first = round_to(first, dtype)
    second = round_to(second, dtype)
    rotated_first, rotated_second = rotate_halves(first.to(tl.float32), second.to(tl.float32), cos, sin, dtype)
    rotate = head < NUM_HEADS + NUM_KV_HEADS  # q and k heads; v heads are stored as projected
    first = tl.where(rotate, rotated_first, first)
    second = tl.where(rotate, rotated_second, second)
    out_ptrs = qkv_ptr + token.to(tl.int64) * stride_qkv_row + first_cols
    tl.store(out_ptrs, first)
    tl.store(out_ptrs + HALF, second)

    if WRITE_CACHE:
        if head >= NUM_HEADS:  # k and v heads
            if slot >= 0:  # a real token
                is_value = head >= NUM_HEADS + NUM_KV_HEADS
                kv_head = head - NUM_HEADS - tl.where(is_value, NUM_KV_HEADS, 0)
                destination = (cache_ptr + tl.where(is_value, stride_cache_kind, 0)
                               + slot * (NUM_KV_HEADS * HEAD_SIZE) + kv_head * HEAD_SIZE + channel)
                inv_scale = tl.where(is_value, inv_v_scale, inv_k_scale)
                store_cache(destination, first, inv_scale, every, QUANTIZE)
                store_cache(destination + HALF, second, inv_scale, every, QUANTIZE)


def project_rope_and_write_kv_cache(
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
) -> torch.Tensor:
    """The QKV projection of a few tokens (fast for one), rotated and stored in the cache, in one kernel:
    ``linear_gemv(x, weight, bias, norm_weight=...)`` then ``rope_and_write_kv_cache`` on its output,
    up to a rounding of the projection (see the module docstring).

    x: [T, K] (columns contiguous), model dtype; weight: [(H + 2 * KVH) * D, K] contiguous, same dtype,
    or FP8 codes with ``weight_scale`` (as ``linear_gemv`` takes them); bias: None or [(H + 2 * KVH) * D]; norm_weight: None, or [K]: x is RMS-normalised first (``eps``);
    positions, cos, sin, kv_cache, slot_mapping, scales: as ``rope_and_write_kv_cache`` (kv_cache None:
    rotate only). Returns ``out`` [T, (H + 2 * KVH) * D] (allocated when None; contiguous columns, not
    sharing memory with x): q and k rotated, v as projected. Nothing is allocated when ``out`` is given, and the launch
    depends on shapes only: safe inside a CUDA graph. ``dependent_launch``: as ``linear_gemv``.
    """
    num_tokens, in_features = gemv.check_operands(x, weight, bias, norm_weight, weight_scale=weight_scale)
    width = check_qkv_projection(weight, positions, num_tokens, num_heads, num_kv_heads, head_size)
    write = check_rope_operands(positions, cos, sin, kv_cache, slot_mapping, num_tokens, num_kv_heads, head_size)
    out = gemv.output_for(x, out, width)
    if num_tokens == 0:
        return out
    config = qkv_tile(in_features, width, head_size, weight.element_size())
    _qkv_rope_cache_kernel[(num_tokens, gemv.grid_tiles(width // 2, config.block_n))](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight,
        weight if weight_scale is None else weight_scale, out,
        positions, cos, sin, kv_cache if write else out, slot_mapping if write else positions,
        x.stride(0), weight.stride(0), out.stride(0), cos.stride(0), kv_cache.stride(0) if write else 0,
        float(eps), in_features, 1.0 / float(k_scale), 1.0 / float(v_scale),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, W_SCALED=weight_scale is not None, WRITE_CACHE=write,
        QUANTIZE=write and kv_cache.dtype == torch.float8_e4m3fn, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        THREAD_SUM=config.thread_sum, NORM_BLOCK=gemv.norm_block(in_features),
        num_warps=config.num_warps, **launch_options(dependent_launch),
    )
    return out


def qkv_tile(in_features: int, width: int, head_size: int, element_size: int) -> gemv.TileConfig:
    """The fused kernel's tile: the QKV GEMV's (``gemv.default_config``) with half the channels a program,
    since each brings its second-half partner (the same weight bytes a program), and at most the largest
    power of two dividing D / 2, so a program stays inside one head's half."""
    base = gemv.default_config(in_features, width, False, element_size)
    block_n = max(1, base.block_n // 2)
    while (head_size // 2) % block_n:
        block_n //= 2
    return gemv.TileConfig(block_n=block_n, block_k=base.block_k, num_warps=base.num_warps,
                           thread_sum=base.thread_sum)


def check_qkv_projection(weight: torch.Tensor, positions: torch.Tensor, num_tokens: int, num_heads: int,
                         num_kv_heads: int, head_size: int) -> int:
    """Checks that ``weight`` has the fused QKV rows of the heads and ``positions`` one position a token;
    returns the rows, (H + 2 * KVH) * D."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    if weight.dim() != 2 or weight.shape[0] != width:
        raise ValueError(f"weight {tuple(weight.shape)} is not a fused QKV weight of {width} rows "
                         f"({num_heads} + 2 x {num_kv_heads} heads of {head_size})")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} must hold one position per row of x ({num_tokens})")
    return width


def check_rope_operands(positions, cos, sin, kv_cache, slot_mapping, num_tokens: int, num_kv_heads: int,
                         head_size: int) -> bool:
    """Checks the rotary and cache arguments (as ``rope_and_write_kv_cache`` documents them); returns
    whether there is a cache to write."""
    if positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64, got {positions.dtype}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_size or cos.dtype != torch.float32:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be float32 [P, {head_size}]")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos and sin must have contiguous, equally strided rows")
    if head_size % 2:
        raise ValueError(f"rotary embedding needs an even head size, got {head_size}")
    if kv_cache is None:
        return False
    row = num_kv_heads * head_size
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] % row:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, block_size * {row}]")
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError("kv_cache blocks must be contiguous")
    if slot_mapping is None or slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping must be int64 with one entry per token")
    return True


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
    write = check_rope_operands(positions, cos, sin, kv_cache, slot_mapping, num_tokens, num_kv_heads, head_size)
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
