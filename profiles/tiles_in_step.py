"""GEMV tiles chosen inside the captured decode step, one matrix at a time, then together.

At batch 1 a decoder layer runs four GEMV kernels (``graphrt.kernels.gemv``): QKV with the input norm,
rotary and the cache write, O adding into the stream, gate/up with the norm and SiLU * up, down adding
into the stream. A tile that wins on a matrix timed alone can lose in the step, where each kernel starts
during the previous one's tail (profiles/notes_fusion.md, "Tiles chosen in the step"). So, for one model:

1. each candidate tile of each matrix goes into gemv's table (``MEASURED_TILES`` for 16-bit weights,
   ``MEASURED_FP8_TILES`` for FP8 codes), the engine's decode graph is captured again and its replay
   timed (median of ``--replays``); the table's own tiles are timed again after every matrix's
   candidates, since the clocks drift;
2. the candidates faster than their matrix's baseline by more than ``--min-gain`` go in together, and
   that step is timed against the unchanged one in ``--rounds`` alternating rounds; the greedy tokens of
   both are printed (an FP8 or 16-bit sum in another order may move a near-tie).

Prints each candidate's time and the table entries the combined round supports; writes it all as JSON.
Needs CUDA (the GEMV layers and the graphs).

    python profiles/tiles_in_step.py --model random:llama-3-8b --quantization fp8 --json tiles_fp8_8b.json
"""

import argparse
import itertools
import json
import statistics

import torch

from graphrt.bench import median_replay_ms
from graphrt.kernels import gemv
from graphrt.workload import decode_engine, fill_decode_batch

MATRICES = ("qkv", "o", "gate_up", "down")


