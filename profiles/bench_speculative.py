"""Speculative decoding (prompt-lookup drafts) against plain decoding: tokens per second, one engine
each on the same prompts, greedy, side by side in one run.

Scenarios: ``repeat``, the model asked to repeat a given passage of about 300 tokens word for word, and
``edit``, to repeat it with one word changed throughout (the drafts find the passage in the prompt);
``free``, free-form chat questions (few drafts: the adaptive length must keep the cost of the misses
small). Each at the batch sizes given (the prompts repeated to fill a batch). Prints a table with the
acceptance rate, tokens per verification and the median verify step (wall, its tokens read) beside
each ratio, and a plain step (wall per token of a row), checks that both engines gave the same tokens,
and writes ``--json`` (with the decode graphs' replay times and the host's share of each kind of step
that the speculative engine's draft lengths weigh, ``graphrt.speculative.step_costs``).
``--draft-model`` drafts with a model instead of prompt lookup. Models without a tokenizer get
token-id prompts (a random passage, then its first half again).

    python profiles/bench_speculative.py --json speculative.json                 # the default model
    python profiles/bench_speculative.py --model random:llama-3.2-1b --num-tokens 4 --batch-sizes 1 8
"""

import argparse
import dataclasses
import json
import random
import time

import torch

from graphrt import LLM, SamplingParams
from graphrt.cli_args import add_model_arguments, kernel_options

#: Written for this benchmark: plain prose that a small model can copy, about 300 tokens.
PASSAGE = (
    "The harbour town woke slowly on winter mornings. Before the sun cleared the eastern hills, the "
    "fishing boats were already moving out past the breakwater, their lamps swinging in the swell, while "
    "the baker on the square pulled the first trays of bread from an oven that had burned all night. By "
    "seven the gulls had found the fish market, where the auctioneer called prices in a voice that carried "
    "across the water, and the buyers from the inland restaurants stamped their feet against the cold. The "
    "school bell rang at half past eight. Children ran along the sea wall with their coats open, and the "
    "old men who sat outside the café every day, whatever the weather, argued about the tides, the price "
    "of diesel and the mayor's plan to widen the road to the lighthouse. At noon the boats began to come "
    "back, low in the water, and the whole town seemed to turn towards the harbour to see what the sea had "
    "given. In the afternoon the wind usually rose. Shutters banged, washing snapped on the lines behind the "
    "houses, and the ferry to the island ran late or not at all. When the lamps came on along the front, "
    "the town grew quiet again, and the only sound was the sea working against the stones of the old pier."
)
EDIT = ("harbour", "port")
#: Positions each engine's cache holds a sequence for: the passage prompt and 320 tokens fit.
MAX_MODEL_LEN = 1024
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "What are the main causes of the seasons on Earth?",
    "Describe a good morning routine for a busy student.",
    "Give three tips for learning a new language.",
    "Why do leaves change colour in autumn?",
    "Summarise the plot of a detective story you invent.",
    "What should someone pack for a week of hiking?",
]


def scenario_prompts(llm: LLM, scenario: str) -> list:
    """The scenario's prompts: chat-templated token ids, or for a model without a tokenizer token-id
    prompts with repeats in them (repeat, edit) or without (free)."""
    if llm.engine.tokenizer is None:
        rng = random.Random(scenario)
        vocab = llm.engine.model_config.vocab_size
        passage = [rng.randrange(3, vocab) for _ in range(300)]
        if scenario == "free":
            return [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(len(FREE_PROMPTS))]
        return [passage + passage[:150]]
    if scenario == "repeat":
        return [llm.chat_prompt_ids(f"Repeat the following passage word for word.\n\n{PASSAGE}")]
    if scenario == "edit":
        old, new = EDIT
        return [llm.chat_prompt_ids(f"Repeat the following passage word for word, but write '{new}' wherever it "
                                    f"says '{old}'.\n\n{PASSAGE}")]
    return [llm.chat_prompt_ids(text) for text in FREE_PROMPTS]


