"""Batch-size buckets: one CUDA graph per bucket; a batch is padded up to the smallest that holds it."""

from __future__ import annotations

import bisect


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to 256, trimmed to ``max_num_seqs`` (which is added when it
    falls between two buckets, so every allowed batch size has a graph)."""
    sizes = [s for s in [1, 2, 4, *range(8, 257, 8)] if s <= max_num_seqs]
    if max_num_seqs <= 256 and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def validate_capture_sizes(sizes: list[int]) -> list[int]:
    """Sorted, de-duplicated positive sizes; raises ValueError on anything else."""
    if not sizes:
        raise ValueError("capture sizes must not be empty")
    bad = [s for s in sizes if not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"capture sizes must be positive integers, got {bad[0]!r}")
    return sorted(set(sizes))


def choose_bucket(sizes: list[int], batch_size: int) -> int | None:
    """The smallest bucket >= ``batch_size`` (``sizes`` sorted), or None when the batch is too large."""
    index = bisect.bisect_left(sizes, batch_size)
    return sizes[index] if index < len(sizes) else None
