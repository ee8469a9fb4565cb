"""Per-request sampling settings, validated when they are built."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from graphrt.base.errors import InvalidRequestError

#: Seeds are stored in an int64 tensor on the device, so they must fit in a non-negative int64.
SEED_LIMIT = 2**63

#: Temperatures below this are sampled greedily: dividing logits by them would overflow float32.
GREEDY_TEMPERATURE = 1e-5
#: Temperatures live in a float32 tensor on the device: above this they would become infinite.
MAX_TEMPERATURE = 1e38


def _bad(name: str, value: Any, requirement: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid sampling parameter {name}={value!r}: {requirement}", field=name)


def _is_int(value: Any) -> bool:
    # bool is a subclass of int in Python; ``top_k=True`` is almost certainly a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Fields:
        max_tokens: the most tokens to generate for this request (>= 1). Generation may stop
            earlier on EOS or on one of ``stop_token_ids``.
        temperature: divides the logits before softmax (>= 0, at most ``MAX_TEMPERATURE``). ``0`` means greedy
            decoding (argmax; ties go to the lowest token id) and makes ``top_k``, ``top_p``
            and ``seed`` irrelevant. Values below ``GREEDY_TEMPERATURE`` (1e-5) are treated as
            greedy too, since dividing logits by them can overflow float32.
        top_k: keep only the ``top_k`` most likely tokens before sampling. ``0`` or ``-1``
            turns the filter off.
        top_p: nucleus sampling, in (0, 1]: keep the smallest set of most likely tokens whose
            probability sums to at least ``top_p`` (computed after temperature and top-k; see
            ``graphrt.sampling.sampler``). ``1.0`` turns the filter off.
        seed: makes this request's random draws reproducible, whatever else is in the batch:
            an int in [0, 2**63). ``None`` lets the engine pick one when the request arrives.
        stop_token_ids: generation stops after any of these token ids is produced (ids >= 0);
            the stop token is part of the output.
        stop: strings that end generation when the output's text contains one (a string alone is one
            stop string). The output's ``text`` ends where the first of them begins (the stop string
            is left out, as in OpenAI's API; ``token_ids`` keep every token generated); while the
            request runs, text that may be the start of a stop string is held back
            (``graphrt.sampling.stop_strings``). Needs a model with a tokenizer.
        ignore_eos: keep generating past the model's end-of-sequence token(s) until
            ``max_tokens`` or a stop token.
        logprobs: None (off), or k >= 0: each generated token comes with its float32 log
            probability under the model (``log_softmax`` of the raw logits, before temperature
            and filters), its rank, and the k most likely tokens with theirs (``graphrt.sampling.logprobs``;
            all of them when k exceeds the vocabulary). The engine refuses a k above its
            ``EngineConfig.max_logprobs``.
        prompt_logprobs: None (off), or k >= 0: the same for every prompt token after the first,
            scored by the prompt before it (what evaluation harnesses read for log-likelihoods).

    Raises:
        InvalidRequestError: naming the field and the bad value, if any field is invalid.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        self.max_tokens = int(self.max_tokens)

        if not _is_real(self.temperature) or not (0 <= self.temperature <= MAX_TEMPERATURE):
            raise _bad("temperature", self.temperature, f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        self.temperature = float(self.temperature)

        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to disable")
        self.top_k = int(self.top_k)

        # NaN fails both comparisons, so it is rejected here too.
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "must be a number in (0, 1]")
        self.top_p = float(self.top_p)

        if self.seed is not None:
            if not _is_int(self.seed) or not (0 <= self.seed < SEED_LIMIT):
                raise _bad("seed", self.seed, "must be None or an integer in [0, 2**63)")
            self.seed = int(self.seed)

        # A str is iterable too; accept only real sequences of ids.
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of integers >= 0")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise _bad("stop_token_ids", self.stop_token_ids,
                           f"must be a list of integers >= 0; {tok!r} is not")
        # Copy so that the caller mutating its list later cannot change a validated request.
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", self.stop, "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)

        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "must be True or False")

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not _is_int(value) or value < 0:
                    raise _bad(name, value, "must be None or an integer >= 0 (how many top tokens to list)")
                setattr(self, name, int(value))

    @property
    def greedy(self) -> bool:
        """True when this request decodes greedily (temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def filtered(self) -> bool:
        """True when this request samples through top-k or top-p (filters on greedy rows are moot)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
