"""The HTTP API: FastAPI routes for ``/v1/completions``, ``/v1/chat/completions`` (whole answers, or
server-sent events with ``stream: true``), ``/v1/models`` and ``/health``, with the server's guards:
an API key compared in constant time, a capped body read under a deadline, admission through the
gate (429 when full), and a request aborted when its client goes away."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from graphrt.serve.errors import ApiError, bad_request
from graphrt.serve.openai_api import Choice, OpenAIHandlers, sse_event
from graphrt.serve.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


def build_app(handlers: OpenAIHandlers) -> FastAPI:
    """The server's ASGI app over ``handlers`` (its engine loop, limits and model name)."""
    limits = handlers.limits
    app = FastAPI(title="graphrt", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("graphrt serve: %s %s failed", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def authorize(request: Request) -> None:
        if limits.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        # Constant time: how much of a wrong key matched must not show in the answer's timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), limits.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if not handlers.loop.running:
            raise ApiError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": handlers.model_name, "object": "model", "created": handlers.created, "owned_by": "graphrt",
                "max_model_len": handlers.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> Response:
        authorize(request)
        handlers.check_model(name)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await read_request(request, CompletionRequest, limits.max_body_bytes, limits.body_timeout)
        return await answer(request, handlers.completion_choices(body), chat=False, stream=body.stream,
                            include_usage=body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_request(request, ChatCompletionRequest, limits.max_body_bytes, limits.body_timeout)
        return await answer(request, handlers.chat_choices(body), chat=True, stream=body.stream,
                            include_usage=body.include_usage)

    async def answer(request: Request, choices: list[Choice], chat: bool, stream: bool,
                     include_usage: bool) -> Response:
        # A client that leaves while queued gives its place up.
        await until_disconnect(request, handlers.gate.admit(len(choices)))
        release = _once(lambda: handlers.gate.release(len(choices)))
        streaming = False
        try:
            requests = await handlers.start(choices)
            if stream:
                streaming = True  # from here the stream releases the slots, when it ends
                return EventStream(handlers.stream(choices, requests, chat, include_usage), on_close=release)
            return JSONResponse(await until_disconnect(request, handlers.complete(choices, requests, chat)))
        finally:
            if not streaming:
                release()

    return app


async def read_request(request: Request, model: type[BaseModel], max_bytes: int, timeout: float):
    """The body parsed as ``model``: at most ``max_bytes`` (413), all of it within ``timeout`` seconds
    (408), JSON (400), valid (400 naming the field)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise ApiError(413, f"the request body is over this server's limit of {max_bytes} bytes")
    chunks, size = [], 0
    pieces = request.stream().__aiter__()
    clock = asyncio.get_running_loop()
    deadline = clock.time() + timeout  # for the whole body: a client trickling bytes gains no time
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(pieces.__anext__(), max(0.0, deadline - clock.time()))
            except StopAsyncIteration:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the request body is over this server's limit of {max_bytes} bytes")
            chunks.append(chunk)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the request") from None
    try:
        data = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(*describe_invalid(exc.errors())) from None


def describe_invalid(errors: list[dict]) -> tuple[str, str | None]:
    """A validation failure as (message, param): the field of the first error, its path without
    pydantic's names of union members (``stop.str``); for a field that takes several types, which ones,
    and the deepest of its errors (a message part that is not text says where)."""
    first = errors[0]
    param = _field_path(first["loc"]) or None
    if not param:
        return first["msg"], None
    tags = [part for part in first["loc"] if _is_type_tag(part)]
    if not tags:
        return f"{param}: {first['msg']}", param
    # A union: every member's errors follow, each under its own tag at the same position.
    position = first["loc"].index(tags[0])
    prefix = first["loc"][:position]
    members = [e for e in errors if tuple(e["loc"][:position]) == tuple(prefix) and len(e["loc"]) > position]
    kinds = list(dict.fromkeys(e["loc"][position] for e in members))
    message = f"{param}: must be one of {', '.join(kinds)}"
    deepest = max(members, key=lambda e: len(e["loc"]))
    if len(deepest["loc"]) > position + 1:
        message += f" ({_field_path(deepest['loc'])}: {deepest['msg']})"
    return message, param


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "dict", "list"})


def _field_path(loc) -> str:
    return ".".join(str(part) for part in loc if not _is_type_tag(part))


async def until_disconnect(request: Request, work):
    """Await ``work``, cancelled (its requests aborted) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(400, "the client went away")  # nobody reads this answer
    return task.result()


class EventStream(Response):
    """Server-sent events: each of ``events`` (encoded already: ``data: {json}``), then ``data: [DONE]``.
    A client that disconnects stops the stream (its requests are aborted); an error after the first event
    is sent as an event of its own. ``on_close`` runs once the stream ends, however it ends."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        # No Response.__init__: it would declare a content-length of 0; the stream's length is unknown.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self._chunks, self._on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            streaming = asyncio.ensure_future(self._send_all(send))

            async def disconnected() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass

            watcher = asyncio.ensure_future(disconnected())
            try:
                await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (streaming, watcher):
                    task.cancel()
                await asyncio.gather(streaming, watcher, return_exceptions=True)
                await self._chunks.aclose()
            if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
                raise streaming.exception()
        finally:
            self._on_close()

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self._chunks:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except ApiError as exc:
            logger.warning("graphrt serve: a stream ended early: %s", exc.message)
            await send({"type": "http.response.body", "body": sse_event(exc.body()), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def error_response(error: ApiError) -> JSONResponse:
    headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"}}.get(error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _once(action: Callable[[], None]) -> Callable[[], None]:
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run
