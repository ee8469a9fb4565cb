"""The OpenAI API's completions and chat completions over an ``EngineLoop``: requests turned into engine
requests (one per choice), their outputs into OpenAI's response objects, whole or as stream chunks."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from graphrt.base.errors import ConfigError, InvalidRequestError
from graphrt.llm import LLM
from graphrt.loader.token_bytes import token_label
from graphrt.outputs import RequestOutput
from graphrt.sampling.logprobs import TokenLogprobs
from graphrt.sampling.params import SamplingParams
from graphrt.serve.engine_loop import EngineLoop, EngineStopped, ServedRequest
from graphrt.serve.errors import ApiError, bad_request
from graphrt.serve.limits import AdmissionGate, ServerLimits
from graphrt.serve.protocol import ChatCompletionRequest, CompletionRequest

#: OpenAI's default max_tokens for completions (chat completions default to what the context leaves).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class Choice:
    """One engine request of an API request: its choice index, prompt ids and sampling."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # completions' echo: the prompt text put before the answer


class OpenAIHandlers:
    """Turns API requests into choices, runs them (through ``gate``, then ``loop``) and shapes the
    answers. ``model_name``: the one model this server serves (requests naming another get 404)."""

    def __init__(self, llm: LLM, loop: EngineLoop, limits: ServerLimits, model_name: str) -> None:
        if llm.tokenizer is None:
            raise ConfigError(f"graphrt serve needs a model with a tokenizer; {llm.engine.config.model!r} has none")
        self.llm, self.loop, self.limits, self.model_name = llm, loop, limits, model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.max_model_len
        self.vocab_size = llm.engine.model_config.vocab_size
        self.max_prompt_tokens = min(limits.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_tokens = min(limits.max_tokens or self.max_model_len, self.max_model_len)
        #: The longest sequence a request may grow to unasked: an explicit max_model_len may exceed the cache.
        self.default_sequence_len = min(self.max_model_len, llm.engine.sequence_capacity)
        self.created = int(time.time())
        self.gate = AdmissionGate(limits.max_concurrent, limits.max_queued)
        self._token_data: dict[int, bytes] = {}

    # -- requests into choices ------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _resolve_max_tokens(self, asked: int | None, default: int | None, prompt_tokens: int, prompt_field: str,
                            asked_field: str = "max_tokens") -> int:
        if prompt_tokens > self.max_prompt_tokens:
            raise bad_request(f"the prompt has {prompt_tokens} tokens; this server takes at most "
                              f"{self.max_prompt_tokens}", param=prompt_field)
        room = self.max_model_len - prompt_tokens
        if asked is None:
            return max(1, min(default or self.max_tokens, self.max_tokens, self.default_sequence_len - prompt_tokens))
        if asked > self.max_tokens:
            raise bad_request(f"{asked_field}={asked} is above this server's limit of {self.max_tokens}",
                              param=asked_field)
        if asked > room:
            raise bad_request(f"this model's context is {self.max_model_len} tokens: the prompt's {prompt_tokens} "
                              f"leave room for {room}, but {asked_field} asks for {asked}", param=asked_field)
        return asked

    def _check_choice_count(self, choices: list[Choice], prompts: int) -> list[Choice]:
        """More choices than the server runs at once could never be admitted: refused up front."""
        capacity = self.gate.capacity
        if len(choices) > capacity:
            asked = f"{prompts} prompts x n={len(choices) // prompts}" if prompts > 1 else f"n={len(choices)}"
            raise bad_request(f"the request asks for {len(choices)} answers ({asked}) but this server runs at most "
                              f"{capacity} at once", param="prompt" if prompts > 1 else "n")
        return choices

    def completion_choices(self, request: CompletionRequest) -> list[Choice]:
        request.check()
        self.check_model(request.model)
        choices = []
        for number, prompt in enumerate(request.prompts()):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._checked_ids(prompt)
            echo = "" if not request.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            max_tokens = self._resolve_max_tokens(request.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, len(ids),
                                                  "prompt")
            first = number * request.n
            for offset, params in enumerate(request.sampling_params(max_tokens, request.logprobs, first)):
                choices.append(Choice(first + offset, ids, params, echo))
        return self._check_choice_count(choices, len(choices) // request.n)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        outside = next((token for token in ids if not 0 <= token < self.vocab_size), None)
        if outside is not None:
            raise bad_request(f"token id {outside} is outside the model's vocabulary [0, {self.vocab_size})",
                              param="prompt")
        return ids

    def chat_choices(self, request: ChatCompletionRequest) -> list[Choice]:
        request.check()
        self.check_model(request.model)
        try:
            ids = self.llm.chat_prompt_ids(request.turns())
        except InvalidRequestError as exc:
            raise bad_request(str(exc).removeprefix("conversation 0, "), param="messages") from None
        asked_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._resolve_max_tokens(request.requested_max_tokens, None, len(ids), "messages", asked_field)
        return self._check_choice_count(
            [Choice(index, ids, params)
             for index, params in enumerate(request.sampling_params(max_tokens, request.num_logprobs, 0))], 1)

    # -- running choices --------------------------------------------------------------------------

    async def start(self, choices: list[Choice]) -> list[ServedRequest]:
        """Hand the choices (admitted already: ``gate.admit``) to the engine and wait for its verdict on
        each, so that a refusal is an error answer before any of the answer is sent. Raises ApiError 400
        for a choice the engine refuses (the others are aborted), 503 when the engine is not running."""
        requests: list[ServedRequest] = []
        try:
            for choice in choices:
                requests.append(self.loop.submit(choice.prompt_ids, choice.params))
            for request in requests:
                await request.accepted()
        except BaseException as exc:
            for request in requests:
                request.close()
            if isinstance(exc, InvalidRequestError):
                raise bad_request(str(exc)) from None
            if isinstance(exc, EngineStopped):
                raise ApiError(503, str(exc)) from None
            raise
        return requests

    async def run(self, choices: list[Choice], requests: list[ServedRequest]
                  ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each choice's outputs as they come (``requests``: what ``start`` gave for them); leaving early
        aborts the unfinished ones. Raises ApiError 503 when the engine stops meanwhile."""
        if len(choices) == 1:  # the common case needs no task and queue between the request and its reader
            try:
                async for output in requests[0].outputs():
                    yield choices[0], output
            except EngineStopped as exc:
                raise ApiError(503, str(exc)) from None
            finally:
                requests[0].close()
            return
        outputs: asyncio.Queue = asyncio.Queue()

        async def follow(choice: Choice, request: ServedRequest) -> None:
            try:
                async for output in request.outputs():
                    outputs.put_nowait((choice, output))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                outputs.put_nowait((choice, exc))

        tasks = [asyncio.create_task(follow(choice, request)) for choice, request in zip(choices, requests)]
        try:
            unfinished = len(choices)
            while unfinished:
                choice, item = await outputs.get()
                if isinstance(item, Exception):
                    raise ApiError(503, str(item))
                unfinished -= item.finished
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for request in requests:
                request.close()

    # -- answers ----------------------------------------------------------------------------------

    def _envelope(self, kind: str, request_id: str) -> dict:
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def complete(self, choices: list[Choice], requests: list[ServedRequest], chat: bool) -> dict:
        """The whole answer, once every choice finished."""
        finals: dict[int, tuple[Choice, RequestOutput]] = {}
        async for choice, output in self.run(choices, requests):
            if output.finished:
                finals[choice.index] = (choice, output)
        answer = self._envelope("chat.completion" if chat else "text_completion", _request_id(chat))
        answer["choices"] = [self._final_choice(*finals[index], chat) for index in sorted(finals)]
        answer["usage"] = self.usage(_count_prompt_tokens(choices), sum(len(o.token_ids) for _, o in finals.values()))
        return answer

    def _final_choice(self, choice: Choice, output: RequestOutput, chat: bool) -> dict:
        logprobs = None
        if output.logprobs is not None:
            logprobs = self._chat_logprobs(output.logprobs) if chat else self._completion_logprobs(
                output.logprobs, TextOffsets(len(choice.echo)))
        if chat:
            return {"index": choice.index, "message": {"role": "assistant", "content": output.text, "refusal": None},
                    "logprobs": logprobs, "finish_reason": output.finish_reason}
        return {"index": choice.index, "text": choice.echo + output.text, "logprobs": logprobs,
                "finish_reason": output.finish_reason}

    async def stream(self, choices: list[Choice], requests: list[ServedRequest], chat: bool,
                     include_usage: bool) -> AsyncIterator[bytes]:
        """The answer as server-sent events: each choice's new text (chat: its role first), its finish
        reason with its last piece; then, with ``include_usage``, a chunk of usage alone."""
        events = StreamEvents(self._envelope("chat.completion.chunk" if chat else "text_completion",
                                             _request_id(chat)), chat, include_usage)
        sent_text = {choice.index: 0 for choice in choices}
        sent_tokens = {choice.index: 0 for choice in choices}
        offsets = {choice.index: TextOffsets(len(choice.echo)) for choice in choices}  # completions' text_offset
        completion_tokens = 0
        if chat:
            for choice in choices:
                yield events.event([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}])
        elif any(choice.echo for choice in choices):
            for choice in choices:
                yield events.text(choice.index, choice.echo)
        async for choice, output in self.run(choices, requests):
            text = output.text or ""
            delta = text[sent_text[choice.index]:]
            new_logprobs = (output.logprobs or [])[sent_tokens[choice.index]:]
            if not delta and not output.finished and not new_logprobs:
                continue
            sent_text[choice.index] = len(text)
            sent_tokens[choice.index] = len(output.token_ids)
            if output.logprobs is None and not output.finished:
                yield events.text(choice.index, delta)  # the common chunk, from a template
                continue
            logprobs = None
            if output.logprobs is not None:
                logprobs = (self._chat_logprobs(new_logprobs) if chat else self._completion_logprobs(
                    new_logprobs, offsets[choice.index]))
            piece = {"index": choice.index, "logprobs": logprobs, "finish_reason": output.finish_reason}
            piece.update({"delta": {"content": delta} if delta or not output.finished else {}} if chat
                         else {"text": delta})
            if output.finished:
                completion_tokens += len(output.token_ids)
            yield events.event([piece])
        if include_usage:
            yield events.event([], usage=self.usage(_count_prompt_tokens(choices), completion_tokens))

    # -- logprobs ---------------------------------------------------------------------------------

    def _token_bytes(self, token_id: int) -> bytes:
        data = self._token_data.get(token_id)
        if data is None:
            data = self._token_data[token_id] = self.tokenizer.token_bytes(token_id)
        return data

    def _token_label(self, token_id: int) -> str:
        return token_label(self._token_bytes(token_id))

    def _completion_logprobs(self, scored: list[TokenLogprobs], offsets: TextOffsets) -> dict:
        """Completions' logprobs of ``scored`` tokens, which follow what ``offsets`` has counted of this
        answer (and advances over them)."""
        return {"tokens": [self._token_label(entry.token_id) for entry in scored],
                "token_logprobs": [entry.logprob for entry in scored],
                "top_logprobs": [{self._token_label(t): lp for t, lp in entry.top} for entry in scored],
                "text_offset": [offsets.advance(self._token_bytes(entry.token_id)) for entry in scored]}

    def _chat_logprobs(self, scored: list[TokenLogprobs]) -> dict:
        def described(token_id: int, logprob: float) -> dict:
            return {"token": self._token_label(token_id), "logprob": logprob,
                    "bytes": list(self._token_bytes(token_id))}

        return {"content": [{**described(entry.token_id, entry.logprob),
                             "top_logprobs": [described(t, lp) for t, lp in entry.top]} for entry in scored]}


class TextOffsets:
    """Completions' ``text_offset`` of an answer's tokens, one after another: the whole characters before
    each (after ``start`` characters of echoed prompt), its tokens' bytes decoded as they come (a
    character split across tokens counts once it is whole)."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self.chars = start

    def advance(self, data: bytes) -> int:
        """The offset of a token of bytes ``data``; counts the characters it completes after it."""
        offset = self.chars
        self.chars += len(self._decoder.decode(data))
        return offset


class StreamEvents:
    """A stream's chunks as server-sent events (``data: {json}``), all under one ``envelope`` (id, object,
    created, model). The chunk sent per token and request, new text alone, is written from a template:
    building and encoding its dict took most of the server's time per token under many streams."""

    def __init__(self, envelope: dict, chat: bool, include_usage: bool) -> None:
        # With include_usage every chunk has a usage field, null but in the last (OpenAI's shape).
        self.envelope = {**envelope, "usage": None} if include_usage else envelope
        self._text_head = "data: " + json.dumps(envelope, ensure_ascii=False)[:-1] + ',"choices":[{"index":'
        self._text_key, self._text_close = (',"delta":{"content":', "}") if chat else (',"text":', "")
        self._text_end = ',"logprobs":null,"finish_reason":null}]' + (',"usage":null' if include_usage else "") + "}"

    def text(self, index: int, text: str) -> bytes:
        """The chunk of choice ``index``'s new ``text`` (no logprobs, not its last)."""
        return (f"{self._text_head}{index}{self._text_key}{json.dumps(text, ensure_ascii=False)}{self._text_close}"
                f"{self._text_end}\n\n").encode()

    def event(self, choices: list[dict], **fields) -> bytes:
        """A chunk of ``choices`` (and other top-level ``fields``: usage)."""
        return sse_event({**self.envelope, "choices": choices, **fields})


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _count_prompt_tokens(choices: list[Choice]) -> int:
    """Prompt tokens of a request: each prompt once, however many choices it has (they share its list)."""
    return sum(len(ids) for ids in {id(c.prompt_ids): c.prompt_ids for c in choices}.values())


def _request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
