"""Products of FP8 weights (E4M3 codes, a float32 scale per row) with several tokens' activations.

The GEMV kernels read a row's weights once per token (``graphrt.kernels.gemv``), so above one token an
FP8 model's linear layers run on the tensor cores, one of two ways:

* ``w8a16_matmul``: one Triton kernel streams the codes once, widens them in registers (exact: every
  E4M3 value is a float16 one), multiplies on the tensor cores with float32 accumulation and scales
  each output column once. The activations are not quantised: the result is the one the dequantised
  weights give (up to the activations' float16 range, see its docstring).
* ``scaled_mm``: each token's activations are quantised to E4M3 with a scale of their own
  (``quantize_rows``, one Triton launch: ``scale = amax / 448``, codes rounded to nearest-even), then
  codes multiply codes on FP8 tensor cores (twice the 16-bit rate, no widening), with row-wise scales:
  for up to ``TRITON_MAX_ROWS`` rows the same Triton kernel, above it ``torch._scaled_mm`` (cuBLAS /
  CUTLASS, sm_89+). Quantising the activations adds an error the W8A16 path does not have: at most
  half an E4M3 step (2**-4 relative) on each input. It needs both widths to be multiples of 16
  (``supports_shape``).

The Triton kernel puts the weight rows on the tensor cores' 64-row side and the tokens on the narrow
side, so 2-64 tokens fill an MMA without padding to 64. Which path a forward takes is the kernel
policy's (``graphrt.models.kernel_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrt.kernels.rounding import FP8_MAX_VALUE, round_to, round_to_e4m3

FP8_DTYPE = torch.float8_e4m3fn

#: Smallest activation scale: a row of zeros gets it (its codes are zeros) instead of dividing by 0.
MIN_SCALE = 1e-12

#: Row elements one load of ``_quantize_rows_kernel`` takes.
_BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] activations (16-bit or float32)
    codes_ptr,  # [M, K] float8_e4m3fn out
    scales_ptr,  # [M] float32 out
    stride_x,
    stride_codes,
    K,
    MIN_SCALE_VALUE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + offsets, mask=k + offsets < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # Correctly rounded divisions, as torch divides: the codes then equal quantize_rows_torch's bit for bit.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_VALUE), MIN_SCALE_VALUE)
    tl.store(scales_ptr + row, scale)
    for k in range(0, K, BLOCK):  # the row again, from L1/L2
        cols = k + offsets
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        codes = round_to_e4m3(tl.math.div_rn(x, scale))
        tl.store(codes_ptr + row * stride_codes + cols, codes.to(codes_ptr.dtype.element_ty), mask=cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (columns contiguous) -> (codes [M, K] float8_e4m3fn, scales [M] float32) with
    ``x[m] ~ codes[m] * scales[m]``, ``scales[m] = max(amax(|x[m]|) / 448, MIN_SCALE)``. One launch,
    no host sync: safe inside a CUDA graph."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [M, K] tensor with contiguous columns, got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, width = x.shape
    codes = torch.empty((rows, width), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, codes, scales, x.stride(0), codes.stride(0), width,
                                       MIN_SCALE_VALUE=MIN_SCALE, BLOCK=min(_BLOCK, triton.next_power_of_2(width)))
    return codes, scales


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in torch ops (the reference it must equal)."""
    x = x.float()
    limit = float(torch.finfo(FP8_DTYPE).max)
    amax = x.abs().amax(dim=1)
    # Divided by a tensor: torch on CUDA divides by a Python number as a product with its reciprocal,
    # which is not the correctly rounded quotient (the kernel's), and flips codes at ties.
    scales = (amax / torch.full_like(amax, limit)).clamp(min=MIN_SCALE)
    return (x / scales[:, None]).clamp(-limit, limit).to(FP8_DTYPE), scales


def supports_shape(out_features: int, in_features: int) -> bool:
    """Whether ``scaled_mm`` takes a weight of this shape (cuBLAS's FP8 GEMMs want widths of 16s)."""
    return out_features % 16 == 0 and in_features % 16 == 0


