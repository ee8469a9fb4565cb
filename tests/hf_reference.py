"""HF transformers as the trusted reference: greedy continuations and teacher-forced logits."""

from __future__ import annotations

import torch

#: Two logits closer than this (float32, logits of order 1-10) count as a tie that rounding may flip.
TIE_TOLERANCE = 1e-4


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of one prompt (no EOS stop), as a list of token ids."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


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
