"""Decode steps with one switch of the dependent-launch path off and on, side by side.

``--switch dependent-launch`` (default): the fused kernels launched plainly against as programmatic
dependents (``EngineConfig.dependent_launch``; ``graphrt.kernels.dependent_launch``).
``--switch early-tile-loads``: with dependent launches, the paged decode's one-tile slices loaded after
the wait for the previous kernel against before it (``triton_paged_decode.EARLY_TILE_LOADS``).

For each (model, context, batch) the captured decode step is timed with the switch off and on, the two
alternating over ``--rounds`` rounds so drift on the machine hits both alike; medians over rounds of
each round's median step (end to end, host included) and replay (GPU only). Greedy tokens of a short
batch-1 generation are compared between the two first (they must be identical).

    python profiles/bench_dependent_launch.py --json profiles/results/dependent_launch_h200.json
    python profiles/bench_dependent_launch.py --switch early-tile-loads --json profiles/results/early_tile_loads_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from graphrt import LLM, SamplingParams
from graphrt.attention import triton_paged_decode
from graphrt.bench import measure_read_bandwidth, time_graphs

#: (model, context, batch sizes) timed by default.
POINTS = [("random:smollm2-135m", 512, (1, 8)), ("random:llama-3.2-1b", 512, (1, 8, 64)),
          ("random:llama-3-8b", 512, (1,))]


def _dependent_launch(on: bool) -> dict:
    return {"dependent_launch": on}


def _early_tile_loads(on: bool) -> dict:
    triton_paged_decode.EARLY_TILE_LOADS = on  # read at each launch, so at capture
    return {}


#: switch -> (name off, name on, function(on) that sets it and returns the EngineConfig fields it needs).
SWITCHES = {"dependent-launch": ("plain", "dependent", _dependent_launch),
            "early-tile-loads": ("late", "early", _early_tile_loads)}


def greedy_tokens(model: str, options: dict) -> list[int]:
    llm = LLM(model, device="cuda", progress=False, max_num_seqs=1, max_model_len=256, num_kv_blocks=32, **options)
    tokens = list(llm.generate([[5, 900, 77, 1234]], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))[0]
                  .token_ids)
    del llm
    torch.cuda.empty_cache()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="dependent-launch")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="decode steps (and replays) a round")
    parser.add_argument("--models", nargs="+", metavar="MODEL", help="of POINTS, only these (e.g. random:llama-3.2-1b)")
    args = parser.parse_args()
    off_name, on_name, turn = SWITCHES[args.switch]
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "switch": args.switch,
               "hbm_read_bandwidth_gbps": round(measure_read_bandwidth(device) / 1e9, 1), "rounds": args.rounds,
               "steps": args.steps, "points": []}
    greedy = SamplingParams(temperature=0.0)
    for model, context, batch_sizes in POINTS:
        if args.models and model not in args.models:
            continue
        same = greedy_tokens(model, turn(False)) == greedy_tokens(model, turn(True))
        print(f"{model}: batch-1 greedy tokens identical {off_name} and {on_name}: {same}", flush=True)
        for batch in batch_sizes:
            samples = {False: ([], []), True: ([], [])}
            for _ in range(args.rounds):
                for on in (False, True):
                    step, replay, _, _, _ = time_graphs(model, device, "auto", batch, context, args.steps, None,
                                                        greedy, **turn(on))
                    samples[on][0].append(step)
                    samples[on][1].append(replay)
            point = {"model": model, "context": context, "batch_size": batch, "same_greedy_tokens": same}
            for on, name in ((False, off_name), (True, on_name)):
                steps, replays = samples[on]
                point[f"{name}_step_ms"] = round(statistics.median(steps), 4)
                point[f"{name}_replay_ms"] = round(statistics.median(replays), 4)
            point["replay_ratio"] = round(point[f"{on_name}_replay_ms"] / point[f"{off_name}_replay_ms"], 3)
            point["step_ratio"] = round(point[f"{on_name}_step_ms"] / point[f"{off_name}_step_ms"], 3)
            print(f"{model:22} ctx {context:5} batch {batch:3}: replay {point[f'{off_name}_replay_ms']:.4f} -> "
                  f"{point[f'{on_name}_replay_ms']:.4f} ms ({point['replay_ratio']:.3f}x), step "
                  f"{point[f'{off_name}_step_ms']:.4f} -> {point[f'{on_name}_step_ms']:.4f} ms "
                  f"({point['step_ratio']:.3f}x)", flush=True)
            results["points"].append(point)
    turn(True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
