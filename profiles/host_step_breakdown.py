"""Where the host time of one replayed decode step goes: static-buffer refresh (and, of it, the one
host-to-device copy call alone), the graph launch call, and the wait for the sampled tokens, beside the
replay's GPU time (CUDA events).

    python profiles/host_step_breakdown.py --model random:llama-3.2-1b --batch-size 1 --context 512

Prints medians in microseconds and, with --json, writes them. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from graphrt.capture.buckets import choose_bucket
from graphrt.cli import add_model_arguments, kernel_options
from graphrt.workload import decode_workload


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def measure(args) -> dict:
    engine, batch = decode_workload(args.model, args.device, args.dtype, args.batch_size, args.context,
                                    enforce_eager=False, **kernel_options(args))
    runner = engine.decode_runner
    padded = choose_bucket(runner.capture_sizes, len(batch))
    graph = runner.graphs[(padded, "greedy")]
    for _ in range(5):
        runner.decode(batch)
    parts = {"refresh": [], "upload": [], "launch": [], "wait_tokens": [], "decode_call": [], "replay_gpu": []}
    staging = runner.graph_state.packed
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner._refresh(batch, padded)
        t1 = time.perf_counter()
        graph.replay()
        t2 = time.perf_counter()
        runner.next_tokens[: len(batch)].tolist()
        t3 = time.perf_counter()
        parts["refresh"].append(t1 - t0)
        parts["launch"].append(t2 - t1)
        parts["wait_tokens"].append(t3 - t2)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        staging.upload(staging.bytes_through("block_tables", padded))  # the refresh's copy, as it issues it
        parts["upload"].append(time.perf_counter() - t4)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        runner.decode(batch)
        parts["decode_call"].append(time.perf_counter() - t4)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        parts["replay_gpu"].append(start.elapsed_time(end) / 1e3)
    if args.cprofile:  # the host functions a decode call spends its time in (the GPU wait shows as the token event's synchronize)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            runner.decode(batch)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    return {"model": args.model, "batch_size": args.batch_size, "context": args.context,
            "fused_kernels": engine.fused_kernels, "dependent_launch": engine.dependent_launch,
            **{f"{k}_us": _median_us(v) for k, v in parts.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model="random:llama-3.2-1b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", help="write the medians to this file")
    parser.add_argument("--cprofile", action="store_true", help="also print the host functions of decode calls")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_step_breakdown: needs a CUDA device", file=sys.stderr)
        return 2
    result = measure(args)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
