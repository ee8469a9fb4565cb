"""Random-weight models with real models' shapes, for benchmarks and tests without weight files."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.base.errors import ModelLoadError
from graphrt.models.config import ModelConfig, RopeScaling
from graphrt.models.fp8 import Fp8Linear

PREFIX = "random:"
#: RMSNorm weights of a random preset are 1 + N(0, NORM_WEIGHT_STD) (see ``RandomCheckpoint.initialize``).
NORM_WEIGHT_STD = 0.15

_LLAMA3_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
}


@dataclass
class RandomCheckpoint:
    """A preset's shape; weights are drawn on the target device, N(0, init_std) for matrices, 1 + N(0, 0.15)
    for norms."""

    name: str
    config: ModelConfig
    init_std: float = 0.02
    seed: int = 0
    tokenizer: None = None

    def initialize(self, model: torch.nn.Module) -> None:
        """Fill every parameter in place: biases with 0, matrices with N(0, init_std), norms with
        1 + N(0, NORM_WEIGHT_STD). An FP8 layer's matrix is drawn in the model dtype, in the same order,
        and quantized per row, so an FP8 model is the quantized 16-bit one of the same seed."""
        first = next(model.parameters())
        generator = torch.Generator(device=first.device).manual_seed(self.seed)
        # A tensor-parallel rank draws each full matrix and keeps its part (``ShardLayout``), so that the
        # ranks together hold the one-rank model of the same seed.
        shard = getattr(model, "shard", None)

        def draw_whole(name: str, shape: torch.Size) -> torch.Tensor:
            full = shape if shard is None else shard.full_shape(name, shape)
            return torch.empty(full, dtype=first.dtype, device=first.device).normal_(0.0, self.init_std,
                                                                                      generator=generator)

        def draw(name: str, shape: torch.Size) -> torch.Tensor:
            drawn = draw_whole(name, shape)
            return drawn if shard is None else shard.local_of_parameter(name, drawn)

        with torch.no_grad():
            norms = []
            for module_name, module in model.named_modules():
                if isinstance(module, Fp8Linear):
                    name, shape = module_name + ".weight", torch.Size((module.out_features, module.in_features))
                    if shard is not None and shard.splits_columns(name):  # whole rows' scales, as on one rank
                        module.quantize_columns_from(draw_whole(name, shape),
                                                     lambda codes: shard.local_part(name, None, codes, name))
                    else:
                        module.quantize_rows_from(0, draw(name, shape))
                for param_name, param in module.named_parameters(recurse=False):
                    name = f"{module_name}.{param_name}" if module_name else param_name
                    if name.endswith("norm.weight"):
                        norms.append(param)
                    elif name.endswith(".bias"):
                        param.zero_()
                    else:
                        param.copy_(draw(name, param.shape))
            # Norm weights are drawn around 1 rather than set to 1, so that no two norms are alike: with
            # unit weights a model that applies one norm's weight in another's place (the input norm's for
            # the post-attention norm's, say) computes the same thing and no comparison can tell. They are
            # drawn after every matrix, from the same generator, so the matrices do not depend on them.
            for param in norms:
                param.normal_(1.0, NORM_WEIGHT_STD, generator=generator)


def read_random_preset(spec: str, init_std: float = 0.02, seed: int = 0) -> RandomCheckpoint:
    """``spec`` is ``random:NAME`` with NAME one of PRESETS."""
    name = spec[len(PREFIX):]
    if name not in PRESETS:
        raise ModelLoadError(f"unknown random preset {name!r}; presets: {', '.join(PREFIX + p for p in PRESETS)}")
    return RandomCheckpoint(name, PRESETS[name], init_std, seed)
