"""``EngineConfig.speculative``: the method and how many tokens a step may draft."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphrt.base.errors import ConfigError

#: Methods ``speculative`` takes: "ngram" (prompt lookup: drafts copied from the request's own tokens) and
#: "draft" (a second model with the target's tokenizer drafts them).
METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """num_tokens: the most draft tokens a sequence gets a step (k; its verify runs k + 1 rows).
    ngram_min / ngram_max: the n-gram lengths prompt lookup matches, longest first. model (method
    "draft"): the draft model, as ``EngineConfig.model`` takes one (an HF directory, a .gguf file,
    random:PRESET), with ``loader_options`` for its loader. adaptive: each step's draft lengths
    weigh each request's acceptance against what the rows cost (prompt lookup: ``draft_policy``), or
    follow its acceptance with pauses after misses (a draft model: ``drafting.DraftLength``); False:
    prompt lookup drafts whatever it finds, up to k, a draft model always k."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = True
    model: str | None = None
    loader_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if (self.method == "draft") != (self.model is not None):
            raise ConfigError("speculative: method 'draft' needs a model (and only it takes one), e.g. "
                              "{'method': 'draft', 'model': 'path/to/small-model', 'num_tokens': 4}")
        if not isinstance(self.loader_options, dict):
            raise ConfigError(f"speculative: loader_options must be a dict, got {self.loader_options!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative: {name} must be an integer >= 1, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"speculative: ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative: adaptive must be True or False, got {self.adaptive!r}")


def speculative_config(value: Any) -> SpeculativeConfig | None:
    """``EngineConfig.speculative`` as a ``SpeculativeConfig``: None (off), a ``SpeculativeConfig``, a
    dict of its fields (``{"method": "ngram", "num_tokens": 4}``), or the CLI's ``"ngram:4"`` /
    ``"draft:MODEL:4"``."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        method, _, rest = value.partition(":")
        model, _, count = rest.rpartition(":") if method == "draft" else ("", "", rest)
        if not count or (method == "draft" and not model):
            raise ConfigError(f"speculative: {value!r} is not ngram:NUM_TOKENS or draft:MODEL:NUM_TOKENS "
                              "(e.g. 'ngram:4')")
        try:
            num_tokens = int(count)
        except ValueError:
            raise ConfigError(f"speculative: the token count in {value!r} is not an integer (the forms are "
                              "ngram:NUM_TOKENS and draft:MODEL:NUM_TOKENS)") from None
        return SpeculativeConfig(method=method, num_tokens=num_tokens, model=model or None)
    if isinstance(value, dict):
        known = set(SpeculativeConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative: unknown field(s) {', '.join(unknown)}; fields: {', '.join(sorted(known))}")
        return SpeculativeConfig(**value)
    raise ConfigError(f"speculative must be None, a dict, 'ngram:NUM_TOKENS', 'draft:MODEL:NUM_TOKENS' or a "
                      f"SpeculativeConfig, got {value!r}")
