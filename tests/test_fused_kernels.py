"""The fused Triton kernels against the unfused torch ops they replace (graphrt.models.layers and the
rotary embedding followed by the plain cache write).

Fresh random inputs, outputs poisoned with NaN before the kernel writes them. Small shapes run on the
CPU under Triton's interpreter; the gpu-marked grid covers every supported head size, GQA ratios, odd
token counts and hidden sizes of the presets on a CUDA device.

Expected agreement: the kernels round to the model dtype where the torch ops do, so q/k rotation,
SiLU * up and the residual sums match bit for bit; the norm's float32 sum of squares runs in another
order, so its output may differ by one unit in the last place of the model dtype.
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

from graphrt.attention import triton_rope_cache_write as rope_write  # noqa: E402
from graphrt.kernels import activation, rms_norm  # noqa: E402
from graphrt.models.layers import RotaryEmbedding, rms_norm_torch, silu_and_mul_torch  # noqa: E402

rope_write = interpreted(rope_write, "_rope_cache_write_kernel")
activation = interpreted(activation, "_silu_and_mul_kernel")
rms_norm = interpreted(rms_norm, "_rms_norm_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16]
#: The CPU cases take float16 too (the interpreter runs it; the model dtype of fp16 checkpoints).
CPU_DTYPES = DTYPES + [torch.float16]


def _tolerance(dtype):
    """Two units in the last place of the dtype (a rounding of the normalised value, then of its product
    with the weight), for the norm's reduction order and the device's rsqrt / exp."""
    if dtype == torch.bfloat16:
        return dict(rtol=2**-6, atol=1e-5)
    return dict(rtol=2**-9, atol=1e-5) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-6)


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# -- residual add + RMSNorm --------------------------------------------------------------------------


def check_rms_norm(num_tokens, hidden, dtype, with_residual, seed=0):
    x = _randn(num_tokens, hidden, dtype=dtype, seed=seed, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=seed + 1)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=seed + 2) if with_residual else None
    expected = rms_norm_torch(x, weight, 1e-5, residual)
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)
    got = rms_norm.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone(), out=out)
    if with_residual:
        (got_out, got_sum), (want_out, want_sum) = got, expected
        torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # the sum is one rounding in both
    else:
        got_out, want_out = got, expected
    assert got_out.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got_out, want_out, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 80), (5, 576)])
def test_rms_norm_matches_torch(num_tokens, hidden, dtype, with_residual):
    check_rms_norm(num_tokens, hidden, dtype, with_residual)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 257])
@pytest.mark.parametrize("hidden", [576, 2048, 3072, 4096, 8192])
def test_rms_norm_grid_gpu(num_tokens, hidden, dtype, with_residual):
    check_rms_norm(num_tokens, hidden, dtype, with_residual, seed=num_tokens * hidden)


def _assert_quantized_as_quantize_rows(got, output):
    """``got`` (QuantizedRows) equals ``quantize_rows_torch`` of ``output`` bit for bit. Except float32
    on the GPU: there the quantising and the plain kernel, compiled apart, may sum the norm's squares
    in another order, so a value can differ in its last bit: the scales then within a float32 rounding
    or two, the codes within E4M3 rounding of the output (half a step, 2**-4 relative)."""
    from graphrt.kernels.fp8_matmul import QuantizedRows, quantize_rows_torch

    codes, scales = quantize_rows_torch(output)
    assert isinstance(got, QuantizedRows) and got.dtype == output.dtype and got.shape == output.shape
    if output.dtype == torch.float32 and CUDA:
        torch.testing.assert_close(got.scales, scales, rtol=2**-21, atol=0)
        back = got.codes.double() * got.scales.double()[:, None]
        exact = output.double()
        bound = exact.abs() * 2**-4 * (1 + 2**-20) + got.scales.double()[:, None] * 2**-10
        assert ((back - exact).abs() <= bound).all()
        return
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))


def check_rms_norm_quantized(num_tokens, hidden, dtype, with_residual, seed=0):
    """The quantised output against quantize_rows of the kernel's own 16-bit output (same sum, same
    rounding); the residual's update unchanged. A zero row gets the smallest scale."""
    from graphrt.kernels.fp8_matmul import MIN_SCALE

    x = _randn(num_tokens, hidden, dtype=dtype, seed=seed, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=seed + 1)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=seed + 2) if with_residual else None
    if not with_residual:
        x[-1] = 0.0
    plain = rms_norm.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone())
    got = rms_norm.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone(), quantize=True)
    if with_residual:
        (got, got_sum), (plain, plain_sum) = got, plain
        assert torch.equal(got_sum, plain_sum)
    _assert_quantized_as_quantize_rows(got, plain)
    if not with_residual:
        assert got.scales[-1] == MIN_SCALE and not got.codes[-1].float().any()


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("num_tokens,hidden", [(2, 64), (3, 80), (5, 576)])
def test_rms_norm_quantized_output_is_quantize_rows_of_its_output(num_tokens, hidden, dtype, with_residual):
    check_rms_norm_quantized(num_tokens, hidden, dtype, with_residual, seed=hidden)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("num_tokens", [2, 17, 64, 257])
