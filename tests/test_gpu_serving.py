"""Chunked prefill, prefix caching and swap preemption on CUDA (the Triton prefix-prefill kernel over
cached blocks, the decode graphs around it, copies to pinned host memory): the output without them,
float32 (a random SmolLM2-shape model), greedy and seeded, in a first round and in a second one that
finds every prompt's blocks cached; swapped sequences as recomputed ones."""

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
    with LLM("random:smollm2-135m", enable_chunked_prefill=False, enable_prefix_caching=False, **options) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    cases = [dict(enable_chunked_prefill=True, max_num_batched_tokens=37, enable_prefix_caching=False),
             dict(enable_chunked_prefill=False, enable_prefix_caching=True),
             dict(enable_chunked_prefill=True, max_num_batched_tokens=64, enable_prefix_caching=True)]
    for case in cases:
        with LLM("random:smollm2-135m", **options, **case) as llm:
            first = [out.token_ids for out in llm.generate(PROMPTS, params)]
            again = [out.token_ids for out in llm.generate(PROMPTS, params)]
            rate = llm.engine.prefix_cache_hit_rate
        assert first == plain and again == plain, case
        if case.get("enable_prefix_caching"):
            assert rate > 0.3, case


def test_swap_preemption_gives_the_output_recomputation_gives():
    """Too few KV blocks for the batch: preempted sequences swapped to pinned host memory and back
    (copies on the device's stream around the graphs) decode as recomputed ones do."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=512, max_num_seqs=4, num_kv_blocks=40,
                   loader_options={"init_std": 0.05}, progress=False)
    with LLM("random:smollm2-135m", **options) as llm:
        recomputed = llm.generate(PROMPTS, params)
    with LLM("random:smollm2-135m", swap_space_bytes=256 << 20, **options) as llm:
        swapped = llm.generate(PROMPTS, params)
    assert sum(out.num_preemptions for out in recomputed) > 0 and sum(out.num_preemptions for out in swapped) > 0
    assert [out.token_ids for out in swapped] == [out.token_ids for out in recomputed]
