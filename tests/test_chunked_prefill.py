"""Chunked prefill on the CPU (float32, random checkpoints): the output with prompts split into chunks
equals the output without, greedy and seeded, with budgets that cut prompts across 4-token blocks,
under preemption, with speculation and pipelined steps; a step never runs more tokens than its
budget, decodes keep running while a long prompt is prefilled, prompt logprobs are scored chunk by
chunk, and bad values are refused."""

from __future__ import annotations

import pytest
import torch

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
    plain = [out.token_ids for out in _outputs(params, enable_chunked_prefill=False)]
    for budget in (5, 7, 13):  # chunks ending inside blocks, on their boundaries, a token short of a prompt
        chunked = _outputs(params, enable_chunked_prefill=True, max_num_batched_tokens=budget)
        assert [out.token_ids for out in chunked] == plain, budget


def test_preemption_speculation_and_pipelined_steps_with_chunks():
    """Too few blocks (preemption: a recomputed sequence is prefilled in chunks too), prompt-lookup
    drafts, and async_decode on the CPU: the same tokens, no request lost."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [out.token_ids for out in _outputs(params, enable_chunked_prefill=False)]
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


def test_prompt_logprobs_are_scored_chunk_by_chunk():
    """Budgets that cut the prompts inside blocks, on their boundaries, one token short of a prompt's end
    (the last token then decodes), below the longest prompts, and under preemption: the whole prompt's
    logprobs, every token's, as whole prefills score them."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    plain = _outputs(params, enable_chunked_prefill=False)
    cases = [dict(max_num_batched_tokens=budget) for budget in (4, 7, 16, 20)]
    cases.append(dict(max_num_batched_tokens=9, num_kv_blocks=20))  # a sequence preempted, recomputed in chunks
    for case in cases:
        chunked = _outputs(params, **case)
        if "num_kv_blocks" in case:
            assert sum(out.num_preemptions for out in chunked) > 0
        for prompt, a, b in zip(PROMPTS, plain, chunked):
            assert b.finish_reason == "length" and a.token_ids == b.token_ids, case
            assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None, case
            assert [p.token_id for p in b.prompt_logprobs[1:]] == prompt[1:], case
            assert [p.logprob for p in b.prompt_logprobs[1:]] == pytest.approx(
                [p.logprob for p in a.prompt_logprobs[1:]], rel=1e-5, abs=1e-5), case
            assert [[t for t, _ in p.top] for p in b.prompt_logprobs[1:]] == [
                [t for t, _ in p.top] for p in a.prompt_logprobs[1:]], case


def test_prompt_logprobs_of_a_chunk_join_into_the_whole_prompts():
    from graphrt.sampling.logprobs import prompt_logprobs

    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden, prompt = torch.randn(11, 8), [int(t) for t in torch.randint(0, 50, (11,))]
    logits = lambda rows: rows @ weight.T  # noqa: E731
    whole = prompt_logprobs(logits, hidden, prompt, 3)
    cuts = [0, 4, 5, 10, 11]  # a one-row chunk, and a last chunk of only the prompt's last row
    joined = sum((prompt_logprobs(logits, hidden[a:b], prompt, 3, first=a) for a, b in zip(cuts, cuts[1:])), [])
    assert len(whole) == len(joined) == 11 and whole[0] is None and joined[0] is None
    assert [(p.token_id, p.logprob) for p in joined[1:]] == [(p.token_id, p.logprob) for p in whole[1:]]
    expected = torch.log_softmax(logits(hidden[:-1]).double(), -1)[torch.arange(10), prompt[1:]]
    assert [p.logprob for p in whole[1:]] == pytest.approx(expected.tolist(), abs=1e-5)
    for first, rows in ((0, 12), (10, 2), (-1, 2), (3, 0)):
        with pytest.raises(ValueError, match="hidden rows from token"):
            prompt_logprobs(logits, torch.randn(rows, 8), prompt, 3, first=first)


def test_bad_values_are_refused_and_the_cli_takes_the_options():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="max_num_batched_tokens must be None or an integer >= 1"):
            EngineConfig(max_num_batched_tokens=bad)
    with pytest.raises(ConfigError, match="enable_chunked_prefill must be True or False"):
        EngineConfig(enable_chunked_prefill="yes")
    args = build_parser().parse_args(["generate", "--enable-chunked-prefill", "--max-num-batched-tokens", "512"])
    assert args.enable_chunked_prefill and args.max_num_batched_tokens == 512
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-num-batched-tokens", "0"])
    defaults = build_parser().parse_args(["generate"])  # both on by default; --no-... turns them off
    assert defaults.enable_chunked_prefill and defaults.enable_prefix_caching
    off = build_parser().parse_args(["generate", "--no-enable-chunked-prefill", "--no-enable-prefix-caching"])
    assert not off.enable_chunked_prefill and not off.enable_prefix_caching
    assert EngineConfig().enable_chunked_prefill and EngineConfig().enable_prefix_caching
    with _llm(enable_chunked_prefill=False) as llm:  # without chunks a whole prompt must fit a step
        assert llm.engine.max_num_batched_tokens == 128
    with _llm() as llm:
        assert llm.engine.max_num_batched_tokens == 2048
