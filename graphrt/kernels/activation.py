"""SiLU-gated activation ``silu(gate) * up`` in one kernel instead of two (plus no strided half copies)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.rounding import round_to

#: Columns of the output one program writes.
_BLOCK = 1024


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
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the model dtype first, as the unfused ``silu(gate)`` tensor is.
    activated = round_to(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(activated * up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2 * I] (gate first, then up; columns contiguous) -> ``out`` [T, I] = ``silu(gate) * up``
    in the same dtype (allocated when not given). Capturable: the launch depends on the shape only."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with contiguous columns, got {tuple(gate_up.shape)}")
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
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

