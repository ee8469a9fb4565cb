"""Pipelined decode (``EngineConfig.async_decode``): the engine queues step n + 1, fed by step n's tokens on
the device, before it reads step n's. Checked against the synchronous engine on the CPU (random:tiny):
same outputs through stops seen a step late, arrivals, preemption and seeded sampling; and the graph
runner's carried input ids against decodes fed from the host."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.capture import DecodeBatch

TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False, loader_options={"init_std": 0.5})


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def sync_llm():
    return LLM(**TINY, async_decode=False)


@pytest.fixture(scope="module")
def async_llm():
    return LLM(**TINY, async_decode=True)


def _count_launches(engine, monkeypatch) -> dict:
    """Counts the decode runner's launches by whether they carried their input ids."""
    counts = {"carried": 0, "fed": 0}
    runner = engine.runner.decode_runner
    original = runner.launch

    def counting(batch, carry_input_ids=False, carry_rows=None):
        counts["carried" if carry_input_ids or carry_rows is not None else "fed"] += 1
        return original(batch, carry_input_ids, carry_rows)

    monkeypatch.setattr(runner, "launch", counting)
    return counts


def _outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


def test_async_greedy_matches_sync_and_pipelines(sync_llm, async_llm, monkeypatch):
    prompts = _prompts(4, seed=10)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 1)]
    counts = _count_launches(async_llm.engine, monkeypatch)
    assert _outputs(async_llm, prompts, params) == _outputs(sync_llm, prompts, params)
    # After the first, every decode follows the one before blind: requests reaching max_tokens leave
    # the batch without a pause (their rows dropped, the others' ids gathered on the device).
    assert counts["fed"] == 1 and counts["carried"] == 10
    engine = async_llm.engine
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_stop_token_seen_a_step_late_is_not_kept(sync_llm, async_llm):
    prompts = _prompts(3, seed=11)
    free = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    reference = [o.token_ids for o in sync_llm.generate(prompts, free)]
    # Each request stops on a token it generates mid-way (its first occurrence ends it).
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[ids[k]])
              for ids, k in zip(reference, (3, 6, 9))]
    got = _outputs(async_llm, prompts, params)
    assert got == _outputs(sync_llm, prompts, params)
    assert all(reason == "stop" for _, reason in got)
    assert [len(ids) for ids, _ in got] == [ids.index(ids[k]) + 1 for ids, k in zip(reference, (3, 6, 9))]
    engine = async_llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_seeded_sampling_matches_sync(sync_llm, async_llm):
    prompts = _prompts(5, seed=12)
    params = [SamplingParams(temperature=0.9, top_p=0.95 if i % 2 else 1.0, max_tokens=10, ignore_eos=True,
                             seed=500 + i) for i in range(len(prompts))]
    assert _outputs(async_llm, prompts, params) == _outputs(sync_llm, prompts, params)


def test_arrivals_between_steps_match_sync(sync_llm, async_llm):
    first, second, third = _prompts(3, seed=13)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)

    def run(engine) -> dict:
        finals = {}
        engine.add_request(first, params, request_id="a")
        for step in range(12):
            if step == 3:
                engine.add_request(second, params, request_id="b")
            if step == 5:
                engine.add_request(third, params, request_id="c")
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        return finals

    got, expected = run(async_llm.engine), run(sync_llm.engine)
    assert got == expected and set(got) == {"a", "b", "c"}
    # Arrivals make the engine skip their step's pipelining, not their prefill: b and c still ran
    # alongside a (as in the synchronous engine, whose token counts per step they match).