@pytest.mark.parametrize("hidden", [576, 2048, 4096])
def test_rms_norm_quantized_grid_gpu(num_tokens, hidden, dtype, with_residual):
    check_rms_norm_quantized(num_tokens, hidden, dtype, with_residual, seed=num_tokens + hidden)


def test_quantized_outputs_take_no_out():
    x = _randn(2, 64, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="out cannot be given with quantize"):
        rms_norm.rms_norm(x, x[0].clone(), 1e-5, out=torch.empty_like(x), quantize=True)
    with pytest.raises(ValueError, match="out cannot be given with quantize"):
        activation.silu_and_mul(x, out=torch.empty(2, 32, dtype=x.dtype, device=DEVICE), quantize=True)


def test_a_quantized_norm_needs_the_fused_kernel():
    from graphrt.models.layers import RMSNorm

    with pytest.raises(ValueError, match="quantized norm output needs the fused kernel"):
        RMSNorm(64, 1e-5, torch.float32, DEVICE)(_randn(2, 64, dtype=torch.float32, seed=1), quantize=True)


def test_rms_norm_rejects_mismatched_residual():
    x = _randn(2, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm.rms_norm(x, x[0].clone(), 1e-5, residual=x[:, :32].contiguous())


# -- SiLU * up -----------------------------------------------------------------------------------------


def check_silu_and_mul(num_tokens, intermediate, dtype, seed=0):
    gate_up = _randn(num_tokens, 2 * intermediate, dtype=dtype, seed=seed, scale=4.0)
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=dtype, device=DEVICE)
    got = activation.silu_and_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, silu_and_mul_torch(gate_up), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 64), (3, 1536), (2, 1100)])
def test_silu_and_mul_matches_torch(num_tokens, intermediate, dtype):
    check_silu_and_mul(num_tokens, intermediate, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 257])
@pytest.mark.parametrize("intermediate", [1536, 8192, 14336, 1000])
def test_silu_and_mul_grid_gpu(num_tokens, intermediate, dtype):
    check_silu_and_mul(num_tokens, intermediate, dtype, seed=num_tokens + intermediate)


