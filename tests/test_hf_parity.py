"""graphrt's greedy output equals HF transformers' on random-weight checkpoints that transformers writes:
Llama with llama3 rope scaling, Mistral with a sliding window shorter than the prompt, Qwen2 with q/k/v
bias and a single KV head. Several prompts of different lengths run in one batch (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphrt import LLM, SamplingParams  # noqa: E402
from hf_reference import assert_greedy_matches  # noqa: E402

NEW_TOKENS = 24
VOCAB = 512


def _common(**extra):
    return dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, **extra,
    )


CHECKPOINTS = {
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(**_common(
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    )),
    "mistral-sliding-window": lambda: transformers.MistralConfig(**_common(
        num_key_value_heads=4, sliding_window=7, tie_word_embeddings=False,
    )),
    "qwen2-bias-mqa": lambda: transformers.Qwen2Config(**_common(
        num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False,
    )),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(directory, HF model in float32) for one random checkpoint."""
    torch.manual_seed(1234)
    config = CHECKPOINTS[request.param]()
    model_cls = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").__class__
    model = model_cls(config).float().eval()
    # Wider than HF's default init so that logits spread out and the attention pattern matters.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Lengths straddle the 16-token block boundary and exceed the 7-token sliding window.
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 16, 17, 33)]


def test_batched_greedy_matches_hf(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=8, progress=False)
    prompts = _prompts(seed=7)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NEW_TOKENS
        assert_greedy_matches(hf_model, prompt, out.token_ids)


def test_logits_match_hf(checkpoint):
    """Prefill and decode logits themselves, not just their argmax, agree with HF's in float32."""
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    engine = llm.engine
    prompt = _prompts(seed=11)[3]
    seq_logits = []
    original = engine.runner.model.compute_logits

    def recording(hidden):
        logits = original(hidden)
        seq_logits.append(logits[0].clone())
        return logits

    engine.runner.model.compute_logits = recording
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    ours = torch.stack(seq_logits)  # [6, V]: prefill step, then 5 decode steps
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(ours, reference.float(), rtol=1e-4, atol=1e-4)