def candidate_tiles(element_size: int, wide: bool = False) -> list[gemv.TileConfig]:
    """Tiles tried per matrix: outputs a program, K slice, warps, with ``general_config``'s thread sums
    for one-byte weights; at most 16 KiB of weights a slice. ``wide`` (one-byte weights): the second
    round, around the first one's winners (8 outputs a program, at the edge of its grid): 8 and 16
    outputs, 1024-4096-code slices, 4 and 8 warps (2 for 8 x 1024 and 8 x 2048), half the thread sum
    beside the rule's, up to 32 KiB a slice."""
    if element_size == 1 and wide:
        tiles = []
        for bn, bk, w in itertools.product((8, 16), (1024, 2048, 4096), (2, 4, 8)):
            if bn * bk > 32768 or (w == 2 and (bn, bk) not in ((8, 1024), (8, 2048))):
                continue
            rule = max(1, min(16, bk // 128))
            tiles += [gemv.TileConfig(bn, bk, w, rule)] + ([gemv.TileConfig(bn, bk, w, rule // 2)] if rule > 1 else [])
        return tiles
    if element_size == 1:
        return [gemv.TileConfig(bn, bk, w, max(1, min(16, bk // 128)))
                for bn, bk, w in itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8)) if bn * bk <= 16384]
    return [gemv.TileConfig(bn, bk, w)
            for bn, bk, w in itertools.product((4, 8, 16), (256, 512, 1024, 2048), (4, 8)) if bn * bk * 2 <= 32768]


def table_keys(config) -> dict[str, tuple[int, int, bool]]:
    """Each matrix's key in the tile table: (weight rows, input features, SiLU * up epilogue)."""
    return {
        "qkv": (config.q_size + 2 * config.kv_size, config.hidden_size, False),
        "o": (config.hidden_size, config.q_size, False),
        "gate_up": (2 * config.intermediate_size, config.hidden_size, True),
        "down": (config.hidden_size, config.intermediate_size, False),
    }


def describe(tile: gemv.TileConfig) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.thread_sum}"


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a timed decode step (``StepTimer.for_model``): model, weights, context, replays."""
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"], type=lambda s: None if s == "none" else s)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--replays", type=int, default=40)


class StepTimer:
    """Recaptures ``engine``'s one decode graph with the switches and tables as they stand and times its
    replay."""

    def __init__(self, engine, batch, replays: int):
        self.engine, self.batch, self.replays = engine, batch, replays

    @classmethod
    def for_model(cls, args: argparse.Namespace, batch_size: int, script: str) -> "StepTimer":
        """A bf16 engine of ``args.model`` (``add_step_arguments``' options) on CUDA with ``batch_size``
        sequences decoding at ``args.context``, its decode graph only (no prompt or mixed graphs);
        SystemExit naming ``script`` without CUDA."""
        if not torch.cuda.is_available():
            raise SystemExit(f"{script} times captured CUDA graphs: it needs a CUDA device")
        engine = decode_engine(args.model, "cuda", "bfloat16", batch_size, args.context, enforce_eager=False,
                               quantization=args.quantization, prefill_graph_tokens=0, mixed_step_tokens=0)
        return cls(engine, fill_decode_batch(engine, batch_size, args.context), args.replays)

    def __call__(self) -> tuple[float, int]:
        runner = self.engine.decode_runner
        runner.graphs.clear()
        runner.capture(progress=False)
        if not runner.graphs:
            raise RuntimeError(f"capture failed: {runner.stats.capture_error}")
        token = runner.decode(self.batch)[0]  # stages the inputs, and the greedy token of this tile set
        return median_replay_ms(runner.graphs[runner.plan(self.batch).key], self.replays), token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of the combined comparison")
    parser.add_argument("--min-gain", type=float, default=0.01, help="a candidate's least gain over the baseline")
    parser.add_argument("--matrices", nargs="+", default=list(MATRICES), choices=MATRICES)
    parser.add_argument("--wide", action="store_true", help="FP8: the second round's wider grid (candidate_tiles)")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    timer = StepTimer.for_model(args, 1, "tiles_in_step.py")
    engine = timer.engine
    if not engine.model.kernel_policy.runs_gemv(1):
        raise SystemExit(f"{args.model} does not run the GEMV layers at batch 1 here: nothing to tune")
    element_size = 1 if args.quantization == "fp8" else 2
    table = gemv.MEASURED_FP8_TILES if element_size == 1 else gemv.MEASURED_TILES
    keys = table_keys(engine.model_config)
    kept = dict(table)
    label = f"{args.model} {args.quantization or 'bf16'} batch 1 context {args.context}"
    print(f"# {label}: replay ms of the whole decode step, each matrix's candidate tiles in turn", flush=True)

    results: dict[str, dict] = {}
    winners: dict[str, gemv.TileConfig] = {}
    for name in args.matrices:
        key = keys[name]
        default = gemv.default_config(key[1], key[0], key[2], element_size)
        baseline_ms, _ = timer()
        rows = []
        for tile in candidate_tiles(element_size, args.wide):
            table[key] = tile
            try:
                ms, token = timer()
            except Exception as exc:  # a tile the compiler refuses (registers, shared memory): skip it
                print(f"{name:8s} {describe(tile):20s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            finally:
                table.clear()
                table.update(kept)
            rows.append({"tile": describe(tile), "ms": round(ms, 4), "token": token})
            print(f"{name:8s} {describe(tile):20s} {ms:8.4f} ms  (table's tile {describe(default)}: "
                  f"{baseline_ms:.4f})", flush=True)
        baseline_after, _ = timer()
        baseline = statistics.mean([baseline_ms, baseline_after])
        best = min(rows, key=lambda row: row["ms"]) if rows else None
        results[name] = {"key": list(key), "default": describe(default), "baseline_ms": round(baseline, 4),
                         "candidates": rows}
        if best is not None and best["ms"] < baseline * (1 - args.min_gain):
            winners[name] = next(t for t in candidate_tiles(element_size, args.wide) if describe(t) == best["tile"])
            print(f"{name}: {best['tile']} {best['ms']:.4f} against {baseline:.4f} ms", flush=True)

    combined: dict = {}
    if winners:
        unchanged, tuned = [], []
        for _ in range(args.rounds):
            unchanged.append(timer())
            table.update({keys[name]: tile for name, tile in winners.items()})
            tuned.append(timer())
            table.clear()
            table.update(kept)
        before = statistics.median(ms for ms, _ in unchanged)
        after = statistics.median(ms for ms, _ in tuned)
        combined = {"winners": {name: describe(tile) for name, tile in winners.items()},
                    "unchanged_ms": [round(ms, 4) for ms, _ in unchanged],
                    "tuned_ms": [round(ms, 4) for ms, _ in tuned],
                    "median_unchanged_ms": round(before, 4), "median_tuned_ms": round(after, 4),
                    "tokens_unchanged": sorted({token for _, token in unchanged}),
                    "tokens_tuned": sorted({token for _, token in tuned})}
        print(f"# combined ({', '.join(f'{n} {describe(t)}' for n, t in winners.items())}): {after:.4f} ms against "
              f"{before:.4f} unchanged ({(after / before - 1) * 100:+.1f} %), median of {args.rounds} alternating "
              f"rounds; greedy tokens {combined['tokens_tuned']} against {combined['tokens_unchanged']}", flush=True)
        for name, tile in winners.items():
            key = keys[name]
            print(f"    {key}: TileConfig({tile.block_n}, {tile.block_k}, {tile.num_warps}, {tile.thread_sum}),  "
                  f"# {args.model.removeprefix('random:')} {name}")
    else:
        print("# no candidate beat the table's tiles by the minimum gain", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"label": label, "device": torch.cuda.get_device_name(), "matrices": results,
                       "combined": combined}, handle, indent=1)


if __name__ == "__main__":
    main()
