"""graphrt's greedy output equals HF transformers' on random-weight checkpoints that transformers writes
(see random_checkpoints.py); several prompts of different lengths run in one batch (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import assert_greedy_matches, graphrt_greedy_with_logits, hf_step_logits  # noqa: E402
from random_checkpoints import NAMES, random_prompts, write_random_checkpoint  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=NAMES)
def checkpoint(request, tmp_path_factory):
    """(directory, HF model in float32) for one random checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    return path, write_random_checkpoint(request.param, path)


def test_batched_greedy_matches_hf(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=8, progress=False)
    prompts = random_prompts(seed=7)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NEW_TOKENS
        assert_greedy_matches(hf_model, prompt, out.token_ids)


def test_logits_match_hf(checkpoint):
    """Prefill and decode logits themselves, not just their argmax, agree with HF's in float32."""
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    reference = hf_step_logits(hf_model, prompt, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_fused_kernels_match_hf(checkpoint):
    """The fused Triton kernels (Triton's CPU interpreter here) give HF's logits and greedy tokens too."""
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", fused_kernels=True, progress=False)
    assert llm.engine.fused_kernels
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    reference = hf_step_logits(hf_model, prompt, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    assert_greedy_matches(hf_model, prompt, tokens)
