"""Pure-torch attention over a paged KV cache: runs anywhere, and is the oracle for faster backends.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size * KVH * D]``; index 0 holds keys,
1 values; within a block, token-major then head then channel, so ``cache[0].view(-1, KVH, D)[slot]``
is one token's keys. Attention is computed per sequence in float32.
"""

from __future__ import annotations

import torch

from graphrt.attention.backend import AttentionBackend, AttentionImpl
from graphrt.attention.metadata import AttentionMetadata

FP8_CACHE_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_CACHE_DTYPE).max)


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a cache of ``dtype`` stores for ``values``: an fp8 cache ``values / scale`` computed in
    float32, saturated at +-448 and rounded to nearest-even; any other the values cast."""
    if dtype != FP8_CACHE_DTYPE:
        return values.to(dtype)
    return (values.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(dtype)


def from_cache(stored: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached values as float32: an fp8 cache's times its scale."""
    return stored.float() * scale if stored.dtype == FP8_CACHE_DTYPE else stored.float()


def write_to_paged_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_kv_heads: int,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store new K/V at their slots. Rows whose slot is -1 (graph padding) go to slot 0, inside the
    null block that no real sequence reads: selecting only the real rows would need a host sync.

    key, value: [T, KVH * D]; kv_cache: [2, num_blocks, block_size * KVH * D] in the model dtype or
    fp8 (``to_cache_dtype``, with ``k_scale`` / ``v_scale``); slot_mapping: [T] int64.
    """
    head_size = key.shape[-1] // num_kv_heads
    slots = slot_mapping.clamp(min=0)
    for kind, values, scale in ((0, key, k_scale), (1, value, v_scale)):
        kv_cache[kind].view(-1, num_kv_heads, head_size)[slots] = to_cache_dtype(
            values.view(-1, num_kv_heads, head_size), kv_cache.dtype, scale)


def gather_from_paged_cache(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one sequence, each [seq_len, KVH, D], as
    stored (``from_cache`` reads them).

    block_table: [M] int32 physical block ids of the sequence.
    """
    num_blocks = kv_cache.shape[1]
    block_size = kv_cache.shape[2] // (num_kv_heads * head_size)
    used = block_table[: -(-seq_len // block_size)].long()
    blocks = kv_cache.view(2, num_blocks, block_size, num_kv_heads, head_size)[:, used]
    flat = blocks.reshape(2, used.shape[0] * block_size, num_kv_heads, head_size)[:, :seq_len]
    return flat[0], flat[1]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over all its keys, in float32.

    query: [Lq, H, D] at positions ``context_len .. context_len + Lq - 1``; key, value: [Lk, KVH, D]
    at positions ``0 .. Lk - 1`` with ``Lk = context_len + Lq``. A query at position p sees keys at
    positions k with k <= p and, with a window W, p - k < W. ALiBi adds ``slope[h] * (k - p)``.
    Returns [Lq, H, D] float32.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)  # [H, Lq, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, Lq, Lk]
    q_pos = torch.arange(context_len, context_len + query.shape[0], device=query.device)[:, None]
    k_pos = torch.arange(key.shape[0], device=query.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[:, None, None] * (k_pos - q_pos)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per sequence over its paged keys, batched, without host syncs: safe to capture.
    An fp8 cache's values are read times ``k_scale`` / ``v_scale``.

    query: [B, H, D], each at position ``seq_lens - 1``; block_tables: [B, M] int32; seq_lens: [B]
    int32. Every row gathers the first ``ceil(max_seq_len / block_size)`` blocks of its table (a bound
    fixed on the host, so shapes never depend on data) and masks keys at positions >= its seq_len.
    Returns [B, H, D] float32.
    """
    batch, num_heads, head_size = query.shape
    num_blocks = kv_cache.shape[1]
    block_size = kv_cache.shape[2] // (num_kv_heads * head_size)
    used_blocks = max(1, -(-max_seq_len // block_size))
    table = block_tables[:, :used_blocks].long()  # [B, Mu]
    cache = kv_cache.view(2, num_blocks, block_size, num_kv_heads, head_size)
    keys = from_cache(cache[0][table].reshape(batch, -1, num_kv_heads, head_size), k_scale)  # [B, L, KVH, D]
    values = from_cache(cache[1][table].reshape(batch, -1, num_kv_heads, head_size), v_scale)
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, head_size)
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys) * scale  # [B, KVH, G, L]
    k_pos = torch.arange(keys.shape[1], device=query.device)[None, :]  # [1, L]
    q_pos = (seq_lens.long() - 1)[:, None]  # [B, 1]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    if alibi_slopes is not None:
        bias = alibi_slopes.float().view(num_kv_heads, group)[None, :, :, None] * (k_pos - q_pos)[:, None, None, :]
        scores = scores + bias
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(batch, num_heads, head_size)


def attend_uncached_prompts(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefill: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Prompts with nothing cached (memory profiling runs without a cache), one at a time, each over
    its own tokens. query/out: [T, H, D]; key, value: [T, KVH, D]."""
    if any(prefill.context_lens):
        raise ValueError("without a KV cache every sequence must have an empty context")
    start = 0
    for q_len in prefill.query_lens:
        rows = slice(start, start + q_len)
        out[rows] = attend(query[rows], key[rows], value[rows], 0, scale, sliding_window, alibi_slopes).to(out.dtype)
        start += q_len


class ReferenceAttentionImpl(AttentionImpl):
    """float32 attention in plain torch: prefills one sequence at a time, decodes batched."""

    def forward(self, query, key, value, kv_cache, attn_metadata: AttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0, kv_cache_written: bool = False, dependent_launch: bool = False):
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        if kv_cache is None or kv_cache.dtype != FP8_CACHE_DTYPE:
            k_scale = v_scale = 1.0
        scales = (k_scale, v_scale)
        if kv_cache is not None and not kv_cache_written:
            write_to_paged_cache(key, value, kv_cache, attn_metadata.slot_mapping[:num_tokens], self.num_kv_heads,
                                 *scales)
        alibi = self.alibi_slopes_on(query.device)
        out = torch.empty_like(q)
        num_prefill_tokens = attn_metadata.num_prefill_tokens
        prefill = attn_metadata.prefill_metadata
        if prefill is not None:
            self._prefill(q, key, value, kv_cache, prefill, alibi, scales, out)
        decode = attn_metadata.decode_metadata
        if decode is not None:
            if kv_cache is None:
                raise ValueError("decoding needs a KV cache")
            out[num_prefill_tokens:] = decode_attention(
                q[num_prefill_tokens:], kv_cache, decode.block_tables, decode.seq_lens_tensor,
                decode.max_decode_seq_len, self.num_kv_heads, self.scale, self.sliding_window, alibi, *scales,
            ).to(out.dtype)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _prefill(self, q, key, value, kv_cache, metadata: AttentionMetadata, alibi, scales, out) -> None:
        """One sequence at a time (host lengths); prefills occupy the first tokens of the step. Each
        attends over its cached context (read as stored) and this step's keys and values as computed."""
        num = metadata.num_prefill_tokens
        new_k = key[:num].view(num, self.num_kv_heads, self.head_size)
        new_v = value[:num].view(num, self.num_kv_heads, self.head_size)
        if kv_cache is None:
            attend_uncached_prompts(q, new_k, new_v, metadata, self.scale, self.sliding_window, alibi, out)
            return
        token = 0
        for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            cached_k, cached_v = gather_from_paged_cache(kv_cache, metadata.block_tables[i], seq_len - q_len,
                                                         self.num_kv_heads, self.head_size)
            rows = slice(token, token + q_len)
            k = torch.cat([from_cache(cached_k, scales[0]), new_k[rows].float()])
            v = torch.cat([from_cache(cached_v, scales[1]), new_v[rows].float()])
            out[token:token + q_len] = attend(
                q[token:token + q_len], k, v, seq_len - q_len, self.scale, self.sliding_window, alibi
            ).to(out.dtype)
            token += q_len


class ReferenceAttentionBackend(AttentionBackend):
    """Pure torch, CPU and GPU; float32 softmax; a Python loop over sequences."""

    name = "reference"

    @staticmethod
    def get_impl_cls():
        return ReferenceAttentionImpl

    @classmethod
    def unusable_reason(cls, device):
        return None
