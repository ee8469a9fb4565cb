"""RMSNorm, optionally preceded by the residual add, in one kernel (one program per row).

Unfused, ``residual = x + residual; out = weight * (r / rms(r))`` is about eight kernels (add, cast,
square, mean, add eps, rsqrt, multiply, cast, multiply by the weight); fused it reads ``x`` and
``residual`` once and writes ``residual`` and ``out`` once. With ``quantize`` it writes ``out`` as
E4M3 codes with a scale per row instead, the activations an FP8 x FP8 product takes (what
``fp8_matmul.quantize_rows`` would make of the 16-bit output, bit for bit, without its launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.fp8_matmul import QuantizedRows, quantized_rows_out, row_codes, row_scale
from graphrt.kernels.rounding import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N], updated in place to x + residual (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N] in x's dtype, or with QUANTIZE float8_e4m3fn codes
    scales_ptr,  # [T] float32 per-row scales of the codes (unused without QUANTIZE)
    stride_x,
    stride_residual,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the model dtype before normalising, as the unfused ``x + residual`` tensor is.
        summed = round_to(x + residual, residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / N
    # x * rsqrt(...), not x / sqrt(...): the unfused op's rounding (a division rounds differently).
    normed = round_to(x * tl.math.rsqrt(variance + eps), dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(weight * normed, dtype)
    if QUANTIZE:  # the 16-bit output's codes: masked columns are zeros and leave the maximum alone
        out = out.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(out), axis=0))
        tl.store(scales_ptr + row, scale)
        out = row_codes(out, scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    quantize: bool = False,
) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``weight * x / rms(x)`` per row, or with ``residual``: ``residual += x`` in place, then its norm.

    x: [T, N] fp16/bf16/fp32, rows may be strided, columns contiguous; weight: [N] same dtype;
    residual: None or [T, N] same dtype, contiguous columns (overwritten with ``x + residual``).
    Returns ``out`` ([T, N] in x's dtype, contiguous; allocated when not given), or ``(out, residual)``
    when a residual is given. ``quantize``: ``out`` is ``QuantizedRows`` instead (codes [T, N]
    float8_e4m3fn and float32 scales [T], allocated here; ``out`` cannot be given), equal to
    ``fp8_matmul.quantize_rows`` of the 16-bit result.
    The launch depends on T and N only: safe inside a CUDA graph.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, N] with contiguous columns, got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if quantize:
        if out is not None:
            raise ValueError("out cannot be given with quantize: the codes and scales are allocated here")
        result = quantized_rows_out(num_tokens, hidden, x.dtype, x.device)
        out, scales = result.codes, result.scales
    elif out is None:
        result = out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous {tuple(x.shape)} {x.dtype}")
    else:
        result = out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, out, scales if quantize else weight,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), float(eps),
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            num_warps=min(16, max(1, block // 256)),
        )
    return result if residual is None else (result, residual)

