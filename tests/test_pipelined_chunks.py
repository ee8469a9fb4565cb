"""Prompt chunks queued blind beside pipelined decodes (``async_decode`` with chunked prefill): a step
of chunks that sample nothing and decodes is queued before the previous step's tokens are read, the
decodes fed from the device, a waiting prompt is admitted into such a step, and a prompt's last token is
decoded beside the carried rows, fed from the host, so that only a step with nothing in flight runs
synchronously. Checked on the CPU (random:tiny, float32) against the synchronous engine and against
whole prompts: the same output, greedy and seeded, for budgets across block boundaries, with requests
arriving while others decode, with shared prefixes (one prompt left a single token by the cache),
under preemption, and through an interrupted step; an abort stops a prompt whose chunk is in flight."""

from __future__ import annotations

import pytest

from graphrt import LLM, SamplingParams

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33, 70, 101, 9, 64)]


def _llm(**options) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_model_len=160, max_num_seqs=8, progress=False,
                    loader_options={"init_std": 0.3})
    return LLM("random:tiny", **{**defaults, **options})


def _params(sampling: str) -> list[SamplingParams]:
    if sampling == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(PROMPTS)
    return [SamplingParams(temperature=0.9, top_p=0.9, seed=n, max_tokens=20, ignore_eos=True)
            for n in range(len(PROMPTS))]


def _staggered(llm: LLM, params: list[SamplingParams], interrupt_once: bool = False) -> tuple[list, dict, int]:
    """A request arrives every third step call; returns the tokens in prompt order, the counts of chunk
    launches (queued from a schedule, queued blind behind a step in flight, and of the latter the prompts
    admitted blind) and of synchronous steps with decodes (the model runner's ``execute``: they hold up
    the decoding sequences), and the preemptions."""
    engine = llm.engine
    launches = {"scheduled": 0, "blind": 0, "admitted": 0, "synchronous": 0}
    execute = engine.runner.execute

    def executing(prefills, decodes, *args, **kwargs):
        launches["synchronous"] += bool(decodes)
        return execute(prefills, decodes, *args, **kwargs)

    engine.runner.execute = executing
    admit = engine.scheduler.admit_blind

    def admitting(token_budget):
        seq = admit(token_budget)
        launches["admitted"] += seq is not None
        return seq

    engine.scheduler.admit_blind = admitting
    interrupted = []
    launch = engine.runner.launch_chunks

    def counting(prefills, lengths, decodes, ahead_from=None):
        if ahead_from is not None and interrupt_once and not interrupted and launches["blind"] == 2:
            interrupted.append(True)
            raise KeyboardInterrupt  # a step in flight with chunks, and the next one refused midway
        launches["blind" if ahead_from is not None else "scheduled"] += 1
        return launch(prefills, lengths, decodes, ahead_from=ahead_from)

    engine.runner.launch_chunks = counting
    index_of, finished, call = {}, {}, 0
    while len(finished) < len(PROMPTS):
        if call % 3 == 0 and call // 3 < len(PROMPTS):
            index = call // 3
            index_of[engine.add_request(PROMPTS[index], params[index])] = index
        call += 1
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            continue
        finished.update((index_of[out.request_id], out) for out in outputs if out.finished)
    assert not interrupt_once or interrupted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    outs = [finished[i] for i in range(len(PROMPTS))]
    return [out.token_ids for out in outs], launches, sum(out.num_preemptions for out in outs)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("budget", [12, 17, 40])
def test_blind_chunks_give_the_synchronous_and_the_whole_prompts_output(sampling, budget):
    params = _params(sampling)
    with _llm(enable_chunked_prefill=False, enable_prefix_caching=False, async_decode=False) as llm:
        whole, _, _ = _staggered(llm, params)
    with _llm(max_num_batched_tokens=budget, async_decode=False) as llm:
        synchronous, launches, _ = _staggered(llm, params)
        assert launches["scheduled"] == launches["blind"] == launches["admitted"] == 0
    with _llm(max_num_batched_tokens=budget, async_decode=True) as llm:
        pipelined, launches, _ = _staggered(llm, params)
    # Every request but the first arrives while others decode: it is admitted blind, and no step that
    # decodes is read before the next one is queued.
    assert launches["blind"] > 0 and launches["admitted"] == len(PROMPTS) - 1 and launches["synchronous"] == 0
    assert pipelined == synchronous == whole


def test_blind_chunks_with_shared_prefixes_give_the_uncached_output(monkeypatch):
    """Prompts sharing a 37-token prefix (block size 4): cached blocks named as pipelined chunks are read
    back, and later prompts take them; the prefix alone, asked again, is left one token by the cache
    (admitted with no chunk, its last token decoded beside the carried rows)."""
    shared = [(29 * i) % 400 + 5 for i in range(37)]
    prompts = [shared + [(11 * i + 3 * n) % 400 + 7 for i in range(n)] for n in (3, 20, 9, 41, 0, 30, 14, 25)]
    monkeypatch.setattr(f"{__name__}.PROMPTS", prompts)
    params = _params("seeded")
    with _llm(enable_chunked_prefill=False, enable_prefix_caching=False, async_decode=False) as llm:
        whole, _, _ = _staggered(llm, params)
    with _llm(max_num_batched_tokens=12, async_decode=True, block_size=4) as llm:
        cached, launches, _ = _staggered(llm, params)
        assert llm.engine.prefix_cache_hit_rate > 0.3 and launches["blind"] > 0 and launches["synchronous"] == 0
    assert cached == whole


def test_blind_chunks_under_preemption_and_through_an_interrupt_lose_nothing():
    params = _params("greedy")
    with _llm(enable_chunked_prefill=False, enable_prefix_caching=False, async_decode=False) as llm:
        whole, _, _ = _staggered(llm, params)
    with _llm(max_num_batched_tokens=12, async_decode=True, block_size=4, num_kv_blocks=34) as llm:
        small_pool, launches, preemptions = _staggered(llm, params)
        assert launches["blind"] > 0 and preemptions > 0
    with _llm(max_num_batched_tokens=12, async_decode=True) as llm:
        interrupted, _, _ = _staggered(llm, params, interrupt_once=True)
    assert small_pool == whole and interrupted == whole


def test_a_prompt_aborted_while_its_chunk_is_in_flight_stops_at_the_next_synchronous_step():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with _llm(max_num_batched_tokens=10, async_decode=True) as llm:
        engine = llm.engine
        [alone] = llm.generate([PROMPTS[0]], params)
        engine.add_request(PROMPTS[0], params, request_id="keep")
        for _ in range(3):
            engine.step()
        engine.add_request(PROMPTS[5], params, request_id="long")  # 101 tokens: ten chunks
        steps = 0
        while engine._in_flight is None or not engine._in_flight.chunks:
            engine.step()
            steps += 1
            assert steps < 10, "no chunk was queued blind"
        assert engine.abort_request("long")
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        assert finished["long"].finish_reason == "abort" and finished["long"].token_ids == []
        assert finished["keep"].token_ids == alone.token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
