"""The static token inputs of decode graphs: the id each row decodes, its position, and the source rows
of a pipelined step's carried ids; allocated once at the largest bucket and refreshed in place from
pinned host staging before every replay (the attention metadata beside them is the backend's)."""

from __future__ import annotations

import torch

from graphrt.base.staging import PackedStaging


class DecodeInputs:
    """``input_ids`` [B] int64, ``positions`` [B] int64, ``carry_rows`` [B] int64 on the device, with
    one pinned host mirror (``B`` = largest bucket). ``input_ids`` comes first in the buffer, so a
    refresh that keeps the device's ids copies only what follows it."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        batch = max_batch_size
        self.packed = PackedStaging([
            ("input_ids", torch.int64, (batch,)),
            ("carry_rows", torch.int64, (batch,)),
            ("positions", torch.int64, (batch,)),
        ], device)
        self.packed.upload(non_blocking=False)
        #: [B] int64: the token each row decodes; a step's sampled tokens are written here too.
        self.input_ids = self.packed.device["input_ids"]
        #: [B] int64: row i of a pipelined step takes the token that row ``carry_rows[i]`` sampled.
        self.carry_rows = self.packed.device["carry_rows"]
        #: [B] int64: each row's position (padding rows: 0).
        self.positions = self.packed.device["positions"]

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    def refresh(self, input_ids: list[int], positions: list[int], padded_batch_size: int,
                keep_input_ids: bool = False, carry_rows: list[int] | None = None) -> None:
        """Write one id and position per real row, zeros for padding rows up to ``padded_batch_size``,
        then copy the bytes in use to the device (non-blocking).

        ``keep_input_ids``: leave the device's ids as they are (``input_ids`` is ignored), for a
        pipelined step whose inputs are the previous step's samples, still on the device; padding
        rows then keep the ids they sampled (vocabulary ids like any other; a padding row's result
        is never read). ``carry_rows`` (with ``keep_input_ids``): one source row per real row, staged
        for the runner's gather. Waits first until the previous refresh's copy has read the mirror.
        """
        batch, n = len(positions), padded_batch_size
        if n > self.max_batch_size or batch > n:
            raise ValueError(f"batch {batch} does not fit padded size {n} (max {self.max_batch_size})")
        if carry_rows is not None and (not keep_input_ids or len(carry_rows) != batch):
            raise ValueError("carry_rows needs keep_input_ids and one source row per row")
        if not keep_input_ids and len(input_ids) != batch:
            raise ValueError(f"{len(input_ids)} input ids for {batch} positions")
        self.packed.wait_until_uploaded()
        host = self.packed.host
        if not keep_input_ids:
            host["input_ids"][:batch] = input_ids
            host["input_ids"][batch:n] = 0
        if carry_rows is not None:
            host["carry_rows"][:batch] = carry_rows
        host["positions"][:batch] = positions
        host["positions"][batch:n] = 0
        first = self.packed.field_start("carry_rows") if keep_input_ids else 0
        self.packed.upload(self.packed.bytes_through("positions", n), first_byte=first)
