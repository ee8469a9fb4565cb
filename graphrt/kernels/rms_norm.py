"""RMSNorm, optionally preceded by the residual add, in one kernel (one program per row).

Unfused, ``residual = x + residual; out = weight * (r / rms(r))`` is about eight kernels (add, cast,
square, mean, add eps, rsqrt, multiply, cast, multiply by the weight); fused it reads ``x`` and
``residual`` once and writes ``residual`` and ``out`` once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.rounding import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N], updated in place to x + residual (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    stride_x,
    stride_residual,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
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
    normed = round_to(x * tl.math.rsqrt(variance + eps), out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(weight * normed, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` per row, or with ``residual``: ``residual += x`` in place, then its norm.

    x: [T, N] fp16/bf16/fp32, rows may be strided, columns contiguous; weight: [N] same dtype;
    residual: None or [T, N] same dtype, contiguous columns (overwritten with ``x + residual``).
    Returns ``out`` ([T, N] in x's dtype, contiguous; allocated when not given), or ``(out, residual)``
    when a residual is given.
    The launch depends on T and N only, and nothing else is allocated: safe inside a CUDA graph.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, N] with contiguous columns, got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous {tuple(x.shape)} {x.dtype}")
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, out,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), float(eps),
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual)