def run(llm: LLM, prompts: list, params: SamplingParams, repeats: int) -> tuple[float, list[list[int]]]:
    """Median seconds of ``repeats`` timed generates (after one warm-up) and the tokens of the last."""
    llm.generate(prompts, params)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], [out.token_ids for out in outs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model=None)
    parser.add_argument("--num-tokens", type=int, default=4, help="draft tokens a step at most (K)")
    parser.add_argument("--draft-model", default=None, help="draft with this model instead of prompt lookup "
                        "(draft:MODEL:K; the target itself, e.g. random:llama-3.2-1b, drafts what it keeps)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--scenarios", nargs="+", default=["repeat", "edit", "free"],
                        choices=["repeat", "edit", "free"])
    parser.add_argument("--max-tokens", type=int, default=320, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per point (median)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    # Both engines live side by side: each gets a cache for its largest batch at MAX_MODEL_LEN instead of
    # the GPU's free memory (the first engine would take it all).
    cache = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batch_sizes),
                 num_kv_blocks=max(args.batch_sizes) * MAX_MODEL_LEN // 16 + 1, block_size=16)
    options = dict(dtype=args.dtype, device=args.device, progress=False, **cache, **kernel_options(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    method = f"ngram:{args.num_tokens}" if args.draft_model is None else f"draft:{args.draft_model}:{args.num_tokens}"
    engines = {"plain": LLM(args.model, **options), "speculative": LLM(args.model, speculative=method, **options)}
    # Each verify step's wall time (it waits for its tokens), to set beside a plain step's.
    verify_seconds: list[float] = []
    verify = engines["speculative"].engine.runner.verify

    def timed_verify(*call_args):
        start = time.perf_counter()
        result = verify(*call_args)
        verify_seconds.append(time.perf_counter() - start)
        return result

    engines["speculative"].engine.runner.verify = timed_verify
    results = []
    print(f"method {method}")
    print(f"{'scenario':>8} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>11} {'ratio':>6} {'accepted':>8} "
          f"{'tok/step':>8} {'verify ms':>9} {'plain ms':>8} {'same':>5}")
    for scenario in args.scenarios:
        base = scenario_prompts(engines["plain"], scenario)
        for batch in args.batch_sizes:
            prompts = [base[i % len(base)] for i in range(batch)]
            before = dataclasses.replace(engines["speculative"].engine.speculative_stats)
            verify_seconds.clear()
            seconds, tokens = {}, {}
            for name, llm in engines.items():
                seconds[name], tokens[name] = run(llm, prompts, params, args.repeats)
            after = engines["speculative"].engine.speculative_stats
            proposed = after.proposed_tokens - before.proposed_tokens
            accepted = after.accepted_tokens - before.accepted_tokens
            steps = after.verify_steps - before.verify_steps
            produced = after.produced_tokens - before.produced_tokens
            generated = sum(len(t) for t in tokens["plain"])
            row = dict(scenario=scenario, batch_size=batch, generated_tokens=generated,
                       plain_tokens_per_s=generated / seconds["plain"],
                       speculative_tokens_per_s=sum(len(t) for t in tokens["speculative"]) / seconds["speculative"],
                       acceptance_rate=accepted / proposed if proposed else 0.0,
                       tokens_per_verify_step=produced / steps if steps else 0.0,
                       same_tokens=tokens["plain"] == tokens["speculative"],
                       verify_ms_median=(1e3 * sorted(verify_seconds)[len(verify_seconds) // 2]
                                         if verify_seconds else None),
                       plain_ms_per_token_row=1e3 * batch / (generated / seconds["plain"]),
                       host_share_ms={kind: 1e3 * extra for kind, extra in
                                      engines["speculative"].engine.step_costs.extra_seconds.items()},
                       measured_verify_speedup=engines["speculative"].engine.drafter.payoff.speedups())
            row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
            results.append(row)
            print(f"{scenario:>8} {batch:>5} {row['plain_tokens_per_s']:>11.1f} "
                  f"{row['speculative_tokens_per_s']:>11.1f} {row['speedup']:>6.2f} {row['acceptance_rate']:>8.2f} "
                  f"{row['tokens_per_verify_step']:>8.2f} "
                  f"{row['verify_ms_median'] or 0:>9.3f} {row['plain_ms_per_token_row']:>8.3f} "
                  f"{str(row['same_tokens']):>5}")
    replay_ms = engines["speculative"].engine.decode_runner.stats.as_dict()["replay_ms"]
    for llm in engines.values():
        llm.close()
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model or "default", device=device, method=method, num_tokens=args.num_tokens,
                           max_tokens=args.max_tokens, replay_ms=replay_ms, rows=results), f, indent=2)


if __name__ == "__main__":
    main()
