"""On a CUDA device: every bucket's replay equals the eager decode bitwise (tokens and logits), padding
rows full of garbage change nothing real, seeded sampling is the same in graph and eager mode, and the
engine's outputs with graphs equal its outputs with ``enforce_eager`` as requests finish and join."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.attention.graph_state import PAD_SLOT
from graphrt.capture import SAMPLING_MODES, DecodeBatch, DecodeGraphRunner, GraphKey

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_SEQS = 32
# A fixed cache: engines of earlier tests still hold theirs, and a memory fraction would see that.
TINY = dict(model="random:tiny", device="cuda", progress=False, max_num_seqs=MAX_SEQS, max_model_len=256,
            num_kv_blocks=4096, loader_options={"init_std": 0.5})


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request):
    """(llm, a logits-returning graph runner over the llm's model and cache)."""
    llm = LLM(**TINY, dtype=request.param)
    engine = llm.engine
    runner = DecodeGraphRunner(
        engine.model, engine.runner.kv_caches, engine.attention_backend, block_size=16, max_seq_len=256,
        max_batch_size=MAX_SEQS, return_logits=True, device=engine.device,
    )
    stats = runner.capture(progress=False)
    assert runner.uses_graphs and stats.num_graphs == len(SAMPLING_MODES) * len(runner.capture_sizes)
    return llm, runner


def _random_rows(llm, count: int, generator: torch.Generator, sampled: bool | str) -> DecodeBatch:
    """Rows with random contexts across block boundaries over freshly allocated blocks whose cache
    content is random (as if earlier steps had written it)."""
    bm = llm.engine.block_manager
    lengths = torch.randint(1, 200, (count,), generator=generator).tolist()
    base = 10_000 + int(torch.randint(0, 10**6, (1,), generator=generator))
    for i, n in enumerate(lengths):
        bm.allocate(base + i, n)
    rows = [base + i for i in range(count)]
    for kv in llm.engine.runner.kv_caches:
        for sid in rows:
            blocks = torch.tensor(bm.block_table(sid), device=kv.device)
            kv[:, blocks] = torch.randn(kv[:, blocks].shape, generator=None, device=kv.device).to(kv.dtype)
    # sampled: True = top-k/top-p rows ("sample" graphs); "temperature" = temperature-only rows.
    drawn = SamplingParams(temperature=0.8) if sampled == "temperature" else SamplingParams(temperature=0.8, top_k=40,
                                                                                             top_p=0.9)
    params = [drawn if sampled and i % 2 == 0 else SamplingParams(temperature=0.0) for i in range(count)]
    batch = DecodeBatch(
        input_ids=torch.randint(0, 512, (count,), generator=generator).tolist(),
        positions=[n - 1 for n in lengths],
        block_tables=[bm.block_table(s) for s in rows],
        slot_mapping=[bm.slot(s, n - 1) for s, n in zip(rows, lengths)],
        params=params,
        seeds=torch.randint(0, 2**62, (count,), generator=generator).tolist(),
        steps=torch.randint(0, 50, (count,), generator=generator).tolist(),
    )
    batch.row_ids = rows  # for freeing afterwards
    return batch


def _free(llm, batch):
    for sid in batch.row_ids:
        llm.engine.block_manager.free(sid)


@pytest.mark.parametrize("sampled", [False, "temperature", True], ids=["greedy", "seeded-temperature", "seeded-top-p"])
def test_every_bucket_replays_exactly_like_eager(setup, sampled):
    llm, runner = setup
    generator = torch.Generator().manual_seed(3)
    previous = 0
    for bucket in runner.capture_sizes:
        sizes, previous = sorted({bucket, previous + 1}), bucket  # a full bucket, the most padded one
        for size in sizes:
            batch = _random_rows(llm, size, generator, sampled)
            eager_tokens = runner.eager_decode(batch)
            eager_logits = runner.last_logits(size).clone()
            replays = runner.stats.replays_per_bucket[bucket]
            graph_tokens = runner.decode(batch)
            assert runner.stats.replays_per_bucket[bucket] == replays + 1
            assert graph_tokens == eager_tokens, f"bucket {bucket}, batch {size}"
            assert torch.equal(runner.last_logits(size), eager_logits), f"bucket {bucket}, batch {size}"
            _free(llm, batch)


def _first_rows(batch: DecodeBatch, count: int) -> DecodeBatch:
    """The decode of ``batch``'s first ``count`` rows alone."""
    return DecodeBatch(**{f.name: getattr(batch, f.name)[:count] if isinstance(getattr(batch, f.name), list)
                          else getattr(batch, f.name) for f in dataclasses.fields(batch)})


def test_garbage_in_padding_rows_changes_nothing_real(setup):
    """Rows past the real batch may hold anything: what a larger batch left in the static buffers (its
    slots, lengths and block tables over live sequences' blocks) before the refresh, and after it any
    token, position, sampling row, length and block table. The replay's real tokens, logits and cache
    blocks are those of a runner whose padding rows were never used."""
    llm, runner = setup
    engine = llm.engine
    caches = engine.runner.kv_caches
    generator = torch.Generator().manual_seed(4)
    larger = _random_rows(llm, 8, generator, sampled=True)  # 8 live sequences
    batch = _first_rows(larger, 5)  # bucket 8: three padding rows
    kv_before = [kv.clone() for kv in caches]
    # Same buckets and captured context, hence the same kernels and launches; its padding rows were never used.
    fresh = DecodeGraphRunner(engine.model, caches, engine.attention_backend, block_size=16, max_seq_len=256,
                              max_batch_size=MAX_SEQS, return_logits=True, enforce_eager=True, device=engine.device)
    clean_tokens = fresh.eager_decode(batch)
    clean_logits = fresh.last_logits(5).clone()
    kv_clean = [kv.clone() for kv in caches]
    for kv, original in zip(caches, kv_before):
        kv.copy_(original)
    runner.decode(larger)  # a replay of bucket 8 over 8 live rows: the static buffers hold their rows
    for kv, original in zip(caches, kv_before):
        kv.copy_(original)
    runner.prepare(batch, runner.plan(batch))
    state = runner.graph_state
    assert state.slot_mapping[5:8].tolist() == [PAD_SLOT] * 3, "a larger batch's slot was left in a padding row"
    runner.inputs.input_ids[5:8] = torch.randint(0, 512, (3,), device="cuda")
    runner.inputs.positions[5:8] = torch.randint(0, 250, (3,), device="cuda")
    runner.sampling.temperature[5:8] = 5.0
    runner.sampling.top_k[5:8] = 3
    runner.sampling.top_p[5:8] = 0.5
    runner.sampling.seeds[5:8] = torch.randint(0, 2**62, (3,), device="cuda")
    # Padding rows may read whatever their lengths and tables say (here the larger batch's rows, over live
    # blocks); their slots stay the refresh's, so what they write goes to the null block.
    state.seq_lens[5:8] = torch.tensor(larger.seq_lens[5:8], dtype=state.seq_lens.dtype)
    state.seq_start_loc[1:9] = torch.cumsum(state.seq_lens[:8], 0)
    for row, table in enumerate(larger.block_tables[5:8], start=5):
        state.block_tables[row, : len(table)] = torch.tensor(table, dtype=state.block_tables.dtype)
    runner.graphs[GraphKey(8, "sample")].replay()
    assert runner.next_tokens[:5].tolist() == clean_tokens
    assert torch.equal(runner.last_logits(5), clean_logits)
    for layer, (kv, expected) in enumerate(zip(caches, kv_clean)):  # every block but the null block
        changed = ((kv[:, 1:] != expected[:, 1:]).flatten(2).any(-1).any(0).nonzero().flatten() + 1).tolist()
        assert not changed, f"layer {layer}: blocks {changed} changed"
    _free(llm, larger)


def test_engine_with_graphs_equals_enforce_eager_as_requests_come_and_go():
    """Requests arrive over time with different lengths and max_tokens; graph and eager engines
    (same seeded random weights) produce the same tokens, greedy and seeded-sampled."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 60, (20,), generator=generator)]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.9, top_p=0.95, seed=i, ignore_eos=True,
                             max_tokens=int(5 + (i * 7) % 30)) for i in range(len(prompts))]

    graph_out, graph_stats = _run_arrivals(prompts, params, enforce_eager=False)
    eager_out, _ = _run_arrivals(prompts, params, enforce_eager=True)
    assert graph_stats.replays_per_bucket and not graph_stats.eager_steps
    assert graph_out == eager_out


def _run_arrivals(prompts, params, dtype="float32", **options):
    """Adds three requests between steps until all are in; returns ({request id: tokens}, stats)."""
    llm = LLM(**TINY, dtype=dtype, **options)
    engine, done = llm.engine, {}
    pending = list(enumerate(zip(prompts, params)))
    while pending or engine.has_unfinished_requests():
        for _ in range(3):  # a few arrivals between steps
            if pending:
                i, (prompt, p) = pending.pop(0)
                engine.add_request(prompt, p, request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return done, engine.decode_runner.stats


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pipelined_decode_equals_synchronous(dtype):
    """Decode steps queued before the previous step's tokens are read (``async_decode``, input ids fed
    back on the device) give the synchronous engine's tokens: arrivals, max_tokens, greedy and seeded
    sampling, through replayed graphs; in float32 also stop tokens seen a step late (their extra step
    decodes the other rows in a larger batch, which in bf16 may resolve a near-tie differently)."""
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 60, (12,), generator=generator)]
    free = [SamplingParams(temperature=0.0 if i % 3 else 0.9, top_p=0.95, seed=i, ignore_eos=True,
                           max_tokens=int(8 + (i * 5) % 40)) for i in range(len(prompts))]
    reference, _ = _run_arrivals(prompts, free, dtype, async_decode=False)
    stops = dtype == "float32"  # every other request stops on a token it generates a few steps in
    params = [SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=p.seed, ignore_eos=True,
                             max_tokens=p.max_tokens,
                             stop_token_ids=[reference[str(i)][3]] if stops and i % 2 else [])
              for i, p in enumerate(free)]
    synchronous, _ = _run_arrivals(prompts, params, dtype, async_decode=False)
    pipelined, stats = _run_arrivals(prompts, params, dtype, async_decode=True)
    assert stats.replays_per_bucket and not stats.eager_steps
    assert pipelined == synchronous
    if stops:
        assert any(len(synchronous[str(i)]) < len(reference[str(i)]) for i in range(1, len(prompts), 2))


def test_pipelined_steps_at_model_shapes_equal_synchronous():
    """SmolLM2-shaped layers (batch 1 on the GEMV kernels, batch 4 on cuBLAS, dependent launches):
    64 greedy tokens pipelined equal 64 synchronous ones."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400], [42]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for batch in ([prompts[0]], prompts):
        outputs = []
        for async_decode in (False, True):
            llm = LLM(model="random:smollm2-135m", device="cuda", dtype="bfloat16", progress=False,
                      max_num_seqs=4, max_model_len=256, num_kv_blocks=128, async_decode=async_decode)
            outputs.append([o.token_ids for o in llm.generate(batch, params)])
            del llm
        assert outputs[0] == outputs[1]


