"""Swap preemption on the CPU (float32, random checkpoints): with too few KV blocks for every sequence,
swapping preempted sequences' blocks out to host memory and back gives the output recomputation gives,
greedy and seeded, across block boundaries, with chunked prefill, prefix caching and speculation; a
swapped sequence resumes without a second prefill; a pool too small for a sequence falls back to
recomputing it; bad sizes are refused."""

from __future__ import annotations

import pytest

import torch

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.cli import build_parser
from graphrt.kv_cache import bytes_per_block
from graphrt.loader import open_checkpoint

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33)]
BLOCK_BYTES = bytes_per_block(open_checkpoint("random:tiny").config, 4, torch.float32)


def _llm(**options) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_model_len=96, max_num_seqs=4, num_kv_blocks=22,
                    block_size=4, loader_options={"init_std": 0.2}, progress=False)
    return LLM("random:tiny", **{**defaults, **options})


def _run(params: SamplingParams, **options) -> tuple[list[list[int]], int, int, int]:
    """Tokens, preemptions, blocks swapped out, prompt tokens prefilled."""
    with _llm(**options) as llm:
        engine, swapped, prefilled = llm.engine, [0], [0]
        if engine.swap_space is not None:
            copy = engine.swap_space.copy
            engine.swap_space.copy = lambda caches, into, out: swapped.__setitem__(0, swapped[0] + len(out)) or copy(
                caches, into, out)
        prefill = engine.runner._prefill
        engine.runner._prefill = lambda seqs, lengths=None: prefilled.__setitem__(0, prefilled[0] + sum(
            (s.num_tokens - s.num_computed_tokens) if lengths is None else n
            for s, n in zip(seqs, lengths or seqs))) or prefill(seqs, lengths)
        outs = llm.generate(PROMPTS, params)
        if engine.swap_space is not None:
            assert engine.swap_space.allocator.num_free_blocks == engine.swap_space.allocator.num_usable_blocks
    return [out.token_ids for out in outs], sum(out.num_preemptions for out in outs), swapped[0], prefilled[0]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_swapping_gives_the_output_recomputation_gives(sampling):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=3, max_tokens=30, ignore_eos=True)
    recomputed, preemptions, _, recomputed_prefill = _run(params)
    swapped, swap_preemptions, blocks_out, swapped_prefill = _run(params, swap_space_bytes=64 * BLOCK_BYTES)
    assert preemptions > 0 and swap_preemptions > 0 and blocks_out > 0
    assert swapped == recomputed
    assert swapped_prefill == sum(len(p) for p in PROMPTS) < recomputed_prefill  # no second prefill


def test_swapping_with_chunks_prefix_caching_speculation_and_a_small_pool():
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    # The baseline recomputes whole, uncached prompts; each case swaps with one feature (or the defaults' two).
    recomputed = _run(params, enable_chunked_prefill=False, enable_prefix_caching=False)[0]
    for options in (dict(enable_prefix_caching=False, max_num_batched_tokens=9),
                    dict(enable_chunked_prefill=False), dict(max_num_batched_tokens=9),
                    dict(speculative="ngram:3"), dict(async_decode=True)):
        tokens, _, blocks_out, _ = _run(params, swap_space_bytes=64 * BLOCK_BYTES, **options)
        assert tokens == recomputed and blocks_out > 0, options
    tokens, preemptions, blocks_out, _ = _run(params, swap_space_bytes=3 * BLOCK_BYTES)  # 2 usable host blocks
    assert tokens == recomputed and preemptions > 0 and blocks_out == 0  # no sequence fits: recomputed


def test_bad_swap_sizes_are_refused():
    with pytest.raises(ConfigError, match="swap_space_bytes must be an integer >= 0"):
        EngineConfig(swap_space_bytes=-1)
    with pytest.raises(ConfigError, match="needs at least 2"):
        _llm(swap_space_bytes=BLOCK_BYTES)
    assert build_parser().parse_args(["generate", "--swap-space-mib", "64"]).swap_space_mib == 64


def test_an_interrupted_swap_is_recomputed_and_close_releases_the_pool():
    """A copy that fails (an interrupt while blocks move): the sequences it was moving are recomputed,
    and the output is still the plain one."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    recomputed = _run(params)[0]
    with _llm(swap_space_bytes=64 * BLOCK_BYTES) as llm:
        engine = llm.engine
        copy, failed = engine.swap_space.copy, []

        def fail_once(caches, into, out):
            if (into or out) and not failed:
                failed.append(True)
                raise KeyboardInterrupt
            copy(caches, into, out)
        engine.swap_space.copy = fail_once
        ids = [engine.add_request(prompt, params, request_id=str(i)) for i, prompt in enumerate(PROMPTS)]
        finished = {}
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except KeyboardInterrupt:
                continue
            finished.update((out.request_id, out.token_ids) for out in outs if out.finished)
        assert failed and [finished[str(i)] for i in range(len(ids))] == recomputed
        assert engine.swap_space.allocator.num_free_blocks == engine.swap_space.allocator.num_usable_blocks
    assert engine.swap_space is None and engine.scheduler.swap is None
