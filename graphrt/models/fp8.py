"""FP8 (E4M3) weights with one float32 scale per output channel, and the reference path that runs them:
dequantise to the activations' dtype, then the matmul (W8A16). Runs anywhere torch has
``float8_e4m3fn``; it halves the weights' memory, not a step's time (the CUDA kernels that read FP8
directly are separate work).

Quantisation (``quantize_per_channel``): ``scale[o] = max_i |W[o, i]| / 448`` (448 is E4M3's largest
finite value) and ``Q[o, i] = round_to_e4m3(W[o, i] / scale[o])``; dequantisation ``W ~ Q * scale``.
E4M3 keeps 3 mantissa bits, so a weight of normal range comes back within 2**-4 of itself (relative),
and one under ``2**-6 * scale`` within ``2**-10 * scale`` (absolute: the subnormal step's half).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
#: E4M3's largest finite value: the per-channel scale maps each row's largest magnitude onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)

#: Values ``EngineConfig.quantization`` takes (None: weights stay in the model dtype).
QUANTIZATIONS = ("fp8",)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (Q [out, in] float8_e4m3fn, scale [out] float32), computed
    in float32. An all-zero row gets scale 1 (its codes are zeros)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


class Fp8Linear(nn.Module):
    """``y = x @ (Q * scale)^T + bias`` with Q [out, in] float8_e4m3fn and scale [out] float32 (buffers),
    bias [out] in the model dtype or None. The dequantised weight is computed in float32 and rounded to
    x's dtype once, then one matmul (what the unquantised model does with a weight of those values)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """The FP8 form of ``linear``'s weight (quantised per output channel), its bias kept as is."""
        weight = linear.weight.detach()
        quantized = cls(linear.in_features, linear.out_features, linear.bias is not None, weight.dtype,
                        weight.device)
        codes, scale = quantize_per_channel(weight)
        quantized.weight.copy_(codes)
        quantized.weight_scale.copy_(scale)
        if linear.bias is not None:
            quantized.bias.data.copy_(linear.bias.detach())
        return quantized

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in ``dtype``: ``Q * scale`` in float32, rounded once."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype."""
        return nn.functional.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-channel"
