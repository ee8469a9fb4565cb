"""What one client may ask of the server (``ServerLimits``), and the gate that admits requests into the
engine (``AdmissionGate``): up to a number of choices at once, a bounded queue after them, 429 beyond."""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass

from graphrt.base.errors import ConfigError
from graphrt.serve.errors import ApiError


@dataclass
class ServerLimits:
    """Caps and timeouts of ``graphrt serve``; every field is checked when built.

    max_body_bytes: largest request body (413 beyond). max_prompt_tokens: longest prompt (None: what
    the model's context leaves room for). max_tokens: most tokens one choice may ask for (None: the
    context's length); a request without ``max_tokens`` gets what its context leaves, up to this.
    max_concurrent: choices (``n`` per prompt) in the engine at once; max_queued: requests waiting for
    room after them (429 for the next). header_timeout / body_timeout: seconds a client may take to
    send a request's headers / body (the connection is closed / 408); send_timeout: seconds a reply
    may wait for a client that does not read (the request is aborted); keep_alive_timeout: seconds an
    idle connection stays open. api_key: when set, every ``/v1`` request needs
    ``Authorization: Bearer <api_key>``.
    """

    max_body_bytes: int = 2 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_concurrent: int = 256
    max_queued: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not _is_int(self.max_queued) or self.max_queued < 0:
            raise ConfigError(f"max_queued must be an integer >= 0, got {self.max_queued!r}")
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{name} must be None or an integer >= 1, got {value!r}")
        for name in ("header_timeout", "body_timeout", "send_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for a server without one)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class AdmissionGate:
    """Admits requests that hold ``slots`` choices each while at most ``capacity`` are admitted; up to
    ``max_waiting`` more wait in arrival order; beyond that ``admit`` answers 429 at once."""

    def __init__(self, capacity: int, max_waiting: int) -> None:
        self.capacity, self.max_waiting = capacity, max_waiting
        self.in_use = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def admit(self, slots: int) -> None:
        """Wait for room for ``slots`` choices (release them with ``release``). Raises ApiError 400 for
        more than ``capacity`` at once, 429 when the queue is full."""
        if slots > self.capacity:
            raise ApiError(400, f"the request asks for {slots} choices but the server runs at most "
                           f"{self.capacity} at once", param="n")
        if not self._waiting and self.in_use + slots <= self.capacity:
            self.in_use += slots
            return
        if len(self._waiting) >= self.max_waiting:
            raise ApiError(429, f"the server is busy (choices running: {self.in_use}, requests queued: "
                           f"{len(self._waiting)}); retry later", code="rate_limit_exceeded")
        entry = (slots, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:  # the client left while queued
            if entry[1].done() and not entry[1].cancelled():
                self.release(slots)  # admitted just as it left
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def release(self, slots: int) -> None:
        self.in_use -= slots
        while self._waiting and self.in_use + self._waiting[0][0] <= self.capacity:
            slots_next, future = self._waiting.popleft()
            if not future.done():
                self.in_use += slots_next
                future.set_result(None)
