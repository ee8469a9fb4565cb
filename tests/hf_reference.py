"""HF transformers as the trusted reference: greedy continuations, teacher-forced logits, the incremental
decode of a given sequence, and a decoder's logit error against a judge's logits."""

from __future__ import annotations

import torch

#: Two logits closer than this (float32, logits of order 1-10) count as a tie that rounding may flip.
TIE_TOLERANCE = 1e-4


@torch.inference_mode()
def hf_greedy_with_logits(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of one prompt, EOS included like any other token (argmax each step,
    through HF's own KV cache; ``generate`` is avoided because its EOS handling would differ), and the
    logits each token was chosen from: [max_new_tokens, V] float32."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    past = None
    generated: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        out = model(ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
        next_id = int(logits[-1].argmax())
        generated.append(next_id)
        ids = torch.tensor([[next_id]], device=device)
    return generated, torch.stack(logits)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of one prompt (see ``hf_greedy_with_logits``)."""
    return hf_greedy_with_logits(model, prompt, max_new_tokens)[0]


@torch.inference_mode()
def hf_step_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] float32: HF's logits for each generated position, teacher-forced on
    ``prompt + generated`` (row t scores the token that follows ``generated[:t]``)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + generated], device=device)
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def assert_greedy_matches(model, prompt: list[int], ours: list[int], tolerance: float = TIE_TOLERANCE) -> int:
    """Check ``ours`` against HF greedy; returns how many leading tokens agree exactly.

    Every token we chose must be HF's argmax at that step up to ``tolerance`` (teacher-forced on our
    own sequence, so a near-tie flipped by rounding is judged on HF's logits, not skipped).
    """
    reference = hf_greedy(model, prompt, len(ours))
    logits = hf_step_logits(model, prompt, ours)
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(ours, device=logits.device)[:, None])[:, 0]
    gaps = (best - chosen).tolist()
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= tolerance, (
        f"step {worst}: we chose token {ours[worst]} whose HF logit is {gaps[worst]:.3g} below the best"
    )
    # Where the sequences diverge, the check above already showed our token ties HF's best there.
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(ours))


def graphrt_greedy_with_logits(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """graphrt's greedy tokens for one prompt and the logits it sampled each from: [max_tokens, V]
    float32 (the prefill step's, then each decode step's)."""
    from graphrt import SamplingParams

    model = llm.engine.runner.model
    recorded: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        recorded.append(logits[0].float())  # compute_logits returns the model dtype
        return logits

    model.compute_logits = recording
    try:
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        del model.compute_logits  # back to the class's method
    return out.token_ids, torch.stack(recorded)


@torch.inference_mode()
def hf_incremental_decode(model, prompt: list[int], tokens: list[int], top: int
                          ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``model`` decoding the given sequence as it decodes its own: the prompt in one forward, then one
    of ``tokens`` a step through its KV cache (the fair yardstick for a decode step, where
    ``hf_step_logits`` runs one forward of the whole sequence). Its greedy choice before each token, and
    its ``top`` most likely tokens there: ids [len(tokens), top] int64 and their float32 log
    probabilities, same shape."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    past, rows = out.past_key_values, [out.logits[0, -1].float()]
    for token in tokens[:-1]:
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1].float())
    logprobs = torch.stack(rows).log_softmax(dim=-1)
    best = logprobs.topk(top, dim=-1)
    return logprobs.argmax(dim=-1).tolist(), best.indices, best.values


def logprob_errors(judge_logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[T] float32: at each step the largest |log p - log p_judge| over the tokens ``ids`` [T, K] whose
    log probabilities ``values`` [T, K] a decoder reported; ``judge_logits`` [T, V] float32. Log
    probabilities, so a shift common to the row cancels."""
    judged = judge_logits.log_softmax(dim=-1).gather(1, ids)
    return (values - judged).abs().max(dim=-1).values


def reported_top(output, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A graphrt ``RequestOutput``'s reported most likely tokens at each step (``SamplingParams.logprobs``
    set): ids [T, K] int64 and their float32 log probabilities, same shape, on ``device``."""
    ids = torch.tensor([[token for token, _ in entry.top] for entry in output.logprobs], device=device)
    values = torch.tensor([[value for _, value in entry.top] for entry in output.logprobs], device=device)
    return ids, values
