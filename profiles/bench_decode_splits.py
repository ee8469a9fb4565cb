"""Split counts of the paged decode kernel at the decode shapes of the bundled presets (head size 64).

``choose_num_splits`` was measured at head size 128 (profiles/notes_paged_decode.md). At 64 a K/V tile
carries half the bytes, and the 1B's profile at batch 64, context 512 shows the attention kernel at
~1.8 TB/s with one split. For each (batch, context) this times the kernel at several split counts and
prints which the heuristic picks.

    python profiles/bench_decode_splits.py --json profiles/results/decode_splits_h200.json
    python profiles/bench_decode_splits.py --merge-tiles 8192 2048 --points 1x4096 2x4096 3x4096 4x4096 8x4096

``--merge-tiles`` repeats the sweep for each size of the merge's tile (``_MERGE_TILE_ELEMENTS``, which
sets the split kernel's registers at many splits: notes_fusion.md, after change 13). ``--block-n`` and
``--num-warps`` repeat it for K/V tiles of other lengths (default: ``default_config``'s, 128 tokens at
head size 64, 4 warps): at batch 1 and context 512 one tile of 512 tokens a program would need no loop
and, unsplit, no merge (notes_fusion.md "Next").

    python profiles/bench_decode_splits.py --points 1x512 8x512 --block-n 128 256 512 --num-warps 4 8

Each timing is a CUDA-graph replay cycling through enough caches (>= 256 MB of K/V) that none is read
from L2 (``bench_gemv.time_graph``: median of 20 replays); bandwidth = K/V bytes the step must read / time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_gemv import time_graph

from graphrt.attention import triton_paged_decode
from graphrt.attention.triton_paged_decode import (
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    default_config,
    paged_decode_attention,
    resident_programs,
)

#: (name, query heads, kv heads, head size) of the presets' attention.
SHAPES = [("llama-3.2-1b", 32, 8, 64), ("smollm2-135m", 9, 3, 64)]
POINTS = [(1, 512), (1, 4096), (8, 512), (8, 4096), (64, 512), (64, 4096), (256, 512)]
SPLITS = (1, 2, 3, 4, 6, 8, 16, 32)
BLOCK_SIZE = 16
MIN_BYTES = 256 << 20
DTYPE = torch.bfloat16


def time_point(heads: int, kv_heads: int, head_size: int, batch: int, context: int, splits: int,
               workspace: DecodeWorkspace, config: DecodeConfig | None = None) -> float:
    """Median microseconds of one attention call (cycled over cache copies inside one graph)."""
    blocks_per_seq = context // BLOCK_SIZE
    kv_bytes = batch * context * kv_heads * head_size * 2 * 2
    copies = max(2, -(-MIN_BYTES // kv_bytes))
    row = BLOCK_SIZE * kv_heads * head_size
    caches = [torch.randn(2, batch * blocks_per_seq + 1, row, device="cuda", dtype=DTYPE) for _ in range(copies)]
    tables = (torch.randperm(batch * blocks_per_seq, device="cuda").int() + 1).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, head_size, device="cuda", dtype=DTYPE)
    out = torch.empty_like(query)

    def call(cache):
        paged_decode_attention(out, query, cache, tables, seq_lens, context, head_size**-0.5, kv_heads, BLOCK_SIZE,
                               workspace=workspace, num_splits=splits, config=config, dependent_launch=False)

    microseconds = 1e3 * time_graph([lambda cache=cache: call(cache) for cache in caches])
    del caches
    torch.cuda.empty_cache()
    return microseconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--merge-tiles", type=int, nargs="*", help="merge tile sizes to sweep (default: as set)")
    parser.add_argument("--points", nargs="*", help="BATCHxCONTEXT points (default: POINTS)")
    parser.add_argument("--block-n", type=int, nargs="*", help="K/V tile lengths to sweep (default: as configured)")
    parser.add_argument("--num-warps", type=int, nargs="*", default=[4], help="warps a program (with --block-n)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_splits: needs a CUDA device", file=sys.stderr)
        return 2
    points = [tuple(int(v) for v in p.split("x")) for p in args.points] if args.points else POINTS
    results = []
    for merge_tile in args.merge_tiles or [triton_paged_decode._MERGE_TILE_ELEMENTS]:
        triton_paged_decode._MERGE_TILE_ELEMENTS = merge_tile  # read by each launch
        print(f"merge tile {merge_tile} elements", flush=True)
        configs = [None] if not args.block_n else [DecodeConfig(block_n=n, num_warps=w, num_stages=3)
                                                   for n in args.block_n for w in args.num_warps]
        for config in configs:
            results += sweep(points, merge_tile, config)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def sweep(points, merge_tile: int, config: DecodeConfig | None = None) -> list[dict]:
    """Every point at every split count (and the heuristic's), with ``config``'s tile (None: the default)."""
    tile = "default tile" if config is None else f"tile {config.block_n} x {config.num_warps} warps"
    results = []
    for name, heads, kv_heads, head_size in SHAPES:
        workspace = DecodeWorkspace.allocate(max(b for b, _ in points), heads, head_size, 64, "cuda")
        resident = resident_programs(default_config(head_size, 2, torch.device("cuda")), head_size, 2,
                                     torch.device("cuda"))
        for batch, context in points:
            chosen = choose_num_splits(batch, kv_heads, context, resident)
            timings = {}
            for splits in sorted(set(SPLITS) | {chosen}):
                if splits * 16 > context:
                    continue
                try:
                    timings[splits] = round(time_point(heads, kv_heads, head_size, batch, context, splits,
                                                       workspace, config), 2)
                except Exception as error:  # reported, the sweep goes on
                    print(f"{name} batch {batch} ctx {context} splits {splits}: {error!r:.200}", flush=True)
            best = min(timings, key=timings.get)
            kv_bytes = batch * context * kv_heads * head_size * 4
            results.append({"model": name, "batch": batch, "context": context, "merge_tile": merge_tile,
                            "block_n": None if config is None else config.block_n,
                            "num_warps": None if config is None else config.num_warps,
                            "chosen_splits": chosen, "best_splits": best, "us": timings, "kv_bytes": kv_bytes})
            print(f"{name:13} {tile} batch {batch:3} ctx {context:5}: heuristic {chosen:2} splits "
                  f"{timings.get(chosen, float('nan')):7.2f} us, best {best:2} {timings[best]:7.2f} us "
                  f"({kv_bytes / timings[best] / 1e6:.2f} TB/s)  all "
                  + " ".join(f"{s}:{t}" for s, t in timings.items()), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
