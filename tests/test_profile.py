"""``graphrt profile`` and the scenario scripts in profiles/, on CPU: the trace and breakdown files,
the per-step GPU arithmetic on a synthetic trace, kernel-name shortening, and each scenario run
small (in process, plus one under the NVTX injection tool to see the ranges Nsight would see)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nvtx_injection
import pytest

from graphrt.base import nvtx as graphrt_nvtx
from graphrt.cli import main
from graphrt.profile import GPU_KEYS, STEP_ANNOTATION, analyze_trace, short_kernel_name

ROOT = Path(__file__).resolve().parents[1]

#: Every key the breakdown JSON documents (graphrt/profile.py), on every device.
BREAKDOWN_KEYS = {
    "model", "device", "dtype", "torch", "batch_size", "context", "steps", "warmup_steps", "mode", "fused_kernels",
    "dependent_launch", "quantization", "kv_cache_dtype",
    "eager_reason", "decode_stats", "trace", "step_wall_us", "step_wall_us_unprofiled", *GPU_KEYS, "exposed_kernels",
    "top_kernels", "top_cpu_ops", "host_outside_ops_us_per_step", "notes",
}


@pytest.fixture(autouse=True)
def nvtx_off_afterwards(monkeypatch):
    """The scenarios ask for NVTX ranges; leave the process's NVTX state off for other tests."""
    for name in (graphrt_nvtx.ENV_RANGES, graphrt_nvtx.ENV_LAYERS):
        monkeypatch.delenv(name, raising=False)
    yield
    graphrt_nvtx.configure()


def test_profile_on_cpu_writes_trace_and_breakdown(tmp_path, capfd):
    trace, out = tmp_path / "trace.json", tmp_path / "breakdown.json"
    code = main(["profile", "--model", "random:tiny", "--device", "cpu", "--batch-size", "2", "--context", "17",
                 "--steps", "3", "--warmup", "1", "--trace", str(trace), "--json", str(out)])
    assert code == 0
    captured = capfd.readouterr()
    assert "USDT" not in captured.err  # Kineto's start/stop notices are dropped
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("name") == STEP_ANNOTATION and e.get("cat") == "user_annotation"]
    assert len(steps) == 3 and all(e["ph"] == "X" and e["dur"] > 0 for e in steps)
    assert any(e.get("cat") == "cpu_op" and e.get("name") == "aten::mm" for e in events)

    result = json.loads(out.read_text())
    assert set(result) == BREAKDOWN_KEYS
    assert (result["device"], result["mode"], result["eager_reason"]) == ("cpu", "eager", "no_cuda")
    assert (result["batch_size"], result["context"], result["steps"], result["trace"]) == (2, 17, 3, str(trace))
    assert result["step_wall_us"] > 0 and result["step_wall_us_unprofiled"] > 0
    assert 0 < result["host_outside_ops_us_per_step"] < result["step_wall_us"]
    assert all(result[key] is None for key in GPU_KEYS) and result["top_kernels"] == []
    ops = {op["name"]: op for op in result["top_cpu_ops"]}
    assert "aten::mm" in ops and ops["aten::mm"]["count_per_step"] > 0
    assert all(0 < op["share_of_step"] <= 1 for op in result["top_cpu_ops"])
    assert any("kernel figures need CUDA" in note for note in result["notes"])
    assert not any("CUPTI" in note or "kernel durations" in note for note in result["notes"])  # no kernels on a CPU

    printed = captured.out
    assert "step wall time" in printed and "aten::mm" in printed and "kernel figures need CUDA" in printed


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _synthetic_step(t0: float, corr: int) -> list[dict]:
    """One 100 us step: a graph launch issuing kernels A (20 us), B (20 us), A (10 us), then a 5 us
    token copy; GPU idle 10 us before, gaps of 2, 8 and 15 us, 10 us after."""
    return [
        _x("user_annotation", STEP_ANNOTATION, t0, 100),
        _x("gpu_user_annotation", STEP_ANNOTATION, t0 + 10, 80),  # GPU-side twin: not a step
        _x("cuda_runtime", "cudaGraphLaunch", t0 + 5, 3, corr),
        _x("kernel", "void ns::kernel_a<float>(float*)", t0 + 10, 20, corr),
        _x("kernel", "kernel_b", t0 + 32, 20, corr),
        _x("kernel", "void ns::kernel_a<float>(float*)", t0 + 60, 10, corr),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 + 75, 20, corr + 1),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t0 + 85, 5, corr + 1),
    ]


