"""The engine's step loop on a thread of its own, fed by the server's asyncio handlers.

The engine is not thread-safe: only the loop's thread touches it. Handlers hand it commands (add a
request, abort one, stop) through a queue; it runs them between steps, steps while any request is
unfinished (so that concurrent requests batch together), and sleeps on the queue otherwise. Each
request's outputs go back to its handler's event loop, where only the newest is kept: a client that
reads slowly gets the text that grew meanwhile in one piece, and memory does not grow with its lag.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from graphrt.base.errors import GraphrtError
from graphrt.engine import LLMEngine
from graphrt.outputs import RequestOutput
from graphrt.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStopped(GraphrtError):
    """The loop is not running (it was stopped, or a step failed): no request can be served."""


class _Mailbox:
    """A request's verdict (accepted or refused by the engine) and newest output, on the event loop of
    the handler that reads them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready = asyncio.Event()
        self._latest: RequestOutput | BaseException | None = None
        self._decided = asyncio.Event()
        self._refusal: BaseException | None = None

    def post(self, item: RequestOutput | BaseException) -> None:
        """From the engine's thread: replace the newest output (or fail the request)."""
        self._call(self._put, item)

    def accept(self) -> None:
        """From the engine's thread: the engine took the request."""
        self._call(self._decided.set)

    def _call(self, function, *args) -> None:
        _call_in(self._loop, function, *args)

    @staticmethod
    def post_all(posts: list[tuple[_Mailbox, RequestOutput]]) -> None:
        """From the engine's thread: a step's outputs, one wake-up of each event loop they go to (not one
        per request: each wake-up writes to the loop's self-pipe, and a step may end hundreds)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, RequestOutput]]] = {}
        for mailbox, output in posts:
            by_loop.setdefault(mailbox._loop, []).append((mailbox, output))
        for loop, items in by_loop.items():
            _call_in(loop, _put_each, items)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._latest, BaseException) or (isinstance(self._latest, RequestOutput)
                                                        and self._latest.finished):
            return  # a request's end is never overwritten
        if isinstance(item, BaseException) and not self._decided.is_set():
            self._refusal = item
        self._decided.set()
        self._latest = item
        self._ready.set()

    async def accepted(self) -> None:
        await self._decided.wait()
        if self._refusal is not None:
            raise self._refusal

    async def take(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            raise item
        return item


def _call_in(loop: asyncio.AbstractEventLoop, function, *args) -> None:
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the handler's event loop is closed: nobody is left to read it
        pass


def _put_each(items: list[tuple[_Mailbox, RequestOutput]]) -> None:
    for mailbox, output in items:
        mailbox._put(output)


class EngineLoop:
    """Runs ``engine``'s steps on a daemon thread (``start`` / ``stop``); ``submit`` hands it a request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._mailboxes: dict[str, _Mailbox] = {}  # the loop thread's alone
        self._thread = threading.Thread(target=self._run, name="graphrt-engine", daemon=True)
        #: Why the loop ended, when a step raised (the server then answers 503).
        self.failure: BaseException | None = None
        self._stopped = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after its current step; unfinished requests fail with ``EngineStopped``."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> ServedRequest:
        """Hand a request to the engine (from the handler's event loop). Raises ``EngineStopped`` when
        the loop is not running; the engine's own verdict comes through ``ServedRequest.accepted``."""
        if not self.running:
            raise EngineStopped(self._why_stopped())
        request_id = f"srv-{uuid.uuid4().hex}"  # not guessable: no client can address another's request
        mailbox = _Mailbox(asyncio.get_running_loop())
        self._commands.put(("add", request_id, prompt_ids, params, mailbox))
        return ServedRequest(self, request_id, mailbox)

    def abort(self, request_id: str) -> None:
        """Stop a request at the engine's next command check (its last output: ``finish_reason="abort"``)."""
        self._commands.put(("abort", request_id))

    def _why_stopped(self) -> str:
        if self.failure is not None:
            return f"the engine failed: {type(self.failure).__name__}: {self.failure}"
        return "the engine is stopped"

    # -- the loop's thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._take_commands(wait=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # a failed step: the engine's state cannot be trusted after it
            logger.exception("graphrt serve: the engine's step failed; requests are refused from now on")
            self.failure = exc
        finally:
            self._stopped.set()
            reason = EngineStopped(self._why_stopped())
            for mailbox in self._mailboxes.values():
                mailbox.post(reason)
            self._mailboxes.clear()
            self._refuse_queued(reason)

    def _take_commands(self, wait: bool) -> bool:
        """Run the queued commands (waiting for one first if ``wait``); False once told to stop."""
        try:
            command = self._commands.get() if wait else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self.engine.abort_request(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, mailbox: _Mailbox) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except GraphrtError as exc:
            mailbox.post(exc)
            return
        mailbox.accept()
        self._mailboxes[request_id] = mailbox

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        posts = []
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            posts.append((mailbox, output))
            if output.finished:
                del self._mailboxes[output.request_id]
        _Mailbox.post_all(posts)

    def _refuse_queued(self, reason: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[4].post(reason)


class ServedRequest:
    """A request handed to an ``EngineLoop``: ``accepted`` waits for the engine's verdict (raising its
    InvalidRequestError, or ``EngineStopped``), ``outputs`` follows it (each output the whole output so
    far; the last one finished), ``close`` aborts it unless it finished."""

    def __init__(self, loop: EngineLoop, request_id: str, mailbox: _Mailbox) -> None:
        self._engine_loop, self.request_id, self._mailbox = loop, request_id, mailbox
        self.finished = False
        self._closed = False

    async def accepted(self) -> None:
        await self._mailbox.accepted()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            output = await self._mailbox.take()
            self.finished = output.finished
            yield output

    def close(self) -> None:
        if not self.finished and not self._closed:
            self._closed = True
            self._engine_loop.abort(self.request_id)
