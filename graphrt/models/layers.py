"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SiLU-gated MLP activation."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeScaling


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back, as HF Llama does.

    x: [T, hidden] in the model dtype; weight: [hidden].
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] (gate first, then up) -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


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
