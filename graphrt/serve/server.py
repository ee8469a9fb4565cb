"""``graphrt serve``: one model behind the OpenAI API, its engine stepping on a thread of its own.

``Server.start`` serves from background threads (HTTP, and the engine loop) and returns once it
listens; ``wait`` blocks until Ctrl-C, or until the engine fails (a step raised: its state cannot be
trusted, so the server ends rather than answer 503 forever; ``failure`` says why, and ``graphrt serve``
exits non-zero for a supervisor to restart it); ``stop`` ends both threads. ``run`` is the three in turn.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import threading
import time
from pathlib import Path

from graphrt.base.errors import ConfigError
from graphrt.llm import LLM
from graphrt.serve.app import build_app
from graphrt.serve.engine_loop import EngineLoop
from graphrt.serve.http import uvicorn_server
from graphrt.serve.limits import ServerLimits
from graphrt.serve.openai_api import OpenAIHandlers

logger = logging.getLogger(__name__)

#: What the default model (``model=None``) is called in the API.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model: str | None) -> str:
    """The API's name of ``model``: the default model's name, a preset as given, a file or folder's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if model.startswith("random:"):
        return model
    return Path(model).name.removesuffix(".gguf") or model


class Server:
    """``llm`` served on ``host:port`` under ``limits`` as ``model_name``; ``port`` 0 picks a free port
    (``port`` holds it once started). Stopping it stops the engine loop; the ``LLM`` stays the
    caller's to close."""

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
                 model_name: str | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.loop = EngineLoop(llm.engine)
        name = model_name or default_model_name(llm.engine.config.model)
        self.handlers = OpenAIHandlers(llm, self.loop, self.limits, name)
        self.host, self.port = host, port
        self._uvicorn = uvicorn_server(build_app(self.handlers), host, port, self.limits)
        self._thread: threading.Thread | None = None
        if not _is_loopback(host) and self.limits.api_key is None:
            logger.warning("graphrt serve: listening on %s without an API key: anyone who reaches it can use it "
                           "(set --api-key or GRAPHRT_API_KEY)", host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        """Serve until interrupted (Ctrl-C)."""
        self.start()
        try:
            self.wait()
        finally:
            self.stop()

    def start(self, timeout: float = 30.0) -> None:
        """Serve from a background thread; returns once the socket listens."""
        self.loop.start()
        self._thread = threading.Thread(target=self._uvicorn.run, name="graphrt-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.loop.stop()
                raise ConfigError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]

    @property
    def failure(self) -> BaseException | None:
        """What a failed engine step raised (None while the engine runs, or after a plain stop)."""
        return self.loop.failure

    def wait(self) -> None:
        """Block until the server ends or its engine fails (``failure``); Ctrl-C returns (``stop`` then
        ends it)."""
        try:
            while self._thread is not None and self._thread.is_alive() and self.loop.failure is None:
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        """Stop listening, end open requests, stop the engine loop."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.loop.stop()


def check_can_listen(host: str, port: int) -> None:
    """ConfigError unless ``host:port`` can be bound now as the server will bind it: asyncio's
    ``create_server`` binds every address the host resolves to (an empty host: every interface), with
    address reuse on and IPv6 sockets IPv6-only, skipping a family this machine cannot open and an
    address it does not have, and fails when another bind fails (a port in use, a port below 1024
    without the right) or none succeeds. Checked before a model loads, so that such a port fails at once
    rather than after the load; the server binds again when it starts (another process may take the
    port between)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    bound = 0
    with contextlib.ExitStack() as probes:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            try:
                probe = probes.enter_context(socket.socket(family, kind, proto))
            except OSError:  # a family this machine cannot open (IPv6 turned off): the server skips it too
                continue
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:  # an address this machine does not have: skipped
                    continue
                raise ConfigError(f"cannot listen on {where}: {exc.strerror or exc}") from None
            bound += 1
    if not bound:
        raise ConfigError(f"cannot listen on {where}: none of its addresses can be bound here")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
