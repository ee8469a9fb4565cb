"""Chunked prefill and prefix caching on CUDA (the Triton prefix-prefill kernel over cached blocks, the
decode graphs around it): the output without them, float32 (a random SmolLM2-shape model), greedy and
seeded, in a first round and in a second one that finds every prompt's blocks cached."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from graphrt import LLM, SamplingParams  # noqa: E402

SHARED = [(13 * i) % 4000 + 3 for i in range(70)]
PROMPTS = [SHARED + [(37 * i + 11 * n) % 5000 + 3 for i in range(n)] for n in (1, 17, 33, 100)] + [SHARED[:31]]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chunks_and_cached_prefixes_give_the_output_without_them(sampling):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=5, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=512, max_num_seqs=4, loader_options={"init_std": 0.05},
                   progress=False)
    with LLM("random:smollm2-135m", **options) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    cases = [dict(enable_chunked_prefill=True, max_num_batched_tokens=37), dict(enable_prefix_caching=True),
             dict(enable_chunked_prefill=True, max_num_batched_tokens=64, enable_prefix_caching=True)]
    for case in cases:
        with LLM("random:smollm2-135m", **options, **case) as llm:
            first = [out.token_ids for out in llm.generate(PROMPTS, params)]
            again = [out.token_ids for out in llm.generate(PROMPTS, params)]
            rate = llm.engine.prefix_cache_hit_rate
        assert first == plain and again == plain, case
        if case.get("enable_prefix_caching"):
            assert rate > 0.3, case
