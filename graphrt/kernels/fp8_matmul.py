"""Products of FP8 weights (E4M3 codes, a float32 scale per row) with several tokens' activations, and
the same rows kernel on 16-bit (or float32) weights (``rows_matmul``).

The GEMV kernels read a row's weights once per token (``graphrt.kernels.gemv``), so above one token an
FP8 model's linear layers run on the tensor cores, one of two ways:

* ``w8a16_matmul``: one Triton kernel streams the codes once, widens them in registers (exact: every
  E4M3 value is a float16 one), multiplies on the tensor cores with float32 accumulation and scales
  each output column once. The activations are not quantised: the result is the one the dequantised
  weights give (up to the activations' float16 range, see its docstring).
* ``scaled_mm``: each token's activations are quantised to E4M3 with a scale of their own
  (``quantize_rows``, one Triton launch: ``scale = amax / 448``, codes rounded to nearest-even; or
  already by the kernel that produced them, which hands over ``QuantizedRows``), then
  codes multiply codes on FP8 tensor cores (twice the 16-bit rate, no widening), with row-wise scales:
  for up to ``TRITON_MAX_ROWS`` rows the same Triton kernel, above it ``torch._scaled_mm`` (cuBLAS /
  CUTLASS, sm_89+). Quantising the activations adds an error the W8A16 path does not have: at most
  half an E4M3 step (2**-4 relative) on each input. It needs both widths to be multiples of 16
  (``supports_shape``).

The Triton kernel puts the weight rows on the tensor cores' 64-row side and the tokens on the narrow
side, so 2-64 tokens fill an MMA without padding to 64; where a matrix has too few output tiles to fill
the GPU it splits K over several programs, the last to finish adding their partial sums (``rows_tile``).
Up to 16 tokens, on sm_90 and later, it reads the weight slices through TMA (bulk copies into shared
memory) rather than with every thread's loads (``ROWS_TMA``). ``rows_matmul`` runs the same kernel on
16-bit weights (no codes, no scales: slices of the same bytes, half the elements), where cuBLAS would pad
a few tokens to its own tiles (``graphrt.models.layers.FewRowsLinear``).
Which path a forward takes is the kernel policy's (``graphrt.models.kernel_policy``, with
``w8a16_is_faster``).

``ROWS_DEPENDENT_LAUNCH`` (off: it did not make the captured step faster, profiles/notes_fp8.md)
launches the rows kernel as a programmatic dependent of the kernel before it
(``graphrt.kernels.dependent_launch``: its programs start during that kernel's tail and wait before they
read its output).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from graphrt.base.checks import triton_interpreter_on
from graphrt.kernels.dependent_launch import launch_options
from graphrt.kernels.device import multiprocessors
from graphrt.kernels.gemv import check_norm_weight, store_linear_output
from graphrt.kernels.gemv_rows import rows_inv_rms
from graphrt.kernels.rounding import FP8_MAX_VALUE, round_to, round_to_e4m3

FP8_DTYPE = torch.float8_e4m3fn

#: Smallest activation scale: a row of zeros gets it (its codes are zeros) instead of dividing by 0.
MIN_SCALE = 1e-12
_MIN_SCALE_VALUE: tl.constexpr = tl.constexpr(MIN_SCALE)

#: Row elements one load of ``_quantize_rows_kernel`` takes.
_BLOCK = 1024


class QuantizedRows(NamedTuple):
    """Activations quantised per row, as ``quantize_rows`` (or a producer kernel that quantises its own
    output: ``rms_norm``, ``silu_and_mul``) writes them: codes [M, K] float8_e4m3fn, scales [M] float32
    (``x[m] ~ codes[m] * scales[m]``), and dtype, the activations' own dtype (the product's output
    dtype). ``scaled_mm`` takes them in place of x."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


