"""Steady decode: B sequences of --context tokens, each decoding one token per engine step, with
graphrt's NVTX ranges on.

The B prompts (random token ids) are prefilled in one step and decoded for --warmup steps; then
--steps decode-only engine steps are recorded, each ``step`` > ``schedule``, ``decode batch=B`` >
``decode.prepare`` + ``decode.replay batch=B padded=P`` (or ``decode.eager``, and ``sample``). The
recorded steps sit between cudaProfilerStart and cudaProfilerStop.

Nsight Systems (every kernel of each replayed graph, with the NVTX ranges):

    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o steady_decode \
        python profiles/steady_decode.py --model random:llama-3.2-1b --batch-size 8 --context 512 --steps 32

Add ``--capture-range=cudaProfilerApi --capture-range-end=stop`` to record only the steady steps, and
``--nvtx-layers --enforce-eager`` for a ``layer N`` range around each decoder layer.

torch.profiler (Chrome/Perfetto trace of the recorded steps, and a summary line):

    python profiles/steady_decode.py --model random:llama-3.2-1b --batch-size 8 --context 512 \
        --torch-profile steady_decode.json
"""

import argparse
import random
import statistics
import sys
import time

from graphrt.cli_args import add_model_arguments, kernel_options
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.profile import cuda_profiler_range, step_annotation, summarize_trace, torch_trace
from graphrt.sampling.params import SamplingParams

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model="random:llama-3.2-1b")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences decoding together (default 8)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default 512)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps recorded (default 32)")
    parser.add_argument("--warmup", type=int, default=4, help="decode steps before recording (default 4)")
    parser.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--nvtx-layers", action="store_true", help="a 'layer N' range per decoder layer (eager)")
    parser.add_argument("--torch-profile", metavar="FILE", help="record the steps with torch.profiler into FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batch, context = args.batch_size, args.context
    max_tokens = 1 + args.warmup + args.steps  # the prefill samples the first
    max_len = context + max_tokens
    engine = LLMEngine(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=batch, max_model_len=max_len,
        block_size=BLOCK_SIZE, num_kv_blocks=batch * -(-max_len // BLOCK_SIZE) + 1,
        max_num_batched_tokens=batch * context, capture_sizes=[batch], enforce_eager=args.enforce_eager,
        nvtx=True, nvtx_layers=args.nvtx_layers, **kernel_options(args),
    ), progress=False)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(context)], params)
    for _ in range(1 + args.warmup):
        engine.step()

    times = []
    profiling = args.torch_profile is not None
    with torch_trace(args.torch_profile, engine.device), cuda_profiler_range(engine.device):
        for _ in range(args.steps):
            start = time.perf_counter()
            with step_annotation(profiling):
                # Ends with a step's tokens on the host; pipelined on CUDA, it queued the next step first.
                outputs = engine.step()
            if not outputs:  # the first pipelined call after the prefill only queues a step (--warmup 0)
                continue
            times.append((time.perf_counter() - start) * 1e3)
            assert len(outputs) == batch, "every sequence decodes one token per step"
    median = statistics.median(times)
    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"steady decode: {args.model} on {engine.device} ({dtype}), batch {batch}, context {context}: "
          f"{len(times)} steps, median {median:.3f} ms/step, {batch / median * 1e3:.1f} tokens/s")
    print(f"decode stats: {engine.decode_runner.stats.as_dict()}")
    if profiling:
        print(summarize_trace(args.torch_profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
