"""Batch-1 GEMV tiles chosen inside the decode step rather than alone.

``gemv.MEASURED_TILES`` held the tile each matrix ran fastest with in ``bench_gemv.py`` (change 21
replaced six with this script's winners): the same kernel launched back to back, each overlapping its
twin's tail. In the step each kernel follows another one (the fused QKV follows the previous layer's down
projection, O follows the attention), and ``graphrt profile``'s exposed times (profiles/notes_fusion.md,
experiment 21) put the 8B's fused QKV at 21 us a layer against 15.4 us alone. Here the step itself is the
measure: per model one engine (batch 1, ``--context`` 512 by default, the greedy graph only), and for each
matrix each candidate tile replaces its entry, the graph is captured again and its replay timed (median of
``--replays``), with the unchanged step timed again between matrices. Then the candidates that beat the
unchanged step by more than ``--margin`` are combined and the combination is timed against the unchanged
step, alternating over ``--rounds`` rounds. Each run's greedy token is compared with the unchanged step's
and reported (a tile changes the products' summation order, so a near tie could differ). The fused QKV
kernel's tile is derived from the QKV entry (``qkv_tile``: half the outputs a program).

    python profiles/bench_step_tiles.py --json profiles/results/step_tiles_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_sweep import capture_greedy_graphs_only, greedy_engine, results_header, write_results

from graphrt.bench import recaptured_replay_ms
from graphrt.kernels import gemv

#: model -> its matrices' MEASURED_TILES keys, most promising first (exposed times above their floors).
MODELS = {
    "random:llama-3-8b": {"qkv": (6144, 4096, False), "down": (4096, 14336, False), "o": (4096, 4096, False),
                          "gate_up": (28672, 4096, True)},
    "random:llama-3.2-1b": {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "down": (2048, 8192, False),
                            "gate_up": (16384, 2048, True)},
    "random:smollm2-135m": {"qkv": (960, 576, False), "o": (576, 576, False), "gate_up": (3072, 576, True),
                            "down": (576, 1536, False)},
}


def candidates(key: tuple[int, int, bool]) -> list[gemv.TileConfig]:
    """Tiles of 4-16 outputs, K slices of 512-2048 (at most the row, rounded up to a power of two), 4 or 8
    warps, at most 32K weight elements a slice (gate and up together)."""
    rows, k, silu = key
    widest = max(512, 1 << (k - 1).bit_length())
    tiles = []
    for block_n in (4, 8, 16):
        for block_k in (512, 1024, 2048):
            if block_k > widest or block_n * block_k * (2 if silu else 1) > 32768:
                continue
            for warps in (4, 8):
                tiles.append(gemv.TileConfig(block_n, block_k, warps))
    return tiles


def time_step(runner, batch, original: dict, tiles: dict, replays: int) -> tuple[float, list[int]]:
    """(median replay ms, greedy token) of ``batch``'s step with ``tiles`` over the ``original`` tiles."""
    gemv.MEASURED_TILES.update(original)
    gemv.MEASURED_TILES.update(tiles)
    return recaptured_replay_ms(runner, batch, replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.01, help="gain a tile needs to enter the combination")
    parser.add_argument("--budget-s", type=float, default=110, help="sweep seconds a model, then combine")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--context", type=int, default=512, help="tokens in the sequence (batch 1)")
    parser.add_argument("--matrices", default="qkv,o,gate_up,down", help="the matrices to sweep, in this order")
    args = parser.parse_args()
    unknown = [model for model in args.models.split(",") if model not in MODELS]
    if unknown:
        parser.error(f"no matrices listed for {', '.join(unknown)}; known: {', '.join(MODELS)}")
    capture_greedy_graphs_only()
    original = dict(gemv.MEASURED_TILES)
    results = results_header(replays=args.replays, rounds=args.rounds, margin=args.margin, models=[])
    for model in args.models.split(","):
        engine, batch = greedy_engine(model, 1, args.context)
        runner = engine.decode_runner

        def step_ms(tiles: dict) -> tuple[float, list[int]]:
            return time_step(runner, batch, original, tiles, args.replays)

        baseline_ms, baseline_token = step_ms({})
        entry = {"model": model, "context": args.context,
                 "current_tiles": {m: vars(original[k]) for m, k in MODELS[model].items()},
                 "sweep": {}, "baselines_ms": [round(baseline_ms, 4)]}
        winners = {}
        deadline = time.perf_counter() + args.budget_s
        for matrix in args.matrices.split(","):
            key = MODELS[model][matrix]
            if time.perf_counter() > deadline:
                break
            timed, tiles = {}, {}
            for tile in candidates(key):
                if time.perf_counter() > deadline:
                    break
                ms, token = step_ms({key: tile})
                name = f"{tile.block_n}x{tile.block_k} w{tile.num_warps}"
                timed[name], tiles[name] = (round(ms, 4), token == baseline_token), tile
            reference, _ = step_ms({})  # drift check between matrices
            entry["baselines_ms"].append(round(reference, 4))
            base = statistics.median(entry["baselines_ms"])
            best_name, (best_ms, _) = min(timed.items(), key=lambda item: item[1][0])
            entry["sweep"][matrix] = {"timed_ms": timed, "best": best_name, "best_ms": best_ms,
                                      "ratio_to_current": round(best_ms / base, 4)}
            print(f"{model:22} {matrix:8} current {vars(original[key])} step {base:.4f} ms; best {best_name} "
                  f"{best_ms:.4f} ms ({best_ms / base:.4f}x)", flush=True)
            if best_ms < base * (1 - args.margin):
                winners[key] = tiles[best_name]
        if winners:
            samples = {"current": [], "combined": []}
            for _ in range(args.rounds):
                samples["current"].append(step_ms({})[0])
                combined_ms, combined_token = step_ms(winners)
                samples["combined"].append(combined_ms)
            current, combined = (statistics.median(samples[name]) for name in ("current", "combined"))
            entry["combined"] = {"tiles": {str(k): vars(v) for k, v in winners.items()},
                                 "current_ms": round(current, 4), "combined_ms": round(combined, 4),
                                 "ratio": round(combined / current, 4), "rounds_ms": samples,
                                 "same_token": combined_token == baseline_token}
            print(f"{model:22} combined {entry['combined']['tiles']}: {current:.4f} -> {combined:.4f} ms "
                  f"({combined / current:.4f}x), same token {combined_token == baseline_token}", flush=True)
        results["models"].append(entry)
        gemv.MEASURED_TILES.clear()
        gemv.MEASURED_TILES.update(original)
        engine = batch = runner = None  # freed before the next model's engine
        torch.cuda.empty_cache()
        write_results(args.json, results)


if __name__ == "__main__":
    main()