def test_gpu_breakdown_of_a_synthetic_trace():
    outside = _x("kernel", "warmup_kernel", 500, 10)  # in no step and with no launch: ignored
    trace = {"traceEvents": _synthetic_step(0, 1) + _synthetic_step(200, 3) + [outside]}
    r = analyze_trace(trace)
    assert r["num_steps"] == 2 and r["step_wall_us"] == 100
    assert r["kernels_per_step"] == 3 and r["kernel_us_per_step"] == 50
    assert r["memcpy_per_step"] == 1 and r["memset_per_step"] == 0 and r["copy_us_per_step"] == 5
    assert r["gpu_busy_us_per_step"] == 55 and r["gpu_busy_share"] == 0.55 and r["gpu_idle_us_per_step"] == 45
    assert (r["idle_before_first_us"], r["idle_between_us"], r["idle_after_last_us"]) == (10, 25, 10)
    assert r["gaps_per_step"] == 3 and r["gap_mean_us"] == pytest.approx(25 / 3)
    assert (r["gap_median_us"], r["gap_max_us"]) == (8, 15)
    assert (r["graph_launches_per_step"], r["graph_kernels_per_step"], r["graph_kernels_visible"]) == (1, 3, True)
    # The replay alone: its kernels from 10 to 70 us, 50 us busy, gaps of 2 and 8 us.
    assert (r["graph_start_us"], r["graph_span_us_per_step"], r["graph_idle_us_per_step"]) == (10, 60, 10)
    assert r["graph_gap_mean_us"] == 5
    assert r["host_outside_ops_us_per_step"] == 100 - 3 - 20  # the two runtime calls are the host's work
    first, second = r["top_kernels"]
    assert (first["short_name"], first["count_per_step"], first["us_per_step"]) == ("kernel_a", 2, 30)
    assert first["mean_us"] == 15 and first["share_of_step"] == 0.3 and first["share_of_kernel_time"] == 0.6
    assert second["name"] == "kernel_b"


def test_exposed_times_of_overlapping_kernels_add_up_to_the_busy_span():
    """Dependent launches: each kernel starts inside the one before and waits, so durations overlap.
    Exposed times (past the previous end) do not, and launches of one kernel on other grids stay apart."""
    def kernel(name, ts, dur, grid):
        event = _x("kernel", name, ts, dur, 1)
        event["args"]["grid"] = grid
        return event

    events = [
        _x("user_annotation", STEP_ANNOTATION, 0, 100),
        _x("cuda_runtime", "cudaGraphLaunch", 1, 2, 1),
        kernel("gemv", 10, 20, [512, 1, 1]),  # 10-30: all of it exposed
        kernel("attention", 12, 26, [8, 4, 1]),  # 12-38, waited for gemv: 8 us past its end
        kernel("gemv", 20, 23, [1024, 1, 1]),  # 20-43: 5 us past attention's
        kernel("gemv", 50, 4, [512, 1, 1]),  # after a 7 us gap: its own 4 us
    ]
    r = analyze_trace(events)
    exposed = {(k["short_name"], tuple(k["grid"])): k for k in r["exposed_kernels"]}
    assert set(exposed) == {("gemv", (512, 1, 1)), ("attention", (8, 4, 1)), ("gemv", (1024, 1, 1))}
    first = exposed[("gemv", (512, 1, 1))]
    counts = (first["count_per_step"], first["exposed_us_per_step"], first["mean_exposed_us"], first["mean_us"])
    assert counts == (2, 24, 12, 12)
    assert exposed[("attention", (8, 4, 1))]["exposed_us_per_step"] == 8
    assert exposed[("gemv", (1024, 1, 1))]["exposed_us_per_step"] == 5
    assert r["exposed_kernels"][0]["short_name"] == "gemv" and r["exposed_kernels"][0]["share_of_step"] == 0.24
    busy_span = 54 - 10
    assert sum(k["exposed_us_per_step"] for k in r["exposed_kernels"]) + 7 == busy_span
    assert r["kernel_us_per_step"] == 73  # durations overlap: more than the span


