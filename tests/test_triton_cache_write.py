"""The Triton paged-cache write against a torch scatter of the real rows.

Rows whose slot is -1 are skipped outright (the reference backend instead parks them in the null
block, slot 0, to avoid a host sync; the kernel needs no such detour), so the expected cache is built
here: poison everywhere, the real rows at their slots.

Without CUDA the kernel runs under Triton's interpreter: ``TRITON_INTERPRET`` must be set before the
kernel module is imported, because ``@triton.jit`` reads it when it decorates (triton 3.6 and 3.9
alike, through ``triton.knobs.runtime.interpret``). If another test imported the module first without
it, the module is reloaded here.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_cache_write as tcw  # noqa: E402

tcw = interpreted(tcw, "_write_kv_cache_kernel")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def write_to_paged_cache(key, value, kv_cache, slot_mapping, num_kv_heads):
    """Expected result: each real row (slot >= 0) cast to the cache dtype at its slot, nothing else."""
    keep = slot_mapping >= 0
    flat = kv_cache.view(2, -1, key.shape[-1])
    flat[0, slot_mapping[keep]] = key[keep].to(kv_cache.dtype)
    flat[1, slot_mapping[keep]] = value[keep].to(kv_cache.dtype)


def _expected_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache must hold: x * (1 / scale) in float32, saturated, rounded to nearest even."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inv.to(x.device)).clamp(-448.0, 448.0).to(FP8)


def _case(num_tokens, num_kv_heads, head_size, block_size, num_blocks, src_dtype, seed, pad_every=3):
    gen = torch.Generator().manual_seed(seed)
    row = num_kv_heads * head_size
    key = torch.randn(num_tokens, row, generator=gen).to(src_dtype).to(DEVICE)
    value = torch.randn(num_tokens, row, generator=gen).to(src_dtype).to(DEVICE)
    # Distinct slots anywhere but the null block; every pad_every-th row is graph padding (-1).
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[::pad_every] = -1
    return key, value, slots.to(DEVICE)


def _poisoned_cache(num_blocks, block_size, row, dtype, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(2, num_blocks, block_size * row, generator=gen) * 100).to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_size,block_size,dtype",
    [
        (7, 2, 64, 16, torch.float16),
        (5, 1, 80, 8, torch.bfloat16),
        (9, 4, 96, 32, torch.float32),
        (3, 8, 128, 16, torch.bfloat16),  # row of 1024: one program per row
        (4, 9, 128, 16, torch.float16),  # row of 1152: two programs per row, second one masked
        (5, 2, 112, 16, torch.float16),  # row of 224 in a program of 256
    ],
)
def test_write_matches_reference(num_tokens, num_kv_heads, head_size, block_size, dtype):
    num_blocks = 6
    key, value, slots = _case(num_tokens, num_kv_heads, head_size, block_size, num_blocks, dtype, seed=num_tokens)
    cache = _poisoned_cache(num_blocks, block_size, num_kv_heads * head_size, dtype, seed=1)
    expected = cache.clone()
    write_to_paged_cache(key, value, expected, slots, num_kv_heads)
    tcw.write_kv_cache(key, value, cache, slots, num_kv_heads)
    # Bitwise: a copy in the same dtype; skipped rows and untouched slots keep their poison.
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_write_converts_to_cache_dtype(src_dtype, cache_dtype):
    key, value, slots = _case(6, 2, 64, 16, 5, src_dtype, seed=11)
    cache = _poisoned_cache(5, 16, 128, cache_dtype, seed=2)
    expected = cache.clone()
    write_to_paged_cache(key, value, expected, slots, 2)
    tcw.write_kv_cache(key, value, cache, slots, 2)
    if DEVICE == "cpu" and (src_dtype, cache_dtype) == (torch.float32, torch.bfloat16):
        # Triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even.
        torch.testing.assert_close(cache, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_fp8_with_scales(src_dtype):
    num_kv_heads, head_size, block_size, num_blocks = 2, 64, 16, 5
    key, value, slots = _case(8, num_kv_heads, head_size, block_size, num_blocks, src_dtype, seed=5)
    key[1, :4] = torch.tensor([1000.0, -1000.0, 0.0, -0.0], dtype=src_dtype)  # saturation and signed zero
    k_scale, v_scale = 0.05, 3.0  # spreads values over normals, subnormals and the saturated range
    cache = _poisoned_cache(num_blocks, block_size, num_kv_heads * head_size, FP8, seed=3)
    expected = cache.clone()
    keep = slots >= 0
    flat = expected.view(2, -1, num_kv_heads * head_size)
    flat[0, slots[keep]] = _expected_fp8(key[keep], k_scale)
    flat[1, slots[keep]] = _expected_fp8(value[keep], v_scale)
    tcw.write_kv_cache(key, value, cache, slots, num_kv_heads, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_write_from_strided_rows():
    """Key and value as column slices of one fused QKV output (rows strided, channels contiguous)."""
    num_heads, num_kv_heads, head_size = 4, 2, 64
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).half().to(DEVICE)
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    key, value = qkv[:, q_width:q_width + kv_width], qkv[:, q_width + kv_width:]
    slots = torch.tensor([20, -1, 3, 47, 16], device=DEVICE)
    cache = _poisoned_cache(4, 16, kv_width, torch.float16, seed=4)
    expected = cache.clone()
    write_to_paged_cache(key, value, expected, slots, num_kv_heads)
    tcw.write_kv_cache(key, value, cache, slots, num_kv_heads)
    assert torch.equal(cache, expected)


def test_write_rejects_bad_arguments():
    key, value, slots = _case(4, 2, 64, 16, 4, torch.float16, seed=1)
    cache = _poisoned_cache(4, 16, 128, torch.float16, seed=1)
    with pytest.raises(ValueError, match="int64"):
        tcw.write_kv_cache(key, value, cache, slots.int(), 2)
    with pytest.raises(ValueError, match="kv_cache"):
        tcw.write_kv_cache(key, value, cache[:, :, :100], slots, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_large_on_gpu(dtype, block_size):
    """A prefill-sized write (1,000 tokens, 8 kv heads of 128) with padding rows, bitwise."""
    num_kv_heads, head_size, num_blocks = 8, 128, 2048 // block_size + 1
    src = torch.bfloat16 if dtype == FP8 else dtype
    key, value, slots = _case(1000, num_kv_heads, head_size, block_size, num_blocks, src, seed=block_size, pad_every=7)
    cache = _poisoned_cache(num_blocks, block_size, num_kv_heads * head_size, dtype, seed=5)
    expected = cache.clone()
    if dtype == FP8:
        keep = slots >= 0
        flat = expected.view(2, -1, num_kv_heads * head_size)
        flat[0, slots[keep]] = _expected_fp8(key[keep], 0.5)
        flat[1, slots[keep]] = _expected_fp8(value[keep], 0.25)
        tcw.write_kv_cache(key, value, cache, slots, num_kv_heads, k_scale=0.5, v_scale=0.25)
    else:
        write_to_paged_cache(key, value, expected, slots, num_kv_heads)
        tcw.write_kv_cache(key, value, cache, slots, num_kv_heads)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
