"""Paged-decode split counts and K/V tiles chosen inside the decode step rather than alone.

``graphrt profile``'s exposed times put the batch-1 attention at 4.9-7.5 us a layer (SmolLM2, 1B,
8B at context 512; profiles/notes_fusion.md, experiment 21), the largest part of a SmolLM2 layer,
though it reads 0.1-1 MB. Its split count (``choose_num_splits``) and tile (``default_config``) were
measured with the kernel alone; the GEMV tiles measured alone were off in the step
(``bench_step_tiles.py``). Here, per model:batch:context point (``--points``; by default batch 1 at
context 512; the greedy graph only), each (splits, tokens a tile, warps) variant of ``variants_for``
replaces both choices, the graph is captured again and its replay timed; then the fastest variant and
today's choice alternate over ``--rounds`` rounds. Each variant's greedy token is compared with today's
(other splits sum in another order). ``results/step_attention_h200.json`` ran 12 of today's 18
variants at context 512.

``--compare-rule`` times ``choose_launch``'s rules for ``SHORT_CONTEXT_TILE`` (64-token tiles and splits
where short contexts leave SMs idle, and 64-token tiles where unsplit programs overflow one wave) on and
off instead, alternating, at ``--points`` (default: batch 8 at context 512, which the first sweep did
not cover); off, both rules are off.

    python profiles/bench_step_attention.py --json profiles/results/step_attention_h200.json
    python profiles/bench_step_attention.py --points random:llama-3.2-1b:1:4096 --json step_attention_4096.json
    python profiles/bench_step_attention.py --compare-rule --json profiles/results/short_context_rule_h200.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from step_sweep import capture_greedy_graphs_only, greedy_engine, parse_point, results_header, write_results

import graphrt.attention.triton_paged_decode as paged_decode
from graphrt.bench import recaptured_replay_ms

#: model:batch:context points the sweep times by default (batch 1 at context 512, experiment 21's).
SWEEP_POINTS = "random:smollm2-135m:1:512,random:llama-3.2-1b:1:512,random:llama-3-8b:1:512"


def variants_for(context: int) -> list:
    """(splits, tokens a K/V tile, warps) to time at ``context``, None first (today's choice): tiles of
    128, 64 and 32 tokens (32 at 2 warps too), 1 to 64 splits in powers of two while each split still
    holds a whole tile (a split holds whole tiles, so more would leave the extra ones empty)."""
    variants = [None]
    for block_n, warps in ((128, 4), (64, 4), (32, 4), (32, 2)):
        splits = 1
        while splits <= min(paged_decode.MAX_SPLITS, max(context // block_n, 1)):
            variants.append((splits, block_n, warps))
            splits *= 2
    return variants

_choose_num_splits, _default_config = paged_decode.choose_num_splits, paged_decode.default_config
_short_context_tile = paged_decode.SHORT_CONTEXT_TILE


def apply(variant) -> None:
    """Installs ``variant``'s split count and tile in the paged decode's module (None: today's choices)."""
    if variant is None:
        paged_decode.choose_num_splits, paged_decode.default_config = _choose_num_splits, _default_config
        paged_decode.SHORT_CONTEXT_TILE = _short_context_tile
        return
    paged_decode.SHORT_CONTEXT_TILE = 1 << 30  # the variant's tile as it is
    splits, block_n, warps = variant
    paged_decode.choose_num_splits = lambda *args, **kwargs: splits
    paged_decode.default_config = lambda *args, **kwargs: paged_decode.DecodeConfig(block_n, warps, 3)


def compare_rule(points: list[str], rounds: int, replays: int) -> list[dict]:
    """The short-context rule on and off at each model:batch:context point, alternating over rounds."""
    entries = []
    rule_tile = paged_decode.SHORT_CONTEXT_TILE
    for point in points:
        model, batch_size, context = parse_point(point)
        engine, batch = greedy_engine(model, batch_size, context)
        runner = engine.decode_runner
        samples, tokens = {"off": [], "on": []}, {}
        try:
            for round_index in range(rounds):
                states = [("off", 1 << 30), ("on", rule_tile)]  # off: every tile counts as short already
                for state, tile in states if round_index % 2 == 0 else states[::-1]:  # no order bias
                    paged_decode.SHORT_CONTEXT_TILE = tile
                    ms, tokens[state] = recaptured_replay_ms(runner, batch, replays)
                    samples[state].append(ms)
        finally:
            paged_decode.SHORT_CONTEXT_TILE = rule_tile
        off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
        entries.append({"model": model, "batch_size": batch_size, "context": context, "off_ms": round(off, 4),
                        "on_ms": round(on, 4), "ratio": round(on / off, 4), "rounds_ms": samples,
                        "same_tokens": tokens["on"] == tokens["off"]})
        print(f"{model:22} batch {batch_size:3} ctx {context:5}: rule off {off:.4f} -> on {on:.4f} ms "
              f"({on / off:.4f}x), same tokens {tokens['on'] == tokens['off']}", flush=True)
        engine = batch = runner = None
        torch.cuda.empty_cache()
    return entries


def name_of(variant) -> str:
    return "today" if variant is None else "{}x{} w{}".format(*variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-rule", action="store_true", help="time the short-context rule on and off")
    parser.add_argument("--points", help="model:batch:context, comma-separated (default: the mode's points)")
    args = parser.parse_args()
    capture_greedy_graphs_only()
    results = results_header(replays=args.replays, rounds=args.rounds, models=[])
    if args.compare_rule:
        points = args.points or "random:smollm2-135m:8:512,random:llama-3.2-1b:8:512,random:llama-3-8b:8:512"
        results["points"] = compare_rule(points.split(","), args.rounds, args.replays)
        write_results(args.json, results)
        return
    for point in (args.points or SWEEP_POINTS).split(","):
        model, batch_size, context = parse_point(point)
        engine, batch = greedy_engine(model, batch_size, context)
        runner = engine.decode_runner
        variants = variants_for(context)

        def step(variant) -> tuple[float, list[int]]:
            apply(variant)
            return recaptured_replay_ms(runner, batch, args.replays)

        timed = {}
        _, today_token = step(None)
        for variant in variants:
            ms, token = step(variant)
            timed[name_of(variant)] = (round(ms, 4), token == today_token)
        best = min(variants, key=lambda variant: timed[name_of(variant)][0])
        entry = {"model": model, "batch_size": batch_size, "context": context, "timed_ms": timed, "best": name_of(best)}
        if best is not None:
            rounds = {"today": [], name_of(best): []}
            for _ in range(args.rounds):
                rounds["today"].append(step(None)[0])
                rounds[name_of(best)].append(step(best)[0])
            today, chosen = statistics.median(rounds["today"]), statistics.median(rounds[name_of(best)])
            entry.update(rounds_ms=rounds, today_ms=round(today, 4), best_ms=round(chosen, 4),
                         ratio=round(chosen / today, 4))
            print(f"{point:30} best {name_of(best)}: {today:.4f} -> {chosen:.4f} ms ({chosen / today:.4f}x)",
                  flush=True)
        print(f"{point:30} " + ", ".join(f"{name} {ms:.4f}{'' if same else ' (token differs)'}"
                                         for name, (ms, same) in timed.items()), flush=True)
        results["models"].append(entry)
        apply(None)
        engine = batch = runner = None  # freed before the next model's engine
        torch.cuda.empty_cache()
        write_results(args.json, results)


if __name__ == "__main__":
    main()
