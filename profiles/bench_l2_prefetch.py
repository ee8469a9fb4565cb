"""Batch-1 decode steps with the GEMV kernels asking L2 for their weights before their dependency wait.

With dependent launches a kernel's programs are scheduled while the kernel before still runs, and
load their first weight slice into registers before they wait for it (``graphrt.kernels.gemv``). A
bulk L2 prefetch (``gemv.prefetch_to_l2``) lets them start the rest of their rows on the way too, at no
register cost: useful where the kernel before leaves HBM idle, as the latency-bound attention does
before the O projection. ``gemv.L2_PREFETCH_BUDGETS`` sets, per matrix, how many bytes a kernel's
programs ask for in all. For each point one engine is built; each variant sets the budgets (and, for
some, a tile), captures the graph again and times its replay, the variants alternating over
``--rounds`` rounds; medians over rounds of each round's median replay. The greedy token of every
variant must equal the baseline's (a prefetch changes no arithmetic; tests/test_dependent_launch.py checks
the bits).

    python profiles/bench_l2_prefetch.py --json profiles/results/l2_prefetch_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from graphrt.bench import measure_read_bandwidth, median_replay_ms
from graphrt.kernels import gemv
from graphrt.sampling_params import SamplingParams
from graphrt.workload import decode_engine, fill_decode_batch

MB = 1 << 20

#: name -> (L2 budgets by matrix, tile overrides by gemv.MEASURED_TILES key)
VARIANTS = {
    "none": ({}, {}),
    "o_16mb": ({"o": 16 * MB}, {}),
    "o_32mb": ({"o": 32 * MB}, {}),
    "o_gate_up_16mb": ({"o": 16 * MB, "gate_up": 16 * MB}, {}),
    "all_16mb": ({"o": 16 * MB, "gate_up": 16 * MB, "down": 16 * MB}, {}),
    # The register route to the same end: the 8B's O with whole rows a program, all loaded before the wait.
    "o_whole_rows": ({}, {(4096, 4096, False): gemv.TileConfig(4, 4096, 4)}),
}

POINTS = [("random:smollm2-135m", 512), ("random:llama-3.2-1b", 512), ("random:llama-3.2-1b", 4096),
          ("random:llama-3-8b", 512)]


def apply(variant: str) -> None:
    budgets, tiles = VARIANTS[variant]
    for matrix in gemv.L2_PREFETCH_BUDGETS:
        gemv.L2_PREFETCH_BUDGETS[matrix] = budgets.get(matrix, 0)
    gemv.MEASURED_TILES.update(ORIGINAL_TILES)
    gemv.MEASURED_TILES.update(tiles)


ORIGINAL_TILES = dict(gemv.MEASURED_TILES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = args.variants.split(",")
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "l2_bytes": torch.cuda.get_device_properties(device).L2_cache_size,
               "hbm_read_bandwidth_gbps": round(measure_read_bandwidth(device) / 1e9, 1),
               "rounds": args.rounds, "replays": args.replays,
               "variants": {name: {"budgets": budgets, "tiles": {str(k): vars(v) for k, v in tiles.items()}}
                            for name, (budgets, tiles) in VARIANTS.items() if name in variants},
               "points": []}
    for model, context in POINTS:
        engine = decode_engine(model, "cuda", "auto", 1, context, enforce_eager=False)
        batch = fill_decode_batch(engine, 1, context, SamplingParams(temperature=0.0))
        runner = engine.decode_runner
        samples = {name: [] for name in variants}
        tokens = {}
        for _ in range(args.rounds):
            for name in variants:
                apply(name)
                runner.graphs.clear()
                torch.cuda.empty_cache()
                runner.capture(progress=False)
                tokens.setdefault(name, runner.decode(batch))
                samples[name].append(median_replay_ms(runner.graphs[(1, batch.sampling_mode)], args.replays))
        apply("none")
        base = statistics.median(samples["none"]) if "none" in samples else None
        point = {"model": model, "context": context, "batch_size": 1, "replay_ms": {}, "ratio_to_none": {},
                 "same_tokens": {}}
        for name in variants:
            replay = statistics.median(samples[name])
            point["replay_ms"][name] = round(replay, 4)
            point["rounds_ms"] = point.get("rounds_ms", {}) | {name: [round(v, 4) for v in samples[name]]}
            if base:
                point["ratio_to_none"][name] = round(replay / base, 4)
            point["same_tokens"][name] = tokens[name] == tokens[variants[0]]
            print(f"{model:22} ctx {context:5}: {name:16} replay {replay:.4f} ms"
                  + (f" ({replay / base:.4f}x)" if base else "") + f" same token {point['same_tokens'][name]}",
                  flush=True)
        results["points"].append(point)
        del engine, batch, runner
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
