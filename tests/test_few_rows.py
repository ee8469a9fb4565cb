"""The few-rows tensor-core kernel (graphrt.kernels.few_rows) against a float64 torch reference.

The reference runs the kernel's chosen arithmetic in float64: with the norm, x times the norm weight
rounded to the model dtype (where the kernel rounds it), the product, then each row's 1 / rms of x;
then the rounding of the product to the model dtype as ``F.linear`` rounds it, and SiLU * up or the
residual add as the torch ops round them. The kernel sums in float32, so a result may sit one rounding
of the model dtype away. A second check holds the normalised products to the unfused ops
(``rms_norm_torch`` then the product) within the bf16 error both roundings leave. Fresh random
inputs; outputs poisoned with NaN before the kernel writes them. Small shapes on the CPU under
Triton's interpreter, the models' shapes on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from graphrt.kernels import few_rows, gemv  # noqa: E402
from graphrt.models.layers import rms_norm_torch, silu_and_mul_torch  # noqa: E402
from triton_cpu import interpreted  # noqa: E402

few_rows = interpreted(few_rows, "_few_rows_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-5
#: silu_add: the down projection's form, SiLU * up on a [M, 2 * K] gate/up input, the residual add after.
VARIANTS = ["plain", "bias", "norm", "norm_silu", "add", "silu_add"]
EPILOGUES = {"norm_silu": gemv.EPILOGUE_SILU_MUL, "add": gemv.EPILOGUE_ADD_TO_OUT, "silu_add": gemv.EPILOGUE_ADD_TO_OUT}

#: One rounding of each dtype, relative (float32: the float32 sums against float64's).
UNIT = {torch.float32: 2**-17, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _operands(variant, rows, out_features, in_features, dtype, seed):
    x = _randn(rows, in_features * (2 if variant == "silu_add" else 1), dtype=dtype, seed=seed, scale=2.0)
    weight = _randn(out_features, in_features, dtype=dtype, seed=seed + 1, scale=in_features**-0.5)
    bias = _randn(out_features, dtype=dtype, seed=seed + 2) if variant == "bias" else None
    norm_weight = _randn(in_features, dtype=dtype, seed=seed + 3) if variant.startswith("norm") else None
    out_width = out_features // 2 if variant == "norm_silu" else out_features
    residual = _randn(rows, out_width, dtype=dtype, seed=seed + 4) if variant.endswith("add") else None
    return x, weight, bias, norm_weight, residual


def _run(variant, x, weight, bias, norm_weight, residual, tile=None, dtype=None):
    rows = x.shape[0]
    out_width = weight.shape[0] // 2 if variant == "norm_silu" else weight.shape[0]
    out = residual.clone() if residual is not None else torch.full((rows, out_width), float("nan"), dtype=x.dtype,
                                                                   device=DEVICE)
    got = few_rows.linear_few_rows(x, weight, bias, norm_weight=norm_weight, eps=EPS,
                                   epilogue=EPILOGUES.get(variant, gemv.EPILOGUE_STORE), out=out, tile=tile,
                                   silu_input=variant == "silu_add")
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was never written"
    return got


def _epilogue(variant, product, residual):
    if variant == "norm_silu":
        return silu_and_mul_torch(product)
    return residual + product if variant.endswith("add") else product


def reference(variant, x, weight, bias, norm_weight, residual):
    """The kernel's arithmetic in float64, rounded where it rounds. Returns (expected output, the rounded
    product, the sum of its terms' magnitudes, the largest term), all [M, N_w] but the output."""
    dtype = x.dtype
    if variant == "silu_add":
        x = silu_and_mul_torch(x)
    inputs = x.double()
    scale = 1.0
    if norm_weight is not None:
        inputs = (x.float() * norm_weight.float()).to(dtype).double()
        scale = torch.rsqrt(x.double().pow(2).mean(dim=1, keepdim=True) + EPS)
    product = (inputs @ weight.double().T) * scale
    terms = (inputs.abs() @ weight.double().abs().T) * scale
    largest_term = inputs.abs().amax(dim=1, keepdim=True) * weight.double().abs().amax(dim=1)[None, :] * scale
    if bias is not None:
        product += bias.double()
    product = product.to(dtype)
    return _epilogue(variant, product, residual), product, terms, largest_term


def allowed_error(variant, expected, product, terms, largest_term, dtype):
    """Per element: the product may sit a rounding or two away (float32 sums in another order, 1 / rms in
    float32, then the rounding to the model dtype); through a residual sum unchanged, through SiLU *
    up amplified by ``1 + |gate|``; near zero the float32 sums' own error, relative to the largest
    product and, for 16-bit dots on tensor cores, whose adders keep fewer bits than float32's, to the
    sum of the terms' magnitudes (``terms``: [M, N_w]; measured on the H200: 8e-6 on a product of
    0.0075 whose 8,192 terms summed to ~140 in magnitude)."""
    unit = UNIT[dtype]
    floor = (unit if dtype == torch.float32 else 2**-20) * product.double().abs().max() + 1e-6
    accumulated = 2**-22 * terms if dtype != torch.float32 else torch.zeros_like(terms)
    if variant == "norm_silu":  # each half's accumulation error, through silu(gate) * up (|silu'| <= 1.1)
        half = product.shape[1] // 2
        gate, up = product[:, :half].double(), product[:, half:].double()
        floor = floor + 1.1 * accumulated[:, :half] * up.abs() + accumulated[:, half:] * torch.nn.functional.silu(gate).abs()
        return 2 * unit * expected.double().abs() * (3 + gate.abs()) + floor
    floor = floor + accumulated
    if variant == "silu_add" and dtype != torch.float32:
        # The GPU's exp may round silu(gate) to the other neighbour for a few inputs (as the unfused
        # kernel's may), each moving the product by a rounding of its term: four allowed, the largest.
        floor = floor + 4 * unit * largest_term
    return 2 * unit * (expected.double().abs() + product.double().abs()) + floor


