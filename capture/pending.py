"""A launched decode step's results on their way to pinned host memory: sampled token ids and, for
rows that asked, their log probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrt.base import nvtx
from graphrt.sampling.logprobs import TokenLogprobs, unpack_rows


class HostBuffers:
    """Pinned host memory a launch's results are copied into: tokens [B] int64 and the packed logprobs
    of ``graphrt.sampling.logprobs.token_logprobs`` (values [B, 1 + K] float32, ids [B, 1 + K] int64), with the
    event recorded after the copies. The graph runner keeps two and uses them in turn."""

    def __init__(self, max_batch_size: int, logprob_width: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.tokens = torch.zeros(max_batch_size, dtype=torch.int64, pin_memory=pinned)
        self.logprob_values = torch.zeros(max_batch_size, logprob_width, dtype=torch.float32, pin_memory=pinned)
        self.logprob_ids = torch.zeros(max_batch_size, logprob_width, dtype=torch.int64, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None
        #: The launch whose results these buffers hold until read (None once read or before any).
        self.holder: PendingTokens | None = None


def _host_view(device_tensor: torch.Tensor, host_buffer: torch.Tensor) -> torch.Tensor:
    """The leading part of ``host_buffer`` shaped like ``device_tensor``, or a new (pinned like it)
    tensor when the device tensor has more rows (a batch larger than the static buffers)."""
    rows = device_tensor.shape[0]
    if rows <= host_buffer.shape[0]:
        return host_buffer[:rows, :device_tensor.shape[1]] if device_tensor.dim() == 2 else host_buffer[:rows]
    return torch.empty(device_tensor.shape, dtype=host_buffer.dtype, pin_memory=host_buffer.is_pinned())


class PendingTokens:
    """A launched decode step's sampled tokens (and logprobs) on their way to pinned host memory.

    ``result()`` waits for the copy (for the step, hence) and returns the token ids as ints; ``ready()``
    asks without waiting; ``logprobs()`` (after or instead of ``result``) returns each row's
    ``TokenLogprobs``, None for rows that did not ask. The runner reuses the host buffers two launches
    later, reading the results into the object first."""

    def __init__(self, host_tokens: torch.Tensor, copied: torch.cuda.Event | None,
                 host_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
                 num_tops: Sequence[int | None] = ()) -> None:
        self._host_tokens = host_tokens
        self._copied = copied
        self._host_logprobs = host_logprobs
        self._num_tops = list(num_tops)
        self._tokens: list[int] | None = None
        self._logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def copy_to_host(cls, tokens: torch.Tensor, buffers: HostBuffers,
                     logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_tops: Sequence[int | None] = ()) -> PendingTokens:
        """Queue the copy of device ``tokens`` [n] (and of ``logprobs``, the (values, ids) pair of
        ``token_logprobs`` for those rows, when given; ``num_tops``: each row's requested top count or
        None) into ``buffers``, then record its event after them (CUDA tokens; the event must not be
        awaited by an unread earlier launch)."""
        pairs = [(tokens, buffers.tokens)]
        if logprobs is not None:
            pairs += [(logprobs[0], buffers.logprob_values), (logprobs[1], buffers.logprob_ids)]
        hosts = [_host_view(device, buffer).copy_(device, non_blocking=tokens.is_cuda) for device, buffer in pairs]
        copied = None
        if tokens.is_cuda:
            copied = buffers.copied
            copied.record(torch.cuda.current_stream(tokens.device))
        return cls(hosts[0], copied, (hosts[1], hosts[2]) if logprobs is not None else None, num_tops)

    @classmethod
    def empty(cls) -> PendingTokens:
        """The results of a launch of no rows."""
        return cls(torch.zeros(0, dtype=torch.int64), None)

    def ready(self) -> bool:
        return self._tokens is not None or self._copied is None or self._copied.query()

    def result(self) -> list[int]:
        if self._tokens is None:
            if self._copied is not None:
                with nvtx.decode_wait():
                    self._copied.synchronize()
            self._tokens = self._host_tokens.tolist()
            if self._host_logprobs is not None:
                self._logprobs = unpack_rows(*self._host_logprobs, self._tokens, self._num_tops)
        return self._tokens

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Each row's ``TokenLogprobs`` (waits like ``result``); all None when no row asked."""
        tokens = self.result()
        return self._logprobs if self._logprobs is not None else [None] * len(tokens)
