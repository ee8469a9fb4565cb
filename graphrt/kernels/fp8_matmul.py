"""Products of FP8 weights (E4M3 codes, a float32 scale per row) with several tokens' activations.

The GEMV kernels read a row's weights once per token (``graphrt.kernels.gemv``), so above one token an
FP8 model's linear layers run on the tensor cores, one of two ways:

* ``w8a16_matmul`` (a few rows, decode batches): one Triton kernel streams the codes once, widens them
  to the activations' 16-bit dtype in registers (exact: every E4M3 value is a bfloat16 / float16 one),
  multiplies on the tensor cores with float32 accumulation and scales each output column once. The
  activations are not quantised, so the result is the one the dequantised weights give.
* ``scaled_mm`` (many rows, prefill): each token's activations are quantised to E4M3 with a scale of
  their own (``quantize_rows``, one Triton launch: ``scale = amax / 448``, codes rounded to
  nearest-even), then ``torch._scaled_mm`` multiplies codes by codes with row-wise scales (cuBLAS /
  CUTLASS on sm_89+, twice the 16-bit tensor-core rate). Quantising the activations adds an error the
  W8A16 paths do not have: at most half an E4M3 step (2**-4 relative) on each input. It needs both
  widths to be multiples of 16 (``supports_shape``).

Which one a forward takes is the kernel policy's (``graphrt.models.kernel_policy``).
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
    scales = (x.abs().amax(dim=1) / float(torch.finfo(FP8_DTYPE).max)).clamp(min=MIN_SCALE)
    limit = float(torch.finfo(FP8_DTYPE).max)
    return (x / scales[:, None]).clamp(-limit, limit).to(FP8_DTYPE), scales


def supports_shape(out_features: int, in_features: int) -> bool:
    """Whether ``scaled_mm`` takes a weight of this shape (cuBLAS's FP8 GEMMs want widths of 16s)."""
    return out_features % 16 == 0 and in_features % 16 == 0


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` on FP8 tensor cores, x quantised per row.

    x: [M, K] 16-bit or float32 on CUDA; weight: [N, K] float8_e4m3fn, contiguous; weight_scale: [N]
    float32; bias: None or [N]. Returns [M, N] in x's dtype (the product is written in bfloat16, the
    one output type row-wise scaling takes, then converted when x is not bfloat16).
    """
    _check_weight(x, weight, weight_scale)
    if not supports_shape(*weight.shape):
        raise ValueError(f"FP8 tensor-core products need widths that are multiples of 16, got {tuple(weight.shape)}")
    codes, scales = quantize_rows(x)
    out = torch._scaled_mm(codes, weight.t(), scale_a=scales[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K] activations, 16-bit (float32 with DOT_F32)
    w_ptr,  # [N, K] float8_e4m3fn codes
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,  # products in float32 (float32 activations, or the CPU interpreter's bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, round_to(acc, dtype), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class W8A16Tile:
    """One ``w8a16_matmul`` launch's tiling."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: Programs to aim for: two for each SM of a 132-SM GPU, so every SM holds work.
_TARGET_PROGRAMS = 264


def w8a16_tile(rows: int, out_features: int, in_features: int) -> W8A16Tile:
    """The tile for ``rows`` tokens: every row in one program column (rows padded to 16, the tensor
    cores' smallest), output columns a program as wide as keeps ``_TARGET_PROGRAMS`` programs, K slices
    of 256 codes, prefetched four deep (Triton pipelines the loads)."""
    block_m = max(16, triton.next_power_of_2(rows)) if rows <= 64 else 64
    block_n = 128
    while block_n > 16 and triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m) < _TARGET_PROGRAMS:
        block_n //= 2
    block_k = min(256, max(16, triton.next_power_of_2(in_features)))
    return W8A16Tile(block_m, block_n, block_k, num_warps=4, num_stages=4)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, tile: W8A16Tile | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` with the codes widened in registers (W8A16).

    x: [M, K] (columns contiguous) 16-bit or float32; weight: [N, K] float8_e4m3fn, contiguous;
    weight_scale: [N] float32; bias: None or [N] in x's dtype. Returns [M, N] in x's dtype, rounded
    once from the float32 sum. Any M; built for a few rows (``w8a16_tile``). No host sync: safe
    inside a CUDA graph.
    """
    _check_weight(x, weight, weight_scale)
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor, got {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must have contiguous columns")
    rows, width = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tile = tile or w8a16_tile(rows, *weight.shape)
    dot_f32 = x.dtype == torch.float32 or x.device.type == "cpu"
    grid = (triton.cdiv(weight.shape[0], tile.block_n), triton.cdiv(rows, tile.block_m))
    _w8a16_kernel[grid](x, weight, weight_scale, weight if bias is None else bias, out, rows, weight.shape[0],
                        width, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                        DOT_F32=dot_f32, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def _check_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K] float8_e4m3fn tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {weight.shape[1]} input features")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}], got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
