"""Decode steps of 1-16 rows with the GEMV layers' token bound as graphrt sets it and raised, side by side
in one run: where the GEMV kernels (one program a row) or the few-row kernels (``gemv_rows``: each weight
read once for every row) beat cuBLAS with separate norm, rotary and SiLU kernels.

Each bound replaces ``graphrt.models.kernel_policy.GEMV_THRESHOLDS`` while its engines are built (the
policy reads it then), and ``graphrt.bench.run_bench`` times plain steps at the given batch sizes and
verify steps (``--query-tokens`` rows a sequence) at the given contexts.

    python profiles/bench_gemv_bounds.py --json gemv_rows.json                       # GEMV up to 16 rows
    python profiles/bench_gemv_bounds.py --few-row-kernels --json gemv_rows_kernels.json
"""

import argparse
import contextlib
import dataclasses
import json

from graphrt.bench import HEADER, run_bench
from graphrt.models import kernel_policy


@contextlib.contextmanager
def gemv_bound(**fields):
    """``GEMV_THRESHOLDS`` with ``fields`` replaced, for the engines built inside."""
    kept = kernel_policy.GEMV_THRESHOLDS
    kernel_policy.GEMV_THRESHOLDS = dataclasses.replace(kept, **fields)
    try:
        yield
    finally:
        kernel_policy.GEMV_THRESHOLDS = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["random:smollm2-135m", "random:llama-3.2-1b"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--verify-batch-sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--query-tokens", type=int, default=5, help="rows a sequence in the verify steps")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="of the verify steps")
    parser.add_argument("--few-row-kernels", action="store_true",
                        help="raise the few-row kernels' bound (rows_max_tokens) rather than the GEMV kernels'")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="auto", help="cuda (eager steps only elsewhere: a smoke test)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    raised = dict(rows_max_tokens=16) if args.few_row_kernels else dict(max_tokens=16)
    results = {}
    for model in args.models:
        for name, fields in (("as set", {}), ("raised", raised)):
            print(f"== {model}, GEMV bound {name} {fields or ''}\n{HEADER}", flush=True)
            with gemv_bound(**fields):
                plain = run_bench(model, args.device, "auto", args.batch_sizes, [512], args.steps)
                verify = run_bench(model, args.device, "auto", args.verify_batch_sizes, args.contexts, args.steps,
                                   query_tokens=(args.query_tokens,))
            results[f"{model} {name}"] = dict(bound=fields, rows=plain["rows"] + verify["rows"],
                                              hbm_read_bandwidth_gbps=plain["hbm_read_bandwidth_gbps"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
