"""Prompt graphs on the CPU: their buckets, the option's refusals, and that nothing captures where they
cannot run (no CUDA, ``enforce_eager``, ``prefill_graph_tokens=0``); tests/test_gpu_prefill_graphs.py
runs them."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, ConfigError
from graphrt.capture.prefill_graphs import (
    MIN_PREFILL_BUCKET,
    PrefillGraphRunner,
    mixed_buckets,
    prefill_buckets,
    prompt_groups,
)
from graphrt.config import EngineConfig


@pytest.mark.parametrize(("max_tokens", "buckets"), [
    (1, [1]), (16, [16]), (17, [16, 17]), (100, [16, 32, 64, 100]), (2048, [16, 32, 64, 128, 256, 512, 1024, 2048]),
])
def test_buckets_double_from_the_smallest_and_end_at_the_largest(max_tokens, buckets):
    assert prefill_buckets(max_tokens) == buckets
    assert prefill_buckets(max_tokens)[0] == min(MIN_PREFILL_BUCKET, max_tokens)


def test_bucket_sizes_below_one_are_refused():
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        prefill_buckets(0)


@pytest.mark.parametrize("name", ["prefill_graph_tokens", "mixed_step_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "512"])
def test_prompt_graph_token_caps_must_be_counts(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be an integer >= 0, got {value!r}"):
        EngineConfig(model="random:tiny", **{name: value})


@pytest.mark.parametrize(("prompt_max", "max_tokens", "buckets"), [
    (2048, 256, [64, 128, 256]),  # a quarter of the cap up to it
    (2048, 300, [128, 256]),  # the buckets the cap holds
    (2048, 2048, [512, 1024, 2048]),
    (2048, 5000, [2048]),  # capped by the prompt graphs
    (100, 256, [64, 100]),
    (2048, 16, [16]),
    (2048, 15, []),  # below the smallest bucket: no mixed graphs
    (2048, 0, []),
])
def test_mixed_buckets_run_from_a_quarter_of_the_cap_to_it(prompt_max, max_tokens, buckets):
    assert mixed_buckets(prefill_buckets(prompt_max), max_tokens) == buckets


def test_the_cpu_engine_runs_prompts_eagerly():
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=64, progress=False) as llm:
        assert llm.engine.prefill_graphs is None and llm.engine.runner.prefill_graphs is None
        assert not llm.engine.decode_runner.mixed_buckets  # no mixed steps either
    with pytest.raises(ValueError, match="prompt graphs need a CUDA device"):
        PrefillGraphRunner(None, [], 16, 64, 64, torch.device("cpu"))


@pytest.mark.parametrize(("query_lens", "table_lens", "groups"), [
    ([4] * 16, [1] * 16, [range(0, 16)]),  # one graph holds them
    ([4] * 17, [1] * 17, [range(0, 16), range(16, 17)]),  # more sequences than a graph holds
    ([4] * 40, [1] * 40, [range(0, 16), range(16, 32), range(32, 40)]),
    ([8] * 16, [1] * 16, [range(0, 8), range(8, 16)]),  # 128 tokens: two graphs of 64
    ([40, 30, 40, 5], [3, 2, 3, 1], [range(0, 1), range(1, 2), range(2, 4)]),  # a graph holds 64 tokens
    ([64, 1], [4, 1], [range(0, 1), range(1, 2)]),
    ([65], [5], None),  # more tokens than the largest bucket
    ([8, 8], [1, 9], None),  # a table wider than the graphs'
    ([], [], None),
])
def test_prompt_groups_pack_sequences_into_graphs(query_lens, table_lens, groups):
    assert prompt_groups(query_lens, table_lens, max_seqs=16, max_tokens=64, max_blocks=8) == groups


@pytest.mark.parametrize("command", ["generate", "serve", "bench-serving"])
def test_the_cli_takes_mixed_step_tokens_and_refuses_a_negative_count(command, capsys):
    from graphrt.cli import build_parser
    from graphrt.cli_args import engine_options

    args = build_parser().parse_args([command, "--mixed-step-tokens", "128"])
    assert args.mixed_step_tokens == 128
    if command != "bench-serving":
        assert engine_options(args)["mixed_step_tokens"] == 128
    assert build_parser().parse_args([command]).mixed_step_tokens == EngineConfig.mixed_step_tokens
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--mixed-step-tokens", "-1"])
    assert "--mixed-step-tokens: " in capsys.readouterr().err
