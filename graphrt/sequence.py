"""A request's state as it moves through the engine: tokens, sampling, status and cache progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from graphrt.sampling.logprobs import TokenLogprobs
from graphrt.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is prefilled or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS or stop token was generated (it is the last output token)
    LENGTH = "length"  # max_tokens reached, or the sequence reached max_model_len
    ERROR = "error"  # the request was rejected; see RequestOutput.error
    ABORT = "abort"  # the caller aborted the request (LLMEngine.abort_request)


@dataclass
class Sequence:
    """One request. ``seq_id`` orders arrivals: a larger id arrived later (preemption takes the newest)."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: The seed its random draws use: its own, or one the engine drew for it on arrival.
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    #: Tokens whose K/V are in the cache; reset to 0 on preemption (the cache is recomputed).
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    #: With ``params.logprobs``: one entry per output token, in order (kept across preemption).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: With ``params.prompt_logprobs``: one entry per prompt token (None for the first), set by the
    #: prefill (whole, or the chunk) whose rows complete it: a chunk ending one token short of the prompt's
    #: end completes it, the last token's row scoring nothing. A recompute after preemption leaves it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    #: While a prompt that asks for them is prefilled in chunks: the entries of the chunks computed so far.
    partial_prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest token (the input of the next decode), without copying the token lists."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The token ids at positions ``start`` to ``end`` (exclusive), prompt then output, without
        copying the rest."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):end - len(prompt)]
        return prompt[start:] + self.output_token_ids[:end - len(prompt)]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def at_length_limit(self, max_model_len: int, pending: int = 0) -> bool:
        """Whether ``max_tokens`` or ``max_model_len`` is reached, counting ``pending`` tokens sampled
        but not appended yet (a pipelined engine's token in flight)."""
        return (len(self.output_token_ids) + pending >= self.params.max_tokens
                or self.num_tokens + pending >= max_model_len)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the next prefill must score the prompt (asked for, and not scored yet)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def append_token(self, token_id: int, max_model_len: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record a sampled token (with its logprobs when the request asked); finish the sequence when a
        stop condition holds."""
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        stop_ids = self.params.stop_token_ids
        if token_id in stop_ids or (not self.params.ignore_eos and token_id in self.eos_token_ids):
            self.finish(FinishReason.STOP)
        elif self.at_length_limit(max_model_len):
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        """End the sequence for ``reason`` (a stop condition, or the caller's abort)."""
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
