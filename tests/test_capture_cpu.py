"""The decode graph runner's host-side logic on CPU: buckets, static-buffer refresh and padding, and
every eager-fallback reason. (Replays themselves are checked on the GPU in test_gpu_graphs.py.)"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.attention import ReferenceAttentionBackend
from graphrt.attention.graph_state import NULL_BLOCK, PAD_SEQ_LEN, PAD_SLOT, DecodeGraphState
from graphrt.capture import (
    DecodeBatch,
    DecodeGraphRunner,
    DecodePlan,
    EagerReason,
    GraphCheck,
    GraphKey,
    choose_bucket,
    default_capture_sizes,
)
from graphrt.capture.decode_inputs import DecodeInputs

TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False, loader_options={"init_std": 0.5})


def test_default_capture_sizes():
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert default_capture_sizes(10) == [1, 2, 4, 8, 10]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(512)[-1] == 256


@pytest.mark.parametrize(("batch", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (250, 256), (257, None)])
def test_choose_bucket_pads_to_smallest_that_holds(batch, bucket):
    assert choose_bucket(default_capture_sizes(256), batch) == bucket


def test_refresh_writes_real_rows_and_inert_padding():
    state = DecodeGraphState.allocate(max_batch_size=8, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    # Garbage everywhere first: a refresh must overwrite every row up to the padded size.
    for tensor in (state.seq_lens, state.slot_mapping, state.block_tables):
        tensor.fill_(777)
    state.refresh(seq_lens=[5, 17, 33], block_tables=[[3], [4, 9], [1, 2, 6]], slot_mapping=[52, 144, 96],
                  padded_batch_size=4)
    assert state.seq_lens[:4].tolist() == [5, 17, 33, PAD_SEQ_LEN]
    assert state.slot_mapping[:4].tolist() == [52, 144, 96, PAD_SLOT]
    assert state.block_tables[:4].tolist() == [
        [3, 0, 0, 0], [4, 9, 0, 0], [1, 2, 6, 0], [NULL_BLOCK] * 4,
    ]
    assert state.seq_start_loc[:5].tolist() == [0, 5, 22, 55, 56]
    # One copy of the bytes in use: block tables come last, so rows past the padded size are not copied.
    assert state.block_tables[4:].flatten().tolist() == [777] * 16
    metadata = state.metadata(4)
    assert metadata.seq_lens is None and metadata.max_decode_seq_len == 64
    assert metadata.block_tables.data_ptr() == state.block_tables.data_ptr()  # views, not copies


def test_decode_inputs_refresh_writes_real_rows_and_zero_padding():
    """The runner's token inputs: ids and positions of the real rows, zeros in padding rows, nothing
    past the padded size; refused shapes copy nothing."""
    inputs = DecodeInputs.allocate(8, torch.device("cpu"))
    for tensor in (inputs.input_ids, inputs.positions):
        tensor.fill_(777)
    inputs.refresh([11, 12, 13], [4, 16, 32], padded_batch_size=4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [4, 16, 32, 0]
    assert inputs.positions[4:].tolist() == [777] * 4
    with pytest.raises(ValueError, match="does not fit"):
        inputs.refresh([1] * 9, list(range(9)), padded_batch_size=9)
    with pytest.raises(ValueError, match="carry_rows needs keep_input_ids"):
        inputs.refresh([1], [2], 1, carry_rows=[0])
    with pytest.raises(ValueError, match="2 input ids for 1 positions"):
        inputs.refresh([1, 2], [5], 1)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]


def test_refresh_with_table_versions_restages_exactly_the_changed_rows():
    """Steps where rows keep, grow, swap or drop their tables, with versions as BlockManager hands
    them out: the device tables always equal a full restage's, while unchanged rows are skipped."""
    import random

    rng = random.Random(0)
    state = DecodeGraphState.allocate(max_batch_size=8, max_seq_len=128, block_size=16, device=torch.device("cpu"))
    next_version = iter(range(1, 10**6))
    tables = {sid: ([rng.randrange(1, 500) for _ in range(rng.randrange(1, 8))], next(next_version))
              for sid in range(12)}
    for _ in range(60):
        rows = rng.sample(sorted(tables), rng.randrange(1, 9))
        for sid in rows:
            if rng.random() < 0.3:  # the table changes (grow, copy-on-write): a new version
                table = tables[sid][0][:-1] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 3))]
                tables[sid] = (table[:8], next(next_version))
        padded = choose_bucket([1, 2, 4, 8], len(rows))
        block_tables = [tables[sid][0] for sid in rows]
        state.refresh([16 * len(t) for t in block_tables], block_tables, [16] * len(rows), padded,
                      block_table_versions=[tables[sid][1] for sid in rows])
        expected = [t + [NULL_BLOCK] * (8 - len(t)) for t in block_tables] + [[NULL_BLOCK] * 8] * (padded - len(rows))
        assert state.block_tables[:padded].tolist() == expected


