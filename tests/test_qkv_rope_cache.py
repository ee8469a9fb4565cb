"""The QKV projection with rotary embedding and cache write in one kernel
(``triton_rope_cache_write.project_rope_and_write_kv_cache``) against the two kernels it replaces: the
GEMV (``graphrt.kernels.gemv.linear_gemv``, tested against float64) followed by
``rope_and_write_kv_cache`` (tested bit for bit against the torch rotary embedding).

The two sum the projection in float32 in tiles of different shapes, so a projected value may sit one
rounding of the model dtype away, and the rotation mixes each channel with its partner in the other
half of the head: the bound per element is a rounding of the projection, of its partner and of the
result. The cache is checked exactly: it must hold the kernel's own k and v rows at the real tokens'
slots (fp8: those rows quantised) and its poison everywhere else. Fresh random inputs; outputs and
caches poisoned first. Small shapes on the CPU under Triton's interpreter, model shapes on a GPU.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_qkv_rows as qkv_rows  # noqa: E402
from graphrt.attention import triton_rope_cache_write as rope_write  # noqa: E402
from graphrt.kernels import fp8_matmul, gemv, gemv_rows  # noqa: E402
from graphrt.models.fp8 import quantize_per_channel  # noqa: E402
from graphrt.models.layers import RotaryEmbedding, rms_norm_torch  # noqa: E402

gemv = interpreted(gemv, "_gemv_kernel")
rope_write = interpreted(rope_write, "_qkv_rope_cache_kernel")
gemv_rows = interpreted(gemv_rows, "_rows_linear_kernel")
qkv_rows = interpreted(qkv_rows, "_rows_qkv_rope_cache_kernel")
fp8_matmul = interpreted(fp8_matmul, "_weight_rows_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
EPS = 1e-5
BLOCK_SIZE = 16
#: One rounding of each dtype, relative (float32: its float32 sums in two orders, K <= 4096).
UNIT = {torch.float32: 2**-17, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _qkv_operands(num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, seed, bias, fp8_weight):
    """(width, kv_size, x [T, hidden], the fused QKV weight, its row scales or None, its bias or None): fresh
    random values; ``fp8_weight``: the weight as FP8 codes with a scale per row."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    x = _randn(num_tokens, hidden, dtype=dtype, seed=seed, scale=2.0)
    weight = _randn(width, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    weight_scale = None
    if fp8_weight:
        weight, weight_scale = quantize_per_channel(weight)
    qkv_bias = _randn(width, dtype=dtype, seed=seed + 2) if bias else None
    return width, num_kv_heads * head_size, x, weight, weight_scale, qkv_bias


def _rope_inputs(num_tokens: int, head_size: int, kv_size: int, cache_dtype, seed: int):
    """(rotary tables, positions, slots, a poisoned cache) for ``num_tokens``: random positions, distinct
    slots past the first block with every third token a padding row (-1: rotated, never stored)."""
    rotary = RotaryEmbedding(head_size, 4096, 10000.0, None, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    num_blocks = num_tokens // BLOCK_SIZE + 3
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[:num_tokens] + BLOCK_SIZE
    slots[1::3] = -1
    poison = float("nan") if cache_dtype != FP8 else 448.0  # e4m3 has no inf; NaN bits are 0x7f
    cache = torch.full((2, num_blocks, BLOCK_SIZE * kv_size), poison, device=DEVICE).to(cache_dtype)
    return rotary, positions, slots.to(DEVICE), cache


def check(num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, *, bias=False, norm=True,
          cache_dtype=None, with_cache=True, scales=(1.0, 1.0), seed=0, fp8_weight=False, rows_kernel=False):
    """``rows_kernel``: check the few-row kernel (``triton_qkv_rows``) instead of the one-token one."""
    cache_dtype = cache_dtype or dtype
    width, kv_size, x, weight, weight_scale, qkv_bias = _qkv_operands(
        num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, seed, bias,
        fp8_weight)  # FP8: against linear_gemv's product of the same codes (test_gemv checks it)
    norm_weight = _randn(hidden, dtype=dtype, seed=seed + 3) if norm else None
    rotary, positions, slots, cache = _rope_inputs(num_tokens, head_size, kv_size, cache_dtype, seed)
    cache = cache if with_cache else None
    poisoned_cache = None if cache is None else cache.clone()

    projected = gemv.linear_gemv(x, weight, qkv_bias, norm_weight=norm_weight, eps=EPS, weight_scale=weight_scale)
    want = projected.clone()
    rope_write.rope_and_write_kv_cache(want, positions, rotary.cos, rotary.sin, None, None, num_heads,
                                       num_kv_heads, head_size)
    out = torch.full((num_tokens, width), float("nan"), dtype=dtype, device=DEVICE)
    project = qkv_rows.project_rope_and_write_kv_cache_rows if rows_kernel else rope_write.project_rope_and_write_kv_cache
    got = project(
        x, weight, qkv_bias, positions, rotary.cos, rotary.sin, cache, slots, num_heads, num_kv_heads, head_size,
        norm_weight=norm_weight, eps=EPS, k_scale=scales[0], v_scale=scales[1], out=out, weight_scale=weight_scale,
    )
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was never written"

    unit = UNIT[dtype]
    halves = projected.double().view(num_tokens, -1, 2, head_size // 2)
    partner = halves.flip(2).reshape(num_tokens, width)
    allowed = 2 * unit * (projected.double().abs() + partner.abs() + want.double().abs()) + 1e-6
    # The two kernels sum K float32 terms in different orders (and may round 1 / rms apart by a float32
    # rounding): a few float32 roundings of the terms' absolute sum, for an element and its rotation
    # partner. It matters in float32 only, where the results' own rounding is as fine.
    terms = rms_norm_torch(x, norm_weight, EPS) if norm else x
    real_weight = weight.double() * (1.0 if weight_scale is None else weight_scale.double()[:, None])
    magnitude = terms.double().abs() @ real_weight.abs().T
    magnitude = magnitude + magnitude.view(num_tokens, -1, 2, head_size // 2).flip(2).reshape(num_tokens, width)
    allowed = allowed + 4 * 2**-24 * magnitude
    excess = (got.double() - want.double()).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
                               f"{divmod(worst, width)}: {got.flatten()[worst].item()} vs {want.flatten()[worst].item()}")

    if with_cache:
        expected_cache = poisoned_cache.clone()
        keep = slots >= 0
        flat = expected_cache.view(2, -1, kv_size)
        k_rows, v_rows = got[:, num_heads * head_size:].split(kv_size, dim=-1)
        for kind, rows in ((0, k_rows), (1, v_rows)):
            rows = rows[keep].float() / scales[kind]  # an fp8 cache holds values / their scale
            flat[kind, slots[keep]] = rows.clamp(-448, 448).to(FP8) if cache_dtype == FP8 else rows.to(cache_dtype)
        torch.testing.assert_close(cache.float(), expected_cache.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes(head_size, dtype):
    check(2, 2, 1, head_size, 64, dtype, seed=head_size)


def test_head_size_112_in_float16():
    """The one supported head size and the one model dtype the grid above leaves to the GPU."""
    check(2, 2, 1, 112, 64, torch.float16, seed=112)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (3, 3), (6, 2), (9, 3)])
def test_gqa_ratios(num_heads, num_kv_heads):
    check(1, num_heads, num_kv_heads, 64, 80, torch.bfloat16, seed=num_heads)


def test_bias_and_long_rows():
    """A QKV bias (Qwen2) and a row longer than one K slice (the last slice partial)."""
    check(1, 4, 2, 64, 1100, torch.float32, bias=True, seed=3)


def test_without_norm():
    check(2, 4, 2, 64, 64, torch.bfloat16, norm=False, seed=4)


def test_fp8_cache():
    """Keys and values each divided by their own scale before the e4m3 rounding."""
    check(4, 2, 1, 64, 64, torch.bfloat16, cache_dtype=FP8, scales=(0.25, 2.0), seed=5)


@pytest.mark.parametrize("cache", ["model dtype", "fp8"])
def test_fp8_weights(cache):
    fp8 = cache == "fp8"  # scales apply to an fp8 cache only
    check(3, 4, 2, 64, 96, torch.bfloat16, bias=True, cache_dtype=FP8 if fp8 else None,
          scales=(0.5, 2.0) if fp8 else (1.0, 1.0), seed=17, fp8_weight=True)


def test_without_cache_only_projects_and_rotates():
    check(2, 4, 2, 64, 64, torch.bfloat16, with_cache=False, seed=6)


def test_tile_stays_inside_half_a_head():
    """A program's channels never straddle two heads' halves: its tile divides D / 2."""
    for head_size in (64, 80, 96, 112, 128, 256, 6):
        for in_features, width in ((2048, 3072), (4096, 6144), (576, 960), (96, 1000)):
            tile = rope_write.qkv_tile(in_features, width, head_size, 2)
            assert (head_size // 2) % tile.block_n == 0, (head_size, in_features, width, tile)


def test_rejects_bad_input():
    x = _randn(1, 64, dtype=torch.float32, seed=0)
    rotary = RotaryEmbedding(64, 16, 10000.0, None, device=DEVICE)
    positions = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="fused QKV weight"):
        rope_write.project_rope_and_write_kv_cache(x, _randn(100, 64, dtype=torch.float32, seed=1), None, positions,
                                                   rotary.cos, rotary.sin, None, None, 4, 2, 64)
    weight = _randn(8 * 64, 64, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="positions"):
        rope_write.project_rope_and_write_kv_cache(x, weight, None, positions.int(), rotary.cos, rotary.sin, None,
                                                   None, 4, 2, 64)
    with pytest.raises(ValueError, match=r"out \(1, 100\)"):
        rope_write.project_rope_and_write_kv_cache(x, weight, None, positions, rotary.cos, rotary.sin, None, None,
                                                   4, 2, 64, out=torch.empty(1, 100, device=DEVICE))
    shared = _randn(1, 64 + 8 * 64, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="share memory"):
        rope_write.project_rope_and_write_kv_cache(shared[:, :64], weight, None, positions, rotary.cos, rotary.sin,
                                                   None, None, 4, 2, 64, out=shared[:, 64:])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,hidden,bias", [
    (32, 8, 64, 2048, False),  # Llama-3.2-1B
    (32, 8, 128, 4096, False),  # Llama-3-8B
    (9, 3, 64, 576, False),  # SmolLM2-135M
    (28, 4, 128, 3584, True),  # Qwen2-7B (QKV bias)
    (16, 4, 80, 1280, False), (16, 2, 96, 1536, False), (8, 8, 256, 2048, False), (12, 4, 112, 1344, False),
], ids=lambda v: str(v))
def test_model_shapes_gpu(num_tokens, num_heads, num_kv_heads, head_size, hidden, bias, dtype):
    check(num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, bias=bias, seed=head_size + num_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fp8_cache_gpu():
    check(1, 32, 8, 128, 4096, torch.bfloat16, cache_dtype=FP8, scales=(0.25, 2.0), seed=11)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,hidden,bias", [
    (32, 8, 64, 2048, False), (32, 8, 128, 4096, False), (9, 3, 64, 576, False), (28, 4, 128, 3584, True)])
