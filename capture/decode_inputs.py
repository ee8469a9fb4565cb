"""The static token inputs of decode graphs: the id each row decodes, its position, and the source rows
of a pipelined step's carried ids (with the ids of rows fed from the host beside them); allocated once
at the largest bucket and refreshed in place from pinned host staging before every replay. The graph
runner places them first in the attention state's staging (``AttentionBackend.init_graph_state``'s
``leading_fields``), so one copy refreshes both."""

from __future__ import annotations

import torch

from graphrt.base.staging import PackedStaging


class DecodeInputs:
    """``input_ids`` [B] int64, ``fed_ids`` [B] int64, ``carry_rows`` [B] int64, ``positions`` [B]
    int64 on the device, views of a ``PackedStaging`` that holds ``fields(B)`` (``B`` = largest
    bucket). ``input_ids`` and ``fed_ids`` are the two halves of one field, ``carry_source`` [2B], that
    comes first: a refresh that keeps the device's ids copies only what follows ``input_ids``, and a
    carried row's gather reads a previous sample (index < B) or an id fed from the host (index B + i)
    from the same tensor."""

    @staticmethod
    def fields(max_batch_size: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        batch = max_batch_size
        return [("carry_source", torch.int64, (2 * batch,)), ("carry_rows", torch.int64, (batch,)),
                ("positions", torch.int64, (batch,))]

    def __init__(self, packed: PackedStaging) -> None:
        self.packed = packed
        #: [2B] int64: ``input_ids`` then ``fed_ids``, the source of a carried batch's gather.
        self.carry_source = packed.device["carry_source"]
        batch = self.carry_source.shape[0] // 2
        #: [B] int64: the token each row decodes; a step's sampled tokens are written here too.
        self.input_ids = self.carry_source[:batch]
        #: [B] int64: in a carried batch, the ids of rows fed from the host (row i's at index i).
        self.fed_ids = self.carry_source[batch:]
        #: [B] int64: row i of a pipelined step takes ``carry_source[carry_rows[i]]``: the token row
        #: ``carry_rows[i]`` sampled (< B), or its own id fed from the host (B + i).
        self.carry_rows = packed.device["carry_rows"]
        #: [B] int64: each row's position (padding rows: 0).
        self.positions = packed.device["positions"]

    @classmethod
    def allocate(cls, max_batch_size: int, device: torch.device) -> DecodeInputs:
        """Inputs in a staging of their own (the graph runner shares the attention state's instead)."""
        packed = PackedStaging(cls.fields(max_batch_size), device)
        packed.upload(non_blocking=False)
        return cls(packed)

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    def write(self, input_ids: list[int], positions: list[int], padded_batch_size: int,
              keep_input_ids: bool = False, carry_rows: list[int | None] | None = None) -> int:
        """Write one id and position per real row, zeros for padding rows up to ``padded_batch_size``,
        into the pinned mirror only; returns the first byte the copy to the device must start at.

        ``keep_input_ids``: leave the device's ids as they are (``input_ids`` is ignored), for a
        pipelined step whose inputs are the previous step's samples, still on the device; padding
        rows then keep the ids they sampled (vocabulary ids like any other; a padding row's result
        is never read), and the copy starts after them. ``carry_rows`` (with ``keep_input_ids``): one
        source row per real row, staged for the runner's gather; None fetches the row's own id from
        ``input_ids`` (a row fed from the host beside carried ones). The caller waits for the previous
        copy first (``packed.wait_until_uploaded``). Raises ValueError, writing nothing, for shapes
        that do not fit.
        """
        batch, n = len(positions), padded_batch_size
        if n > self.max_batch_size or batch > n:
            raise ValueError(f"batch {batch} does not fit padded size {n} (max {self.max_batch_size})")
        if carry_rows is not None and (not keep_input_ids or len(carry_rows) != batch):
            raise ValueError("carry_rows needs keep_input_ids and one source row per row")
        fed_rows = carry_rows is not None and None in carry_rows
        if (not keep_input_ids or fed_rows) and len(input_ids) != batch:
            raise ValueError(f"{len(input_ids)} input ids for {batch} positions")
        host = self.packed.host
        if not keep_input_ids:
            host["carry_source"][:batch] = input_ids
            host["carry_source"][batch:n] = 0
        if carry_rows is not None:
            fed_start = self.max_batch_size  # row i's host id sits at fed_start + i
            fed = [i for i, row in enumerate(carry_rows) if row is None]
            host["carry_source"][[fed_start + i for i in fed]] = [input_ids[i] for i in fed]
            host["carry_rows"][:batch] = [fed_start + i if row is None else row for i, row in enumerate(carry_rows)]
        host["positions"][:batch] = positions
        host["positions"][batch:n] = 0
        # Keeping the device's ids, the copy starts at ``fed_ids``, the second half of ``carry_source``.
        return self.packed.field_start("carry_source") + self.fed_ids.nbytes if keep_input_ids else 0

    def refresh(self, input_ids: list[int], positions: list[int], padded_batch_size: int,
                keep_input_ids: bool = False, carry_rows: list[int | None] | None = None) -> None:
        """``write``, then the non-blocking copy of the bytes in use (these fields only)."""
        self.packed.wait_until_uploaded()
        first = self.write(input_ids, positions, padded_batch_size, keep_input_ids, carry_rows)
        self.packed.upload(self.packed.bytes_through("positions", padded_batch_size), first_byte=first)
