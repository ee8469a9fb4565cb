"""``graphrt bench``: decode-step latency, eager against CUDA graphs, beside the memory-bandwidth floor.

For each (batch size, context): B sequences of ``context`` tokens sit in the paged cache (random
contents); one decode step is timed end to end as a serving engine sees it (static-buffer refresh,
replay or eager forward, sampling, the token copy back), median over ``steps`` runs. With graphs the
replay alone is timed too, on the GPU (CUDA events around ``graph.replay()``): the device time of a
step without the host's share; and pipelined steps, as the engine runs them with ``async_decode``
(each step queued, fed by the previous one's tokens on the device, before that step's tokens are read):
the interval between consecutive steps' tokens, where the host's share overlaps the replay. The floor
is (weight bytes + KV bytes read, as stored: FP8 weights and their scales, the cache's dtype) / the HBM
read bandwidth measured in the same run.
``query_tokens`` q > 1 times verify steps as speculative decoding runs them: q consecutive rows a
sequence (its newest token and q - 1 drafts), B x q rows in one graph; the floor stays a plain step's
(every weight and each sequence's cache read once), so the ratio shows what the extra rows cost.
``compare_unfused`` times the same graphs built with the unfused reference kernels beside them.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from graphrt.base.errors import ConfigError
from graphrt.base.files import write_json
from graphrt.base.plots import plain_log_labels, pyplot, save_figure, ticks_at
from graphrt.config import resolve_device, resolve_dtype
from graphrt.engine import LLMEngine
from graphrt.sampling.params import SamplingParams
from graphrt.workload import decode_engine, fill_decode_batch, synchronize

DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (512,)


@dataclass
class BenchRow:
    batch_size: int
    context: int
    fused_kernels: bool
    eager_ms: float
    graph_ms: float | None  # end-to-end step through the graph
    replay_ms: float | None  # GPU time of the replay alone
    speedup: float | None  # eager_ms / graph_ms
    floor_ms: float | None
    ratio_to_floor: float | None  # graph_ms (eager_ms without graphs) / floor_ms
    replay_ratio_to_floor: float | None  # replay_ms / floor_ms
    tokens_per_s: float  # rows a second (at q > 1: tokens verified, every draft kept)
    capture_seconds: float | None
    pool_mib: float | None
    pipelined_ms: float | None = None  # a step queued before the previous one's tokens are read
    pipelined_ratio_to_floor: float | None = None
    unfused_graph_ms: float | None = None  # with compare_unfused: the same step, unfused kernels
    unfused_replay_ms: float | None = None
    gemv_layers: bool = False  # the step's layers ran the batch-1 GEMV kernels (graphrt.kernels.gemv)
    dependent_launch: bool = False  # fused kernels launched as programmatic dependents (EngineConfig)
    query_tokens: int = 1  # rows a sequence (a verify step's newest token and its drafts when > 1)


def measure_read_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a large on-device reduction (each byte read once), median of 20 runs.

    The runs follow half a second of the same reduction, so that a GPU that was idle has raised its
    clocks: timed after only a few warm-up runs, the probe at the start of a ``bench`` read a bandwidth
    that varied from one invocation to the next, and every floor of that invocation moved with it
    (profiles/notes_fusion.md)."""
    data = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    warm_until = time.perf_counter() + 0.5
    while time.perf_counter() < warm_until:
        data.sum()
        torch.cuda.synchronize(device)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        data.sum()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return data.numel() * data.element_size() / statistics.median(times)


def weight_bytes_read(engine: LLMEngine, batch_size: int) -> int:
    """Bytes of weights one decode step reads, as stored: every matrix once (FP8 layers' codes and
    their scales), of the embedding table only the looked-up rows unless it is also the (tied) LM
    head, which reads it whole. The rotary tables (not weights: a row a token) are left out."""
    total = 0
    for name, tensor in engine.model.state_dict().items():
        if name == "embed_tokens.weight" and engine.model.lm_head is not None:
            total += batch_size * tensor.shape[1] * tensor.element_size()
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes_read(engine: LLMEngine, batch_size: int, context: int) -> int:
    """Bytes of cached keys and values one decode step reads, in the cache's dtype (of the KV heads this
    rank holds, with tensor parallelism)."""
    cfg = engine.model.config
    element = torch.empty((), dtype=engine.kv_cache_dtype).element_size()
    return batch_size * context * cfg.num_hidden_layers * 2 * cfg.kv_size * element