def test_fp8_weights_gpu(num_heads, num_kv_heads, head_size, hidden, bias):
    check(1, num_heads, num_kv_heads, head_size, hidden, torch.bfloat16, bias=bias, cache_dtype=FP8,
          scales=(0.5, 2.0), seed=hidden, fp8_weight=True)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,hidden", [(32, 8, 64, 2048), (32, 8, 128, 4096),
                                                                     (9, 3, 64, 576), (16, 2, 80, 1280)])
def test_compiles_for_sm90(num_heads, num_kv_heads, head_size, hidden):
    """The GPU compiler accepts the kernel at the presets' tiles (the interpreter checks less), with an fp8
    cache and in float32 too, launched as a dependent."""
    from sm90_compile import compile_for_sm90

    width = (num_heads + 2 * num_kv_heads) * head_size
    cases = []
    for dtype, cache, bias, fp8_weight in (("bf16", "bf16", False, False), ("bf16", "fp8e4nv", True, False),
                                           ("fp32", "fp32", False, False), ("bf16", "bf16", False, True),
                                           ("bf16", "fp8e4nv", True, True)):
        tile = rope_write.qkv_tile(hidden, width, head_size, 1 if fp8_weight else 4 if dtype == "fp32" else 2)
        pointers = {arg: f"*{dtype}" for arg in ("x_ptr", "w_ptr", "bias_ptr", "norm_w_ptr", "qkv_ptr")}
        pointers.update(scale_ptr="*fp32", **({"w_ptr": "*fp8e4nv"} if fp8_weight else {}))
        cases.append(dict(
            name=f"{dtype}-{cache}{'-fp8-weight' if fp8_weight else ''}",
            module="graphrt.attention.triton_rope_cache_write", kernel="_qkv_rope_cache_kernel",
            signature={**pointers, "cache_ptr": f"*{cache}", "positions_ptr": "*i64", "cos_ptr": "*fp32",
                       "sin_ptr": "*fp32", "slot_ptr": "*i64", "stride_cache_kind": "i64", "eps": "fp32",
                       "inv_k_scale": "fp32", "inv_v_scale": "fp32",
                       **{n: "i32" for n in ("stride_x", "stride_w", "stride_qkv_row", "stride_table_row", "K")}},
            constexprs=dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, NORM=True,
                            HAS_BIAS=bias, W_SCALED=fp8_weight, WRITE_CACHE=True, QUANTIZE=cache == "fp8e4nv", BLOCK_N=tile.block_n,
                            BLOCK_K=tile.block_k, THREAD_SUM=tile.thread_sum, NORM_BLOCK=gemv.norm_block(hidden),
                            PDL=True),
            num_warps=tile.num_warps, num_stages=3, launch_pdl=True,
            aligned_ints=["stride_x", "stride_w", "stride_qkv_row", "stride_table_row", "K"]))
    for case, result in zip(cases, compile_for_sm90(cases)):
        assert "error" not in result, (case["name"], result)
        assert result["dependency_waits"] >= 1, case["name"]


