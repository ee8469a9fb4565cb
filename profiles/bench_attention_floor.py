"""What the batch-1 attention costs in the decode step above a bare dependent kernel in its place, and
what its parts cost.

``graphrt profile``'s exposed times put the batch-1 attention at 4.9-7.5 us a layer (SmolLM2, 1B,
8B at context 512; profiles/notes_fusion.md, experiment 21) while the O projection after it, a
kernel of ~1 MB, adds ~1.5 us. Whether a faster attention is worth a redesign depends on how much
of those microseconds any kernel at that place would cost (its dependency wait, launch and drain)
and how much is the attention's own chain of loads, products, partials and merge. Variants, each the
whole captured step, alternating over ``--rounds`` rounds in one engine per point (model:batch:context,
the greedy graph only):

* ``paged_decode``: today's paged decode;
* ``without_merge``: the split pass alone, its merge compiled out (every split writes its own
  normalised rows into the output: no partials, arrival count or merge; meaningless tokens);
* ``copy_query``: a kernel that only waits for the one before and copies the query rows into the
  output in the attention's place (the same launch as a programmatic dependent; meaningless tokens).

    python profiles/bench_attention_floor.py --json attention_floor.json

(``results/attention_floor_h200.json`` came from this script's first form, which reported the merge as
``merge_us_per_layer``; ``results/early_table_h200.json`` from one with a fourth variant, experiment 23.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from step_sweep import capture_greedy_graphs_only, greedy_engine, parse_point, results_header, write_results

import graphrt.attention.triton_paged_decode as paged_decode
from graphrt.bench import recaptured_replay_ms
from graphrt.kernels.dependent_launch import launch_options, wait_for_previous_kernel
from graphrt.models.llama import LlamaAttention

POINTS = "random:smollm2-135m:1:512,random:llama-3.2-1b:1:512,random:llama-3-8b:1:512,random:llama-3.2-1b:1:4096"


@triton.jit
def _copy_query_kernel(q_ptr, out_ptr, stride_q, stride_out, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, ROW_PAD)
    row = tl.load(q_ptr + seq * stride_q + columns, mask=columns < ROW)
    tl.store(out_ptr + seq * stride_out + columns, row, mask=columns < ROW)


def copy_query(out, query, *args, dependent_launch: bool = False, **kwargs):
    """Stands in for ``paged_decode_attention(out [B, H, D], query [B, H, D], ...)``: out = query."""
    batch, heads, size = query.shape
    _copy_query_kernel[(batch,)](query, out, query.stride(0), out.stride(0), ROW=heads * size,
                                 ROW_PAD=triton.next_power_of_2(heads * size), num_warps=4,
                                 **launch_options(dependent_launch))
    return out


class _WithoutMerge:
    """Stands in for ``_decode_split_kernel``: each launch compiled as if it had one split
    (``SINGLE_SPLIT``), whatever its split count, so every split stores its normalised rows into ``out``
    and none writes partials, counts in or merges."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "SINGLE_SPLIT": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--points", default=POINTS, help="model:batch:context, comma-separated")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    capture_greedy_graphs_only()
    results = results_header(replays=args.replays, rounds=args.rounds, points=[])
    for point in args.points.split(","):
        model, batch_size, context = parse_point(point)
        engine, batch = greedy_engine(model, batch_size, context)
        attention = [module.attn for module in engine.model.modules() if isinstance(module, LlamaAttention)]
        today = attention[0]._decode
        split_kernel = paged_decode._decode_split_kernel
        # name: (the attention's decode function, its split kernel)
        variants = {"paged_decode": (today, split_kernel), "without_merge": (today, _WithoutMerge(split_kernel)),
                    "copy_query": (copy_query, split_kernel)}
        samples = {name: [] for name in variants}
        try:
            for round_index in range(args.rounds):
                for name in list(variants) if round_index % 2 == 0 else list(variants)[::-1]:
                    decode, paged_decode._decode_split_kernel = variants[name]
                    for impl in attention:
                        impl._decode = decode
                    samples[name].append(recaptured_replay_ms(engine.decode_runner, batch, args.replays)[0])
        finally:
            paged_decode._decode_split_kernel = split_kernel
        median = {name: statistics.median(times) for name, times in samples.items()}
        above = {name: (median[name] - median["copy_query"]) * 1e3 / len(attention) for name in variants}
        entry = {"model": model, "batch_size": batch_size, "context": context, "layers": len(attention),
                 **{f"{name}_ms": round(median[name], 4) for name in variants},
                 **{f"{name}_above_copy_us_per_layer": round(above[name], 2) for name in variants if name != "copy_query"},
                 "rounds_ms": samples}
        results["points"].append(entry)
        shown = ", ".join(f"{name} {above[name]:.2f}" for name in variants if name != "copy_query")
        print(f"{point:34} " + ", ".join(f"{name} {median[name]:.4f} ms" for name in variants)
              + f" | us a layer above the copy: {shown}", flush=True)
        engine = batch = attention = today = None
        torch.cuda.empty_cache()
        write_results(args.json, results)


if __name__ == "__main__":
    main()
