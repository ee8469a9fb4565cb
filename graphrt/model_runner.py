"""Turns a scheduled step into tensors once, runs the model, and samples one token per sequence.

A step's prompt tokens replay a captured prompt graph padded to a bucket of tokens when one holds
them (``graphrt.capture.prefill_graphs``), else run eagerly; its decodes go through the decode graph
runner, which replays a captured CUDA graph when it can. A step with both runs them in one forward
where a mixed graph holds it (the prompt tokens first, then the decode rows: the weights are read once
for both, and the decodes sample inside the graph); otherwise the prompt forward first, then the
decode replay, so that new prompts never knock running sequences off their graphs.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from graphrt.attention import AttentionBackend
from graphrt.attention.metadata import pinned_to_device
from graphrt.base import nvtx
from graphrt.block_manager import BlockManager
from graphrt.capture import DecodeBatch, DecodeGraphRunner, DecodePlan, PendingTokens
from graphrt.capture.prefill_graphs import PrefillGraphRunner
from graphrt.models.llama import LlamaForCausalLM
from graphrt.sampling.logprobs import (
    PROMPT_ROWS_PER_CHUNK,
    TokenLogprobs,
    prompt_logprobs,
    rows_logprobs,
    token_logprobs,
)
from graphrt.sampling.sampler import SamplingTensors
from graphrt.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class _PromptStep:
    """A step's prompt tokens: per token its id, position and cache slot; per sequence its new tokens,
    its length after them and its block table."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    ends: list[int]
    tables: list[list[int]]

    @classmethod
    def build(cls, seqs: list[Sequence], lengths: list[int] | None, block_manager: BlockManager) -> _PromptStep:
        """Each sequence's uncomputed tokens, ``lengths[i]`` of them when given (a chunk)."""
        step = cls([], [], [], [], [], [])
        for index, seq in enumerate(seqs):
            start = seq.num_computed_tokens
            end = seq.num_tokens if lengths is None else min(seq.num_tokens, start + lengths[index])
            step.input_ids.extend(seq.all_token_ids[start:end])
            step.positions.extend(range(start, end))
            step.slots.extend(block_manager.slots(seq.seq_id, start, end))
            step.query_lens.append(end - start)
            step.ends.append(end)
            step.tables.append(block_manager.block_table(seq.seq_id))
        return step