def _time_steps(decode, batch, steps: int, device: torch.device) -> float:
    """Median wall-clock ms of one decode call (each call ends with its token copy, a sync)."""
    for _ in range(3):
        decode(batch)
    samples = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        decode(batch)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _time_pipelined_steps(runner, batch, steps: int) -> float:
    """Median wall-clock ms between consecutive steps' tokens when each step is launched, carrying the
    previous step's tokens on the device, before the previous step's tokens are read (the engine's
    ``async_decode``)."""
    pending = runner.launch(batch)
    for _ in range(3):
        following = runner.launch(batch, carry_input_ids=True)
        pending.result()
        pending = following
    samples = []
    last = time.perf_counter()
    for _ in range(steps):
        following = runner.launch(batch, carry_input_ids=True)
        pending.result()
        now = time.perf_counter()
        samples.append((now - last) * 1e3)
        last, pending = now, following
    pending.result()
    return statistics.median(samples)


def _time_replays(engine: LLMEngine, batch, steps: int) -> float:
    """Median GPU ms of replaying ``batch``'s graph (static buffers refreshed once, by a decode)."""
    runner = engine.decode_runner
    runner.decode(batch)
    return median_replay_ms(_graph_for(runner, batch), steps)


def _graph_for(runner, batch) -> torch.cuda.CUDAGraph:
    """The captured graph ``runner`` replays for ``batch``: its padded size's, its sampling mode's."""
    return runner.graphs[runner.plan(batch).key]


