"""A Llama-family model's architecture (``ModelConfig``), read from HF's ``config.json`` fields or a
GGUF file's metadata, and the checks on those fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from graphrt.base.errors import ConfigError
from graphrt.models.fp8 import Fp8CheckpointFormat

#: Architectures the Llama-family decoder implements, by the name HF writes in ``config.json``.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class RopeScaling:
    """Llama 3's frequency-dependent rotary scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        # Every rotary frequency is divided by ``factor``, and the blend between the two bands by
        # ``high_freq_factor - low_freq_factor``: a zero there makes every logit NaN.
        where = "rope_scaling (llama3)"
        for name in ("factor", "low_freq_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{where}: {name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.high_freq_factor) and self.high_freq_factor > self.low_freq_factor):
            raise ConfigError(f"{where}: high_freq_factor must exceed low_freq_factor ({self.low_freq_factor}), "
                              f"got {self.high_freq_factor!r}")
        if self.original_max_position_embeddings < 1:
            raise ConfigError(f"{where}: original_max_position_embeddings must be >= 1, "
                              f"got {self.original_max_position_embeddings}")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2).

    Field names follow HF's ``config.json`` so that a checkpoint's config maps onto this one directly.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    #: Bias on the q/k/v projections (always on for Qwen2, optional for Llama).
    attention_bias: bool = False
    #: Each token attends to itself and the ``sliding_window - 1`` tokens before it; None = full.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: How the checkpoint stores FP8 linear weights, or None for a 16-bit (or GGUF) checkpoint; set by
    #: the loader from ``quantization_config`` (``graphrt.loader.fp8_checkpoint``).
    fp8_checkpoint: Fp8CheckpointFormat | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be None or an integer >= 1, got {self.sliding_window!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count, embeddings included once when tied."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from the contents of an HF ``config.json``. Raises ConfigError naming the field when one
        is missing or of the wrong type."""
        if not isinstance(config, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
        architectures = config.get("architectures") or [None]
        arch = architectures[0] if isinstance(architectures, list) else architectures
        if arch is None:
            model_type = config.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM"}.get(model_type, str(model_type))
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        if arch == "None":  # neither field says what the model is
            raise ConfigError(f"config.json names no architecture (no 'architectures' or 'model_type'); "
                              f"supported: {supported}")
        if arch not in SUPPORTED_ARCHITECTURES:  # before its fields: another family names them otherwise
            raise ConfigError(f"architecture {arch} is not supported (supported: {supported})")
        hidden = _int_field(config, "hidden_size")
        heads = _int_field(config, "num_attention_heads")
        layers = _int_field(config, "num_hidden_layers")
        intermediate = _int_field(config, "intermediate_size")
        vocab = _int_field(config, "vocab_size")
        kv_heads = _int_field(config, "num_key_value_heads", default=heads)
        head_dim = _int_field(config, "head_dim", default=hidden // heads if heads > 0 else 0)
        # transformers 5 writes "rope_parameters" (theta included); older versions "rope_scaling".
        rope_parameters = config.get("rope_parameters") or {}
        if not isinstance(rope_parameters, dict):
            raise ConfigError(f"rope_parameters must be a JSON object, got {rope_parameters!r}")
        rope_scaling = _parse_rope_scaling(config.get("rope_scaling") or rope_parameters)
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {config['hidden_act']!r}; graphrt implements 'silu'")
        if _bool_field(config, "mlp_bias", False):
            raise ConfigError("MLP biases (mlp_bias: true) are not supported")
        sliding_window = _sliding_window(config, arch, layers)
        eos_ids = token_ids_field(config, "eos_token_id")
        bos = config.get("bos_token_id")
        if bos is not None and not _is_index(bos):
            raise ConfigError(f"config.json: bos_token_id must be a token id (an integer >= 0), got {bos!r}")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_int_field(config, "max_position_embeddings", default=4096),
            rms_norm_eps=_float_field(config, "rms_norm_eps", 1e-5),
            rope_theta=_float_field(config, "rope_theta", rope_parameters.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=_bool_field(config, "tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or _bool_field(config, "attention_bias", False),
            sliding_window=sliding_window,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _sliding_window(config: dict[str, Any], arch: str, layers: int) -> int | None:
    """The window every layer attends in, as transformers reads each family's config: Llama has none (a
    ``sliding_window`` key there is ignored); Mistral's applies to every layer; Qwen2's only with
    ``use_sliding_window``, and then to the layers ``layer_types`` names "sliding_attention" (without it:
    those from ``max_window_layers`` on, default 28). One window for all layers or none: a config that
    mixes full and windowed layers is refused."""
    if arch == "LlamaForCausalLM":
        return None
    window = _int_field(config, "sliding_window", default=0) or None
    if arch != "Qwen2ForCausalLM":
        return window
    if not _bool_field(config, "use_sliding_window", False) or window is None:
        return None
    types = config.get("layer_types")
    if types is None:
        first = _int_field(config, "max_window_layers", default=28)
        types = ["sliding_attention" if index >= first else "full_attention" for index in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"full_attention",
                                                                                  "sliding_attention"}:
        raise ConfigError(f"layer_types must list 'full_attention' or 'sliding_attention' for each of the {layers} "
                          f"layers, got {types!r}")
    if len(set(types)) > 1:
        windowed = [index for index, kind in enumerate(types) if kind == "sliding_attention"]
        raise ConfigError(f"layers {windowed} attend in a sliding window of {window} and the others fully; graphrt "
                          "runs one window for all layers or none (use_sliding_window, max_window_layers, "
                          "layer_types)")
    return window if types[0] == "sliding_attention" else None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_ids_field(config: dict[str, Any], name: str, where: str = "config.json") -> tuple[int, ...]:
    """``config[name]``, a token id or a list of them (HF's ``eos_token_id``), as a tuple; () when absent.
    ConfigError naming the field when it holds anything else."""
    value = config.get(name)
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(_is_index(token) for token in ids):
        raise ConfigError(f"{where}: {name} must be a token id (an integer >= 0) or a list of them, got {value!r}")
    return tuple(ids)


def _int_field(config: dict[str, Any], name: str, default: int | None = None, where: str = "config.json") -> int:
    """``config[name]`` as an int (a JSON integer, or a float with no fraction); ConfigError naming the
    field when it is missing (without a default) or not an integer. Ranges are ModelConfig's to check."""
    if config.get(name) is None:
        if default is None:
            raise ConfigError(f"{where} lacks the field {name!r}")
        return default
    value = config[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def _float_field(config: dict[str, Any], name: str, default: float, where: str = "config.json") -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


def _bool_field(config: dict[str, Any], name: str, default: bool) -> bool:
    value = config.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):  # "false" would be truthy: refuse rather than guess
        raise ConfigError(f"config.json: {name} must be true or false, got {value!r}")
    return value


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: rope_scaling must be a JSON object, got {raw!r}")
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; graphrt implements 'llama3'")
    where = "config.json rope_scaling"
    required = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [name for name in required if raw.get(name) is None]
    if missing:
        raise ConfigError(f"{where} (llama3) lacks {', '.join(repr(name) for name in missing)}")
    return RopeScaling(
        factor=_float_field(raw, "factor", 0.0, where),
        low_freq_factor=_float_field(raw, "low_freq_factor", 0.0, where),
        high_freq_factor=_float_field(raw, "high_freq_factor", 0.0, where),
        original_max_position_embeddings=_int_field(raw, "original_max_position_embeddings", where=where),
    )
