"""uvicorn under the server's timeouts: a connection that has not sent a request's headers within
``header_timeout`` is closed (uvicorn itself only times out idle connections between requests), and
a reply a client does not read within ``send_timeout`` ends its request (which aborts its work)."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphrt.serve.limits import ServerLimits

logger = logging.getLogger(__name__)


class ClientTooSlow(Exception):
    """A client did not take a piece of its reply within the send timeout."""


class SendDeadline:
    """ASGI middleware: every ``send`` of the app must complete within ``timeout`` seconds (a reply
    larger than the socket's buffers waits for the client to read)."""

    def __init__(self, app, timeout: float) -> None:
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_in_time(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                raise ClientTooSlow(f"the client read nothing for {self.timeout:g} s") from None

        try:
            await self.app(scope, receive, send_in_time)
        except ClientTooSlow as exc:
            client = scope.get("client")
            logger.warning("graphrt serve: dropped %s: %s", f"{client[0]}:{client[1]}" if client else "a client", exc)


def header_deadline_protocol(timeout: float, keep_alive: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take over ``timeout`` seconds
    to arrive: from connecting, and after each reply from the end of the ``keep_alive`` seconds an
    idle connection may wait for its next request."""

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline(timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline(keep_alive + timeout)

        def _arm_header_deadline(self, seconds: float) -> None:
            waiting_after = self.cycle  # a request whose headers arrive starts a new cycle
            self.loop.call_later(seconds, self._close_if_no_request, waiting_after)

        def _close_if_no_request(self, waiting_after) -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_server(app, host: str, port: int, limits: ServerLimits, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for ``app`` on ``host:port`` under ``limits``' timeouts (not started)."""
    config = uvicorn.Config(
        SendDeadline(app, limits.send_timeout), host=host, port=port, log_level=log_level,
        http=header_deadline_protocol(limits.header_timeout, limits.keep_alive_timeout),
        timeout_keep_alive=limits.keep_alive_timeout,
        h11_max_incomplete_event_size=64 * 1024, lifespan="off", server_header=False,
        timeout_graceful_shutdown=5,  # then open streams are cut: stopping must not wait for them to end
    )
    return uvicorn.Server(config)
