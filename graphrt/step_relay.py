"""Rank 0's model calls relayed to the other tensor-parallel ranks (``graphrt.distributed``).

``RelayingRunner`` stands for rank 0's ``ModelRunner``: each call that runs the model is first sent,
with what changed of the sequences it reads and of their block tables, to the other ranks, whose
``follow_steps`` loop keeps copies of both and makes the same call on their own runner. Swap copies are relayed the same way. The other
ranks' results are not read: every rank samples the same tokens (``graphrt.models.tensor_parallel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from graphrt.base.errors import GraphrtError
from graphrt.block_manager import BlockManager, BlockTables
from graphrt.distributed import RankGroup
from graphrt.model_runner import ModelRunner
from graphrt.sequence import Sequence
from graphrt.swap_space import SwapSpace


#: How long a broken collective waits for a rank's exit to register before it is reported as itself: a
#: killed rank's sockets close (and its peers' reads fail) a moment before its exit is visible.
_RANK_EXIT_WAIT_SECONDS = 2.0


def _light(seq: Sequence) -> Sequence:
    """What another rank's runner reads of a sequence it has not seen: the sequence without its text and
    the logprobs of its outputs so far."""
    return dataclasses.replace(seq, prompt=None, output_logprobs=[])


@dataclass(frozen=True)
class _SequenceIds:
    """A call's list of sequences, sent as their ids (the other ranks hold copies of them)."""

    ids: tuple[int, ...]


class RelayingRunner:
    """Rank 0's ``ModelRunner`` over several ranks: ``execute``, ``verify``, ``launch_decode`` and
    ``launch_chunks`` are sent to the other ranks before they run here; everything else is the local
    runner's.

    A message carries what changed since the last one: a sequence the others have not seen, whole; of
    one they hold, the tokens appended since and its computed count; block tables whose version changed;
    the sequences finished since (``forget``). A decode step of B sequences sends about B small tuples.
    """

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, ranks: RankGroup) -> None:
        self._runner = runner
        self._block_manager = block_manager
        self._ranks = ranks
        #: Per sequence the other ranks hold: how many of its tokens they have, its table's version.
        self._sent_tokens: dict[int, int] = {}
        self._sent_versions: dict[int, int] = {}
        self._forgotten: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def forget(self, seq_id: int) -> None:
        """A sequence is finished: the other ranks drop their copy with the next message."""
        if self._sent_tokens.pop(seq_id, None) is not None:
            self._sent_versions.pop(seq_id, None)
            self._forgotten.append(seq_id)

    def _relay(self, method: str, args: tuple, kwargs: dict) -> None:
        """Send the call ``method(*args, **kwargs)`` with what the other ranks lack of its sequences."""
        seqs = {seq.seq_id: seq for arg in args if isinstance(arg, list) for seq in arg if isinstance(seq, Sequence)}
        updates = []
        for seq_id, seq in seqs.items():
            held = self._sent_tokens.get(seq_id)
            if held is None:
                updates.append((seq_id, _light(seq)))
            else:
                updates.append((seq_id, seq.token_ids_between(held, seq.num_tokens), seq.num_computed_tokens))
            self._sent_tokens[seq_id] = seq.num_tokens
        tables = {}
        for seq_id in seqs:
            version = self._block_manager.table_version(seq_id)
            if self._sent_versions.get(seq_id) != version:
                tables[seq_id] = (self._block_manager.block_table(seq_id), version)
                self._sent_versions[seq_id] = version
        args = tuple(_SequenceIds(tuple(seq.seq_id for seq in arg)) if isinstance(arg, list) and arg
                     and isinstance(arg[0], Sequence) else arg for arg in args)
        forgotten, self._forgotten = self._forgotten, []
        self._ranks.send(("run", method, args, kwargs, updates, tables, forgotten), within_step=True)

    def _in_step(self, method: str, args: tuple, kwargs: dict, run):
        """Relay the call, then ``run()`` it here. Until both return the ranks count as out of step
        (``RankGroup.out_of_step``), which an interruption leaves them; a collective broken by a rank that
        exited is reported as that rank's failure."""
        ranks = self._ranks
        if ranks.out_of_step:
            ranks.send(("run",))  # refuses, naming why
        ranks.out_of_step = True
        try:
            self._relay(method, args, kwargs)
            result = run()
        except RuntimeError as error:  # gloo / NCCL: a peer went away
            failed = ranks.failed_rank(wait=_RANK_EXIT_WAIT_SECONDS)
            if failed is None:
                raise
            raise GraphrtError(f"{failed}; close this engine") from error
        ranks.out_of_step = False
        return result

    def execute(self, prefills: list[Sequence], decodes: list[Sequence], prefill_tokens: list[int] | None = None):
        return self._in_step("execute", (prefills, decodes, prefill_tokens), {},
                             lambda: self._runner.execute(prefills, decodes, prefill_tokens))

    def verify(self, decodes: list[Sequence], drafts: list[list[int]]):
        return self._in_step("verify", (decodes, drafts), {}, lambda: self._runner.verify(decodes, drafts))

    def launch_decode(self, decodes: list[Sequence], ahead_from: list[int] | None = None):
        return self._in_step("launch_decode", (decodes,), {"ahead_from": ahead_from},
                             lambda: self._runner.launch_decode(decodes, ahead_from=ahead_from))

    def launch_chunks(self, prefills: list[Sequence], lengths: list[int], decodes: list[Sequence],
                      ahead_from: list[int] | None = None):
        return self._in_step("launch_chunks", (prefills, lengths, decodes), {"ahead_from": ahead_from},
                             lambda: self._runner.launch_chunks(prefills, lengths, decodes, ahead_from=ahead_from))

    def copy_swaps(self, swap_space: SwapSpace, swap_in: list[tuple[int, int]],
                   swap_out: list[tuple[int, int]]) -> None:
        """``ModelRunner.copy_swaps`` here and on every other rank (each its own cache)."""
        self._ranks.send(("swap", swap_in, swap_out))
        self._runner.copy_swaps(swap_space, swap_in, swap_out)


_RUNNABLE = ("execute", "verify", "launch_decode", "launch_chunks")


@torch.inference_mode()
def follow_steps(runner: ModelRunner, swap_space: SwapSpace | None, ranks: RankGroup) -> None:
    """Ranks 1 .. N-1: make each call rank 0 relays on ``runner`` (whose block tables must be a
    ``BlockTables``, kept as rank 0's) over copies of its sequences, until rank 0 says close."""
    tables: BlockTables = runner.block_manager
    copies: dict[int, Sequence] = {}
    while True:
        message = ranks.receive()
        kind = message[0]
        if kind == "close":
            return
        if kind == "swap":
            runner.copy_swaps(swap_space, message[1], message[2])
            continue
        if kind != "run" or message[1] not in _RUNNABLE:
            raise RuntimeError(f"tensor-parallel rank {ranks.rank}: unknown message {kind!r} from rank 0")
        _, method, args, kwargs, updates, changed_tables, forgotten = message
        for seq_id in forgotten:
            del copies[seq_id]
            tables.drop(seq_id)
        for update in updates:
            if len(update) == 2:
                copies[update[0]] = update[1]
            else:
                seq_id, appended, computed = update
                copy = copies[seq_id]
                copy.output_token_ids.extend(appended)
                copy.num_computed_tokens = computed
        tables.update(changed_tables)
        args = [[copies[seq_id] for seq_id in arg.ids] if isinstance(arg, _SequenceIds) else arg for arg in args]
        getattr(runner, method)(*args, **kwargs)
