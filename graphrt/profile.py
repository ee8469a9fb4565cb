"""``graphrt profile``: record decode steps with torch.profiler and break each step down by kernel.

A steady workload (``graphrt.workload``: B sequences of ``context`` tokens in the paged cache) is
warmed up, then ``steps`` decode steps are recorded with torch.profiler (CPU, plus CUDA on a GPU),
each inside a ``graphrt.decode_step`` annotation. The Chrome/Perfetto trace is written to a file and
read back to attribute every GPU activity (kernel, memcpy, memset) to its step: through the
correlation id of the launch that issued it (``cudaLaunchKernel``, ``cuLaunchKernel``,
``cudaGraphLaunch``, ...) when that launch lies inside a step, else by its start time.

Per step (means over the recorded steps), all times in microseconds:

- ``step_wall_us``: the step's host wall time (refresh, replay or eager forward, sampling, the token
  copy back and the wait for it), under the profiler; ``step_wall_us_unprofiled``: the median of
  the timed warm-up steps, without it.
- ``kernels_per_step``, ``kernel_us_per_step`` (sum of kernel durations), ``memcpy_per_step``,
  ``memset_per_step``, ``copy_us_per_step``.
- ``gpu_busy_us_per_step``: the union of all GPU activity; ``gpu_busy_share`` of the wall time;
  ``gpu_idle_us_per_step`` = wall - busy, split into ``idle_before_first_us`` (host work before the
  first launch lands), ``idle_between_us`` (the sum of gaps between consecutive GPU activities) and
  ``idle_after_last_us`` (the copy back and return to Python); ``gaps_per_step``, ``gap_mean_us``,
  ``gap_median_us``, ``gap_max_us``.
- ``graph_launches_per_step`` and ``graph_kernels_per_step`` (kernels issued by a graph launch);
  ``graph_kernels_visible``: whether replayed graphs showed their kernels individually (None when no
  graph was replayed). The replay alone, from its first node's start to its last node's end:
  ``graph_start_us`` (where it starts in the step), ``graph_span_us_per_step``,
  ``graph_idle_us_per_step`` (span - busy) and ``graph_gap_mean_us`` (between consecutive nodes).
- ``top_kernels``: ``name``, ``short_name``, ``count_per_step``, ``us_per_step``, ``mean_us``,
  ``share_of_step`` (of the wall time), ``share_of_kernel_time``.
- ``exposed_kernels``: what each GPU activity adds to the step. Taken in the order they end, an
  activity's *exposed* time is the part of it that no activity ending before it covered (for a chain
  of kernels: from the previous one's end, or its own start after a gap, to its own end). With
  programmatic dependent launches a kernel starts while the one before runs and waits on the device,
  so durations overlap and include the waits; exposed times do not overlap, and over all activities
  (copies included) they add up to ``gpu_busy_us_per_step``. Per (name, launch grid), so one kernel's
  launches for different matrices stay apart; the top ``top`` by exposed time: ``short_name``,
  ``grid``, ``count_per_step``, ``exposed_us_per_step``, ``mean_exposed_us``, ``mean_us`` (duration),
  ``share_of_step``.
- ``top_cpu_ops``: host operators and runtime calls by self time: ``name``, ``count_per_step``,
  ``self_us_per_step``, ``total_us_per_step``, ``share_of_step``; ``host_outside_ops_us_per_step``:
  step time on the step's thread outside any recorded operator or runtime call (Python).

On CPU the GPU figures are None and ``notes`` says that kernel figures need CUDA. The profiler slows
the host side (operator recording; CUPTI makes a graph launch cost far more than it does unprofiled), so
``step_wall_us`` exceeds ``step_wall_us_unprofiled``: kernel durations hold, idle and launch
figures are upper bounds, and a note says by how much the step slowed.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from graphrt.base.errors import ConfigError
from graphrt.base.files import write_json
from graphrt.base.native_stderr import filtered_native_stderr, kineto_notice
from graphrt.workload import decode_workload, synchronize

DEFAULT_TRACE = "graphrt_trace.json"
#: The annotation around each recorded decode step (a ``user_annotation`` event in the trace).
STEP_ANNOTATION = "graphrt.decode_step"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
NODE_TRACE_HINT = ("per-kernel attribution inside graphs needs --enforce-eager here, or Nsight Systems with "
                   "--cuda-graph-trace=node")

GPU_KEYS = (
    "kernels_per_step", "kernel_us_per_step", "memcpy_per_step", "memset_per_step", "copy_us_per_step",
    "gpu_busy_us_per_step", "gpu_busy_share", "gpu_idle_us_per_step", "idle_before_first_us",
    "idle_between_us", "idle_after_last_us", "gaps_per_step", "gap_mean_us", "gap_median_us", "gap_max_us",
    "graph_launches_per_step", "graph_kernels_per_step", "graph_kernels_visible", "graph_start_us",
    "graph_span_us_per_step", "graph_idle_us_per_step", "graph_gap_mean_us",
)


# -- kernel names ----------------------------------------------------------------------------------

_OP_HINT = re.compile(r"\b([A-Za-z]\w*?(?:_kernel(?:_cuda|_impl)?|Functor\w*|_functor|Ops))\b")
#: Wrappers that say nothing about the operation they wrap; the name inside them is taken instead.
_GENERIC_BASES = {"Kernel", "Kernel2", "device_kernel", "kernel"}
_GENERIC = {"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "UnaryFunctor", "gpu_kernel", "launch_kernel"}


def _split_top(text: str, sep: str) -> tuple[str, str]:
    """``text`` cut at the first ``sep`` outside any brackets: (before, from it on)."""
    depth = 0
    for i, ch in enumerate(text):
        if depth == 0 and ch == sep:
            return text[:i], text[i:]
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth = max(0, depth - 1)
    return text, ""


def short_kernel_name(name: str, width: int = 64) -> str:
    """A readable form of a (demangled, often templated) kernel name.

    ``void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(...)::{lambda...}, ...>(int, ...)``
    becomes ``vectorized_elementwise_kernel<silu_kernel>``: the argument list and namespaces go, and
    of the template arguments only the first operator-like name (``*_kernel``, ``*Functor*``) stays.
    Names without templates (cuBLAS, Triton) are kept, cut to ``width`` characters.
    """
    text = name.strip()
    if text.startswith("void "):
        text = text[5:]
    base, rest = _split_top(text, "<")
    if rest:
        rest = _split_top(rest, "(")[0].strip()[1:-1]  # the template arguments, without the <>
    else:
        base, _ = _split_top(text, "(")
    base = base.rsplit("::", 1)[-1].strip() or text
    hint = ""
    if rest:
        for match in _OP_HINT.finditer(rest):
            candidate = match.group(1)
            if candidate != base and candidate not in _GENERIC:
                hint = candidate
                break
    if not hint and rest and base in _GENERIC_BASES:  # cutlass::Kernel2<sm90_xmma_gemm_...>: the argument is the name
        first = _split_top(rest, ",")[0].strip()
        hint = _split_top(first, "<")[0].rsplit("::", 1)[-1]
    short = f"{base}<{hint}>" if hint else base
    return short if len(short) <= width else short[: width - 1] + "…"


# -- trace analysis --------------------------------------------------------------------------------


def load_trace(path: str | Path) -> dict:
    """A Chrome trace written by torch.profiler (plain JSON, or gzip when the name ends in .gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _events(trace: dict | list) -> list[dict]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle stretches between consecutive ``intervals`` (sorted by start; overlaps leave none)."""
    gaps, reach = [], intervals[0][1]
    for start, end in intervals[1:]:
        if start > reach:
            gaps.append(start - reach)
        reach = max(reach, end)
    return gaps


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def _from_graph(kernel: dict, launch: tuple[int, bool] | None) -> bool:
    """Whether a kernel ran as a node of a CUDA graph: issued by a graph launch, or tagged with a graph
    id by CUPTI (kineto writes it into the kernel's args when it has one)."""
    if launch is not None and launch[1]:
        return True
    args = kernel.get("args") or {}
    return any(args.get(key) not in (None, 0) for key in ("graph id", "graph node id"))


def analyze_trace(trace: dict | list, top: int = 15, step_name: str = STEP_ANNOTATION) -> dict:
    """Per-step breakdown of a torch.profiler Chrome trace whose steps are ``step_name`` annotations.
    Returns ``num_steps``, ``step_wall_us``, ``host_outside_ops_us_per_step``, ``top_kernels`` and
    every ``GPU_KEYS`` key; the GPU keys are None when the trace holds no GPU activity."""
    events = _events(trace)
    steps = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("name") == step_name and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    if not steps:
        raise ValueError(f"the trace holds no '{step_name}' step annotations")
    windows = [(float(s["ts"]), float(s["ts"]) + float(s["dur"])) for s in steps]
    starts = [w[0] for w in windows]
    n = len(steps)

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= windows[i][1] else None

    # Launches inside a step: correlation id -> (step, is a graph launch).
    launches: dict[int, tuple[int, bool]] = {}
    graph_launches = 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in LAUNCH_CATEGORIES:
            continue
        corr = (e.get("args") or {}).get("correlation")
        step = step_of(float(e["ts"]))
        if corr is None or step is None:
            continue
        is_graph = str(e.get("name", "")).startswith(("cudaGraphLaunch", "cuGraphLaunch"))
        graph_launches += is_graph
        launches[corr] = (step, is_graph)

    # (start, end, category, name, ran as a graph node, launch grid) of each GPU activity, per step
    per_step: list[list[tuple[float, float, str, str, bool, tuple | None]]] = [[] for _ in range(n)]
    graph_kernels = 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        start = float(e["ts"])
        found = launches.get((e.get("args") or {}).get("correlation"))
        step = found[0] if found is not None else step_of(start)
        if step is None:
            continue
        in_graph = _from_graph(e, found)
        graph_kernels += in_graph and e["cat"] == "kernel"
        grid = (e.get("args") or {}).get("grid")
        per_step[step].append((start, start + float(e.get("dur", 0.0)), e["cat"], e.get("name", "?"), in_graph,
                               tuple(grid) if isinstance(grid, list) else None))

    # Host work inside each step, on the step's thread: operators, runtime calls, the profiler's own.
    host: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    for e in events:
        if e.get("ph") != "X" or e.get("cat") in GPU_CATEGORIES + ("gpu_user_annotation",) or e.get("name") == step_name:
            continue
        start = float(e["ts"])
        step = step_of(start)
        end = start + float(e.get("dur", 0.0))
        if step is not None and end <= windows[step][1] and e.get("tid") == steps[step].get("tid"):
            host[step].append((start, end))

    wall = [w[1] - w[0] for w in windows]
    result: dict = {
        "num_steps": n,
        "step_wall_us": _mean(wall),
        "host_outside_ops_us_per_step": _mean(w - _union_length(h) for w, h in zip(wall, host)),
    }
    if not any(per_step):
        result.update({key: None for key in GPU_KEYS}, top_kernels=[], exposed_kernels=[])
        return result

    kernel_count = kernel_time = memcpy = memset = copy_time = 0.0
    busy, before, between, after, gaps = [], [], [], [], []
    graph_start, graph_span, graph_idle, graph_gaps = [], [], [], []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    exposed: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # (name, grid) -> count, exposed, duration
    for (w_start, w_end), activities in zip(windows, per_step):
        activities.sort()
        _add_exposed(activities, (w_start, w_end), exposed)
        for start, end, cat, name, *_ in activities:
            if cat == "kernel":
                kernel_count += 1
                kernel_time += end - start
                by_name[name][0] += 1
                by_name[name][1] += end - start
            else:
                memcpy += cat == "gpu_memcpy"
                memset += cat == "gpu_memset"
                copy_time += end - start
        graph = [(s, e) for s, e, _, _, in_graph, _ in activities if in_graph]
        if graph:  # the replay alone: from its first node's start to its last node's end
            graph_start.append(graph[0][0] - w_start)
            graph_span.append(max(e for _, e in graph) - graph[0][0])
            graph_idle.append(graph_span[-1] - _union_length(graph))
            graph_gaps.extend(_gaps(graph))
        clipped = [(max(s, w_start), min(e, w_end)) for s, e, *_ in activities if min(e, w_end) > max(s, w_start)]
        busy.append(_union_length(clipped))
        if not clipped:
            before.append(w_end - w_start)
            between.append(0.0)
            after.append(0.0)
            continue
        step_gaps = _gaps(clipped)
        gaps.extend(step_gaps)
        before.append(min(s for s, _ in clipped) - w_start)
        between.append(sum(step_gaps))
        after.append(w_end - max(e for _, e in clipped))

    step_wall = result["step_wall_us"]
    kernel_per_step = kernel_time / n
    top_kernels = [
        {
            "name": name,
            "short_name": short_kernel_name(name),
            "count_per_step": count / n,
            "us_per_step": total / n,
            "mean_us": total / count,
            "share_of_step": total / n / step_wall if step_wall else None,
            "share_of_kernel_time": total / kernel_time if kernel_time else None,
        }
        for name, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    ]
    busy_mean = _mean(busy)
    result.update(
        kernels_per_step=kernel_count / n,
        kernel_us_per_step=kernel_per_step,
        memcpy_per_step=memcpy / n,
        memset_per_step=memset / n,
        copy_us_per_step=copy_time / n,
        gpu_busy_us_per_step=busy_mean,
        gpu_busy_share=busy_mean / step_wall if step_wall else None,
        gpu_idle_us_per_step=step_wall - busy_mean,
        idle_before_first_us=_mean(before),
        idle_between_us=_mean(between),
        idle_after_last_us=_mean(after),
        gaps_per_step=len(gaps) / n,
        gap_mean_us=_mean(gaps),
        gap_median_us=statistics.median(gaps) if gaps else 0.0,
        gap_max_us=max(gaps, default=0.0),
        graph_launches_per_step=graph_launches / n,
        graph_kernels_per_step=graph_kernels / n,
        graph_kernels_visible=(graph_kernels > 0) if graph_launches else None,
        graph_start_us=_mean(graph_start) if graph_start else None,
        graph_span_us_per_step=_mean(graph_span) if graph_span else None,
        graph_idle_us_per_step=_mean(graph_idle) if graph_idle else None,
        graph_gap_mean_us=_mean(graph_gaps) if graph_span else None,
        top_kernels=top_kernels,
        exposed_kernels=[
            {
                "short_name": short_kernel_name(name),
                "grid": list(grid) if grid else None,
                "count_per_step": count / n,
                "exposed_us_per_step": exposed_total / n,
                "mean_exposed_us": exposed_total / count,
                "mean_us": duration / count,
                "share_of_step": exposed_total / n / step_wall if step_wall else None,
            }
            for (name, grid), (count, exposed_total, duration)
            in sorted(exposed.items(), key=lambda item: -item[1][1])[:top]
        ],
    )
    return result


def _add_exposed(activities: list[tuple], window: tuple[float, float], exposed: dict[tuple, list[float]]) -> None:
    """Adds each of one step's ``activities`` (start, end, category, name, in graph, grid), clipped to
    the step's ``window``, to ``exposed[(name, grid)]`` = [count, exposed us, duration us]: in the order
    they end, the part of each that no activity ending before it covered (``analyze_trace``'s
    ``exposed_kernels``). Over a step these add up to its busy time: each instant is counted once, for
    the first activity to end that covers it."""
    covered: list[list[float]] = []  # merged intervals, in order, of the activities counted so far
    clipped = [(max(start, window[0]), min(end, window[1]), name, grid)
               for start, end, _, name, _, grid in activities if min(end, window[1]) > max(start, window[0])]
    for start, end, name, grid in sorted(clipped, key=lambda activity: activity[1]):
        overlap = 0.0
        for c_start, c_end in reversed(covered):  # disjoint, in order, none ending after this one
            if c_end <= start:
                break
            overlap += c_end - max(c_start, start)
        entry = exposed[(name, grid)]
        entry[0] += 1
        entry[1] += end - start - overlap
        entry[2] += end - start
        # Every interval in covered ends no later than this one: it merges with those reaching its start.
        while covered and covered[-1][1] >= start:
            start = min(start, covered.pop()[0])
        covered.append([start, end])


def cpu_op_breakdown(profiler, num_steps: int, step_wall_us: float, top: int = 15,
                     step_name: str = STEP_ANNOTATION) -> list[dict]:
    """The top host operators (and runtime calls) by self time per step, from a finished
    torch.profiler's ``key_averages``."""
    rows = []
    for evt in profiler.key_averages():
        if evt.key == step_name or evt.key.startswith("ProfilerStep") or evt.self_cpu_time_total <= 0:
            continue
        rows.append({
            "name": evt.key,
            "count_per_step": evt.count / num_steps,
            "self_us_per_step": evt.self_cpu_time_total / num_steps,
            "total_us_per_step": evt.cpu_time_total / num_steps,
            "share_of_step": evt.self_cpu_time_total / num_steps / step_wall_us if step_wall_us else None,
        })
    rows.sort(key=lambda r: -r["self_us_per_step"])
    return rows[:top]


# -- recording -------------------------------------------------------------------------------------


def profiler_activities(device: torch.device) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


@contextmanager
def torch_trace(path: str | None, device: torch.device):
    """Record the block with torch.profiler (CPU, plus CUDA on a GPU) and write a Chrome/Perfetto
    trace to ``path`` (gzip when it ends in .gz); does nothing when ``path`` is None. Yields the
    profiler (or None)."""
    if path is None:
        yield None
        return
    from torch.profiler import profile

    with filtered_native_stderr(kineto_notice), profile(activities=profiler_activities(device)) as prof:
        yield prof
        synchronize(device)
    prof.export_chrome_trace(str(path))


@contextmanager
def cuda_profiler_range(device: torch.device):
    """cudaProfilerStart/Stop around the block on CUDA, so that ``nsys profile
    --capture-range=cudaProfilerApi`` records only the block; nothing on CPU."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.stop()


def step_annotation(active: bool = True):
    """The ``graphrt.decode_step`` annotation that ``analyze_trace`` splits a trace by (a no-op
    context when not ``active``)."""
    from torch.profiler import record_function

    return record_function(STEP_ANNOTATION) if active else nullcontext()


def summarize_trace(path: str | Path) -> str:
    """One paragraph on a trace written with ``step_annotation`` around each step."""
    r = analyze_trace(load_trace(path), top=5)
    text = f"trace {path}: {r['num_steps']} steps, {_us(r['step_wall_us'])} wall per step"
    if r["kernels_per_step"] is None:
        return text + " (no GPU activity: kernel figures need CUDA)"
    text += (f", {r['kernels_per_step']:.1f} kernels ({_us(r['kernel_us_per_step'])}) per step, GPU busy "
             f"{_pct(r['gpu_busy_share'])}, mean gap {_us(r['gap_mean_us'])}; top kernels: ")
    return text + ", ".join(f"{k['short_name']} {_pct(k['share_of_step'])}" for k in r["top_kernels"])


def profile_decode(
    model: str = "random:llama-3.2-1b",
    *,
    batch_size: int = 1,
    context: int = 512,
    steps: int = 20,
    warmup: int = 5,
    dtype: str = "auto",
    device: str = "auto",
    enforce_eager: bool = False,
    trace: str | Path = DEFAULT_TRACE,
    top: int = 15,
    nvtx: bool = False,
    fused_kernels: bool | None = None,
    dependent_launch: bool | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Build the workload, run ``warmup`` timed steps, record ``steps`` more with torch.profiler,
    write the trace and return the breakdown (keys in the module docstring). ``fused_kernels``,
    ``dependent_launch``, ``quantization``, ``kv_cache_dtype``: as the ``EngineConfig`` fields."""
    from torch.profiler import profile, schedule

    if steps < 1 or warmup < 0:
        raise ConfigError(f"profile needs steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    engine, batch = decode_workload(model, device, dtype, batch_size, context, enforce_eager, nvtx=nvtx,
                                    fused_kernels=fused_kernels, dependent_launch=dependent_launch,
                                    quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    runner, dev = engine.decode_runner, engine.device
    unprofiled = []
    for _ in range(max(warmup, 1)):
        synchronize(dev)
        start = time.perf_counter()
        runner.decode(batch)
        unprofiled.append((time.perf_counter() - start) * 1e6)
    stats_before = runner.stats.as_dict()

    # One discarded step under the profiler first: the first recorded step pays for its start-up.
    cycle = schedule(wait=0, warmup=1, active=steps, repeat=1)
    # One cycle: acc_events keeps its events. Kineto's start/stop notices are dropped from stderr.
    with (filtered_native_stderr(kineto_notice),
          profile(activities=profiler_activities(dev), schedule=cycle, acc_events=True) as prof):
        for _ in range(steps + 1):
            synchronize(dev)
            with step_annotation():
                runner.decode(batch)
            prof.step()
    trace = Path(trace)
    prof.export_chrome_trace(str(trace))

    result = analyze_trace(load_trace(trace), top=top)
    cpu_ops = cpu_op_breakdown(prof, result["num_steps"], result["step_wall_us"], top=top)
    replays = sum(runner.stats.replays_per_bucket.values()) - sum(stats_before["replays_per_bucket"].values())
    notes = []
    if dev.type != "cuda":
        notes.append("kernel figures need CUDA: on CPU only host operators are broken down")
    elif result["graph_kernels_visible"] is True:
        notes.append("torch.profiler (CUPTI) reported the kernels inside the replayed CUDA graph individually")
    elif result["graph_kernels_visible"] is False:
        notes.append("torch.profiler showed only the CUDA graph launch, not its kernels: " + NODE_TRACE_HINT)
    slowdown = result["step_wall_us"] / statistics.median(unprofiled)
    if slowdown > 1.2 and dev.type == "cuda":
        notes.append(f"the profiler slowed the step {slowdown:.1f}x (host side: CUPTI and operator recording); "
                     "kernel durations hold, but idle and launch figures are upper bounds")
    elif slowdown > 1.2:
        notes.append(f"the profiler slowed the step {slowdown:.1f}x (operator recording): host operator times are "
                     "upper bounds")
    unexpected = {k: v for k, v in runner.stats.eager_steps.items() if k != runner.eager_reason}
    if unexpected:
        notes.append(f"decode steps that ran eagerly although graphs were on: {unexpected}")
    if engine.dependent_launch:
        notes.append("kernels ran as programmatic dependents: each starts while the one before finishes and "
                     "waits for it, so kernel times overlap and include that wait (--plain-launch separates them, "
                     "and moves batch-1 layers over 256 MB to cuBLAS)")
    return _rounded({
        "model": model,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "batch_size": batch_size,
        "context": context,
        "steps": result["num_steps"],
        "warmup_steps": warmup,
        "mode": "cuda_graph" if replays else "eager",
        "fused_kernels": engine.fused_kernels,
        "dependent_launch": engine.dependent_launch,
        "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
        "eager_reason": None if replays else runner.eager_reason,
        "decode_stats": runner.stats.as_dict(),
        "trace": str(trace),
        "step_wall_us_unprofiled": statistics.median(unprofiled),
        **{k: v for k, v in result.items() if k != "num_steps"},
        "top_cpu_ops": cpu_ops,
        "notes": notes,
    })


def _rounded(value, digits: int = 3, significant: int = 6):
    """``value`` with every float in it rounded (keeps the JSON readable): to ``digits`` decimal places,
    more where the value needs them to keep ``significant`` significant digits, so a small share of the
    step (an operator's on a slow or busy host) stays positive instead of rounding to 0."""
    if isinstance(value, float):
        if value and math.isfinite(value):
            digits = max(digits, significant - 1 - math.floor(math.log10(abs(value))))
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _rounded(v, digits, significant) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits, significant) for v in value]
    return value


# -- report ----------------------------------------------------------------------------------------


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e3:.3f} ms" if value >= 1000 else f"{value:.1f} us"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_breakdown(r: dict) -> str:
    """The breakdown as the text ``graphrt profile`` prints."""
    mode = "CUDA graph" if r["mode"] == "cuda_graph" else f"eager ({r['eager_reason']})"
    mode += ", fused kernels" if r.get("fused_kernels") else ", unfused kernels"
    mode += " (dependent launches)" if r.get("dependent_launch") else ""
    if r.get("quantization"):
        mode += f", {r['quantization']} weights"
    if r.get("kv_cache_dtype") and r["kv_cache_dtype"] != r["dtype"]:
        mode += f", {r['kv_cache_dtype']} KV cache"
    lines = [
        f"graphrt profile: {r['model']}, batch {r['batch_size']}, context {r['context']}, {r['dtype']} on "
        f"{r['device']}, {mode}",
        f"{r['steps']} steps recorded after {r['warmup_steps']} warm-up; trace: {r['trace']}",
        "",
        f"step wall time      {_us(r['step_wall_us']):>12}   (unprofiled {_us(r['step_wall_us_unprofiled'])})",
    ]
    if r["kernels_per_step"] is not None:
        graph = ""
        if r["graph_launches_per_step"]:
            graph = (f"   ({r['graph_kernels_per_step']:.0f} from {r['graph_launches_per_step']:.0f} graph "
                     f"launch{'es' if r['graph_launches_per_step'] > 1 else ''})")
        lines += [
            f"kernels per step    {r['kernels_per_step']:>12.1f}{graph}",
            f"kernel time         {_us(r['kernel_us_per_step']):>12}   {_pct(r['kernel_us_per_step'] / r['step_wall_us'])} of step",
            f"copies per step     {r['memcpy_per_step'] + r['memset_per_step']:>12.1f}   ({_us(r['copy_us_per_step'])})",
            f"GPU busy            {_us(r['gpu_busy_us_per_step']):>12}   {_pct(r['gpu_busy_share'])} of step",
            f"GPU idle            {_us(r['gpu_idle_us_per_step']):>12}   before first {_us(r['idle_before_first_us'])}, "
            f"between {_us(r['idle_between_us'])}, after last {_us(r['idle_after_last_us'])}",
            f"gaps between ops    {r['gaps_per_step']:>12.1f}   mean {_us(r['gap_mean_us'])}, median "
            f"{_us(r['gap_median_us'])}, max {_us(r['gap_max_us'])}",
        ]
        if r.get("graph_span_us_per_step") is not None:
            span, idle = r["graph_span_us_per_step"], r["graph_idle_us_per_step"]
            lines.append(f"graph replay        {_us(span):>12}   first node {_us(r['graph_start_us'])} into the step; "
                         f"idle inside {_us(idle)} ({_pct(idle / span if span else None)}), mean gap "
                         f"{r['graph_gap_mean_us']:.2f} us")
        lines += [
            "",
            f"{'top kernels':<66} {'n/step':>7} {'us/step':>9} {'mean us':>8} {'% step':>7}",
        ]
        for k in r["top_kernels"]:
            lines.append(f"  {k['short_name']:<64} {k['count_per_step']:>7.1f} {k['us_per_step']:>9.1f} "
                         f"{k['mean_us']:>8.2f} {100 * (k['share_of_step'] or 0):>6.1f}%")
        if r.get("exposed_kernels"):
            lines += ["", f"{'exposed: time not covered by what ended before (name, grid)':<66} {'n/step':>7} "
                          f"{'us/step':>9} {'mean us':>8} {'% step':>7}"]
            for k in r["exposed_kernels"]:
                grid = "x".join(str(g) for g in k["grid"]) if k["grid"] else "-"
                label = f"{k['short_name'][:64 - len(grid) - 3]} [{grid}]"
                lines.append(f"  {label:<64} {k['count_per_step']:>7.1f} {k['exposed_us_per_step']:>9.1f} "
                             f"{k['mean_exposed_us']:>8.2f} {100 * (k['share_of_step'] or 0):>6.1f}%")
    lines += ["", f"{'top host ops (self time)':<66} {'n/step':>7} {'us/step':>9} {'':>8} {'% step':>7}"]
    for op in r["top_cpu_ops"]:
        lines.append(f"  {op['name'][:64]:<64} {op['count_per_step']:>7.1f} {op['self_us_per_step']:>9.1f} "
                     f"{'':>8} {100 * (op['share_of_step'] or 0):>6.1f}%")
    if r["host_outside_ops_us_per_step"] is not None:
        lines.append(f"  {'(Python outside any op)':<64} {'':>7} {r['host_outside_ops_us_per_step']:>9.1f}")
    for note in r["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(args) -> int:
    from graphrt.cli_args import kernel_options

    result = profile_decode(
        args.model, batch_size=args.batch_size, context=args.context, steps=args.steps, warmup=args.warmup,
        dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager, trace=args.trace, top=args.top,
        nvtx=args.nvtx, **kernel_options(args),
    )
    print(format_breakdown(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0