def test_exposed_times_count_each_busy_instant_once():
    """A kernel inside another adds only itself; a copy between kernels is a row of its own; whatever
    lies outside the step is cut off: the exposed times add up to the busy time."""
    events = [
        _x("user_annotation", STEP_ANNOTATION, 0, 200),
        _x("kernel", "outer", 10, 90),  # 10-100
        _x("kernel", "inner", 20, 10),  # 20-30, inside outer
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 10),  # 100-110
        _x("kernel", "late", 190, 30),  # 190-220: 10 us inside the step
    ]
    r = analyze_trace(events)
    exposed = {k["short_name"]: k["exposed_us_per_step"] for k in r["exposed_kernels"]}
    assert exposed == {"outer": 80, "inner": 10, "Memcpy HtoD": 10, "late": 10}
    assert sum(exposed.values()) == r["gpu_busy_us_per_step"] == 110


def test_graph_launch_without_kernels_is_reported_hidden():
    events = [
        _x("user_annotation", STEP_ANNOTATION, 0, 100),
        _x("cuda_runtime", "cudaGraphLaunch", 5, 3, 1),
        _x("cuda_runtime", "cudaMemcpyAsync", 75, 20, 2),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 85, 5, 2),
    ]
    r = analyze_trace(events)
    assert r["kernels_per_step"] == 0 and r["graph_launches_per_step"] == 1 and r["graph_kernels_visible"] is False
    assert r["graph_span_us_per_step"] is None


def test_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="step annotations"):
        analyze_trace({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]})


@pytest.mark.parametrize("name, short", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
     "{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, "
     "at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, std::array<char*, 2ul>)",
     "vectorized_elementwise_kernel<silu_kernel>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, std::array<char*, 3ul>)",
     "vectorized_elementwise_kernel<MulFunctor>"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)",
     "reduce_kernel<ArgMaxOps>"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, long)", "indexSelectLargeIndex"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<cute::tuple<>, 128> >(Params)",
     "device_kernel<FlashAttnFwdSm90>"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"),
    ("_paged_decode_kernel", "_paged_decode_kernel"),
])
def test_short_kernel_names(name, short):
    assert short_kernel_name(name) == short


def test_long_names_are_cut():
    assert short_kernel_name("k" * 200, width=20) == "k" * 19 + "…"


# -- scenario scripts ------------------------------------------------------------------------------

SCENARIOS = {
    "steady_decode": ["--batch-size", "3", "--context", "20", "--steps", "4", "--warmup", "1"],
    "mixed_prefill_decode": ["--batch-size", "2", "--context", "20", "--prompt-len", "9", "--arrivals", "3",
                             "--arrival-every", "2", "--max-tokens", "3", "--warmup", "1"],
    "capture": ["--max-num-seqs", "8", "--max-model-len", "64"],
    "prompt_latency": ["--batch-size", "2", "--context", "20", "--prefix-len", "40", "--suffix-len", "7",
                       "--requests", "3", "--cached"],
}
EXPECTED_OUTPUT = {
    "steady_decode": "4 steps, median",
    "mixed_prefill_decode": "6 steps, 3 with prompt tokens",
    "capture": "buckets [1, 2, 4, 8], no graphs (no_cuda)",
    "prompt_latency": "2 decoding, prompts of 40 shared + 7 own tokens, prefix caching on: TTFT median",
}


def _load_scenario(name: str):
    path = ROOT / "profiles" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scenario_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_runs_on_cpu_and_writes_a_torch_trace(name, tmp_path, capsys):
    module = _load_scenario(name)
    assert "nsys profile -t cuda,nvtx --cuda-graph-trace=node" in module.__doc__
    trace = tmp_path / f"{name}.json"
    argv = ["--model", "random:tiny", "--device", "cpu", *SCENARIOS[name], "--torch-profile", str(trace)]
    assert module.main(argv) == 0
    printed = capsys.readouterr().out
    assert EXPECTED_OUTPUT[name] in printed
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "cpu_op" for e in events)
    if name != "capture":  # the decode scenarios mark each recorded step
        steps = [e for e in events if e.get("name") == STEP_ANNOTATION and e.get("cat") == "user_annotation"]
        assert len(steps) == {"steady_decode": 4, "mixed_prefill_decode": 6, "prompt_latency": 3}[name]
        assert f"trace {trace}: {len(steps)} steps" in printed


def test_prompt_latency_tables_the_timed_requests_host_work(tmp_path, capsys):
    import pstats

    module = _load_scenario("prompt_latency")
    stats_file = tmp_path / "host.prof"
    argv = ["--model", "random:tiny", "--device", "cpu", *SCENARIOS["prompt_latency"], "--python-profile",
            str(stats_file)]
    assert module.main(argv) == 0
    printed = capsys.readouterr().out
    assert "host time by own time, us a request (3 requests):" in printed
    assert "host time by time inside, us a request (3 requests):" in printed
    # Only the timed requests were recorded: add_request once a request, its first step among them.
    calls = {name: row[1] for (_, _, name), row in pstats.Stats(str(stats_file)).stats.items()}
    assert calls["add_request"] == 3 and calls["step"] >= 3
    assert "engine.py" in printed and "add_request" in printed


