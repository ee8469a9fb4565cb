"""Counters a graph runner keeps, readable from the API (``runner.stats``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class EagerReason:
    """Why a decode step ran without a graph."""

    ENFORCE_EAGER = "enforce_eager"
    NO_CUDA = "no_cuda"
    CAPTURE_FAILED = "capture_failed"
    BATCH_TOO_LARGE = "batch_too_large"
    CONTEXT_TOO_LONG = "context_too_long"
    #: The runtime oracle (``check_graphs``) found this bucket's replays wrong (``graph_check``).
    GRAPH_CHECK_FAILED = "graph_check_failed"


@dataclass
class DecodeStats:
    replays_per_bucket: Counter = field(default_factory=Counter)
    #: Padding rows added to reach a bucket, summed over replays.
    padded_rows: int = 0
    eager_steps: Counter = field(default_factory=Counter)
    #: Steps whose prompt tokens ran in the decode's forward (``DecodeGraphRunner.plan_mixed``), replayed or eager.
    mixed_steps: int = 0
    num_graphs: int = 0
    #: Of ``num_graphs``, the mixed ones (prompt tokens and decode rows in one graph).
    num_mixed_graphs: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    capture_error: str | None = None
    #: Median seconds of one replay of each bucket's greedy graph right after capture (empty without graphs).
    replay_seconds: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "replays_per_bucket": dict(sorted(self.replays_per_bucket.items())),
            "padded_rows": self.padded_rows,
            "eager_steps": dict(self.eager_steps),
            "mixed_steps": self.mixed_steps,
            "num_graphs": self.num_graphs,
            "num_mixed_graphs": self.num_mixed_graphs,
            "capture_seconds": round(self.capture_seconds, 3),
            "pool_mib": round(self.pool_bytes / 2**20, 1),
            "capture_error": self.capture_error,
            "replay_ms": {size: round(seconds * 1e3, 4) for size, seconds in sorted(self.replay_seconds.items())},
        }
