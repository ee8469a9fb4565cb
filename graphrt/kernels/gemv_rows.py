"""Products of a few rows (2 to ``MAX_ROWS`` tokens: a verify step's rows, a small batch) with the GEMV
layers' fusions, on tensor cores.

The GEMV kernels (``graphrt.kernels.gemv``) compute each row in programs of its own, so every row
streams the layer's weights again: cheap for a row or two of a layer that fits L2, slower than cuBLAS
beyond. Here one program computes ``block_n`` outputs for every row at once, the rows padded to 16
(the tensor cores' narrow side; the weight rows take the wide one, as in ``fp8_matmul``'s rows
kernel), so each weight is read once, and it takes the same neighbours along as the GEMV kernels: the
RMSNorm prologue (each program recomputes its rows' scales: the rows are KBs against the weights'
MBs), and the SiLU * up and residual-add epilogues (``gemv.store_linear_output``).

Rounding follows the GEMV kernels and the unfused ops: the normalised rows are rounded to the model
dtype where ``rms_norm_torch`` rounds them, the products of 16-bit values are exact in the tensor
cores' float32 sums (in another order than the GEMV kernels' or cuBLAS's, so results may differ by
a last-place rounding), float32 models multiply in IEEE float32, and the epilogues round as the torch
ops do. Each row's result does not depend on how many rows share the launch beyond the padding to 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrt.base.checks import triton_interpreter_on
from graphrt.kernels import gemv
from graphrt.kernels.dependent_launch import launch_options
from graphrt.kernels.rounding import round_to

#: Most rows a launch takes: one tile of the tensor cores' narrow side.
MAX_ROWS = 16


@dataclass(frozen=True)
class RowsTileConfig:
    """One launch's tiling: weight rows a program (a multiple of 16), K elements a slice, warps, and the
    slices Triton prefetches."""

    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two of at least 16, got {value}")


@triton.jit
def rows_inv_rms(x_ptr, rows, row_ok, stride_x, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] float32 1 / rms of each row (padding rows: 1 / sqrt(eps), unused)."""
    ks = tl.arange(0, BLOCK_K)
    sum_squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + ks
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=row_ok[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        sum_squares += x * x
    return tl.math.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)


@triton.jit
def rows_products(x_ptr, w_ptr, norm_w_ptr, rows, row_ok, cols, paired_cols, col_ok, stride_x, stride_w, K, eps,
                  NORM: tl.constexpr, PAIRED: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """``W[cols] @ x[rows]^T`` and, with PAIRED, ``W[paired_cols] @ x[rows]^T``: float32 [BLOCK_N,
    BLOCK_M] each (the first again without PAIRED). With NORM the rows are RMS-normalised first with
    the norm weight at ``norm_w_ptr``, rounded to ``dtype`` as ``rms_norm_torch`` rounds them. Reads
    only what the step's kernels may have written after a dependent launch's wait: call it after."""
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    paired_rows = w_ptr + paired_cols.to(tl.int64)[:, None] * stride_w
    inv_rms = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:
        inv_rms = rows_inv_rms(x_ptr, rows, row_ok, stride_x, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    paired_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_cols = k + ks
        k_ok = k_cols < K
        x = tl.load(x_rows + k_cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            norm_w = tl.load(norm_w_ptr + k_cols, mask=k_ok, other=0.0).to(tl.float32)
            normed = round_to(x.to(tl.float32) * inv_rms[:, None], dtype).to(tl.float32)
            x = round_to(norm_w[None, :] * normed, dtype)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k_cols[None, :], mask=w_mask, other=0.0)
        acc = _accumulate(acc, w, x, DOT_F32)
        if PAIRED:
            paired_w = tl.load(paired_rows + k_cols[None, :], mask=w_mask, other=0.0)
            paired_acc = _accumulate(paired_acc, paired_w, x, DOT_F32)
    if not PAIRED:
        paired_acc = acc
    return acc, paired_acc


@triton.jit
def _accumulate(acc, w, x, DOT_F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K]^T in float32."""
    if DOT_F32:
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    return acc


@triton.jit
def _rows_linear_kernel(
    x_ptr,  # [M, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [N, K], or [2 * N, K] gate then up with SILU_MUL
    bias_ptr,  # [N] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    out_ptr,  # [M, N]; with ADD_TO_OUT read and updated in place
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    eps,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,  # gemv.EPILOGUE_*
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,  # float32 products (dot_in_float32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if HAS_BIAS:  # static: read before the wait
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    result, up = rows_products(x_ptr, w_ptr, norm_w_ptr, rows, row_ok, cols, cols + N, col_ok, stride_x, stride_w, K,
                               eps, NORM, EPILOGUE == 2, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, dtype)
    if HAS_BIAS:
        result += bias[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
    mask = col_ok[:, None] & row_ok[None, :]
    addend = result
    if EPILOGUE == 1:  # EPILOGUE_ADD_TO_OUT: the residual stream, read after the wait
        addend = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    gemv.store_linear_output(result, up, addend, out_ptrs, mask, EPILOGUE, dtype)


def dot_in_float32(x: torch.Tensor) -> bool:
    """Whether the kernels multiply in IEEE float32: for float32 models, and for bfloat16 ones under
    Triton's CPU interpreter, whose bfloat16 dot multiplies the raw bits (widened, each bfloat16
    product is exact in float32, as on the tensor cores, so the CPU runs the GPU's arithmetic)."""
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type != "cuda"
                                        and triton_interpreter_on())


def check_rows(rows: int) -> None:
    """ValueError unless ``rows`` fits one launch (``MAX_ROWS``)."""
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} rows exceed the few-row kernels' {MAX_ROWS}; use the GEMM path")


def linear_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    epilogue: int = gemv.EPILOGUE_STORE,
    out: torch.Tensor | None = None,
    config: RowsTileConfig | None = None,
    dependent_launch: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gemv.linear_gemv`` for up to ``MAX_ROWS`` rows, each weight read once for all of them: the same
    arguments, shapes and epilogues (``EPILOGUE_STORE``, ``EPILOGUE_SILU_MUL``, ``EPILOGUE_ADD_TO_OUT``),
    16-bit or float32 weights in x's dtype (FP8 weights: ``weight_scale`` is refused; their few-row
    kernels are ``fp8_matmul``'s). x: [M, K], M <= MAX_ROWS. ``config``: the tile (default
    ``RowsTileConfig()``). Nothing is allocated when ``out`` is given, and the launch depends on shapes
    only: safe inside a CUDA graph."""
    if weight_scale is not None or weight.dtype == gemv.FP8_WEIGHT_DTYPE:
        raise ValueError("the few-row kernels take 16-bit or float32 weights in x's dtype, not FP8 codes")
    rows, in_features, out_features, out = gemv.linear_operands(x, weight, bias, norm_weight, epilogue, out)
    check_rows(rows)
    if rows == 0:
        return out
    config = config or RowsTileConfig()
    block_k = min(config.block_k, max(16, triton.next_power_of_2(in_features)))
    _rows_linear_kernel[(gemv.grid_tiles(out_features, config.block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, out,
        rows, out_features, in_features, x.stride(0), weight.stride(0), out.stride(0), float(eps),
        NORM=norm_weight is not None, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        DOT_F32=dot_in_float32(x), BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(dependent_launch),
    )
    return out
