"""FP8 tensor-core products for forwards of several tokens: W8A8, a scale per token and per weight row.

The GEMV kernels read a row's weights once per token (``graphrt.kernels.gemv``), so above one token an
FP8 model's linear layers run on the tensor cores instead: each token's activations are quantised to
E4M3 with a scale of their own (``quantize_rows``, one Triton launch: ``scale = amax / 448``, codes
rounded to nearest-even), then ``torch._scaled_mm`` multiplies codes by codes with row-wise scales,
accumulating in float32 (cuBLAS / CUTLASS on sm_89+). Quantising the activations adds an error the
W8A16 GEMV does not have: at most half an E4M3 step (2**-4 relative) on each input.

``scaled_mm`` needs both widths (in and out features) to be multiples of 16; ``supports_shape`` says
whether a weight qualifies, and layers that do not keep the dequantising path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.rounding import FP8_MAX_VALUE, round_to_e4m3

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
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K] float8_e4m3fn tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {weight.shape[1]} input features")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}], got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
    if not supports_shape(*weight.shape):
        raise ValueError(f"FP8 tensor-core products need widths that are multiples of 16, got {tuple(weight.shape)}")
    codes, scales = quantize_rows(x)
    out = torch._scaled_mm(codes, weight.t(), scale_a=scales[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)
