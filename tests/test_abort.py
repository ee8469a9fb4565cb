"""Aborting requests (``LLMEngine.abort_request``) and streams that stop early or share one ``LLM``:
an aborted request ends with ``finish_reason="abort"`` and frees its blocks, waiting or running,
synchronous or pipelined; the others' tokens are unchanged."""

from __future__ import annotations

import pytest

from graphrt import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(**options) -> LLM:
    return LLM("random:tiny", **{**dict(device="cpu", dtype="float32", max_model_len=64, progress=False), **options})


def _run(engine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("async_decode", [False, True], ids=["synchronous", "pipelined"])
def test_aborted_requests_end_with_abort_and_free_their_blocks_and_the_others_are_unchanged(async_decode):
    with _llm(max_num_seqs=2, async_decode=async_decode) as llm:
        engine = llm.engine
        [alone] = llm.generate([[5, 6, 7]], GREEDY)
        free = engine.block_manager.num_free_blocks
        for rid, prompt in (("keep", [5, 6, 7]), ("running", [9, 10]), ("waiting", [11, 12, 13])):
            engine.add_request(prompt, GREEDY, request_id=rid)
        for _ in range(3):
            engine.step()
        assert engine.abort_request("waiting") and engine.abort_request("running")
        assert not engine.abort_request("running") and not engine.abort_request("no such request")
        finished = _run(engine)
        assert finished["waiting"].finish_reason == "abort" and finished["waiting"].token_ids == []
        assert finished["running"].finish_reason == "abort" and 0 < len(finished["running"].token_ids) < 12
        assert finished["keep"].token_ids == alone.token_ids and finished["keep"].finish_reason == "length"
        assert engine.block_manager.num_free_blocks == free and not engine.abort_request("keep")


def test_a_prompt_aborted_partway_through_its_chunks_runs_no_further_chunk():
    """Chunked prefill (a budget of 8 tokens, a 120-token prompt): the abort takes effect before the
    next step is scheduled, not once the whole prompt is prefilled; a request beside it is unchanged."""
    long_prompt = [(7 * i) % 400 + 3 for i in range(120)]
    with _llm(max_model_len=160, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        engine = llm.engine
        [alone] = llm.generate([[5, 6, 7]], GREEDY)
        free = engine.block_manager.num_free_blocks
        engine.add_request(long_prompt, GREEDY, request_id="long")
        engine.add_request([5, 6, 7], GREEDY, request_id="keep")
        engine.step()
        long_seq = engine._requests["long"]
        assert 0 < long_seq.num_computed_tokens < len(long_prompt)  # partway through its chunks
        chunks = []
        prefill = engine.runner._prefill
        engine.runner._prefill = lambda seqs, lengths=None: chunks.extend(s.request_id for s in seqs) or prefill(
            seqs, lengths)
        assert engine.abort_request("long")
        outputs = {out.request_id: out for out in engine.step()}
        assert outputs["long"].finished and outputs["long"].finish_reason == "abort"
        assert outputs["long"].token_ids == []
        finished = _run(engine)
        assert "long" not in chunks and "long" not in finished
        assert finished["keep"].token_ids == alone.token_ids
        assert engine.block_manager.num_free_blocks == free


@pytest.mark.parametrize("async_decode", [False, True], ids=["synchronous", "pipelined"])
def test_a_swapped_out_request_aborted_leaves_at_once_and_frees_its_host_blocks(async_decode):
    """Swap preemption (a pool too small for four sequences): an aborted swapped-out request is not
    swapped back in to be decoded; the next step returns its abort and its host blocks are free."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[(13 * i + 7 * k) % 500 + 3 for i in range(6)] for k in range(4)]
    with _llm(max_model_len=256, max_num_seqs=8, async_decode=async_decode, block_size=4, num_kv_blocks=14,
              swap_space_bytes=1 << 22, max_num_batched_tokens=12) as llm:
        engine = llm.engine
        expected = {f"r{k}": out.token_ids for k, out in enumerate(llm.generate(prompts, params))}
        for k, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"r{k}")
        swapped = []
        while not swapped:
            engine.step()
            swapped = [rid for rid, seq in engine._requests.items() if engine.swap_space.holds(seq.seq_id)]
        held = engine.swap_space.allocator.num_free_blocks
        assert engine.abort_request(swapped[0])
        assert engine.swap_space.allocator.num_free_blocks > held
        outputs = {out.request_id: out for out in engine.step()}
        assert outputs[swapped[0]].finish_reason == "abort"
        finished = _run(engine)
        assert all(finished[rid].token_ids == expected[rid] for rid in finished)
        assert len(finished) == 3 and swapped[0] not in finished
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
        assert engine.swap_space.allocator.num_free_blocks == engine.swap_space.allocator.num_usable_blocks


def test_an_aborted_decoding_request_is_not_queued_again_by_a_pipelined_step():
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    with _llm(async_decode=True) as llm:
        engine = llm.engine
        engine.add_request([1, 2, 3], params, request_id="a")
        engine.add_request([4, 5, 6], params, request_id="b")
        for _ in range(4):
            engine.step()
        rows = []
        launch = engine.runner.decode_runner.launch
        engine.runner.decode_runner.launch = lambda batch, *args, **kwargs: rows.append(len(batch)) or launch(
            batch, *args, **kwargs)
        assert engine.abort_request("a")
        finished = _run(engine)
        assert finished["a"].finish_reason == "abort" and finished["b"].finish_reason == "length"
        assert rows and max(rows) == 1  # every decode after the abort is b's alone


def test_a_stream_left_early_aborts_its_requests_and_streams_sharing_an_llm_each_get_theirs():
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _llm(max_num_seqs=4) as llm:
        expected = [out.token_ids for out in llm.generate([[1, 2, 3], [7, 8, 9]], long)]
        for index, out in llm.generate_stream([[1, 2, 3], [4, 5]], long):
            break
        assert not llm.engine.has_unfinished_requests()
        # Two streams read in turn, and a generate call between them: each sees all of its own tokens.
        first, second = llm.generate_stream([[1, 2, 3]], long), llm.generate_stream([[7, 8, 9]], long)
        seen = {0: next(first)[1], 1: next(second)[1]}
        [between] = llm.generate([[7, 8, 9]], long)
        for index, stream in enumerate((first, second)):
            for _, out in stream:
                seen[index] = out
        assert [seen[0].token_ids, seen[1].token_ids] == expected and between.token_ids == expected[1]
        assert not llm.engine.has_unfinished_requests()