class ModelRunner:
    """Runs scheduled steps over the paged KV cache: prefills eagerly, decodes through ``decode_runner``.

    kv_caches: one tensor per layer, shaped by ``backend.get_kv_cache_shape``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: type[AttentionBackend],
        block_manager: BlockManager,
        decode_runner: DecodeGraphRunner,
        kv_scales_pending: bool = False,
        progress: bool = True,
        prefill_graphs: PrefillGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_manager = block_manager
        self.decode_runner = decode_runner
        self.device = decode_runner.device
        self.block_size = block_manager.block_size
        #: Prefill tokens are chosen as decode tokens are, by the model's kernel policy, so a request's
        #: draws come from one race formula.
        self._sample = model.kernel_policy.sample
        #: True until the first prefill, when asked (``EngineConfig.calibrate_kv_scales``): the fp8 cache's
        #: scales are measured over it, then the decode graphs captured (``progress``: their progress bar).
        self.kv_scales_pending = kv_scales_pending
        self._progress = progress
        #: Captured prompt steps (None: every prompt step eager).
        self.prefill_graphs = prefill_graphs

    def execute(self, prefills: list[Sequence], decodes: list[Sequence], prefill_tokens: list[int] | None = None
                ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Run one step; returns the sampled token id of each sequence, prefills first then decodes, and
        each one's logprobs (None where the request did not ask). ``prefill_tokens[i]``: how many of
        ``prefills[i]``'s uncomputed tokens to run (default all); a prefill whose chunk stops short of
        its last token samples nothing (token None). Scores the prompts of prefills that asked for
        prompt logprobs (``Sequence.prompt_logprobs``)."""
        if prefills and decodes:
            mixed = self._execute_mixed(prefills, decodes, prefill_tokens)
            if mixed is not None:
                return mixed
        tokens, logprobs = self._prefill(prefills, prefill_tokens) if prefills else ([], [])
        if decodes:
            with nvtx.decode(len(decodes)):
                pending = self.decode_runner.launch(self._decode_batch(decodes))
                tokens += pending.result()
            logprobs += pending.logprobs()
            for seq in decodes:
                seq.num_computed_tokens = seq.num_tokens
        return tokens, logprobs

    def copy_swaps(self, swap_space, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """A step's swap copies between this runner's KV cache and ``swap_space`` (a ``SwapSpace``):
        ``swap_in`` (host, device) pairs, then ``swap_out`` (device, host) pairs."""
        swap_space.copy(self.kv_caches, swap_in, swap_out)

    def verify(self, decodes: list[Sequence], drafts: list[list[int]]
               ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """One decode step over each sequence's newest token and its draft (``graphrt.speculative.drafting``:
        ``len(draft) + 1`` virtual rows a sequence, consecutive positions, one block table, which must
        already cover them); returns per sequence the target's token of each row, and their logprobs
        (None where the request did not ask). Advances nothing: the caller appends what it keeps and
        sets ``num_computed_tokens``."""
        rows = [len(draft) + 1 for draft in drafts]
        with nvtx.range("verify"), nvtx.decode(sum(rows)):
            pending = self.decode_runner.launch(self._decode_batch(decodes, drafts=drafts))
            tokens, logprobs = pending.result(), pending.logprobs()
        sampled, scored, start = [], [], 0
        for count in rows:
            sampled.append(tokens[start:start + count])
            scored.append(logprobs[start:start + count])
            start += count
        return sampled, scored

    def launch_decode(self, decodes: list[Sequence], ahead_from: list[int] | None = None) -> PendingTokens:
        """Queue the decode of ``decodes`` without waiting for it (``DecodeGraphRunner.launch``).

        ``ahead_from``: each sequence's newest token is still on the device, sampled by the previous
        launch in row ``ahead_from[i]``, and not yet appended: its position is ``num_tokens`` and its
        input id is carried on the device. The block tables must already cover that position. Where
        ``ahead_from[i]`` is None the sequence decodes its newest token from the host as without
        ``ahead_from`` (a prompt's last token, beside the carried rows). The caller appends the tokens
        and advances ``num_computed_tokens`` when it reads them."""
        ahead = None if ahead_from is None else [row is not None for row in ahead_from]
        with nvtx.decode(len(decodes)):
            return self.decode_runner.launch(self._decode_batch(decodes, ahead), carry_rows=ahead_from)

    def can_launch_chunks(self, prefills: list[Sequence], lengths: list[int]) -> bool:
        """Whether ``launch_chunks`` takes these chunks: none reaches its sequence's last token (that one
        samples, which needs the host), none scores its prompt, no KV scales are still to calibrate."""
        return not self.kv_scales_pending and all(
            seq.num_computed_tokens + length < seq.num_tokens and not seq.needs_prompt_logprobs
            for seq, length in zip(prefills, lengths))

    def launch_chunks(self, prefills: list[Sequence], lengths: list[int], decodes: list[Sequence],
                      ahead_from: list[int] | None = None) -> PendingTokens:
        """Queue a step of prompt chunks and decodes without waiting for it: ``prefills``' chunks
        (``lengths[i]`` tokens each; ``can_launch_chunks`` must hold: nothing of theirs is sampled) and
        the decode of ``decodes`` (``ahead_from`` as for ``launch_decode``), in one forward where a mixed
        graph holds the step, else the chunks' forward and then the decode's, each queued as it is.
        Advances the prefills' ``num_computed_tokens`` (their K/V is written in stream order, before any
        later step reads it); the caller advances the decodes' when it reads their tokens."""
        if not self.can_launch_chunks(prefills, lengths):
            raise ValueError("launch_chunks: a chunk reaches its sequence's last token, scores its prompt, or "
                             "the KV scales are still to calibrate")
        mixed = self._plan_mixed(prefills, lengths, decodes,
                                 ahead=None if ahead_from is None else [row is not None for row in ahead_from])
        if mixed is None:
            self._prefill(prefills, lengths)  # samples nothing: no chunk reaches its end
            return self.launch_decode(decodes, ahead_from=ahead_from)
        step, batch, plan = mixed
        with nvtx.mixed(len(prefills), len(step.input_ids), len(decodes)):
            return self._queue_mixed(prefills, step, batch, plan, carry_rows=ahead_from)

    def _plan_mixed(self, prefills: list[Sequence], lengths: list[int] | None, decodes: list[Sequence],
                    ahead: list[bool] | None = None) -> tuple[_PromptStep, DecodeBatch, DecodePlan] | None:
        """The prompt step, the decode batch (``ahead`` as for ``_decode_batch``) and the mixed graph's
        plan for running both in one forward; None, having run nothing, when none holds them: prompt
        logprobs or KV scales to calibrate, more prompt tokens or sequences than the prompt segment
        holds, a decode batch the decode graphs do not."""
        graphs = self.prefill_graphs
        if (graphs is None or self.kv_scales_pending or not self.decode_runner.mixed_buckets
                or any(seq.needs_prompt_logprobs for seq in prefills)):
            return None
        step = _PromptStep.build(prefills, lengths, self.block_manager)
        if not graphs.fits(len(step.input_ids), len(prefills), max(map(len, step.tables))):
            return None
        batch = self._decode_batch(decodes, ahead=ahead)
        plan = self.decode_runner.plan_mixed(batch, len(step.input_ids))
        return None if plan is None else (step, batch, plan)

    def _queue_mixed(self, prefills: list[Sequence], step: _PromptStep, batch: DecodeBatch, plan: DecodePlan,
                     carry_rows: list[int | None] | None = None) -> PendingTokens:
        """Stage ``step`` in the prompt segment and queue the mixed replay (``carry_rows`` as for
        ``DecodeGraphRunner.launch``); advances the prefills' ``num_computed_tokens``."""
        self.prefill_graphs.stage(step.input_ids, step.positions, step.slots, step.query_lens, step.ends,
                                  step.tables, plan.key.prompt_tokens)
        pending = self.decode_runner.launch(batch, carry_rows=carry_rows, plan=plan)
        for seq, end in zip(prefills, step.ends):
            seq.num_computed_tokens = end
        return pending

    def can_launch_ahead(self, decodes: list[Sequence], ahead_from: list[int]) -> bool:
        """Whether ``launch_decode(decodes, ahead_from)`` can run: the launch in flight ran through the
        decode runner's static buffers, so its tokens for rows ``ahead_from`` are there to carry (a batch
        that outgrew them ran outside, and its tokens come back through the host only), and one position
        further the batch still fits them (rows that outgrow them decode eagerly, from host ids)."""
        longest = max((seq.num_tokens + 1 for seq in decodes), default=0)
        return self.decode_runner.can_carry(ahead_from, longest)

    def _decode_batch(self, decodes: list[Sequence], ahead: list[bool] | None = None,
                      drafts: list[list[int]] | None = None) -> DecodeBatch:
        """The decode of each sequence's newest token (where ``ahead[i]``: of the token after it, its
        id carried on the device, see ``launch_decode``); with ``drafts``, each sequence's row followed
        by one row per draft token, at the next positions, sampling the next output indices
        (``verify``)."""
        rows: list[tuple[Sequence, int, int]] = []  # (sequence, input id, offset past its newest position)
        for index, seq in enumerate(decodes):
            carried = ahead is not None and ahead[index]
            rows.append((seq, 0 if carried else seq.last_token_id, int(carried)))
            if drafts is not None:
                rows.extend((seq, token, 1 + j) for j, token in enumerate(drafts[index]))
        tables = {seq.seq_id: (self.block_manager.block_table(seq.seq_id), self.block_manager.table_version(seq.seq_id))
                  for seq in decodes}
        positions = [seq.num_tokens - 1 + past for seq, _, past in rows]
        return DecodeBatch(
            input_ids=[token for _, token, _ in rows],
            positions=positions,
            block_tables=[tables[seq.seq_id][0] for seq, _, _ in rows],
            slot_mapping=[self.block_manager.slot(seq.seq_id, p) for (seq, _, _), p in zip(rows, positions)],
            params=[seq.params for seq, _, _ in rows],
            seeds=[seq.seed for seq, _, _ in rows],
            steps=[len(seq.output_token_ids) + past for seq, _, past in rows],
            block_table_versions=[tables[seq.seq_id][1] for seq, _, _ in rows],
        )

    @torch.inference_mode()
    def _execute_mixed(self, prefills: list[Sequence], decodes: list[Sequence], lengths: list[int] | None
                       ) -> tuple[list[int | None], list[TokenLogprobs | None]] | None:
        """``execute`` in one forward (a mixed graph, ``DecodeGraphRunner.plan_mixed``); None, having run
        nothing, when none holds the step (``_plan_mixed``)."""
        mixed = self._plan_mixed(prefills, lengths, decodes)
        if mixed is None:
            return None
        step, batch, plan = mixed
        with nvtx.mixed(len(prefills), len(step.input_ids), len(decodes)):
            pending = self._queue_mixed(prefills, step, batch, plan)
            token_ids, logprobs = self._sample_prompts(prefills, step, self.prefill_graphs.last_hidden,
                                                       torch.arange(len(prefills), device=self.device))
            token_ids += pending.result()
            logprobs += pending.logprobs()
        for seq in decodes:
            seq.num_computed_tokens = seq.num_tokens
        return token_ids, logprobs

    @torch.inference_mode()
    def _prefill(self, seqs: list[Sequence], lengths: list[int] | None = None
                 ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """One forward over every sequence's uncomputed tokens (``lengths[i]`` of them: a chunk,
        attending over the cached tokens before it; a prompt graph's replay where one holds the step,
        else eager), then one sampled token (and its logprobs where
        asked) for each sequence whose chunk reached its last token, None for the others; prompts that
        ask are scored too, chunk by chunk (``_score_prompts``)."""
        step = _PromptStep.build(seqs, lengths, self.block_manager)
        input_ids, positions, slots, query_lens, ends, tables = (
            step.input_ids, step.positions, step.slots, step.query_lens, step.ends, step.tables)
        graphs = self.prefill_graphs
        groups = None
        if graphs is not None and not self.kv_scales_pending and not any(seq.needs_prompt_logprobs for seq in seqs):
            groups = graphs.groups(query_lens, [len(table) for table in tables])
        with nvtx.prefill(len(seqs), len(input_ids)):
            if groups is not None:
                hidden, last_token_rows = self._prefill_in_graphs(groups, input_ids, positions, slots, query_lens,
                                                                  ends, tables)
                scored_prompts = [None] * len(seqs)
            else:
                hidden, last_token_rows = self._prefill_eagerly(input_ids, positions, slots, query_lens, ends, tables)
                scored_prompts = self._score_prompts(seqs, hidden, query_lens)
        token_ids, logprobs = self._sample_prompts(seqs, step, hidden, last_token_rows)
        for seq, end, scored in zip(seqs, ends, scored_prompts):
            seq.num_computed_tokens = end
            if scored is not None:
                seq.prompt_logprobs = scored
        return token_ids, logprobs

    def _sample_prompts(self, seqs: list[Sequence], step: _PromptStep, hidden: torch.Tensor,
                        last_token_rows: torch.Tensor) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """One token (and its logprobs where asked) for each sequence whose chunk reached its prompt's
        end, None for the others; ``hidden[last_token_rows[i]]`` is sequence i's last new row."""
        token_ids: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        done = [row for row, (seq, end) in enumerate(zip(seqs, step.ends)) if end == seq.num_tokens]
        if not done:
            return token_ids, logprobs
        sampled_seqs = [seqs[row] for row in done]
        if len(done) < len(seqs):  # each finished prompt's last new token
            last_token_rows = last_token_rows[pinned_to_device(done, torch.int64, last_token_rows.device)]
        logits = self.model.compute_logits(hidden[last_token_rows])  # [B, V] float32
        with nvtx.range("sample"):
            sampling = SamplingTensors.from_params(
                [seq.params for seq in sampled_seqs],
                seeds=[seq.seed for seq in sampled_seqs],
                steps=[len(seq.output_token_ids) for seq in sampled_seqs],
                device=self.device,
            )
            sampled = self._sample(logits, sampling)
            sampled_logprobs = rows_logprobs(logits, sampled, [seq.params.logprobs for seq in sampled_seqs])
            for row, token_id, token_logprobs in zip(done, sampled.tolist(), sampled_logprobs):
                token_ids[row], logprobs[row] = token_id, token_logprobs  # the tokens' copy came first
        return token_ids, logprobs

    def _prefill_in_graphs(self, groups: list[range], input_ids: list[int], positions: list[int], slots: list[int],
                           query_lens: list[int], ends: list[int], tables: list[list[int]]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt step through prompt graphs, a replay per group of sequences (``PrefillGraphRunner.groups``):
        hidden states and each sequence's last new row in them, as ``_prefill_eagerly`` gives. With one
        group, the graph's output itself; with several, each sequence's last row, copied out of each
        replay's output before the next replay overwrites it."""
        token_starts = [0, *itertools.accumulate(query_lens)]
        last_rows: list[torch.Tensor] = []
        for group in groups:
            first, stop = token_starts[group.start], token_starts[group.stop]
            hidden = self.prefill_graphs.run(
                input_ids[first:stop], positions[first:stop], slots[first:stop], query_lens[group.start:group.stop],
                ends[group.start:group.stop], tables[group.start:group.stop])
            rows = pinned_to_device([token_starts[i + 1] - 1 - first for i in group], torch.int64, self.device)
            if len(groups) == 1:
                return hidden, rows
            last_rows.append(hidden[rows])  # a copy: the next replay overwrites the graph's output
        hidden = torch.cat(last_rows)
        return hidden, torch.arange(hidden.shape[0], device=self.device)

    def _prefill_eagerly(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
                         ends: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager forward of a prompt step (the KV scales calibrated over it first when pending):
        the final hidden states [T, hidden] and each sequence's last new row [B] int64."""
        metadata = self.backend.make_metadata(
            query_lens=query_lens,
            seq_lens=ends,
            num_prefills=len(query_lens),
            block_tables=tables,
            slot_mapping=slots,
            block_size=self.block_size,
            device=self.device,
        )
        ids = pinned_to_device(input_ids, torch.int64, self.device)
        position_ids = pinned_to_device(positions, torch.int64, self.device)
        if self.kv_scales_pending:
            self._calibrate_kv_scales(ids, position_ids, metadata)
        hidden = self.model(ids, position_ids, self.kv_caches, metadata)
        return hidden, metadata.query_start_loc[1:].long() - 1

    def _calibrate_kv_scales(self, ids: torch.Tensor, positions: torch.Tensor, metadata) -> None:
        """The first prefill's forward once to measure the layers' largest k and v (its cache writes,
        with the old scales, are overwritten by the forward that follows), the scales set, then the
        decode graphs captured with them."""
        with nvtx.range("calibrate kv scales"):
            scales = self.model.calibrate_kv_scales(lambda: self.model(ids, positions, self.kv_caches, metadata))
        self.kv_scales_pending = False
        if self.prefill_graphs is not None:  # the scales are baked into the prompt graphs too
            self.prefill_graphs.capture(progress=self._progress)
        if scales:
            logger.info("KV-cache scales calibrated over %d prompt tokens: k %.3g..%.3g, v %.3g..%.3g",
                        ids.shape[0], min(k for k, _ in scales), max(k for k, _ in scales),
                        min(v for _, v in scales), max(v for _, v in scales))
        self.decode_runner.capture(progress=self._progress)

    def _score_prompts(self, seqs: list[Sequence], hidden: torch.Tensor,
                       query_lens: list[int]) -> list[list[TokenLogprobs | None] | None]:
        """Prompt logprobs, chunk by chunk, from the forward's hidden states [T, hidden]: each sequence that
        asks and has none yet scores this prefill's rows of its prompt (added to
        ``partial_prompt_logprobs``; a chunk from token 0 starts afresh, as a recomputation does). Returns
        each sequence's whole list once this prefill's rows complete it (the prompt's last row scores
        nothing, so a chunk ending one token short completes it), else None."""
        scored: list[list[TokenLogprobs | None] | None] = []
        start = 0
        for seq, length in zip(seqs, query_lens):
            whole = None
            first, prompt = seq.num_computed_tokens, seq.prompt_token_ids
            rows = min(length, len(prompt) - first)  # a recomputation's rows past the prompt score nothing
            if seq.needs_prompt_logprobs and rows > 0:
                if first == 0:
                    seq.partial_prompt_logprobs = []
                seq.partial_prompt_logprobs += prompt_logprobs(self.model.compute_logits, hidden[start:start + rows],
                                                               prompt, seq.params.prompt_logprobs, first=first)
                if first + rows >= len(prompt) - 1:  # every entry is in (the last row scores nothing)
                    whole, seq.partial_prompt_logprobs = seq.partial_prompt_logprobs, []
            scored.append(whole)
            start += length
        return scored


@torch.inference_mode()
def profile_prefill_peak_memory(
    model: LlamaForCausalLM,
    backend: type[AttentionBackend],
    block_size: int,
    device: torch.device,
    num_tokens: int,
    max_seq_len: int,
    max_logprobs: int = 0,
) -> int:
    """Peak CUDA bytes of a prefill of ``num_tokens`` tokens (in sequences of at most ``max_seq_len``)
    with no KV cache, its prompt scored for ``max_logprobs`` top logprobs too when that is > 0 (the most a
    prefill allocates); sizes the cache on GPU."""
    seq_lens = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
    metadata = backend.make_metadata(
        query_lens=seq_lens,
        seq_lens=seq_lens,
        num_prefills=len(seq_lens),
        block_tables=[[] for _ in seq_lens],
        slot_mapping=[-1] * num_tokens,
        block_size=block_size,
        device=device,
    )
    input_ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
    torch.cuda.reset_peak_memory_stats(device)
    hidden = model(input_ids, positions, [None] * len(model.layers), metadata)
    model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
    if max_logprobs:
        scored = min(num_tokens, PROMPT_ROWS_PER_CHUNK)  # prompt logprobs score this many rows at a time
        token_logprobs(model.compute_logits(hidden[:scored]), input_ids[:scored],
                       min(max_logprobs, model.config.vocab_size))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
