"""Whether verify steps pay, as measured: the check behind prompt lookup's adaptive lengths.

``draft_policy`` drafts when its estimates say a verify step gives more tokens a second than a plain
step. The estimates can be wrong in either direction (a request's acceptance, the host's share of a
synchronous step), so each verify step's realised worth is measured too: the tokens it gave a sequence
over its wall time, against a plain step of the same sequences (``StepCosts.step``, the rate drafting
gave up). While the decayed mean over a batch bucket's latest verifies says they gave fewer tokens a
second than plain steps would have, that bucket drafts nothing; after ``FIRST_PROBE`` steps that
wanted to draft, one verify is let through to measure again, and each probe that does not pay doubles
the wait (up to ``LAST_PROBE``), so that a text which never copies costs at most about one verify in
that many steps.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Verify steps of a bucket measured before their realised rate may stop drafting there.
MIN_VERIFIES = 3
#: The weight of a bucket's older verifies against the newest (about the latest five count).
DECAY = 0.8
#: Steps that wanted to draft, while drafting is stopped, before a verify is let through to measure.
FIRST_PROBE, LAST_PROBE = 8, 128


@dataclass
class _Bucket:
    """One batch bucket's decayed sums over its verifies: the plain seconds their tokens would have
    taken a sequence, and the seconds they took."""

    plain_seconds: float = 0.0
    seconds: float = 0.0
    verifies: int = 0
    stopped: bool = False
    wanted: int = 0  # steps that wanted to draft since drafting stopped or the last probe
    probe_after: int = FIRST_PROBE

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds > 0 else float("inf")


class Payoff:
    """Realised verify rates by batch bucket (``bucket_of``: the decode graph bucket of a count of
    sequences), and whether a step that wants to draft may."""

    def __init__(self, bucket_of) -> None:
        self._bucket_of = bucket_of
        self._buckets: dict[int | None, _Bucket] = {}

    def _bucket(self, sequences: int) -> _Bucket:
        return self._buckets.setdefault(self._bucket_of(sequences), _Bucket())

    def allows(self, sequences: int) -> bool:
        """Whether a step of ``sequences`` that wants to draft may: always while verifies pay; while they
        do not, once every ``probe_after`` such steps (the answer stays yes until that verify is
        measured, so that planning a step twice, blind and then with its tokens, agrees)."""
        bucket = self._bucket(sequences)
        if not bucket.stopped or bucket.wanted >= bucket.probe_after:
            return True
        bucket.wanted += 1
        return False

    def observe(self, sequences: int, tokens: int, seconds: float, plain_seconds: float | None) -> None:
        """A verify step of ``sequences`` gave ``tokens`` tokens (kept drafts and the targets' own) in
        ``seconds`` of wall time; a plain step of them would take ``plain_seconds`` (None: unknown, the
        step is not counted)."""
        if plain_seconds is None or sequences <= 0 or seconds <= 0:
            return
        bucket = self._bucket(sequences)
        bucket.plain_seconds = DECAY * bucket.plain_seconds + tokens / sequences * plain_seconds
        bucket.seconds = DECAY * bucket.seconds + seconds
        bucket.verifies += 1
        pays = bucket.speedup >= 1.0
        if bucket.stopped:  # a probe: drafting resumes if it paid, else the next probe waits longer
            bucket.stopped, bucket.wanted = not pays, 0
            bucket.probe_after = FIRST_PROBE if pays else min(2 * bucket.probe_after, LAST_PROBE)
        elif not pays and bucket.verifies >= MIN_VERIFIES:
            bucket.stopped, bucket.wanted = True, 0

    def speedups(self) -> dict[int | None, float]:
        """Each bucket's realised verify speedup over plain steps (the decayed mean; >1 pays)."""
        return {key: bucket.speedup for key, bucket in self._buckets.items() if bucket.verifies}
