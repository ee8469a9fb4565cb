"""A decode graph's sampling rows: static device tensors refreshed from one pinned buffer in one copy.

``SamplingTensors.from_params`` + ``copy_into`` cost two pageable host-to-device copies and five
device copies per step; here the five fields share one device buffer (int64 rows, then float32 rows)
mirrored by one pinned host buffer, so a refresh is numpy writes and a single non-blocking copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrt.sampler import SamplingTensors, host_rows
from graphrt.sampling_params import SamplingParams

_INT64_FIELDS = ("top_k", "seeds", "steps")
_FLOAT32_FIELDS = ("temperature", "top_p")


def _views(buffer: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
    """The five [rows] fields inside a uint8 buffer of 32 * rows bytes."""
    int64 = buffer[: 24 * rows].view(torch.int64).view(3, rows)
    float32 = buffer[24 * rows:].view(torch.float32).view(2, rows)
    return {**dict(zip(_INT64_FIELDS, int64)), **dict(zip(_FLOAT32_FIELDS, float32))}


class StaticSampling:
    """``tensors``: a ``SamplingTensors`` of ``max_batch_size`` rows whose storage never changes (a
    captured graph reads it); ``refresh`` writes a batch into its first rows."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        rows = max_batch_size
        self.staging = torch.zeros(32 * rows, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = _views(self.staging, rows)
        host["top_p"].fill_(1.0)  # every row greedy with filters off until the first refresh
        self._host = {name: view.numpy() for name, view in host.items()}
        self.device_buffer = torch.empty_like(self.staging, device=device).copy_(self.staging)
        self.tensors = SamplingTensors(**_views(self.device_buffer, rows), all_greedy=True, needs_top_k_top_p=False)

    def refresh(self, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> None:
        """Validate (as ``SamplingTensors.from_params``) and write rows ``[:len(params)]``, then copy;
        ValueError for a bad row, with nothing written. Rows past the batch keep stale values, which
        ``sample`` (row-wise) never lets reach the batch's rows. Call again only after the step that
        read the last refresh finished (the graph runner waits for its tokens each step)."""
        if len(params) > self.tensors.batch_size:
            raise ValueError(f"{len(params)} sampling rows do not fit {self.tensors.batch_size}")
        temps, top_ks, top_ps, all_greedy, needs_filter = host_rows(params, seeds, steps)
        n, host = len(params), self._host
        host["temperature"][:n] = temps
        host["top_p"][:n] = top_ps
        host["top_k"][:n] = top_ks
        host["seeds"][:n] = seeds
        host["steps"][:n] = steps
        self.device_buffer.copy_(self.staging, non_blocking=True)
        self.tensors.all_greedy, self.tensors.needs_top_k_top_p = all_greedy, needs_filter
