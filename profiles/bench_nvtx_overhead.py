"""Host cost of graphrt's NVTX ranges, off and on, per range and per simulated decode step.

Three states, each in its own process (NVTX picks its tool once per process):

- ``off``: the default; every helper returns the no-op range after one flag check.
- ``on_no_tool``: ``GRAPHRT_NVTX=1`` without a profiler attached; graphrt finds only the ``nvtx``
  package's dummy domain and stays off.
- ``on_tool``: ``GRAPHRT_NVTX=1`` with a tool attached: tests/nvtx_injection.c in counting mode,
  a near-free stand-in for nsys (nsys's own per-event cost comes on top).

A simulated decode step nests the ranges a real one emits: ``step`` > ``schedule``, then ``decode`` >
``decode.eager`` on the eager path (4 ranges), or ``decode`` > ``decode.prepare`` + ``decode.replay``
on the graph path (5 ranges; a graph samples inside the replay, so no ``sample`` range). Figures are the best of
several repeats, minus the cost of calling an empty function; raw ``push_range``/``pop_range`` with
pre-built attributes and ``nvtx.annotate`` are measured alongside for comparison.

    python profiles/bench_nvtx_overhead.py [--json nvtx_overhead.json]

Runs on any machine (no GPU needed: it times host calls); the tool is built from tests/nvtx_injection.c
when a C compiler and the NVTX headers are available, otherwise ``on_tool`` is skipped.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_US_PER_STEP = 2.0
LAYERS = 30  # SmolLM2-135M, the default model
RANGES_PER_STEP = {"decode_step_eager": 4, "decode_step_graph": 5, "decode_step_eager_layers": 4 + LAYERS}


def _time_ns(fn, iterations: int, repeats: int) -> tuple[float, float]:
    """(best, median) nanoseconds per call of ``fn`` over ``repeats`` runs of ``iterations`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        samples.append((time.perf_counter_ns() - start) / iterations)
    return min(samples), statistics.median(samples)


def _cases(nvtx) -> dict:
    """Benchmark bodies over graphrt.base.nvtx; each runs one range (or one simulated step)."""

    def static_range():
        with nvtx.range("step"):
            pass

    def detailed_range():
        with nvtx.decode(8):
            pass

    def two_detail_range():
        with nvtx.decode_replay(5, 8):
            pass

    def layer_check():
        if nvtx.layers_enabled():
            pass

    def decode_step_eager():
        with nvtx.range("step"):
            with nvtx.range("schedule"):
                pass
            with nvtx.decode(5), nvtx.decode_eager(5, "enforce_eager"):
                pass

    def decode_step_graph():
        with nvtx.range("step"):
            with nvtx.range("schedule"):
                pass
            with nvtx.decode(5):
                with nvtx.decode_prepare():
                    pass
                with nvtx.decode_replay(5, 8):
                    pass

    def decode_step_eager_layers():
        with nvtx.range("step"):
            with nvtx.range("schedule"):
                pass
            with nvtx.decode(5), nvtx.decode_eager(5, "enforce_eager"):
                if nvtx.layers_enabled():
                    for index in range(LAYERS):
                        with nvtx.layer(index):
                            pass

    return {
        "static_range": static_range,
        "detailed_range": detailed_range,
        "two_detail_range": two_detail_range,
        "layer_check": layer_check,
        "decode_step_eager": decode_step_eager,
        "decode_step_graph": decode_step_graph,
        "decode_step_eager_layers": decode_step_eager_layers,
    }


def _raw_cases() -> dict:
    """The nvtx package used directly on the same domain, for comparison."""
    import nvtx

    domain = nvtx.get_domain("graphrt")
    attributes = domain.get_event_attributes(message="raw")
    push, pop = domain.push_range, domain.pop_range

    def raw_push_pop():
        push(attributes)
        pop()

    def annotate():
        with nvtx.annotate("annotate", domain="graphrt"):
            pass

    return {"raw_push_pop": raw_push_pop, "nvtx_annotate": annotate}


def _child(state: str, iterations: int, repeats: int) -> dict:
    """Measure in this process (its environment already set for ``state``)."""
    from graphrt.base import nvtx

    enabled = nvtx.configure(layers=state == "on_tool")  # layers too, so the layer case is measured on

    def noop():
        pass

    baseline, _ = _time_ns(noop, iterations, repeats)
    cases = _cases(nvtx)
    if state == "on_tool":
        cases.update(_raw_cases())
    results = {}
    for name, fn in cases.items():
        fn()  # build cached attributes outside the timing
        runs = max(iterations // RANGES_PER_STEP.get(name, 1), 1000)
        best, median = _time_ns(fn, runs, repeats)
        results[name] = {"best_ns": round(best - baseline, 1), "median_ns": round(median - baseline, 1)}
    out = {"state": state, "ranges_enabled": enabled, "call_baseline_ns": round(baseline, 1), "cases": results}
    library = os.environ.get("NVTX_INJECTION64_PATH")
    if library:  # how many events the tool received: proof the ranges really reached it
        import ctypes

        counter = ctypes.CDLL(library).nvtx_injection_event_count
        counter.restype = ctypes.c_ulonglong
        out["tool_events"] = counter()
    return out


def _build_tool(out_dir: Path) -> tuple[Path | None, str | None]:
    sys.path.insert(0, str(ROOT / "tests"))
    import nvtx_injection

    try:
        return nvtx_injection.build(out_dir), None
    except nvtx_injection.ToolUnavailable as exc:
        return None, str(exc)


def _run_state(state: str, tool: Path | None, iterations: int, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHRT_NVTX", "NVTX_"))}
    if state != "off":
        env["GRAPHRT_NVTX"] = "1"
    if state == "on_tool":
        env["NVTX_INJECTION64_PATH"] = str(tool)  # no NVTX_INJECTION_RECORD: count, don't write
    command = [sys.executable, __file__, "--child", state, "--iterations", str(iterations), "--repeats", str(repeats)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def _report(results: dict) -> None:
    states = list(results["states"])
    names = list(next(iter(results["states"].values()))["cases"])
    names += [n for n in results["states"].get("on_tool", {}).get("cases", {}) if n not in names]
    print(f"NVTX host cost, µs (best of {results['repeats']}; median in brackets); "
          f"budget {BUDGET_US_PER_STEP} µs per decode step when on")
    print(f"{'case':38s}" + "".join(f"{s:>22s}" for s in states))
    for name in names:
        cells = []
        for state in states:
            case = results["states"][state]["cases"].get(name)
            cells.append(f"{case['best_ns'] / 1000:9.3f} [{case['median_ns'] / 1000:7.3f}]" if case else "-")
        ranges = RANGES_PER_STEP.get(name)
        label = f"{name} ({ranges} ranges)" if ranges else name
        print(f"{label:38s}" + "".join(f"{c:>22s}" for c in cells))
    for state, data in results["states"].items():
        extra = f", tool received {data['tool_events']} events" if "tool_events" in data else ""
        print(f"{state}: ranges {'on' if data['ranges_enabled'] else 'off'}{extra}")
    if results.get("tool_unavailable"):
        print(f"on_tool skipped: {results['tool_unavailable']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--iterations", type=int, default=200_000, help="ranges timed per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.iterations, args.repeats)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        tool, unavailable = _build_tool(Path(tmp))
        states = ["off", "on_no_tool"] + (["on_tool"] if tool else [])
        results = {
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpus": os.cpu_count(), "python": platform.python_version()},
            "iterations": args.iterations,
            "repeats": args.repeats,
            "budget_us_per_step": BUDGET_US_PER_STEP,
            "ranges_per_case": RANGES_PER_STEP,
            "tool_unavailable": unavailable,
            "states": {state: _run_state(state, tool, args.iterations, args.repeats) for state in states},
        }
    _report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
