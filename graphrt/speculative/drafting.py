"""The engine's side of speculative decoding: how many tokens each sequence drafts (by prompt lookup or
a draft model), the blocks its draft positions need, and which drafted tokens the target keeps.

Verification is a decode step over virtual rows: a sequence with draft ``d_1 .. d_k`` decodes k + 1
rows, row j taking token ``d_j`` (row 0 its newest token) at position ``L - 1 + j`` with ``L`` its
token count, so that row j attends over the cache up to its own token (the rows' K/V are written
before attention reads them) and samples the token at output index ``n + j`` with the request's noise
for that index (``DecodeBatch.steps``). The kept tokens are the row-0 sample, then each next row's
sample while the previous one equalled the draft: exactly the tokens decoding without drafts would
give from the same logits, greedy or sampled (the sampler is a function of the logits, the seed and
the output index), so speculation changes speed, not output. Rows past the first mismatch wrote K/V
at positions that later tokens overwrite before anything reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.block_manager import BlockManager
from graphrt.sequence import Sequence
from graphrt.speculative.config import SpeculativeConfig
from graphrt.speculative.draft_model import DraftModel
from graphrt.speculative.draft_policy import Acceptance, plan_lengths
from graphrt.speculative.ngram import NgramIndex
from graphrt.speculative.payoff import Payoff
from graphrt.speculative.step_costs import SYNCHRONOUS, StepCosts

#: Steps a sequence stops drafting after consecutive verifies that kept no draft token: doubled on each
#: further miss, up to ``MAX_PAUSE`` (a rejected draft costs a verify of several rows for one token).
#: The pause starts short because a copying request's misses come alone (where its output leaves the
#: text it copies, and lookup finds the new place a token later), and paused steps cost what decoding
#: without speculation costs (with ``async_decode`` they are pipelined as without it).
FIRST_PAUSE, MAX_PAUSE = 1, 64


def _through_first_stop(seq: Sequence, draft: list[int]) -> list[int]:
    """``draft`` up to its first stop or end-of-sequence token (included): rows past it would decode
    for a sequence that has finished."""
    stops = set(seq.params.stop_token_ids)
    if not seq.params.ignore_eos:
        stops.update(seq.eos_token_ids)
    for index, token in enumerate(draft):
        if token in stops:
            return draft[:index + 1]
    return draft


class DraftLength:
    """A request's next draft length with a draft model: one more (up to k) after a draft kept whole, one
    more than it kept after a partial one (so the next verify has one row to spare), and after a verify
    that kept nothing a pause in drafting that doubles while misses repeat (reset by any kept token)."""

    def __init__(self, max_tokens: int, adaptive: bool) -> None:
        self.max_tokens, self.adaptive = max_tokens, adaptive
        self.length = max_tokens
        self._pause_steps = 0
        self._next_pause = FIRST_PAUSE

    @property
    def pausing(self) -> bool:
        """Whether this step drafts nothing (a pause in drafting)."""
        return self._pause_steps > 0

    def next(self) -> int:
        """Tokens to draft this step (0 while pausing); counts a step of the pause."""
        if self._pause_steps:
            self._pause_steps -= 1
            return 0
        return self.length

    def update(self, proposed: int, kept: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if kept == proposed:
            self.length = min(self.max_tokens, self.length + 1)
        else:
            self.length = max(1, min(self.max_tokens, kept + 1))
        if kept == 0:
            self._pause_steps, self._next_pause = self._next_pause, min(MAX_PAUSE, 2 * self._next_pause)
        else:
            self._next_pause = FIRST_PAUSE


@dataclass
class SpeculativeStats:
    """Counts since the engine started (``LLMEngine.speculative_stats``) or for one request
    (``RequestOutput.speculative``): decode steps of a sequence (every one, with or without a draft,
    pipelined or not), draft tokens proposed and kept, tokens produced."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    produced_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens over proposed ones (0 when none were proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced a decode step (1 without drafts)."""
        return self.produced_tokens / self.verify_steps if self.verify_steps else 0.0

    def add(self, proposed: int, accepted: int, produced: int) -> None:
        self.verify_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.produced_tokens += produced


@dataclass
class DraftPlan:
    """A step's draft lengths, one per sequence (0: no draft), and with prompt lookup the lookups they
    were chosen from (``Drafter.plan``)."""

    lengths: list[int]
    lookups: list[list[int]] | None = None

    @property
    def drafts_any(self) -> bool:
        return any(self.lengths)


