"""The few-row kernels (graphrt.kernels.gemv_rows) against the float64 reference of tests/test_gemv.py:
the same variants (bias, norm, SiLU * up, residual add), 2-16 rows, odd widths and depths, outputs
poisoned with NaN; a row's result independent of the other rows in the launch."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import test_gemv  # noqa: E402
from test_gemv import DEVICE, VARIANTS, _randn  # noqa: E402
from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_qkv_rows as qkv_rows  # noqa: E402
from graphrt.kernels import gemv  # noqa: E402
from graphrt.kernels import gemv_rows as _gemv_rows  # noqa: E402

gemv_rows = interpreted(_gemv_rows, "_rows_linear_kernel")
CUDA = torch.cuda.is_available()


def check(variant, rows, out_features, in_features, dtype, seed=0, config=None):
    test_gemv.check(variant, rows, out_features, in_features, dtype, seed, config, linear=gemv_rows.linear_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(2, 48, 80), (5, 40, 200), (16, 34, 33)])
def test_linear_rows_matches_reference(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype)


@pytest.mark.parametrize("variant", ["norm", "norm_silu"])
def test_linear_rows_in_float16_and_other_tiles(variant):
    check(variant, 3, 64, 96, torch.float16)
    check(variant, 7, 96, 300, torch.bfloat16, config=gemv_rows.RowsTileConfig(block_n=32, block_k=32))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Row 0 alone and among 9 others: the same bits (the rows are padded to one tile either way)."""
    x = _randn(10, 72, dtype=torch.bfloat16, seed=5)
    weight = _randn(40, 72, dtype=torch.bfloat16, seed=6, scale=72**-0.5)
    norm_weight = _randn(72, dtype=torch.bfloat16, seed=7)
    together = gemv_rows.linear_rows(x, weight, norm_weight=norm_weight)
    alone = gemv_rows.linear_rows(x[3:4].clone(), weight, norm_weight=norm_weight)
    assert torch.equal(together[3:4], alone)


def test_linear_rows_refuses_what_it_does_not_take():
    x = torch.zeros(17, 32, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="17 rows exceed the few-row kernels' 16"):
        gemv_rows.linear_rows(x, weight)
    with pytest.raises(ValueError, match="not FP8 codes"):
        gemv_rows.linear_rows(x[:2], weight.to(torch.float8_e4m3fn), weight_scale=torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="block_n must be a power of two of at least 16"):
        gemv_rows.RowsTileConfig(block_n=8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (3072, 2048), (2048, 8192)])
def test_linear_rows_grid_gpu(variant, rows, out_features, in_features, dtype):
    if variant == "norm_silu":
        out_features *= 2
    check(variant, rows, out_features, in_features, dtype)


