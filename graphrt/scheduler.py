"""Continuous batching: each step runs every running sequence's next decode plus as many waiting
prefills as blocks, ``max_num_seqs`` and the token budget allow. When blocks run out the newest
running sequence is preempted: its blocks are freed and it is recomputed later (no request is lost).

With chunked prefill the token budget (``max_num_batched_tokens``) is shared: a step runs every
decode (a token each), then the next chunk of each running sequence still prefilling (oldest first),
then admits waiting prompts with their first chunk, each chunk as long as the budget left allows. A
prompt's blocks are allocated whole when it is admitted; a chunk computes the K/V of its tokens over
the cached ones before them, and the chunk that reaches the prompt's end samples its first token.
A sequence whose prompt has one token left decodes it (the decode of position ``num_tokens - 1``
samples the same output index as the prefill would). A request asking for ``prompt_logprobs`` is
prefilled in chunks too (each chunk scores its rows) but takes no cached prefix: every token is scored.
A pipelined engine plans a step before the previous one's tokens are read with ``chunks_under_way`` and
``admit_blind``: the same order and budget, each chunk stopping a token short of its prompt's end (that
token is then decoded, fed from the host beside the carried rows).

With a swap space (``graphrt.swap_space``) a preempted decoding sequence whose blocks fit it is swapped
out instead of recomputed, and swapped back in (before the step's decodes are scheduled, so it
decodes in that step) once it is the oldest waiting sequence and its blocks fit with one to spare
for each running sequence; ``SchedulerOutput.swap_in`` / ``swap_out`` list the block copies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from graphrt.block_manager import BlockManager
from graphrt.sequence import Sequence, SequenceStatus
from graphrt.swap_space import SwapSpace


@dataclass
class SchedulerOutput:
    """What one step runs: ``prefills`` first (``prefill_tokens[i]`` of each one's uncomputed tokens:
    all of them without chunked prefill), then ``decodes`` (one token each)."""

    prefills: list[Sequence] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: Block copies to make before the step's forward: (host, device) pairs, then (device, host) pairs.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    #: The sequences those copies are for.
    swapped_in: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


def is_prefilling(seq: Sequence) -> bool:
    """Whether a running sequence still has prompt (or recomputed) tokens to prefill beyond the newest."""
    return seq.num_computed_tokens < seq.num_tokens - 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = False, swap: SwapSpace | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        #: Where preempted sequences' blocks go instead of being recomputed (None: recompute).
        self.swap = swap
        self.waiting: deque[Sequence] = deque()
        #: In arrival order, so the last one is the newest (the one preemption takes).
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._swap_in(out)
        self._schedule_decodes(out)
        budget = self.max_num_batched_tokens - len(out.decodes)
        for seq in self.running:  # prefills under way hold their blocks already
            if budget > 0 and is_prefilling(seq):
                out.prefills.append(seq)
                out.prefill_tokens.append(min(seq.num_tokens - seq.num_computed_tokens, budget))
                budget -= out.prefill_tokens[-1]
        # After a preemption the cache is full: admitting prompts now would only evict them again.
        if not out.preempted:
            self._schedule_prefills(out, token_budget=budget)
        return out

    def chunks_under_way(self, token_budget: int) -> tuple[list[Sequence], list[int]]:
        """The next chunk of each prefill under way, oldest first, within ``token_budget`` tokens, for a
        step planned before the previous step's tokens are read (a pipelined step): as ``schedule`` gives
        them, but each stops one token short of its sequence's end, since the chunk that reaches the end
        samples a token, which such a step cannot read; that last token is decoded in a later step.
        Returns the sequences and their chunks' lengths (their blocks are allocated already)."""
        prefills: list[Sequence] = []
        lengths: list[int] = []
        for seq in self.running:
            if token_budget > 0 and is_prefilling(seq):
                prefills.append(seq)
                lengths.append(min(seq.num_tokens - 1 - seq.num_computed_tokens, token_budget))
                token_budget -= lengths[-1]
        return prefills, lengths

    def has_prefill_under_way(self) -> bool:
        """Whether a running sequence has prompt chunks left (chunked prefill)."""
        return any(is_prefilling(seq) for seq in self.running)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            if is_prefilling(seq):  # its chunks come after the decodes
                index += 1
                continue
            # The token decoded this step sits at position num_tokens - 1: the table must cover it.
            while not self.block_manager.can_grow(seq.seq_id, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is seq:
                    return
            self.block_manager.grow(seq.seq_id, seq.num_tokens)
            out.decodes.append(seq)
            index += 1

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Swapped sequences at the head of the queue back to running while their blocks fit with one to
        spare for each running sequence (its next token's, so the swap-in does not preempt at once)."""
        while self.can_swap_in():
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq.seq_id, seq.num_tokens)
            out.swap_in.extend(self.swap.swap_in(seq.seq_id, self.block_manager.block_table(seq.seq_id)))
            out.swapped_in.append(seq)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)

    def can_swap_in(self) -> bool:
        """Whether the oldest waiting sequence is swapped and would be swapped back in now."""
        if self.swap is None or not self.waiting or not self.swap.holds(self.waiting[0].seq_id):
            return False
        needed = self.block_manager.blocks_needed(self.waiting[0].num_tokens) + len(self.running)
        return len(self.running) < self.max_num_seqs and needed <= self.block_manager.num_free_blocks

    def abandon_swaps(self, out: SchedulerOutput) -> None:
        """The copies of ``out`` failed (or were interrupted): its swapped-in sequences and its swapped-out
        ones are recomputed instead (their blocks may hold nothing of theirs)."""
        for seq in out.swapped_in:
            if seq in self.running:
                self._return_to_waiting(seq)
        for seq in out.swapped_out:
            self.swap.drop(seq.seq_id)
            seq.num_computed_tokens = 0

    def can_admit(self, token_budget: int | None = None) -> bool:
        """Whether the oldest waiting sequence would be admitted (prefilled) now, within ``token_budget``
        prompt tokens (default: the whole ``max_num_batched_tokens``)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        if self.swap is not None and self.swap.holds(self.waiting[0].seq_id):
            return False  # it is swapped back in, not prefilled
        seq = self.waiting[0]
        budget = self.max_num_batched_tokens if token_budget is None else token_budget
        needed = 1 if self.chunked_prefill else seq.num_tokens
        return needed <= budget and self.block_manager.can_allocate(seq.num_tokens)

    def _schedule_prefills(self, out: SchedulerOutput, token_budget: int) -> None:
        while self.can_admit(token_budget):
            seq = self._admit()
            out.prefills.append(seq)
            out.prefill_tokens.append(min(seq.num_tokens - seq.num_computed_tokens, token_budget))
            token_budget -= out.prefill_tokens[-1]

    def admit_blind(self, token_budget: int) -> Sequence | None:
        """For a step planned before the previous step's tokens are read (a pipelined step): admit the
        oldest waiting prompt as ``schedule`` would (``can_admit(token_budget)``), with chunked prefill,
        unless it scores its prompt (its chunks must be read); None, admitting nothing, otherwise. Its
        first chunk stops a token short of its end (``chunks_under_way`` gives the next ones): with a
        cached prefix, no chunk at all may be left."""
        if not self.chunked_prefill or not self.can_admit(token_budget) or self.waiting[0].needs_prompt_logprobs:
            return None
        return self._admit()

    def _admit(self) -> Sequence:
        """The oldest waiting sequence into ``running``, its blocks allocated whole (with prefix caching,
        the K/V of its leading full blocks may be there already: ``num_computed_tokens`` covers them)."""
        seq = self.waiting.popleft()
        if seq.needs_prompt_logprobs:  # every prompt token is scored, so none comes from the cache
            self.block_manager.allocate(seq.seq_id, seq.num_tokens)
        else:
            seq.num_computed_tokens = self.block_manager.allocate_with_prefix(
                seq.seq_id, seq.all_token_ids, count=seq.num_preemptions == 0)
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)
        return seq

    def _insert_running(self, seq: Sequence) -> None:
        """Keep ``running`` in arrival order (a recomputed sequence is older than newer arrivals)."""
        position = len(self.running)
        while position > 0 and self.running[position - 1].seq_id > seq.seq_id:
            position -= 1
        self.running.insert(position, seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap ``seq`` out where a swap space holds its blocks (a decoding sequence: its K/V complete up
        to its newest token), else send it back to be recomputed."""
        seq.num_preemptions += 1
        table = self.block_manager.block_table(seq.seq_id)
        if self.swap is None or is_prefilling(seq) or not self.swap.fits(len(table)):
            self._return_to_waiting(seq)
            return
        out.swap_out.extend(self.swap.swap_out(seq.seq_id, table))
        out.swapped_out.append(seq)
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING  # its computed tokens kept: it resumes decoding
        self.waiting.appendleft(seq)

    def _return_to_waiting(self, seq: Sequence) -> None:
        """A running sequence back to the front of the queue, its blocks freed, to be prefilled again
        (it is older than every queued one)."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def requeue_prefills(self, seqs: list[Sequence]) -> None:
        """Sequences admitted by the last ``schedule`` whose step failed (an exception or interrupt in
        the forward): their prompts' K/V may be half-written, so they go back to the queue in the order
        they were admitted, to be prefilled again; without this the next step would decode them on a
        cache that lacks their prompts."""
        for seq in reversed(seqs):
            if seq in self.running:
                self._return_to_waiting(seq)

    def finish_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """After tokens were appended: release finished sequences' blocks; returns those finished."""
        finished = [s for s in seqs if s.is_finished]
        for seq in finished:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        return finished
