"""Prefill attention through xFormers for prompts with nothing cached before them.

All prompts of a step run in one xFormers call:

* without ALiBi, tokens stay packed (``[1, T, …]``) under a block-diagonal causal mask built from the
  prompt lengths (``BlockDiagonalCausalMask.from_seqlens``), made local for a sliding window
  (``make_local_attention``): flash when it accepts the input, else cutlass;
* with ALiBi, flash takes no tensor bias, and cutlass takes one only without a block-diagonal mask, so
  prompts are scattered into a zero-padded batch ``[B, L, H, D]`` under
  ``LowerTriangularMaskWithTensorBias``; one bias ``[H, L, L]`` holding ``slope * (k - q)`` (and -inf
  outside a window) serves every prompt (stride 0 over B), since positions restart at 0 in each row.
  ``L`` is the longest prompt rounded up to 64, and K/V are repeated to all H heads while they are
  scattered (the same one copy), so cutlass runs once over ``[B, L, H, D]``. Not the BMGHK form
  (stride-0 K/V, which xFormers' cutlass path runs as one launch per KV head on its own stream): that
  path is not trusted here (an illegal memory access was seen with it; cf. pytorch/pytorch#191937 on
  that kernel with stride-0 K/V), and this plainest layout avoids it. Padding costs ``B * L^2`` attention work instead
  of ``sum(len^2)``; the bias costs ``H * L^2`` elements of the query's dtype, so ALiBi prefill of very
  long prompts is bounded by memory (as a loop of one call per prompt would be). One call for every
  prompt rather than such a loop: one launch instead of one per prompt (profiles/notes_paged_decode.md).

GQA/MQA (packed path): query ``[T, H, D]`` is viewed as ``[1, T, KVH, H/KVH, D]`` (xFormers' BMGHK)
and key/value ``[T, KVH, D]`` are expanded to that shape with stride 0, never materialised.

The masks and the ALiBi bias depend only on the step's prompt lengths, so ``plan_prefill`` builds them
once per step and every layer reuses the ``PrefillPlan`` (no per-layer host-to-device copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.attention.xformers_compat import xformers_status


def _fmha():
    import xformers.ops.fmha as fmha  # imported late: importing xFormers logs about its extension

    return fmha


@dataclass(frozen=True)
class PrefillPlan:
    """The step's prompt lengths turned into xFormers masks (device tensors), shared by all layers."""

    query_lens: tuple[int, ...]
    #: BlockDiagonalCausal(LocalAttention)Mask for packed tokens, or LowerTriangularMaskWithTensorBias
    #: whose bias is [B, H, L, L] (stride 0 over B) for the padded ALiBi batch.
    attn_bias: object
    #: ALiBi only: [T] int64, the row of each packed token in the padded [B * L] layout; None otherwise.
    padded_rows: torch.Tensor | None
    #: ALiBi only: L, rows per prompt in the padded batch (longest prompt rounded up to 64); else 0.
    padded_len: int