def test_rows_kernel_compiles_for_sm90():
    """Every epilogue, bfloat16 (tensor-core products) and float32, plainly and as a dependent, and the QKV
    kernel with a 16-bit and an fp8 cache: compiles for the H200 within its shared memory (the interpreter
    checks neither, and runs bfloat16 products widened)."""
    import itertools

    from sm90_compile import H200_SHARED_MEMORY, compile_for_sm90

    cases = []
    for dtype, variant, pdl in itertools.product(["bf16", "fp32"], ["bias", "norm", "norm_silu", "add"], [False, True]):
        config = gemv_rows.RowsTileConfig()
        pointers = {arg: f"*{dtype}" for arg in ("x_ptr", "w_ptr", "bias_ptr", "norm_w_ptr", "out_ptr")}
        integers = {arg: "i32" for arg in ("M", "N", "K", "stride_x", "stride_w", "stride_out")}
        epilogue = {"norm_silu": gemv.EPILOGUE_SILU_MUL, "add": gemv.EPILOGUE_ADD_TO_OUT}.get(variant,
                                                                                             gemv.EPILOGUE_STORE)
        cases.append(dict(
            name=f"{variant}-{dtype}{'-dependent' if pdl else ''}", module="graphrt.kernels.gemv_rows",
            kernel="_rows_linear_kernel", signature={**pointers, **integers, "eps": "fp32"},
            constexprs=dict(NORM=variant.startswith("norm"), EPILOGUE=epilogue, HAS_BIAS=variant == "bias",
                            DOT_F32=dtype == "fp32", BLOCK_M=gemv_rows.MAX_ROWS, BLOCK_N=config.block_n,
                            BLOCK_K=config.block_k, PDL=pdl),
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
            aligned_ints=["N", "K", "stride_x", "stride_w", "stride_out"]))
    for dtype, head_size, pdl, cache in [("bf16", 64, True, "bf16"), ("bf16", 128, True, "fp8e4nv"),
                                         ("fp32", 80, False, "fp32")]:
        pointers = {arg: f"*{dtype}" for arg in ("x_ptr", "w_ptr", "bias_ptr", "norm_w_ptr", "qkv_ptr")}
        pointers.update(positions_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", cache_ptr=f"*{cache}", slot_ptr="*i64")
        integers = {arg: "i32" for arg in ("M", "K", "stride_x", "stride_w", "stride_qkv_row", "stride_table_row",
                                           "stride_cache_kind")}
        floats = {arg: "fp32" for arg in ("eps", "inv_k_scale", "inv_v_scale")}
        cases.append(dict(
            name=f"qkv-{dtype}-{head_size}-{cache}", module="graphrt.attention.triton_qkv_rows",
            kernel="_rows_qkv_rope_cache_kernel", signature={**pointers, **integers, **floats},
            constexprs=dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_SIZE=head_size, NORM=True, HAS_BIAS=False,
                            WRITE_CACHE=True, QUANTIZE=cache == "fp8e4nv", DOT_F32=dtype == "fp32",
                            BLOCK_M=gemv_rows.MAX_ROWS, BLOCK_N=qkv_rows.half_block(head_size), BLOCK_K=128, PDL=pdl),
            num_warps=4, num_stages=4, launch_pdl=pdl, aligned_ints=["K", "stride_x", "stride_w"]))
    results = compile_for_sm90(cases)
    problems = {case["name"]: result for case, result in zip(cases, results)
                if "error" in result or result["shared"] > H200_SHARED_MEMORY}
    assert not problems, problems


def test_a_model_on_the_few_row_kernels_decodes_as_on_the_gemm_path(monkeypatch):
    """A fused model (float32, the interpreter) whose decode steps of 5-16 rows run the GEMV layers on the
    few-row kernels gives the GEMM path's tokens and logprobs; so does a prompt of 9 tokens alone, whose
    prefill then runs them too (the prefill attention reading q, k and v from their output)."""
    import dataclasses

    from graphrt import LLM, SamplingParams
    from graphrt.models import kernel_policy

    prompts = [[(13 * i + 7 * n) % 500 + 3 for i in range(n)] for n in (3, 9, 17, 4, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    options = dict(dtype="float32", device="cpu", fused_kernels=True, max_model_len=64, num_kv_blocks=64,
                   progress=False, loader_options={"init_std": 0.1})
    with LLM("random:tiny", **options) as llm:
        assert not llm.engine.model.kernel_policy.runs_gemv(len(prompts))
        reference = llm.generate(prompts, params)
        reference_alone = llm.generate([prompts[1]], params)[0]
    monkeypatch.setattr(kernel_policy, "GEMV_THRESHOLDS",
                        dataclasses.replace(kernel_policy.GEMV_THRESHOLDS, rows_max_tokens=16))
    calls = []
    linear_rows = gemv_rows.linear_rows
    monkeypatch.setattr(_gemv_rows, "linear_rows", lambda *a, **k: calls.append(a[0].shape[0]) or linear_rows(*a, **k))
    with LLM("random:tiny", **options) as llm:
        assert llm.engine.model.kernel_policy.runs_gemv_rows(len(prompts))
        outputs = llm.generate(prompts, params)
        decode_calls = list(calls)
        alone = llm.generate([prompts[1]], params)[0]
    assert decode_calls and set(decode_calls) == {len(prompts)}
    assert len(prompts[1]) in calls[len(decode_calls):]  # the prompt's prefill
    assert alone.token_ids == reference_alone.token_ids
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
