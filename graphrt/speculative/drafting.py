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
from graphrt.speculative.ngram import NgramIndex

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
    """A request's next draft length: one more (up to k) after a draft kept whole, one more than it
    kept after a partial one (so the next verify has one row to spare), and after a verify that kept
    nothing a pause in drafting that doubles while misses repeat (reset by any kept token)."""

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


class Drafter:
    """Drafts for the decoding sequences and the bookkeeping of what verification kept. One per engine;
    a sequence's index and draft length live from its first draft until ``forget``."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 max_rows: int, draft_model: DraftModel | None = None) -> None:
        self.config, self.block_manager = config, block_manager
        self.max_model_len, self.max_rows = max_model_len, max_rows
        #: With method "draft": the model that drafts (else prompt lookup does).
        self.draft_model = draft_model
        self._indexes: dict[int, NgramIndex] = {}
        self._lengths: dict[int, DraftLength] = {}
        self.stats = SpeculativeStats()
        self.request_stats: dict[int, SpeculativeStats] = {}

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """A draft per sequence (possibly empty), the sequences' block tables grown to cover their draft
        positions. A draft never runs past ``max_tokens`` or ``max_model_len`` (the last kept token is
        always the target's own), the step's rows stay within ``max_rows`` (earlier sequences first),
        and a sequence whose draft positions need blocks the cache lacks drafts nothing (no preemption
        for speculation)."""
        lengths: list[int] = []
        spare_rows = self.max_rows - len(seqs)
        for seq in seqs:
            length = self._length(seq).next()
            room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            length = max(0, min(length, room, spare_rows))
            spare_rows -= length
            lengths.append(length)
        if self.draft_model is not None:
            drafts = self.draft_model.propose(seqs, lengths)
        else:
            drafts = [self._index(seq).propose(length) if length else [] for seq, length in zip(seqs, lengths)]
        for index, (seq, draft) in enumerate(zip(seqs, drafts)):
            draft = drafts[index] = _through_first_stop(seq, draft)
            if draft and not self.block_manager.can_grow(seq.seq_id, seq.num_tokens + len(draft)):
                drafts[index] = []
            elif draft:
                self.block_manager.grow(seq.seq_id, seq.num_tokens + len(draft))
        return drafts

    def all_pausing(self, seqs: list[Sequence]) -> bool:
        """Whether every one of ``seqs`` pauses its drafting this step (a sequence's first step drafts)."""
        return all(seq.seq_id in self._lengths and self._lengths[seq.seq_id].pausing for seq in seqs)

    def pass_step(self, seqs: list[Sequence]) -> None:
        """A step of ``seqs`` that drafts nothing (a plain decode, queued while they pause)."""
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
        """After a verify: ``kept`` of ``proposed`` draft tokens kept, ``appended`` tokens appended (fewer
        than ``kept + 1`` when a stop condition came first). Updates the draft length and the counts."""
        self._length(seq).update(proposed, kept)
        accepted = min(kept, appended)
        self.stats.add(proposed, accepted, appended)
        self.request_stats.setdefault(seq.seq_id, SpeculativeStats()).add(proposed, accepted, appended)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's index (or draft-model shadow), draft length and statistics."""
        if self.draft_model is not None:
            self.draft_model.forget(seq)
        self._indexes.pop(seq.seq_id, None)
        self._lengths.pop(seq.seq_id, None)
        self.request_stats.pop(seq.seq_id, None)

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
