"""Decode steps of 2-16 sequences on the few-rows layers (``graphrt.kernels.few_rows``) against cuBLAS's.

Per point (model, batch, context) one captured engine, greedy graph only: the step is captured and its
replay timed with the layers on cuBLAS (``few_rows_max_tokens = 0``: ten kernels a layer) and on the
few-rows kernels (six, all dependent launches), alternating over ``--rounds`` rounds; the greedy tokens
of both are compared (the kernels sum in another order and round the norm elsewhere, so near-ties may
differ). With ``--sweep`` the few-rows tiles are then chosen inside the step at the points it names, as
``bench_step_tiles.py`` does for the batch-1 GEMV: per matrix each candidate tile replaces its entry in
``few_rows.MEASURED_TILES``, the graph is captured again and its replay timed; the winners are combined
and timed against the default tiles, alternating.

    python profiles/bench_step_few_rows.py --json profiles/results/step_few_rows_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_sweep import capture_greedy_graphs_only, greedy_engine, parse_point, results_header, write_results

from graphrt.bench import recaptured_replay_ms
from graphrt.kernels import few_rows

#: model -> its matrices' MEASURED_TILES keys (weight rows, in_features, SiLU * up).
MATRICES = {
    "random:llama-3-8b": {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
                          "down": (4096, 14336, False)},
    "random:llama-3.2-1b": {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate_up": (16384, 2048, True),
                            "down": (2048, 8192, False)},
    "random:smollm2-135m": {"qkv": (960, 576, False), "o": (576, 576, False), "gate_up": (3072, 576, True),
                            "down": (576, 1536, False)},
}

#: Shared memory a tile may take (bytes): the H200's per-block limit less Triton's conversion scratch.
_SHARED_BUDGET = 216 * 1024


def candidates(key: tuple[int, int, bool]) -> list[few_rows.FewRowsTile]:
    """Tiles of 16-128 outputs and K slices of 128-2048 (at most the row), deep pipelines of short slices
    (experiment 12's winners alone) and single long slices loaded at once before the wait (as the batch-1
    GEMV does), whose pipelined slices fit the shared memory."""
    _, k, silu = key
    widest = max(128, 1 << (k - 1).bit_length())
    tiles = []
    for block_n, block_k, warps, stages in [(64, 256, 4, 4), (64, 256, 4, 5), (64, 128, 8, 4), (128, 128, 8, 3),
                                            (32, 256, 4, 5), (32, 512, 4, 3), (16, 512, 4, 4), (64, 512, 8, 2),
                                            (16, 1024, 8, 1), (16, 2048, 8, 1), (32, 1024, 8, 1), (16, 256, 4, 6)]:
        per_slice = 2 * block_k * (block_n * (2 if silu else 1) + few_rows.MAX_ROWS)
        if block_k <= widest and per_slice * max(stages, 1) <= _SHARED_BUDGET:
            tiles.append(few_rows.FewRowsTile(block_n, block_k, warps, stages))
    return tiles


def compare(runner, model, batch, rounds: int, replays: int) -> dict:
    """cuBLAS layers against few-rows layers in one engine, alternating rounds."""
    layers_max = model.few_rows_max_tokens
    samples, tokens = {"cublas": [], "few_rows": []}, {}
    for _ in range(rounds):
        for name, max_tokens in (("cublas", 0), ("few_rows", layers_max)):
            model.few_rows_max_tokens = max_tokens
            ms, tokens[name] = recaptured_replay_ms(runner, batch, replays)
            samples[name].append(round(ms, 4))
    model.few_rows_max_tokens = layers_max
    cublas, fused = (statistics.median(samples[name]) for name in ("cublas", "few_rows"))
    return {"cublas_ms": cublas, "few_rows_ms": fused, "ratio": round(fused / cublas, 4), "rounds_ms": samples,
            "same_tokens": tokens["cublas"] == tokens["few_rows"]}


def sweep(runner, batch, model_name: str, rounds: int, replays: int, budget_s: float, margin: float) -> dict:
    """Few-rows tiles per matrix chosen in the step, then the winners combined against the defaults."""
    original = dict(few_rows.MEASURED_TILES)

    def step_ms(tiles: dict) -> tuple[float, list[int]]:
        few_rows.MEASURED_TILES.clear()
        few_rows.MEASURED_TILES.update({**original, **tiles})
        return recaptured_replay_ms(runner, batch, replays)

    baseline_ms, baseline_tokens = step_ms({})
    entry, winners = {"baselines_ms": [round(baseline_ms, 4)], "matrices": {}}, {}
    deadline = time.perf_counter() + budget_s
    for matrix, key in MATRICES[model_name].items():
        timed, tiles = {}, {}
        for tile in candidates(key):
            if time.perf_counter() > deadline:
                break
            name = f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"
            try:
                ms, tokens = step_ms({key: tile})
            except Exception as error:  # e.g. out of shared memory for one epilogue: that tile is out
                entry.setdefault("failed", {})[f"{matrix} {name}"] = f"{type(error).__name__}: {error}"[:300]
                continue
            timed[name], tiles[name] = (round(ms, 4), tokens == baseline_tokens), tile
        if not timed:
            break
        entry["baselines_ms"].append(round(step_ms({})[0], 4))  # drift between matrices
        base = statistics.median(entry["baselines_ms"])
        best_name, (best_ms, _) = min(timed.items(), key=lambda item: item[1][0])
        entry["matrices"][matrix] = {"timed_ms": timed, "best": best_name, "ratio_to_default": round(best_ms / base, 4)}
        print(f"  {matrix:8} default {base:.4f} ms; best {best_name} {best_ms:.4f} ms ({best_ms / base:.4f}x)",
              flush=True)
        if best_ms < base * (1 - margin):
            winners[key] = tiles[best_name]
    if winners:
        samples = {"default": [], "combined": []}
        for _ in range(rounds):
            samples["default"].append(round(step_ms({})[0], 4))
            combined_ms, combined_tokens = step_ms(winners)
            samples["combined"].append(round(combined_ms, 4))
        default, combined = (statistics.median(samples[name]) for name in ("default", "combined"))
        entry["combined"] = {"tiles": {str(key): vars(tile) for key, tile in winners.items()}, "default_ms": default,
                             "combined_ms": combined, "ratio": round(combined / default, 4), "rounds_ms": samples,
                             "same_tokens": combined_tokens == baseline_tokens}
        print(f"  combined {entry['combined']['tiles']}: {default:.4f} -> {combined:.4f} ms", flush=True)
    few_rows.MEASURED_TILES.clear()
    few_rows.MEASURED_TILES.update(original)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=[f"{m}:{b}:512" for m in MATRICES for b in (2, 4, 8, 16)],
                        help="model:batch:context to compare")
    parser.add_argument("--sweep", nargs="*", default=[], help="model:batch:context points to choose tiles at")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.005, help="gain a tile needs to enter the combination")
    parser.add_argument("--budget-s", type=float, default=90, help="sweep seconds a point, then combine")
    args = parser.parse_args()
    capture_greedy_graphs_only()
    results = results_header(replays=args.replays, rounds=args.rounds, points=[], sweeps=[])
    for point in args.points + [f"sweep:{p}" for p in args.sweep]:
        sweeping = point.startswith("sweep:")
        model_name, batch_size, context = parse_point(point.removeprefix("sweep:"))
        engine, batch = greedy_engine(model_name, batch_size, context)
        runner, model = engine.decode_runner, engine.model
        if not model.runs_few_rows_layers(batch_size):
            print(f"{point}: the model does not take few-rows layers at batch {batch_size}", flush=True)
            continue
        head = {"model": model_name, "batch_size": batch_size, "context": context}
        if sweeping:
            print(f"sweep {model_name} batch {batch_size} context {context}", flush=True)
            results["sweeps"].append({**head, **sweep(runner, batch, model_name, args.rounds, args.replays,
                                                      args.budget_s, args.margin)})
        else:
            entry = {**head, **compare(runner, model, batch, args.rounds, args.replays)}
            results["points"].append(entry)
            print(f"{model_name:22} batch {batch_size:3} ctx {context}: cuBLAS {entry['cublas_ms']:.4f} ms, few rows "
                  f"{entry['few_rows_ms']:.4f} ms ({entry['ratio']:.3f}x), same tokens {entry['same_tokens']}",
                  flush=True)
        engine = batch = runner = model = None  # freed before the next engine
        torch.cuda.empty_cache()
        write_results(args.json, results)


if __name__ == "__main__":
    main()
