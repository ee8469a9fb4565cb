"""``graphrt bench`` on CPU: eager timings only (no graphs, no floor), table, JSON and plot."""

from __future__ import annotations

import json

import pytest

from graphrt.cli import main


def test_bench_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--model", "random:tiny", "--device", "cpu", "--batch-sizes", "1,3",
                 "--contexts", "17", "--steps", "3", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert [(r["batch_size"], r["context"]) for r in result["rows"]] == [(1, 17), (3, 17)]
    for row in result["rows"]:
        assert row["eager_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["graph_ms"] is None and row["floor_ms"] is None  # CPU: eager only
        assert row["gemv_layers"] is False  # unfused on the CPU: cuBLAS-style torch linears
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["batch", "ctx", "q", "eager", "ms"]
    assert len(table) == 3


def test_compare_unfused_on_the_cpu_says_its_column_stays_empty(capsys):
    assert main(["bench", "--model", "random:tiny", "--device", "cpu", "--batch-sizes", "1", "--contexts", "8",
                 "--steps", "1", "--compare-unfused"]) == 0
    assert "--compare-unfused times CUDA graphs; on the CPU its column stays empty" in capsys.readouterr().err


def test_bench_times_verify_steps_of_several_rows_a_sequence(tmp_path):
    """``--query-tokens 1,3``: each point also as a verify step, 3 consecutive rows a sequence on its table."""
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:tiny", "--device", "cpu", "--batch-sizes", "2", "--contexts", "16",
                 "--query-tokens", "1,3", "--steps", "2", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["batch_size"], r["query_tokens"]) for r in rows] == [(2, 1), (2, 3)]
    assert all(r["eager_ms"] > 0 for r in rows)


def test_verify_rows_decode_what_single_rows_decode_at_each_position():
    """The workload's q rows a sequence are real verify rows: row j's token is the one a plain decode of
    the same cache and input gives at that position (each row writes its K/V, later rows attend to it)."""
    import torch

    from graphrt.workload import decode_engine, fill_decode_batch

    engine = decode_engine("random:tiny", "cpu", "float32", 2, 21, enforce_eager=True, query_tokens=3)
    batch = fill_decode_batch(engine, 2, 21, query_tokens=3)
    assert batch.positions == [20, 21, 22] * 2 and batch.block_tables[0] == batch.block_tables[2]
    assert batch.slot_mapping[3:] != batch.slot_mapping[:3]
    together = engine.decode_runner.decode(batch)
    caches = [kv.clone() for kv in engine.runner.kv_caches]
    alone = []  # one row at a time, in order: the same tokens
    for row in range(6):
        single = type(batch)(**{name: [getattr(batch, name)[row]] for name in
                                ("input_ids", "positions", "block_tables", "slot_mapping", "params", "seeds",
                                 "steps")})
        alone += engine.decode_runner.decode(single)
    assert together == alone
    torch.testing.assert_close(engine.runner.kv_caches[0], caches[0])  # the same K/V rewritten in place


def test_unfused_flag_maps_to_the_engine_option():
    """``--unfused`` yields EngineConfig.fused_kernels directly: False when given, None (device default)."""
    from graphrt.cli import build_parser

    for command in ("generate", "bench", "profile"):
        assert build_parser().parse_args([command]).fused_kernels is None
        assert build_parser().parse_args([command, "--unfused"]).fused_kernels is False


@pytest.mark.parametrize("argv", [["profile", "--context", "2048"],
                                  ["bench", "--contexts", "2048", "--batch-sizes", "1"]])
def test_a_context_at_the_models_last_position_names_the_option(argv, capsys):
    # random:tiny has 2048 positions: a context of 2048 leaves none for the decoded token.
    assert main([argv[0], "--model", "random:tiny", "--device", "cpu", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert "a context of 2048 tokens leaves no position for the 1 decoded token(s)" in err and "--context" in err