def test_a_fresh_process_captures_every_bucket():
    """In a new process nothing has launched the kernels yet: each bucket's first forward (batch 1's
    GEMV layers, another attention split count) must run in the warm-up, because a Triton kernel's
    first launch loads its module, which CUDA refuses inside a capture; a failure there would leave
    the engine decoding eagerly with one warning."""
    import json
    import subprocess
    import sys

    script = (
        "import json; from graphrt import LLM; "
        "llm = LLM(model='random:llama-3.2-1b', device='cuda', dtype='bfloat16', progress=False, "
        "max_num_seqs=16, max_model_len=512, num_kv_blocks=512); "
        "runner = llm.engine.decode_runner; "
        "print(json.dumps({'stats': runner.stats.as_dict(), 'sizes': list(runner.capture_sizes), "
        "'mixed': list(runner.mixed_buckets)}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stats"]["capture_error"] is None
    # A graph per sampling mode and batch size, and a mixed one (prompt tokens beside the decode rows) per
    # prompt bucket and batch size.
    mixed = len(result["mixed"]) * len(result["sizes"])
    assert mixed > 0 and result["stats"]["num_mixed_graphs"] == mixed
    assert result["stats"]["num_graphs"] == len(SAMPLING_MODES) * len(result["sizes"]) + mixed
