"""How many tokens each sequence of a step drafts (prompt lookup): the lengths that maximise the tokens a
second the step is expected to give, from each request's acceptance and what the step's rows cost.

A draft token is kept only if the ones before it were, so with ``p`` a request's chance that a draft
token is kept after kept ones, its j-th draft token adds ``p ** j`` tokens to the step on average. The
candidates (every sequence's j-th token while ``p ** j`` >= ``MIN_TOKEN_GAIN``) are taken best first;
the step drafts the first m of them for the m that gives the most expected tokens per second of a
verify step of n + m rows, and nothing unless that beats a plain step of the n rows by ``MARGIN``.
Without measured step costs (no decode graphs) rows count as free, and every candidate is drafted.
"""

from __future__ import annotations

from graphrt.speculative.step_costs import SYNCHRONOUS, StepCosts

#: The least expected gain (chance of being kept) of a draft token worth a row.
MIN_TOKEN_GAIN = 0.3
#: How much more than a plain step's tokens a second a verify step must promise (the costs are
#: estimates, and a verify step that fails costs more than the plain step it replaced).
MARGIN = 0.05
#: The acceptance estimate's prior (kept, missed) and the factor each token's outcome (kept, or the
#: one missed) scales the older ones by: about the last ten tokens' outcomes count.
PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0
DECAY = 0.9


class Acceptance:
    """A request's chance that a draft token is kept given that the ones before it were: kept / (kept +
    missed) over counts that decay with each token's outcome, so that it follows where the output
    copies (long runs kept) and where it does not."""

    def __init__(self) -> None:
        self.kept, self.missed = PRIOR_KEPT, PRIOR_MISSED

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.missed)

    def observe(self, proposed: int, kept: int) -> None:
        """A draft (or a lookup checked against the tokens that came) of ``proposed`` tokens of which the
        first ``kept`` matched."""
        if proposed == 0:
            return
        missed = int(kept < proposed)  # the newest outcome, after the kept tokens'
        older = DECAY ** (kept + missed)
        self.kept = older * self.kept + DECAY ** missed * sum(DECAY ** i for i in range(kept))
        self.missed = older * self.missed + missed


def plan_lengths(rates: list[float], caps: list[int], costs: StepCosts | None, plain_kind: str,
                 max_rows: int) -> list[int]:
    """Draft tokens for each of n sequences (``rates``: their acceptance, ``caps``: the most each may
    draft). The step's rows stay within ``max_rows``. ``plain_kind``: how a plain step of the n rows
    runs (``step_costs.PIPELINED`` with ``async_decode``), the alternative a verify must beat."""
    n = len(rates)
    candidates = sorted(((rate ** j, i) for i, (rate, cap) in enumerate(zip(rates, caps))
                         for j in range(1, cap + 1) if rate ** j >= MIN_TOKEN_GAIN), key=lambda c: (-c[0], c[1]))
    del candidates[max(0, max_rows - n):]
    chosen = len(candidates)
    if candidates and costs is not None and costs.known:
        chosen = 0
        plain = costs.step(n, plain_kind)
        best = 0.0 if plain is None else (1 + MARGIN) * n / max(plain, 1e-9)
        expected = float(n)
        for m, (gain, _) in enumerate(candidates, 1):
            expected += gain
            verify = costs.step(n + m, SYNCHRONOUS)
            if verify is None:
                break
            if expected / max(verify, 1e-9) > best:
                best, chosen = expected / max(verify, 1e-9), m
    lengths = [0] * n
    for _, index in candidates[:chosen]:
        lengths[index] += 1
    return lengths