def check_silu_and_mul_quantized(num_tokens, intermediate, dtype, seed=0):
    from graphrt.kernels.fp8_matmul import MIN_SCALE

    gate_up = _randn(num_tokens, 2 * intermediate, dtype=dtype, seed=seed, scale=4.0)
    gate_up[-1, :intermediate] = 0.0  # silu(0) * up = 0: a zero row, the smallest scale
    got = activation.silu_and_mul(gate_up, quantize=True)
    _assert_quantized_as_quantize_rows(got, activation.silu_and_mul(gate_up))
    assert got.scales[-1] == MIN_SCALE


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,intermediate", [(2, 64), (3, 1536), (2, 5000)])
def test_silu_and_mul_quantized_output_is_quantize_rows_of_its_output(num_tokens, intermediate, dtype,
                                                                      monkeypatch):
    """Rows held in registers in one partial load, and (the register cap lowered to 2048 columns) rows
    walked twice in loads of 2048, the last partial."""
    check_silu_and_mul_quantized(num_tokens, intermediate, dtype, seed=intermediate)
    monkeypatch.setattr(activation, "_QUANTIZE_MAX_BLOCK", 2048)
    monkeypatch.setattr(activation, "_QUANTIZE_LOOP_BLOCK", 2048)
    check_silu_and_mul_quantized(num_tokens, intermediate, dtype, seed=intermediate + 1)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [2, 17, 64, 257])
@pytest.mark.parametrize("intermediate", [1536, 8192, 14336, 1000, 28672])  # 28672: above the register cap
def test_silu_and_mul_quantized_grid_gpu(num_tokens, intermediate, dtype):
    check_silu_and_mul_quantized(num_tokens, intermediate, dtype, seed=num_tokens + intermediate)


# -- rotary embedding + KV-cache write -------------------------------------------------------------------


def check_rope_cache_write(num_tokens, num_heads, num_kv_heads, head_size, dtype, cache_dtype=None,
                           with_cache=True, block_size=16, seed=0):
    cache_dtype = cache_dtype or dtype
    max_positions = 4096
    rotary = RotaryEmbedding(head_size, max_positions, 10000.0, None, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(DEVICE)
    num_blocks = num_tokens // block_size + 3
    # Distinct slots outside the null block; every third row is CUDA-graph padding (-1).
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[1::3] = -1
    slots = slots.to(DEVICE)
    poison = float("nan") if cache_dtype != FP8 else 448.0  # e4m3 has no inf; NaN bits are 0x7f
    cache = torch.full((2, num_blocks, block_size * kv_size), poison, dtype=torch.float32,
                       device=DEVICE).to(cache_dtype) if with_cache else None

    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rotary(positions, q, k)
    want_cache = None
    if with_cache:
        want_cache = cache.clone()
        keep = slots >= 0
        flat = want_cache.view(2, -1, kv_size)
        for kind, rows in ((0, want_k), (1, v)):
            rows = rows[keep].float()
            flat[kind, slots[keep]] = rows.clamp(-448, 448).to(FP8) if cache_dtype == FP8 else rows.to(cache_dtype)

    rotated = qkv.clone()
    rope_write.rope_and_write_kv_cache(rotated, positions, rotary.cos, rotary.sin, cache, slots,
                                       num_heads, num_kv_heads, head_size)
    got_q, got_k, got_v = rotated.split([q_size, kv_size, kv_size], dim=-1)
    # bf16: bit for bit. fp32: the GPU may contract a product and a sum into one FMA. fp16 on the GPU:
    # Triton folds the fp32 -> fp16 -> fp32 round trip of a product, so a value may be one fp16 unit off.
    exact = {torch.bfloat16: dict(rtol=0, atol=0), torch.float32: dict(rtol=1e-6, atol=1e-6),
             torch.float16: dict(rtol=2**-10, atol=2**-7)}[dtype]
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)
    if with_cache:
        torch.testing.assert_close(cache.float(), want_cache.float(), equal_nan=True, **exact)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
def test_rope_cache_write_head_sizes(head_size, dtype):
    check_rope_cache_write(5, 4, 2, head_size, dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (3, 3), (6, 2), (9, 3)])
def test_rope_cache_write_gqa(num_heads, num_kv_heads):
    check_rope_cache_write(4, num_heads, num_kv_heads, 64, torch.bfloat16, seed=num_heads)


def test_rope_cache_write_fp8_cache():
    check_rope_cache_write(4, 4, 2, 64, torch.bfloat16, cache_dtype=FP8)


def test_rope_without_cache_only_rotates():
    check_rope_cache_write(3, 4, 2, 64, torch.bfloat16, with_cache=False)


