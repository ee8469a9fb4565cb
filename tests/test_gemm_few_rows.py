"""The few-rows tensor-core kernel (graphrt.kernels.gemm_few_rows) against the float64 reference of
tests/test_gemv.py: the unfused layer arithmetic, the GEMM in float64 rounded where ``F.linear`` rounds,
and the same per-element bound (a rounding or two of the product, carried through the epilogue).
Fresh random inputs; outputs poisoned with NaN before the kernel writes them. Small shapes on the CPU
under Triton's interpreter (products in float32 there), the models' shapes at 2-16 rows on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from graphrt.kernels import gemm_few_rows, gemv  # noqa: E402
from test_gemv import EPS, VARIANTS, _randn, allowed_error, reference  # noqa: E402
from triton_cpu import interpreted  # noqa: E402

gemm_few_rows = interpreted(gemm_few_rows, "_few_rows_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def check(variant, rows, out_features, in_features, dtype, seed=0, tile=None):
    out_width = out_features // 2 if variant == "norm_silu" else out_features
    x = _randn(rows, in_features, dtype=dtype, seed=seed, scale=2.0)
    weight = _randn(out_features, in_features, dtype=dtype, seed=seed + 1, scale=in_features**-0.5)
    bias = _randn(out_features, dtype=dtype, seed=seed + 2) if variant == "bias" else None
    norm_weight = _randn(in_features, dtype=dtype, seed=seed + 3) if variant.startswith("norm") else None
    residual = _randn(rows, out_width, dtype=dtype, seed=seed + 4) if variant == "add" else None
    expected, product, largest_term = reference(variant, x, weight, bias, norm_weight, residual)
    out = residual.clone() if variant == "add" else torch.full((rows, out_width), float("nan"), dtype=dtype,
                                                               device=DEVICE)
    epilogue = {"norm_silu": gemv.EPILOGUE_SILU_MUL, "add": gemv.EPILOGUE_ADD_TO_OUT}.get(variant, gemv.EPILOGUE_STORE)
    got = gemm_few_rows.linear_few_rows(x, weight, bias, norm_weight=norm_weight, eps=EPS, epilogue=epilogue,
                                        out=out, tile=tile)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was never written"
    excess = (got.double() - expected.double()).abs() - allowed_error(variant, expected, product, largest_term,
                                                                       in_features, dtype)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
                               f"{divmod(worst, excess.shape[1])}: {got.flatten()[worst].item()} vs "
                               f"{expected.flatten()[worst].item()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,out_features,in_features", [(2, 48, 80), (5, 40, 300), (16, 64, 96), (1, 20, 40)])
def test_few_rows_match_reference(variant, rows, out_features, in_features, dtype):
    check(variant, rows, out_features, in_features, dtype, seed=rows + in_features)


@pytest.mark.parametrize("tile", [gemm_few_rows.FewRowsTile(16, 32, 4, 2), gemm_few_rows.FewRowsTile(64, 64, 8, 3)],
                         ids=str)
def test_slices_and_partial_tiles(tile):
    """K in several slices with a partial last one; outputs past the last row of W; 7 rows of 16."""
    for variant in VARIANTS:
        check(variant, 7, 40, 100, torch.float32, seed=11, tile=tile)


def test_rejects_too_many_rows():
    x = _randn(17, 32, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="17 rows exceed"):
        gemm_few_rows.linear_few_rows(x, _randn(16, 32, dtype=torch.float32, seed=1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [2, 8, 16])
@pytest.mark.parametrize("out_features,in_features", [(3072, 2048), (2048, 8192), (16384, 2048), (960, 576),
                                                      (576, 1536), (1000, 1100)])
def test_model_shapes_gpu(variant, rows, out_features, in_features, dtype):
    if variant == "norm_silu" and out_features % 2:
        pytest.skip("gate/up weights have an even row count")
    check(variant, rows, out_features, in_features, dtype, seed=rows * 7 + in_features)
