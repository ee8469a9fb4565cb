"""CUDA graphs for a step's prompt tokens: whole prompts or chunks of them, at most ``max_seqs`` sequences
and ``max_tokens`` tokens, run the model through one captured forward padded to the smallest bucket of
tokens that holds them, instead of about ten eager launches a layer (whose host time, not the GPU's,
set the length of a prompt step: ``profiles/notes_serving.md``).

The decode graphs' rules hold here too:

* every value that changes between replays lives in static tensors, refreshed from one pinned staging
  copy before a replay;
* padding is inert: padding tokens (id 0, position 0, slot -1) write no K/V and belong to no sequence,
  so no real token attends to them; unused sequence rows have no tokens and length 0, and the
  attention kernel's programs for them return at once;
* nothing on the host shapes a launch inside the graph: attention is always the prefix-prefill kernel
  (new tokens over their cached context, causally over themselves; a fresh prompt has a context of 0),
  its grid fixed by the bucket (bucket tokens x query heads per KV head / tile rows, ``max_seqs``, KV
  heads) and the block-table width by the captured maximum context;
* capture runs largest bucket first into one pool of its own, after a warm-up of every bucket on a side
  stream; a failed capture leaves prompt steps eager, with one warning.

The graph leaves the final hidden states of every bucket row in a static output; the caller picks each
sequence's last row and samples outside the graph (a prompt step samples only the prompts it finishes).

With ``eager`` (``enforce_eager`` on CUDA) nothing is captured and a step runs the same forward eagerly
on the same staged, padded inputs, so that its tokens are the graphs' bit for bit, as the decode graph
runner's eager steps are.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.attention.graph_state import NULL_BLOCK, PAD_SLOT
from graphrt.attention.metadata import AttentionMetadata
from graphrt.base import nvtx
from graphrt.base.staging import PackedStaging

logger = logging.getLogger(__name__)

#: Most sequences one prompt graph holds (a step with more replays a graph per group: ``prompt_groups``).
PREFILL_GRAPH_SEQS = 16
#: The smallest bucket of tokens; buckets double from here up to the largest.
MIN_PREFILL_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets, ascending: powers of two from ``MIN_PREFILL_BUCKET`` below ``max_tokens``, then
    ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets, size = [], MIN_PREFILL_BUCKET
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_tokens]


def mixed_buckets(prompt_buckets: list[int], max_tokens: int) -> list[int]:
    """The prompt-token buckets mixed graphs are captured for: those of ``prompt_buckets`` (the prompt
    graphs', ascending) from a quarter of ``max_tokens`` up to it (the largest below a quarter when none
    lies between; none when every bucket exceeds ``max_tokens``). A quarter: each bucket adds a graph per
    decode batch size, and a prompt part far below the smallest is padded to it."""
    held = [size for size in prompt_buckets if size <= max_tokens]
    return [size for size in held if size * 4 >= max_tokens] or held[-1:]


@dataclass
class PrefillGraphStats:
    """What the prompt graphs did: graphs captured, replays by bucket, steps that ran eagerly and why."""

    num_graphs: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    capture_error: str | None = None
    replays_per_bucket: dict[int, int] = field(default_factory=dict)
    padded_tokens: int = 0

    def as_dict(self) -> dict:
        return {"num_graphs": self.num_graphs, "capture_seconds": round(self.capture_seconds, 3),
                "pool_mib": round(self.pool_bytes / 2**20, 1), "capture_error": self.capture_error,
                "replays_per_bucket": dict(sorted(self.replays_per_bucket.items())),
                "padded_tokens": self.padded_tokens}


def prompt_groups(query_lens: list[int], table_lens: list[int], max_seqs: int, max_tokens: int,
                  max_blocks: int) -> list[range] | None:
    """A prompt step's sequences (their new tokens ``query_lens``, their block tables' lengths
    ``table_lens``) as consecutive groups of at most ``max_seqs`` sequences and ``max_tokens`` tokens, as
    few as greedy packing gives; None when one sequence alone has more tokens or blocks than a graph
    holds. A step of more sequences than one graph holds then replays a few graphs instead of running
    eagerly, whose launches from the host cost more than the replays."""
    groups, start, tokens = [], 0, 0
    for index, (new, width) in enumerate(zip(query_lens, table_lens)):
        if not 0 < new <= max_tokens or width > max_blocks:
            return None
        if index - start == max_seqs or tokens + new > max_tokens:
            groups.append(range(start, index))
            start, tokens = index, 0
        tokens += new
    if start < len(query_lens):
        groups.append(range(start, len(query_lens)))
    return groups or None


class PrefillGraphRunner:
    """Captured prompt forwards of ``model`` over ``kv_caches`` (CUDA only; the Triton attention backend,
    whose prefix-prefill kernel reads lengths from device tensors).

    ``max_tokens``: the largest bucket (a step's prompt tokens, all sequences together);
    ``max_seq_len``: the longest sequence, which fixes the block-table width; ``block_size``: the
    cache's tokens per block; ``eager``: run each bucket's forward without capturing it.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_tokens: int, max_seq_len: int,
                 device: torch.device, max_seqs: int = PREFILL_GRAPH_SEQS, eager: bool = False) -> None:
        if device.type != "cuda":
            raise ValueError("prompt graphs need a CUDA device")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.buckets = prefill_buckets(max_tokens)
        self.device = device
        tokens, seqs, width = self.buckets[-1], max_seqs, -(-max_seq_len // block_size)
        #: Inputs and attention metadata in one pinned staging: a replay's refresh is one copy.
        self.packed = PackedStaging([
            ("input_ids", torch.int64, (tokens,)),
            ("positions", torch.int64, (tokens,)),
            ("slot_mapping", torch.int64, (tokens,)),
            ("query_lens", torch.int32, (seqs,)),
            ("seq_lens", torch.int32, (seqs,)),
            ("query_start_loc", torch.int32, (seqs + 1,)),
            ("seq_start_loc", torch.int32, (seqs + 1,)),
            ("last_rows", torch.int64, (seqs,)),
            ("block_tables", torch.int32, (seqs, width)),  # last: a refresh copies a prefix of its rows
        ], device)
        #: [max_seqs, hidden] in the model dtype: in a mixed step (``DecodeGraphRunner``'s mixed graphs) each
        #: sequence's last new row, gathered by ``keep_last_rows`` (a static buffer outside every pool).
        self.last_hidden = torch.zeros(seqs, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype,
                                       device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        #: [bucket, hidden] in the model dtype: each graph's final hidden states (in the graphs' pool).
        self.outputs: dict[int, torch.Tensor] = {}
        self.stats = PrefillGraphStats()
        self.eager = eager
        #: Whether steps may run here: graphs captured, or ``eager``.
        self.ready = eager
        self.closed = False

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.packed.device["block_tables"].shape[1]

    def fits(self, num_tokens: int, num_seqs: int, longest_table: int) -> bool:
        """Whether a prompt step of ``num_tokens`` tokens over ``num_seqs`` sequences, the longest block
        table ``longest_table`` blocks, can replay a graph."""
        return (self.ready and 0 < num_tokens <= self.max_tokens and 0 < num_seqs <= self.max_seqs
                and longest_table <= self.max_blocks_per_seq)

    def groups(self, query_lens: list[int], table_lens: list[int]) -> list[range] | None:
        """A prompt step's sequences in consecutive groups that each replay a graph (``prompt_groups``),
        None when none can: graphs not captured, or a sequence that fits no graph alone."""
        if not self.ready:
            return None
        return prompt_groups(query_lens, table_lens, self.max_seqs, self.max_tokens, self.max_blocks_per_seq)

    def metadata(self, tokens: int) -> AttentionMetadata:
        """Metadata a graph of ``tokens`` tokens is captured with: views of the static tensors, lengths only
        on the device (``captured``); the host lists give the launch bounds: ``max_seqs`` sequences, the
        longest ``tokens`` new tokens."""
        device = self.packed.device
        return AttentionMetadata(
            num_prefills=self.max_seqs,
            num_prefill_tokens=tokens,
            num_decode_tokens=0,
            query_lens=[tokens] + [0] * (self.max_seqs - 1),
            seq_lens=None,
            slot_mapping=device["slot_mapping"][:tokens],
            query_lens_tensor=device["query_lens"],
            seq_lens_tensor=device["seq_lens"],
            query_start_loc=device["query_start_loc"],
            seq_start_loc=device["seq_start_loc"],
            block_tables=device["block_tables"],
            block_size=self.block_size,
            captured=True,
        )

    def segment_inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A mixed step's prompt part, padded to ``tokens``: the static ids, positions and slots [tokens]
        int64 and the captured metadata, as ``stage`` left them (``DecodeGraphRunner``'s mixed graphs put
        them before the decode rows)."""
        device = self.packed.device
        return (device["input_ids"][:tokens], device["positions"][:tokens], device["slot_mapping"][:tokens],
                self.metadata(tokens))

    def keep_last_rows(self, hidden: torch.Tensor) -> None:
        """Inside a mixed step: each staged sequence's last new row of ``hidden`` [tokens, hidden] (the
        prompt part's final hidden states) into ``last_hidden`` (unused sequence rows: row 0)."""
        torch.index_select(hidden, 0, self.packed.device["last_rows"], out=self.last_hidden)

    # -- capture -----------------------------------------------------------------------------------

    def capture(self, progress: bool = True) -> PrefillGraphStats:
        """Warm up every bucket on a side stream, then capture them largest first into one pool. A failure
        leaves prompt steps eager with one warning; it never raises. Nothing to do with ``eager``."""
        if self.eager:
            return self.stats
        start = time.perf_counter()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        self.stage([], [], [], [], [], [], self.max_tokens)  # every token and sequence inert
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                torch.cuda.set_sync_debug_mode("error")  # a host sync in the forward raises here, named
                try:
                    with torch.cuda.stream(side):
                        for tokens in reversed(self.buckets):
                            self._forward(tokens)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.current_stream(self.device).wait_stream(side)
                pool = torch.cuda.graph_pool_handle()
                for tokens in reversed(self.buckets):
                    graph = torch.cuda.CUDAGraph()
                    with nvtx.range(f"capture prefill tokens={tokens}"), torch.cuda.graph(graph, pool=pool):
                        self.outputs[tokens] = self._forward(tokens)
                    self.graphs[tokens] = graph
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # any capture problem: prompts run eagerly (unpadded) rather than crash
            self.graphs.clear()
            self.outputs.clear()
            self.stats.capture_error = f"{type(exc).__name__}: {exc}"
            logger.warning("prompt graph capture failed, prompt steps run eagerly instead: %s",
                           self.stats.capture_error)
            return self.stats
        self.ready = True
        self.stats.num_graphs = len(self.graphs)
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        summary = (f"captured {self.stats.num_graphs} prompt graphs ({self.buckets[0]}..{self.max_tokens} tokens, "
                   f"up to {self.max_seqs} sequences) in {self.stats.capture_seconds:.1f} s, "
                   f"pool {self.stats.pool_bytes / 2**20:.0f} MiB")
        if progress:
            print(f"graphrt: {summary}", file=sys.stderr)
        logger.info(summary)
        return self.stats

    def _forward(self, tokens: int) -> torch.Tensor:
        device = self.packed.device
        return self.model(device["input_ids"][:tokens], device["positions"][:tokens], self.kv_caches,
                          self.metadata(tokens))

    # -- replay ------------------------------------------------------------------------------------

    def bucket(self, num_tokens: int) -> int:
        return next(size for size in self.buckets if size >= num_tokens)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], query_lens: list[int],
            seq_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One prompt step through its bucket's graph: per token its id, position and cache slot; per
        sequence its new tokens, its length after them and its block table. Returns the final hidden
        states ``[len(input_ids), hidden]``, a view of the graph's output, valid until the next replay.
        Raises ValueError for a step that ``fits`` refuses."""
        if self.closed:
            raise RuntimeError("this prompt graph runner is closed")
        num_tokens, longest = len(input_ids), max((len(t) for t in block_tables), default=0)
        if not self.fits(num_tokens, len(query_lens), longest):
            raise ValueError(f"a prompt step of {num_tokens} tokens over {len(query_lens)} sequences "
                             f"(longest table {longest} blocks) has no graph")
        tokens = self.bucket(num_tokens)
        self.stage(input_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, tokens)
        self.stats.padded_tokens += tokens - num_tokens
        if self.eager:
            return self._forward(tokens)[:num_tokens]
        self.graphs[tokens].replay()
        self.stats.replays_per_bucket[tokens] = self.stats.replays_per_bucket.get(tokens, 0) + 1
        return self.outputs[tokens][:num_tokens]

    def stage(self, input_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, tokens: int) -> None:
        """Write the real tokens and sequences, then inert padding up to ``tokens`` tokens and ``max_seqs``
        sequences, into the staging mirror; copy it to the device (through the used block-table rows).
        A replay (``run``, or a mixed step's) reads them next."""
        packed = self.packed
        packed.wait_until_uploaded()
        host, n, seqs = packed.host, len(input_ids), len(query_lens)
        host["input_ids"][:n] = input_ids
        host["input_ids"][n:tokens] = 0
        host["positions"][:n] = positions
        host["positions"][n:tokens] = 0
        host["slot_mapping"][:n] = slot_mapping
        host["slot_mapping"][n:tokens] = PAD_SLOT
        host["query_lens"][:seqs] = query_lens
        host["query_lens"][seqs:] = 0
        host["seq_lens"][:seqs] = seq_lens
        host["seq_lens"][seqs:] = 0
        host["query_start_loc"][0] = host["seq_start_loc"][0] = 0
        np.cumsum(host["query_lens"], out=host["query_start_loc"][1:])
        np.cumsum(host["seq_lens"], out=host["seq_start_loc"][1:])
        last_rows = host["last_rows"]
        last_rows[:seqs] = host["query_start_loc"][1:seqs + 1]
        last_rows[:seqs] -= 1
        last_rows[seqs:] = 0
        tables = host["block_tables"]
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
            tables[row, len(table):] = NULL_BLOCK
        # Rows of unused sequences are never read (no tokens): they keep what they held.
        packed.upload(packed.bytes_through("block_tables", max(seqs, 1)))

    def close(self) -> None:
        """Drop the graphs, their outputs and the static buffers' references to the cache."""
        self.graphs.clear()
        self.outputs.clear()
        self.kv_caches = []
        self.last_hidden = None
        self.ready = False
        self.closed = True
