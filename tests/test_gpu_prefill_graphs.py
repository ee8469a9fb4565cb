"""Prompt graphs on CUDA (``graphrt.capture.prefill_graphs``): an engine whose prompt steps replay them
gives the tokens of one whose prompts run eagerly (float32, greedy and seeded; whole prompts, chunks,
cached prefixes); a replay equals the eager forward of the same padded inputs bit for bit, stays close
to the unpadded eager forward, and writes no cache slot but its tokens'."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from graphrt import LLM, SamplingParams  # noqa: E402

PROMPTS = [[(29 * i + 7 * n) % 6000 + 3 for i in range(n)] for n in (1, 15, 16, 17, 45, 130, 301)]
OPTIONS = dict(max_model_len=512, max_num_seqs=8, loader_options={"init_std": 0.05}, progress=False)
WHOLE = dict(enable_chunked_prefill=False, enable_prefix_caching=False)  # chunks and caching are the defaults


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("case", [WHOLE, dict(max_num_batched_tokens=37, enable_prefix_caching=False),
                                  dict(max_num_batched_tokens=64)], ids=["whole", "chunks37", "chunks64-cached"])
def test_prompt_graphs_give_the_tokens_of_eager_prompts(sampling, case):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=3, max_tokens=20, ignore_eos=True)
    with LLM("random:smollm2-135m", dtype="float32", prefill_graph_tokens=0, **OPTIONS, **case) as llm:
        assert llm.engine.prefill_graphs is None
        eager = [out.token_ids for out in llm.generate(PROMPTS, params)]
    with LLM("random:smollm2-135m", dtype="float32", **OPTIONS, **case) as llm:
        graphs = llm.engine.prefill_graphs
        assert graphs is not None and graphs.stats.capture_error is None and graphs.stats.num_graphs > 1
        replayed = [out.token_ids for out in llm.generate(PROMPTS, params)]
        again = [out.token_ids for out in llm.generate(PROMPTS, params)]  # cached prefixes where enabled
        assert sum(graphs.stats.replays_per_bucket.values()) > 0
    assert replayed == eager and again == eager


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_step_of_more_prompts_than_a_graph_holds_replays_several(sampling):
    """40 prompts in one step, 16 a graph: three replays, the tokens of eager prompts."""
    prompts = [[(13 * i + 5 * n) % 6000 + 3 for i in range(3 + n % 7)] for n in range(40)]
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=5, max_tokens=6, ignore_eos=True)
    options = {**OPTIONS, "max_num_seqs": 64}
    with LLM("random:smollm2-135m", dtype="float32", prefill_graph_tokens=0, **options) as llm:
        eager = [out.token_ids for out in llm.generate(prompts, params)]
    with LLM("random:smollm2-135m", dtype="float32", **options) as llm:
        graphs = llm.engine.prefill_graphs
        replayed = [out.token_ids for out in llm.generate(prompts, params)]
        assert sum(graphs.stats.replays_per_bucket.values()) >= 3  # 16 + 16 + 8 sequences in one step
    assert replayed == eager


@pytest.mark.parametrize("case", [WHOLE, dict(max_num_batched_tokens=64, mixed_step_tokens=0)],
                         ids=["whole", "chunks64"])
def test_enforce_eager_runs_the_prompt_graphs_forward_and_gives_their_tokens_bf16(case):
    """Eager prompt steps run the bucket's padded forward, so bfloat16 tokens match the graphs' exactly (the
    unpadded eager forward rounds differently: other GEMM shapes, xFormers attention). The chunked case
    keeps mixed steps off, so that its chunks beside decodes run prompt graphs too (mixed steps' eager
    forward against their graphs: tests/test_gpu_mixed_steps.py)."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        with LLM("random:smollm2-135m", dtype="bfloat16", enforce_eager=eager, **OPTIONS, **case) as llm:
            graphs = llm.engine.prefill_graphs
            assert graphs.eager == eager and graphs.ready and (graphs.stats.num_graphs == 0) == eager
            tokens[eager] = [out.token_ids for out in llm.generate(PROMPTS, params)]
            assert graphs.stats.padded_tokens > 0
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replay_equals_the_eager_forward_of_its_bucket_and_writes_only_its_slots(dtype):
    with LLM("random:smollm2-135m", dtype=dtype, num_kv_blocks=64, **OPTIONS) as llm:  # a cache small to clone
        engine = llm.engine
        graphs, runner, block_size = engine.prefill_graphs, engine.runner, engine.config.block_size
        vocab = engine.model_config.vocab_size
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (45,), generator=generator).tolist()
        table = [5, 2, 7]  # free blocks (the engine holds no request), out of order on purpose
        slots = [table[p // block_size] * block_size + p % block_size for p in range(45)]
        # The first 20 tokens as a prompt (context 0), through the graphs.
        graphs.run(ids[:20], list(range(20)), slots[:20], [20], [20], [table[:2]])
        # An unused block and the table's slots past the chunk poisoned: the replay must leave every slot
        # but its 25 as it found them.
        for cache in runner.kv_caches:
            blocks = cache.view(2, cache.shape[1], block_size, -1)
            blocks[:, 9].fill_(float("nan"))
            blocks[:, 7, 45 % block_size:].fill_(float("nan"))
        before = [cache.clone() for cache in runner.kv_caches]
        chunk = (ids[20:], list(range(20, 45)), slots[20:], [25], [45], [table])
        replayed = graphs.run(*chunk).clone()
        assert torch.isfinite(replayed).all()
        written = torch.zeros(before[0].shape[1], block_size, dtype=torch.bool, device=replayed.device)
        for slot in slots[20:]:
            written[slot // block_size, slot % block_size] = True
        for cache, old in zip(runner.kv_caches, before):
            kept = ~written[None, :, :, None].expand(2, -1, -1, cache.shape[-1] // block_size)
            now, then = cache.view(kept.shape)[kept], old.view(kept.shape)[kept]
            assert torch.equal(now.nan_to_num(7.0), then.nan_to_num(7.0))
        # The eager forward of the same staged (padded) inputs: the same kernels at the same shapes.
        bucket = graphs.bucket(25)
        graphs.stage(*chunk, bucket)
        with torch.inference_mode():
            eager_padded = graphs._forward(bucket)[:25]
            eager, _ = runner._prefill_eagerly(*chunk)
        assert torch.equal(replayed, eager_padded)
        error = (replayed.float() - eager.float()).norm() / eager.float().norm()
        assert error < (1e-5 if dtype == "float32" else 2e-2), error.item()