def test_preemption_with_async_decode_loses_nothing():
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=0.9, top_k=50, max_tokens=24, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    roomy = LLM(**TINY, async_decode=False).generate(prompts, params)
    tight_llm = LLM(**TINY, num_kv_blocks=10, async_decode=True)
    tight = tight_llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0, "the cache was meant to be too small"
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    manager = tight_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_an_interrupted_wait_loses_no_token(sync_llm, async_llm, monkeypatch):
    """An exception while a pipelined step waits for its tokens (a Ctrl-C, say) leaves the engine usable:
    the interrupted steps are decoded again and the outputs are those of an uninterrupted run."""
    from graphrt.capture import PendingTokens

    prompts = _prompts(3, seed=14)
    params = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=77)
    expected = [o.token_ids for o in sync_llm.generate(prompts, params)]
    engine = async_llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"interrupted-{i}")
    original, calls = PendingTokens.result, {"n": 0}

    def flaky(self):
        if self._tokens is None:  # a real wait, not a read of tokens already on the host
            calls["n"] += 1
            if calls["n"] == 4:
                assert engine._in_flight is not None  # the step after this one is queued already
                raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(PendingTokens, "result", flaky)
    finals, interrupted = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            continue
        finals.update({o.request_id: o.token_ids for o in outputs if o.finished})
    assert interrupted == 1
    assert [finals[f"interrupted-{i}"] for i in range(3)] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def _batch(engine, seq_ids, context, input_ids) -> DecodeBatch:
    manager = engine.block_manager
    return DecodeBatch(
        input_ids=input_ids,
        positions=[context - 1] * len(seq_ids),
        block_tables=[manager.block_table(s) for s in seq_ids],
        slot_mapping=[manager.slot(s, context - 1) for s in seq_ids],
        params=[SamplingParams(temperature=0)] * len(seq_ids),
        seeds=list(seq_ids),
        steps=[0] * len(seq_ids),
    )


@pytest.mark.parametrize("options,prompts", [
    (dict(capture_sizes=[2]), [[5, 6, 7], [8, 9], [10, 11, 12]]),  # three rows outgrow two
    (dict(max_capture_seq_len=16), [list(range(3, 23)), [8, 9], [10, 11, 12]]),  # a row longer than captured
], ids=["rows", "length"])
def test_batch_back_inside_the_static_buffers_matches_sync(sync_llm, options, prompts):
    """A launch that outgrew the decode runner's static buffers ran outside them; when a row finishes and
    the others fit again, the next launch cannot carry ids those buffers never received: it waits for the
    tokens and feeds them from the host (before, generate raised on the carry)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 6, 6)]
    llm = LLM(**TINY, async_decode=True, max_num_seqs=4, **options)
    assert _outputs(llm, prompts, params) == _outputs(sync_llm, prompts, params)
    assert not llm.engine.has_unfinished_requests()


def test_runner_carried_input_ids_equal_host_fed(async_llm):
    """Three steps of three rows: carrying the ids on the device gives the tokens that feeding each
    step's sampled ids back from the host gives."""
    engine = async_llm.engine
    runner = engine.runner.decode_runner
    manager = engine.block_manager
    seq_ids = [900, 901, 902]
    for sid in seq_ids:
        manager.allocate(sid, 20)
    try:
        def steps(carry: bool) -> list[list[int]]:
            ids = [5, 77, 300]
            first = runner.launch(_batch(engine, seq_ids, 17, ids))
            history, pending = [], first
            for position in (18, 19):
                batch = _batch(engine, seq_ids, position, [0, 0, 0] if carry else pending.result())
                following = runner.launch(batch, carry_input_ids=carry)
                history.append(pending.result())
                pending = following
            history.append(pending.result())
            return history

        fed, carried = steps(carry=False), steps(carry=True)
        assert carried == fed
        assert len({tuple(t) for t in fed}) > 1, "the steps should produce different tokens"
    finally:
        for sid in seq_ids:
            manager.free(sid)


