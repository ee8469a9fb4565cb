"""Rank 0's model calls relayed to the other tensor-parallel ranks (``graphrt.distributed``).

``RelayingRunner`` stands for rank 0's ``ModelRunner``: each call that runs the model is first sent,
with the block tables of the sequences it reads, to the other ranks, whose ``follow_steps`` loop makes
the same call on their own runner over those tables. Swap copies are relayed the same way. The other
ranks' results are not read: every rank samples the same tokens (``graphrt.models.tensor_parallel``).
"""

from __future__ import annotations

import dataclasses

import torch

from graphrt.block_manager import BlockManager, BlockTables
from graphrt.distributed import RankGroup
from graphrt.model_runner import ModelRunner
from graphrt.sequence import Sequence
from graphrt.swap_space import SwapSpace


def _light(seq: Sequence) -> Sequence:
    """What another rank's runner reads of ``seq``: the sequence without its text and the logprobs of
    its outputs so far (a shallow copy: token lists are pickled, not shared)."""
    return dataclasses.replace(seq, prompt=None, output_logprobs=[])


class RelayingRunner:
    """Rank 0's ``ModelRunner`` over several ranks: ``execute``, ``verify``, ``launch_decode`` and
    ``launch_chunks`` are sent to the other ranks before they run here; everything else is the local
    runner's."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, ranks: RankGroup) -> None:
        self._runner = runner
        self._block_manager = block_manager
        self._ranks = ranks

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def _relay(self, method: str, seqs: list[Sequence], args: tuple, kwargs: dict) -> None:
        """Send the call ``method(*args, **kwargs)``, its Sequence arguments lightened, with the tables of ``seqs``."""
        light = {seq.seq_id: _light(seq) for seq in seqs}
        args = tuple([light[seq.seq_id] for seq in arg] if isinstance(arg, list) and arg and isinstance(arg[0], Sequence)
                     else arg for arg in args)
        tables = self._block_manager.snapshot([seq.seq_id for seq in seqs])
        self._ranks.send(("run", method, args, kwargs, tables))

    def execute(self, prefills: list[Sequence], decodes: list[Sequence], prefill_tokens: list[int] | None = None):
        self._relay("execute", prefills + decodes, (prefills, decodes, prefill_tokens), {})
        return self._runner.execute(prefills, decodes, prefill_tokens)

    def verify(self, decodes: list[Sequence], drafts: list[list[int]]):
        self._relay("verify", decodes, (decodes, drafts), {})
        return self._runner.verify(decodes, drafts)

    def launch_decode(self, decodes: list[Sequence], ahead_from: list[int] | None = None):
        self._relay("launch_decode", decodes, (decodes,), {"ahead_from": ahead_from})
        return self._runner.launch_decode(decodes, ahead_from=ahead_from)

    def launch_chunks(self, prefills: list[Sequence], lengths: list[int], decodes: list[Sequence],
                      ahead_from: list[int] | None = None):
        self._relay("launch_chunks", prefills + decodes, (prefills, lengths, decodes), {"ahead_from": ahead_from})
        return self._runner.launch_chunks(prefills, lengths, decodes, ahead_from=ahead_from)

    def copy_swaps(self, swap_space: SwapSpace, swap_in: list[tuple[int, int]],
                   swap_out: list[tuple[int, int]]) -> None:
        """``swap_space.copy`` of a step's block copies here and on every other rank (each its own cache)."""
        self._ranks.send(("swap", swap_in, swap_out))
        swap_space.copy(self._runner.kv_caches, swap_in, swap_out)


_RUNNABLE = ("execute", "verify", "launch_decode", "launch_chunks")


@torch.inference_mode()
def follow_steps(runner: ModelRunner, swap_space: SwapSpace | None, ranks: RankGroup) -> None:
    """Ranks 1 .. N-1: make each call rank 0 relays on ``runner`` (whose block tables must be a
    ``BlockTables`` the calls' tables are loaded into) until rank 0 says close."""
    tables: BlockTables = runner.block_manager
    while True:
        message = ranks.receive()
        kind = message[0]
        if kind == "close":
            return
        if kind == "swap":
            swap_space.copy(runner.kv_caches, message[1], message[2])
        elif kind == "run" and message[1] in _RUNNABLE:
            _, method, args, kwargs, snapshot = message
            tables.load(snapshot)
            getattr(runner, method)(*args, **kwargs)
        else:
            raise RuntimeError(f"tensor-parallel rank {ranks.rank}: unknown message {kind!r} from rank 0")
