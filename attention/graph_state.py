"""Static attention metadata for decode CUDA graphs: allocated once at the largest batch bucket, refreshed
in place from pinned host staging before every replay, with padding rows made inert so that a padded
graph's extra rows write nothing and read only the null block.

Only attention's own fields live here (slots, lengths, block tables, kernel scratch); the tokens a
step decodes and their positions belong to the graph runner (``graphrt.capture``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.attention.metadata import AttentionMetadata
from graphrt.base.staging import PackedStaging

#: Padding rows write nowhere (slot -1 is skipped), attend to one key, and read only the null block.
PAD_SLOT = -1
PAD_SEQ_LEN = 1
NULL_BLOCK = 0


@dataclass
class DecodeGraphState:
    """Attention tensors a captured decode graph reads, and their pinned host mirror.

    ``B`` = largest bucket, ``M = ceil(max_seq_len / block_size)`` = block-table width. The per-step
    fields share one ``PackedStaging`` (block tables last), so a refresh is numpy writes and one copy of
    the bytes in use, not a copy (and a cumsum kernel) per field.
    """

    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    seq_start_loc: torch.Tensor  # [B + 1] int32, prefix sums of seq_lens (refreshed)
    block_tables: torch.Tensor  # [B, M] int32
    query_lens: torch.Tensor  # [B] int32, all ones (decode)
    query_start_loc: torch.Tensor  # [B + 1] int32, arange (one token per row)
    #: The buffers behind the four fields above and their host mirror.
    packed: PackedStaging
    #: [B] int64: per staging row, the version of the block table it holds (``_UNKNOWN`` when not known,
    #: ``_PADDING`` for a padding row's null-block row).
    staged_versions: np.ndarray
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
    def allocate(cls, max_batch_size: int, max_seq_len: int, block_size: int, device: torch.device,
                 leading_fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]] = ()) -> DecodeGraphState:
        """The state at the largest bucket, every row inert. ``leading_fields``: the caller's own
        static fields ``(name, dtype, shape)``, placed first in the same pinned staging so that one
        copy refreshes them and the attention metadata together (the graph runner's token inputs);
        attention never reads them (``packed.device[name]`` / ``packed.host[name]`` are the caller's)."""
        batch, width = max_batch_size, -(-max_seq_len // block_size)
        packed = PackedStaging([
            *leading_fields,
            ("slot_mapping", torch.int64, (batch,)),
            ("seq_lens", torch.int32, (batch,)),
            ("seq_start_loc", torch.int32, (batch + 1,)),
            ("block_tables", torch.int32, (batch, width)),  # last: a refresh copies a prefix of its rows
        ], device)
        host = packed.host
        host["seq_lens"][:] = PAD_SEQ_LEN
        host["slot_mapping"][:] = PAD_SLOT
        host["block_tables"][:] = NULL_BLOCK
        np.cumsum(host["seq_lens"], out=host["seq_start_loc"][1:])
        packed.upload(non_blocking=False)
        return cls(
            **{name: packed.device[name] for name in ("slot_mapping", "seq_lens", "seq_start_loc", "block_tables")},
            query_lens=torch.ones(batch, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            packed=packed,
            staged_versions=np.full(batch, _PADDING, dtype=np.int64),
            block_size=block_size,
            max_seq_len=max_seq_len,
        )

    def bytes_in_use(self, padded_batch_size: int) -> int:
        """Bytes of the staging buffer a refresh of ``padded_batch_size`` rows copies, from its start
        (leading fields included) through those rows' block tables."""
        return self.packed.bytes_through("block_tables", padded_batch_size)

    def metadata(self, batch_size: int) -> AttentionMetadata:
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
            max_decode_seq_len=self.max_seq_len,
        )

    def refresh(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        padded_batch_size: int,
        block_table_versions: list[int] | None = None,
        upload: bool = True,
    ) -> None:
        """Write the real rows, then padding rows up to ``padded_batch_size``, into the device tensors:
        numpy writes into the pinned staging buffer, then one non-blocking copy of the bytes in use
        (``upload=False``: no copy; the caller, having written its leading fields too, copies
        ``bytes_in_use(padded_batch_size)`` itself).
        Padding rows get slot -1, length 1 and the null block. ``block_table_versions`` (ints >= 0,
        equal only for equal tables; see ``graphrt.capture.DecodeBatch``) let a row whose table is
        already staged skip its conversion. Raises ValueError for a row that exceeds the captured
        maximum context; nothing is copied then.

        The copy reads the staging buffer when the stream reaches it, so a refresh first waits until
        the previous refresh's copy has run (immediate unless that step is still queued).
        """
        batch = len(seq_lens)
        if batch > padded_batch_size or padded_batch_size > self.max_batch_size:
            raise ValueError(f"batch {batch} does not fit padded size {padded_batch_size} (max {self.max_batch_size})")
        width = self.max_blocks_per_seq
        if block_table_versions is not None and min(block_table_versions, default=0) < 0:
            raise ValueError("block_table_versions must be >= 0")
        for row, table in enumerate(block_tables):
            if len(table) > width:
                raise ValueError(f"row {row} has {len(table)} blocks; the captured maximum context allows {width}")
        self.packed.wait_until_uploaded()
        host = self.packed.host
        n = padded_batch_size
        host["slot_mapping"][:batch] = slot_mapping
        host["slot_mapping"][batch:n] = PAD_SLOT
        lens = host["seq_lens"]
        lens[:batch] = seq_lens
        lens[batch:n] = PAD_SEQ_LEN
        np.cumsum(lens[:n], out=host["seq_start_loc"][1 : n + 1])
        tables, staged = host["block_tables"], self.staged_versions
        for row, table in enumerate(block_tables):
            version = _UNKNOWN if block_table_versions is None else block_table_versions[row]
            if version >= 0 and staged[row] == version:
                continue  # this exact table is in the staging row already
            staged[row] = _UNKNOWN  # until the row is fully written: a failed write is never trusted
            tables[row] = NULL_BLOCK
            tables[row, : len(table)] = table
            staged[row] = version
        padding = staged[batch:n] != _PADDING
        if padding.any():
            tables[batch:n][padding] = NULL_BLOCK
            staged[batch:n] = _PADDING
        if upload:  # block-table rows past the padded batch are not read: the copy stops after row n
            self.packed.upload(self.bytes_in_use(n))


#: Staged-version markers: a row whose table version is unknown (always restaged), a padding row.
_UNKNOWN = -1
_PADDING = -2