def test_static_sampling_refresh_equals_from_params():
    from graphrt.capture.static_sampling import StaticSampling
    from graphrt.sampling.sampler import SamplingTensors

    static = StaticSampling(6, torch.device("cpu"))
    storage = static.packed.device_buffer.data_ptr()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9)]
    seeds, steps = [3, 2**62 + 5, 0, 17], [0, 4, 9, 2**40]
    static.refresh(params, seeds, steps)
    expected = SamplingTensors.from_params(params, seeds, steps, "cpu")
    for name in ("temperature", "top_k", "top_p", "seeds", "steps"):
        assert torch.equal(getattr(static.tensors, name)[:4], getattr(expected, name)), name
    assert (static.tensors.all_greedy, static.tensors.needs_top_k_top_p) == (False, True)
    assert static.packed.device_buffer.data_ptr() == storage  # a captured graph keeps reading the same memory
    staged = static.packed.staging.clone()
    with pytest.raises(ValueError, match="seed"):
        static.refresh([SamplingParams(temperature=0.5)], [-1], [0])
    assert torch.equal(static.packed.staging, staged)  # a rejected batch writes nothing, not even the staging


def test_refresh_skips_rows_whose_version_is_staged_and_never_trusts_a_failed_row():
    state = DecodeGraphState.allocate(max_batch_size=4, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    state.refresh([20, 40], [[3, 4], [5, 6, 7]], [16, 32], 2, block_table_versions=[10, 11])
    # Mark the staging row of version 10: an unchanged version must not be converted again, so the
    # mark reaches the device (what a real caller never does; it shows the skip happens).
    state.packed.host["block_tables"][0, 3] = 99
    state.refresh([20, 40], [[3, 4], [5, 6, 7]], [16, 32], 2, block_table_versions=[10, 12])
    assert state.block_tables[:2].tolist() == [[3, 4, 0, 99], [5, 6, 7, 0]]
    with pytest.raises(OverflowError):  # a block id beyond int32 fails half-way through row 0
        state.refresh([20], [[3, 2**40]], [16], 1, block_table_versions=[13])
    state.refresh([20], [[3, 4]], [16], 1, block_table_versions=[13])  # the failed row is restaged
    assert state.block_tables[:1].tolist() == [[3, 4, 0, 0]]
    with pytest.raises(ValueError, match=">= 0"):
        state.refresh([20], [[3, 4]], [16], 1, block_table_versions=[-2])


def test_decode_batch_checks_versions():
    rows = dict(input_ids=[1], positions=[0], block_tables=[[1]], slot_mapping=[16], params=[SamplingParams()],
                seeds=[0], steps=[0])
    with pytest.raises(ValueError, match="block_table_versions"):
        DecodeBatch(**rows, block_table_versions=[1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        DecodeBatch(**rows, block_table_versions=[-1])


def test_refresh_rejects_rows_beyond_captured_context():
    state = DecodeGraphState.allocate(4, 32, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="captured maximum context allows 2"):
        state.refresh([40], [[1, 2, 3]], [5], 1)


@pytest.fixture
def llm():
    return LLM(**TINY, max_num_seqs=8, max_model_len=128)


def _decode_batch(llm, count: int, seed: int = 0, context=20) -> DecodeBatch:
    """Prefill ``count`` random prompts through the engine, then describe their next decode step."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):
        n = context + i
        rid = engine.add_request(torch.randint(3, 500, (n,), generator=generator).tolist(),
                                 SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        seqs.append(engine._requests[rid])
    scheduled = engine.scheduler.schedule()
    tokens, _ = engine.runner.execute(scheduled.prefills, scheduled.decodes)
    for seq, token in zip(scheduled.prefills, tokens):
        seq.append_token(token, engine.max_model_len)
    for seq in seqs:  # make room for the decode
        engine.block_manager.grow(seq.seq_id, seq.num_tokens)
    return engine.runner._decode_batch(seqs)


def _runner(llm, **overrides) -> DecodeGraphRunner:
    engine = llm.engine
    options = dict(block_size=16, max_seq_len=128, max_batch_size=8, device=torch.device("cpu"))
    options.update(overrides)
    return DecodeGraphRunner(engine.model, engine.runner.kv_caches, ReferenceAttentionBackend, **options)


def _kv_snapshot(llm):
    return [c.clone() for c in llm.engine.runner.kv_caches]


def test_no_cuda_runs_eager_through_static_buffers(llm):
    runner = _runner(llm)
    batch = _decode_batch(llm, 3)
    reference = runner._decode_unbuffered(batch)[0].tolist()  # per-step tensors, no static buffers
    assert runner.decode(batch) == reference
    assert runner.stats.eager_steps == {EagerReason.NO_CUDA: 1}
    assert not runner.stats.replays_per_bucket


def test_enforce_eager_is_a_reason(llm):
    runner = _runner(llm, enforce_eager=True, capture_sizes=[1])
    runner.decode(_decode_batch(llm, 1, seed=1))
    batch = _decode_batch(llm, 2, seed=6)  # larger than every bucket: still counted as enforce_eager
    assert runner.decode(batch) == runner._decode_unbuffered(batch)[0].tolist()
    assert runner.stats.eager_steps == {EagerReason.ENFORCE_EAGER: 2}


def test_empty_batch_decodes_nothing(llm):
    runner = _runner(llm)
    empty = DecodeBatch(input_ids=[], positions=[], block_tables=[], slot_mapping=[], params=[], seeds=[], steps=[])
    assert runner.decode(empty) == []


def test_batch_too_large_falls_back(llm):
    runner = _runner(llm, capture_sizes=[1, 2])
    runner.eager_reason = None  # as if graphs had been captured: the batch is what forces eager
    batch = _decode_batch(llm, 3, seed=2)
    assert runner.decode(batch) == runner._decode_unbuffered(batch)[0].tolist()
    assert runner.stats.eager_steps[EagerReason.BATCH_TOO_LARGE] == 1


def test_context_too_long_falls_back(llm):
    runner = _runner(llm, max_seq_len=16)
    runner.eager_reason = None  # as if graphs had been captured: the context is what forces eager
    batch = _decode_batch(llm, 2, seed=3, context=20)
    assert runner.decode(batch) == runner._decode_unbuffered(batch)[0].tolist()
    assert runner.stats.eager_steps[EagerReason.CONTEXT_TOO_LONG] == 1


def test_failed_capture_warns_once_and_stays_eager(llm, caplog):
    runner = _runner(llm)
    runner.eager_reason = None  # pretend graphs were possible: capturing on CPU then fails
    with caplog.at_level(logging.WARNING):
        runner.capture(progress=False)
    assert runner.eager_reason == EagerReason.CAPTURE_FAILED
    assert runner.stats.capture_error
    assert len([r for r in caplog.records if "capture failed" in r.message]) == 1
    runner.decode(_decode_batch(llm, 1, seed=4))
    assert runner.stats.eager_steps == {EagerReason.CAPTURE_FAILED: 1}


def _first_rows(batch: DecodeBatch, count: int) -> DecodeBatch:
    """The decode of ``batch``'s first ``count`` rows alone."""
    return DecodeBatch(**{f.name: getattr(batch, f.name)[:count] if isinstance(getattr(batch, f.name), list)
                          else getattr(batch, f.name) for f in dataclasses.fields(batch)})


def test_padding_rows_with_garbage_change_nothing_real(llm):
    """Rows past the real batch may hold anything: what a larger batch left in the static buffers (its
    slots, lengths and block tables over live sequences' blocks) before the refresh, and after it any
    token, position, temperature, length and block table. Real tokens, logits and cache blocks stay what
    a runner whose padding rows were never used gives."""
    larger = _decode_batch(llm, 8, seed=5, context=9)  # 8 live sequences (one prefill); the first 3 decode alone
    batch = _first_rows(larger, 3)
    caches = llm.engine.runner.kv_caches
    before = _kv_snapshot(llm)
    fresh = _runner(llm, return_logits=True, capture_sizes=[8])  # its padding rows were never used
    clean_tokens = fresh.eager_decode(batch)
    clean_logits = fresh.last_logits(3).clone()
    after_clean = _kv_snapshot(llm)
    for kv, original in zip(caches, before):  # undo the real rows' cache writes
        kv.copy_(original)

    runner = _runner(llm, return_logits=True, capture_sizes=[8])
    runner.eager_decode(larger)  # the static buffers now hold 8 live rows' slots, lengths and tables
    for kv, original in zip(caches, before):
        kv.copy_(original)
    runner.prepare(batch, DecodePlan(3, GraphKey(8, "greedy"), EagerReason.ENFORCE_EAGER, True))
    state = runner.graph_state
    assert state.slot_mapping[3:8].tolist() == [PAD_SLOT] * 5, "a larger batch's slot was left in a padding row"
    garbage = torch.Generator().manual_seed(9)
    runner.inputs.input_ids[3:8] = torch.randint(0, 512, (5,), generator=garbage)
    runner.inputs.positions[3:8] = torch.randint(0, 128, (5,), generator=garbage)
    runner.sampling.temperature[3:8] = 3.0
    # Padding rows may read whatever their lengths and tables say (here the larger batch's rows, over live
    # blocks); their slots stay the refresh's, so what they write goes to the null block.
    state.seq_lens[3:8] = torch.tensor(larger.seq_lens[3:8], dtype=state.seq_lens.dtype)
    state.seq_start_loc[1:9] = torch.cumsum(state.seq_lens[:8], 0)
    for row, table in enumerate(larger.block_tables[3:8], start=3):
        state.block_tables[row, : len(table)] = torch.tensor(table, dtype=state.block_tables.dtype)
    runner._forward(GraphKey(8, "greedy"))
    assert runner.next_tokens[:3].tolist() == clean_tokens
    assert torch.equal(runner.last_logits(3), clean_logits)
    for layer, (kv, expected) in enumerate(zip(caches, after_clean)):  # every block but the null block
        changed = ((kv[:, 1:] != expected[:, 1:]).any(-1).any(0).nonzero().flatten() + 1).tolist()
        assert not changed, f"layer {layer}: blocks {changed} changed"


def _rows(rows: int, longest: int, params=None) -> DecodeBatch:
    """A decode batch of ``rows`` rows whose longest holds ``longest`` keys (shapes only)."""
    lens = [max(1, longest - r) for r in range(rows)]
    return DecodeBatch(input_ids=[1] * rows, positions=[n - 1 for n in lens], block_tables=[[1]] * rows,
                       slot_mapping=[16] * rows, params=params or [SamplingParams(temperature=0)] * rows,
                       seeds=[0] * rows, steps=[0] * rows)


def test_plan_is_the_one_dispatch(llm):
    """Every case of the decision: replay at the padded bucket; a failed bucket's step eager at that
    bucket and the captured bound; no graphs: eager at the batch's own size and longest row; too many
    rows or too long a context: eager outside the static buffers."""
    runner = _runner(llm, capture_sizes=[1, 2, 4, 8], max_seq_len=64)
    runner.eager_reason = None  # as after a successful capture
    assert runner.plan(_rows(3, 40)) == DecodePlan(3, GraphKey(4, "greedy"), None, True)
    sampled = [SamplingParams(temperature=0.7, top_k=5)] * 3
    assert runner.plan(_rows(3, 40, sampled)).key == GraphKey(4, "sample")
    assert runner.plan(_rows(9, 40)) == DecodePlan(9, GraphKey(9, "greedy"), EagerReason.BATCH_TOO_LARGE, False, 40)
    assert runner.plan(_rows(2, 65)) == DecodePlan(2, GraphKey(2, "greedy"), EagerReason.CONTEXT_TOO_LONG, False, 65)
    runner.graph_check = GraphCheck(1, {})
    runner.graph_check.failed_buckets.add(4)
    assert runner.plan(_rows(3, 40)) == DecodePlan(3, GraphKey(4, "greedy"), EagerReason.GRAPH_CHECK_FAILED, True)
    assert runner.plan(_rows(2, 40)).replays
    runner.graph_check = None
    runner.eager_reason = EagerReason.ENFORCE_EAGER
    assert runner.plan(_rows(3, 40)) == DecodePlan(3, GraphKey(3, "greedy"), EagerReason.ENFORCE_EAGER, True, 40)
    assert runner.plan(_rows(9, 40)).eager_reason == EagerReason.ENFORCE_EAGER  # the runner-wide reason explains it
    with pytest.raises(ValueError, match="lists at most 20"):
        runner.plan(_rows(1, 10, [SamplingParams(logprobs=21)]))
    with pytest.raises(ValueError, match="no graph to replay"):
        runner.replay(runner.plan(_rows(3, 40)))
    with pytest.raises(ValueError, match="nothing to prepare"):
        runner.prepare(_rows(9, 40), runner.plan(_rows(9, 40)))
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.plan(_rows(1, 10))


def test_can_carry_needs_the_rows_and_a_batch_that_fits(llm):
    batch = _decode_batch(llm, 3)
    runner = _runner(llm, capture_sizes=[1, 2, 4, 8], max_seq_len=64)
    assert runner.inputs.packed is runner.graph_state.packed  # one staging, one copy a step
    assert not runner.can_carry([0], 30)  # nothing launched yet
    runner.decode(batch)
    assert runner.can_carry([0, 1, 2], 30) and runner.can_carry([2, 0], 64)
    assert not runner.can_carry([3], 30)  # the launch left three rows
    assert not runner.can_carry([0, 1], 65)  # one position further the batch outgrows the captured context
