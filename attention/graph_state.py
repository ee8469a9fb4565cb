"""Static decode metadata for CUDA graphs: allocated once at the largest batch bucket, refreshed in place
from pinned host staging before every replay, with padding rows made inert (DESIGN.md §4, rule 3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .metadata import AttentionMetadata

#: Padding rows write nowhere (slot -1 is skipped), attend to one key, and read only the null block.
PAD_SLOT = -1
PAD_SEQ_LEN = 1
NULL_BLOCK = 0


@dataclass
class DecodeGraphState:
    """Device tensors a captured decode graph reads, and their pinned host mirrors.

    ``B`` = largest bucket, ``M = ceil(max_seq_len / block_size)`` = block-table width.
    """

    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32
    query_lens: torch.Tensor  # [B] int32, all ones (decode)
    query_start_loc: torch.Tensor  # [B + 1] int32, arange (one token per row)
    seq_start_loc: torch.Tensor  # [B + 1] int32, prefix sums of seq_lens (refreshed)
    host_slot_mapping: torch.Tensor  # pinned (on CUDA) mirrors of the three refreshed tensors
    host_seq_lens: torch.Tensor
    host_block_tables: torch.Tensor
    block_size: int
    #: Captured maximum context: rows longer than this cannot replay and run eagerly.
    max_seq_len: int
    #: Backend-specific static buffers (e.g. split-K workspaces), allocated by the backend's hook.
    extras: dict = field(default_factory=dict)

    @property
    def max_batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @classmethod
    def allocate(cls, max_batch_size: int, max_seq_len: int, block_size: int, device: torch.device) -> DecodeGraphState:
        width = -(-max_seq_len // block_size)
        pin = device.type == "cuda"

        def host(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        return cls(
            slot_mapping=torch.full((max_batch_size,), PAD_SLOT, dtype=torch.int64, device=device),
            seq_lens=torch.full((max_batch_size,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
            block_tables=torch.full((max_batch_size, width), NULL_BLOCK, dtype=torch.int32, device=device),
            query_lens=torch.ones(max_batch_size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
            seq_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device) * PAD_SEQ_LEN,
            host_slot_mapping=host(max_batch_size, dtype=torch.int64),
            host_seq_lens=host(max_batch_size, dtype=torch.int32),
            host_block_tables=host(max_batch_size, width, dtype=torch.int32),
            block_size=block_size,
            max_seq_len=max_seq_len,
        )

    def metadata(self, batch_size: int, kv_cache_dtype: str = "auto") -> AttentionMetadata:
        """Decode metadata over the first ``batch_size`` rows: views, so a graph captured with it reads
        whatever ``refresh`` wrote last."""
        return AttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch_size,
            query_lens=[1] * batch_size,
            seq_lens=None,
            slot_mapping=self.slot_mapping[:batch_size],
            query_lens_tensor=self.query_lens[:batch_size],
            seq_lens_tensor=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_start_loc=self.seq_start_loc[: batch_size + 1],
            block_tables=self.block_tables[:batch_size],
            block_size=self.block_size,
            kv_cache_dtype=kv_cache_dtype,
            use_cuda_graph=True,
            max_decode_seq_len=self.max_seq_len,
        )

    def refresh(
        self, seq_lens: list[int], block_tables: list[list[int]], slot_mapping: list[int], padded_batch_size: int
    ) -> None:
        """Write the real rows, then padding rows up to ``padded_batch_size``, into the device tensors
        (host -> pinned staging -> one non-blocking copy per tensor). Raises ValueError for a row that
        exceeds the captured maximum context."""
        batch = len(seq_lens)
        if batch > padded_batch_size or padded_batch_size > self.max_batch_size:
            raise ValueError(f"batch {batch} does not fit padded size {padded_batch_size} (max {self.max_batch_size})")
        lens = self.host_seq_lens.numpy()
        slots = self.host_slot_mapping.numpy()
        tables = self.host_block_tables.numpy()
        lens[:batch] = seq_lens
        lens[batch:padded_batch_size] = PAD_SEQ_LEN
        slots[:batch] = slot_mapping
        slots[batch:padded_batch_size] = PAD_SLOT
        tables[:padded_batch_size] = NULL_BLOCK
        for row, table in enumerate(block_tables):
            if len(table) > tables.shape[1]:
                raise ValueError(
                    f"row {row} has {len(table)} blocks; the captured maximum context allows {tables.shape[1]}"
                )
            tables[row, : len(table)] = table
        n = padded_batch_size
        self.seq_lens[:n].copy_(self.host_seq_lens[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(self.host_slot_mapping[:n], non_blocking=True)
        self.block_tables[:n].copy_(self.host_block_tables[:n], non_blocking=True)
        torch.cumsum(self.seq_lens[:n], dim=0, dtype=torch.int32, out=self.seq_start_loc[1 : n + 1])
