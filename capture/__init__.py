"""CUDA-graph capture of the decode step: batch-size buckets, the decode batch an engine hands over,
the static token inputs, and the graph runner (plan, prepare, replay or eager fallback; warm-up,
capture, the runtime oracle, stats)."""

from graphrt.capture.buckets import choose_bucket, default_capture_sizes
from graphrt.capture.decode_batch import DecodeBatch
from graphrt.capture.decode_inputs import DecodeInputs
from graphrt.capture.graph_check import GraphCheck, GraphCheckFailure
from graphrt.capture.graph_runner import SAMPLING_MODES, DecodeGraphRunner, DecodePlan, GraphKey
from graphrt.capture.pending import PendingTokens
from graphrt.capture.stats import DecodeStats, EagerReason

__all__ = [
    "DecodeBatch",
    "DecodeGraphRunner",
    "DecodeInputs",
    "DecodePlan",
    "DecodeStats",
    "EagerReason",
    "GraphCheck",
    "GraphCheckFailure",
    "GraphKey",
    "PendingTokens",
    "SAMPLING_MODES",
    "choose_bucket",
    "default_capture_sizes",
]
