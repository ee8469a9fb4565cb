"""``graphrt bench`` on CPU: eager timings only (no graphs, no floor), table, JSON and plot."""

from __future__ import annotations

import json

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
    assert table[0].split()[:4] == ["batch", "ctx", "eager", "ms"]
    assert len(table) == 3


def test_unfused_flag_maps_to_the_engine_option():
    """``--unfused`` yields EngineConfig.fused_kernels directly: False when given, None (device default)."""
    from graphrt.cli import build_parser

    for command in ("generate", "bench", "profile"):
        assert build_parser().parse_args([command]).fused_kernels is None
        assert build_parser().parse_args([command, "--unfused"]).fused_kernels is False