@triton.jit
def row_scale(amax):
    """A row's activation scale from its largest magnitude (float32): ``max(amax / 448, MIN_SCALE)``,
    correctly rounded as torch divides, so codes equal ``quantize_rows_torch``'s bit for bit."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX_VALUE), _MIN_SCALE_VALUE)


@triton.jit
def row_codes(x, scale):
    """float32 values -> their E4M3 codes under ``scale`` (still float32, exact in the final cast)."""
    return round_to_e4m3(tl.math.div_rn(x, scale))


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] activations (16-bit or float32)
    codes_ptr,  # [M, K] float8_e4m3fn out
    scales_ptr,  # [M] float32 out
    stride_x,
    stride_codes,
    K,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + offsets, mask=k + offsets < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0))
    tl.store(scales_ptr + row, scale)
    for k in range(0, K, BLOCK):  # the row again, from L1/L2
        cols = k + offsets
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(codes_ptr + row * stride_codes + cols, row_codes(x, scale).to(codes_ptr.dtype.element_ty),
                 mask=cols < K)


def quantized_rows_out(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> QuantizedRows:
    """Uninitialised codes [rows, width] and scales [rows] for a kernel that quantises its output."""
    return QuantizedRows(torch.empty((rows, width), dtype=FP8_DTYPE, device=device),
                         torch.empty(rows, dtype=torch.float32, device=device), dtype)


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
    if not width:  # nothing to scale: every row gets the smallest scale, as a row of zeros does
        return codes, scales.fill_(MIN_SCALE)
    if rows:
        _quantize_rows_kernel[(rows,)](x, codes, scales, x.stride(0), codes.stride(0), width,
                                       BLOCK=min(_BLOCK, triton.next_power_of_2(width)))
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


#: Whether the decoder's FP8 layers launch the rows kernel as a programmatic dependent (where the model
#: launches its kernels so) by default.
ROWS_DEPENDENT_LAUNCH = False
#: Whether ``rows_tile`` has tiles of up to 16 tokens read their weight slices through the tensor memory
#: accelerator (TMA: one bulk copy a slice into shared memory, sm_90 and later) where the device has one,
#: rather than with every thread's loads: the copies keep the slices in flight without the threads'
#: registers, which made the captured decode step faster at 8 and 16 tokens; 64-token tiles keep the
#: threads' loads, which were as fast there (profiles/notes_fp8.md has the measurements).
ROWS_TMA = True

#: Most rows ``scaled_mm`` runs on the Triton kernel (``_weight_rows_kernel``); more go to cuBLAS
#: (``torch._scaled_mm``). At 8 and 64 rows of the Llama-3-8B and 1B matrices the Triton kernel at its
#: default tile took 0.60-0.93x cuBLAS's time (profiles/notes_fp8.md); above, prefill-sized products
#: are cuBLAS's ground.
TRITON_MAX_ROWS = 64


def scaled_mm(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, tile: RowsTile | None = None, *,
              dependent_launch: bool = False, silu_mul: bool = False) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` on FP8 tensor cores, x quantised per row.

    x: [M, K] 16-bit or float32 on CUDA, or ``QuantizedRows`` its producer already quantised (then no
    quantisation launch here); weight: [N, K] float8_e4m3fn, contiguous; weight_scale: [N] float32;
    bias: None or [N]. Returns [M, N] in x's dtype. Up to ``TRITON_MAX_ROWS`` rows: one
    quantisation launch and the Triton kernel (``tile``: its tiling, default ``rows_tile``'s; Hopper's FP8
    accumulator, about 14 bits, is added into float32 registers every K slice); more rows:
    ``torch._scaled_mm`` with row-wise scales, written in bfloat16 (the one output type row-wise
    scaling takes) and converted when x is not bfloat16. No host sync: safe inside a CUDA graph.
    ``dependent_launch``: the Triton kernel launched as a programmatic dependent (the module docstring).
    ``silu_mul`` (up to ``TRITON_MAX_ROWS`` rows): weight is [2 * I, K], gate rows then up rows, and the
    result [M, I] is ``silu(gate) * up`` (rounded as ``silu_and_mul`` of the product rounds it), written
    by the product's own epilogue.
    """
    quantized = isinstance(x, QuantizedRows)
    if quantized:
        check_quantized_rows(x)
    _check_weight(x.codes if quantized else x, weight, weight_scale)
    if not supports_shape(*weight.shape):
        raise ValueError(f"FP8 tensor-core products need widths that are multiples of 16, got {tuple(weight.shape)}")
    check_bias(weight, bias)
    if silu_mul and x.shape[0] > TRITON_MAX_ROWS:
        raise ValueError(f"silu_mul takes at most {TRITON_MAX_ROWS} rows (the Triton kernel's), got {x.shape[0]}")
    codes, scales = (x.codes, x.scales) if quantized else quantize_rows(x)
    if codes.shape[0] <= TRITON_MAX_ROWS:
        return _rows_matmul(codes, scales, weight, weight_scale, bias, x.dtype, tile, dependent_launch, silu_mul)
    out = torch._scaled_mm(codes, weight.t(), scale_a=scales[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


@triton.jit
def _weight_rows_kernel(
    x_ptr,  # [M, K] activations: FP8 codes (X_CODES), else 16-bit or float32
    x_scale_ptr,  # [M] float32 scales of the codes (read only with X_CODES)
    w_ptr,  # [N, K] weights (E4M3 codes with W_CODES); [2 * N, K] with SILU_MUL: gate rows, then up rows
    w_desc,  # with TMA: a tensor descriptor of w_ptr's rows in [BLOCK_N, BLOCK_K] boxes (else unused)
    w_scale_ptr,  # [N] float32 ([2 * N] with SILU_MUL; read only with W_CODES)
    bias_ptr,  # [N] ([2 * N] with SILU_MUL; unused without HAS_BIAS)
    out_ptr,  # [M, N]
    partials_ptr,  # [SPLIT_K, tiles, BLOCK_N, BLOCK_M] float32, twice with SILU_MUL (unused when SPLIT_K == 1)
    arrivals_ptr,  # [tiles] int32, zero on entry (unused when SPLIT_K == 1)
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    slices_per_split,  # BLOCK_K slices of K each split takes (the last may take fewer)
    norm_w_ptr,  # [K] RMSNorm weight (read only with NORM)
    eps,
    X_CODES: tl.constexpr,  # x is E4M3 codes: FP8 x FP8 products; else W8A16 (codes widened to float16)
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,  # products in float32 (float32 activations). Triton's CPU interpreter runs the
    # float16 and FP8 products exactly in float32, so CPU tests take the GPU's branches.
    EVEN: tl.constexpr,  # BLOCK_N divides N and BLOCK_K divides K: the weight loads need no mask
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each summing its own range of K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
    TMA: tl.constexpr = False,  # the weight slices come through the tensor memory accelerator (w_desc)
    W_CODES: tl.constexpr = True,  # w holds E4M3 codes scaled per row; else 16-bit weights in x's dtype
    SILU_MUL: tl.constexpr = False,  # out = silu(x @ gate^T) * (x @ up^T), gate and up rows N apart
    NORM: tl.constexpr = False,  # x (16-bit or float32) is RMS-normalised first (rows_tile_sums)
    ADD_TO_OUT: tl.constexpr = False,  # out (the residual stream) += the product, in place
):
    # Weight rows are the products' M side (the tensor cores' 64-row side), tokens the N side: a few
    # tokens fill an MMA that way, whereas on the M side they would be padded to 64.
    dtype = out_ptr.dtype.element_ty
    first_col = tl.program_id(0) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, col_ok = rows < M, cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # x (a kernel of the step wrote it), the split scratch and the output only after the kernel before
        # has finished: a launch that started early never meets the one before it on the scratch.
        tl.extra.cuda.gdc_wait()
    acc, up_acc = rows_tile_sums(x_ptr, w_ptr, w_desc, first_col, N, rows, row_ok, col_ok, K, stride_x, stride_w,
                                 slices_per_split, SILU_MUL, X_CODES, DOT_F32, EVEN, TMA, W_CODES, BLOCK_M, BLOCK_N,
                                 BLOCK_K, norm_w_ptr, eps, NORM)
    last, acc, up_acc = gather_split_sums(acc, up_acc, partials_ptr, arrivals_ptr, SILU_MUL, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
        _store_rows_tile(acc, up_acc, cols, rows, col_ok, row_ok, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
                         stride_out, dtype, X_CODES, HAS_BIAS, W_CODES, SILU_MUL, ADD_TO_OUT)


@triton.jit
def rows_tile_sums(x_ptr, w_ptr, w_desc, first_col, pair_offset, rows, row_ok, col_ok, K, stride_x, stride_w,
                   slices_per_split, PAIRED: tl.constexpr, X_CODES: tl.constexpr, DOT_F32: tl.constexpr,
                   EVEN: tl.constexpr, TMA: tl.constexpr, W_CODES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, norm_w_ptr, eps, NORM: tl.constexpr):
    """One program's float32 sums [BLOCK_N weight rows, BLOCK_M tokens] over its split's range of K (split
    ``program_id(2)``, ``slices_per_split`` slices of BLOCK_K): weight rows ``first_col`` on, and with PAIRED
    a second tile of the rows ``pair_offset`` further (else the second result is zeros). Flags as
    ``_weight_rows_kernel``'s; with TMA ``w_desc`` boxes are [BLOCK_N, BLOCK_K]. With NORM (16-bit or
    float32 x, not codes) the rows are RMS-normalised first with the norm weight at ``norm_w_ptr`` and
    ``eps``, rounded as ``rms_norm_torch`` rounds them: each program reads its rows whole once for their
    scales before its loop, from L2. That read is all of K for the program's tokens where a split reads
    K / SPLIT_K of its weight rows (16 tokens at SPLIT_K 4: as many bytes as the weights), a cost the split
    rule does not weigh. Reads x: after a dependent launch's wait."""
    cols = first_col + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    # Row indices, not a row offset times the stride: a size of 1 arrives as a constant, not a tensor.
    paired_ptrs = w_ptr + (cols + pair_offset).to(tl.int64)[:, None] * stride_w + ks[None, :]  # with PAIRED
    k_begin = tl.program_id(2) * slices_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + slices_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    paired_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if NORM:
        inv_rms = rows_inv_rms(x_ptr, rows, row_ok, stride_x, K, eps, BLOCK_M, BLOCK_K)
    for k in range(k_begin, k_end, BLOCK_K):
        k_ok = (k + ks) < K  # read only where BLOCK_K does not divide K
        w_mask = col_ok[:, None] & k_ok[None, :]
        if TMA:
            # One bulk copy a slice into shared memory, rows and columns past the matrix filled with zeros:
            # no register holds an address or a code on the way to the tensor cores. A box's rows past the
            # program's (col_ok) may be other rows of the matrix: multiplied, never stored.
            w = w_desc.load([first_col, k])
            if PAIRED:
                paired = w_desc.load([first_col + pair_offset, k])
        elif EVEN:
            w = tl.load(w_ptrs + k)
            if PAIRED:
                paired = tl.load(paired_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=w_mask, other=0.0)
            if PAIRED:
                paired = tl.load(paired_ptrs + k, mask=w_mask, other=0.0)
        if EVEN:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            norm_w = tl.load(norm_w_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
            normed = round_to(x.to(tl.float32) * inv_rms[:, None], x.dtype).to(tl.float32)
            x = round_to(norm_w[None, :] * normed, x.dtype)
        acc = _slice_products(acc, w, x, X_CODES, DOT_F32, W_CODES, BLOCK_K)
        if PAIRED:
            paired_acc = _slice_products(paired_acc, paired, x, X_CODES, DOT_F32, W_CODES, BLOCK_K)
    return acc, paired_acc


@triton.jit
def gather_split_sums(acc, paired_acc, partials_ptr, arrivals_ptr, PAIRED: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(last, sums, paired sums) of a program's output tile: with one split its own sums, last true; split,
    every split leaves its partial sums and counts itself in, and the last to arrive (last true) gets the
    sums of all of them in split order (the same sum whichever arrives last) and resets the count for the
    next launch. The tile is (program_id(0), program_id(1)); the scratch holds [SPLIT_K, tiles, BLOCK_N,
    BLOCK_M] float32, twice with PAIRED."""
    # Static branches, not an early return: some Triton versions compile the statements after a static
    # return too, and the unsplit launch passes placeholders that the atomics below cannot take.
    if SPLIT_K == 1:
        last, total, paired_total = True, acc, paired_acc
    else:
        # One thread performs the scalar atomic: the barrier orders every thread's partial stores before its
        # release; its acquire orders the loads below after the other splits' stores.
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tile_elems = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_stride = (tl.num_programs(0) * tl.num_programs(1) * BLOCK_N * BLOCK_M).to(tl.int64)
        tile_base = partials_ptr + tile.to(tl.int64) * BLOCK_N * BLOCK_M + tile_elems
        paired_base = tile_base + SPLIT_K * tile_stride  # the paired sums after every split's first ones
        tl.store(tile_base + tl.program_id(2) * tile_stride, acc)
        if PAIRED:
            tl.store(paired_base + tl.program_id(2) * tile_stride, paired_acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        paired_total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if last:
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")
            for split in tl.static_range(SPLIT_K):
                total += tl.load(tile_base + split * tile_stride, cache_modifier=".cg")
                if PAIRED:
                    paired_total += tl.load(paired_base + split * tile_stride, cache_modifier=".cg")
    return last, total, paired_total


@triton.jit
def _slice_products(acc, w, x, X_CODES: tl.constexpr, DOT_F32: tl.constexpr, W_CODES: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] float32 + w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K]^T, as the operands'
    types multiply (``_weight_rows_kernel``'s flags)."""
    if DOT_F32:
        acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    elif not W_CODES:
        acc += tl.dot(w, tl.trans(x))  # 16-bit weights and activations, float32 sums
    elif X_CODES:
        # max_num_imprecise_acc: each slice's sum leaves the FP8 accumulator for float32 registers.
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
    else:
        # W8A16 multiplies in float16: each pair of E4M3 codes widens to float16 in one instruction
        # (to bfloat16 in three); the activations are clamped to float16's largest value.
        x16 = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        acc += tl.dot(w.to(tl.float16), tl.trans(x16))
    return acc


@triton.jit
def scaled_sums(acc, weight_rows, col_ok, rows, row_ok, x_scale_ptr, w_scale_ptr, bias_ptr, X_CODES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, W_CODES: tl.constexpr):
    """A tile's float32 sums [BLOCK_N weight rows, BLOCK_M tokens] times their weight rows' scales (with
    W_CODES) and their tokens' (with X_CODES), plus the rows' bias."""
    if W_CODES:
        acc = acc * tl.load(w_scale_ptr + weight_rows, mask=col_ok, other=0.0)[:, None]
    if X_CODES:
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + weight_rows, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _store_rows_tile(acc, up_acc, cols, rows, col_ok, row_ok, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
                     stride_out, dtype: tl.constexpr, X_CODES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     W_CODES: tl.constexpr, SILU_MUL: tl.constexpr, ADD_TO_OUT: tl.constexpr = False):
    """Scales and biases a tile's float32 sums (``scaled_sums``), rounds them once to ``dtype`` and stores
    them transposed into ``out``; with SILU_MUL ``acc`` holds the gate rows' sums and ``up_acc`` the up
    rows' (N further), and ``silu(gate) * up`` is stored, rounded as the unfused ops round it; with
    ADD_TO_OUT the rounded product is added to out's values (the residual stream) as a torch add rounds."""
    result = scaled_sums(acc, cols, col_ok, rows, row_ok, x_scale_ptr, w_scale_ptr, bias_ptr, X_CODES, HAS_BIAS,
                          W_CODES)
    up = result
    if SILU_MUL:
        up = scaled_sums(up_acc, cols + N, col_ok, rows, row_ok, x_scale_ptr, w_scale_ptr, bias_ptr, X_CODES,
                          HAS_BIAS, W_CODES)
    out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
    mask = row_ok[None, :] & col_ok[:, None]
    addend = result
    if ADD_TO_OUT:
        addend = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    # gemv.EPILOGUE_SILU_MUL (2), EPILOGUE_ADD_TO_OUT (1) or EPILOGUE_STORE (0): Triton reads no plain global
    # in a kernel.
    store_linear_output(result, up, addend, out_ptrs, mask, 2 if SILU_MUL else 1 if ADD_TO_OUT else 0, dtype)


@dataclass(frozen=True)
class RowsTile:
    """One ``_weight_rows_kernel`` launch's tiling: tokens, weight rows and K codes a program's slice,
    warps, the slices Triton prefetches, and the programs that share each output tile (split-K: each
    sums its own range of K; the last to finish adds the partial sums)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    tma: bool = False  # weight slices through TMA, where the device and the weight allow (``reads_through_tma``)

    def __post_init__(self) -> None:
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"split_k must be 1 to {MAX_SPLIT_K}, got {self.split_k}")


#: Most programs one output tile is split over, and the fewest K slices each split keeps.
MAX_SPLIT_K = 4
MIN_SLICES_PER_SPLIT = 2
#: Programs a launch is split up to, per multiprocessor, with 16-token tiles (two fit an SM's shared
#: memory); one with larger token tiles (more splits measured slower there). The matrices with few output
#: rows (the 8B's QKV, O and down at 64-96 tiles, the 1B's at 32-48) otherwise leave most multiprocessors
#: of a large GPU idle (profiles/notes_fp8.md).
SPLIT_PROGRAMS_PER_SM = 2

def rows_tile(rows: int, out_features: int, in_features: int, multiprocessors: int, tma: bool = False,
              element_size: int = 1) -> RowsTile:
    """The tile for ``rows`` tokens: up to 64 of them a program (padded to 16, the tensor cores'
    smallest multiple), 64 weight rows, K slices of 256 codes prefetched four deep (128 six deep for
    unsplit 64-token tiles), 4 warps: over the Llama-3-8B and 1B matrices at 8 and 64 rows the fastest
    of the tiles timed (profiles/notes_fp8.md).
    Where those programs number fewer than ``SPLIT_PROGRAMS_PER_SM`` an SM (one with more than 16 tokens
    a tile), K is split to come closer (at most ``MAX_SPLIT_K`` ways, each split keeping
    ``MIN_SLICES_PER_SPLIT`` slices). ``tma``: the device reads through TMA (``tma_available``); tiles of 16
    tokens then do where ``ROWS_TMA`` says so. ``element_size``: the weight's bytes an element (16-bit
    weights: K slices of the same bytes, half the codes). Host values only: safe before capture."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_k = min(256 // element_size, max(32, triton.next_power_of_2(in_features)))
    block_n = 64
    tiles = max(1, triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m))
    wanted = (SPLIT_PROGRAMS_PER_SM if block_m == 16 else 1) * multiprocessors // tiles
    split_k = max(1, min(MAX_SPLIT_K, wanted, triton.cdiv(in_features, block_k) // MIN_SLICES_PER_SPLIT))
    if block_m == 64 and split_k == 1 and block_k * element_size > 128:
        # Unsplit 64-token tiles (the many-tile matrices: gate/up) ran faster on 128-code slices six deep.
        return RowsTile(block_m, block_n, 128 // element_size, num_warps=4, num_stages=6)
    return RowsTile(block_m, block_n, block_k, num_warps=4, num_stages=4, split_k=split_k,
                    tma=tma and ROWS_TMA and block_m == 16)


def w8a16_is_faster(tile: RowsTile) -> bool:
    """Whether a product of 2-16 tokens (``kernel_policy.GemvThresholds.w8a16_max_tokens``) whose
    ``rows_tile`` is ``tile`` runs faster on the W8A16 kernel than on FP8 tensor cores: where that tile
    splits K the most ways (the matrices of fewest output rows). Splitting helped the W8A16 kernel far
    more than the FP8 x FP8 one, which also pays a quantisation launch; where K is split less or not at
    all the FP8 kernel was as fast or faster (the Llama-3-8B and 1B matrices at 2, 8 and 16 rows,
    profiles/notes_fp8.md, which names the GPUs measured; others take the same rule unmeasured). Through
    TMA too: W8A16 on every matrix measured slower in the step than this rule (the producers before QKV
    and gate/up quantise their outputs for free, which a matrix timed alone does not show)."""
    return tile.split_k == MAX_SPLIT_K


def tma_available(device: torch.device) -> bool:
    """Whether the rows kernel can read through TMA on ``device``: an NVIDIA GPU of compute capability 9.0
    or later, or Triton's interpreter (which runs the descriptor loads on the CPU, so CPU tests take the
    branch)."""
    if triton_interpreter_on():
        return True
    return device.type == "cuda" and _cuda_has_tma(device.index if device.index is not None
                                                   else torch.cuda.current_device())


@functools.cache
def _cuda_has_tma(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


#: Split-K scratch per device: float32 partial sums and int32 arrival counts (zero between launches:
#: the last split of each tile resets its count). Fixed sizes, allocated on a device's first split launch
#: and never freed or moved, so captured graphs keep valid addresses; ``rows_tile``'s splits need at most
#: ``SPLIT_PROGRAMS_PER_SM * multiprocessors`` tiles of 64 x 64, twice the sums for a paired product (SiLU * up,
#: the QKV halves of ``attention/triton_qkv_rows.py``). One scratch for the device: split
#: launches must not run concurrently on it (graphrt runs its forwards and graph replays on one stream,
#: so each launch ends before the next; one launched as a programmatic dependent starts early but touches
#: the scratch only after its wait, when the launch before it has ended).
PARTIAL_CAPACITY = 1 << 22
ARRIVAL_CAPACITY = 1 << 13
_split_scratch: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device: torch.device, partials: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [PARTIAL_CAPACITY] float32, arrivals [ARRIVAL_CAPACITY] int32) of ``device``."""
    key = (device.type, device.index if device.index is not None or device.type != "cuda"
           else torch.cuda.current_device())
    held = _split_scratch.get(key)
    sums_room = min(PARTIAL_CAPACITY, held[0].numel()) if held else PARTIAL_CAPACITY
    tiles_room = min(ARRIVAL_CAPACITY, held[1].numel()) if held else ARRIVAL_CAPACITY
    if partials > sums_room or tiles > tiles_room:
        raise ValueError(f"a split-K launch of {tiles} tiles and {partials} partial sums exceeds the scratch "
                         f"({tiles_room} tiles, {sums_room} sums): use fewer splits or larger tiles")
    if held is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K scratch is allocated on a device's first split launch, which must "
                               "run outside CUDA-graph capture: run the product once before capturing")
        _split_scratch[key] = (torch.empty(PARTIAL_CAPACITY, dtype=torch.float32, device=device),
                               torch.zeros(ARRIVAL_CAPACITY, dtype=torch.int32, device=device))
    return _split_scratch[key]


def _rows_matmul(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, tile: RowsTile | None,
                 dependent_launch: bool = False, silu_mul: bool = False, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``_weight_rows_kernel`` on x [M, K] (FP8 codes with ``x_scale`` [M], or activations with None) and
    FP8 weight codes with ``weight_scale``, or (None) 16-bit weights in x's dtype; ``dependent_launch``: as
    ``scaled_mm``'s. ``silu_mul``: the weight is gate rows then up rows, and the result [M, N / 2] is
    ``silu(gate) * up``. ``norm_weight`` ([K], x's dtype; activations only): x is RMS-normalised first
    (``eps``). ``residual`` ([M, N], ``out_dtype``): the product is added into it in place, and it is
    returned."""
    if x.stride(-1) != 1:
        raise ValueError("x must have contiguous columns")
    rows, width = x.shape
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"a SiLU * up product needs gate and up rows alike, got {weight.shape[0]} rows")
    out_features = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    check_norm_and_residual(x, x_scale, norm_weight, residual, silu_mul, (rows, out_features), out_dtype)
    out = residual if residual is not None else torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if width == 0:  # an empty sum: the bias alone (then SiLU * up of it)
        sums = bias.to(out_dtype).expand(rows, weight.shape[0]) if bias is not None else \
            torch.zeros((rows, weight.shape[0]), dtype=out_dtype, device=x.device)
        if silu_mul:
            sums = torch.nn.functional.silu(sums[:, :out_features]) * sums[:, out_features:]
        return out.add_(sums) if residual is not None else out.copy_(sums)
    tile = tile or rows_tile(rows, out_features, width, multiprocessors(x.device), tma_available(x.device),
                             weight.element_size())
    col_tiles, row_tiles = triton.cdiv(out_features, tile.block_n), triton.cdiv(rows, tile.block_m)
    launch = rows_launch(weight, weight_scale, tile, out, col_tiles, row_tiles, paired=silu_mul)
    _weight_rows_kernel[(col_tiles, row_tiles, launch.split_k)](
        x, launch.w_scales if x_scale is None else x_scale, weight, launch.w_desc, launch.w_scales,
        weight if bias is None else bias, out,
        launch.partials, launch.arrivals, rows, out_features, width, x.stride(0), weight.stride(0), out.stride(0),
        launch.slices_per_split, weight if norm_weight is None else norm_weight, float(eps),
        X_CODES=x_scale is not None, HAS_BIAS=bias is not None, DOT_F32=launch.dot_f32,
        EVEN=out_features % tile.block_n == 0 and width % tile.block_k == 0, SPLIT_K=launch.split_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, TMA=launch.tma,
        W_CODES=weight_scale is not None, SILU_MUL=silu_mul, NORM=norm_weight is not None,
        ADD_TO_OUT=residual is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **launch_options(dependent_launch))
    return out


def check_norm_and_residual(x: torch.Tensor, x_scale: torch.Tensor | None, norm_weight: torch.Tensor | None,
                             residual: torch.Tensor | None, silu_mul: bool, out_shape: tuple[int, int],
                             out_dtype: torch.dtype) -> None:
    """ValueError unless the norm prologue's weight and the residual epilogue's stream fit the launch."""
    if norm_weight is not None:
        if x_scale is not None:
            raise ValueError("the norm prologue takes 16-bit or float32 activations, not FP8 codes")
        check_norm_weight(x, norm_weight)
    if residual is not None:
        if silu_mul:
            raise ValueError("the residual add and SiLU * up are separate epilogues: one at a time")
        # Rows that overlap (stride(0) below the width, as an expanded tensor's) would have programs race.
        if (residual.shape != out_shape or residual.dtype != out_dtype or residual.stride(-1) != 1
                or (out_shape[0] > 1 and residual.stride(0) < out_shape[1]) or residual.device != x.device):
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} on {residual.device} must be "
                             f"{list(out_shape)} {out_dtype} on {x.device}, columns contiguous, rows apart")
        if residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError("residual must not share memory with x: programs would read x while others write it")


class RowsLaunch(NamedTuple):
    """The host side of one launch of a kernel built on the rows kernel's pieces (``rows_tile_sums``,
    ``gather_split_sums``): K slices a split and splits (a split has at least one slice), the split-K
    scratch (the output as a placeholder without a split), the weight as TMA reads it (a descriptor) or
    not, the weight scales (the weight as a placeholder for 16-bit weights), and whether products run
    in float32."""

    split_k: int
    slices_per_split: int
    partials: torch.Tensor
    arrivals: torch.Tensor
    w_desc: object
    w_scales: torch.Tensor
    tma: bool
    dot_f32: bool


def rows_launch(weight: torch.Tensor, weight_scale: torch.Tensor | None, tile: RowsTile, out: torch.Tensor,
                col_tiles: int, row_tiles: int, paired: bool = False) -> RowsLaunch:
    """``RowsLaunch`` of a grid of (``col_tiles``, ``row_tiles``, splits) programs of ``tile`` over ``weight``
    [N, K] (FP8 codes with ``weight_scale``, or 16-bit) writing ``out`` (its dtype: the products'); with
    ``paired`` each program sums two weight tiles (twice the split scratch)."""
    slices = triton.cdiv(weight.shape[1], tile.block_k)
    slices_per_split = triton.cdiv(slices, min(tile.split_k, slices))
    split_k = triton.cdiv(slices, slices_per_split)
    partials = arrivals = out  # not touched without a split
    if split_k > 1:
        sums = (2 if paired else 1) * split_k * col_tiles * row_tiles * tile.block_n * tile.block_m
        partials, arrivals = split_workspace(out.device, sums, col_tiles * row_tiles)
    tma = reads_through_tma(weight, tile)
    # Triton's CPU interpreter multiplies bfloat16 operands as raw bits: float32 there (each product of
    # 16-bit values is exact in float32, as on the tensor cores).
    dot_f32 = out.dtype == torch.float32 or (weight_scale is None and out.dtype == torch.bfloat16
                                             and triton_interpreter_on())
    return RowsLaunch(split_k, slices_per_split, partials, arrivals,
                      TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]) if tma else weight,
                      weight if weight_scale is None else weight_scale, tma, dot_f32)


def silu_mul_splits_k(rows: int, weight: torch.Tensor) -> bool:
    """Whether a SiLU * up product of ``rows`` tokens with ``weight`` ([2 * I, K]: gate rows, then up) splits
    K at its default tile (each split then stores and the last one adds two accumulators' partial sums)."""
    tile = rows_tile(rows, weight.shape[0] // 2, weight.shape[1], multiprocessors(weight.device),
                     tma_available(weight.device), weight.element_size())
    return tile.split_k > 1


def reads_through_tma(weight: torch.Tensor, tile: RowsTile) -> bool:
    """Whether the rows kernel reads ``weight``'s slices through TMA: ``tile.tma``, where the device has it
    (``tma_available``), for a weight TMA can address (rows whose byte stride is a multiple of 16,
    starting 16-byte aligned); else with the threads' loads."""
    return (tile.tma and weight.stride(0) * weight.element_size() % 16 == 0 and weight.data_ptr() % 16 == 0
            and tma_available(weight.device))


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, tile: RowsTile | None = None, *,
                 dependent_launch: bool = False, silu_mul: bool = False, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None])^T + bias`` with the codes widened in registers (W8A16).

    x: [M, K] (columns contiguous) 16-bit or float32; weight: [N, K] float8_e4m3fn, contiguous;
    weight_scale: [N] float32; bias: None or [N] in x's dtype. Returns [M, N] in x's dtype, rounded
    once from the float32 sum. The tensor cores take codes and activations in float16: exact for every
    code, and for activations of magnitude 2**-14 to 65504 (every bfloat16 value in that range is a
    float16 one; smaller ones lose bits below 2**-24, larger ones are clamped to 65504). float32
    activations multiply in float32. Any M; built for a few rows (``rows_tile``). No host sync: safe
    inside a CUDA graph. ``dependent_launch``, ``silu_mul``: as ``scaled_mm``'s (any M); ``norm_weight``,
    ``eps``, ``residual``: as ``rows_matmul``'s.
    """
    _check_weight(x, weight, weight_scale)
    check_bias(weight, bias)
    return _rows_matmul(x, None, weight, weight_scale, bias, x.dtype, tile, dependent_launch, silu_mul, norm_weight,
                        eps, residual)


def rows_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tile: RowsTile | None = None, *, dependent_launch: bool = False,
                silu_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a few rows of 16-bit weights on the rows kernel (weight rows on the
    tensor cores' 64-row side, K split where the matrix has few output tiles, slices through TMA up to
    16 tokens on sm_90+), where cuBLAS pads the tokens to its own tiles.

    x: [M, K] (columns contiguous) bfloat16, float16 or float32; weight: [N, K] contiguous, x's dtype;
    bias: None or [N] in x's dtype. Returns [M, N] in x's dtype, rounded once from the float32 sum of
    products exact in float32 (float32 weights multiply in IEEE float32). Built for 2-64 rows. No host
    sync: safe inside a CUDA graph. ``dependent_launch``, ``silu_mul``: as ``scaled_mm``'s (any M).
    ``norm_weight`` ([K], x's dtype): x is the residual stream, RMS-normalised in the kernel first
    (``eps``; rounded as ``rms_norm_torch`` rounds, its 1 / rms summed in another order). ``residual``
    ([M, N], x's dtype, not x's memory): the product is added into it in place (rounded as a torch add of
    the rounded product) and it is returned; not with ``silu_mul``.
    """
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dim() != 2 \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K] 16-bit or float32 tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match the weight's {weight.shape[1]} input "
                         f"features in {weight.dtype}")
    check_bias(weight, bias)
    return _rows_matmul(x, None, weight, None, bias, x.dtype, tile, dependent_launch, silu_mul, norm_weight, eps,
                        residual)


def check_quantized_rows(x: QuantizedRows) -> None:
    """ValueError unless ``x`` holds float8_e4m3fn codes [M, K] and float32 scales [M]."""
    if x.codes.dtype != FP8_DTYPE or x.scales.shape != (x.codes.shape[0],) or x.scales.dtype != torch.float32:
        raise ValueError(f"quantized rows must be float8_e4m3fn codes [M, K] with float32 scales [M], got "
                         f"{x.codes.dtype} {tuple(x.codes.shape)} and {x.scales.dtype} {tuple(x.scales.shape)}")


def check_bias(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError unless ``bias`` is None or a contiguous vector of ``weight``'s rows."""
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
