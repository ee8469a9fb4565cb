"""Host-to-device staging for the static tensors a CUDA graph reads.

Several small per-step fields share one device buffer, mirrored by one pinned host buffer, so a
refresh is numpy writes into the mirror plus a single non-blocking copy, instead of a torch call (and
a host-to-device copy) per field. Used for a decode graph's token inputs and attention metadata, which
share one (``graphrt.attention.graph_state``, ``graphrt.capture.decode_inputs``), and for its sampling
rows (``graphrt.capture.static_sampling``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

#: Every field starts on this boundary: Triton specialises kernels for 16-byte aligned pointers.
ALIGNMENT = 16


class PackedStaging:
    """Fields ``(name, dtype, shape)`` packed in the given order, each 16-byte aligned.

    ``device[name]``: the field as a tensor on ``device``, a view whose storage never changes (what a
    captured graph reads); ``host[name]``: the same field as a numpy view of the pinned mirror (what a
    refresh writes). Nothing reaches the device before ``upload``.
    """

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device) -> None:
        self._spans: dict[str, tuple[int, int]] = {}  # name -> (first byte, bytes per row of dim 0)
        end = 0
        for name, dtype, shape in fields:
            start = -(-end // ALIGNMENT) * ALIGNMENT
            row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
            self._spans[name] = (start, row_bytes)
            end = start + shape[0] * row_bytes
        self.staging = torch.zeros(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_buffer = torch.zeros(end, dtype=torch.uint8, device=device)  # distinct even on CPU
        self.device = {name: self._view(self.device_buffer, name, dtype, shape) for name, dtype, shape in fields}
        self.host: dict[str, np.ndarray] = {
            name: self._view(self.staging, name, dtype, shape).numpy() for name, dtype, shape in fields
        }
        #: Recorded after each non-blocking CUDA upload, which reads the pinned mirror only when the
        #: stream reaches it; ``_upload_pending`` until waited for.
        self._uploaded = torch.cuda.Event() if self.device_buffer.is_cuda else None
        self._upload_pending = False

    def _view(self, buffer: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start, row_bytes = self._spans[name]
        return buffer[start : start + shape[0] * row_bytes].view(dtype).view(shape)

    def bytes_through(self, name: str, rows: int) -> int:
        """Bytes from the buffer's start through the first ``rows`` rows (dim 0) of field ``name``."""
        start, row_bytes = self._spans[name]
        return start + rows * row_bytes

    def field_start(self, name: str) -> int:
        """Byte offset of field ``name`` in the buffer."""
        return self._spans[name][0]

    def wait_until_uploaded(self) -> None:
        """Block until the last upload has read the mirror, so that the host may write it again. Free
        when the caller already waited for later work on the stream (the graph runner's synchronous
        decode); needed when a refresh runs while the previous step is still queued (pipelined decode)."""
        if self._upload_pending:
            self._uploaded.synchronize()
            self._upload_pending = False

    def upload(self, num_bytes: int | None = None, non_blocking: bool = True, first_byte: int = 0) -> None:
        """Copy bytes ``[first_byte, num_bytes)`` (default: all) of the mirror to the device. A
        non-blocking copy reads the mirror when the stream reaches it: call ``wait_until_uploaded``
        before writing the mirror again."""
        end = self.staging.numel() if num_bytes is None else num_bytes
        self.device_buffer[first_byte:end].copy_(self.staging[first_byte:end], non_blocking=non_blocking)
        if non_blocking and self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device_buffer.device))
            self._upload_pending = True
