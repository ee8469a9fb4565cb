"""What the launch heuristics read of a device, host values only (safe before CUDA-graph capture)."""

from __future__ import annotations

import functools

import torch

#: Multiprocessors assumed off CUDA (Triton's CPU interpreter): a small stand-in machine, so that the
#: heuristics that fill a GPU's multiprocessors still take their several-program branches in CPU tests.
STAND_IN_MULTIPROCESSORS = 4


@functools.cache
def _cuda_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (``STAND_IN_MULTIPROCESSORS`` off CUDA)."""
    if device.type != "cuda":
        return STAND_IN_MULTIPROCESSORS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
