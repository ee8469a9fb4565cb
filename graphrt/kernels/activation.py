"""SiLU-gated activation ``silu(gate) * up`` in one kernel instead of two (plus no strided half copies).

With ``quantize`` the output is written as E4M3 codes with a scale per row instead, the activations an
FP8 x FP8 down projection takes (what ``fp8_matmul.quantize_rows`` would make of the 16-bit output, bit
for bit, without its launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.fp8_matmul import MIN_SCALE, QuantizedRows, quantized_rows_out, row_codes, row_scale
from graphrt.kernels.rounding import round_to

#: Columns of the output one program writes.
_BLOCK = 1024
#: Longest row the quantising kernel holds in registers at once (16 warps, 32 columns a thread); longer
#: rows are walked twice in loads of ``_QUANTIZE_LOOP_BLOCK``.
_QUANTIZE_MAX_BLOCK = 16384
_QUANTIZE_LOOP_BLOCK = 4096


@triton.jit
def _silu_times_up(gate_up_row, cols, mask, INTERMEDIATE: tl.constexpr, dtype: tl.constexpr):
    """``silu(gate) * up`` at columns ``cols`` of one row, rounded to dtype as the unfused ops round it
    (``silu(gate)`` first, then the product)."""
    gate = tl.load(gate_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_row + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    activated = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    return round_to(activated * up, dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * I]: gate columns, then up columns
    out_ptr,  # [T, I]
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    out = _silu_times_up(gate_up_ptr + row * stride_in, cols, mask, INTERMEDIATE, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_quantize_kernel(
    gate_up_ptr,  # [T, 2 * I]: gate columns, then up columns
    codes_ptr,  # [T, I] float8_e4m3fn
    scales_ptr,  # [T] float32
    stride_in,
    stride_codes,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program a row, since the scale needs the row's largest output: a row of up to BLOCK columns is
    # computed once and held in registers; a longer one is computed twice, the second time from L2 (the
    # gate/up product has just written it).
    dtype = gate_up_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    gate_up_row = gate_up_ptr + row * stride_in
    offsets = tl.arange(0, BLOCK)
    if INTERMEDIATE <= BLOCK:
        mask = offsets < INTERMEDIATE
        out = _silu_times_up(gate_up_row, offsets, mask, INTERMEDIATE, dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(out), axis=0))
        tl.store(scales_ptr + row, scale)
        tl.store(codes_ptr + row * stride_codes + offsets, row_codes(out, scale).to(codes_ptr.dtype.element_ty),
                 mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, INTERMEDIATE, BLOCK):
        cols = k + offsets
        out = _silu_times_up(gate_up_row, cols, cols < INTERMEDIATE, INTERMEDIATE, dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(out))
    scale = row_scale(tl.max(amax, axis=0))
    tl.store(scales_ptr + row, scale)
    for k in range(0, INTERMEDIATE, BLOCK):
        cols = k + offsets
        out = _silu_times_up(gate_up_row, cols, cols < INTERMEDIATE, INTERMEDIATE, dtype).to(tl.float32)
        tl.store(codes_ptr + row * stride_codes + cols, row_codes(out, scale).to(codes_ptr.dtype.element_ty),
                 mask=cols < INTERMEDIATE)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None,
                 quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """gate_up: [T, 2 * I] (gate first, then up; columns contiguous) -> ``out`` [T, I] = ``silu(gate) * up``
    in the same dtype (allocated when not given). ``quantize``: returns ``QuantizedRows`` instead (codes
    [T, I] float8_e4m3fn and float32 scales [T], allocated here; ``out`` cannot be given), equal to
    ``fp8_matmul.quantize_rows`` of the 16-bit result. Capturable: the launch depends on the shape only."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with contiguous columns, got {tuple(gate_up.shape)}")
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if quantize:
        if out is not None:
            raise ValueError("out cannot be given with quantize: the codes and scales are allocated here")
        result = quantized_rows_out(num_tokens, intermediate, gate_up.dtype, gate_up.device)
        if num_tokens and intermediate:
            block = triton.next_power_of_2(intermediate)
            block = block if block <= _QUANTIZE_MAX_BLOCK else _QUANTIZE_LOOP_BLOCK
            _silu_and_mul_quantize_kernel[(num_tokens,)](
                gate_up, result.codes, result.scales, gate_up.stride(0), result.codes.stride(0),
                INTERMEDIATE=intermediate, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
        elif num_tokens:  # no columns: every row gets the smallest scale, as quantize_rows gives it
            result.scales.fill_(MIN_SCALE)
        return result
    if out is None:
        out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_tokens, intermediate) or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous [{num_tokens}, {intermediate}] "
                         f"{gate_up.dtype}")
    if num_tokens:
        block = min(_BLOCK, triton.next_power_of_2(intermediate))
        grid = (num_tokens, triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate,
                                   BLOCK=block, num_warps=4)
    return out