def test_mixed_scenario_emits_mixed_steps_under_an_nvtx_tool(tmp_path):
    try:
        tool = nvtx_injection.build(tmp_path)
    except nvtx_injection.ToolUnavailable as exc:
        pytest.skip(str(exc))
    record_path = tmp_path / "record.tsv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHRT_NVTX", "NVTX_"))}
    env.update(nvtx_injection.tool_env(tool, record_path), PYTHONPATH=str(ROOT))
    args = ["--model", "random:tiny", "--device", "cpu", *SCENARIOS["mixed_prefill_decode"]]
    result = subprocess.run([sys.executable, "profiles/mixed_prefill_decode.py", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    record = nvtx_injection.read(record_path)
    assert record.domains == ["graphrt"]
    steps: list[list[str]] = []
    for r in record.ranges:
        if r.name == "step":
            steps.append([])
        elif len(r.parents) == 1 and r.parent == "step":
            steps[-1].append(r.message)
    # Warm-up: the two running prompts prefill together, then decode; then arrivals mix in.
    assert steps[0] == ["schedule", "prefill seqs=2 tokens=40", "sample"]
    assert ["schedule", "prefill seqs=1 tokens=9", "sample", "decode batch=2"] in steps
    assert ["schedule", "decode batch=3"] in steps


def test_gpu_breakdown_prints_kernels_gaps_and_graph_note():
    from graphrt.profile import format_breakdown

    r = analyze_trace({"traceEvents": _synthetic_step(0, 1)})
    r.update(model="m", device="NVIDIA H200", dtype="bfloat16", batch_size=1, context=512, steps=r.pop("num_steps"),
             warmup_steps=5, mode="cuda_graph", eager_reason=None, trace="t.json", step_wall_us_unprofiled=90.0,
             top_cpu_ops=[{"name": "cudaGraphLaunch", "count_per_step": 1.0, "self_us_per_step": 3.0,
                           "total_us_per_step": 3.0, "share_of_step": 0.03}],
             notes=["a note"])
    text = format_breakdown(r)
    assert "CUDA graph" in text and re.search(r"kernels per step +3\.0 +\(3 from 1 graph launch\)", text)
    assert re.search(r"GPU busy +55\.0 us +55\.0% of step", text)
    assert re.search(r"GPU idle +45\.0 us +before first 10\.0 us", text)
    assert re.search(r"graph replay +60\.0 us +first node 10\.0 us into the step; idle inside 10\.0 us", text)
    assert "between 25.0 us" in text and "mean 8.3 us" in text
    assert "kernel_a" in text and "cudaGraphLaunch" in text and "note: a note" in text
    assert re.search(r"exposed: time not covered [^\n]*\n  kernel_a \[-\] +2\.0 +30\.0 +15\.00 +30\.0%\n  kernel_b \[-\]", text)


def test_breakdown_rounding_keeps_small_shares_positive():
    """The JSON's floats keep three decimals, more where a value needs them for six significant digits:
    an operator's small share of a long step (a busy host's) must not round to 0, which would read as
    "took no time"; long step times keep their microseconds."""
    from graphrt.profile import _rounded

    assert _rounded({"share_of_step": 0.000123456789, "us": [8946.8741234, 1234567.8912, 2.0]}) == {
        "share_of_step": 0.000123457, "us": [8946.874, 1234567.891, 2.0]}
    assert _rounded(0.0) == 0.0 and _rounded("text") == "text" and _rounded(3) == 3


def test_filtered_native_stderr_drops_only_the_lines_asked_and_keeps_order(capfd):
    import os
    import sys

    from graphrt.base.native_stderr import filtered_native_stderr, kineto_notice

    with filtered_native_stderr(kineto_notice):
        os.write(2, b"USDT:2026 x.cpp:52] profiler_start\nfirst\n")
        os.write(2, b"second\nUSDT:2026 x.cpp:59] profiler_stop\n")
        print("from Python", file=sys.stderr)
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "first\nsecond\n" in err and "from Python\n" in err and err.endswith("after\n")