#: Most rows ``scaled_mm`` runs on the Triton kernel (``_weight_rows_kernel``); more go to cuBLAS
#: (``torch._scaled_mm``). At 8 and 64 rows of the Llama-3-8B and 1B matrices the Triton kernel at its
#: default tile took 0.60-0.93x cuBLAS's time (profiles/notes_fp8.md); above, prefill-sized products
#: are cuBLAS's ground.
TRITON_MAX_ROWS = 64


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, tile: RowsTile | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` on FP8 tensor cores, x quantised per row.

    x: [M, K] 16-bit or float32 on CUDA; weight: [N, K] float8_e4m3fn, contiguous; weight_scale: [N]
    float32; bias: None or [N]. Returns [M, N] in x's dtype. Up to ``TRITON_MAX_ROWS`` rows: one
    quantisation launch and the Triton kernel (``tile``: its tiling, default ``rows_tile``'s; Hopper's FP8
    accumulator, about 14 bits, is added into float32 registers every K slice); more rows:
    ``torch._scaled_mm`` with row-wise scales, written in bfloat16 (the one output type row-wise
    scaling takes) and converted when x is not bfloat16. No host sync: safe inside a CUDA graph.
    """
    _check_weight(x, weight, weight_scale)
    if not supports_shape(*weight.shape):
        raise ValueError(f"FP8 tensor-core products need widths that are multiples of 16, got {tuple(weight.shape)}")
    _check_bias(weight, bias)
    codes, scales = quantize_rows(x)
    if x.shape[0] <= TRITON_MAX_ROWS:
        return _rows_matmul(codes, scales, weight, weight_scale, bias, x.dtype, tile)
    out = torch._scaled_mm(codes, weight.t(), scale_a=scales[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


@triton.jit
def _weight_rows_kernel(
    x_ptr,  # [M, K] activations: FP8 codes (X_CODES), else 16-bit or float32
    x_scale_ptr,  # [M] float32 scales of the codes (read only with X_CODES)
    w_ptr,  # [N, K] float8_e4m3fn codes
    w_scale_ptr,  # [N] float32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    X_CODES: tl.constexpr,  # x is E4M3 codes: FP8 x FP8 products; else W8A16 (codes widened to float16)
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,  # products in float32 (float32 activations). Triton's CPU interpreter runs the
    # float16 and FP8 products exactly in float32, so CPU tests take the GPU's branches.
    EVEN: tl.constexpr,  # BLOCK_N divides N and BLOCK_K divides K: the weight loads need no mask
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Weight rows are the products' M side (the tensor cores' 64-row side), tokens the N side: a few
    # tokens fill an MMA that way, whereas on the M side they would be padded to 64.
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = (k + ks) < K
            w = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif X_CODES:
            # max_num_imprecise_acc: each slice's sum leaves the FP8 accumulator for float32 registers.
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            # W8A16 multiplies in float16: each pair of E4M3 codes widens to float16 in one instruction
            # (to bfloat16 in three); the activations are clamped to float16's largest value.
            x16 = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            acc += tl.dot(w.to(tl.float16), tl.trans(x16))
    acc = acc * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
    if X_CODES:
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
    tl.store(out_ptrs, round_to(acc, dtype), mask=row_ok[None, :] & col_ok[:, None])


@dataclass(frozen=True)
class RowsTile:
    """One ``_weight_rows_kernel`` launch's tiling: tokens, weight rows and K codes a program's slice,
    warps, and the slices Triton prefetches."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def rows_tile(rows: int, out_features: int, in_features: int) -> RowsTile:
    """The tile for ``rows`` tokens: up to 64 of them a program (padded to 16, the tensor cores'
    smallest multiple), 64 weight rows, K slices of 256 codes prefetched four deep, 4 warps: over the
    Llama-3-8B and 1B matrices at 8 and 64 rows the fastest of the tiles timed (profiles/notes_fp8.md)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_k = min(256, max(32, triton.next_power_of_2(in_features)))
    return RowsTile(block_m, 64, block_k, num_warps=4, num_stages=4)


def _rows_matmul(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, tile: RowsTile | None) -> torch.Tensor:
    """``_weight_rows_kernel`` on x [M, K] (FP8 codes with ``x_scale`` [M], or activations with None)."""
    if x.stride(-1) != 1:
        raise ValueError("x must have contiguous columns")
    rows, width = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    tile = tile or rows_tile(rows, *weight.shape)
    even = weight.shape[0] % tile.block_n == 0 and width % tile.block_k == 0
    dot_f32 = out_dtype == torch.float32
    grid = (triton.cdiv(weight.shape[0], tile.block_n), triton.cdiv(rows, tile.block_m))
    _weight_rows_kernel[grid](x, weight_scale if x_scale is None else x_scale, weight, weight_scale,
                              weight if bias is None else bias, out, rows, weight.shape[0], width, x.stride(0),
                              weight.stride(0), out.stride(0), X_CODES=x_scale is not None, HAS_BIAS=bias is not None,
                              DOT_F32=dot_f32, EVEN=even, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                              BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, tile: RowsTile | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` with the codes widened in registers (W8A16).

    x: [M, K] (columns contiguous) 16-bit or float32; weight: [N, K] float8_e4m3fn, contiguous;
    weight_scale: [N] float32; bias: None or [N] in x's dtype. Returns [M, N] in x's dtype, rounded
    once from the float32 sum. The tensor cores take codes and activations in float16: exact for every
    code, and for activations of magnitude 2**-14 to 65504 (every bfloat16 value in that range is a
    float16 one; smaller ones lose bits below 2**-24, larger ones are clamped to 65504). float32
    activations multiply in float32. Any M; built for a few rows (``rows_tile``). No host sync: safe
    inside a CUDA graph.
    """
    _check_weight(x, weight, weight_scale)
    _check_bias(weight, bias)
    return _rows_matmul(x, None, weight, weight_scale, bias, x.dtype, tile)


def _check_bias(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor, got {tuple(bias.shape)}")


def _check_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K] float8_e4m3fn tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {weight.shape[1]} input features")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}], got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
