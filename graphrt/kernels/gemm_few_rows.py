"""Linear layers for decode batches of a few rows (2-16), on tensor cores, with the layer's neighbours fused in.

Between one row (``graphrt.kernels.gemv``) and a full batch, a decoder layer's GEMMs still stream their
weights once and do little arithmetic, but more than CUDA cores keep up with at eight rows. Here the
rows are padded to ``ROWS_PAD`` (16, the tensor cores' smallest tile) and the product runs transposed:
a program computes ``BLOCK_N`` outputs for every row as ``W[BLOCK_N, K] @ x^T[K, ROWS_PAD]``, so each
weight slice is read once for all rows, and Triton multi-buffers the weight loads that feed the
product (``num_stages`` slices in flight a program). The same prologue and epilogues as the GEMV:

* prologue ``NORM``: x is the residual stream, RMS-normalised first with the layer's norm weight;
* epilogue ``EPILOGUE_SILU_MUL``: the weight is gate then up ``[2 * I, K]``; writes ``silu(gate) * up``;
* epilogue ``EPILOGUE_ADD_TO_OUT``: the result is added into ``out`` in place (the residual stream).

Rounding follows the unfused ops (``graphrt.models.layers``) as the GEMV's does; the float32 sums run in
the tensor cores' order, so results differ from ``torch.nn.functional.linear`` by a last-place rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .dependent_launch import launch_options, wait_for_previous_kernel
from .gemv import EPILOGUE_ADD_TO_OUT, EPILOGUE_SILU_MUL, EPILOGUE_STORE, check_operands
from .rounding import round_to

#: Rows a launch takes at most: the padded tile of the product.
ROWS_PAD = 16


@dataclass(frozen=True)
class FewRowsTile:
    """Outputs a program computes, K slice, warps, and weight slices in flight a program."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: Until measured per shape: 32 outputs, K slices of 128, 4 warps, 4 slices in flight.
DEFAULT_TILE = FewRowsTile(32, 128, 4, 4)


@triton.jit
def _few_rows_kernel(
    x_ptr,  # [M, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [N, K], or [2 * N, K] gate then up with SILU_MUL
    bias_ptr,  # [N] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    out_ptr,  # [M, N]; with ADD_TO_OUT read and updated in place
    stride_x,
    stride_w,
    stride_out,
    eps,
    M,
    N,
    K,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,  # M padded (>= 16)
    DOT_F32: tl.constexpr,  # products in float32: fp32 models, and the CPU interpreter's 16-bit dots
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    wait_for_previous_kernel(PDL)
    dtype = out_ptr.dtype.element_ty
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    rows_m = tl.arange(0, ROWS)
    m_mask = rows_m < M
    k_offsets = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_x + k_offsets[None, :]  # [ROWS, BLOCK_K]
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w + k_offsets[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N.to(tl.int64) * stride_w  # SILU_MUL's up rows

    inv_rms = tl.full([ROWS], 1.0, tl.float32)
    if NORM:
        # 1 / rms of each row, recomputed by every program: the rows come from L2.
        sum_squares = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k, mask=m_mask[:, None] & (k + k_offsets < K)[None, :], other=0.0).to(tl.float32)
            sum_squares += x * x
        inv_rms = tl.math.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)

    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if EPILOGUE == 2:  # EPILOGUE_SILU_MUL: the up outputs too (acc_up exists only then)
        acc_up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = k + k_offsets < K
        w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # as rms_norm_torch rounds it: weight * (x * inv_rms).to(dtype), rounded to dtype
            norm_w = tl.load(norm_w_ptr + k + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
            x = round_to(norm_w[None, :] * round_to(x.to(tl.float32) * inv_rms[:, None], dtype).to(tl.float32),
                         dtype)
        if DOT_F32:
            x_t = tl.trans(x.to(tl.float32))
            acc = tl.dot(w.to(tl.float32), x_t, acc, input_precision="ieee")
            if EPILOGUE == 2:
                up_w = tl.load(up_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up = tl.dot(up_w.to(tl.float32), x_t, acc_up, input_precision="ieee")
        else:
            x_t = tl.trans(x.to(w.dtype))
            acc = tl.dot(w, x_t, acc)
            if EPILOGUE == 2:
                up_w = tl.load(up_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up = tl.dot(up_w, x_t, acc_up)

    result = acc  # [BLOCK_N, ROWS]: output n of row m at [n, m]
    if HAS_BIAS:
        result += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    result = round_to(result, dtype).to(tl.float32)  # the linear layer's output tensor
    out_ptrs = out_ptr + rows_m.to(tl.int64)[None, :] * stride_out + cols_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if EPILOGUE == 1:  # EPILOGUE_ADD_TO_OUT
        result += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    elif EPILOGUE == 2:  # EPILOGUE_SILU_MUL
        up = round_to(acc_up, dtype).to(tl.float32)
        result = round_to(result / (1.0 + tl.exp(-result)), dtype).to(tl.float32) * up
    tl.store(out_ptrs, round_to(result, dtype), mask=out_mask)


def linear_few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    epilogue: int = EPILOGUE_STORE,
    out: torch.Tensor | None = None,
    tile: FewRowsTile | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` for 1 to ``ROWS_PAD`` rows, optionally with RMSNorm before and SiLU *
    up or a residual add after, in one kernel; arguments, shapes and dtypes as
    ``graphrt.kernels.gemv.linear_gemv``'s. ``tile``: the launch's tiling (default ``DEFAULT_TILE``).
    Nothing is allocated when ``out`` is given, and the launch depends on shapes only: safe inside a
    CUDA graph."""
    if epilogue not in (EPILOGUE_STORE, EPILOGUE_ADD_TO_OUT, EPILOGUE_SILU_MUL):
        raise ValueError(f"unknown epilogue {epilogue!r}")
    rows, in_features = check_operands(x, weight, bias, norm_weight, paired_bias_free=epilogue == EPILOGUE_SILU_MUL)
    if rows > ROWS_PAD:
        raise ValueError(f"{rows} rows exceed the {ROWS_PAD} this kernel takes; use torch.nn.functional.linear")
    out_features = weight.shape[0] // 2 if epilogue == EPILOGUE_SILU_MUL else weight.shape[0]
    if out is None:
        if epilogue == EPILOGUE_ADD_TO_OUT:
            raise ValueError("the residual-add epilogue needs out, the tensor to add into")
        out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    elif out.shape != (rows, out_features) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{rows}, {out_features}] {x.dtype} with "
                         "contiguous columns")
    elif out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with x: programs would read x while others write out")
    if rows == 0:
        return out
    tile = tile or DEFAULT_TILE
    _few_rows_kernel[(triton.cdiv(out_features, tile.block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, out,
        x.stride(0), weight.stride(0), out.stride(0), float(eps), rows, out_features, in_features,
        NORM=norm_weight is not None, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ROWS=ROWS_PAD,
        DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(dependent_launch),
    )
    return out
