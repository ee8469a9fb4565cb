"""FP8 (E4M3) linear weights: their scales, how checkpoints store them, and the layer that runs them.

A weight is codes ``Q [out, in]`` float8_e4m3fn times float32 scales, ``W = Q * scale``, one scale a
row (``scale [out]``) or one a row and block of ``scale_columns`` input columns (``scale [out,
ceil(in / scale_columns)]``: what block-scaled checkpoints hold, each block's scale repeated over its
rows). A 16-bit weight is quantised here per row (``quantize_weight``): ``scale = max |W[o]| / 448``
(448 is E4M3's largest finite value), ``Q = round_to_e4m3(W / scale)``. E4M3 keeps 3 mantissa bits, so a
weight of normal range comes back within 2**-4 of itself (relative), and one under ``2**-6 * scale``
within ``2**-10 * scale`` (absolute: the subnormal step's half).

``Fp8Linear``'s paths are fixed when it is built: one-token decode layers call the GEMV kernels with
its codes and row scales directly (W8A16; ``graphrt.models.llama``); its own forward runs FP8
tensor cores with per-token activation scales, or the W8A16 tensor-core kernel for one token and for up
to ``w8a16_max_tokens`` tokens where that kernel is the faster (``graphrt.kernels.fp8_matmul``: CUDA,
row scales), or dequantises and runs one matmul in the activations' dtype (the reference path: CPU,
block scales).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from graphrt.base.errors import ModelLoadError

FP8_DTYPE = torch.float8_e4m3fn
#: E4M3's largest finite value: a scale maps its group's largest magnitude onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)

#: Values ``EngineConfig.quantization`` takes (None: weights stay in the model dtype).
QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """How an FP8 checkpoint scales its weights, read from its ``quantization_config``.

    method: "fp8" (transformers' fine-grained FP8 and per-tensor tools) or "compressed-tensors".
    weight_block: (rows, columns) of one scale's block, or None (one scale a tensor or a row, told
    apart by the scale tensors' shapes). ignored: module names or ``re:`` patterns the checkpoint
    keeps in 16 bits (graphrt quantises such decoder linears per row at load; the LM head stays 16-bit).
    """

    method: str
    weight_block: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()

    @property
    def scale_columns(self) -> int | None:
        """Input columns one scale covers (None: the whole row)."""
        return None if self.weight_block is None else self.weight_block[1]


def quantize_weight(weight: torch.Tensor, scale_columns: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (Q [out, in] float8_e4m3fn, scale float32 [out], or [out,
    ceil(in / scale_columns)] with ``scale_columns``), computed in float32. An all-zero group gets
    scale 1 (its codes are zeros)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.float()
    rows, columns = w.shape
    group = columns if scale_columns is None else scale_columns
    groups = -(-columns // group) if columns else 1
    padded = nn.functional.pad(w, (0, groups * group - columns)).view(rows, groups, group)
    amax = padded.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [out, groups]
    if scale_columns is None:
        scale = scale[:, 0].contiguous()
    codes = (w / per_column_scales(scale, columns, scale_columns)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def per_column_scales(scale: torch.Tensor, columns: int, scale_columns: int | None) -> torch.Tensor:
    """Scales in a layer's layout (float32 [rows], or [rows, groups] of ``scale_columns`` columns each)
    as a tensor that broadcasts against its [rows, columns] weight: [rows, 1] or [rows, columns]."""
    if scale_columns is None:
        return scale[:, None]
    return scale.repeat_interleave(scale_columns, dim=1)[:, :columns]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, scale_columns: int | None) -> torch.Tensor:
    """codes [rows, columns] float8_e4m3fn with their scales (``per_column_scales``' layout) -> the
    weight they mean, float32."""
    return codes.float() * per_column_scales(scale, codes.shape[1], scale_columns)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight`` with one scale per output row: (Q [out, in] float8_e4m3fn, scale [out] float32)."""
    return quantize_weight(weight)


def scales_for_rows(scale: torch.Tensor, rows: int, columns: int, scale_columns: int | None,
                    weight_block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """A checkpoint's scale tensor for a ``[rows, columns]`` weight, as the layer stores it: float32
    [rows] (``scale_columns`` None) or [rows, ceil(columns / scale_columns)].

    Accepted: one scale (per tensor: [], [1], [1, 1]), one a row ([rows] or [rows, 1]), or one a block
    of ``weight_block`` ([ceil(rows / b0), ceil(columns / b1)], the blocks' scales repeated over their
    rows). Every such form is exact in the layer's layout, except block scales in a layer of row scales
    (ModelLoadError: the model was built for another format). ``name`` labels errors.
    """
    if not scale.is_floating_point():
        raise ModelLoadError(f"{name}: scales must be floating-point, got {scale.dtype}")
    scale = scale.float()
    groups = 1 if scale_columns is None else -(-columns // scale_columns)
    if scale.numel() == 1:
        per_row = scale.reshape(1, 1).expand(rows, groups)
    elif tuple(scale.shape) in ((rows,), (rows, 1)):
        per_row = scale.reshape(rows, 1).expand(rows, groups)
    elif weight_block is not None and tuple(scale.shape) == (-(-rows // weight_block[0]),
                                                             -(-columns // weight_block[1])):
        if scale_columns != weight_block[1]:
            raise ModelLoadError(f"{name}: block scales of {weight_block} do not fit a layer built for scales of "
                                 f"{scale_columns or 'a whole row of'} columns")
        per_row = scale.repeat_interleave(weight_block[0], dim=0)[:rows]
    else:
        expected = ("[], [1], [rows] or [rows, 1] (block scales need config.json's quantization_config to say "
                    "the block size)") if weight_block is None else (
            f"one scale, one a row, or [{-(-rows // weight_block[0])}, {-(-columns // weight_block[1])}] "
            f"for blocks of {weight_block}")
        raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)} does not fit a [{rows}, {columns}] "
                             f"weight; expected {expected}")
    if not torch.isfinite(per_row).all() or (per_row <= 0).any():
        raise ModelLoadError(f"{name}: scales must be finite and positive")
    return per_row[:, 0].contiguous() if scale_columns is None else per_row.contiguous()


def _runs_cuda_kernels(device: torch.device) -> bool:
    """Whether forwards on ``device`` run the Triton FP8 kernels (CUDA) rather than the reference path."""
    return device.type == "cuda"


@functools.cache
def _fp8_matmul():
    """``graphrt.kernels.fp8_matmul``, imported on first use: it imports Triton, which only CUDA
    forwards need."""
    from graphrt.kernels import fp8_matmul

    return fp8_matmul


def _on_rows_kernel(path, rows: int) -> bool:
    """Whether a forward of ``rows`` tokens whose ``Fp8Linear._cuda_path`` is ``path`` runs the Triton rows
    kernel (CUDA kernels, at most ``fp8_matmul.TRITON_MAX_ROWS`` tokens; more go to cuBLAS)."""
    return path is not None and rows <= _fp8_matmul().TRITON_MAX_ROWS


class Fp8Linear(nn.Module):
    """``y = x @ (Q * scale)^T + bias`` with Q [out, in] float8_e4m3fn and scale float32 [out] (or [out,
    ceil(in / scale_columns)]) as buffers; bias [out] in the model dtype or None.

    On CUDA with row scales, forwards run the Triton kernels of ``graphrt.kernels.fp8_matmul``: with
    ``tensor_cores`` (sm_89+, widths of 16s) FP8 tensor cores with per-token activation scales
    (``scaled_mm``), except one token and, up to ``w8a16_max_tokens`` tokens, the weights on which
    the W8A16 kernel is faster (``fp8_matmul.w8a16_is_faster``): those, and every forward without
    ``tensor_cores``, run the W8A16 kernel (``w8a16_matmul``); anything else (CPU, block scales) the
    reference path: the dequantised weight computed in float32, rounded to x's dtype once, one matmul.
    (One token is usually the GEMV kernels', which the decoder layer calls itself.)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None,
                 scale_columns: int | None = None, tensor_cores: bool = False, w8a16_max_tokens: int = 0,
                 dependent_launch: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scale_columns = in_features, out_features, scale_columns
        scale_shape = (out_features,) if scale_columns is None else (out_features, -(-in_features // scale_columns))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.tensor_cores = (tensor_cores and scale_columns is None and out_features % 16 == 0
                             and in_features % 16 == 0)  # fp8_matmul.supports_shape, without importing Triton
        self.w8a16_max_tokens = w8a16_max_tokens
        #: The model launches its fused kernels as programmatic dependents: the rows kernel may be one too
        #: (where ``fp8_matmul.ROWS_DEPENDENT_LAUNCH`` says so).
        self.dependent_launch = dependent_launch

    @property
    def row_scales(self) -> torch.Tensor | None:
        """The [out] float32 scales the GEMV kernels take, or None with block scales."""
        return self.weight_scale if self.scale_columns is None else None

    def store_rows(self, start: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Copy codes [r, in] and their scales (this layer's layout, ``scales_for_rows``) into rows
        ``start .. start + r``."""
        self.weight[start:start + codes.shape[0]].copy_(codes)
        self.weight_scale[start:start + codes.shape[0]].copy_(scales)

    def quantize_rows_from(self, start: int, weight: torch.Tensor) -> None:
        """Quantise a 16-bit or float32 weight [r, in] into rows ``start .. start + r`` (on this layer's
        device, in this layer's scale layout)."""
        codes, scales = quantize_weight(weight.to(self.weight.device), self.scale_columns)
        self.store_rows(start, codes, scales)

    def quantize_columns_from(self, weight: torch.Tensor, columns_held: Callable[[torch.Tensor], torch.Tensor]
                              ) -> None:
        """Quantise a whole 16-bit or float32 weight [out, full in] of which this layer holds the columns
        ``columns_held(codes)`` cuts (a tensor-parallel rank's slice): the rows' scales are the whole
        rows' (as on one rank), the codes this layer's columns of them. Per-row scales only."""
        if self.scale_columns is not None:
            raise ValueError("quantize_columns_from takes a layer of one scale a row")
        codes, scales = quantize_weight(weight.to(self.weight.device))
        held = columns_held(codes)
        if tuple(held.shape) != tuple(self.weight.shape):
            raise ModelLoadError(f"a weight of shape {tuple(weight.shape)} does not fill an FP8 layer of "
                                 f"{tuple(self.weight.shape)} columns held")
        self.store_rows(0, held, scales)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in ``dtype``: ``Q * scale`` in float32, rounded once."""
        return dequantize(self.weight, self.weight_scale, self.scale_columns).to(dtype)

    def _cuda_path(self, rows: int, device: torch.device):
        """(takes FP8 activations, the rows kernel's tile) for a forward of ``rows`` tokens on ``device``,
        or None off the CUDA kernels (CPU, block scales): the reference path."""
        if not _runs_cuda_kernels(device) or self.scale_columns is not None:
            return None
        kernels = _fp8_matmul()
        tile = kernels.rows_tile(rows, self.out_features, self.in_features, kernels.multiprocessors(device),
                                 kernels.tma_available(device))
        fp8_activations = self.tensor_cores and rows > 1 and not (
            rows <= self.w8a16_max_tokens and kernels.w8a16_is_faster(tile))
        return fp8_activations, tile

    def takes_quantized_input(self, rows: int, device: torch.device) -> bool:
        """Whether a forward of ``rows`` tokens on ``device`` quantises its input per token (FP8 tensor
        cores), so that the kernel producing that input may quantise it instead (``QuantizedRows``)."""
        path = self._cuda_path(rows, device)
        return path is not None and path[0]

    def fuses_silu_mul(self, x) -> bool:
        """Whether ``forward(x, silu_mul=True)`` writes ``silu(gate) * up`` in the product's own epilogue:
        a forward on the rows kernel (CUDA, row scales, up to ``fp8_matmul.TRITON_MAX_ROWS`` tokens)."""
        return _on_rows_kernel(self._cuda_path(x.shape[0], x.device), x.shape[0])

    def rows_kernel_operands(self, x):
        """How a forward of ``x`` would run on the rows kernel, for a kernel that fuses more around the same
        product (``attention/triton_qkv_rows.py``): (activations, as ``QuantizedRows`` where it takes FP8
        activations, quantised here unless the producer did; codes; row scales; bias; None: the fusing
        kernel tiles its own launch), or None where it would not (CPU, block scales, more than
        ``fp8_matmul.TRITON_MAX_ROWS`` tokens). FP8 or 16-bit activations as the whole product would take them."""
        path = self._cuda_path(x.shape[0], x.device)
        if not _on_rows_kernel(path, x.shape[0]):
            return None
        fp8_activations, _ = path
        kernels = _fp8_matmul()
        if fp8_activations and isinstance(x, torch.Tensor):
            x = kernels.QuantizedRows(*kernels.quantize_rows(x), x.dtype)
        elif not fp8_activations and not isinstance(x, torch.Tensor):
            raise ValueError(f"this layer takes 16-bit activations for {x.shape[0]} tokens, not quantized rows")
        return x, self.weight, self.weight_scale, self.bias, None

    def forward(self, x, silu_mul: bool = False):
        """x: [T, in] -> [T, out] in x's dtype. x may be ``fp8_matmul.QuantizedRows`` (codes and per-token
        scales from the kernel that produced it) where ``takes_quantized_input`` says so. ``silu_mul``
        (where ``fuses_silu_mul``): the weight is gate rows then up rows, and the result [T, out / 2] is
        ``silu(gate) * up``, on the tile (and kernel) the whole product would take."""
        path = self._cuda_path(x.shape[0], x.device)
        if silu_mul and not _on_rows_kernel(path, x.shape[0]):
            raise ValueError(f"a forward of {x.shape[0]} tokens here does not run the rows kernel: no SiLU * up "
                             "epilogue")
        if path is not None:
            fp8_activations, tile = path
            kernels = _fp8_matmul()
            launch = {"dependent_launch": self.dependent_launch and kernels.ROWS_DEPENDENT_LAUNCH, "silu_mul": silu_mul}
            if fp8_activations:
                return kernels.scaled_mm(x, self.weight, self.weight_scale, self.bias, tile=tile, **launch)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"this layer takes 16-bit activations for {x.shape[0]} tokens, not quantized rows")
            return kernels.w8a16_matmul(x, self.weight, self.weight_scale, self.bias, tile=tile, **launch)
        if not isinstance(x, torch.Tensor):
            raise ValueError("quantized rows need the CUDA FP8 kernels with row scales")
        return nn.functional.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        scales = "per row" if self.scale_columns is None else f"per row and {self.scale_columns} columns"
        if self.scale_columns is not None:
            path = "dequantise + matmul"
        elif self.tensor_cores:
            path = (f"on CUDA w8a16 for 1 token (up to {self.w8a16_max_tokens} where faster), else "
                    "fp8 tensor cores")
        else:
            path = "on CUDA w8a16"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 scales {scales}, {path}"