# -- the few-row kernel (triton_qkv_rows): a verify step's rows, small batches ------------------------


@pytest.mark.parametrize("dtype,head_size", [(torch.float32, 64), (torch.bfloat16, 80), (torch.bfloat16, 96)], ids=str)
def test_rows_kernel_head_sizes(head_size, dtype):
    """80: a half of 40 channels in programs of 16 (the last chunk masked); 96: of 48, in 16s."""
    check(5, 2, 1, head_size, 48, dtype, seed=head_size, rows_kernel=True)


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", [(2, 4, 1), (16, 2, 1), (7, 6, 2)])
def test_rows_kernel_token_counts_and_gqa_ratios(num_tokens, num_heads, num_kv_heads):
    check(num_tokens, num_heads, num_kv_heads, 64, 48, torch.bfloat16, seed=num_tokens, rows_kernel=True)


@pytest.mark.parametrize("cache_dtype", [None, FP8])
def test_rows_kernel_bias_no_norm_fp8_cache_and_no_cache(cache_dtype):
    scales = (0.5, 2.0) if cache_dtype == FP8 else (1.0, 1.0)  # scales apply to an fp8 cache only
    check(4, 2, 1, 64, 72, torch.float16, bias=True, norm=False, cache_dtype=cache_dtype, scales=scales,
          rows_kernel=True)
    check(3, 2, 2, 64, 64, torch.bfloat16, with_cache=False, rows_kernel=True)


