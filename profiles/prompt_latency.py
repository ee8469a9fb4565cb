"""Time to first token of one request, taken apart: where a prompt step's time goes when its prompt
starts with a cached prefix, against the same prompt computed whole.

--batch-size sequences decode (0: the engine is idle, as at a low arrival rate); then --requests
requests arrive one at a time, each waiting for the previous one's first token, each a --prefix-len
token prefix shared by all of them plus --suffix-len tokens of its own. The prefix is computed once
before the timing (with --cached, the prefix cache holds it from then on; without, each request
computes its whole prompt). Each request's TTFT is split into ``add_request`` (validation, the prefix
lookup), the steps until its first token (the drain of a pipelined decode in flight, then its prompt
step), and, with --torch-profile, the GPU's kernel time inside that window (``summarize_trace``: the
window is one "step" of the trace).

    python profiles/prompt_latency.py --model random:llama-3.2-1b --cached --torch-profile cached.json

Nsight Systems (the NVTX ranges name each step's phases):

    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o prompt_latency \
        python profiles/prompt_latency.py --model random:llama-3.2-1b --cached --batch-size 8
"""

import argparse
import cProfile
import json
import math
import pstats
import random
import statistics
import sys
import time

from graphrt.cli_args import add_model_arguments, kernel_options
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.profile import analyze_trace, load_trace, step_annotation, summarize_trace, torch_trace
from graphrt.sampling.params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model="random:llama-3.2-1b")
    parser.add_argument("--batch-size", type=int, default=0, help="sequences decoding while requests arrive")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of those sequences")
    parser.add_argument("--prefix-len", type=int, default=1500, help="tokens every arriving prompt starts with")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens of each arriving prompt's own")
    parser.add_argument("--requests", type=int, default=24, help="requests timed (after 4 untimed)")
    parser.add_argument("--cached", action="store_true", help="prefix caching on (off: each prompt computed whole)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step's token budget")
    parser.add_argument("--torch-profile", metavar="FILE", help="record the timed requests with torch.profiler")
    parser.add_argument("--kernels-json", metavar="FILE",
                        help="with --torch-profile: write the window's whole kernel breakdown (every kernel's "
                             "time and exposed time a request, graphrt.profile.analyze_trace) as JSON")
    parser.add_argument("--python-profile", metavar="FILE",
                        help="record the timed requests' host work with cProfile (pstats file), printing its top rows")
    return parser.parse_args(argv)


def host_profile_table(stats: pstats.Stats, requests: int, rows: int = 30) -> str:
    """The functions that took the most host time, by own time and by time inside, in microseconds a
    request (cProfile's overhead included: compare rows with each other, not with unprofiled runs)."""
    entries = [(f"{path.rsplit('/', 1)[-1]}:{line}({name})", calls, own, inside)
               for (path, line, name), (_, calls, own, inside, _) in stats.stats.items()]
    lines = []
    for title, column in (("own time", 2), ("time inside", 3)):
        lines.append(f"host time by {title}, us a request ({requests} requests):")
        for where, calls, own, inside in sorted(entries, key=lambda entry: -entry[column])[:rows]:
            lines.append(f"  {own / requests * 1e6:9.1f} own {inside / requests * 1e6:9.1f} inside "
                         f"{calls / requests:7.1f} calls  {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warmup = 4
    total = warmup + args.requests
    decode_tokens = 64 + 8 * total  # the decoding sequences outlast the run
    max_len = max(args.context + decode_tokens, args.prefix_len + args.suffix_len + 2)
    engine = LLMEngine(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch_size + 2,
        max_model_len=max_len, enable_prefix_caching=args.cached,
        max_num_batched_tokens=args.max_num_batched_tokens, **kernel_options(args)), progress=False)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def tokens(length: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(length)]

    prefix = tokens(args.prefix_len)
    decoding = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request(tokens(args.context), decoding)
    arriving = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(prefix + tokens(args.suffix_len), arriving)  # the prefix, cached from here with --cached
    while engine.scheduler.waiting or engine.scheduler.has_prefill_under_way():
        engine.step()

    add_ms, steps_ms, num_steps = [], [], []
    profiling = args.torch_profile is not None
    trace = torch_trace(args.torch_profile, engine.device) if profiling else None
    host_profile = cProfile.Profile() if args.python_profile else None
    for index in range(total):
        for _ in range(3):  # the running batch decodes between arrivals (a pipelined step stays in flight)
            engine.step()
        timed = index >= warmup
        if timed and index == warmup and trace is not None:
            trace.__enter__()
        if timed and host_profile is not None:
            host_profile.enable()
        with step_annotation(profiling and timed):
            start = time.perf_counter()
            request_id = engine.add_request(prefix + tokens(args.suffix_len), arriving)
            added = time.perf_counter()
            steps = 0
            while True:
                steps += 1
                if any(out.request_id == request_id and out.token_ids for out in engine.step()):
                    break
            done = time.perf_counter()
        if host_profile is not None:
            host_profile.disable()
        if timed:
            add_ms.append((added - start) * 1e3)
            steps_ms.append((done - added) * 1e3)
            num_steps.append(steps)
    if trace is not None:
        trace.__exit__(None, None, None)

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.3f}"

    dtype = str(engine.dtype).removeprefix("torch.")
    ttft = [a + s for a, s in zip(add_ms, steps_ms)]
    print(f"prompt latency: {args.model} on {engine.device} ({dtype}), {args.batch_size} decoding, prompts of "
          f"{args.prefix_len} shared + {args.suffix_len} own tokens, prefix caching "
          f"{'on' if args.cached else 'off'}: TTFT median {median(ttft)} ms "
          f"(p90 {sorted(ttft)[math.ceil(0.9 * len(ttft)) - 1]:.3f}) = add_request {median(add_ms)} + steps "
          f"{median(steps_ms)} ms ({statistics.median(num_steps):g} step calls)")
    if profiling:
        print(summarize_trace(args.torch_profile))
        if args.kernels_json:
            with open(args.kernels_json, "w") as handle:
                json.dump(analyze_trace(load_trace(args.torch_profile), top=40), handle, indent=1)
    if host_profile is not None:
        host_profile.dump_stats(args.python_profile)
        print(host_profile_table(pstats.Stats(host_profile), args.requests))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
