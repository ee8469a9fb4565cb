"""The decode graphs' runtime oracle (``check_graphs``) on CPU: the runner's graphs are stood in for by
objects whose ``replay`` runs the captured region eagerly (``_forward``), correctly or with a planted
fault, so every path of the oracle runs here; test_gpu_graph_check.py corrupts real CUDA graphs."""

from __future__ import annotations

import logging

import pytest

from graphrt import LLM, SamplingParams
from graphrt.base.errors import ConfigError
from graphrt.capture import DecodeBatch, DecodeGraphRunner, EagerReason, GraphCheck, GraphKey
from graphrt.config import EngineConfig

TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False)


class StandInGraph:
    """A "captured graph" of one bucket: replays the region eagerly, then plants ``fault`` (None, or a
    function of the runner) as a stale or corrupted graph would."""

    def __init__(self, runner: DecodeGraphRunner, size: int, mode: str, fault=None) -> None:
        self.runner, self.size, self.mode, self.fault = runner, size, mode, fault
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.runner._forward(GraphKey(self.size, self.mode))
        if self.fault is not None:
            self.fault(self.runner)


def checked_runner(llm: LLM, every: int, faults: dict[int, object] | None = None) -> DecodeGraphRunner:
    """A graph runner over the LLM's model and cache whose buckets replay stand-in graphs (``faults``:
    bucket -> fault), with the oracle armed as ``capture`` arms it."""
    engine = llm.engine
    runner = DecodeGraphRunner(engine.model, engine.runner.kv_caches, engine.attention_backend, block_size=16,
                               max_seq_len=64, max_batch_size=4, check_graphs=every)
    runner.eager_reason = None  # as after a successful capture
    for size in runner.capture_sizes:
        for mode in runner.captured_modes:
            runner.graphs[GraphKey(size, mode)] = StandInGraph(runner, size, mode, (faults or {}).get(size))
    runner.graph_check = GraphCheck(every, runner._static_inputs())
    return runner


def batch_of(rows: int, step: int) -> DecodeBatch:
    return DecodeBatch(input_ids=[10 + r for r in range(rows)], positions=[4 + step] * rows,
                       block_tables=[[1 + r] for r in range(rows)], slot_mapping=[(1 + r) * 16 + 4 + step for r in range(rows)],
                       params=[SamplingParams(temperature=0)] * rows, seeds=[r for r in range(rows)], steps=[step] * rows)


def flip_first_token(runner):
    runner.next_tokens[0] = (runner.next_tokens[0] + 1) % runner.model.config.vocab_size


def nudge_logits(runner):
    runner.logits[:, 5] += 0.5  # tokens may stay the same: the logits still give it away


@pytest.fixture(scope="module")
def llm():
    with LLM(**TINY) as llm:
        yield llm


def test_correct_graphs_pass_every_check(llm):
    runner = checked_runner(llm, every=1)
    reference = [runner.eager_decode(batch_of(3, step)) for step in range(4)]
    tokens = [runner.decode(batch_of(3, step)) for step in range(4)]
    check = runner.graph_check
    assert tokens == reference
    assert check.checks == check.replays == 4 and check.failures == []
    assert runner.stats.replays_per_bucket[4] == 4 and not runner.stats.eager_steps


@pytest.mark.parametrize("fault", [flip_first_token, nudge_logits], ids=["tokens", "logits"])
def test_a_diverging_bucket_is_logged_once_and_sent_to_eager(llm, fault, caplog):
    runner = checked_runner(llm, every=1, faults={2: fault})
    with caplog.at_level(logging.WARNING, logger="graphrt.capture.graph_check"):
        outputs = [runner.decode(batch_of(2, step)) for step in range(3)]
        runner.decode(batch_of(3, 0))  # bucket 4 still replays
    expected = [runner.eager_decode(batch_of(2, step)) for step in range(3)]
    assert outputs == expected  # the failing replay's step kept the eager result
    [failure] = runner.graph_check.failures
    assert (failure.bucket, failure.mode, failure.reason, failure.replay) == (2, "greedy", "diverged", 1)
    if fault is flip_first_token:
        assert failure.tokens_differ == 1 and failure.max_logit_diff == 0
    else:
        assert failure.max_logit_diff == pytest.approx(0.5)
    assert caplog.text.count("decode graph check failed for bucket 2") == 1
    assert runner.stats.eager_steps[EagerReason.GRAPH_CHECK_FAILED] == 2
    assert runner.graphs[GraphKey(2, "greedy")].replays == 1 and runner.graphs[GraphKey(4, "greedy")].replays == 1


