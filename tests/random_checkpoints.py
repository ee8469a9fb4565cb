"""Random-weight HF checkpoints, written by transformers itself, covering the architectures graphrt
implements: Llama with llama3 rope scaling, Mistral with a short sliding window, Qwen2 with q/k/v
bias and a single KV head."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
#: Norm weights are drawn as 1 + N(0, NORM_WEIGHT_STD): far enough from 1 that every norm differs from
#: every other, close enough that activations keep their scale.
NORM_WEIGHT_STD = 0.15


def _common(**extra) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, **extra,
    )


def _configs(transformers) -> dict:
    return {
        "llama3-rope-scaling": transformers.LlamaConfig(**_common(
            num_key_value_heads=2, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        )),
        "mistral-sliding-window": transformers.MistralConfig(**_common(
            num_key_value_heads=4, sliding_window=7, tie_word_embeddings=False,
        )),
        "qwen2-bias-mqa": transformers.Qwen2Config(**_common(
            num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False,
        )),
    }


NAMES = ["llama3-rope-scaling", "mistral-sliding-window", "qwen2-bias-mqa"]


def write_random_checkpoint(name: str, path: Path, seed: int = 1234):
    """Save checkpoint ``name`` under ``path``; returns the HF model (float32, CPU, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    config = _configs(transformers)[name]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    # Wider than HF's default init so that logits spread out and the attention pattern matters.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" not in param_name:
                param.normal_(0.0, 0.08)
        # RMSNorm weights around 1, each its own (HF's init leaves them all at 1.0): with unit weights a
        # model that applies one norm's weight in another's place (input_layernorm for
        # post_attention_layernorm, say) computes exactly the same thing and passes every parity test.
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1.0 + NORM_WEIGHT_STD * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return model


def random_prompts(seed: int, lengths=(5, 16, 17, 33)) -> list[list[int]]:
    """Prompts whose lengths straddle the 16-token block boundary and exceed the sliding window."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