def test_runner_carries_ids_from_other_rows(async_llm):
    """A step that dropped a row (a finished sequence) takes each remaining row's id from the row it
    sat in before: the same tokens as feeding the sampled ids back from the host."""
    engine = async_llm.engine
    runner = engine.runner.decode_runner
    manager = engine.block_manager
    seq_ids = [920, 921, 922, 923]
    for sid in seq_ids:
        manager.allocate(sid, 20)
    try:
        first = runner.decode(_batch(engine, seq_ids, 17, [5, 77, 300, 41]))
        kept = [0, 2, 3]  # row 1 finished
        fed = runner.decode(_batch(engine, [seq_ids[r] for r in kept], 18, [first[r] for r in kept]))
        runner.decode(_batch(engine, seq_ids, 17, [5, 77, 300, 41]))
        carried = runner.launch(_batch(engine, [seq_ids[r] for r in kept], 18, [0, 0, 0]), carry_rows=kept).result()
        assert carried == fed
        # Row 1 fed from the host between carried rows (a prompt's last token joining them): its id is
        # taken, the others' ignored.
        runner.decode(_batch(engine, seq_ids, 17, [5, 77, 300, 41]))
        mixed_ids = [first[3], 123, first[0]]
        fed_mixed = runner.decode(_batch(engine, [seq_ids[3], seq_ids[1], seq_ids[0]], 18, mixed_ids))
        runner.decode(_batch(engine, seq_ids, 17, [5, 77, 300, 41]))
        batch = _batch(engine, [seq_ids[3], seq_ids[1], seq_ids[0]], 18, [999, 123, 999])
        assert runner.launch(batch, carry_rows=[3, None, 0]).result() == fed_mixed
        with pytest.raises(ValueError, match="cannot carry the input id of row 3"):
            runner.launch(_batch(engine, seq_ids[:2], 18, [0, 0]), carry_rows=[0, 3])
        with pytest.raises(ValueError, match="names 1 source rows for a batch of 2"):
            runner.launch(_batch(engine, seq_ids[:2], 18, [0, 0]), carry_rows=[0])
    finally:
        for sid in seq_ids:
            manager.free(sid)


def test_runner_refuses_what_it_cannot_carry_and_keeps_unread_tokens(async_llm):
    engine = async_llm.engine
    runner = engine.runner.decode_runner
    manager = engine.block_manager
    seq_ids = [910, 911]
    for sid in seq_ids:
        manager.allocate(sid, 8)
    try:
        runner.decode(_batch(engine, seq_ids[:1], 8, [3]))
        with pytest.raises(ValueError, match="carry the input ids of 2 rows"):
            runner.launch(_batch(engine, seq_ids, 8, [0, 0]), carry_input_ids=True)
        expected = [runner.decode(_batch(engine, seq_ids, 8, ids)) for ids in ([3, 4], [1, 2])]
        first = runner.launch(_batch(engine, seq_ids, 8, [3, 4]))
        runner.launch(_batch(engine, seq_ids, 8, [0, 0]), carry_input_ids=True)
        # A third launch reuses the oldest one's pinned buffer: it reads the oldest's tokens first.
        third = runner.launch(_batch(engine, seq_ids, 8, [1, 2]))
        assert first.result() == expected[0] and third.result() == expected[1]
        assert first.ready() and third.ready()
    finally:
        for sid in seq_ids:
            manager.free(sid)


def test_decode_inputs_refresh_keeps_device_input_ids():
    from graphrt.capture.decode_inputs import DecodeInputs

    inputs = DecodeInputs.allocate(4, torch.device("cpu"))
    inputs.refresh([11, 12], [4, 8], 4)
    inputs.input_ids[:2] = torch.tensor([101, 102])  # what a step's sampler writes there
    inputs.refresh([7, 7], [5, 9], 4, keep_input_ids=True, carry_rows=[1, 0])
    assert inputs.input_ids[:2].tolist() == [101, 102]
    assert inputs.positions[:4].tolist() == [5, 9, 0, 0]
    assert inputs.carry_rows[:2].tolist() == [1, 0]
    # A row fed from the host beside carried ones: its id staged at fed_ids[row], its source index 4 + row.
    inputs.refresh([7, 55, 7], [5, 9, 3], 4, keep_input_ids=True, carry_rows=[1, None, 0])
    assert inputs.input_ids[:2].tolist() == [101, 102] and inputs.fed_ids[1].item() == 55
    assert inputs.carry_rows[:3].tolist() == [1, 5, 0]
    assert inputs.carry_source.index_select(0, inputs.carry_rows[:3]).tolist() == [102, 55, 101]
    with pytest.raises(ValueError, match="1 input ids for 2 positions"):
        inputs.refresh([7], [5, 9], 4, keep_input_ids=True, carry_rows=[1, None])