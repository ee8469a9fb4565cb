"""Mixed steps on CUDA (``DecodeGraphRunner.plan_mixed``): prompt tokens and decodes in one captured forward
give the tokens of the same steps run as two forwards (a prompt graph, then the decode graph), in float32,
greedy and seeded, for whole prompts arriving while others decode, chunks and cached prefixes; with
``enforce_eager`` the same forward runs eagerly and gives the graphs' bfloat16 tokens bit for bit; the
runtime oracle finds every mixed replay equal to its eager forward."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from graphrt import LLM, SamplingParams  # noqa: E402

OPTIONS = dict(max_model_len=512, max_num_seqs=8, loader_options={"init_std": 0.05}, progress=False)
#: Requests arriving in waves while the earlier ones decode: (steps to run first, prompt lengths).
WAVES = [(0, [7, 33]), (3, [1, 120]), (2, [17, 16, 45]), (4, [200]), (1, [5])]


def staggered(llm: LLM, params: list[SamplingParams], waves=WAVES) -> dict[str, list[int]]:
    """Every wave's prompts added after its steps; then steps until all finish. Token ids by request."""
    engine, tokens, index = llm.engine, {}, 0
    for steps, lengths in waves:
        for _ in range(steps):
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
        for length in lengths:
            prompt = [(31 * i + 11 * index) % 6000 + 3 for i in range(length)]
            engine.add_request(prompt, params[index % len(params)], request_id=f"r{index}")
            index += 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def sampling(kind: str) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    return [SamplingParams(temperature=0.9, top_p=0.8 if n % 2 else 1.0, top_k=50 if n == 2 else 0, seed=n,
                           max_tokens=24, ignore_eos=True) for n in range(3)]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("case", [dict(enable_chunked_prefill=False, enable_prefix_caching=False),
                                  dict(max_num_batched_tokens=48, enable_prefix_caching=False),
                                  dict(max_num_batched_tokens=64)], ids=["whole", "chunks48", "chunks64-cached"])
def test_mixed_steps_give_the_tokens_of_two_forwards(kind, case):
    with LLM("random:smollm2-135m", dtype="float32", mixed_step_tokens=0, **OPTIONS, **case) as llm:
        assert not llm.engine.decode_runner.mixed_buckets
        apart = staggered(llm, sampling(kind))
        assert llm.engine.decode_runner.stats.mixed_steps == 0
    with LLM("random:smollm2-135m", dtype="float32", mixed_step_tokens=64, **OPTIONS, **case) as llm:
        runner = llm.engine.decode_runner
        # Buckets from a quarter of 64 up to it, capped by the prompt graphs (the step budget, with chunks).
        assert runner.mixed_buckets == [16, 32, min(64, case.get("max_num_batched_tokens", 64))]
        assert runner.stats.num_mixed_graphs == 3 * len(runner.capture_sizes)
        mixed = staggered(llm, sampling(kind))
        again = staggered(llm, sampling(kind))  # cached prefixes where enabled
        assert runner.stats.mixed_steps > 0 and runner.stats.capture_error is None
        assert not runner.stats.eager_steps
    assert mixed == apart and again == apart


def test_logprob_rows_and_large_prompt_parts_take_two_forwards():
    """A step whose decode rows ask for logprobs, or whose prompt part outgrows the mixed buckets, runs its
    prompt forward first; the tokens and logprobs are those of an engine without mixed steps."""
    # r0 decodes with logprobs while r1 and then r2 + r3 (49 tokens, past the 32-token buckets) arrive; r4
    # arrives after r0 has finished, beside plain decodes only: the one step that mixes.
    waves = [(0, [7]), (2, [5]), (3, [9, 40]), (8, [6])]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)] + [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4
    results = {}
    for mixed_tokens in (0, 32):
        with LLM("random:smollm2-135m", dtype="float32", mixed_step_tokens=mixed_tokens, **OPTIONS) as llm:
            results[mixed_tokens] = staggered(llm, params, waves)
            assert llm.engine.decode_runner.stats.mixed_steps == (1 if mixed_tokens else 0)
    assert results[32] == results[0]


def test_enforce_eager_runs_the_mixed_forward_and_gives_its_tokens_bf16():
    tokens = {}
    for eager in (False, True):
        with LLM("random:smollm2-135m", dtype="bfloat16", enforce_eager=eager, mixed_step_tokens=64,
                 enable_chunked_prefill=True, max_num_batched_tokens=64, **OPTIONS) as llm:
            runner = llm.engine.decode_runner
            tokens[eager] = staggered(llm, sampling("seeded"))
            assert runner.stats.mixed_steps > 0 and (runner.stats.num_mixed_graphs == 0) == eager
    assert tokens[True] == tokens[False]


def test_the_oracle_finds_every_mixed_replay_equal_to_its_eager_forward():
    with LLM("random:smollm2-135m", dtype="bfloat16", check_graphs=1, mixed_step_tokens=64,
             enable_chunked_prefill=True, max_num_batched_tokens=64, **OPTIONS) as llm:
        staggered(llm, sampling("greedy"))
        runner = llm.engine.decode_runner
        assert runner.stats.mixed_steps > 0
        assert runner.graph_check.checks >= runner.stats.mixed_steps and runner.graph_check.failures == []
