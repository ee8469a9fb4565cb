"""Per-step attention metadata, built once by the model runner and read by every layer.

Token layout of a step: the new tokens of all prefilling sequences first, then one token per decoding
sequence. Lengths have one meaning each:

* ``query_lens[i]``: new tokens of sequence ``i`` in this step (its prompt chunk, or 1 when decoding);
* ``context_lens[i]``: tokens of sequence ``i`` already in the KV cache before this step;
* ``seq_lens[i] = context_lens[i] + query_lens[i]``: keys sequence ``i`` attends to after this step's
  writes.

Metadata built for a captured CUDA graph has no host lengths (they change between replays): its
``seq_lens`` host list is None and kernels read lengths from the device tensors, bounded by
``max_decode_seq_len``, the captured maximum context. Captured prompt metadata (``captured``) has host
``query_lens`` that only bound the launch (the first entry the bucket's tokens, the rest 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Lengths, slots and block tables of one forward pass (prefills first, then decodes).

    Host lists let host code plan launches without syncing; device tensors feed the kernels.
    ``B`` = number of sequences, ``T`` = number of new tokens, ``M`` = block-table width.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    #: Host copies, one entry per sequence; ``seq_lens`` is None in graph-captured metadata.
    query_lens: list[int]
    seq_lens: list[int] | None
    #: [T] int64: flat cache slot (block * block_size + offset) each new token's K/V goes to; -1 = skip.
    slot_mapping: torch.Tensor
    #: [B] int32, device copies of the host lists above.
    query_lens_tensor: torch.Tensor
    seq_lens_tensor: torch.Tensor
    #: [B + 1] int32: prefix sums of query_lens (where each sequence's new tokens start).
    query_start_loc: torch.Tensor
    #: [B + 1] int32: prefix sums of seq_lens.
    seq_start_loc: torch.Tensor
    #: [B, M] int32: physical KV blocks of each sequence, padded with the null block (0).
    block_tables: torch.Tensor
    block_size: int
    #: Upper bound on decoding sequences' seq_lens that fixes decode launch shapes (grids, split
    #: counts, gathered blocks); 0 = the largest decode seq_len in ``seq_lens``.
    max_decode_seq_len: int = 0
    #: Preallocated split-K scratch for decode kernels (set on graph metadata; None = allocate per call).
    decode_workspace: object | None = None
    #: A captured prompt step (``graphrt.capture.prefill_graphs``): lengths only in the device tensors,
    #: so prefill attention is the kernel that reads them there (the prefix-prefill kernel).
    captured: bool = False

    def __post_init__(self) -> None:
        if not self.max_decode_seq_len and self.seq_lens is not None:
            self.max_decode_seq_len = max(self.seq_lens[self.num_prefills:], default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @cached_property
    def context_lens(self) -> list[int]:
        """Host list: tokens of each sequence already cached before this step."""
        return [s - q for s, q in zip(self._host_seq_lens(), self.query_lens)]

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self._host_seq_lens(), default=0)

    def _host_seq_lens(self) -> list[int]:
        if self.seq_lens is None:
            raise RuntimeError("graph-captured metadata has no host seq_lens; read seq_lens_tensor")
        return self.seq_lens

    @cached_property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """View restricted to the prefilling sequences, or None when there are none."""
        if self.num_prefills == 0:
            return None
        return self._slice(0, self.num_prefills, 0, self.num_prefill_tokens)

    @cached_property
    def decode_metadata(self) -> AttentionMetadata | None:
        """View restricted to the decoding sequences, or None when there are none."""
        if self.num_decodes == 0:
            return None
        return self._slice(self.num_prefills, self.num_seqs, self.num_prefill_tokens, self.num_tokens)

    def _slice(self, first_seq: int, end_seq: int, first_token: int, end_token: int) -> AttentionMetadata:
        is_prefill = first_seq == 0 and end_seq == self.num_prefills
        query_start = self.query_start_loc[first_seq:end_seq + 1]
        seq_start = self.seq_start_loc[first_seq:end_seq + 1]
        return AttentionMetadata(
            num_prefills=end_seq - first_seq if is_prefill else 0,
            num_prefill_tokens=end_token - first_token if is_prefill else 0,
            num_decode_tokens=0 if is_prefill else end_token - first_token,
            query_lens=self.query_lens[first_seq:end_seq],
            seq_lens=None if self.seq_lens is None else self.seq_lens[first_seq:end_seq],
            slot_mapping=self.slot_mapping[first_token:end_token],
            query_lens_tensor=self.query_lens_tensor[first_seq:end_seq],
            seq_lens_tensor=self.seq_lens_tensor[first_seq:end_seq],
            query_start_loc=query_start - query_start[0],
            seq_start_loc=seq_start - seq_start[0],
            block_tables=self.block_tables[first_seq:end_seq],
            block_size=self.block_size,
            max_decode_seq_len=0 if is_prefill else self.max_decode_seq_len,
            decode_workspace=None if is_prefill else self.decode_workspace,
            captured=self.captured,
        )

    @classmethod
    def mixed(cls, prefill: AttentionMetadata, decode: AttentionMetadata,
              slot_mapping: torch.Tensor) -> AttentionMetadata:
        """One forward over ``prefill``'s tokens then ``decode``'s rows, each part keeping its own
        tensors (a captured mixed step: the prompt graphs' static buffers and the decode graphs'):
        ``prefill_metadata`` and ``decode_metadata`` are the two given, not views of one table, and
        ``slot_mapping`` is the step's [T] int64 slots, prefill tokens first. The joint fields hold the
        decode part's tensors; nothing reads them across both parts."""
        if prefill.num_decodes or decode.num_prefills:
            raise ValueError("mixed metadata takes a prefill-only part and a decode-only part")
        tokens = prefill.num_prefill_tokens + decode.num_decode_tokens
        if slot_mapping.shape[0] != tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {tokens} tokens")
        joint = cls(
            num_prefills=prefill.num_prefills,
            num_prefill_tokens=prefill.num_prefill_tokens,
            num_decode_tokens=decode.num_decode_tokens,
            query_lens=prefill.query_lens + decode.query_lens,
            seq_lens=(None if prefill.seq_lens is None or decode.seq_lens is None
                      else prefill.seq_lens + decode.seq_lens),
            slot_mapping=slot_mapping,
            query_lens_tensor=decode.query_lens_tensor,
            seq_lens_tensor=decode.seq_lens_tensor,
            query_start_loc=decode.query_start_loc,
            seq_start_loc=decode.seq_start_loc,
            block_tables=decode.block_tables,
            block_size=decode.block_size,
            max_decode_seq_len=decode.max_decode_seq_len,
            decode_workspace=decode.decode_workspace,
            captured=prefill.captured,
        )
        # The parts as they are (cached_property reads the instance's dict first).
        joint.__dict__["prefill_metadata"] = prefill
        joint.__dict__["decode_metadata"] = decode
        return joint

    @classmethod
    def from_seqlens(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        num_prefills: int,
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
        max_decode_seq_len: int = 0,
    ) -> AttentionMetadata:
        """Build from host lists; copies go to ``device`` once, through pinned memory on CUDA.

        Sequences ``[0, num_prefills)`` prefill; the rest decode and must have ``query_lens == 1``.
        """
        if len(query_lens) != len(seq_lens) or len(block_tables) != len(seq_lens):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if any(q != 1 for q in query_lens[num_prefills:]):
            raise ValueError("decoding sequences must have exactly one new token")
        if len(slot_mapping) != sum(query_lens):
            raise ValueError(f"slot_mapping has {len(slot_mapping)} entries for {sum(query_lens)} tokens")
        width = max((len(t) for t in block_tables), default=0) or 1
        padded_tables = [t + [0] * (width - len(t)) for t in block_tables]

        def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            return pinned_to_device(values, dtype, device)

        query_starts = [0]
        for q in query_lens:
            query_starts.append(query_starts[-1] + q)
        seq_starts = [0]
        for s in seq_lens:
            seq_starts.append(seq_starts[-1] + s)
        num_prefill_tokens = sum(query_lens[:num_prefills])
        return cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=sum(query_lens) - num_prefill_tokens,
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            slot_mapping=to_device(slot_mapping, torch.int64),
            query_lens_tensor=to_device(query_lens, torch.int32),
            seq_lens_tensor=to_device(seq_lens, torch.int32),
            query_start_loc=to_device(query_starts, torch.int32),
            seq_start_loc=to_device(seq_starts, torch.int32),
            block_tables=to_device(padded_tables, torch.int32).view(len(block_tables), width),
            block_size=block_size,
            max_decode_seq_len=max_decode_seq_len,
        )


def pinned_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``: through pinned memory and a non-blocking copy on CUDA,
    so host code never waits for the device."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
