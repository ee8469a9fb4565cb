"""The OpenAI API's request bodies (completions and chat completions), checked field by field, and the
``SamplingParams`` they ask for.

Types are strict (a string is not a number, ``true`` is not 1); fields OpenAI defines that graphrt's
engine does not implement (penalties, logit bias, tools, ``best_of``, ``suffix``) are refused when set
to anything but their neutral value, so that no request silently gets less than it asked for. Unknown
fields are ignored, as OpenAI-compatible servers do. ``top_k`` and ``ignore_eos`` are the usual
extensions (vLLM's names).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphrt.base.errors import InvalidRequestError
from graphrt.llm import CHAT_ROLES, template_role
from graphrt.sampling.params import SEED_LIMIT, SamplingParams
from graphrt.serve.errors import bad_request

#: OpenAI's limit on stop strings per request.
MAX_STOP_STRINGS = 4
#: Most top tokens a request may list per position (chat's top_logprobs; completions' logprobs).
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields completions and chat completions share. ``null`` for a field means its default, as in
    OpenAI's API (clients send it for what they leave unset)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        return {key: value for key, value in data.items() if value is not None}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise bad_request(f"{name} is not supported by graphrt: leave it at 0", param=name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by graphrt", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream: true", param="stream_options")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
        if any(not stop for stop in stops):
            raise bad_request("stop strings must not be empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> list[SamplingParams]:
        """The ``SamplingParams`` of the request's ``n`` choices of one prompt, choice ``choice`` first:
        with a seed, choice ``i`` draws with ``seed + i``, so that each is reproducible and they differ."""
        stops = self.stop_strings()
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    seed=None if self.seed is None else (self.seed + choice + i) % SEED_LIMIT, stop=stops,
                    ignore_eos=self.ignore_eos, logprobs=logprobs,
                )
                for i in range(self.n)
            ]
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.field) from None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids, or a
    list of lists of token ids (one choice set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by graphrt", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by graphrt (it must equal n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported by graphrt", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("prompt is empty", param="prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None

    def as_turn(self, index: int) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template: text parts joined; OpenAI's ``developer`` role is
        the system prompt."""
        if self.role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role {self.role!r} is not one of {', '.join(CHAT_ROLES)}",
                              param=f"messages.{index}.role")
        if self.tool_calls or self.function_call is not None:
            raise bad_request(f"messages[{index}] holds tool calls, which graphrt does not support",
                              param=f"messages.{index}")
        if self.content is None:
            raise bad_request(f"messages[{index}] has no content", param=f"messages.{index}.content")
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": template_role(self.role), "content": content}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_unsupported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise bad_request("tools are not supported by graphrt", param="tools")
        if self.functions or self.function_call not in (None, "none"):
            raise bad_request("functions are not supported by graphrt", param="functions")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad_request("response_format takes only {\"type\": \"text\"} in graphrt (no JSON modes)",
                              param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top tokens per position for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def turns(self) -> list[dict[str, str]]:
        return [message.as_turn(index) for index, message in enumerate(self.messages)]
