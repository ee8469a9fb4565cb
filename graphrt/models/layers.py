"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SiLU-gated MLP activation."""

from __future__ import annotations

import math

import torch
from torch import nn

from graphrt.models.config import RopeScaling


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Unfused RMSNorm with HF Llama's arithmetic: ``weight * (x / rms(x))``, the norm in float32.

    x: [T, N]; weight: [N]; residual: None or [T, N], all one dtype. With a residual, ``x + residual``
    is normalised and returned too: ``(out, x + residual)`` (a new tensor; ``residual`` is untouched).
    ``graphrt.kernels.rms_norm.rms_norm`` is the fused kernel with the same contract (it updates
    ``residual`` in place).
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] (gate first, then up) -> silu(gate) * up: [T, I]. Unfused; the fused kernel
    is ``graphrt.kernels.activation.silu_and_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


#: Whether ``FewRowsLinear`` layers run the rows kernel where their bound allows (an A/B switch for
#: ``profiles/step_ab.py``, read at each forward: a graph captured after a change keeps what it saw).
ROWS_KERNEL = True


def rows_kernel_runs_on(device: torch.device) -> bool:
    """Whether ``FewRowsLinear`` runs the rows kernel on ``device``: CUDA only (a test may widen it to the
    CPU under Triton's interpreter)."""
    return device.type == "cuda"


class FewRowsLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forwards of 2 to ``max_tokens`` tokens on CUDA
    run the rows kernel (``graphrt.kernels.fp8_matmul.rows_matmul``: weight rows on the tensor cores'
    wide side, K split where a matrix has few output tiles), where cuBLAS pads a few tokens to its own
    tiles; other forwards, and CPU ones, run ``nn.Linear``'s. ``max_tokens`` comes from the kernel policy
    (``KernelPolicy.rows_kernel_max_tokens``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, *,
                 max_tokens: int) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.max_tokens = max_tokens

    def takes_rows_kernel(self, x: torch.Tensor) -> bool:
        """Whether a forward of ``x`` runs the rows kernel."""
        return (ROWS_KERNEL and rows_kernel_runs_on(x.device) and x.dim() == 2 and 1 < x.shape[0] <= self.max_tokens
                and x.dtype == self.weight.dtype and x.stride(-1) == 1)

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x, silu_mul=True)`` writes ``silu(gate) * up`` in the product's own epilogue: on
        the rows kernel, where its tile does not split K (16-bit weights: a split product's reduction of two
        accumulators made the step slower than the activation's own launch; profiles/notes_fusion.md)."""
        if not self.takes_rows_kernel(x):
            return False
        from graphrt.kernels.fp8_matmul import silu_mul_splits_k

        return not silu_mul_splits_k(x.shape[0], self.weight)

    def rows_kernel_operands(self, x: torch.Tensor):
        """How a forward of ``x`` would run on the rows kernel, for a kernel that fuses more around the same
        product (``attention/triton_qkv_rows.py``): (activations, weight, None, bias, None: the default
        tile), or None where it would not."""
        return (x, self.weight, None, self.bias, None) if self.takes_rows_kernel(x) else None

    def forward(self, x: torch.Tensor, silu_mul: bool = False, norm: "RMSNorm | None" = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype. ``silu_mul`` (where ``fuses_silu_mul``): the weight is gate
        rows then up rows, and the result [T, out / 2] is ``silu(gate) * up``. On the rows kernel only:
        ``norm``: x is the residual stream, normalised by this RMSNorm's weight and eps in the kernel first;
        ``residual`` ([T, out]): the product is added into it in place, and it is returned."""
        if self.takes_rows_kernel(x):
            from graphrt.kernels.fp8_matmul import rows_matmul

            return rows_matmul(x, self.weight, self.bias, silu_mul=silu_mul,
                               norm_weight=None if norm is None else norm.weight, eps=1e-6 if norm is None else norm.eps,
                               residual=residual)
        if silu_mul or norm is not None or residual is not None:
            raise ValueError(f"a forward of {x.shape[0]} tokens here does not run the rows kernel: no SiLU * up, "
                             "norm or residual fusion")
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows kernel for 2-{self.max_tokens} tokens on CUDA"


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally adding the residual stream first (see ``rms_norm_torch``).

    ``fused=True`` runs the Triton kernel (one launch instead of about eight); needs a device where
    Triton runs.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None, device=None,
                 fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if fused:
            from graphrt.kernels.rms_norm import rms_norm

            self._norm = rms_norm
        else:
            self._norm = rms_norm_torch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False):
        """x: [T, hidden] -> normed [T, hidden]; with ``residual``: (normed sum, sum). ``quantize`` (the
        fused kernel only): normed as ``fp8_matmul.QuantizedRows``, codes with per-token scales."""
        if quantize:
            if self._norm is rms_norm_torch:
                raise ValueError("a quantized norm output needs the fused kernel (fused=True)")
            return self._norm(x, self.weight, self.eps, residual, quantize=True)
        return self._norm(x, self.weight, self.eps, residual)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 rotation frequencies, with Llama 3's scaling applied when given.

    Llama 3 keeps high frequencies (wavelength under original_ctx / high_freq_factor), divides low
    ones (wavelength over original_ctx / low_freq_factor) by ``factor``, and blends in between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's "rotate half" layout (first half of D pairs with the second).

    Holds cos/sin tables for positions ``0 .. max_positions - 1`` so that a step only gathers rows.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None, device=None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling).to(device)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)  # [P, D/2]
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, H * D]; k: [T, KVH * D] -> rotated q, k (same shapes, dtype)."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, self.head_dim)
        first, second = x.chunk(2, dim=-1)
        rotated_half = torch.cat([-second, first], dim=-1)
        return (x * cos + rotated_half * sin).flatten(1)
