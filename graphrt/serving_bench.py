"""``graphrt bench-serving``: one engine under load, as a serving frontend drives it.

Requests arrive at Poisson times (``rate`` a second, seeded; an infinite rate makes an offline run, every
request there at the start), each a random prompt of token ids with a length drawn uniformly from
``mean - spread .. mean + spread`` and asking for an output length drawn the same way (``ignore_eos``:
every request generates exactly that many tokens), greedy or sampled at a ``temperature`` and ``top_p``
with a seed of its own; a ``shared_prefix`` fraction of them start with one common prefix of a given
length (a system prompt), the rest of their prompt their own. The loop adds every request whose arrival
time has passed, then runs one ``engine.step()``; when nothing is running it sleeps until the next
arrival. A token counts as delivered when the step that returns it returns (pipelined steps return their
tokens one call late, as a frontend sees them).

Reported: time to first token (TTFT: arrival to the step that returned the first token), inter-token
latency (ITL: the gaps between successive steps that returned tokens to a request; a speculative step
returning several counts once), time per output token per request (TPOT: first to last token over the
tokens after the first), p50 and p99 of each, output tokens and requests a second over the run, and the
prefix-cache hit rate (prompt tokens found in the cache over those looked up in the run; None without
``--enable-prefix-caching``), the sequences running after each step (mean, largest: the decode
batch the load kept up) and the preemptions the load caused. A short warm-up runs first and is not
counted.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass

from graphrt.base.errors import ConfigError
from graphrt.base.files import write_json
from graphrt.base.plots import plain_log_labels, pyplot, save_figure
from graphrt.sampling.params import SamplingParams


@dataclass(frozen=True)
class LengthRange:
    """Integers drawn uniformly from ``mean - spread`` to ``mean + spread`` (both >= 1)."""

    mean: int
    spread: int = 0

    def __post_init__(self) -> None:
        if self.spread < 0 or self.mean - self.spread < 1:
            raise ConfigError(f"a length range needs spread >= 0 and mean - spread >= 1, got {self.mean}:{self.spread}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"512"`` or ``"512:128"`` (mean, spread)."""
        mean, _, spread = text.partition(":")
        try:
            values = int(mean), int(spread) if spread else 0
        except ValueError:
            raise ConfigError(f"expected MEAN or MEAN:SPREAD (integers), got {text!r}") from None
        return cls(*values)

    @property
    def largest(self) -> int:
        return self.mean + self.spread

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.mean - self.spread, self.mean + self.spread)


@dataclass(frozen=True)
class LoadSpec:
    """The load: ``num_requests`` arriving at ``rate`` a second (``inf``: all at once); prompt and output
    lengths; a ``shared_prefix_fraction`` of the prompts starting with one common ``shared_prefix_len``
    tokens; every request sampled at ``temperature`` (0: greedy) and ``top_p``."""

    rate: float
    num_requests: int
    prompt_len: LengthRange
    output_len: LengthRange
    shared_prefix_fraction: float = 0.0
    shared_prefix_len: int = 0
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigError(f"the arrival rate must be > 0 requests a second, got {self.rate}")
        if self.num_requests < 1:
            raise ConfigError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0 or self.shared_prefix_len < 0:
            raise ConfigError(f"the shared prefix needs a fraction in [0, 1] and a length >= 0, got "
                              f"{self.shared_prefix_fraction}:{self.shared_prefix_len}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"the temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def longest_sequence(self) -> int:
        return self.shared_prefix_len + self.prompt_len.largest + self.output_len.largest


@dataclass(frozen=True)
class LoadRequest:
    arrival_s: float  # after the start of the run
    prompt_token_ids: list[int]
    params: SamplingParams  # exactly its output length (ignore_eos), its own seed
    shares_prefix: bool

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


def make_requests(spec: LoadSpec, vocab_size: int) -> list[LoadRequest]:
    """The load's requests in arrival order (deterministic for a seed). Token ids avoid 0-2 (special
    tokens in most vocabularies)."""
    rng = random.Random(spec.seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(spec.shared_prefix_len)]
    requests, clock = [], 0.0
    for _ in range(spec.num_requests):
        clock += 0.0 if math.isinf(spec.rate) else rng.expovariate(spec.rate)
        shares = rng.random() < spec.shared_prefix_fraction
        own = [rng.randrange(3, vocab_size) for _ in range(spec.prompt_len.draw(rng))]
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.output_len.draw(rng),
                                ignore_eos=True, seed=rng.randrange(2**63))
        requests.append(LoadRequest(clock, (prefix if shares else []) + own, params, shares))
    return requests