def check(variant, rows, out_features, in_features, dtype, seed=0, tile=None):
    x, weight, bias, norm_weight, residual = _operands(variant, rows, out_features, in_features, dtype, seed)
    got = _run(variant, x, weight, bias, norm_weight, residual, tile)
    expected, product, terms, largest_term = reference(variant, x, weight, bias, norm_weight, residual)
    excess = (got.double() - expected.double()).abs() - allowed_error(variant, expected, product, terms, largest_term,
                                                                      dtype)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
                               f"{divmod(worst, excess.shape[1])}: {got.flatten()[worst].item()} vs "
                               f"{expected.flatten()[worst].item()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(2, 48, 80), (3, 40, 300), (16, 20, 96), (1, 64, 64)])
def test_linear_few_rows_matches_reference(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype, seed=rows + in_features)


@pytest.mark.parametrize("tile", [few_rows.FewRowsTile(16, 32, 4, 2), few_rows.FewRowsTile(32, 64, 8, 3)], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_linear_few_rows_slices_match_reference(variant, tile):
    """Short K slices: several a row, the last one partial; an output tile past the last output."""
    check(variant, 5, 40, 100, torch.float32, seed=11, tile=tile)


def test_norm_after_products_is_as_accurate_as_the_unfused_ops():
    """Against the exact norm and product (float64 throughout), the kernel's error is no larger than
    the unfused ops' (``rms_norm_torch``'s roundings, then the product, rounded): it rounds ``g * x``
    where they round ``x / rms`` and ``g * (x / rms)``, one rounding of the model dtype against two.
    The comparison is of largest and mean errors, with a quarter's margin."""
    rows, out_features, in_features, dtype = 8, 64, 512, torch.bfloat16
    x, weight, _, norm_weight, _ = _operands("norm", rows, out_features, in_features, dtype, seed=5)
    got = _run("norm", x, weight, None, norm_weight, None).double()
    exact = rms_norm_torch(x.double(), norm_weight.double(), EPS) @ weight.double().T
    unfused = (rms_norm_torch(x, norm_weight, EPS).double() @ weight.double().T).to(dtype).double()
    ours, theirs = (got - exact).abs(), (unfused - exact).abs()
    assert ours.max() <= 1.25 * theirs.max()
    assert ours.mean() <= 1.25 * theirs.mean()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [3, 8, 16])
@pytest.mark.parametrize("out_features,in_features", [
    (3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048),  # Llama-3.2-1B QKV, O, down, gate/up
    (6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096),  # Llama-3-8B QKV, O, down, gate/up
    (960, 576), (1000, 1100),  # SmolLM2 QKV; odd sizes
])
def test_linear_few_rows_grid_gpu(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype, seed=rows * out_features + in_features)


def test_linear_few_rows_rejects_bad_input():
    gate_up = _randn(2, 96, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="silu_input needs x"):
        few_rows.linear_few_rows(gate_up[:, :64].contiguous(), _randn(32, 64, dtype=torch.float32, seed=1),
                                 silu_input=True)
    with pytest.raises(ValueError, match="do not combine"):
        few_rows.linear_few_rows(gate_up, _randn(32, 48, dtype=torch.float32, seed=1), silu_input=True,
                                 norm_weight=gate_up[0, :48].contiguous())
    x = _randn(17, 64, dtype=torch.float32, seed=0)
    weight = _randn(32, 64, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="17 rows exceed the 16"):
        few_rows.linear_few_rows(x, weight)
    with pytest.raises(ValueError, match="needs out"):
        few_rows.linear_few_rows(x[:2], weight, epilogue=gemv.EPILOGUE_ADD_TO_OUT)
    with pytest.raises(ValueError, match="weight"):
        few_rows.linear_few_rows(x[:2], weight[:, :48].contiguous())


def test_default_tile_fits_short_rows():
    assert few_rows.default_tile(80, 48) == few_rows.FewRowsTile(16, 128, 4, 3)
    assert few_rows.default_tile(4096, 4096, element_size=4) == few_rows.DEFAULT_TILE


def test_few_rows_kernel_compiles_for_sm90():
    """Every launch specialisation the decode path makes compiles for the H200, fits its shared memory,
    and, launched as a dependent, requests weights before its wait (the interpreter checks none of it)."""
    from sm90_compile import H200_SHARED_MEMORY, compile_for_sm90, few_rows_case

    cases = []
    for dtype in ("bf16", "fp32"):
        for variant in VARIANTS:
            cases.append(few_rows_case(f"{variant}-{dtype}-dependent", dtype, variant, few_rows.DEFAULT_TILE, True))
    for (weight_rows, in_features, silu), tile in few_rows.MEASURED_TILES.items():
        for variant in ["norm_silu"] if silu else ["norm", "add", "silu_add"]:
            cases.append(few_rows_case(f"{variant}-{weight_rows}x{in_features}", "bf16", variant, tile, True))
    results = compile_for_sm90(cases)
    problems = {case["name"]: result for case, result in zip(cases, results)
                if "error" in result or result["shared"] > H200_SHARED_MEMORY or not result["loads_before_wait"]}
    assert not problems, problems
