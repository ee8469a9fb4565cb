"""The matrix-vector kernel (graphrt.kernels.gemv) against a float64 torch reference.

The reference runs the unfused ops' arithmetic: the norm as ``rms_norm_torch`` (rounded to the model
dtype), then the product in float64, rounded to the model dtype where ``F.linear`` rounds, then SiLU * up
or the residual add as the torch ops round them. The kernel sums in float32, so a result may sit one
rounding of the model dtype away. Fresh random inputs; outputs poisoned with NaN before the kernel
writes them. Small shapes on the CPU under Triton's interpreter, the models' shapes on a GPU.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.kernels import gemv  # noqa: E402
from graphrt.models.fp8 import quantize_per_channel  # noqa: E402
from graphrt.models.layers import rms_norm_torch, silu_and_mul_torch  # noqa: E402

gemv = interpreted(gemv, "_gemv_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-5
VARIANTS = ["plain", "bias", "norm", "norm_silu", "add"]


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


#: One rounding of each dtype, relative (float32: the float32 sums against float64's, over K <= 8192).
UNIT = {torch.float32: 2**-17, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def reference(variant, x, weight, bias, norm_weight, residual):
    """The unfused layer arithmetic with the GEMM in float64, rounded once to the model dtype.
    Returns (expected output, the rounded GEMM result, the largest |x_k * w_nk| of each product
    [M, N_w])."""
    dtype = x.dtype  # weight: x's dtype, or float64 (FP8 codes times their scales)
    if variant.startswith("norm"):
        x = rms_norm_torch(x, norm_weight, EPS)
    product = x.double() @ weight.double().T
    largest_term = x.double().abs().amax(dim=1, keepdim=True) * weight.double().abs().amax(dim=1)[None, :]
    if bias is not None:
        product += bias.double()
    product = product.to(dtype)
    if variant == "norm_silu":
        return silu_and_mul_torch(product), product, largest_term
    return (residual + product if variant == "add" else product), product, largest_term


def allowed_error(variant, expected, product, largest_term, in_features, dtype, magnitude=None):
    """Per element: the GEMM result may sit a rounding or two away (float32 sums in another order, then
    the rounding to the model dtype), and that error carries through the epilogue: unchanged into a
    residual sum (however much the sum cancels), amplified by ``1 + |gate|`` through SiLU. With the
    norm, 1/rms summed in another order can move a few normalised inputs by one rounding each
    (measured on the H200: ~2 of 8192 in fp16), each changing the product by up to a rounding of its
    largest term; allowed: 4 + K / 1024 of them. ``magnitude`` ([rows, N] sums of the terms' absolute
    values, without the norm): the float32 sums' own error scales with it, a few float32 roundings of it
    (tensor cores accumulate in another order than one row's sum; on the H200 a 16-bit sum over 8192
    terms came within 3 of them)."""
    unit = UNIT[dtype]
    # Near zero the float32 sums' own error (relative to the terms, not to the result) is what is left.
    floor = (unit if dtype == torch.float32 else 2**-20) * product.double().abs().max() + 1e-6
    if magnitude is not None:
        floor = floor + 4 * 2**-24 * magnitude
    flipped = unit * (4 + in_features // 1024) * largest_term
    if variant == "norm_silu":  # through silu(gate) * up: |silu'| <= 1.1
        half = product.shape[1] // 2
        gate, up = product[:, :half].double(), product[:, half:].double()
        floor = floor + 1.1 * flipped[:, :half] * up.abs() + flipped[:, half:] * torch.nn.functional.silu(gate).abs()
        return 2 * unit * expected.double().abs() * (3 + gate.abs()) + floor
    if variant == "norm":
        floor = floor + flipped
    return 2 * unit * (expected.double().abs() + product.double().abs()) + floor


def check(variant, rows, out_features, in_features, dtype, seed=0, config=None, fp8_weight=False, linear=None):
    """``fp8_weight``: the kernel reads the weight as FP8 codes with a scale per row (quantised by
    ``quantize_per_channel``); the reference multiplies by those codes times their scales, in float64.
    ``linear``: the function checked (default ``gemv.linear_gemv``; the few-row ``gemv_rows.linear_rows``
    takes the same arguments)."""
    out_width = out_features // 2 if variant == "norm_silu" else out_features
    x = _randn(rows, in_features, dtype=dtype, seed=seed, scale=2.0)
    weight = _randn(out_features, in_features, dtype=dtype, seed=seed + 1, scale=in_features**-0.5)
    weight_scale = None
    if fp8_weight:  # rows of widely different magnitudes, so the scales matter
        weight = weight * torch.logspace(-2, 1, out_features, device=DEVICE, dtype=torch.float64)[:, None].to(dtype)
        codes, weight_scale = quantize_per_channel(weight)
        weight = codes.double() * weight_scale.double()[:, None]  # the real weights: what the reference uses
    bias = _randn(out_features, dtype=dtype, seed=seed + 2) if variant == "bias" else None
    norm_weight = _randn(in_features, dtype=dtype, seed=seed + 3) if variant.startswith("norm") else None
    residual = _randn(rows, out_width, dtype=dtype, seed=seed + 4) if variant == "add" else None
    expected, product, largest_term = reference(variant, x, weight, bias, norm_weight, residual)
    out = residual.clone() if variant == "add" else torch.full((rows, out_width), float("nan"), dtype=dtype,
                                                               device=DEVICE)
    epilogue = {"norm_silu": gemv.EPILOGUE_SILU_MUL, "add": gemv.EPILOGUE_ADD_TO_OUT}.get(
        variant, gemv.EPILOGUE_STORE)
    linear = linear or gemv.linear_gemv
    got = linear(x, codes if fp8_weight else weight, bias, norm_weight=norm_weight, eps=EPS, epilogue=epilogue, out=out,
                 config=config, weight_scale=weight_scale)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was never written"
    magnitude = None if variant.startswith("norm") else x.double().abs() @ weight.double().abs().T
    allowed = allowed_error(variant, expected, product, largest_term, in_features, dtype, magnitude)
    excess = (got.double() - expected.double()).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
                               f"{divmod(worst, excess.shape[1])}: {got.flatten()[worst].item()} vs "
                               f"{expected.flatten()[worst].item()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 48, 80), (1, 20, 1100), (3, 40, 96), (2, 64, 300)])
def test_linear_gemv_matches_reference(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype, seed=rows + in_features)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 48, 80), (3, 40, 96)])
def test_linear_gemv_matches_reference_in_float16(variant, rows, out_features, in_features):
    check(variant, rows, out_features, in_features, torch.float16)


@pytest.mark.parametrize("config", [gemv.TileConfig(8, 32, 4), gemv.TileConfig(4, 64, 8),
                                    gemv.TileConfig(4, 64, 4, thread_sum=8)], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 20, 100), (2, 40, 96)])
def test_linear_gemv_slices_match_reference(variant, rows, out_features, in_features, config):
    """Short K slices: several a row, the last one partial; output tiles past the last row; runs of
    columns summed per thread before they accumulate."""
    check(variant, rows, out_features, in_features, torch.float32, seed=7 * rows + in_features, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features,config", [
    (1, 48, 80, None), (1, 20, 1100, None), (3, 40, 96, None), (2, 40, 100, gemv.TileConfig(8, 32, 4)),
    (1, 24, 200, gemv.TileConfig(4, 64, 4, thread_sum=16))])
def test_fp8_weights_match_a_float64_product_of_the_dequantised_weights(variant, rows, out_features, in_features,
                                                                       config, dtype):
    """W8A16: FP8 codes widened in registers, each product scaled by its row's scale, against the
    float64 product of codes x scales; odd widths, several K slices with a partial last one."""
    check(variant, rows, out_features, in_features, dtype, seed=3 * rows + in_features, config=config,
          fp8_weight=True)


@pytest.mark.parametrize("thread_sum", [0, 3, 128])
def test_tile_thread_sum_must_be_a_power_of_two_dividing_the_slice(thread_sum):
    with pytest.raises(ValueError, match="thread_sum must be a power of two dividing block_k 64"):
        gemv.TileConfig(4, 64, 4, thread_sum=thread_sum)


def test_fp8_weights_need_their_scales():
    x = torch.randn(1, 64, device=DEVICE)
    codes, scale = quantize_per_channel(torch.randn(32, 64, device=DEVICE))
    with pytest.raises(ValueError, match="FP8 weight needs weight_scale"):
        gemv.linear_gemv(x, codes)
    with pytest.raises(ValueError, match="only an FP8 weight takes one"):
        gemv.linear_gemv(x, torch.randn(32, 64, device=DEVICE), weight_scale=scale)
    with pytest.raises(ValueError, match="one scale per weight row"):
        gemv.linear_gemv(x, codes, weight_scale=scale[:16])
    with pytest.raises(ValueError, match="one scale per weight row"):
        gemv.linear_gemv(x, codes, weight_scale=scale.double())


@pytest.mark.parametrize("variant", ["norm", "norm_silu"])
def test_norm_rows_longer_than_one_load(variant, monkeypatch):
    """Rows longer than the sum of squares loads at once (the cap lowered to 16 elements): its loop runs
    several times, the last load partial."""
    monkeypatch.setattr(gemv, "_MAX_NORM_BLOCK", 16)
    assert gemv.norm_block(100) == 16
    check(variant, 2, 40, 100, torch.float32, seed=31, config=gemv.TileConfig(8, 32, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_features,in_features", [
    (3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048),  # Llama-3.2-1B QKV, O, down, gate/up
    (6144, 4096), (4096, 4096), (4096, 14336),  # Llama-3-8B QKV, O, down
    (960, 576), (3072, 576), (1000, 1100),  # SmolLM2 QKV, gate/up; odd sizes
])
def test_linear_gemv_grid_gpu(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype, seed=rows * out_features + in_features)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_features,in_features", [
    (3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048),  # Llama-3.2-1B QKV, O, down, gate/up
    (6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096),  # Llama-3-8B QKV, O, down, gate/up
    (960, 576), (3072, 576), (576, 1536), (1000, 1100),  # SmolLM2 QKV, gate/up, down; odd sizes
])
def test_fp8_weights_grid_gpu(variant, out_features, in_features, dtype):
    check(variant, 1, out_features, in_features, dtype, seed=out_features + in_features, fp8_weight=True)


def test_linear_gemv_rejects_bad_shapes():
    x = _randn(2, 64, dtype=torch.float32, seed=0)
    weight = _randn(32, 64, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight"):
        gemv.linear_gemv(x, weight[:, :48].contiguous())
    with pytest.raises(ValueError, match="needs out"):
        gemv.linear_gemv(x, weight, epilogue=gemv.EPILOGUE_ADD_TO_OUT)
    with pytest.raises(ValueError, match="gate/up"):
        gemv.linear_gemv(x, weight[:31].contiguous(), epilogue=gemv.EPILOGUE_SILU_MUL)
    with pytest.raises(ValueError, match="norm weight"):
        gemv.linear_gemv(x, weight, norm_weight=x[0, :32].contiguous())
    with pytest.raises(ValueError, match="out"):
        gemv.linear_gemv(x, weight, out=torch.empty(2, 31, device=DEVICE))
    with pytest.raises(ValueError, match="share memory"):
        gemv.linear_gemv(x, torch.eye(64, device=DEVICE), epilogue=gemv.EPILOGUE_ADD_TO_OUT, out=x)
    with pytest.raises(ValueError, match="epilogue"):
        gemv.linear_gemv(x, weight, epilogue=7)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        gemv.linear_gemv(x, weight, torch.zeros(64, device=DEVICE)[::2])


# -- the GPU compiler's view, checked without a GPU -----------------------------------------------------


def _sm90_cases():
    """Every launch specialisation linear_gemv makes: the general tile at the largest K slice, bf16
    and fp32, each variant, launched plainly and as a dependent; every measured tile (16-bit and FP8
    weights) with the epilogues it serves, as the decode path launches it on sm_90 (a dependent)."""
    from sm90_compile import gemv_case

    cases = []
    for dtype, variant, pdl in itertools.product(["bf16", "fp32"], ["bias", "norm", "norm_silu", "add"], [False, True]):
        config = gemv.general_config(8192, variant == "norm_silu")
        cases.append(gemv_case(f"{variant}-{dtype}{'-dependent' if pdl else ''}", dtype, variant, config, pdl, 8192))
    for variant, pdl in itertools.product(["bias", "norm", "norm_silu", "add"], [False, True]):
        config = gemv.general_config(8192, variant == "norm_silu", element_size=1)
        cases.append(gemv_case(f"{variant}-bf16-fp8-weight{'-dependent' if pdl else ''}", "bf16", variant, config,
                               pdl, 8192, fp8_weight=True))
    for table, fp8 in ((gemv.MEASURED_TILES, False), (gemv.MEASURED_FP8_TILES, True)):
        for (rows, in_features, silu), config in table.items():
            for variant in ["norm_silu"] if silu else ["norm", "add"]:
                cases.append(gemv_case(f"{variant}-bf16-{'fp8-' if fp8 else ''}{rows}x{in_features}-dependent", "bf16",
                                       variant, config, True, in_features, fp8_weight=fp8))
    return cases


def test_gemv_kernel_compiles_for_sm90():
    """Every launch specialisation compiles for the H200 and fits its shared memory (the interpreter
    checks neither)."""
    from sm90_compile import H200_SHARED_MEMORY, compile_for_sm90

    cases = _sm90_cases()
    results = compile_for_sm90(cases)
    problems = {case["name"]: result for case, result in zip(cases, results)
                if "error" in result or result["shared"] > H200_SHARED_MEMORY}
    assert not problems, problems


# -- which models take the GEMV layers ---------------------------------------------------------------------


def test_measured_tiles_apply_to_16_bit_weights_of_their_shape_only():
    assert gemv.default_config(2048, 2048, False, 2) == gemv.TileConfig(8, 2048, 8)
    assert gemv.default_config(2048, 2048, False, 4) == gemv.TileConfig(8, 1024, 8)  # fp32: the general rule
    assert gemv.default_config(2048, 16384, True, 2) == gemv.TileConfig(16, 256, 4)
    assert gemv.default_config(2048, 16384, False, 2) == gemv.TileConfig(8, 1024, 8)  # not as SiLU * up
    assert gemv.default_config(100, 20) == gemv.TileConfig(8, 128, 8)
    assert gemv.default_config(2048, 2048, False, 1) == gemv.TileConfig(4, 2048, 4, 16)  # FP8: the general FP8 tile
    assert gemv.default_config(2048, 16384, True, 1) == gemv.TileConfig(8, 1024, 4, 8)  # FP8: measured
    assert gemv.default_config(2048, 16384, False, 1) == gemv.TileConfig(4, 2048, 4, 16)  # not as SiLU * up
    assert gemv.default_config(576, 960, False, 1) == gemv.TileConfig(4, 1024, 4, 8)
    assert gemv.default_config(48, 64, False, 1) == gemv.TileConfig(4, 64, 4, 1)


@pytest.mark.parametrize("preset,plain,dependent", [("tiny", 4, 4), ("smollm2-135m", 4, 4), ("llama-3.2-1b", 1, 1),
                                                    ("llama-3-8b", 0, 1)])
def test_models_take_gemv_layers_where_they_were_measured_faster(preset, plain, dependent):
    """One-token forwards run the GEMV layers where they measured faster than cuBLAS: launched plainly,
    for layers up to GEMV_THRESHOLDS.max_layer_bytes (SmolLM2's 7 MB and the 1B's 122 MB, not the 8B's 436 MB); as
    dependent launches, at every measured size; forwards of up to 4 tokens too for 16-bit layers of at most
    small_layer_bytes (SmolLM2's, tiny's; not the 1B's). Unfused models never do."""
    from graphrt.attention.reference import ReferenceAttentionBackend
    from graphrt.loader.random_presets import PRESETS
    from graphrt.models.llama import LlamaForCausalLM

    def build(fused, dependent_launch=False):  # on the meta device: shapes only, no memory
        return LlamaForCausalLM(PRESETS[preset], ReferenceAttentionBackend, 64, torch.bfloat16, "meta",
                                fused_kernels=fused, dependent_launch=dependent_launch)

    assert build(True).kernel_policy.gemv_max_tokens == plain
    assert build(True, dependent_launch=True).kernel_policy.gemv_max_tokens == dependent
    assert build(False).kernel_policy.gemv_max_tokens == 0
    with pytest.raises(ValueError, match="dependent_launch needs fused_kernels"):
        build(False, dependent_launch=True)
