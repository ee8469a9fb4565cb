"""CUDA-graph capture of the decode step: batch-size buckets, the decode batch an engine hands over,
and the graph runner (warm-up, capture, replay, eager fallback, stats)."""

from .buckets import choose_bucket, default_capture_sizes
from .decode_batch import DecodeBatch
from .graph_check import GraphCheck, GraphCheckFailure
from .graph_runner import SAMPLING_MODES, DecodeGraphRunner
from .pending import PendingTokens
from .stats import DecodeStats, EagerReason

__all__ = [
    "DecodeBatch",
    "DecodeGraphRunner",
    "DecodeStats",
    "EagerReason",
    "GraphCheck",
    "GraphCheckFailure",
    "PendingTokens",
    "SAMPLING_MODES",
    "choose_bucket",
    "default_capture_sizes",
]
