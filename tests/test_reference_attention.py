"""The reference backend's paged paths against a plain float64 attention over unpaged K/V."""

from __future__ import annotations

import math

import pytest
import torch

from graphrt.attention import AttentionMetadata, ReferenceAttentionBackend
from graphrt.attention.reference import decode_attention


def dense_attention(q, k, v, q_start, window=None, slopes=None):
    """float64 ground truth: q [Lq, H, D] at positions q_start.., k/v [Lk, KVH, D] at 0.."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    qp = torch.arange(q_start, q_start + q.shape[0])[:, None]
    kp = torch.arange(k.shape[0])[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= qp - kp < window
    if slopes is not None:
        scores = scores + slopes.double()[:, None, None] * (kp - qp)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _paged(seq_lens, num_kv_heads, head_size, block_size, generator):
    """Random K/V per sequence, scattered over shuffled blocks; returns (cache, tables, kv list)."""
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + 3
    cache = torch.randn(2, num_blocks, block_size * num_kv_heads * head_size, generator=generator)
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never block 0
    tables, kvs = [], []
    for n, nb in zip(seq_lens, blocks_each):
        table = [order.pop() for _ in range(nb)]
        view = cache.view(2, num_blocks, block_size, num_kv_heads, head_size)[:, table]
        kv = view.reshape(2, -1, num_kv_heads, head_size)[:, :n]
        tables.append(table)
        kvs.append((kv[0], kv[1]))
    width = max(blocks_each)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache, padded, kvs


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_attention_matches_dense(heads, window, alibi):
    num_heads, num_kv_heads = heads
    head_size, block_size = 64, 16
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 15, 16, 17, 40]
    cache, tables, kvs = _paged(seq_lens, num_kv_heads, head_size, block_size, generator)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=generator)
    slopes = torch.rand(num_heads, generator=generator) if alibi else None
    # A captured maximum above every real length: the extra gathered blocks must be masked out.
    out = decode_attention(query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 64, num_kv_heads,
                           head_size**-0.5, window, slopes)
    for i, n in enumerate(seq_lens):
        k, v = kvs[i]
        expected = dense_attention(query[i:i + 1], k, v, n - 1, window, slopes)
        torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-5)


def test_mixed_step_with_cached_prefix_matches_dense():
    """A prefill over a cached prefix plus two decodes in one forward, through the backend's impl."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    generator = torch.Generator().manual_seed(1)
    impl = ReferenceAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    context_lens, query_lens = [20, 16, 3], [13, 1, 1]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    cache, tables, kvs = _paged(seq_lens, num_kv_heads, head_size, block_size, generator)
    # New tokens' K/V: take the true values, then poison their cache slots so the write must restore them.
    slots, new_k, new_v = [], [], []
    for i, (c, n) in enumerate(zip(context_lens, seq_lens)):
        for pos in range(c, n):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
        new_k.append(kvs[i][0][c:n].clone())
        new_v.append(kvs[i][1][c:n].clone())
    key = torch.cat(new_k).flatten(1)
    value = torch.cat(new_v).flatten(1)
    flat = cache.view(2, -1, num_kv_heads * head_size)
    flat[:, slots] = float("nan")
    metadata = AttentionMetadata.from_seqlens(
        query_lens=query_lens, seq_lens=seq_lens, num_prefills=1, block_tables=tables.tolist(),
        slot_mapping=slots, block_size=block_size, device=torch.device("cpu"),
    )
    query = torch.randn(sum(query_lens), num_heads * head_size, generator=generator)
    out = impl.forward(query, key, value, cache, metadata).view(-1, num_heads, head_size)
    start = 0
    for i, (c, q_len) in enumerate(zip(context_lens, query_lens)):
        k, v = kvs[i]
        expected = dense_attention(query[start:start + q_len].view(q_len, num_heads, head_size), k, v, c)
        torch.testing.assert_close(out[start:start + q_len].double(), expected, rtol=1e-5, atol=1e-5)
        start += q_len


def test_padding_rows_write_only_the_null_block():
    """Slot -1 rows (graph padding) leave every real block untouched."""
    from graphrt.attention.reference import write_to_paged_cache

    cache = torch.randn(2, 4, 16 * 2 * 64)
    before = cache.clone()
    write_to_paged_cache(torch.randn(3, 128), torch.randn(3, 128), cache, torch.tensor([-1, 17, -1]), 2)
    changed = (cache != before).view(2, -1, 128).any(-1).any(0).nonzero().flatten().tolist()
    assert [slot for slot in changed if slot >= 16] == [17]  # slots 0..15 are the null block


def test_prefill_without_cache_equals_prefill_through_cache():
    """Memory profiling runs prefill with kv_cache None: same result as through the paged cache."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    generator = torch.Generator().manual_seed(2)
    impl = ReferenceAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads,
                                                    sliding_window=4)
    query_lens = [5, 18]
    tables = [[1], [2, 3]]
    slots = list(range(16, 21)) + list(range(32, 50))
    metadata = AttentionMetadata.from_seqlens(
        query_lens=query_lens, seq_lens=query_lens, num_prefills=2, block_tables=tables, slot_mapping=slots,
        block_size=block_size, device=torch.device("cpu"),
    )
    query = torch.randn(23, num_heads * head_size, generator=generator)
    key = torch.randn(23, num_kv_heads * head_size, generator=generator)
    value = torch.randn(23, num_kv_heads * head_size, generator=generator)
    cache = torch.full((2, 4, block_size * num_kv_heads * head_size), float("nan"))
    through_cache = impl.forward(query, key, value, cache, metadata)
    without = impl.forward(query, key, value, None, metadata)
    torch.testing.assert_close(without, through_cache)