def _alibi_bias(slopes: torch.Tensor, length: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[H, length, length] view of a buffer whose rows are padded to 8 elements (cutlass needs aligned strides).

    Entry [h, q, k] = slope[h] * (k - q), computed in float32 then rounded once; -inf where q - k >= window.
    Causality comes from the mask class, so entries above the diagonal are never read.
    """
    padded = -(-length // 8) * 8
    buf = torch.empty(slopes.shape[0], length, padded, dtype=dtype, device=slopes.device)
    pos = torch.arange(length, device=slopes.device, dtype=torch.float32)
    distance = pos[None, :] - pos[:, None]  # [L, L]: k - q
    outside = (distance <= -sliding_window) if sliding_window is not None else None
    for h in range(slopes.shape[0]):  # one head at a time keeps the float32 temporary at L^2
        row = distance * slopes[h].float()
        if outside is not None:
            row = row.masked_fill(outside, float("-inf"))
        buf[h, :, :length].copy_(row)
    return buf[:, :, :length]


def plan_prefill(
    query_lens: list[int],
    *,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> PrefillPlan:
    """Build the masks for prompts of ``query_lens`` tokens (packed in that order).

    dtype: the query's dtype (the ALiBi bias must match it); alibi_slopes: [H] float, on ``device``.
    """
    fmha = _fmha()
    lens = [int(n) for n in query_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"every prompt needs at least one token, got lengths {lens}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if alibi_slopes is None:
        bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(lens, device=device)
        if sliding_window is not None:
            bias = bias.make_local_attention(sliding_window)
        return PrefillPlan(tuple(lens), bias, None, 0)

    if alibi_slopes.shape != (num_heads,):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({num_heads},)")
    padded_len = -(-max(lens) // 64) * 64
    table = _alibi_bias(alibi_slopes.to(device), padded_len, sliding_window, dtype)
    table = table.unsqueeze(0).expand(len(lens), *table.shape)
    # Token i of prompt b (packed index start_b + i) goes to padded row b * L + i.
    lens_t = torch.tensor(lens)
    starts = torch.cumsum(lens_t, 0) - lens_t
    shift = torch.arange(len(lens)) * padded_len - starts
    rows = torch.arange(int(lens_t.sum())) + torch.repeat_interleave(shift, lens_t)
    return PrefillPlan(
        tuple(lens), fmha.attn_bias.LowerTriangularMaskWithTensorBias(table), rows.to(device), padded_len
    )


def xformers_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    plan: PrefillPlan | None = None,
    op: type | None = None,
) -> torch.Tensor:
    """Causal self-attention of each prompt over its own tokens; prompts packed back to back.

    query: [T, H, D]; key, value: [T, KVH, D] (H a multiple of KVH), all one dtype (fp16/bf16, or fp32
    through cutlass) on CUDA; query_lens: host list of prompt lengths summing to T; scale: softmax
    scale; sliding_window W: a query at position p sees keys k with k <= p and p - k < W;
    alibi_slopes: [H] float, adds ``slope[h] * (k - p)``. plan: ``plan_prefill`` of the same
    lengths/heads/dtype/window/slopes, to share across layers (built here when None). op: an xFormers
    forward operator class to force (benchmarks); None lets xFormers dispatch. Returns [T, H, D] in
    query's dtype; semantics are ``attention.reference.attend`` with ``context_len = 0``.
    """
    status = xformers_status()
    if not status.usable:
        raise RuntimeError(f"xFormers prefill cannot run here: {status.reason}")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    per_kv = num_heads // num_kv_heads
    if plan is None:
        plan = plan_prefill(
            query_lens,
            num_heads=num_heads,
            dtype=query.dtype,
            device=query.device,
            sliding_window=sliding_window,
            alibi_slopes=alibi_slopes,
        )
    if sum(plan.query_lens) != num_tokens:
        raise ValueError(f"plan covers {sum(plan.query_lens)} tokens, query has {num_tokens}")
    fmha = _fmha()

    if plan.padded_rows is None:
        # [T, KVH or H, D] -> [1, T, KVH, H/KVH, D]; K/V broadcast over the group, not copied
        q = query.view(1, num_tokens, num_kv_heads, per_kv, head_size)
        k = key.unsqueeze(2).expand(-1, -1, per_kv, -1).unsqueeze(0)
        v = value.unsqueeze(2).expand(-1, -1, per_kv, -1).unsqueeze(0)
        out = fmha.memory_efficient_attention_forward(q, k, v, attn_bias=plan.attn_bias, scale=scale, op=op)
        return out.view(num_tokens, num_heads, head_size)

    batch, rows, length = len(plan.query_lens), plan.padded_rows, plan.padded_len

    def pad(x: torch.Tensor) -> torch.Tensor:
        # [T, heads, D] -> [B, L, H, D], K/V heads repeated in the same copy. Zeros, not empty: a padded
        # key row holding NaN would poison p @ v even where p is 0.
        repeat = num_heads // x.shape[1]
        padded = x.new_zeros(batch * length, x.shape[1], repeat, head_size)
        padded.index_copy_(0, rows, x.unsqueeze(2).expand(-1, -1, repeat, -1))
        return padded.view(batch, length, num_heads, head_size)

    out = fmha.memory_efficient_attention_forward(
        pad(query), pad(key), pad(value), attn_bias=plan.attn_bias, scale=scale, op=op
    )
    return out.reshape(batch * length, num_heads, head_size).index_select(0, rows)