def median_replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median GPU ms of one replay of a captured ``graph`` (CUDA events around each replay)."""
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_graphs(model, dev, dtype, batch_size, context, steps, fused_kernels, params, query_tokens=1, **options):
    """(end-to-end ms, replay ms, pipelined ms, capture s, pool MiB) of a captured engine's decode
    step. ``options``: further ``EngineConfig`` fields."""
    torch.cuda.empty_cache()
    engine = decode_engine(model, str(dev), dtype, batch_size, context, enforce_eager=False,
                           fused_kernels=fused_kernels, query_tokens=query_tokens, **options)
    batch = fill_decode_batch(engine, batch_size, context, params, query_tokens=query_tokens)
    graph_ms = _time_steps(engine.decode_runner.decode, batch, steps, dev)
    replay_ms = _time_replays(engine, batch, steps)
    pipelined_ms = _time_pipelined_steps(engine.decode_runner, batch, steps)
    stats = engine.decode_runner.stats
    result = graph_ms, replay_ms, pipelined_ms, stats.capture_seconds, stats.pool_bytes / 2**20
    del engine, batch
    torch.cuda.empty_cache()
    return result


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _bench_point(model, dev, dtype, batch_size, context, q, steps, params, bandwidth, fused_kernels,
                 dependent_launch, compare_unfused, storage) -> tuple[BenchRow, dict]:
    """One point: an eager engine timed (and its bytes counted), then on CUDA a captured one; returns
    the row and the engine's storage facts (quantization, cache dtype) for the result's header."""
    eager_engine = decode_engine(model, str(dev), dtype, batch_size, context, enforce_eager=True, query_tokens=q,
                                 fused_kernels=fused_kernels, dependent_launch=dependent_launch, **storage)
    batch = fill_decode_batch(eager_engine, batch_size, context, params, query_tokens=q)
    eager_ms = _time_steps(eager_engine.decode_runner.decode, batch, steps, dev)
    weights = weight_bytes_read(eager_engine, batch_size * q)
    kv = kv_bytes_read(eager_engine, batch_size, context)
    fused = eager_engine.fused_kernels
    gemv_layers = eager_engine.model.kernel_policy.runs_gemv(batch_size * q)
    launched_as_dependents = eager_engine.dependent_launch
    facts = dict(quantization=eager_engine.quantization,
                 kv_cache_dtype=str(eager_engine.kv_cache_dtype).removeprefix("torch."))
    del eager_engine, batch
    graph_ms = replay_ms = pipelined_ms = capture_s = pool = unfused_ms = unfused_replay = None
    if dev.type == "cuda":
        graph_ms, replay_ms, pipelined_ms, capture_s, pool = time_graphs(
            model, dev, dtype, batch_size, context, steps, fused_kernels, params, q,
            dependent_launch=dependent_launch, **storage)
        if compare_unfused and fused:
            unfused_ms, unfused_replay, _, _, _ = time_graphs(
                model, dev, dtype, batch_size, context, steps, False, params, q, **storage)
    best = graph_ms if graph_ms is not None else eager_ms
    floor = (weights + kv) / bandwidth * 1e3 if bandwidth else None
    row = BenchRow(
        batch_size=batch_size, context=context, fused_kernels=fused, eager_ms=round(eager_ms, 4),
        graph_ms=_rounded(graph_ms), replay_ms=_rounded(replay_ms),
        speedup=None if graph_ms is None else round(eager_ms / graph_ms, 2),
        floor_ms=_rounded(floor),
        ratio_to_floor=None if floor is None else round(best / floor, 2),
        replay_ratio_to_floor=None if floor is None or replay_ms is None else round(replay_ms / floor, 2),
        pipelined_ms=_rounded(pipelined_ms),
        pipelined_ratio_to_floor=None if floor is None or pipelined_ms is None else round(pipelined_ms / floor, 2),
        tokens_per_s=round(batch_size * q / best * 1e3, 1),
        capture_seconds=_rounded(capture_s, 2), pool_mib=_rounded(pool, 1),
        unfused_graph_ms=_rounded(unfused_ms), unfused_replay_ms=_rounded(unfused_replay),
        gemv_layers=gemv_layers, dependent_launch=launched_as_dependents, query_tokens=q,
    )
    return row, facts


def run_bench(model: str, device: str, dtype: str, batch_sizes, contexts, steps: int,
              fused_kernels: bool | None = None, compare_unfused: bool = False,
              params: SamplingParams | None = None, dependent_launch: bool | None = None,
              quantization: str | None = None, kv_cache_dtype: str = "auto", query_tokens=(1,)) -> dict:
    """Measure every (batch, context, query tokens); returns a JSON-able dict with the rows and the set-up.

    ``fused_kernels``, ``dependent_launch``, ``quantization``, ``kv_cache_dtype``: as the
    ``EngineConfig`` fields; ``compare_unfused``: also time the graphs
    with the unfused kernels (GPU only); ``params``: every row's sampling (default greedy);
    ``query_tokens``: rows a sequence, each value a point (1: plain decode steps). Raises
    ConfigError, before building anything, for no points or fewer than one step."""
    if (steps < 1 or not batch_sizes or not contexts or not query_tokens
            or min(*batch_sizes, *contexts, *query_tokens) < 1):
        raise ConfigError(f"bench needs steps >= 1 and at least one batch size, context and query-token count, "
                          f"each >= 1; got steps={steps}, batch sizes {list(batch_sizes)}, contexts "
                          f"{list(contexts)}, query tokens {list(query_tokens)}")
    params = params or SamplingParams(temperature=0.0)
    dev = resolve_device(device)  # refuses a CUDA device torch does not see, before anything runs
    use_cuda = dev.type == "cuda"
    bandwidth = measure_read_bandwidth(dev) if use_cuda else None
    storage = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    rows, engine_facts = [], {}
    for context in contexts:
        for batch_size in batch_sizes:
            for q in query_tokens:
                row, engine_facts = _bench_point(
                    model, dev, dtype, batch_size, context, q, steps, params, bandwidth, fused_kernels,
                    dependent_launch, compare_unfused, storage)
                rows.append(row)
                print(format_row(row), flush=True)
    return {
        "model": model,
        "dtype": str(resolve_dtype(dtype, dev)).removeprefix("torch."),
        "quantization": engine_facts["quantization"],  # None: the decoder weights in the model dtype
        "kv_cache_dtype": engine_facts["kv_cache_dtype"],
        "device": torch.cuda.get_device_name(dev) if use_cuda else "cpu",
        "torch": torch.__version__,
        "hbm_read_bandwidth_gbps": None if bandwidth is None else round(bandwidth / 1e9, 1),
        "steps_per_point": steps,
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p},
        "rows": [asdict(r) for r in rows],
    }


HEADER = (f"{'batch':>5} {'ctx':>6} {'q':>2} {'eager ms':>9} {'graph ms':>9} {'speedup':>7} {'replay ms':>9} "
          f"{'pipe ms':>8} {'floor ms':>9} {'x floor':>7} {'replay x':>8} {'pipe x':>6} {'unfused':>9} "
          f"{'tok/s':>10} {'capture s':>9} {'pool MiB':>8}")


def format_optional(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (e.g. ">9.3f"), or a dash of the same width when absent."""
    return format("-", spec.split(".")[0]) if value is None else format(value, spec)


