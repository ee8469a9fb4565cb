"""Configuration objects: the model's architecture and the engine's runtime settings."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError

#: Architectures the Llama-family decoder implements, by the name HF writes in ``config.json``.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class RopeScaling:
    """Llama 3's frequency-dependent rotary scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; graphrt implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
        # Qwen2 configs carry a window that applies only with use_sliding_window.
        windowed = arch != "Qwen2ForCausalLM" or _bool_field(config, "use_sliding_window", False)
        sliding_window = (_int_field(config, "sliding_window", default=0) or None) if windowed else None
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


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name (or ``"auto"``: bfloat16 on CUDA, float32 on CPU) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def triton_interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None picks CUDA when present; asking for CUDA without one is an error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device")
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"unsupported device {str(device)!r}; graphrt runs on cpu or cuda")
    return device


@dataclass
class EngineConfig:
    """Runtime settings of one engine instance (what ``graphrt.LLM`` takes beyond the model)."""

    model: str | None = None
    dtype: str = "auto"
    device: str | None = "auto"
    max_num_seqs: int = 256
    #: Longest sequence (prompt + generated); None = the model's max_position_embeddings.
    max_model_len: int | None = None
    #: Tokens per KV-cache block.
    block_size: int = 16
    #: Most prompt tokens one prefill forward takes. Prompts are not split, and a preempted sequence is
    #: recomputed in one piece, so the engine raises this to max_model_len when it is smaller.
    max_num_batched_tokens: int | None = None
    #: Never capture CUDA graphs (decode runs eagerly through the same static buffers).
    enforce_eager: bool = False
    #: Batch sizes to capture decode graphs for; None = 1, 2, 4, then multiples of 8 up to 256,
    #: trimmed to max_num_seqs.
    capture_sizes: list[int] | None = None
    #: Longest context a captured graph serves (longer rows decode eagerly); None = max_model_len.
    max_capture_seq_len: int | None = None
    #: Number of KV blocks; None = derived from the memory budget below.
    num_kv_blocks: int | None = None
    #: CUDA: fraction of total device memory graphrt may use (weights, activations, cache).
    gpu_memory_utilization: float = 0.9
    #: CPU: bytes the KV cache may take; None = enough for max_num_seqs full sequences, capped at 1 GiB.
    kv_cache_bytes: int | None = None
    #: Attention backend by name; None = the best usable one for the device.
    attention_backend: str | None = None
    #: Fused Triton kernels for the layers' elementwise work (add + RMSNorm, rotary + KV-cache write,
    #: SiLU * up), and at batch 1 matrix-vector linear layers with those fused in (models with layers up
    #: to ``graphrt.kernels.gemv.beats_cublas``); False = the unfused torch ops, kept to compare
    #: against. None = fused on CUDA (on CPU Triton only runs in its slow interpreter).
    fused_kernels: bool | None = None
    #: Launch the fused decode kernels (GEMV layers, rotary + cache write, paged attention) as programmatic
    #: dependents, so each overlaps the end of the kernel before it (``graphrt.kernels.dependent_launch``;
    #: same results). Needs fused kernels and an sm_90+ GPU. None = on wherever those hold.
    dependent_launch: bool | None = None
    #: Pipelined decode steps: while step n runs on the GPU, the engine already queues step n + 1 (its
    #: inputs are step n's sampled tokens, fed back on the device), so the host's work of a step overlaps
    #: the GPU's. A stop token is seen a step late: the row rides along one more step (its token dropped),
    #: so the others decode that step in a larger batch (in 16-bit dtypes a near-tie can resolve
    #: differently, as between batch sizes); otherwise the tokens are the synchronous engine's. Finished
    #: sequences leave the pipelined batch without a pause; a step that admits prompts or preempts waits
    #: first. None = on for CUDA.
    async_decode: bool | None = None
    #: Seed for requests that give none (their seeds are drawn from it).
    seed: int = 0
    #: Extra keyword arguments for the model loader (e.g. random presets' init scale).
    loader_options: dict[str, Any] = field(default_factory=dict)
    #: NVTX ranges on the ``graphrt`` domain for Nsight (also ``GRAPHRT_NVTX=1``); see ``graphrt.nvtx``.
    nvtx: bool = False
    #: Also a range per decoder layer in eager forwards (also ``GRAPHRT_NVTX_LAYERS=1``); implies ``nvtx``.
    nvtx_layers: bool = False
    #: The most top tokens a request's ``logprobs`` / ``prompt_logprobs`` may ask for: the width of the
    #: decode graphs' logprob buffers. 0 captures no logprob graphs and refuses requests that ask.
    max_logprobs: int = 20
    #: The decode graphs' runtime oracle (``graphrt.capture.graph_check``): N >= 1 checks every replay's
    #: static input addresses and re-runs every N-th replayed step eagerly to compare tokens and logits;
    #: a bucket that fails decodes eagerly from then on. 0 = off; None = ``GRAPHRT_CHECK_GRAPHS`` (an
    #: integer >= 0) or 0. Resolved to an int when the config is built.
    check_graphs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be at least 2 (one is the null block), got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if not is_count(self.max_logprobs):
            raise ConfigError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        self.max_logprobs = int(self.max_logprobs)
        if self.check_graphs is None:
            self.check_graphs = _check_graphs_from_environment()
        elif not is_count(self.check_graphs):
            raise ConfigError(f"check_graphs must be an integer >= 0 (0 = off), got {self.check_graphs!r}")
        self.check_graphs = int(self.check_graphs)


#: The environment variable ``EngineConfig.check_graphs`` falls back to.
ENV_CHECK_GRAPHS = "GRAPHRT_CHECK_GRAPHS"


def is_count(value: Any) -> bool:
    """An integer >= 0 of any integer type (NumPy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _check_graphs_from_environment() -> int:
    text = os.environ.get(ENV_CHECK_GRAPHS, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{ENV_CHECK_GRAPHS} must be an integer >= 0 (0 = off), got {text!r}")
    return value
