"""What the engine returns per request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from graphrt.sampling.logprobs import TokenLogprobs
from graphrt.speculative.drafting import SpeculativeStats


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end (``generate``).

    ``token_ids`` holds every token generated so far, a final stop token included; ``text`` is their
    decoding without special tokens (None for models without a tokenizer). ``finish_reason`` is None
    while the request runs, then ``"stop"`` (a stop token or stop string), ``"length"``, ``"abort"`` (``LLMEngine.abort_request``) or
    ``"error"`` (with ``error`` saying why; such a request was never run).

    ``logprobs`` (requests with ``SamplingParams.logprobs``): one ``TokenLogprobs`` per entry of
    ``token_ids``; ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one per prompt token,
    None for the first. Both None when not asked for. ``speculative`` (engines with speculative
    decoding): the request's verify steps, draft tokens proposed and kept, tokens produced.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    speculative: SpeculativeStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return asdict(self)
