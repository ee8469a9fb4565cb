"""Speculative decoding on CUDA: verify steps replayed in the decode graphs give the output without
speculation (float32, a random SmolLM2-shape model), greedy and sampled."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from test_speculative import PROMPTS, _oracle  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_verify_steps_in_graphs_give_the_output_without_speculation(monkeypatch, sampling):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=3, max_tokens=40, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=4, loader_options={"init_std": 0.05},
                   progress=False)
    with LLM("random:smollm2-135m", **options) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    _oracle(monkeypatch, {tuple(p): out for p, out in zip(PROMPTS, plain)}, wrong_every=3)
    with LLM("random:smollm2-135m", speculative="ngram:4", **options) as llm:
        outs = llm.generate(PROMPTS, params)
        replays = llm.engine.decode_runner.stats.replays_per_bucket
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert stats.accepted_tokens > 0 and max(int(b) for b, n in replays.items() if n) > len(PROMPTS)


def test_a_draft_model_in_graphs_gives_the_output_without_speculation():
    """The target itself as the draft model (its own cache and decode graphs): every draft kept; the
    output of decoding without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=4, loader_options={"init_std": 0.05},
                   progress=False)
    with LLM("random:smollm2-135m", **options) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    draft = {"method": "draft", "model": "random:smollm2-135m", "num_tokens": 4, "loader_options": {"init_std": 0.05}}
    with LLM("random:smollm2-135m", speculative=draft, **options) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert stats.accepted_tokens == stats.proposed_tokens > 0