class Drafter:
    """Drafts for the decoding sequences and the bookkeeping of what verification kept. One per engine;
    a sequence's index, acceptance and draft length live from its first step until ``forget``.

    Prompt lookup's lengths come from ``draft_policy``: each request's acceptance is learnt from its
    verifies and, where it drafts nothing, from its lookups checked against the tokens the target then
    gave (a lookup costs no forward), and the step's rows are weighed against the tokens they may bring
    with ``costs``; where verifies measured slower than plain steps, ``payoff`` stops drafting but for
    probes. A draft model's lengths follow ``DraftLength`` (its drafts cost its forwards, so
    its acceptance is learnt from verifies alone, with pauses after misses)."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 max_rows: int, draft_model: DraftModel | None = None, costs: StepCosts | None = None,
                 plain_kind: str = SYNCHRONOUS) -> None:
        self.config, self.block_manager = config, block_manager
        self.max_model_len, self.max_rows = max_model_len, max_rows
        #: With method "draft": the model that drafts (else prompt lookup does).
        self.draft_model = draft_model
        #: What a step's rows cost (prompt lookup's lengths weigh them), and how a plain step runs.
        self.costs, self.plain_kind = costs, plain_kind
        #: Whether verifies paid, as measured (stops prompt lookup's adaptive drafting where they did not).
        self.payoff = None if costs is None else Payoff(costs.bucket)
        self._indexes: dict[int, NgramIndex] = {}
        self._lengths: dict[int, DraftLength] = {}
        self._acceptance: dict[int, Acceptance] = {}
        self._lookups: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (token count then, lookup) unchecked
        self.stats = SpeculativeStats()
        self.request_stats: dict[int, SpeculativeStats] = {}

    def begin(self, seqs: list[Sequence]) -> None:
        """Sequences just prefilled: with prompt lookup, index their prompts and look up once now, in the
        prefill's step, so that the decode steps (whose times the draft lengths weigh) do per-token work
        only."""
        if self.draft_model is None:
            for seq in seqs:
                self._lookup(seq)

    def plan(self, seqs: list[Sequence], blind: bool = False) -> DraftPlan:
        """The draft lengths of a step of ``seqs``. ``blind``: the step is planned before the tokens of
        the step in flight are known (whether to queue it blind): lookups are not redone then, the
        latest unchecked one stands in. The lengths keep every draft within the request's
        ``max_tokens`` and ``max_model_len`` (the last kept token is always the target's own) and the
        step within ``max_rows`` (earlier sequences first)."""
        rooms = [min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
                 for seq in seqs]
        if self.draft_model is not None:
            wanted = [0 if self._length(seq).pausing else min(self._length(seq).length, room)
                      for seq, room in zip(seqs, rooms)]
            return DraftPlan(self._within_rows(wanted))
        for seq in seqs:
            self._check_lookup(seq)
        lookups = [self._lookups.get(seq.seq_id, (0, []))[1] if blind else self._lookup(seq) for seq in seqs]
        caps = [max(0, min(len(lookup), room)) for lookup, room in zip(lookups, rooms)]
        if self.config.adaptive:
            rates = [self._acceptance_of(seq).rate for seq in seqs]
            lengths = plan_lengths(rates, caps, self.costs, self.plain_kind, self.max_rows)
            if any(lengths) and self.payoff is not None and not self.payoff.allows(len(seqs)):
                lengths = [0] * len(seqs)
        else:
            lengths = self._within_rows(caps)
        return DraftPlan(lengths, lookups)

    def observe_verify(self, sequences: int, tokens: int, seconds: float) -> None:
        """A verify step of ``sequences`` (no prompt beside it) gave ``tokens`` tokens in ``seconds`` of
        wall time: measured against a plain step of them (``Payoff``)."""
        if self.payoff is not None and self.costs.known:
            self.payoff.observe(sequences, tokens, seconds, self.costs.step(sequences, self.plain_kind))

    def _within_rows(self, wanted: list[int]) -> list[int]:
        """``wanted`` draft lengths (one a sequence) cut so that the step's rows (a sequence's own and its
        drafts') stay within ``max_rows``, earlier sequences first; never negative."""
        lengths, spare_rows = [], self.max_rows - len(wanted)
        for length in wanted:
            lengths.append(max(0, min(length, spare_rows)))
            spare_rows -= lengths[-1]
        return lengths

    def propose(self, seqs: list[Sequence], plan: DraftPlan) -> list[list[int]]:
        """A draft per sequence (possibly empty) as ``plan`` (``plan(seqs)``) sets their lengths, the
        sequences' block tables grown to cover their draft positions. A sequence whose draft positions
        need blocks the cache lacks drafts nothing (no preemption for speculation)."""
        if self.draft_model is not None:
            for seq in seqs:
                self._length(seq).next()  # counts a step of a pause
            drafts = self.draft_model.propose(seqs, plan.lengths)
        else:
            drafts = [lookup[:length] for lookup, length in zip(plan.lookups, plan.lengths)]
        for index, (seq, draft) in enumerate(zip(seqs, drafts)):
            draft = drafts[index] = _through_first_stop(seq, draft)
            if draft and not self.block_manager.can_grow(seq.seq_id, seq.num_tokens + len(draft)):
                drafts[index] = []
            elif draft:
                self.block_manager.grow(seq.seq_id, seq.num_tokens + len(draft))
            if drafts[index]:
                self._lookups.pop(seq.seq_id, None)  # its verify tells what it would have told
        return drafts

    def pass_step(self, seqs: list[Sequence]) -> None:
        """A step of ``seqs`` that drafts nothing (a plain decode, queued blind)."""
        if self.draft_model is not None:
            for seq in seqs:
                self._length(seq).next()

    def record_plain_step(self, seqs: list[Sequence]) -> None:
        """Counts a plain decode step's token for each of ``seqs`` (no draft proposed)."""
        for seq in seqs:
            self.record(seq, 0, 0, 1)

    @staticmethod
    def kept_tokens(draft: list[int], sampled: list[int]) -> list[int]:
        """The tokens to append from a verify (``len(kept) - 1`` of them drafts): ``sampled`` holds the
        target's token of each of the draft's ``len(draft) + 1`` rows; kept are row 0's, then each next
        row's while the previous one equalled its draft token."""
        kept = 0
        while kept < len(draft) and sampled[kept] == draft[kept]:
            kept += 1
        return sampled[:kept + 1]

    def record(self, seq: Sequence, proposed: int, kept: int, appended: int) -> None:
        """After a step: ``kept`` of ``proposed`` draft tokens kept, ``appended`` tokens appended (fewer
        than ``kept + 1`` when a stop condition came first). Updates the acceptance (or the draft
        length) and the counts; with prompt lookup, checks the pending lookup against the appended tokens
        and, once it is scored, looks up at the new end."""
        if self.draft_model is not None:
            self._length(seq).update(proposed, kept)
        else:
            self._acceptance_of(seq).observe(proposed, kept)
            self._check_lookup(seq)
            if seq.seq_id not in self._lookups and not seq.is_finished:
                self._lookup(seq)
        accepted = min(kept, appended)
        self.stats.add(proposed, accepted, appended)
        self.request_stats.setdefault(seq.seq_id, SpeculativeStats()).add(proposed, accepted, appended)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's index (or draft-model shadow), acceptance, draft length and
        statistics."""
        if self.draft_model is not None:
            self.draft_model.forget(seq)
        for state in (self._indexes, self._lengths, self._acceptance, self._lookups, self.request_stats):
            state.pop(seq.seq_id, None)

    def _lookup(self, seq: Sequence) -> list[int]:
        """The lookup at the end of the known tokens: the pending one if it was made there, else a new
        one, which becomes the pending one when none is (checked against the tokens to come)."""
        pending = self._lookups.get(seq.seq_id)
        if pending is not None and pending[0] == seq.num_tokens:
            return pending[1]
        lookup = self._index(seq).propose(self.config.num_tokens)
        if pending is None:
            self._lookups[seq.seq_id] = (seq.num_tokens, lookup)
        return lookup

    def _check_lookup(self, seq: Sequence) -> None:
        """Score the pending lookup of ``seq`` as a verify would have once the tokens it guessed are
        known (or its first wrong one is), and drop it."""
        pending = self._lookups.get(seq.seq_id)
        if pending is None:
            return
        start, lookup = pending
        first = start - len(seq.prompt_token_ids)  # lookups are made while decoding: past the prompt
        came = seq.output_token_ids[first:first + len(lookup)]
        matched = 0
        while matched < len(came) and came[matched] == lookup[matched]:
            matched += 1
        if matched == len(lookup) or matched < len(came):
            self._acceptance_of(seq).observe(len(lookup), matched)
            del self._lookups[seq.seq_id]

    def _acceptance_of(self, seq: Sequence) -> Acceptance:
        acceptance = self._acceptance.get(seq.seq_id)
        if acceptance is None:
            acceptance = self._acceptance[seq.seq_id] = Acceptance()
        return acceptance

    def _index(self, seq: Sequence) -> NgramIndex:
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        # Index what was appended since the last draft (the prompt at first), without copying the rest.
        known, prompt = len(index.tokens), seq.prompt_token_ids
        if known < len(prompt):
            index.extend(prompt[known:])
            known = len(prompt)
        index.extend(seq.output_token_ids[known - len(prompt):])
        return index

    def _length(self, seq: Sequence) -> DraftLength:
        length = self._lengths.get(seq.seq_id)
        if length is None:
            length = self._lengths[seq.seq_id] = DraftLength(self.config.num_tokens, self.config.adaptive)
        return length