def test_rope_cache_write_rejects_wrong_width():
    qkv = _randn(2, 100, dtype=torch.float32, seed=0)
    rotary = RotaryEmbedding(64, 16, 10000.0, None, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        rope_write.rope_and_write_kv_cache(qkv, torch.zeros(2, dtype=torch.int64, device=DEVICE), rotary.cos,
                                           rotary.sin, None, None, 4, 2, 64)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (9, 3), (8, 1), (16, 16)])
@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_rope_cache_write_grid_gpu(num_tokens, num_heads, num_kv_heads, head_size, dtype):
    check_rope_cache_write(num_tokens, num_heads, num_kv_heads, head_size, dtype, seed=num_tokens + head_size)


@gpu
@pytest.mark.gpu
def test_rope_cache_write_fp8_gpu():
    check_rope_cache_write(64, 32, 8, 128, torch.bfloat16, cache_dtype=FP8)


# -- whole model ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_engine_matches_unfused(dtype, monkeypatch):
    """Same greedy tokens and (nearly) the same logits from the fused and the unfused model, over
    prompts of different lengths decoding together, and over one prompt decoding alone (the GEMV layers
    of ``graphrt.kernels.gemv``, QKV with rotary and cache write in one kernel)."""
    from hf_reference import graphrt_greedy_with_logits

    from graphrt import LLM, SamplingParams
    from graphrt.kernels import gemv
    from graphrt.models import kernel_policy

    # GEMV layers for one token only (tiny's small layers would take up to four, each row a program of
    # its own: slow in the interpreter; test_gemv.py checks several rows against float64).
    monkeypatch.setattr(kernel_policy, "GEMV_THRESHOLDS",
                        dataclasses.replace(kernel_policy.GEMV_THRESHOLDS, small_layer_bytes=0))
    gemv_rows = []  # the token count of every GEMV call
    linear_gemv = gemv.linear_gemv
    monkeypatch.setattr(gemv, "linear_gemv", lambda x, *a, **k: gemv_rows.append(x.shape[0]) or linear_gemv(x, *a, **k))
    qkv_rows = []  # the token count of every fused QKV + rotary + cache-write call
    project = rope_write.project_rope_and_write_kv_cache
    monkeypatch.setattr(rope_write, "project_rope_and_write_kv_cache",
                        lambda x, *a, **k: qkv_rows.append(x.shape[0]) or project(x, *a, **k))

    prompts = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)  # the fused sampling kernel
    outputs, drawn, logits = {}, {}, {}
    for fused in (False, True):
        llm = LLM("random:tiny", dtype=dtype, device=DEVICE, fused_kernels=fused, max_model_len=64,
                  max_num_seqs=4, num_kv_blocks=64, loader_options={"init_std": 0.2}, progress=False)
        assert llm.engine.fused_kernels is fused
        outputs[fused] = [out.token_ids for out in llm.generate(prompts, params)]
        drawn[fused] = [out.token_ids for out in llm.generate(prompts, sampled)]
        logits[fused] = graphrt_greedy_with_logits(llm, prompts[2], max_tokens=4)[1]
    assert gemv_rows, "the one-row decode never ran the GEMV layers"
    assert set(gemv_rows) == {1}, "a forward of several tokens ran the GEMV layers"
    assert set(qkv_rows) == {1}, "the one-row layers did not project, rotate and cache in one kernel"
    assert outputs[True] == outputs[False]
    assert drawn[True] == drawn[False]
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.02, atol=0.05)
    torch.testing.assert_close(logits[True], logits[False], **tolerance)


# -- greedy argmax -------------------------------------------------------------------------------------


