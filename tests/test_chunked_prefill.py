"""Chunked prefill on the CPU (float32, random checkpoints): the output with prompts split into chunks
equals the output without, greedy and seeded, with budgets that cut prompts across 4-token blocks,
under preemption, with speculation and pipelined steps; a step never runs more tokens than its
budget, decodes keep running while a long prompt is prefilled, prompt logprobs are still scored
whole, and bad values are refused."""

from __future__ import annotations

import pytest

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.block_manager import BlockManager
from graphrt.cli import build_parser
from graphrt.scheduler import Scheduler
from graphrt.sequence import Sequence

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33, 50)]


def _llm(**options) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, num_kv_blocks=64,
                    block_size=4, loader_options={"init_std": 0.2}, progress=False)
    return LLM("random:tiny", **{**defaults, **options})


def _outputs(params: SamplingParams, **options) -> list:
    with _llm(**options) as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chunked_prefill_gives_the_output_without_it(sampling):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=3, max_tokens=12, ignore_eos=True)
    plain = [out.token_ids for out in _outputs(params)]
    for budget in (5, 7, 13):  # chunks ending inside blocks, on their boundaries, a token short of a prompt
        chunked = _outputs(params, enable_chunked_prefill=True, max_num_batched_tokens=budget)
        assert [out.token_ids for out in chunked] == plain, budget


def test_preemption_speculation_and_pipelined_steps_with_chunks():
    """Too few blocks (preemption: a recomputed sequence is prefilled in chunks too), prompt-lookup
    drafts, and async_decode on the CPU: the same tokens, no request lost."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [out.token_ids for out in _outputs(params)]
    cases = [dict(num_kv_blocks=22), dict(speculative="ngram:3"), dict(async_decode=True)]
    for options in cases:
        outs = _outputs(params, enable_chunked_prefill=True, max_num_batched_tokens=9, **options)
        assert [out.token_ids for out in outs] == plain, options
        if "num_kv_blocks" in options:
            assert sum(out.num_preemptions for out in outs) > 0


def test_a_step_keeps_to_its_budget_and_decodes_go_on_while_a_prompt_is_chunked():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=True)
    short = Sequence(0, "short", [5, 6, 7], SamplingParams(max_tokens=40), seed=0)
    long = Sequence(1, "long", list(range(3, 33)), SamplingParams(max_tokens=4), seed=0)  # 30 tokens
    scheduler.add(short)
    first = scheduler.schedule()
    assert first.prefills == [short] and first.prefill_tokens == [3]
    short.num_computed_tokens = 3
    short.output_token_ids.append(9)
    scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_tokens - 1:
        out = scheduler.schedule()
        assert out.decodes == [short]  # the running sequence decodes every step
        assert len(out.decodes) + sum(out.prefill_tokens) <= 8
        assert out.prefills == [long]
        chunks.append(out.prefill_tokens[0])
        long.num_computed_tokens += out.prefill_tokens[0]
        short.num_computed_tokens = short.num_tokens
        short.output_token_ids.append(9)
    assert chunks == [7, 7, 7, 7, 2] and scheduler.has_prefill_under_way() is False
    assert long.num_computed_tokens == long.num_tokens  # the last chunk reached the prompt's end


def test_prompt_logprobs_are_scored_from_a_whole_prefill():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    plain = _outputs(params)
    chunked = _outputs(params, enable_chunked_prefill=True, max_num_batched_tokens=60)
    for a, b in zip(plain, chunked):
        assert a.token_ids == b.token_ids
        assert [p.logprob for p in a.prompt_logprobs[1:]] == pytest.approx([p.logprob for p in b.prompt_logprobs[1:]])
    with _llm(enable_chunked_prefill=True, max_num_batched_tokens=20) as llm:  # the 33- and 50-token prompts
        outs = llm.generate(PROMPTS, params)  # cannot be scored in one step: refused, the others run
    assert [out.finish_reason for out in outs] == ["length"] * 3 + ["error"] * 2
    assert "prompt_logprobs scores the whole prompt in one step" in outs[3].error


def test_bad_values_are_refused_and_the_cli_takes_the_options():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="max_num_batched_tokens must be an integer >= 1"):
            EngineConfig(max_num_batched_tokens=bad)
    with pytest.raises(ConfigError, match="enable_chunked_prefill must be True or False"):
        EngineConfig(enable_chunked_prefill="yes")
    args = build_parser().parse_args(["generate", "--enable-chunked-prefill", "--max-num-batched-tokens", "512"])
    assert args.enable_chunked_prefill and args.max_num_batched_tokens == 512
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-num-batched-tokens", "0"])
    with _llm() as llm:  # without chunks a whole prompt must fit a step
        assert llm.engine.max_num_batched_tokens == 128
    with _llm(enable_chunked_prefill=True) as llm:
        assert llm.engine.max_num_batched_tokens == 2048
