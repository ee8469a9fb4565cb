"""A decode graph's sampling rows: static device tensors refreshed from one pinned buffer in one copy.

``SamplingTensors.from_params`` + ``copy_into`` cost two pageable host-to-device copies and five
device copies per step; here the five fields share one ``PackedStaging``, so a refresh is numpy
writes and a single non-blocking copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrt.base.staging import PackedStaging
from graphrt.sampling.params import SamplingParams
from graphrt.sampling.sampler import SamplingTensors, host_rows


class StaticSampling:
    """``tensors``: a ``SamplingTensors`` of ``max_batch_size`` rows whose storage never changes (a
    captured graph reads it); ``refresh`` writes a batch into its first rows."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        rows = (max_batch_size,)
        self.packed = PackedStaging([
            ("top_k", torch.int64, rows), ("seeds", torch.int64, rows), ("steps", torch.int64, rows),
            ("temperature", torch.float32, rows), ("top_p", torch.float32, rows),
        ], device)
        self.packed.host["top_p"][:] = 1.0  # every row greedy with filters off until the first refresh
        self.packed.upload(non_blocking=False)
        self.tensors = SamplingTensors(**self.packed.device, all_greedy=True, needs_top_k_top_p=False)

    def refresh(self, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> None:
        """Validate (as ``SamplingTensors.from_params``) and write rows ``[:len(params)]``, then copy;
        ValueError for a bad row, with nothing written. Rows past the batch keep stale values, which
        ``sample`` (row-wise) never lets reach the batch's rows. Waits first until the previous
        refresh's copy has run."""
        if len(params) > self.tensors.batch_size:
            raise ValueError(f"{len(params)} sampling rows do not fit {self.tensors.batch_size}")
        temps, top_ks, top_ps, all_greedy, needs_filter = host_rows(params, seeds, steps)
        self.packed.wait_until_uploaded()  # the previous refresh's copy may still be queued (pipelined decode)
        n, host = len(params), self.packed.host
        host["temperature"][:n] = temps
        host["top_p"][:n] = top_ps
        host["top_k"][:n] = top_ks
        host["seeds"][:n] = seeds
        host["steps"][:n] = steps
        self.packed.upload()
        self.tensors.all_greedy, self.tensors.needs_top_k_top_p = all_greedy, needs_filter
