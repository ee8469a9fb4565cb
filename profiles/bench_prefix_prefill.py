"""The prefix-prefill kernel's launch shapes for one prompt part over a long cached context, the shape of a
chunked prefill step or a prompt after a cached prefix (Llama-3.2-1B's attention: 32 query / 8 KV heads, head
size 64, bf16, page 16, 16 layers): median microseconds a layer for each (rows a program x keys a step /
context splits), beside what the launcher picks (``choose_tiles``, ``choose_num_splits``).

Each configuration is timed as a decode step sees it: one CUDA graph launching the kernel once per layer over
16 layers' own caches (so the context is not left in L2 by the layer before), replayed; the configurations
are interleaved over several rounds and each one's median replay is divided by the layers.

    python profiles/bench_prefix_prefill.py --json profiles/results/prefix_prefill_tiles_h200.json
"""

import argparse
import json
import statistics

import torch
import triton

from graphrt.attention import triton_prefix_prefill as kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, LAYERS = 32, 8, 64, 16, 16
POINTS = [(64, 1536), (96, 2048), (128, 1500), (224, 2048), (480, 2048), (2048, 0)]  # (new tokens, cached context)
TILES = [(16, 32), (16, 64), (32, 32), (32, 64), (64, 32), (64, 64), (128, 64)]
SPLITS = (1, 2, 4, 8)


class Point:
    """Inputs of one prompt part over ``context`` cached tokens, a cache per layer."""

    def __init__(self, new_tokens: int, context: int):
        generator = torch.Generator(device="cuda").manual_seed(new_tokens + context)
        seq_len = context + new_tokens
        blocks = -(-seq_len // BLOCK_SIZE)
        self.new_tokens = new_tokens
        self.caches = [torch.randn(2, blocks + 1, BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE, device="cuda",
                                   dtype=torch.bfloat16, generator=generator) for _ in range(LAYERS)]
        self.table = torch.randperm(blocks, device="cuda", generator=generator).add_(1).to(torch.int32)[None]
        self.query = torch.randn(new_tokens, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16,
                                 generator=generator)
        self.key, self.value = (torch.randn(new_tokens, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16,
                                            generator=generator) for _ in range(2))
        self.starts = torch.tensor([0, new_tokens], dtype=torch.int32, device="cuda")
        self.lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.query)

    def layers(self, block_r: int | None, block_n: int | None, num_splits: int | None) -> None:
        for cache in self.caches:
            kernel.triton_prefix_prefill(self.query, self.key, self.value, cache, self.table, self.starts, self.lens,
                                         self.new_tokens, HEAD_SIZE**-0.5, out=self.out, block_r=block_r,
                                         block_n=block_n, num_splits=num_splits)

    def graph(self, config: tuple) -> torch.cuda.CUDAGraph:
        self.layers(*config)  # compiles the variant outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.layers(*config)
        return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--replays", type=int, default=20, help="graph replays a round")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    results = []
    for new_tokens, context in POINTS:
        point = Point(new_tokens, context)
        rows = new_tokens * NUM_HEADS // NUM_KV_HEADS
        chosen = kernel.choose_tiles(rows, triton.next_power_of_2(HEAD_SIZE))
        splits = kernel.choose_num_splits(-(-rows // chosen[0]), NUM_KV_HEADS, torch.device("cuda"))
        configs = {"chosen": (None, None, None)}
        configs.update({f"{r}x{n}" + (f"/{s}" if s > 1 else ""): (r, n, s)
                        for r, n in TILES for s in SPLITS if s == 1 or (r, n) in ((16, 64), (64, 64))})
        graphs = {name: point.graph(config) for name, config in configs.items()}
        times = {name: [] for name in graphs}
        for graph in graphs.values():  # warm the clocks and every graph once
            replay_us(graph, 3)
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(replay_us(graph, args.replays))
        medians = {name: round(statistics.median(values), 2) for name, values in times.items()}
        chosen_us = medians.pop("chosen")
        best = min(medians, key=medians.get)
        print(f"new {new_tokens:5d} context {context:5d}: chosen {chosen[0]}x{chosen[1]}/{splits} {chosen_us:7.1f} us;"
              f" best {best} {medians[best]:7.1f} us; " + " ".join(f"{k} {v:.1f}" for k, v in medians.items()),
              flush=True)
        results.append({"new_tokens": new_tokens, "context": context, "chosen": [*chosen[:2], splits],
                        "chosen_us": chosen_us, "us_a_layer": medians})
        del graphs, point
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "layers": LAYERS, "rounds": args.rounds,
                       "replays": args.replays, "shape": {
                           "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                           "block_size": BLOCK_SIZE, "dtype": "bfloat16"}, "points": results}, f, indent=2)


if __name__ == "__main__":
    main()
