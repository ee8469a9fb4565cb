"""``graphrt bench-serving`` on the CPU: the load it makes, the engine driven through it (every request
finished with its drawn length, latencies ordered), its table, JSON and plot, and its refusals."""

from __future__ import annotations

import json

import pytest

from graphrt import LLM
from graphrt.base.errors import ConfigError
from graphrt.cli import main
from graphrt.serving_bench import LengthRange, LoadSpec, make_requests, run_load, summarize


def test_the_load_is_seeded_poisson_with_lengths_in_range_and_one_shared_prefix():
    spec = LoadSpec(rate=20.0, num_requests=200, prompt_len=LengthRange(10, 4), output_len=LengthRange(6, 2),
                    shared_prefix_fraction=0.5, shared_prefix_len=5, seed=3)
    requests = make_requests(spec, vocab_size=100)
    assert requests == make_requests(spec, vocab_size=100)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and 5 < arrivals[-1] < 15  # 200 arrivals at 20 a second: about 10 s
    shared = [r for r in requests if r.shares_prefix]
    assert 70 < len(shared) < 130
    assert len({tuple(r.prompt_token_ids[:5]) for r in shared}) == 1
    for r in requests:
        own = len(r.prompt_token_ids) - (5 if r.shares_prefix else 0)
        assert 6 <= own <= 14 and 4 <= r.max_tokens <= 8
        assert min(r.prompt_token_ids) >= 3 and max(r.prompt_token_ids) < 100


def test_the_engine_finishes_every_request_with_its_length_and_the_summary_is_ordered():
    spec = LoadSpec(rate=400.0, num_requests=10, prompt_len=LengthRange(9, 5), output_len=LengthRange(5, 3), seed=1)
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=32, progress=False) as llm:
        requests = make_requests(spec, llm.engine.model_config.vocab_size)
        running: list[int] = []
        timings, duration = run_load(llm.engine, requests, running=running)
    assert [t.tokens for t in timings] == [r.max_tokens for r in requests]
    assert running and running[-1] == 0 and 1 <= max(running) <= 10
    assert all(t.ttft_s >= 0 and all(gap >= 0 for gap in t.itl_s) for t in timings)
    summary = summarize(timings, duration, running=running)
    assert summary["running_max"] == max(running) and 0 < summary["running_mean"] <= max(running)
    assert summary["output_tokens"] == sum(r.max_tokens for r in requests)
    for stat in ("ttft", "itl", "tpot"):
        assert 0 <= summary[stat]["p50_ms"] <= summary[stat]["p99_ms"]
    assert summary["prefix_hit_rate"] is None


def test_an_infinite_rate_is_an_offline_run_of_seeded_sampled_requests(tmp_path):
    spec = LoadSpec(rate=float("inf"), num_requests=5, prompt_len=LengthRange(12, 4), output_len=LengthRange(6),
                    temperature=0.8, top_p=0.95, seed=2)
    requests = make_requests(spec, vocab_size=500)
    assert [r.arrival_s for r in requests] == [0.0] * 5
    assert len({r.params.seed for r in requests}) == 5
    assert all(r.params.temperature == 0.8 and r.params.top_p == 0.95 and r.params.ignore_eos for r in requests)
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=32, progress=False) as llm:
        timings, _ = run_load(llm.engine, requests)
    assert [(t.tokens, t.arrival_s) for t in timings] == [(6, 0.0)] * 5
    out_json = tmp_path / "offline.json"
    assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", "--rate", "inf", "--num-requests", "4",
                 "--prompt-len", "8:3", "--output-len", "4", "--temperature", "0.8", "--top-p", "0.95",
                 "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["load"]["rate"] == "inf" and result["load"]["temperature"] == 0.8
    assert result["output_tokens"] == 16


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "serving.json", tmp_path / "serving.png"
    assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", "--rate", "100", "--num-requests", "6",
                 "--prompt-len", "8:3", "--output-len", "4:1", "--shared-prefix", "0.5:6", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "ITL" in printed and "req/s" in printed
    result = json.loads(out_json.read_text())
    assert result["requests"] == 6 and result["load"]["shared_prefix_len"] == 6
    assert result["ttft"]["p50_ms"] is not None and result["output_tokens_per_s"] > 0
    assert result["running_max"] >= 1 and "sequences running after a step" in printed
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_small_cache_makes_the_load_preempt_and_every_request_still_finishes(tmp_path, capsys):
    # 6 blocks of 16 tokens (5 usable) for requests of up to 28 tokens each, all at once: some are preempted
    # (swapped out, 1 MiB of swap space) and every one still ends with its length.
    out_json = tmp_path / "small.json"
    assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", "--rate", "inf", "--num-requests", "6",
                 "--prompt-len", "12:2", "--output-len", "12:2", "--num-kv-blocks", "6", "--swap-space-mib", "1",
                 "--no-enable-prefix-caching", "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["num_kv_blocks"] == 6 and result["preemptions"] > 0 and result["requests"] == 6
    assert f"preemptions {result['preemptions']}" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "argument --rate: expected a number > 0, got '0'"),
    (["--prompt-len", "5:9"], "mean - spread >= 1, got 5:9"),
    (["--output-len", "x"], "expected MEAN or MEAN:SPREAD (integers), got 'x'"),
    (["--shared-prefix", "1.5:4"], "expected a fraction in [0, 1] and a length >= 0, got '1.5:4'"),
    (["--num-requests", "0"], "argument --num-requests: expected an integer >= 1, got '0'"),
], ids=["rate", "prompt_len", "output_len", "shared_prefix", "num_requests"])
def test_cli_refuses_bad_load_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-serving", "--model", "random:tiny", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_loads_are_refused_before_building(capsys):
    assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", "--prompt-len", "20:4",
                 "--output-len", "10", "--max-model-len", "30"]) != 0
    assert "longest sequence (34 tokens" in capsys.readouterr().err
    # Without --max-model-len the load sets it; beyond the model's positions the load is named.
    assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", "--prompt-len", "5000",
                 "--output-len", "4", "--num-requests", "2"]) != 0
    assert "longest sequence (5004 tokens" in capsys.readouterr().err
    for argv, message in ((["--temperature", "-1"], "the temperature must be finite and >= 0, got -1.0"),
                          (["--top-p", "0"], "top_p must be in (0, 1], got 0.0")):
        assert main(["bench-serving", "--model", "random:tiny", "--device", "cpu", *argv]) != 0
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match="arrival rate must be > 0"):
        LoadSpec(rate=0.0, num_requests=1, prompt_len=LengthRange(4), output_len=LengthRange(4))
