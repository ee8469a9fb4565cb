"""Token sampling alone, side by side: each sampler captured in a CUDA graph over [B, V] logits.

* ``greedy``: the two-pass argmax (``graphrt.sampling.argmax``);
* ``temperature``: the fused temperature race (``graphrt.sampling.fused.sample_temperature``);
* ``search``: top-k / top-p by threshold search (``graphrt.sampling.top_k_top_p``), rows with top-p 0.9,
  and with top-k 50 and top-p 0.9;
* ``sort``: the same rows on the sorting sampler (``graphrt.sampling.sampler.sample``), what the fused path ran
  before the search.

Logits of a 128k vocabulary (Llama 3), random values scaled by 4 (a spread like a model's); float32 by
default, as the LM head writes them (``--logits-dtype bfloat16``: 16-bit logits, whose search takes 14
launches where float32's takes 22). Medians of 50 replays. Prints a table and writes ``--json``;
``tokens_equal`` says whether the search drew the sort's tokens (information, not a check: float32
near-ties may differ).

    python profiles/bench_sampling.py --json sampling.json
    python profiles/bench_sampling.py --logits-dtype bfloat16   # how results/sampling_h200.json was run

CUDA only.
"""

import argparse
import json

import torch

from graphrt.bench import median_replay_ms
from graphrt.sampling.argmax import argmax_rows
from graphrt.sampling.fused import sample_temperature
from graphrt.sampling.params import SamplingParams
from graphrt.sampling.sampler import SamplingTensors, sample
from graphrt.sampling.top_k_top_p import sample_top_k_top_p


def graph_ms(op, replays: int = 50) -> float:
    """Median ms of a replay of ``op`` (a thunk) captured alone in a CUDA graph."""
    op()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op()
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_ms(graph, replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--logits-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logits_dtype = getattr(torch, args.logits_dtype)
    rows_of = {
        "top_p": SamplingParams(temperature=0.8, top_p=0.9),
        "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    }
    results = {"device": torch.cuda.get_device_name(), "vocab": args.vocab, "logits_dtype": args.logits_dtype,
               "points": []}
    print(f"{'batch':>5} {'rows':>12} {'greedy':>8} {'temp':>8} {'search':>8} {'sort':>8} {'sort/search':>11}  (ms)")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        logits = (torch.randn(batch, args.vocab, device="cuda") * 4).to(logits_dtype)
        out = torch.empty(batch, dtype=torch.int64, device="cuda")
        for name, params in rows_of.items():
            rows = SamplingTensors.from_params([params] * batch, list(range(batch)), [7] * batch, "cuda")
            point = {
                "batch": batch, "rows": name,
                "greedy_ms": graph_ms(lambda: argmax_rows(logits, out=out)),
                "temperature_ms": graph_ms(lambda: sample_temperature(logits, rows, out=out)),
                "search_ms": graph_ms(lambda: sample_top_k_top_p(logits, rows, out=out)),
                "sort_ms": graph_ms(lambda: out.copy_(sample(logits, rows))),
            }
            point["tokens_equal"] = sample_top_k_top_p(logits, rows).tolist() == sample(logits, rows).tolist()
            results["points"].append(point)
            print(f"{batch:5} {name:>12} {point['greedy_ms']:8.3f} {point['temperature_ms']:8.3f} "
                  f"{point['search_ms']:8.3f} {point['sort_ms']:8.3f} {point['sort_ms'] / point['search_ms']:11.1f}"
                  f"  tokens equal: {point['tokens_equal']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
