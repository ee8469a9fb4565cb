"""Linear layers for decode at 2-16 tokens on tensor cores, with the layer's neighbours fused in.

Between batch 1 (``graphrt.kernels.gemv``'s matrix-vector kernels) and batches where cuBLAS's GEMMs
stream the weights at full rate, a decode step of a few sequences still reads each weight once and
does little arithmetic, yet on cuBLAS a layer runs ten kernels: four GEMMs, a split-K reduce, two norms,
rotary + cache write, SiLU * up and the attention, of which only the Triton ones launch as programmatic
dependents (profiles/notes_fusion.md, experiment 21: Llama-3.2-1B at batch 8, 64 us a layer exposed
against 45 at batch 1). Here one program computes ``BLOCK_N`` outputs for every row: each
``[BLOCK_N, BLOCK_K]`` weight slice is read once and multiplied with the rows (padded to 16, the
tensor cores' smallest tile) by ``tl.dot``, so the layer takes the GEMV's shape, five kernels, each a
dependent launch whose first weight slice is loaded before it waits for the kernel before. The
neighbours, as in ``gemv``:

* ``norm_weight``: x is the residual stream, RMS-normalised on the way in. Every program needs each
  row's 1 / rms, which a prologue would compute before the first product, one more pass over the rows
  after the wait; instead the K loop multiplies x by the norm weight, sums each row's squares as it
  goes, and scales the products by 1 / rms at the end: ``W (g * x / rms) = (W (g * x)) / rms``. So the
  rounding sits elsewhere than in the unfused ops, which round ``x / rms`` and ``g * (x / rms)`` to the
  model dtype where this rounds ``g * x``: one rounding of the model dtype either way (measured against
  float64 on the 1B's QKV at 8 rows, 1.16e-2 here against 1.28e-2 for the unfused ops, outputs of ~3);
* ``EPILOGUE_SILU_MUL``: the weight is gate then up; a program computes both halves' outputs ``n``
  and ``I + n`` and writes ``silu(gate) * up``;
* ``EPILOGUE_ADD_TO_OUT``: the result is added into ``out`` (the residual stream) in place.

Products sum in float32 in another order than cuBLAS's, so results differ from ``F.linear`` by a
last-place rounding, as two GEMM libraries do. Where the model uses these kernels is measured
(``graphrt.models.llama``), not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .dependent_launch import launch_options
from .gemv import EPILOGUE_ADD_TO_OUT, EPILOGUE_SILU_MUL, linear_operands, store_linear_output
from .rounding import round_to

#: Rows a launch takes at most: the tensor cores' smallest tile, to which the rows are padded.
MAX_ROWS = 16


@dataclass(frozen=True)
class FewRowsTile:
    """One launch's tiling: outputs a program, K slice, warps, and K slices the loop keeps in flight
    (Triton's software pipelining: ``num_stages``)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _products(w, up_w, x_ptrs, x_mask, K, norm_w, acc, acc_up, sum_squares, NORM: tl.constexpr,
              SILU_MUL: tl.constexpr, SILU_INPUT: tl.constexpr, DOT_F32: tl.constexpr, dtype: tl.constexpr):
    """One K slice: loads the rows' slice ([ROWS, BLOCK_K] at ``x_ptrs``; with SILU_INPUT the gate slice
    there and the up slice K columns on, combined as ``silu(gate) * up``, rounded as the unfused ops
    round it), with NORM multiplies it by the norm weight's slice ``norm_w`` ([BLOCK_K] float32) and adds
    its squares to ``sum_squares``, and adds ``w @ x^T`` (and with SILU_MUL ``up_w @ x^T``) to the
    [BLOCK_N, ROWS] float32 accumulators."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if SILU_INPUT:
        gate = x.to(tl.float32)
        up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
        x = round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32) * up, dtype)
    if NORM:
        x32 = x.to(tl.float32)
        sum_squares += x32 * x32
        x = round_to(x32 * norm_w[None, :], dtype)
    if DOT_F32:
        x_t = tl.trans(x.to(tl.float32))
        acc = tl.dot(w.to(tl.float32), x_t, acc, input_precision="ieee")
        if SILU_MUL:
            acc_up = tl.dot(up_w.to(tl.float32), x_t, acc_up, input_precision="ieee")
    else:
        x_t = tl.trans(x.to(w.dtype))
        acc = tl.dot(w, x_t, acc)
        if SILU_MUL:
            acc_up = tl.dot(up_w, x_t, acc_up)
    return acc, acc_up, sum_squares


@triton.jit
def _few_rows_kernel(
    x_ptr,  # [M, K] rows (with NORM: the residual stream, normalised here; with SILU_INPUT: [M, 2 * K] gate, up)
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
    SILU_INPUT: tl.constexpr,  # x is the gate/up projection's output; the product takes silu(gate) * up
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,  # M padded to the dot's tile (MAX_ROWS)
    DOT_F32: tl.constexpr,  # products in float32: float32 models, and the CPU interpreter's 16-bit dots
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    dtype = out_ptr.dtype.element_ty
    SILU_MUL: tl.constexpr = EPILOGUE == 2  # EPILOGUE_SILU_MUL
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    rows_m = tl.arange(0, ROWS)
    m_mask = rows_m < M
    k_offsets = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w + k_offsets[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N.to(tl.int64) * stride_w  # SILU_MUL's up rows
    x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_x + k_offsets[None, :]  # [ROWS, BLOCK_K]
    out_ptrs = out_ptr + rows_m.to(tl.int64)[None, :] * stride_out + cols_n[:, None]  # [BLOCK_N, ROWS]
    out_mask = n_mask[:, None] & m_mask[None, :]

    if PDL:
        # Weights, bias and norm weight are static: the first slices are requested before waiting for
        # the previous kernel, so their latency overlaps its tail (graphrt.kernels.dependent_launch).
        tl.extra.cuda.gdc_launch_dependents()
    k_mask = k_offsets < K
    w_mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    up_w = w
    if SILU_MUL:
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
    norm_w = tl.full([BLOCK_K], 1.0, tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    addend = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if EPILOGUE == 1:  # EPILOGUE_ADD_TO_OUT: the stream is requested now, not after the products
        addend = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)

    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    sum_squares = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    acc, acc_up, sum_squares = _products(w, up_w, x_ptrs, m_mask[:, None] & k_mask[None, :], K, norm_w, acc, acc_up,
                                         sum_squares, NORM, SILU_MUL, SILU_INPUT, DOT_F32, dtype)
    for k in range(BLOCK_K, K, BLOCK_K):
        k_mask = k + k_offsets < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs + k, mask=w_mask, other=0.0)
        if SILU_MUL:
            up_w = tl.load(up_ptrs + k, mask=w_mask, other=0.0)
        if NORM:
            norm_w = tl.load(norm_w_ptr + k + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
        acc, acc_up, sum_squares = _products(w, up_w, x_ptrs + k, m_mask[:, None] & k_mask[None, :], K, norm_w, acc,
                                             acc_up, sum_squares, NORM, SILU_MUL, SILU_INPUT, DOT_F32, dtype)

    if NORM:  # output n of row m sits at [n, m]
        inv_rms = tl.math.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)  # [ROWS]
        acc = acc * inv_rms[None, :]
        acc_up = acc_up * inv_rms[None, :]
    store_linear_output(acc + bias[:, None], acc_up, addend, out_ptrs, out_mask, EPILOGUE, dtype)


#: Until measured per shape (``MEASURED_TILES``): 16 outputs, K slices of 256, 4 warps, 3 slices in flight.
DEFAULT_TILE = FewRowsTile(16, 256, 4, 3)

#: Tiles measured fastest on the H200, 16-bit weights: (weight rows, in_features, SiLU * up epilogue) ->
#: tile. From experiment 12's kernel of the same structure, each matrix alone at 8 rows
#: (profiles/results/few_rows_h200.json; five slices in flight there are four here, where the residual
#: add's early load leaves no room for a fifth).
MEASURED_TILES: dict[tuple[int, int, bool], FewRowsTile] = {
    (3072, 2048, False): FewRowsTile(64, 256, 4, 4),  # Llama-3.2-1B QKV
    (2048, 2048, False): FewRowsTile(64, 256, 4, 4),  # 1B O
    (16384, 2048, True): FewRowsTile(64, 128, 8, 4),  # 1B gate/up
    (2048, 8192, False): FewRowsTile(64, 256, 4, 4),  # 1B down
    (6144, 4096, False): FewRowsTile(64, 256, 4, 4),  # Llama-3-8B QKV
    (4096, 4096, False): FewRowsTile(64, 256, 4, 4),  # 8B O
    (28672, 4096, True): FewRowsTile(128, 128, 8, 3),  # 8B gate/up
    (4096, 14336, False): FewRowsTile(64, 256, 4, 4),  # 8B down
    (960, 576, False): FewRowsTile(16, 64, 4, 5),  # SmolLM2-135M QKV
    (576, 576, False): FewRowsTile(16, 128, 4, 5),  # SmolLM2 O
    (3072, 576, True): FewRowsTile(32, 256, 4, 4),  # SmolLM2 gate/up
    (576, 1536, False): FewRowsTile(16, 256, 4, 5),  # SmolLM2 down
}


def layer_max_tokens(layer_weight_bytes: int, dependent_launch: bool) -> int:
    """Up to how many tokens a decoder layer of ``layer_weight_bytes`` runs its linear layers here (its
    ``forward_few_rows``): launched as programmatic dependents, ``MAX_ROWS`` until measured otherwise;
    launched plainly, none (the kernels' gain is the chain of dependent launches)."""
    return MAX_ROWS if dependent_launch else 0


def default_tile(in_features: int, weight_rows: int, silu_mul: bool = False, element_size: int = 2) -> FewRowsTile:
    """The tile for a ``[weight_rows, in_features]`` weight: the measured one for 16-bit weights of a
    measured shape, else ``DEFAULT_TILE`` with its K slice no longer than the row."""
    measured = MEASURED_TILES.get((weight_rows, in_features, silu_mul)) if element_size == 2 else None
    if measured is not None:
        return measured
    block_k = min(DEFAULT_TILE.block_k, max(16, triton.next_power_of_2(in_features)))
    return FewRowsTile(DEFAULT_TILE.block_n, block_k, DEFAULT_TILE.num_warps, DEFAULT_TILE.num_stages)


def linear_few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    epilogue: int = 0,
    out: torch.Tensor | None = None,
    tile: FewRowsTile | None = None,
    dependent_launch: bool = False,
    silu_input: bool = False,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` for 1 to ``MAX_ROWS`` rows, optionally with RMSNorm before and SiLU *
    up or a residual add after, in one kernel.

    Arguments, shapes and dtypes as ``graphrt.kernels.gemv.linear_gemv``'s: x [M, K] (M <= 16, columns
    contiguous), weight [N_w, K] contiguous, bias None or [N_w], norm_weight None or [K], all one dtype
    (fp16/bf16/fp32); ``epilogue`` one of gemv's ``EPILOGUE_*``; ``out`` [M, N_w] (or [M, I] with SiLU *
    up), required for the residual add, not sharing memory with x. With ``norm_weight`` the norm's
    1 / rms scales the products (see the module docstring for where that rounds). ``tile``: the
    launch's tiling (default ``default_tile``'s). Nothing is allocated when ``out`` is given, and the
    launch depends on shapes only: safe inside a CUDA graph. ``dependent_launch``: launch as a
    programmatic dependent of the previous kernel. ``silu_input``: x is a gate/up projection's output
    [M, 2 * K] (gate columns, then up) and the product takes ``silu(gate) * up`` [M, K], as
    ``graphrt.kernels.activation.silu_and_mul`` rounds it (the down projection with the activation
    fused in)."""
    if silu_input:
        if norm_weight is not None:
            raise ValueError("silu_input and norm_weight do not combine: the input is either normalised or activated")
        if x.dim() != 2 or x.shape[-1] != 2 * weight.shape[-1]:
            raise ValueError(f"silu_input needs x [M, 2 * {weight.shape[-1]}] (gate, then up), got {tuple(x.shape)}")
        x = x[:, : weight.shape[-1]]  # the gate half; the kernel reads up K columns on
    rows, in_features, out_features, out = linear_operands(x, weight, bias, norm_weight, epilogue, out)
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} rows exceed the {MAX_ROWS} linear_few_rows takes; use torch.nn.functional.linear")
    if rows == 0:
        return out
    tile = tile or default_tile(in_features, weight.shape[0], epilogue == EPILOGUE_SILU_MUL, x.element_size())
    _few_rows_kernel[(triton.cdiv(out_features, tile.block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, out,
        x.stride(0), weight.stride(0), out.stride(0), float(eps), rows, out_features, in_features,
        NORM=norm_weight is not None, SILU_INPUT=silu_input, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ROWS=MAX_ROWS,
        DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(dependent_launch),
    )
    return out


__all__ = ["EPILOGUE_ADD_TO_OUT", "EPILOGUE_SILU_MUL", "FewRowsTile", "MAX_ROWS", "default_tile", "layer_max_tokens",
           "linear_few_rows"]
