"""Drafts from a second, smaller model with the target's tokenizer: its own weights, KV cache, block
tables and decode graphs, on the target's device.

The draft model keeps a shadow of every sequence it drafts for: the target's tokens, and how many of
them its cache holds. A step's drafts take up to k of its forwards: the first catches each shadow up
(a prefill of the tokens its cache lacks: the whole prompt at first, the newest one or two after a
verify) or decodes its newest token, the others decode the token just drafted. Each draws with the
request's own sampling parameters, seed and output index, so that where the draft model agrees with
the target the target's draw is the drafted token. After the verify, the shadow's cache stays valid up
to the first draft token the target did not keep.
"""

from __future__ import annotations

import dataclasses

from graphrt.block_manager import BlockManager
from graphrt.sequence import Sequence


class DraftModel:
    """``runner``: a ``graphrt.model_runner.ModelRunner`` over the draft model, its cache and
    ``block_manager``; the engine builds both and closes the runner's decode graphs."""

    def __init__(self, runner, block_manager: BlockManager) -> None:
        self.runner, self.block_manager = runner, block_manager
        self._shadows: dict[int, Sequence] = {}
        self._drafted: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (output length, draft) of the last step

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` draft tokens for ``seqs[i]`` (0: none). A sequence whose shadow cannot get
        the blocks it needs drafts nothing this step (its shadow is dropped, to be rebuilt later)."""
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        active = [(self._synced(seq), length) for seq, length in zip(seqs, lengths) if length > 0]
        for shadow, _ in active:  # recorded first, so that an interrupted step still leaves a true record
            self._drafted[shadow.seq_id] = (len(shadow.output_token_ids), drafts[shadow.seq_id])
        try:
            self._draft_rounds(active, drafts)
        finally:
            for shadow, _ in active:  # the drafts come off again; the next sync keeps what the target kept
                if shadow.seq_id in self._shadows:
                    del shadow.output_token_ids[self._drafted[shadow.seq_id][0]:]
        return [drafts[seq.seq_id] for seq in seqs]

    def _draft_rounds(self, active: list[tuple[Sequence, int]], drafts: dict[int, list[int]]) -> None:
        """Up to ``length`` forwards for each (shadow, length), each appending a drafted token to the
        shadow and to ``drafts``."""
        for round_index in range(max((length for _, length in active), default=0)):
            batch = []
            for shadow, length in active:
                if length <= round_index or shadow.seq_id not in self._shadows:
                    continue
                if not self.block_manager.can_grow(shadow.seq_id, shadow.num_tokens):
                    self._drop(shadow.seq_id)
                    drafts[shadow.seq_id].clear()
                    continue
                self.block_manager.grow(shadow.seq_id, shadow.num_tokens)
                batch.append(shadow)
            if not batch:
                break
            catch_up = [s for s in batch if s.num_computed_tokens < s.num_tokens - 1]
            up_to_date = [s for s in batch if s.num_computed_tokens >= s.num_tokens - 1]
            tokens, _ = self.runner.execute(catch_up, up_to_date)
            for shadow, token in zip(catch_up + up_to_date, tokens):
                shadow.output_token_ids.append(token)
                drafts[shadow.seq_id].append(token)

    def forget(self, seq: Sequence) -> None:
        """Release a finished sequence's shadow and its blocks."""
        self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        if self._shadows.pop(seq_id, None) is not None:
            self.block_manager.free(seq_id)
        self._drafted.pop(seq_id, None)

    def _synced(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow holding its tokens now, its cache count cut to the tokens it still agrees on."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            params = dataclasses.replace(seq.params, logprobs=None, prompt_logprobs=None)
            shadow = Sequence(seq.seq_id, seq.request_id, list(seq.prompt_token_ids), params, seq.seed)
            self.block_manager.allocate(seq.seq_id, 0)
            self._shadows[seq.seq_id] = shadow
        elif seq.seq_id in self._drafted:  # the last step that drafted (steps between drafted nothing)
            base, draft = self._drafted.pop(seq.seq_id)
            kept = seq.output_token_ids[base:]
            agreed = 0
            while agreed < min(len(draft), len(kept)) and draft[agreed] == kept[agreed]:
                agreed += 1
            valid = len(seq.prompt_token_ids) + base + agreed
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid)
        shadow.output_token_ids = list(seq.output_token_ids)
        return shadow
