"""Static decode inputs and metadata for CUDA graphs: allocated once at the largest batch bucket, refreshed
in place from pinned host staging before every replay, with padding rows made inert (DESIGN.md §4, rule 3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .metadata import AttentionMetadata

#: Padding rows write nowhere (slot -1 is skipped), attend to one key, and read only the null block.
PAD_SLOT = -1
PAD_SEQ_LEN = 1
NULL_BLOCK = 0


@dataclass
class DecodeGraphState:
    """Device tensors a captured decode graph reads, and their pinned host mirrors.

    ``B`` = largest bucket, ``M = ceil(max_seq_len / block_size)`` = block-table width. Every per-step
    field lives in one byte buffer (int64 rows first, then int32), mirrored by one pinned host buffer,
    so a refresh is one host-to-device copy of a prefix of it: a step's host cost is then numpy writes
    and a single copy, not a copy (and a cumsum kernel) per field.
    """

    input_ids: torch.Tensor  # [B] int64, the token each row decodes
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    seq_start_loc: torch.Tensor  # [B + 1] int32, prefix sums of seq_lens (refreshed)
    block_tables: torch.Tensor  # [B, M] int32
    query_lens: torch.Tensor  # [B] int32, all ones (decode)
    query_start_loc: torch.Tensor  # [B + 1] int32, arange (one token per row)
    staging: torch.Tensor  # uint8, the pinned (on CUDA) host mirror of the device buffer behind the fields above
    device_buffer: torch.Tensor  # uint8, the device buffer the fields above view
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
        batch, width = max_batch_size, -(-max_seq_len // block_size)
        layout = _Layout(batch, width)
        staging = torch.zeros(layout.num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = layout.views(staging)
        host["seq_lens"].fill_(PAD_SEQ_LEN)
        host["slot_mapping"].fill_(PAD_SLOT)
        host["block_tables"].fill_(NULL_BLOCK)
        torch.cumsum(host["seq_lens"], 0, dtype=torch.int32, out=host["seq_start_loc"][1:])
        device_buffer = torch.empty_like(staging, device=device).copy_(staging)  # distinct even on CPU
        return cls(
            **layout.views(device_buffer),
            query_lens=torch.ones(batch, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            staging=staging,
            device_buffer=device_buffer,
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
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        padded_batch_size: int,
        input_ids: list[int] | None = None,
        positions: list[int] | None = None,
        block_table_versions: list[int] | None = None,
    ) -> None:
        """Write the real rows, then padding rows up to ``padded_batch_size``, into the device tensors:
        numpy writes into the pinned staging buffer, then one non-blocking copy of the bytes in use.
        ``input_ids``/``positions`` (one per real row) default to 0. Padding rows get token 0 at
        position 0, slot -1, length 1 and the null block. ``block_table_versions`` (ints >= 0, equal
        only for equal tables; see ``DecodeBatch``) let a row whose table is already staged skip its
        conversion. Raises ValueError for a row that exceeds the captured maximum context; nothing is
        copied then.

        The copy reads the staging buffer asynchronously: call again only after the step that used the
        last refresh finished (the graph runner waits for its tokens, which guarantees that).
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
        host = self._host_arrays()
        n = padded_batch_size
        for name, values in (("input_ids", input_ids), ("positions", positions)):
            if values is None:
                host[name][:n] = 0
            else:
                host[name][:batch] = values
                host[name][batch:n] = 0
        host["slot_mapping"][:batch] = slot_mapping
        host["slot_mapping"][batch:n] = PAD_SLOT
        lens = host["seq_lens"]
        lens[:batch] = seq_lens
        lens[batch:n] = PAD_SEQ_LEN
        np.cumsum(lens[:n], out=host["seq_start_loc"][1 : n + 1])
        tables, staged = host["block_tables"], self._staged_versions()
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
        used = self._layout().bytes_through_row(n)  # block tables come last: later rows are not read
        self.device_buffer[:used].copy_(self.staging[:used], non_blocking=True)

    def _layout(self) -> _Layout:
        return _Layout(self.max_batch_size, self.max_blocks_per_seq)

    def _staged_versions(self) -> np.ndarray:
        """[B] int64: per staging row, the version of the block table it holds (``_UNKNOWN`` when not
        known, ``_PADDING`` for a padding row's null-block row)."""
        staged = self.extras.get(_STAGED_VERSIONS)
        if staged is None:
            staged = self.extras[_STAGED_VERSIONS] = np.full(self.max_batch_size, _UNKNOWN, dtype=np.int64)
        return staged

    def _host_arrays(self) -> dict[str, np.ndarray]:
        """numpy views of the staging buffer's fields (cached: building them costs more than writing)."""
        arrays = self.extras.get(_HOST_ARRAYS)
        if arrays is None:
            arrays = self.extras[_HOST_ARRAYS] = {k: v.numpy() for k, v in self._layout().views(self.staging).items()}
        return arrays


#: Keys of the cached numpy views of the staging buffer and of the staged table versions in ``extras``.
_HOST_ARRAYS = "host_arrays"
_STAGED_VERSIONS = "staged_block_table_versions"
#: Staged-version markers: a row whose table version is unknown (always restaged), a padding row.
_UNKNOWN = -1
_PADDING = -2


class _Layout:
    """Byte offsets of the per-step fields in the staging/device buffers: three int64 rows (ids,
    positions, slots), then int32 seq_lens [B], seq_start_loc [B + 1] and block_tables [B, M]. Every
    field starts on a 16-byte boundary, which Triton's kernels are specialised for."""

    def __init__(self, batch: int, width: int) -> None:
        self.batch, self.width = batch, width
        self.int64_row = _align(batch * 8) // 8  # elements per int64 row, padded
        self.lens_start = 3 * self.int64_row * 8
        self.starts_start = self.lens_start + _align(batch * 4)
        self.tables_start = self.starts_start + _align((batch + 1) * 4)
        self.num_bytes = self.tables_start + batch * width * 4

    def bytes_through_row(self, rows: int) -> int:
        """Bytes from the start of the buffer through block-table row ``rows - 1``."""
        return self.tables_start + rows * self.width * 4

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.batch
        int64 = buffer[: self.lens_start].view(torch.int64).view(3, self.int64_row)
        return {
            "input_ids": int64[0, :b],
            "positions": int64[1, :b],
            "slot_mapping": int64[2, :b],
            "seq_lens": buffer[self.lens_start : self.lens_start + 4 * b].view(torch.int32),
            "seq_start_loc": buffer[self.starts_start : self.starts_start + 4 * (b + 1)].view(torch.int32),
            "block_tables": buffer[self.tables_start :].view(torch.int32).view(b, self.width),
        }


def _align(num_bytes: int, to: int = 16) -> int:
    return -(-num_bytes // to) * to