def test_only_every_nth_replay_is_rerun(llm):
    runner = checked_runner(llm, every=3, faults={4: flip_first_token})
    for step in range(2):
        runner.decode(batch_of(3, step))
    assert runner.graph_check.checks == 0 and runner.graph_check.failures == []  # unchecked replays pass blind
    runner.decode(batch_of(3, 2))
    assert runner.graph_check.checks == 1 and runner.graph_check.failures[0].replay == 3


def test_a_moved_static_input_is_caught_before_the_replay(llm, caplog):
    runner = checked_runner(llm, every=100)
    runner.decode(batch_of(1, 0))
    runner.kv_caches[0] = runner.kv_caches[0].clone()  # a cache replaced instead of written in place
    with caplog.at_level(logging.WARNING, logger="graphrt.capture.graph_check"):
        runner.decode(batch_of(1, 1))
    [failure] = runner.graph_check.failures
    assert failure.reason == "inputs_moved" and failure.moved == ["kv_caches.0"]
    assert "static inputs moved since capture: kv_caches.0" in caplog.text
    assert runner.graphs[GraphKey(1, "greedy")].replays == 1  # the step after the move ran eagerly
    runner.decode(batch_of(1, 2))
    assert runner.stats.eager_steps[EagerReason.GRAPH_CHECK_FAILED] == 1


def test_engine_config_and_environment(monkeypatch):
    monkeypatch.delenv("GRAPHRT_CHECK_GRAPHS", raising=False)
    assert EngineConfig().check_graphs == 0
    monkeypatch.setenv("GRAPHRT_CHECK_GRAPHS", "7")
    assert EngineConfig().check_graphs == 7
    assert EngineConfig(check_graphs=2).check_graphs == 2  # the field wins over the environment
    for text in ("x", "-1", "2.5"):
        monkeypatch.setenv("GRAPHRT_CHECK_GRAPHS", text)
        with pytest.raises(ConfigError, match="GRAPHRT_CHECK_GRAPHS"):
            EngineConfig()
    monkeypatch.delenv("GRAPHRT_CHECK_GRAPHS")
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ConfigError, match="check_graphs"):
            EngineConfig(check_graphs=bad)
    with pytest.raises(ValueError, match="check_graphs"):
        GraphCheck(0, {})


def test_engine_without_graphs_says_the_oracle_has_nothing_to_check(caplog):
    """On CPU (or with enforce_eager) nothing is captured: the option is accepted, and a warning says so."""
    with caplog.at_level(logging.WARNING, logger="graphrt.capture.graph_runner"):
        with LLM(**TINY, check_graphs=1) as llm:
            [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
            assert len(out.token_ids) == 3 and llm.engine.decode_runner.graph_check is None
    assert "check_graphs=1 has nothing to check: decode runs without graphs here (no_cuda)" in caplog.text


def test_runner_options_are_checked(llm):
    import numpy as np

    engine = llm.engine
    for name, bad in [("max_logprobs", "5"), ("max_logprobs", None), ("max_logprobs", 2.5), ("check_graphs", 1.5),
                      ("check_graphs", True), ("check_graphs", -1)]:
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 0, got {bad!r}"):
            DecodeGraphRunner(engine.model, engine.runner.kv_caches, engine.attention_backend, block_size=16,
                              max_seq_len=64, max_batch_size=2, **{name: bad})
    assert EngineConfig(max_logprobs=np.int64(3), check_graphs=np.int32(2)).max_logprobs == 3