@dataclass
class RequestTiming:
    arrival_s: float
    delivery_s: list[float]  # when each step that returned tokens to it returned
    tokens: int = 0
    preemptions: int = 0  # times the engine preempted it (recomputed or swapped out)

    @property
    def ttft_s(self) -> float:
        return self.delivery_s[0] - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.delivery_s, self.delivery_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        return (self.delivery_s[-1] - self.delivery_s[0]) / (self.tokens - 1) if self.tokens > 1 else None


def run_load(engine, requests: list[LoadRequest], clock=time.perf_counter, sleep=time.sleep,
             running: list[int] | None = None) -> tuple[list[RequestTiming], float]:
    """Drive ``engine`` (an ``LLMEngine``) through ``requests``; returns each request's timing and the
    run's duration in seconds (first arrival counted from the start, to the last token). ``running``,
    when given, gets the number of sequences the engine was running after each step."""
    timings = [RequestTiming(r.arrival_s, []) for r in requests]
    start, next_request = clock(), 0
    while next_request < len(requests) or engine.has_unfinished_requests():
        now = clock() - start
        while next_request < len(requests) and requests[next_request].arrival_s <= now:
            request = requests[next_request]
            engine.add_request(request.prompt_token_ids, request.params, request_id=str(next_request))
            next_request += 1
        if not engine.has_unfinished_requests():
            sleep(max(0.0, requests[next_request].arrival_s - (clock() - start)))
            continue
        outputs = engine.step()
        returned = clock() - start
        if running is not None:
            running.append(len(engine.scheduler.running))
        for out in outputs:
            timing = timings[int(out.request_id)]
            if len(out.token_ids) > timing.tokens:
                timing.delivery_s.append(returned)
                timing.tokens = len(out.token_ids)
            timing.preemptions = out.num_preemptions
    return timings, clock() - start


def _percentiles(values: list[float]) -> dict:
    """p50 and p99 in ms (None for no values)."""
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": round(1e3 * statistics.median(ordered), 3), "p99_ms": round(1e3 * p99, 3)}


def summarize(timings: list[RequestTiming], duration_s: float, prefix_hit_rate: float | None = None,
              running: list[int] | None = None) -> dict:
    """The run's latency percentiles and throughput (see the module docstring); ``prefix_hit_rate``:
    the prompt tokens the prefix cache held over those looked up in the run (None without one);
    ``running``: sequences running after each step, whose mean and largest are reported (the decode
    batch the load kept up)."""
    tokens = sum(t.tokens for t in timings)
    return {
        "requests": len(timings),
        "duration_s": round(duration_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration_s, 1) if duration_s > 0 else None,
        "requests_per_s": round(len(timings) / duration_s, 3) if duration_s > 0 else None,
        "ttft": _percentiles([t.ttft_s for t in timings if t.delivery_s]),
        "itl": _percentiles([gap for t in timings for gap in t.itl_s]),
        "tpot": _percentiles([t.tpot_s for t in timings if t.tpot_s is not None]),
        "prefix_hit_rate": None if prefix_hit_rate is None else round(prefix_hit_rate, 4),
        "preemptions": sum(t.preemptions for t in timings),
        "running_mean": round(statistics.fmean(running), 2) if running else None,
        "running_max": max(running) if running else None,
    }


def format_summary(summary: dict) -> str:
    def ms(stat: dict) -> str:
        return "  ".join(f"{key.removesuffix('_ms')} {value:.2f} ms" if value is not None else f"{key} -"
                         for key, value in stat.items())
    return "\n".join([
        f"requests {summary['requests']} in {summary['duration_s']:.2f} s: {summary['requests_per_s']} req/s, "
        f"{summary['output_tokens']} output tokens ({summary['output_tokens_per_s']} tok/s)",
        f"TTFT  {ms(summary['ttft'])}",
        f"ITL   {ms(summary['itl'])}",
        f"TPOT  {ms(summary['tpot'])}",
        f"prefix cache hit rate: {summary['prefix_hit_rate'] if summary['prefix_hit_rate'] is not None else '-'}",
        f"sequences running after a step: mean {summary['running_mean']}, largest {summary['running_max']}; "
        f"preemptions {summary['preemptions']}",
    ])


