"""A runtime oracle for the decode graphs (``check_graphs=N``): replays are checked against eager runs.

A captured graph keeps the device addresses it was captured with: if a static input is replaced
instead of refreshed in place (a new tensor for a buffer, weights loaded by assignment), or a graph is
replayed with state it was not captured for, the replay silently computes from stale memory. With the
oracle on, the graph runner

* before every replay compares the address of every static input (graph state, sampling rows, the
  logits and logprob buffers, the KV caches, the model's parameters and buffers) with its address at
  capture: a moved input sends the step, and its bucket from then on, to eager;
* every N-th replay runs the same step eagerly too, on the same inputs (the replay's own outputs are
  kept aside first), and compares tokens and float32 logits: a token that differs, or a logit that
  differs by more than ``LOGIT_TOLERANCE`` relative to the row's largest magnitude, is a divergence.
  The eager result is kept, and the bucket decodes eagerly from then on.

Each bucket's first failure is logged once (bucket, mode, replay count, largest difference) and kept
in ``GraphCheck.failures``. The check costs a host sync and an eager forward per checked replay: a
debugging aid, off by default.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

#: Largest logit difference between a replay and its eager run, relative to the row's largest |logit|,
#: that still counts as agreement. Replays run the eager step's kernels on the same inputs, so they
#: agree to the bit wherever those kernels are deterministic; the margin only absorbs a library that
#: picks another reduction order inside a capture.
LOGIT_TOLERANCE = 1e-3


@dataclass
class GraphCheckFailure:
    """A replay that disagreed with its eager run, or found a static input moved."""

    bucket: int
    mode: str
    replay: int  # the runner's replay count when it happened (1 = the first replay)
    reason: str  # "diverged" or "inputs_moved"
    max_logit_diff: float | None = None  # diverged: the largest |graph - eager| logit difference
    tokens_differ: int | None = None  # diverged: rows whose tokens differ
    moved: list[str] = dataclasses.field(default_factory=list)  # inputs_moved: which inputs


def static_tensors(root, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``root`` through dataclass fields, dicts, lists and tuples, named by
    its path (``graph_state.seq_lens``, ``kv_caches.3``); other objects are not entered."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(root, torch.Tensor):
        found[prefix] = root
    elif dataclasses.is_dataclass(root) and not isinstance(root, type):
        for f in dataclasses.fields(root):
            found.update(static_tensors(getattr(root, f.name), f"{prefix}.{f.name}" if prefix else f.name))
    elif isinstance(root, dict):
        for key, value in root.items():
            found.update(static_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(root, (list, tuple)):
        for index, value in enumerate(root):
            found.update(static_tensors(value, f"{prefix}.{index}" if prefix else str(index)))
    return found


class GraphCheck:
    """The oracle's state for one graph runner: addresses at capture, counters, failed buckets.

    every: check every ``every``-th replay against an eager run (>= 1); inputs: the static inputs at
    capture, by name (``static_tensors``).
    """

    def __init__(self, every: int, inputs: dict[str, torch.Tensor]) -> None:
        if every < 1:
            raise ValueError(f"check_graphs must be >= 1 to check replays, got {every}")
        self.every = every
        self._addresses = {name: tensor.data_ptr() for name, tensor in inputs.items()}
        self.replays = 0
        self.checks = 0
        #: The largest logit difference any checked replay showed against its eager run.
        self.largest_logit_diff = 0.0
        self.failures: list[GraphCheckFailure] = []
        self.failed_buckets: set[int] = set()

    def moved_inputs(self, inputs: dict[str, torch.Tensor]) -> list[str]:
        """Names of static inputs whose address differs from capture's (or that were not there)."""
        moved = [name for name, tensor in inputs.items() if self._addresses.get(name) != tensor.data_ptr()]
        return moved + [name for name in self._addresses if name not in inputs]

    def count_replay(self) -> bool:
        """Count a replay; whether it is one to check against an eager run."""
        self.replays += 1
        return self.replays % self.every == 0

    @staticmethod
    def differences(graph_tokens: torch.Tensor, graph_logits: torch.Tensor, eager_tokens: torch.Tensor,
                    eager_logits: torch.Tensor) -> tuple[int, float, bool]:
        """(rows whose tokens differ, largest logit difference, whether that is a divergence). Tokens
        [B] int64, logits [B, V] float32 of the same step's replay and eager run."""
        tokens_differ = int((graph_tokens != eager_tokens).sum())
        diff = (graph_logits - eager_logits).abs()
        max_diff = float(diff.max()) if diff.numel() else 0.0
        scale = eager_logits.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)  # [B, 1]
        too_far = bool((diff > LOGIT_TOLERANCE * scale).any()) or not torch.isfinite(graph_logits).all()
        return tokens_differ, max_diff, tokens_differ > 0 or too_far

    def fail(self, failure: GraphCheckFailure) -> None:
        """Record a failure; log it and send its bucket to eager the first time the bucket fails."""
        self.failures.append(failure)
        if failure.bucket in self.failed_buckets:
            return
        self.failed_buckets.add(failure.bucket)
        if failure.reason == "inputs_moved":
            detail = f"static inputs moved since capture: {', '.join(failure.moved[:5])}"
        else:
            detail = (f"{failure.tokens_differ} token(s) differ, largest logit difference "
                      f"{failure.max_logit_diff:.4g}")
        logger.warning("decode graph check failed for bucket %d (%s) at replay %d: %s; that bucket decodes "
                       "eagerly from now on", failure.bucket, failure.mode, failure.replay, detail)
