"""Module-level switches of graphrt A/B'd inside the captured decode step: the step's graph captured with
the switches as they stand (A), then with each variant's values, replayed in alternating rounds.

A switch such as ``graphrt.attention.triton_paged_decode.L2_PREFETCH_FIRST_TILE`` changes what the decode
graph's kernels do, not its shape; the graph is recaptured for each side (``tiles_in_step.StepTimer``), so a
round compares graphs of the same engine on the same cache. Prints each round, the medians and the greedy
token of each side (a kernel change that alters results shows there); writes it all as JSON. Needs CUDA.

    python profiles/step_ab.py --model random:llama-3-8b --quantization fp8 --batch-size 8 \\
        --set graphrt.attention.triton_paged_decode.L2_PREFETCH_FIRST_TILE=True \\
        --set graphrt.kernels.fp8_matmul.ROWS_TMA=False \\
        --set graphrt.kernels.fp8_matmul.ROWS_TMA=False,graphrt.attention.triton_paged_decode.L2_PREFETCH_FIRST_TILE=True
"""

import argparse
import ast
import importlib
import json
import statistics

import torch

from tiles_in_step import StepTimer, add_step_arguments


def parse_variant(text: str) -> list[tuple[object, str, object]]:
    """``package.module.NAME=literal[,package.module.NAME=literal...]`` -> [(module, NAME, value)]."""
    variant = []
    for assignment in text.split(","):
        target, _, literal = assignment.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        if not module_name or not literal:
            raise argparse.ArgumentTypeError(f"expected package.module.NAME=value, got {assignment!r}")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise argparse.ArgumentTypeError(f"{module_name} has no {name}")
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError) as error:
            raise argparse.ArgumentTypeError(f"{literal!r} is not a Python literal") from error
        variant.append((module, name, value))
    return variant


def describe(variant) -> str:
    return ", ".join(f"{module.__name__}.{name}={value!r}" for module, name, value in variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--set", dest="variants", action="append", type=parse_variant, required=True,
                        help="a B side: package.module.NAME=value, several joined by commas (repeat --set for "
                             "more B sides)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    timer = StepTimer.for_model(args, args.batch_size, "step_ab.py")
    original = {(module, name): getattr(module, name) for variant in args.variants for module, name, _ in variant}
    sides = {"A": []} | {describe(variant): [] for variant in args.variants}
    label = f"{args.model} {args.quantization or 'bf16'} batch {args.batch_size} context {args.context}"
    print(f"# {label}: replay ms of the whole decode step; A: "
          f"{describe([(module, name, value) for (module, name), value in original.items()])}", flush=True)

    def restore():
        for (module, name), value in original.items():
            setattr(module, name, value)

    try:
        for round_index in range(args.rounds):
            sides["A"].append(timer())
            for variant in args.variants:
                for module, name, value in variant:
                    setattr(module, name, value)
                sides[describe(variant)].append(timer())
                restore()
            print(f"round {round_index}: " + ", ".join(f"{side} {values[-1][0]:.4f}" for side, values in sides.items()),
                  flush=True)
    finally:
        restore()
    medians = {side: statistics.median(ms for ms, _ in values) for side, values in sides.items()}
    for side, values in sides.items():
        tokens = sorted({token for _, token in values})
        print(f"# {side}: {medians[side]:.4f} ms ({(medians[side] / medians['A'] - 1) * 100:+.1f} % against A), "
              f"median of {args.rounds} alternating rounds; greedy tokens {tokens}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"label": label, "device": torch.cuda.get_device_name(),
                       "a": {f"{m.__name__}.{n}": repr(v) for (m, n), v in original.items()},
                       "sides": {side: {"ms": [round(ms, 4) for ms, _ in values], "median_ms": round(medians[side], 4),
                                        "tokens": sorted({token for _, token in values})}
                                 for side, values in sides.items()}}, handle, indent=1)


if __name__ == "__main__":
    main()