def check_argmax(batch, vocab, dtype, seed=0):
    from graphrt.sampling import argmax

    logits = _randn(batch, vocab, dtype=dtype, seed=seed, scale=5.0)
    # Ties at the maximum, in two chunks of 4096 (and twice within one), must go to the lowest id.
    if vocab > 9000:
        logits[0, [123, 4500, 8200]] = 100.0
    logits[-1, [vocab - 1, vocab // 2]] = 100.0
    out = torch.full((batch,), -7, dtype=torch.int64, device=DEVICE)
    got = argmax.argmax_rows(logits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.tolist() == torch.argmax(logits.float(), dim=-1).tolist()


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("batch,vocab", [(1, 37), (3, 512), (2, 9001)])
def test_argmax_matches_torch(batch, vocab, dtype):
    check_argmax(batch, vocab, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("vocab", [49152, 128256, 151936, 1000])
def test_argmax_grid_gpu(batch, vocab, dtype):
    check_argmax(batch, vocab, dtype, seed=batch + vocab)


# -- temperature sampling ----------------------------------------------------------------------------


def _sampling_rows(batch, seed, greedy_every=4):
    from graphrt.sampling.params import SamplingParams
    from graphrt.sampling.sampler import SamplingTensors

    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.0 if i % greedy_every == 0 else 0.3 + 0.2 * (i % 7)) for i in range(batch)]
    seeds = torch.randint(0, 2**63 - 1, (batch,), generator=gen).tolist()
    steps = torch.randint(0, 2**40, (batch,), generator=gen).tolist()
    return SamplingTensors.from_params(params, seeds, steps, DEVICE)


def check_temperature_sampling(batch, vocab, dtype, seed=0):
    """Against graphrt.sampling.sampler.sample: constant rows isolate the noise (the race is then decided by
    the hash alone, so tokens must be equal); random rows may differ only at float32 near-ties."""
    from graphrt.sampling.fused import sample_temperature
    from graphrt.sampling.sampler import sample

    rows = _sampling_rows(batch, seed)
    constant = torch.zeros(batch, vocab, dtype=dtype, device=DEVICE)
    out = torch.full((batch,), -7, dtype=torch.int64, device=DEVICE)
    assert sample_temperature(constant, rows, out=out).tolist() == sample(constant, rows).tolist()
    logits = _randn(batch, vocab, dtype=dtype, seed=seed + 1, scale=3.0)
    got, want = sample_temperature(logits, rows), sample(logits, rows)
    greedy = rows.temperature == 0
    assert torch.equal(got[greedy], want[greedy])
    assert (got != want).sum().item() <= batch // 100  # near-ties in float32 are ~1e-6 a row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,vocab", [(1, 37), (9, 512), (4, 9001)])
def test_temperature_sampling_matches_sampler(batch, vocab, dtype):
    check_temperature_sampling(batch, vocab, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("vocab", [49152, 128256, 151936, 1000])
def test_temperature_sampling_grid_gpu(batch, vocab, dtype):
    check_temperature_sampling(batch, vocab, dtype, seed=batch + vocab)


def test_temperature_sampling_follows_softmax():
    """Draws of one 6-token row (one step each; 20,000 on a GPU, 1,500 in the slow CPU interpreter)
    follow softmax(logits / T) (chi-square, 5 degrees of freedom)."""
    from graphrt.sampling.fused import sample_temperature
    from graphrt.sampling.params import SamplingParams
    from graphrt.sampling.sampler import SamplingTensors

    draws, temperature = (20_000 if CUDA else 1_500), 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.2])
    rows = SamplingTensors.from_params([SamplingParams(temperature=temperature)] * draws, [42] * draws,
                                       list(range(draws)), DEVICE)
    tokens = sample_temperature(row.to(DEVICE).expand(draws, -1).contiguous(), rows)
    counts = torch.bincount(tokens.cpu(), minlength=6).double()
    expected = torch.softmax(row.double() / temperature, 0) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # p = 0.001 for 5 degrees of freedom


def test_fused_kernels_on_cpu_need_the_interpreter(monkeypatch):
    from graphrt import LLM
    from graphrt.base.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="fused_kernels=True needs a CUDA device"):
        LLM("random:tiny", device="cpu", fused_kernels=True, progress=False)
