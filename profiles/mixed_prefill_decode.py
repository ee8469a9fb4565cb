"""Mixed prefill and decode: requests arrive while others decode, so some steps prefill new prompts
and decode the running sequences in the same step.

--batch-size sequences of --context tokens are prefilled and decode for --warmup steps; then, over
the recorded steps, a new request of --prompt-len tokens arrives every --arrival-every steps
(--arrivals in all), each generating --max-tokens tokens. With --enable-chunked-prefill each prompt runs
in chunks over several steps, the step's decodes and chunk sharing --max-num-batched-tokens; a step
that runs prompt tokens (a whole prompt or a chunk) counts as a prefill step. A step with at most
--mixed-step-tokens prompt tokens runs them and the decodes in one forward: ``step`` > ``schedule``,
``mixed seqs=1 tokens=T batch=B`` > ``decode.prepare`` + ``decode.replay batch=B padded=P prompt=C``
(then the ``sample`` of a prompt it finishes); a larger one shows ``prefill seqs=1 tokens=T`` (the
prompt's forward, with its ``sample``), then ``decode batch=B`` > ``decode.prepare`` +
``decode.replay batch=B padded=P`` for the running sequences. The other steps are decode-only, their
batch growing as arrivals join (and shrinking as they finish).

Nsight Systems:

    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o mixed_prefill_decode \
        python profiles/mixed_prefill_decode.py --model random:llama-3.2-1b --batch-size 8 --context 512 \
        --prompt-len 256 --arrivals 8 --arrival-every 4

Add ``--capture-range=cudaProfilerApi --capture-range-end=stop`` to record only the arrival phase.

torch.profiler: the same command with ``--torch-profile mixed.json``.
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
    parser.add_argument("--batch-size", type=int, default=8, help="sequences decoding when arrivals start")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of those sequences")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each arriving request")
    parser.add_argument("--arrivals", type=int, default=8, help="requests arriving while the others decode")
    parser.add_argument("--arrival-every", type=int, default=4, help="steps between arrivals")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each arriving request generates")
    parser.add_argument("--warmup", type=int, default=4, help="decode-only steps before recording")
    parser.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--enable-chunked-prefill", action="store_true", help="prompts in chunks over several steps")
    parser.add_argument("--prefill-graph-tokens", type=int, default=2048,
                        help="prompt steps of at most this many tokens replay prompt graphs (0: eager prompts)")
    parser.add_argument("--mixed-step-tokens", type=int, default=512,
                        help="steps of at most this many prompt tokens run them in the decode's forward (0: never)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="with --enable-chunked-prefill: most tokens a step runs (default 2048)")
    parser.add_argument("--nvtx-layers", action="store_true", help="a 'layer N' range per decoder layer (eager)")
    parser.add_argument("--torch-profile", metavar="FILE", help="record the steps with torch.profiler into FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recorded = args.arrivals * args.arrival_every
    # The running sequences outlast the recording, and with chunks the steps that prefill them all.
    prefill_steps = 1
    if args.enable_chunked_prefill:
        prefill_steps = -(-args.batch_size * args.context // args.max_num_batched_tokens)
    running_tokens = prefill_steps + args.warmup + recorded
    max_len = max(args.context + running_tokens, args.prompt_len + args.max_tokens)
    max_seqs = args.batch_size + args.arrivals
    engine = LLMEngine(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max_seqs, max_model_len=max_len,
        block_size=BLOCK_SIZE, num_kv_blocks=max_seqs * -(-max_len // BLOCK_SIZE) + 1,
        max_num_batched_tokens=(args.max_num_batched_tokens if args.enable_chunked_prefill
                                else max(args.batch_size * args.context, args.prompt_len + max_seqs)),
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=False,  # random prompts share nothing
        prefill_graph_tokens=args.prefill_graph_tokens,
        mixed_step_tokens=args.mixed_step_tokens, enforce_eager=args.enforce_eager, nvtx=True,
        nvtx_layers=args.nvtx_layers, **kernel_options(args),
    ), progress=False)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(length)]

    running = SamplingParams(temperature=0.0, max_tokens=running_tokens, ignore_eos=True)
    arriving = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request(prompt(args.context), running)
    while engine.scheduler.waiting or engine.scheduler.has_prefill_under_way():
        engine.step()
    for _ in range(args.warmup):
        engine.step()

    mixed_ms, decode_ms, queued_only = [], [], 0
    profiling = args.torch_profile is not None
    with torch_trace(args.torch_profile, engine.device), cuda_profiler_range(engine.device):
        for step in range(recorded):
            if step % args.arrival_every == 0:
                engine.add_request(prompt(args.prompt_len), arriving)
            # Prompt tokens run this step: a prompt waits or one is part-way through its chunks.
            prefilling = bool(engine.scheduler.waiting) or engine.scheduler.has_prefill_under_way()
            start = time.perf_counter()
            with step_annotation(profiling):
                outputs = engine.step()
            elapsed = (time.perf_counter() - start) * 1e3
            if not outputs and not prefilling:  # a pipelined engine's call that only queued a decode
                queued_only += 1
                continue
            (mixed_ms if prefilling else decode_ms).append(elapsed)

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.3f}" if values else "-"

    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"mixed prefill/decode: {args.model} on {engine.device} ({dtype}): {recorded} steps, "
          f"{len(mixed_ms)} with prompt tokens (median {median(mixed_ms)} ms, largest "
          f"{max(mixed_ms, default=0):.3f}), {len(decode_ms)} decode-only "
          f"(median {median(decode_ms)} ms), {queued_only} that only queued a pipelined decode")
    print(f"decode stats: {engine.decode_runner.stats.as_dict()}")
    if engine.prefill_graphs is not None:
        print(f"prompt graph stats: {engine.prefill_graphs.stats.as_dict()}")
    if profiling:
        print(summarize_trace(args.torch_profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
