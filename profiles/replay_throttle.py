"""Why pipelined steps at batch 256 run slower than replays timed one at a time (notes_fusion.md, change
14): each timing mode of ``graphrt bench`` beside the GPU's SM clock and power draw while it runs.

For each point, one captured engine (as ``graphrt bench`` builds it), four phases of ``--steps`` steps:

1. ``single``: replays one at a time, the host waiting for each (``graphrt bench``'s replay ms, median);
2. ``back_to_back``: the same replays queued without waiting, timed as a whole (mean per replay);
3. ``pipelined``: steps queued before the previous one's tokens are read (``graphrt bench``'s pipe ms);
4. ``single`` again.

``nvidia-smi`` samples the SM clock and power every 20 ms in the background; each phase reports the
median of its samples. If back-to-back replays slow down like the pipelined steps, and the clock drops
with them, the GPU is throttling under sustained load, not waiting on the host.

    python profiles/replay_throttle.py --json profiles/results/replay_throttle_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from graphrt.bench import _time_pipelined_steps, median_replay_ms
from graphrt.capture.buckets import choose_bucket
from graphrt.sampling_params import SamplingParams
from graphrt.workload import decode_engine, fill_decode_batch


class ClockSampler:
    """``nvidia-smi`` SM clock (MHz) and power (W) samples, each with its host time, from a background process."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                clock, power = (float(field) for field in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), clock, power))

    def between(self, start: float, end: float) -> dict:
        inside = [(clock, power) for t, clock, power in self.samples if start <= t <= end]
        if not inside:
            return {"samples": 0}
        return {"samples": len(inside), "sm_mhz": statistics.median(c for c, _ in inside),
                "power_w": statistics.median(p for _, p in inside)}

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)
        self._reader.join(timeout=10)


def back_to_back_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean GPU ms of a replay when ``replays`` of them are queued without the host waiting between."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def measure(model: str, batch: int, context: int, steps: int, clocks: ClockSampler) -> dict:
    engine = decode_engine(model, "cuda", "bfloat16", batch, context, enforce_eager=False)
    decode_batch = fill_decode_batch(engine, batch, context, SamplingParams(temperature=0.0))
    runner = engine.decode_runner
    runner.decode(decode_batch)
    graph = runner.graphs[(choose_bucket(runner.capture_sizes, len(decode_batch)), decode_batch.sampling_mode)]
    point = {"model": model, "batch": batch, "context": context, "steps": steps}
    phases = [("single", lambda: median_replay_ms(graph, steps)), ("back_to_back", lambda: back_to_back_ms(graph, steps)),
              ("pipelined", lambda: _time_pipelined_steps(runner, decode_batch, steps)),
              ("single_again", lambda: median_replay_ms(graph, steps))]
    for name, run in phases:
        torch.cuda.synchronize()
        start = time.perf_counter()
        ms = run()
        torch.cuda.synchronize()
        point[name] = {"ms": ms, **clocks.between(start, time.perf_counter())}
    print(f"{model:22} b{batch:<4} ctx{context:<5} " + "  ".join(
        f"{name} {point[name]['ms']:.3f} ms {point[name].get('sm_mhz', float('nan')):.0f} MHz "
        f"{point[name].get('power_w', float('nan')):.0f} W" for name, _ in phases), flush=True)
    del engine, decode_batch, graph
    torch.cuda.empty_cache()
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=["random:llama-3-8b:256:512", "random:llama-3.2-1b:256:4096",
                                                        "random:llama-3.2-1b:64:512"],
                        help="model:batch:context, the model a preset name (default: the bench's b256 points and a b64 one)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    clocks = ClockSampler()
    try:
        points = []
        for spec in args.points:
            model, batch, context = spec.rsplit(":", 2)
            points.append(measure(model, int(batch), int(context), args.steps, clocks))
    finally:
        clocks.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "points": points}, f, indent=2)


if __name__ == "__main__":
    main()
