"""``EngineConfig.speculative``: the method and how many tokens a step may draft."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphrt.base.errors import ConfigError

#: Methods ``speculative`` takes: "ngram" (prompt lookup: drafts copied from the request's own tokens).
METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """num_tokens: the most draft tokens a sequence gets a step (k; its verify runs k + 1 rows).
    ngram_min / ngram_max: the n-gram lengths prompt lookup matches, longest first. adaptive: each
    request's draft length follows its acceptance (``drafting.DraftLength``); False: always k."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
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
    dict of its fields (``{"method": "ngram", "num_tokens": 4}``), or the CLI's ``"ngram:4"``."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        method, _, count = value.partition(":")
        if not count:
            raise ConfigError(f"speculative: {value!r} is not METHOD:NUM_TOKENS (e.g. 'ngram:4')")
        try:
            num_tokens = int(count)
        except ValueError:
            raise ConfigError(f"speculative: the token count in {value!r} is not an integer") from None
        return SpeculativeConfig(method=method, num_tokens=num_tokens)
    if isinstance(value, dict):
        known = set(SpeculativeConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative: unknown field(s) {', '.join(unknown)}; fields: {', '.join(sorted(known))}")
        return SpeculativeConfig(**value)
    raise ConfigError(f"speculative must be None, a dict, 'METHOD:NUM_TOKENS' or a SpeculativeConfig, got {value!r}")
