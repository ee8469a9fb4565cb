"""The Triton backend's forward (cache write, prefix prefill, paged decode in one mixed step) against
the reference backend on the same inputs. CPU runs the kernels on Triton's interpreter (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphrt.attention import AttentionMetadata, ReferenceAttentionBackend, TritonAttentionBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: float32 on both sides. On the CPU interpreter every Triton dot is IEEE float32: the largest difference
#: measured over the four cases is 4.8e-7 on outputs of magnitude ~1 (a few float32 units), bounded at 4x;
#: an operand rounded to a 10-bit mantissa (tf32's, fp16's) would be ~1e-4 off. On CUDA the prefix
#: prefill's dots take tl.dot's default float32 precision, tf32 (q, k, p and v rounded to 10 bits): the
#: largest difference measured on the H200 is 2.3e-3, bounded at 2.6x.
TOLERANCE = dict(rtol=0.0, atol=6e-3) if DEVICE.type == "cuda" else dict(rtol=1e-6, atol=2e-6)


HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 64, 16, 12
#: One prompt with 18 cached tokens and 5 new, one fresh prompt of 3, and two decodes.
CONTEXT_LENS, QUERY_LENS = [18, 0, 16, 30], [5, 3, 1, 1]
SEQ_LENS = [c + q for c, q in zip(CONTEXT_LENS, QUERY_LENS)]


def mixed_step_inputs(num_heads: int, num_kv_heads: int, seed: int):
    """The step above on shuffled blocks: block tables, slots, a random cache [2, blocks, page] and the
    step's query [T, H * D], key and value [T, KVH * D], float32."""
    generator = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in SEQ_LENS]
    slots = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (c, n) in enumerate(zip(CONTEXT_LENS, SEQ_LENS)) for p in range(c, n)]
    tokens = sum(QUERY_LENS)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE * num_kv_heads * HEAD_SIZE, generator=generator)
    query, key, value = (torch.randn(tokens, heads * HEAD_SIZE, generator=generator)
                         for heads in (num_heads, num_kv_heads, num_kv_heads))
    return tables, slots, cache, query, key, value


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_step_matches_reference(num_heads, num_kv_heads, window):
    head_size, block_size, scale = HEAD_SIZE, BLOCK_SIZE, HEAD_SIZE**-0.5
    query_lens, seq_lens = QUERY_LENS, SEQ_LENS
    tables, slots, cache, query, key, value = mixed_step_inputs(num_heads, num_kv_heads,
                                                                num_heads * 10 + num_kv_heads + (window or 0))

    def run(backend):
        metadata = AttentionMetadata.from_seqlens(
            query_lens=query_lens, seq_lens=seq_lens, num_prefills=2, block_tables=tables,
            slot_mapping=slots, block_size=block_size, device=DEVICE,
        )
        impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, sliding_window=window)
        kv = cache.clone().to(DEVICE)
        out = impl.forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kv, metadata)
        return out.cpu(), kv.cpu()

    ours, our_cache = run(TritonAttentionBackend)
    expected, expected_cache = run(ReferenceAttentionBackend)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, expected, **TOLERANCE)
    # Same cache except block 0, which only the reference writes (its padding sink).
    torch.testing.assert_close(our_cache[:, 1:], expected_cache[:, 1:], rtol=0, atol=0)


def test_triton_backend_needs_cuda():
    reason = TritonAttentionBackend.unusable_reason(torch.device("cpu"))
    assert "CUDA" in reason


def test_mixed_metadata_of_two_parts_gives_the_joint_steps_output():
    """``AttentionMetadata.mixed``: a prefill part and a decode part built apart (their own tensors, block
    tables of other widths, as a mixed graph's prompt and decode buffers are) give the joint step's output
    and cache bit for bit."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, HEAD_SIZE, BLOCK_SIZE
    query_lens, seq_lens = QUERY_LENS, SEQ_LENS
    tables, slots, cache, query, key, value = mixed_step_inputs(num_heads, num_kv_heads, seed=5)

    def metadata(first: int, end: int, num_prefills: int, width: int) -> AttentionMetadata:
        first_token, end_token = sum(query_lens[:first]), sum(query_lens[:end])
        return AttentionMetadata.from_seqlens(
            query_lens=query_lens[first:end], seq_lens=seq_lens[first:end], num_prefills=num_prefills,
            block_tables=[t + [0] * (width - len(t)) for t in tables[first:end]],
            slot_mapping=slots[first_token:end_token], block_size=block_size, device=DEVICE)

    prefill, decode = metadata(0, 2, 2, 2), metadata(2, 4, 0, 5)
    joint_slots = torch.cat([prefill.slot_mapping, decode.slot_mapping])
    outputs = []
    for step in (metadata(0, 4, 2, 2), AttentionMetadata.mixed(prefill, decode, joint_slots)):
        impl = TritonAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
        kv = cache.clone().to(DEVICE)
        out = impl.forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kv, step)
        outputs.append((out.cpu(), kv.cpu()))
    (joint, joint_cache), (mixed, mixed_cache) = outputs
    assert not joint.isnan().any()
    assert torch.equal(mixed, joint) and torch.equal(mixed_cache, joint_cache)
    with pytest.raises(ValueError, match="slot_mapping has 9 entries for 10 tokens"):
        AttentionMetadata.mixed(prefill, decode, joint_slots[:-1])
    with pytest.raises(ValueError, match="a prefill-only part and a decode-only part"):
        AttentionMetadata.mixed(decode, prefill, joint_slots)
