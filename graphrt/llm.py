"""``graphrt.LLM``: load a model once, then generate for batches of prompts."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import numbers
from collections.abc import Iterable as IterableABC
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from graphrt.base.errors import ConfigError, GraphrtError, InvalidRequestError
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.loader.tokenizer import Tokenizer
from graphrt.outputs import RequestOutput
from graphrt.sampling.params import SamplingParams

Prompt = str | list[int]
#: One chat turn, ``{"role": ..., "content": ...}``, and a conversation: turns in order.
Message = dict[str, str]
Conversation = list[Message]
#: Roles a chat message may have: the chat template's, then OpenAI's ``developer``, a system prompt.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def template_role(role: str) -> str:
    """The role a chat template knows a message by: ``developer`` is ``system``."""
    return "system" if role == "developer" else role


class LLM:
    """Offline generation over the engine.

    >>> llm = LLM(model="random:tiny", device="cpu")
    >>> [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    >>> len(out.token_ids)
    4

    ``model``: an HF directory, a ``.gguf`` file, ``random:PRESET``, or None for the default
    SmolLM2-135M-Instruct GGUF. Other keyword arguments are ``EngineConfig`` fields.

    ``close()`` frees the weights, the KV cache and the decode graphs' memory at once (``with LLM(...)
    as llm:`` closes on leaving the block); an ``LLM`` nobody references is freed by garbage collection.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str | None = "auto",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        block_size: int = 16,
        enforce_eager: bool = False,
        progress: bool = True,
        **engine_options,
    ) -> None:
        _check_option_names(engine_options)
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, enforce_eager=enforce_eager, **engine_options,
        )
        self.engine = LLMEngine(config, progress=progress)
        #: Per request of an open stream: its outputs not yet read by that stream.
        self._inboxes: dict[str, collections.deque[RequestOutput]] = {}

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def close(self) -> None:
        """Free the model's device memory now (``LLMEngine.close``); the ``LLM`` is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either); returns one
        finished output per prompt, in order. An invalid request gets ``finish_reason="error"`` and an
        ``error`` message while the others still run."""
        results: list[RequestOutput | None] = [None] * len(_as_prompt_list(prompts))
        for index, output in self.generate_stream(prompts, sampling_params):
            if output.finished:
                results[index] = output
        return results  # type: ignore[return-value]

    def generate_stream(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """``generate`` as it runs: yields ``(index, output)`` each time prompt ``index``'s request gets
        tokens, ``output`` holding everything so far (``token_ids``, ``text``); each request's last
        output is finished (a rejected request's comes first, with ``finish_reason="error"``). Several
        streams (and ``generate`` calls) may share one ``LLM``: whichever steps the engine passes each
        output to the stream that owns it. Leaving the loop early (``break``, an exception, Ctrl-C)
        aborts the stream's unfinished requests (``LLMEngine.abort_request``)."""
        if self.engine.closed:
            raise GraphrtError("this LLM is closed")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        return self._stream(prompts, params)

    def _stream(self, prompts: list[Prompt], params: list[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        mine: dict[str, int] = {}
        rejected: list[tuple[int, RequestOutput]] = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                request_id = self.engine.add_request(prompt, p)
            except GraphrtError as exc:
                rejected.append((index, self.engine.error_output(prompt, exc, request_id=f"rejected-{index}")))
                continue
            mine[request_id] = index
            self._inboxes[request_id] = collections.deque()
        unfinished = set(mine)
        try:
            yield from rejected
            while unfinished:
                if not any(self._inboxes[request_id] for request_id in unfinished):
                    self._step_into_inboxes()
                for request_id in list(unfinished):
                    inbox = self._inboxes[request_id]
                    while inbox:
                        output = inbox.popleft()
                        if output.finished:
                            unfinished.discard(request_id)
                        yield mine[request_id], output
        finally:
            if unfinished and not self.engine.closed:
                for request_id in unfinished:
                    self.engine.abort_request(request_id)
                while any(not (inbox := self._inboxes[r]) or not inbox[-1].finished for r in unfinished):
                    self._step_into_inboxes()
            for request_id in mine:
                self._inboxes.pop(request_id, None)

    def _step_into_inboxes(self) -> None:
        """One engine step; each output goes to the inbox of the stream that owns its request (outputs of
        requests added to the engine directly are not ours to keep)."""
        for output in self.engine.step():
            inbox = self._inboxes.get(output.request_id)
            if inbox is not None:
                inbox.append(output)

    def chat(
        self,
        messages: str | Conversation | list[str | Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's next turn of each conversation, rendered through the model's chat
        template; returns one finished output per conversation, in order, whose ``prompt`` is the
        rendered text.

        ``messages``: one user message (a string); one conversation, a list of ``{"role", "content"}``
        dicts (roles ``CHAT_ROLES``: a system or developer prompt, then user and assistant turns); or a list of
        either, one request each (vLLM's convention). Raises InvalidRequestError naming the
        conversation and message that is malformed, or that the template refuses."""
        conversations = _as_conversations(messages)
        rendered = [self._render_chat(conversation, index) for index, conversation in enumerate(conversations)]
        outputs = self.generate([ids for _, ids in rendered], sampling_params)
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text
        return outputs

    def chat_prompt_ids(self, messages: str | Conversation) -> list[int]:
        """Token ids of a user message (a string) or a conversation rendered through the chat template,
        ready for the assistant's turn."""
        conversations = _as_conversations(messages)
        if len(conversations) != 1:
            raise InvalidRequestError(f"expected one message or one conversation, got {len(conversations)}")
        return self._render_chat(conversations[0], 0)[1]

    def _render_chat(self, conversation: Conversation, index: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raise GraphrtError("this model has no tokenizer, so it has no chat template")
        _check_conversation(conversation, index)
        conversation = [{**message, "role": template_role(message["role"])} for message in conversation]
        try:
            text = self.tokenizer.apply_chat_template(conversation)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"conversation {index}: {exc}") from None
        return text, self.tokenizer.encode_chat(conversation, text)


def _as_conversations(messages) -> list[Conversation]:
    """The conversations ``LLM.chat`` was given: a string is one user turn; a list of dicts one
    conversation; otherwise a list of strings and conversations."""
    if isinstance(messages, str):
        return [[{"role": "user", "content": messages}]]
    if not isinstance(messages, SequenceABC):
        raise InvalidRequestError(f"chat takes a string, a conversation (a list of messages) or a list of them, "
                                  f"got {type(messages).__name__}")
    if messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    conversations = []
    for index, item in enumerate(messages):
        if isinstance(item, str):
            conversations.append([{"role": "user", "content": item}])
        elif isinstance(item, SequenceABC) and not isinstance(item, (str, bytes)):
            conversations.append(list(item))
        else:
            raise InvalidRequestError(f"conversation {index}: expected a string or a list of messages, "
                                      f"got {type(item).__name__}")
    return conversations


def _check_conversation(conversation: Conversation, index: int) -> None:
    if not conversation:
        raise InvalidRequestError(f"conversation {index} has no messages")
    for turn, message in enumerate(conversation):
        where = f"conversation {index}, message {turn}"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where}: expected a dict with 'role' and 'content', "
                                      f"got {type(message).__name__}")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise InvalidRequestError(f"{where}: missing {' and '.join(repr(k) for k in missing)}")
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequestError(f"{where}: role {message['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            raise InvalidRequestError(f"{where}: content must be a string, got {type(message['content']).__name__}")


def _check_option_names(options: dict) -> None:
    """Refuse a keyword that is no ``EngineConfig`` field, naming the closest one (other engines'
    spellings: ``swap_space`` for ``swap_space_bytes``)."""
    known = [item.name for item in dataclasses.fields(EngineConfig)]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; the options are EngineConfig's fields"
            raise ConfigError(f"LLM got an unknown option {name!r}{hint}")


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids (any integer type: NumPy's too)
    if not isinstance(prompts, IterableABC) or isinstance(prompts, (bytes, dict)):
        raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of prompts, "
                                  f"got {type(prompts).__name__}")
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if not isinstance(params, IterableABC) or isinstance(params, (str, bytes, dict)):
        raise InvalidRequestError(f"sampling params must be a SamplingParams or a list of them, got "
                                  f"{type(params).__name__}" + (" (build one: SamplingParams(**options))"
                                                                if isinstance(params, dict) else ""))
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"{len(params)} sampling params given for {count} prompts")
    return params
