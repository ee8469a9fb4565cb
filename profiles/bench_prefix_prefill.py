"""The prefix-prefill kernel's tiles for one prompt part over a long cached context, the shape of a chunked
prefill step or a prompt after a cached prefix (Llama-3.2-1B's attention: 32 query / 8 KV heads, head size 64,
bf16, page 16): median microseconds a layer for each (rows a program, keys a step; context splits for 64 x 64), beside
what the launcher picks (``choose_tiles``, ``choose_num_splits``). One program walks its sequence's whole context, so few row tiles over a
long context leave most SMs idle: the sweep says which tile heights pay.

    python profiles/bench_prefix_prefill.py --json profiles/results/prefix_prefill_tiles_h200.json
"""

import argparse
import json

import torch
from triton.testing import do_bench

from graphrt.attention import triton_prefix_prefill as kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 64, 16
POINTS = [(64, 1536), (96, 2048), (128, 1500), (224, 2048), (480, 2048), (2048, 0)]  # (new tokens, cached context)


def bench_point(new_tokens: int, context: int, block_r: int | None, block_n: int | None,
                num_splits: int | None = None) -> float:
    generator = torch.Generator(device="cuda").manual_seed(new_tokens + context)
    seq_len = context + new_tokens
    blocks = -(-seq_len // BLOCK_SIZE)
    cache = torch.randn(2, blocks + 1, BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE, device="cuda", dtype=torch.bfloat16,
                        generator=generator)
    table = torch.randperm(blocks, device="cuda", generator=generator).add_(1).to(torch.int32)[None]
    query = torch.randn(new_tokens, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16, generator=generator)
    key, value = (torch.randn(new_tokens, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16,
                              generator=generator) for _ in range(2))
    starts = torch.tensor([0, new_tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)

    def run():
        kernel.triton_prefix_prefill(query, key, value, cache, table, starts, lens, new_tokens, HEAD_SIZE**-0.5,
                                     out=out, block_r=block_r, block_n=block_n, num_splits=num_splits)

    return do_bench(run, warmup=20, rep=100, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    results = []
    for new_tokens, context in POINTS:
        rows = new_tokens * NUM_HEADS // NUM_KV_HEADS
        chosen = kernel.choose_tiles(rows, triton_next_pow2(HEAD_SIZE))
        splits = kernel.choose_num_splits(-(-rows // chosen[0]), NUM_KV_HEADS, torch.device("cuda"))
        row = {"new_tokens": new_tokens, "context": context, "chosen": [*chosen[:2], splits],
               "chosen_us": bench_point(new_tokens, context, None, None), "tiles": {}}
        for block_r in (16, 32, 64, 128):
            for block_n in (32, 64):
                for num_splits in ((1, 2, 4, 8) if (block_r, block_n) == (64, 64) else (1,)):
                    name = f"{block_r}x{block_n}" + (f"/{num_splits}" if num_splits > 1 else "")
                    row["tiles"][name] = bench_point(new_tokens, context, block_r, block_n, num_splits)
        best = min(row["tiles"], key=row["tiles"].get)
        print(f"new {new_tokens:5d} context {context:5d}: chosen {chosen[0]}x{chosen[1]}/{splits} "
              f"{row['chosen_us']:8.1f} us; best {best} {row['tiles'][best]:8.1f} us; "
              + " ".join(f"{name} {us:.1f}" for name, us in row["tiles"].items()), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": {
                "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                "block_size": BLOCK_SIZE, "dtype": "bfloat16"}, "points": results}, f, indent=2)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
