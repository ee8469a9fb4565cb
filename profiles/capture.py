"""Engine start-up with CUDA-graph capture: ``load`` (checkpoint, model, weights), the KV-cache sizing
(on CUDA without --num-kv-blocks: a profiling prefill), the side-stream warm-up, then one
``capture bucket=P`` range per captured graph (one per sampling mode: greedy, temperature, top-k /
top-p, logprobs), largest bucket first. On CPU nothing is captured (the runner decodes eagerly); the
script still runs.

Nsight Systems:

    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o capture \
        python profiles/capture.py --model random:llama-3.2-1b --max-num-seqs 64

torch.profiler (the whole start-up): the same command with ``--torch-profile capture.json``.
"""

import argparse
import json
import sys
import time

from graphrt.cli_args import add_model_arguments, comma_separated_ints, kernel_options
from graphrt.config import EngineConfig, resolve_device
from graphrt.engine import LLMEngine
from graphrt.profile import torch_trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model="random:llama-3.2-1b")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="largest batch; buckets up to it (default 64)")
    parser.add_argument("--capture-sizes", type=comma_separated_ints, default=None, metavar="1,8,64",
                        help="buckets to capture (default: 1, 2, 4, then multiples of 8 up to --max-num-seqs)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="longest sequence (default 2048)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="share of GPU memory for weights, activations and cache (default 0.5)")
    parser.add_argument("--torch-profile", metavar="FILE", help="record the start-up with torch.profiler into FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, capture_sizes=args.capture_sizes,
        gpu_memory_utilization=args.gpu_memory_utilization, nvtx=True, **kernel_options(args),
    )
    start = time.perf_counter()
    with torch_trace(args.torch_profile, resolve_device(args.device)):
        engine = LLMEngine(config, progress=False)
    seconds = time.perf_counter() - start
    runner = engine.decode_runner
    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"start-up: {args.model} on {engine.device} ({dtype}) in {seconds:.2f} s; "
          f"buckets {runner.capture_sizes}, " + (f"graphs captured in {runner.stats.capture_seconds:.2f} s"
                                                 if runner.uses_graphs else f"no graphs ({runner.eager_reason})"))
    print(f"decode stats: {json.dumps(runner.stats.as_dict())}")
    if args.torch_profile:
        print(f"trace: {args.torch_profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