def test_rows_kernel_refuses_more_rows_than_a_tile():
    x = torch.zeros(17, 64, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(4 * 64, 64, dtype=torch.bfloat16, device=DEVICE)
    rotary = RotaryEmbedding(64, 32, 10000.0, None, device=DEVICE)
    with pytest.raises(ValueError, match="17 rows exceed the few-row kernels' 16"):
        qkv_rows.project_rope_and_write_kv_cache_rows(x, weight, None, torch.zeros(17, dtype=torch.int64, device=DEVICE),
                                                      rotary.cos, rotary.sin, None, None, 2, 1, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [2, 5, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,hidden", [(9, 3, 64, 576), (32, 8, 64, 2048),
                                                                      (32, 8, 128, 4096)])
def test_rows_kernel_model_shapes_gpu(num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype):
    check(num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, seed=num_tokens, rows_kernel=True)


# -- the same epilogue on fp8_matmul's rows kernel (16-bit, W8A16 and FP8 x FP8) ---------------------------


def check_on_rows_kernel(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, tile, *, bias=False,
                         cache_dtype=None, scales=(1.0, 1.0), seed=0, norm=False):
    """The fused kernel against the rows kernel's product at the same tile (block_n the fused kernel's)
    followed by rope_and_write_kv_cache: the same bits in qkv and in the cache (poisoned: every element
    the fused kernel owns written). ``kind``: "w16" (16-bit weights), "w8a16" (FP8 codes, 16-bit
    activations) or "fp8" (FP8 codes, activations quantised per token). ``norm`` (not "fp8"): x is the
    residual stream, normalised in both kernels' prologue."""
    cache_dtype = cache_dtype or dtype
    width, kv_size, x, weight, weight_scale, qkv_bias = _qkv_operands(
        num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, seed, bias, kind != "w16")
    activations = x if kind != "fp8" else fp8_matmul.QuantizedRows(*fp8_matmul.quantize_rows(x), dtype)
    rotary, positions, slots, cache = _rope_inputs(num_tokens, head_size, kv_size, cache_dtype, seed)
    want_cache = cache.clone()

    plain_tile = dataclasses.replace(tile, block_n=qkv_rows.half_block(head_size))
    prologue = dict(norm_weight=_randn(hidden, dtype=dtype, seed=seed + 5) + 1.0, eps=EPS) if norm else {}
    if kind == "w16":
        projected = fp8_matmul.rows_matmul(x, weight, qkv_bias, tile=plain_tile, **prologue)
    elif kind == "w8a16":
        projected = fp8_matmul.w8a16_matmul(x, weight, weight_scale, qkv_bias, tile=plain_tile, **prologue)
    else:
        projected = fp8_matmul.scaled_mm(activations, weight, weight_scale, qkv_bias, tile=plain_tile)
    want = projected.clone()
    rope_write.rope_and_write_kv_cache(want, positions, rotary.cos, rotary.sin, want_cache, slots, num_heads,
                                       num_kv_heads, head_size, k_scale=scales[0], v_scale=scales[1])
    got = qkv_rows.project_rope_and_write_kv_cache_on_rows_kernel(
        activations, weight, weight_scale, qkv_bias, positions, rotary.cos, rotary.sin, cache, slots, num_heads,
        num_kv_heads, head_size, k_scale=scales[0], v_scale=scales[1], tile=tile, **prologue)
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))