def write_plot(timings: list[RequestTiming], path: str, title: str) -> None:
    """CDFs of TTFT and ITL (ms, log scale)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in (("TTFT", [t.ttft_s for t in timings if t.delivery_s]),
                         ("ITL", [gap for t in timings for gap in t.itl_s])):
        ordered = sorted(1e3 * v for v in values)
        if ordered:
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    ax.set_xscale("log")
    plain_log_labels(ax.xaxis)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests (TTFT) / of gaps (ITL)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(args) -> int:
    from graphrt.cli_args import kernel_options
    from graphrt.llm import LLM

    spec = LoadSpec(rate=args.rate, num_requests=args.num_requests, prompt_len=args.prompt_len,
                    output_len=args.output_len,
                    shared_prefix_fraction=args.shared_prefix[0], shared_prefix_len=args.shared_prefix[1],
                    seed=args.seed, temperature=args.temperature, top_p=args.top_p)
    max_model_len = args.max_model_len or spec.longest_sequence
    if spec.longest_sequence > max_model_len:
        raise ConfigError(f"the load's longest sequence ({spec.longest_sequence} tokens: prefix, prompt and output "
                          f"at their largest) exceeds --max-model-len {max_model_len}")
    options = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                   progress=False, **kernel_options(args))
    if args.speculative is not None:
        options["speculative"] = args.speculative
    options.update(enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
                   max_num_batched_tokens=args.max_num_batched_tokens, swap_space_bytes=args.swap_space_mib << 20,
                   mixed_step_tokens=args.mixed_step_tokens, num_kv_blocks=args.num_kv_blocks,
                   tensor_parallel_size=args.tensor_parallel_size)
    try:
        llm = LLM(args.model, **options)
    except ConfigError as exc:
        if args.max_model_len is None and "max_position_embeddings" in str(exc):  # the load asked for too long
            raise ConfigError(f"the load's longest sequence ({spec.longest_sequence} tokens: prefix, prompt and "
                              f"output at their largest) is longer than the model takes ({exc}); shorten "
                              "--prompt-len, --output-len or --shared-prefix") from None
        raise
    with llm:
        engine = llm.engine
        warm = make_requests(LoadSpec(1e6, 2, spec.prompt_len, LengthRange(4), seed=spec.seed + 1,
                                      temperature=spec.temperature, top_p=spec.top_p), engine.model_config.vocab_size)
        run_load(engine, warm)
        requests = make_requests(spec, engine.model_config.vocab_size)
        manager = engine.block_manager
        before = manager.prefix_queried_tokens, manager.prefix_hit_tokens
        running: list[int] = []
        timings, duration = run_load(engine, requests, running=running)
        queried, hit = manager.prefix_queried_tokens - before[0], manager.prefix_hit_tokens - before[1]
        hit_rate = (hit / queried if queried else 0.0) if manager.prefix_caching else None
        device = engine.device
        prompt_graphs = None if engine.prefill_graphs is None else engine.prefill_graphs.stats.as_dict()
        decode_graphs = engine.decode_runner.stats.as_dict()
    summary = summarize(timings, duration, hit_rate, running)
    print(format_summary(summary))
    if args.json:
        load = asdict(spec) | ({"rate": "inf"} if math.isinf(spec.rate) else {})  # JSON has no infinity
        write_json(args.json, {"model": args.model, "device": str(device), "load": load,
                               "max_num_seqs": args.max_num_seqs, "speculative": args.speculative,
                               "enable_chunked_prefill": args.enable_chunked_prefill,
                               "enable_prefix_caching": args.enable_prefix_caching,
                               "swap_space_mib": args.swap_space_mib,
                               "num_kv_blocks": engine.block_manager.allocator.num_blocks,
                               "max_num_batched_tokens": engine.max_num_batched_tokens,
                               "mixed_step_tokens": args.mixed_step_tokens, "prompt_graphs": prompt_graphs,
                               "tensor_parallel_size": args.tensor_parallel_size,
                               "decode_graphs": decode_graphs, **summary})
    if args.plot:
        rate = "offline" if math.isinf(spec.rate) else f"{spec.rate:g} req/s"
        write_plot(timings, args.plot, f"{args.model}: {rate}, {spec.num_requests} requests")
    return 0
