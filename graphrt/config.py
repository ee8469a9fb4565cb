"""The engine's runtime settings (``EngineConfig``) and how a device and dtype are chosen."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrt.base.checks import is_count
from graphrt.base.errors import ConfigError
from graphrt.models.fp8 import QUANTIZATIONS
from graphrt.speculative.config import speculative_config

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name (or ``"auto"``: bfloat16 on CUDA, float32 on CPU) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; choose one of auto, {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


#: Values ``EngineConfig.kv_cache_dtype`` takes: "auto" stores the cache in the model dtype.
KV_CACHE_DTYPES = ("auto", "fp8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype: the model's for "auto", ``torch.float8_e4m3fn`` for "fp8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None picks CUDA when present; asking for CUDA without one is an error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unsupported device {device!r}; graphrt runs on cpu or cuda (or auto)") from None
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
    #: Longest sequence (prompt + generated); None = the model's max_position_embeddings, lowered to the
    #: longest sequence the KV cache holds (an explicit value beyond the cache is kept, with a warning).
    max_model_len: int | None = None
    #: Tokens per KV-cache block.
    block_size: int = 16
    #: Most tokens one step runs. Without chunked prefill: the prompt tokens of one prefill forward;
    #: prompts are not split, and a preempted sequence is recomputed in one piece, so the engine raises
    #: this to max_model_len when it is smaller. With it: the budget a step's decodes (one token each)
    #: and prompt chunks share, default ``DEFAULT_CHUNKED_BATCHED_TOKENS``.
    max_num_batched_tokens: int | None = None
    #: Split prompts (and the recomputation of a preempted sequence) into chunks that fit the step's
    #: token budget, continued over the following steps from the paged cache, so that a long prompt
    #: does not stall the running sequences for its whole prefill (``prompt_logprobs`` are scored chunk
    #: by chunk). On by default (it measured faster on the GPU: a shorter inter-token latency tail under
    #: arrivals, more offline throughput; notes_serving.md in profiles/ has the figures).
    enable_chunked_prefill: bool = True
    #: Share the KV blocks of prompts' common leading tokens (system prompts, chat history): a full block
    #: a sequence computed is kept, named by its prefix, and a later prompt that starts with the same
    #: tokens takes it instead of computing it; unheld cached blocks are reused least recently freed
    #: first. Requests that ask for ``prompt_logprobs`` compute their whole prompt. On by default (a
    #: cached prefix's prompt step is shorter; notes_serving.md in profiles/ has the figures).
    enable_prefix_caching: bool = True
    #: Bytes of host memory (pinned on CUDA) for swap preemption: a preempted decoding sequence whose
    #: KV blocks fit is swapped out and back in rather than recomputed. 0 (the default): recompute.
    swap_space_bytes: int = 0
    #: Never capture CUDA graphs: decode steps, and prompt steps that a prompt graph would hold, run eagerly
    #: through the same static buffers (the same padded shapes, so the same tokens as the graphs).
    enforce_eager: bool = False
    #: CUDA: a step's prompt tokens (whole prompts or chunks) replay a captured forward padded to a bucket
    #: of tokens (powers of two from 16, capped at this number and at the step's token budget), one replay
    #: per group of at most ``graphrt.capture.prefill_graphs.PREFILL_GRAPH_SEQS`` sequences and this many
    #: tokens, instead of launching every kernel from the host. 0 = prompts always run eagerly at their own shapes;
    #: prompt steps that ask for ``prompt_logprobs`` or calibrate KV scales always do.
    prefill_graph_tokens: int = 2048
    #: CUDA: a step that decodes and has at most this many prompt tokens (whole short prompts, or chunks)
    #: runs them in the decode's own forward, through mixed graphs captured per decode batch size for
    #: prompt-token buckets from a quarter of this number up to it (capped by the prompt graphs'), so the
    #: weights are read once for both; larger prompt parts run their own forward first, as do those of
    #: steps where a decode row asks for ``logprobs`` (mixed graphs have no logprob outputs). 0 = never.
    mixed_step_tokens: int = 512
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
    #: SiLU * up), and at batch 1 matrix-vector linear layers with those fused in (models whose layers
    #: are within ``graphrt.models.kernel_policy.GEMV_THRESHOLDS``); False = the unfused torch ops, kept
    #: to compare against. None = fused on CUDA (on CPU Triton only runs in its slow interpreter).
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
    #: sequences leave the pipelined batch without a pause; a step that preempts or swaps waits first.
    #: With chunked prefill, prompts beside decodes are admitted and chunked in pipelined steps too, each
    #: prompt's last token decoded in the decode batch (REFERENCE.md, "Pipelined steps"). None = on for
    #: CUDA.
    async_decode: bool | None = None
    #: A request whose prompt leaves room (under ``max_model_len``) for fewer tokens than its
    #: ``max_tokens`` is refused with InvalidRequestError; False (the default) runs it with a warning,
    #: and it ends with ``finish_reason="length"`` when the room runs out.
    strict_max_tokens: bool = False
    #: Seed for requests that give none (their seeds are drawn from it).
    seed: int = 0
    #: Extra keyword arguments for the model loader (e.g. random presets' init scale).
    loader_options: dict[str, Any] = field(default_factory=dict)
    #: NVTX ranges on the ``graphrt`` domain for Nsight (also ``GRAPHRT_NVTX=1``); see ``graphrt.base.nvtx``.
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
    #: Weight quantization of the decoder layers' linear layers: None (the model dtype; an FP8
    #: checkpoint still loads as FP8) or "fp8": FP8 E4M3 with float32 scales, a 16-bit checkpoint
    #: quantized at load with one scale per output channel (``graphrt.models.fp8``). The embedding and
    #: the LM head stay in the model dtype. On CUDA one-token forwards run W8A16 GEMV kernels and larger
    #: ones FP8 tensor cores with per-token activation scales (FP8 on CUDA needs sm_89+); on CPU the
    #: dequantising reference path.
    quantization: str | None = None
    #: The KV cache's storage: "auto" (the model dtype) or "fp8" (E4M3, half a 16-bit cache's bytes; it
    #: stores ``k / k_scale`` and ``v / v_scale`` with each layer's scales from the checkpoint, else 1.0).
    kv_cache_dtype: str = "auto"
    #: With ``kv_cache_dtype="fp8"``: scales the checkpoint lacks become ``4 * max|k| / 448`` and
    #: ``4 * max|v| / 448`` over the engine's first prefill (``graphrt.models.llama.KV_SCALE_HEADROOM``),
    #: which runs twice (measure, then store), and the decode graphs are captured after it, so the
    #: first request waits for both. The first batch decides the scales for good: later values beyond
    #: 4x its maxima saturate.
    calibrate_kv_scales: bool = False
    #: Speculative decoding (``graphrt.speculative``): None (off), ``{"method": "ngram", "num_tokens": k}``
    #: or ``{"method": "draft", "model": PATH_OR_PRESET, "num_tokens": k}`` (or the CLI's ``"ngram:k"`` /
    #: ``"draft:MODEL:k"``, or a ``SpeculativeConfig``): each decoding sequence drafts up to k tokens, by
    #: prompt lookup or with the draft model, and one decode step verifies them; the output is the output
    #: without it. Steps with drafts run synchronously; with ``async_decode``, steps in which no
    #: sequence drafts are pipelined. Resolved to a ``SpeculativeConfig``.
    speculative: Any = None
    #: Tensor parallelism: the model's heads, MLP and vocabulary split over this many ranks, one
    #: process each (``graphrt.distributed``): on CUDA one GPU each (``cuda:0`` .. ``cuda:N-1``, NCCL),
    #: on the CPU gloo. graphrt starts the other ranks' processes itself, or, under ``torchrun`` with
    #: as many processes, joins them. Rank 0 schedules and sends each step to the others.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.model is not None and not (isinstance(self.model, (str, os.PathLike)) and str(self.model)):
            raise ConfigError(f"model must be a path, a GGUF file or random:PRESET (None: the default model), "
                              f"got {self.model!r}")
        for name, least in _COUNTS.items():
            value = getattr(self, name)
            if not (is_count(value) and value >= least):
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
            setattr(self, name, int(value))
        for name, least in _OPTIONAL_COUNTS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not (is_count(value) and value >= least):
                raise ConfigError(f"{name} must be None or an integer >= {least}, got {value!r}")
            setattr(self, name, int(value))
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in _OPTIONAL_FLAGS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True, False or None (automatic), got {getattr(self, name)!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, numbers.Real) or not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
        if self.capture_sizes is not None and (
                isinstance(self.capture_sizes, (str, bytes)) or not isinstance(self.capture_sizes, Iterable)
                or not all(is_count(size) and size >= 1 for size in self.capture_sizes)):
            raise ConfigError(f"capture_sizes must be None or a list of integers >= 1, got {self.capture_sizes!r}")
        if not isinstance(self.loader_options, dict):
            raise ConfigError(f"loader_options must be a dict, got {type(self.loader_options).__name__}")
        unknown = sorted(set(self.loader_options) - {"init_std", "seed"}, key=str)
        if unknown:
            raise ConfigError(f"unknown loader_options {unknown}: random presets take init_std and seed")
        if self.check_graphs is None:
            self.check_graphs = _check_graphs_from_environment()
        elif not is_count(self.check_graphs):
            raise ConfigError(f"check_graphs must be an integer >= 0 (0 = off), got {self.check_graphs!r}")
        self.check_graphs = int(self.check_graphs)
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # refuses an unknown name now
        if self.calibrate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ConfigError("calibrate_kv_scales (--calibrate-kv-scales) needs kv_cache_dtype='fp8' "
                              "(--kv-cache-dtype fp8): a cache in the model dtype has no scales")
        self.speculative = speculative_config(self.speculative)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose one of "
                              f"{', '.join(QUANTIZATIONS)} (or None for the model dtype)")
        if self.tensor_parallel_size > 1 and self.speculative is not None and self.speculative.method == "draft":
            raise ConfigError("speculative method 'draft' does not run with tensor_parallel_size > 1 (the draft "
                              "model is not split over the ranks); use method 'ngram', or one rank")


#: Integer fields and their least value.
_COUNTS = {"max_num_seqs": 1, "block_size": 1, "prefill_graph_tokens": 0, "mixed_step_tokens": 0,
           "swap_space_bytes": 0, "max_logprobs": 0, "seed": 0, "tensor_parallel_size": 1}
#: Integer fields that may be None (automatic) and their least value.
_OPTIONAL_COUNTS = {"max_model_len": 2, "max_num_batched_tokens": 1, "max_capture_seq_len": 1,
                    "num_kv_blocks": 2, "kv_cache_bytes": 1}
#: True/False fields; those that may also be None (automatic).
_FLAGS = ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "strict_max_tokens", "nvtx",
          "nvtx_layers", "calibrate_kv_scales")
_OPTIONAL_FLAGS = ("fused_kernels", "dependent_launch", "async_decode")

#: ``max_num_batched_tokens`` with chunked prefill when none is given.
DEFAULT_CHUNKED_BATCHED_TOKENS = 2048

#: The environment variable ``EngineConfig.check_graphs`` falls back to.
ENV_CHECK_GRAPHS = "GRAPHRT_CHECK_GRAPHS"


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