@pytest.mark.parametrize("kind", ["w16", "w8a16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_size,hidden,tile", [
    (5, 4, 2, 64, 96, fp8_matmul.RowsTile(16, 64, 32, 4, 2)),  # halves of 32 channels: one program a head
    (3, 2, 1, 128, 64, fp8_matmul.RowsTile(16, 64, 32, 4, 2, split_k=2)),  # split K: both halves' partials
    (20, 3, 1, 80, 48, fp8_matmul.RowsTile(16, 64, 32, 4, 2)),  # two token tiles; halves of 40 in 16s (masked)
    (6, 2, 2, 64, 224, fp8_matmul.RowsTile(16, 64, 32, 4, 2, split_k=3, tma=True)),  # through TMA, split 3, 3, 1
])
def test_qkv_on_the_rows_kernel_is_its_product_then_rope_and_write(kind, num_tokens, num_heads, num_kv_heads,
                                                                   head_size, hidden, dtype, tile):
    check_on_rows_kernel(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, tile, seed=num_tokens)


@pytest.mark.parametrize("kind", ["w16", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_size,hidden,tile", [
    (5, 4, 2, 64, 96, fp8_matmul.RowsTile(16, 64, 32, 4, 2)),
    (6, 2, 2, 64, 224, fp8_matmul.RowsTile(16, 64, 32, 4, 2, split_k=3, tma=True)),  # each split reads whole rows
    (20, 3, 1, 80, 48, fp8_matmul.RowsTile(16, 64, 32, 4, 2)),  # two token tiles, masked halves
])
def test_qkv_on_the_rows_kernel_with_the_norm_prologue(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden,
                                                        dtype, tile):
    """The residual stream normalised in the prologue: the bits of the plain rows kernel's product with the
    same prologue, then rope_and_write_kv_cache (test_fp8_matmul checks that prologue against float64)."""
    check_on_rows_kernel(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden, dtype, tile, seed=num_tokens + 1,
                         norm=True)


@pytest.mark.parametrize("cache_dtype", [None, FP8])
def test_qkv_on_the_rows_kernel_with_bias_and_an_fp8_cache(cache_dtype):
    scales = (0.5, 2.0) if cache_dtype == FP8 else (1.0, 1.0)
    check_on_rows_kernel("w8a16", 4, 2, 1, 64, 64, torch.bfloat16, fp8_matmul.RowsTile(16, 64, 32, 4, 2), bias=True,
                         cache_dtype=cache_dtype, scales=scales)


def test_qkv_on_the_rows_kernel_refuses_bad_operands():
    rotary = RotaryEmbedding(64, 32, 10000.0, None, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(4 * 64, 64, device=DEVICE, dtype=torch.bfloat16)
    project = qkv_rows.project_rope_and_write_kv_cache_on_rows_kernel
    with pytest.raises(ValueError, match="not a fused QKV weight"):
        project(x, weight[:200], None, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="contiguous with x's 64 columns"):
        project(x, weight[:, :48], None, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="take their row scales"):
        project(x, weight, torch.ones(256, device=DEVICE), None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="must be x's dtype"):
        project(x.float(), weight, None, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="exceed the rows kernel"):
        many = torch.randn(65, 64, device=DEVICE, dtype=torch.bfloat16)
        project(many, weight, None, None, torch.zeros(65, dtype=torch.int64, device=DEVICE), rotary.cos, rotary.sin,
                None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="one position per row"):
        project(x, weight, None, None, positions[:2], rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="K > 0"):
        project(x[:, :0], weight[:, :0], None, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    codes, scale = quantize_per_channel(weight.float())
    with pytest.raises(ValueError, match="as QuantizedRows"):  # FP8 activations must come with their scales
        project(x.to(FP8), codes, scale, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="float32 scales"):
        bad = fp8_matmul.QuantizedRows(x.to(FP8), torch.ones(2, device=DEVICE), torch.bfloat16)
        project(bad, codes, scale, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64)
    with pytest.raises(ValueError, match="norm weight"):
        project(x, weight, None, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64,
                norm_weight=torch.ones(48, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not FP8 codes"):
        rows = fp8_matmul.QuantizedRows(*fp8_matmul.quantize_rows_torch(x), torch.bfloat16)
        project(rows, codes, scale, None, positions, rotary.cos, rotary.sin, None, None, 2, 1, 64,
                norm_weight=torch.ones(64, device=DEVICE, dtype=torch.bfloat16))


def test_qkv_on_the_rows_kernel_compiles_for_sm90():
    """sm_90: 16-bit, W8A16 and FP8 x FP8, through TMA (the two halves' boxes) or not, split or not, an fp8
    cache; within the H200's shared memory."""
    from sm90_compile import H200_SHARED_MEMORY, compile_for_sm90

    cases = []
    for kind, head_size, tma, split_k, cache, norm in [
            ("w16", 64, True, 4, "bf16", False), ("w8a16", 128, True, 2, "fp8e4nv", False),
            ("fp8", 128, True, 1, "bf16", False), ("w16", 80, False, 1, "bf16", False),
            ("fp8", 64, True, 4, "bf16", False), ("w16", 80, True, 1, "bf16", False),
            ("w16", 64, True, 4, "bf16", True), ("w16", 128, True, 1, "bf16", True)]:  # the norm prologue
        weight = "bf16" if kind == "w16" else "fp8e4nv"
        block_n, block_k = qkv_rows.half_block(head_size), 128 if kind == "w16" else 256
        pointers = dict(x_ptr="*fp8e4nv" if kind == "fp8" else "*bf16", x_scale_ptr="*fp32", w_ptr=f"*{weight}",
                        w_desc=f"tensordesc<{weight}[{block_n}, {block_k}]>" if tma else f"*{weight}",
                        w_scale_ptr="*fp32", bias_ptr="*bf16", qkv_ptr="*bf16", positions_ptr="*i64", cos_ptr="*fp32",
                        sin_ptr="*fp32", cache_ptr=f"*{cache}", slot_ptr="*i64",
                        # unsplit, the output stands in for the split scratch and its counters (rows_launch)
                        partials_ptr="*fp32" if split_k > 1 else "*bf16",
                        arrivals_ptr="*i32" if split_k > 1 else "*bf16", norm_w_ptr="*bf16")
        integers = {arg: "i32" for arg in ("M", "K", "stride_x", "stride_w", "stride_qkv_row", "stride_table_row",
                                           "stride_cache_kind", "slices_per_split")}
        cases.append(dict(
            name=f"qkv-rows-{kind}-{head_size}-split{split_k}{'-tma' if tma else ''}{'-norm' if norm else ''}",
            module="graphrt.attention.triton_qkv_rows", kernel="_weight_rows_qkv_rope_cache_kernel",
            signature={**pointers, **integers, "inv_k_scale": "fp32", "inv_v_scale": "fp32", "eps": "fp32"},
            constexprs=dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_SIZE=head_size, HAS_BIAS=False, WRITE_CACHE=True,
                            QUANTIZE=cache == "fp8e4nv", X_CODES=kind == "fp8", DOT_F32=False,
                            EVEN=(head_size // 2) % block_n == 0, TMA=tma, W_CODES=kind != "w16", SPLIT_K=split_k,
                            BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm),
            num_warps=4, num_stages=4, aligned_ints=["K", "stride_x", "stride_w"]))
    for case, result in zip(cases, compile_for_sm90(cases)):
        assert "error" not in result, (case["name"], result)
        assert result["shared"] <= H200_SHARED_MEMORY, (case["name"], result)
        assert (result["tma_loads"] > 0) is case["constexprs"]["TMA"], (case["name"], result)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("kind", ["w16", "w8a16", "fp8"])
@pytest.mark.parametrize("num_tokens", [2, 8, 16, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,hidden", [(32, 8, 64, 2048), (32, 8, 128, 4096)])
def test_qkv_on_the_rows_kernel_model_shapes_gpu(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden):
    """The 1B's and the 8B's QKV at their default tiles (split K, TMA up to 16 tokens on sm_90+)."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    programs = (num_heads + 2 * num_kv_heads) * -(-(head_size // 2) // qkv_rows.half_block(head_size))
    tile = fp8_matmul.rows_tile(num_tokens, programs * 64, hidden, fp8_matmul.multiprocessors(torch.device(DEVICE)),
                                fp8_matmul.tma_available(torch.device(DEVICE)), 1 if kind != "w16" else 2)
    assert width
    check_on_rows_kernel(kind, num_tokens, num_heads, num_kv_heads, head_size, hidden, torch.bfloat16, tile,
                         seed=num_tokens)
