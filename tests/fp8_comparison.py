"""The default model in FP8 (weights, then weights and KV cache) against itself unquantised: greedy
tokens before the first difference, the largest logit difference while the sequences agree, and what
happens where they part. Shared by the CPU test (tests/test_fp8.py) and the H200 one
(tests/test_gpu_fp8.py)."""

from __future__ import annotations

import torch
from chat_questions import CHAT_QUESTIONS
from hf_reference import graphrt_greedy_with_logits

from graphrt import SamplingParams

#: The eight questions the FP8 figures are measured on (all but the translation and the planets).
QUESTIONS = CHAT_QUESTIONS[:7] + CHAT_QUESTIONS[8:9]
NEW_TOKENS = 48
#: The configurations compared with the unquantised model: EngineConfig fields.
FP8_CONFIGS = {"fp8 weights": dict(quantization="fp8"),
               "fp8 weights + fp8 KV cache": dict(quantization="fp8", kv_cache_dtype="fp8")}


def greedy_runs(llm, batched: bool = False) -> list[tuple[list[int], torch.Tensor]]:
    """Each question's greedy tokens and the float32 logits [NEW_TOKENS, V] they were chosen from
    (eager forwards: the logits are read as the model computes them): one prompt at a time, or with
    ``batched`` all in one batch (fewer, larger steps: what the CPU can afford). A batched run checks
    that each recorded row's argmax is its request's token, so rows cannot be mixed up unseen."""
    prompts = [llm.chat_prompt_ids(question) for question in QUESTIONS]
    if not batched:
        runs = []
        for prompt in prompts:
            tokens, logits = graphrt_greedy_with_logits(llm, prompt, NEW_TOKENS)
            runs.append((tokens, logits.float().cpu()))
        return runs
    model = llm.engine.runner.model
    recorded: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        recorded.append(logits.float().cpu())
        return logits

    model.compute_logits = recording
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        del model.compute_logits  # back to the class's method
    assert [r.shape[0] for r in recorded] == [len(prompts)] * NEW_TOKENS, "expected one prefill and lockstep decodes"
    steps = torch.stack(recorded, dim=1)  # [prompts, NEW_TOKENS, V]
    runs = [(out.token_ids, logits) for out, logits in zip(outputs, steps)]
    for tokens, logits in runs:
        assert logits.argmax(dim=-1).tolist() == tokens, "a recorded logits row is not its request's"
    return runs


def compare(reference: list[tuple[list[int], torch.Tensor]], other: list[tuple[list[int], torch.Tensor]]) -> dict:
    """Figures of ``other`` against ``reference`` over the questions: ``agreed`` (per question, tokens
    equal before the first difference), ``largest_logit_difference`` (over every step whose prefix the
    two share: up to and including the first difference),
    ``largest_chosen_logit_difference`` (the same at the reference's chosen token), and per parting the
    reference's ``margin`` (its logit of its own token minus its logit of other's) and whether other took the
    reference's ``runner_up``."""
    agreed, largest, largest_chosen, partings = [], 0.0, 0.0, []
    for (ref_tokens, ref_logits), (tokens, logits) in zip(reference, other):
        first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        agreed.append(first)
        shared = min(first + 1, len(ref_tokens))
        difference = (logits[:shared] - ref_logits[:shared]).abs()
        largest = max(largest, float(difference.max()))
        chosen = torch.tensor(ref_tokens[:shared])[:, None]
        largest_chosen = max(largest_chosen, float(difference.gather(1, chosen).max()))
        if first < len(ref_tokens):
            row = ref_logits[first]
            runner_up = int(row.topk(2).indices[1])
            partings.append(dict(margin=round(float(row[ref_tokens[first]] - row[tokens[first]]), 3),
                                 runner_up=tokens[first] == runner_up))
    return dict(agreed=agreed, total=sum(agreed), of=NEW_TOKENS * len(reference),
                largest_logit_difference=round(largest, 3), largest_chosen_logit_difference=round(largest_chosen, 3),
                partings=partings)


def describe(name: str, figures: dict) -> str:
    margins = [p["margin"] for p in figures["partings"]]
    outside = sum(not p["runner_up"] for p in figures["partings"])
    return (f"[{name}] tokens equal before the first difference {figures['total']}/{figures['of']} (per prompt "
            f"{figures['agreed']}); largest logit difference while equal {figures['largest_logit_difference']} (at the "
            f"reference's token {figures['largest_chosen_logit_difference']}); "
            f"reference margins where they part {margins}; partings not at the reference's runner-up: {outside}")