def format_row(r: BenchRow) -> str:
    """One table line; ``pipe`` is the pipelined step, ``unfused`` the unfused graph's end-to-end ms
    (with compare_unfused)."""
    return (f"{r.batch_size:>5} {r.context:>6} {r.query_tokens:>2} {r.eager_ms:>9.3f} {format_optional(r.graph_ms, '>9.3f')} "
            f"{format_optional(r.speedup, '>7.2f')} {format_optional(r.replay_ms, '>9.3f')} {format_optional(r.pipelined_ms, '>8.3f')} "
            f"{format_optional(r.floor_ms, '>9.3f')} {format_optional(r.ratio_to_floor, '>7.2f')} {format_optional(r.replay_ratio_to_floor, '>8.2f')} "
            f"{format_optional(r.pipelined_ratio_to_floor, '>6.2f')} {format_optional(r.unfused_graph_ms, '>9.3f')} "
            f"{r.tokens_per_s:>10.1f} {format_optional(r.capture_seconds, '>9.2f')} {format_optional(r.pool_mib, '>8.1f')}")


def write_plot(result: dict, path: str) -> None:
    """ms/step against batch size, one line per (mode, context), log-log, floor dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for context, q in sorted({(r["context"], r.get("query_tokens", 1)) for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["context"] == context and r.get("query_tokens", 1) == q]
        sizes = [r["batch_size"] for r in rows]
        point = f"ctx {context}" + (f", q {q}" if q > 1 else "")
        ax.plot(sizes, [r["eager_ms"] for r in rows], "o-", label=f"eager, {point}")
        if rows[0]["graph_ms"] is not None:
            ax.plot(sizes, [r["graph_ms"] for r in rows], "s-", label=f"CUDA graph, {point}")
            ax.plot(sizes, [r["replay_ms"] for r in rows], "^:", label=f"graph replay (GPU), {point}")
            if rows[0].get("pipelined_ms") is not None:
                ax.plot(sizes, [r["pipelined_ms"] for r in rows], "d-", label=f"pipelined steps, {point}")
        if rows[0].get("unfused_graph_ms") is not None:
            ax.plot(sizes, [r["unfused_graph_ms"] for r in rows], "x-", label=f"CUDA graph unfused, {point}")
        if rows[0]["floor_ms"] is not None:
            ax.plot(sizes, [r["floor_ms"] for r in rows], "k--", label=f"HBM floor, {point}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    ticks_at(ax.xaxis, [r["batch_size"] for r in result["rows"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['model']} ({result['dtype']}) on {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(args) -> int:
    device = resolve_device(args.device)  # a device torch does not see is refused before the table starts
    if args.tensor_parallel_size > 1:
        return _main_parallel(args)
    if args.compare_unfused and device.type != "cuda":
        print("graphrt bench: --compare-unfused times CUDA graphs; on the CPU its column stays empty", file=sys.stderr)
    storage = [f"{args.quantization} weights"] if args.quantization else []
    storage += [f"{args.kv_cache_dtype} KV cache"] if args.kv_cache_dtype != "auto" else []
    if storage:
        print(f"{args.model}: {', '.join(storage)}")
    print(HEADER)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    result = run_bench(args.model, args.device, args.dtype, args.batch_sizes, args.contexts, args.steps,
                       fused_kernels=args.fused_kernels, dependent_launch=args.dependent_launch,
                       compare_unfused=args.compare_unfused, params=params, quantization=args.quantization,
                       kv_cache_dtype=args.kv_cache_dtype, query_tokens=args.query_tokens)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        write_plot(result, args.plot)
    return 0


def _main_parallel(args) -> int:
    """``bench --tensor-parallel-size N``: the engine's steady steps over N ranks (``graphrt.parallel_bench``)."""
    from graphrt.parallel_bench import PARALLEL_HEADER, run_parallel_bench

    unused = [flag for flag, used in (("--query-tokens", args.query_tokens != [1]),
                                      ("--compare-unfused", args.compare_unfused), ("--plot", args.plot),
                                      ("--temperature/--top-k/--top-p", (args.temperature, args.top_k, args.top_p)
                                       != (0.0, 0, 1.0))) if used]
    if unused:
        raise ConfigError(f"bench --tensor-parallel-size times greedy engine steps; {', '.join(unused)} "
                          "apply to one rank's bench only")
    print(PARALLEL_HEADER)
    result = run_parallel_bench(args.model, args.device, args.dtype, args.batch_sizes, args.contexts, args.steps,
                                args.tensor_parallel_size, fused_kernels=args.fused_kernels,
                                dependent_launch=args.dependent_launch, quantization=args.quantization,
                                kv_cache_dtype=args.kv_cache_dtype)
    if args.json:
        write_json(args.json, result)
    return 0
