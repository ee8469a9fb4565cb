"""Decode steps with the fused kernels launched plainly and as programmatic dependents, side by side.

For each (model, context, batch) the captured decode step is timed with ``dependent_launch`` off and
on (``EngineConfig.dependent_launch``; ``graphrt.kernels.dependent_launch``), the two alternating over
``--rounds`` rounds so drift on the machine hits both alike; medians over rounds of each round's
median step (end to end, host included) and replay (GPU only). Greedy tokens of a short batch-1
generation are compared between the two first (they must be identical).

    python profiles/bench_dependent_launch.py --json profiles/results/dependent_launch_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from graphrt import LLM, SamplingParams
from graphrt.bench import measure_read_bandwidth, time_graphs

#: (model, context, batch sizes) timed by default.
POINTS = [("random:smollm2-135m", 512, (1, 8)), ("random:llama-3.2-1b", 512, (1, 8, 64)),
          ("random:llama-3-8b", 512, (1,))]


def greedy_tokens(model: str, dependent_launch: bool) -> list[int]:
    llm = LLM(model, device="cuda", progress=False, max_num_seqs=1, max_model_len=256, num_kv_blocks=32,
              dependent_launch=dependent_launch)
    tokens = list(llm.generate([[5, 900, 77, 1234]], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))[0]
                  .token_ids)
    del llm
    torch.cuda.empty_cache()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="decode steps (and replays) a round")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "hbm_read_bandwidth_gbps": round(measure_read_bandwidth(device) / 1e9, 1), "rounds": args.rounds,
               "steps": args.steps, "points": []}
    greedy = SamplingParams(temperature=0.0)
    for model, context, batch_sizes in POINTS:
        same = greedy_tokens(model, False) == greedy_tokens(model, True)
        print(f"{model}: batch-1 greedy tokens identical with and without dependent launch: {same}", flush=True)
        for batch in batch_sizes:
            samples = {False: ([], []), True: ([], [])}
            for _ in range(args.rounds):
                for dependent_launch in (False, True):
                    step, replay, _, _, _ = time_graphs(model, device, "auto", batch, context, args.steps, None,
                                                        greedy, dependent_launch=dependent_launch)
                    samples[dependent_launch][0].append(step)
                    samples[dependent_launch][1].append(replay)
            point = {"model": model, "context": context, "batch_size": batch, "same_greedy_tokens": same}
            for dependent_launch, name in ((False, "plain"), (True, "dependent")):
                steps, replays = samples[dependent_launch]
                point[f"{name}_step_ms"] = round(statistics.median(steps), 4)
                point[f"{name}_replay_ms"] = round(statistics.median(replays), 4)
            point["replay_ratio"] = round(point["dependent_replay_ms"] / point["plain_replay_ms"], 3)
            point["step_ratio"] = round(point["dependent_step_ms"] / point["plain_step_ms"], 3)
            print(f"{model:22} ctx {context:5} batch {batch:3}: replay {point['plain_replay_ms']:.4f} -> "
                  f"{point['dependent_replay_ms']:.4f} ms ({point['replay_ratio']:.3f}x), step "
                  f"{point['plain_step_ms']:.4f} -> {point['dependent_step_ms']:.4f} ms ({point['step_ratio']:.3f}x)",
                  flush=True)
            results["points"].append(point)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
