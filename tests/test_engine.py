"""Engine behaviour: continuous batching, preemption, seeded sampling, streaming (CPU, random:tiny)."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams

# Wide init so a random model's greedy continuations vary from token to token.
TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False, loader_options={"init_std": 0.5})


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm():
    return LLM(**TINY)


def test_generate_returns_one_output_per_prompt_in_order(llm):
    prompts = _prompts(5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" for o in outputs)


def test_batched_greedy_equals_one_at_a_time(llm):
    prompts = _prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_new_requests_prefill_while_others_decode(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first, second = _prompts(2, seed=2)
    engine.add_request(first, params, request_id="first")
    for _ in range(3):
        engine.step()
    engine.add_request(second, params, request_id="second")
    outputs = engine.step()  # one step: "second" prefills while "first" decodes its 4th token
    assert [(o.request_id, len(o.token_ids)) for o in outputs] == [("second", 1), ("first", 4)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    expected = llm.generate([first, second], params)
    assert [finals["first"], finals["second"]] == [o.token_ids for o in expected]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_preemption_loses_no_request_and_keeps_outputs(temperature):
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=temperature, top_k=50, max_tokens=24, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    roomy = LLM(**TINY).generate(prompts, params)
    # 9 usable blocks of 16 tokens: each request needs 1-4 blocks, all of them together about 20.
    tight_llm = LLM(**TINY, num_kv_blocks=10)
    tight = tight_llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0, "the cache was meant to be too small"
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" for o in tight)
    assert tight_llm.engine.block_manager.num_free_blocks == tight_llm.engine.block_manager.num_usable_blocks


def test_seeded_sampling_independent_of_batch_composition(llm):
    target = _prompts(1, seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1234)
    alone = llm.generate([target], params)[0].token_ids
    others = _prompts(5, seed=5)
    other_params = SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True)
    for position in (0, 2, 5):
        batch = others[:position] + [target] + others[position:]
        batch_params = [other_params] * position + [params] + [other_params] * (5 - position)
        assert llm.generate(batch, batch_params)[position].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=99)
    assert llm.generate([target], different_seed)[0].token_ids != alone


def test_unseeded_requests_reproducible_from_engine_seed():
    prompts = _prompts(3, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    first = [o.token_ids for o in LLM(**TINY, seed=7).generate(prompts, params)]
    again = [o.token_ids for o in LLM(**TINY, seed=7).generate(prompts, params)]
    other = [o.token_ids for o in LLM(**TINY, seed=8).generate(prompts, params)]
    assert first == again
    assert first != other


def test_stop_tokens_and_eos_finish_with_stop(llm):
    prompt = _prompts(1, seed=7)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_at = free[4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop_at) + 1]

    # The model's own end-of-sequence id: among a few prompts, take the first whose free greedy
    # continuation (EOS ignored) reaches it after its first token; with EOS honoured it stops there.
    [eos] = llm.engine.model_config.eos_token_ids  # random:tiny's
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    candidates = _prompts(64, seed=70)
    runs = llm.generate(candidates, free_params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in runs), "ignore_eos=True stopped"
    prompt, free = next(((p, o.token_ids) for p, o in zip(candidates, runs) if eos in o.token_ids[1:-1]),
                        (None, None))
    assert prompt is not None, "no candidate's greedy continuation reaches EOS: draw other candidates"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]  # ignore_eos=False
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(eos) + 1]
    past = llm.generate([prompt], free_params)[0]  # ignore_eos=True runs past it, to max_tokens
    assert past.finish_reason == "length" and past.token_ids == free


def test_max_model_len_finishes_with_length():
    small = LLM(**TINY, max_model_len=20)
    out = small.generate([_prompts(1, seed=8)[0][:15]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 20


def test_scheduler_can_admit_mirrors_the_prefill_rules():
    from graphrt.block_manager import BlockManager
    from graphrt.scheduler import Scheduler
    from graphrt.sequence import Sequence

    def seq(seq_id: int, length: int) -> Sequence:
        return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=list(range(length)),
                        params=SamplingParams(), seed=0)

    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=10)  # 3 usable blocks
    assert not scheduler.can_admit()  # nothing waiting
    scheduler.add(seq(0, 12))
    assert not scheduler.can_admit()  # 12 tokens exceed the 10-token budget
    scheduler.waiting.clear()
    scheduler.add(seq(1, 9))
    assert scheduler.can_admit() and not scheduler.can_admit(token_budget=8)
    assert scheduler.schedule().prefills  # admitted: 3 blocks taken
    scheduler.add(seq(2, 1))
    assert not scheduler.can_admit()  # no block left


@pytest.mark.parametrize("failing", ["_prefill", "launch"])
def test_a_step_that_raises_leaves_requests_to_finish_as_if_it_had_not_run(llm, failing, monkeypatch):
    """An exception (an interrupt, most likely) inside a step's forward propagates; the requests stay
    queued and, stepped on, produce what they would have: a prompt admitted by that step is prefilled
    again rather than decoded on a cache that lacks its K/V (the ``_prefill`` case), and a decode-only
    step runs its token again (the ``launch`` case, which held before that fix too: it guards it)."""
    prompts = _prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    owner = engine.runner if failing == "_prefill" else engine.runner.decode_runner
    original = getattr(owner, failing)
    calls = {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1 + (failing == "launch"):  # the first prefill, or the second decode
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, failing, fails_once)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = {}
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.token_ids) for o in engine.step())
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.token_ids) for o in engine.step())
    assert [outputs[i] for i in ids] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
