"""What a decode step costs by its rows, for weighing a verify's extra rows against the tokens they may
bring: the decode graphs' replay times (measured once, right after capture) plus the host's share of
each kind of step, learnt from the engine's own steps.

A step of R rows replays the graph of R's bucket, so its device time is that bucket's replay time; the
wall time of a step adds what the device time does not cover: attention over real contexts, and the
host's work. That differs by kind: a plain decode queued blind (``async_decode``) hides the host's work
behind the device's, a verify step waits for its tokens before the next one can be drafted. Each kind
keeps the lower quartile of (wall - replay) seconds over its latest ``WINDOW`` steps, 0 until its
first step is seen (optimistic). A low quantile, not a mean or the median: host time is skewed by
one-off delays, and a kind judged too dear from them is not run, so not measured again (the history is
in profiles/notes_speculative.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

#: Steps of a kind whose host share's lower quartile is taken.
WINDOW = 15
#: Steps of this kind: a plain decode queued blind, and a synchronous step (a verify, or a plain decode
#: the engine waited for).
PIPELINED, SYNCHRONOUS = "pipelined", "synchronous"


class StepCosts:
    """Seconds a decode step of some rows takes, by kind (``PIPELINED``, ``SYNCHRONOUS``).

    ``replay_seconds``: returns the decode graphs' replay time by bucket (empty without graphs: then
    ``known`` is False and rows count as free). ``bucket_of``: the bucket a step of that many rows
    replays (None past the largest)."""

    def __init__(self, replay_seconds: Callable[[], dict[int, float]],
                 bucket_of: Callable[[int], int | None]) -> None:
        self._replay_seconds, self._bucket_of = replay_seconds, bucket_of
        #: Each kind's host share now: the lower quartile of its latest steps' (wall - replay) seconds.
        self.extra_seconds = {PIPELINED: 0.0, SYNCHRONOUS: 0.0}
        self._latest = {kind: deque(maxlen=WINDOW) for kind in self.extra_seconds}

    @property
    def known(self) -> bool:
        """Whether replay times were measured (the decode runs in CUDA graphs)."""
        return bool(self._replay_seconds())

    def bucket(self, rows: int) -> int | None:
        """The decode graph bucket a step of ``rows`` rows replays (None past the largest)."""
        return self._bucket_of(rows)

    def replay(self, rows: int) -> float | None:
        """The device seconds of a step of ``rows`` rows (None without a graph that holds them)."""
        bucket = self._bucket_of(rows)
        return None if bucket is None else self._replay_seconds().get(bucket)

    def step(self, rows: int, kind: str) -> float | None:
        """Wall seconds of a step of ``rows`` rows of ``kind`` (None when no graph holds the rows)."""
        replay = self.replay(rows)
        return None if replay is None else replay + self.extra_seconds[kind]

    def observe(self, rows: int, kind: str, seconds: float) -> None:
        """A decode-only step of ``rows`` rows and ``kind`` took ``seconds`` of wall time."""
        replay = self.replay(rows)
        if replay is not None:
            latest = self._latest[kind]
            latest.append(max(0.0, seconds - replay))
            self.extra_seconds[kind] = sorted(latest)[len(latest) // 4]
