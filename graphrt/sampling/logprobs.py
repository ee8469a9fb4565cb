"""Log probabilities of chosen tokens and of each row's most likely tokens, computed on the device.

A row's log probabilities are ``log_softmax`` of its raw float32 logits (before temperature, top-k and
top-p: what the model assigns, the quantity evaluation harnesses compare), computed as ``logit -
logsumexp(row)``. ``token_logprobs`` runs without a host sync and with shapes fixed by ``[B, V]`` and
the number of top tokens, so a decode graph captures it; its results are packed into two ``[B, 1 + K]``
tensors so that one copy each brings them to the host, where ``unpack_rows`` turns them into
``TokenLogprobs``.

Ties: the top tokens are ``torch.topk``'s, ordered by value; tokens with equal logits may appear in
either order (and at the K-th place either may be listed). A token's rank is one plus the number of
tokens with a strictly larger logit, so tied tokens share a rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One token's log probability under the model, and the most likely tokens at its position.

    ``token_id``: the token scored (sampled, or the prompt's next token); ``logprob``: its float32 log
    probability; ``rank``: 1 + the number of tokens with a larger logit (1 = a greedy choice); ``top``:
    ``(token id, logprob)`` of the k most likely tokens, most likely first (k as the request asked; the
    whole vocabulary when k exceeds it).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int,
                   values_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log probabilities of ``token_ids`` and of each row's ``num_top`` most likely tokens.

    logits: [B, V] float32; token_ids: [B] int64 (the token scored in each row); num_top: K, at most V.
    Returns ``(values, ids)``: values [B, 1 + K] float32 = (the token's logprob, the top K logprobs in
    descending order); ids [B, 1 + K] int64 = (the token's rank, the top K token ids). Written into
    ``values_out`` / ``ids_out`` (at least [B, 1 + K]; their first B rows and 1 + K columns) when given,
    so that nothing is allocated outside the scratch of the reductions: capturable in a CUDA graph.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    rows, vocab = logits.shape
    if not 0 <= num_top <= vocab:
        raise ValueError(f"num_top must lie in [0, {vocab}], got {num_top}")
    if token_ids.shape != (rows,):
        raise ValueError(f"token_ids must be [{rows}], got {tuple(token_ids.shape)}")
    width = 1 + num_top
    values = torch.empty(rows, width, dtype=torch.float32, device=logits.device) if values_out is None \
        else values_out[:rows, :width]
    ids = torch.empty(rows, width, dtype=torch.int64, device=logits.device) if ids_out is None \
        else ids_out[:rows, :width]
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, 1]
    chosen = logits.gather(1, token_ids[:, None])  # [B, 1]
    values[:, :1] = chosen - log_normalizer
    ids[:, :1] = (logits > chosen).sum(dim=-1, keepdim=True) + 1
    if num_top:
        top_values, top_ids = torch.topk(logits, num_top, dim=-1)  # [B, K] each, descending
        values[:, 1:] = top_values - log_normalizer
        ids[:, 1:] = top_ids
    return values, ids


def unpack_rows(values: torch.Tensor, ids: torch.Tensor, token_ids: Sequence[int],
                num_tops: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Host side of ``token_logprobs``: values / ids ([B, 1 + K] on the CPU) -> one ``TokenLogprobs`` per
    row that asked (``num_tops[i]`` top tokens, at most K), None for rows whose ``num_tops[i]`` is None."""
    values_rows, ids_rows = values.tolist(), ids.tolist()
    unpacked: list[TokenLogprobs | None] = []
    for token_id, row_values, row_ids, num_top in zip(token_ids, values_rows, ids_rows, num_tops):
        if num_top is None:
            unpacked.append(None)
            continue
        top = list(zip(row_ids[1:1 + num_top], row_values[1:1 + num_top]))
        unpacked.append(TokenLogprobs(token_id=int(token_id), logprob=row_values[0], rank=row_ids[0], top=top))
    return unpacked


def rows_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                  num_tops: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Eager ``token_logprobs`` and ``unpack_rows`` together: logits [B, V] float32, token_ids [B] int64
    (on the logits' device), ``num_tops[i]``: row i's top count or None -> one entry per row (None where
    not asked). Nothing is computed, and nothing copied, when no row asks."""
    asked = [k for k in num_tops if k is not None]
    if not asked:
        return [None] * len(num_tops)
    values, ids = token_logprobs(logits, token_ids, min(max(asked), logits.shape[1]))
    return unpack_rows(values.cpu(), ids.cpu(), token_ids.tolist(), num_tops)


#: Prompt positions scored per LM-head call: bounds the [rows, V] float32 logits a long prompt needs
#: (0.5 MiB a row at a 128k vocabulary) to 128 MiB.
PROMPT_ROWS_PER_CHUNK = 256


def prompt_logprobs(compute_logits, hidden: torch.Tensor, prompt_ids: Sequence[int], num_top: int,
                    first: int = 0) -> list[TokenLogprobs | None]:
    """Log probabilities of a prompt's tokens, each scored by the prompt before it, from one prefill's
    rows: the whole prompt's, or a chunk's.

    compute_logits: [N, hidden] -> [N, V] float32 logits (the model's LM head); hidden: [R, hidden], the
    final hidden states of prompt tokens ``first`` .. ``first + R - 1`` in order (the row of token t scores
    token t + 1); prompt_ids: the prompt's P tokens; num_top: K. Returns None for token 0 when the rows
    start there (nothing precedes it), then a ``TokenLogprobs`` for each token ``first + 1`` ..
    ``first + R`` that the prompt has, so that consecutive chunks' lists joined are the whole prompt's P
    entries. The logits are computed ``PROMPT_ROWS_PER_CHUNK`` rows at a time.
    """
    rows = hidden.shape[0]
    if first < 0 or rows < 1 or first + rows > len(prompt_ids):
        raise ValueError(f"{rows} hidden rows from token {first} for a prompt of {len(prompt_ids)} tokens")
    scored: list[TokenLogprobs | None] = [None] if first == 0 else []
    scoring = min(first + rows, len(prompt_ids) - 1) - first  # the prompt's last row scores nothing
    next_ids = torch.tensor(list(prompt_ids[first + 1:first + 1 + scoring]), dtype=torch.int64, device=hidden.device)
    for start in range(0, scoring, PROMPT_ROWS_PER_CHUNK):
        end = min(start + PROMPT_ROWS_PER_CHUNK, scoring)
        scored += rows_logprobs(compute_logits(hidden[start:end]), next_ids[start:end], [num_top] * (end - start))
    return scored
