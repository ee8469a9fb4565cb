"""A module-level switch of graphrt A/B'd inside the captured decode step: the step's graph captured with
the switch as it stands, then with the value given, replayed in alternating rounds.

A switch such as ``graphrt.kernels.gemv.L2_PREFETCH`` changes what the decode graph's kernels do, not
its shape; the graph is recaptured for each side (``tiles_in_step.StepTimer``), so a round compares two
graphs of the same engine on the same cache. Prints each round, the medians and the greedy token of each
side (a kernel change that alters results shows there); writes it all as JSON. Needs CUDA.

    python profiles/step_ab.py --model random:llama-3-8b --quantization fp8 \\
        --set graphrt.kernels.gemv.L2_PREFETCH=True --json ab.json
"""

import argparse
import ast
import importlib
import json
import statistics

import torch

from graphrt.workload import decode_engine, fill_decode_batch
from tiles_in_step import StepTimer


def parse_setting(text: str) -> tuple[object, str, object]:
    """``package.module.NAME=literal`` -> (module, NAME, value)."""
    target, _, literal = text.partition("=")
    module_name, _, name = target.rpartition(".")
    if not module_name or not literal:
        raise argparse.ArgumentTypeError(f"expected package.module.NAME=value, got {text!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise argparse.ArgumentTypeError(f"{module_name} has no {name}")
    return module, name, ast.literal_eval(literal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"], type=lambda s: None if s == "none" else s)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--set", dest="settings", action="append", type=parse_setting, required=True,
                        help="package.module.NAME=value, the B side (repeat for several switches together)")
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_ab.py times captured CUDA graphs: it needs a CUDA device")

    engine = decode_engine(args.model, "cuda", "bfloat16", args.batch_size, args.context, enforce_eager=False,
                           quantization=args.quantization, prefill_graph_tokens=0, mixed_step_tokens=0)
    batch = fill_decode_batch(engine, args.batch_size, args.context)
    timer = StepTimer(engine, batch, args.replays)
    before = {(module, name): getattr(module, name) for module, name, _ in args.settings}
    described = ", ".join(f"{module.__name__}.{name} {before[module, name]!r} -> {value!r}"
                          for module, name, value in args.settings)
    label = (f"{args.model} {args.quantization or 'bf16'} batch {args.batch_size} context {args.context}: "
             f"{described}")
    print(f"# {label}; replay ms of the whole decode step, A then B each round", flush=True)
    a_side, b_side = [], []
    try:
        for round_index in range(args.rounds):
            a_side.append(timer())
            for module, name, value in args.settings:
                setattr(module, name, value)
            b_side.append(timer())
            for (module, name), value in before.items():
                setattr(module, name, value)
            print(f"round {round_index}: A {a_side[-1][0]:.4f} ms, B {b_side[-1][0]:.4f} ms", flush=True)
    finally:
        for (module, name), value in before.items():
            setattr(module, name, value)
    a_ms, b_ms = (statistics.median(ms for ms, _ in side) for side in (a_side, b_side))
    tokens = {side: sorted({token for _, token in values}) for side, values in (("A", a_side), ("B", b_side))}
    print(f"# B {b_ms:.4f} ms against A {a_ms:.4f} ({(b_ms / a_ms - 1) * 100:+.1f} %), median of {args.rounds} "
          f"alternating rounds; greedy tokens A {tokens['A']}, B {tokens['B']}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"label": label, "device": torch.cuda.get_device_name(),
                       "a_ms": [round(ms, 4) for ms, _ in a_side], "b_ms": [round(ms, 4) for ms, _ in b_side],
                       "median_a_ms": round(a_ms, 4), "median_b_ms": round(b_ms, 4), "tokens": tokens}, handle, indent=1)


if __name__ == "__main__":
    main()
