"""FP8 tensor-core products (graphrt.kernels.fp8_matmul): per-token activation quantisation against its
torch reference (bit for bit, the CPU interpreter or a GPU), and on a GPU the scaled product against
float64 references of the quantised operands (tight: the products of the same codes) and of the
unquantised activations (within half an E4M3 step per input). Fresh random inputs, odd row counts,
rows of widely different magnitudes, the models' shapes."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.kernels import fp8_matmul  # noqa: E402
from graphrt.models.fp8 import quantize_per_channel  # noqa: E402

fp8_matmul = interpreted(fp8_matmul, "_weight_rows_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _rows(rows: int, width: int, dtype, seed: int) -> torch.Tensor:
    """Rows of magnitudes 1e-3 to 100 (to 1 in float16, whose products would overflow otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 0 if dtype == torch.float16 else 2, rows)[:, None]
    return (torch.randn(rows, width, generator=generator) * magnitudes).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(1, 16), (3, 100), (5, 1500), (2, 2048), (64, 2048)])
def test_quantize_rows_equals_its_torch_reference(rows, width, dtype):
    """Bit for bit, ties included: at 64 rows of 2048 some quotients fall on a tie between two codes,
    where a scale off by one unit (torch on CUDA divides by a number through its reciprocal) flips it."""
    x = _rows(rows, width, dtype, seed=rows * width)
    x[0, :3] = 0.0  # zeros stay zeros
    codes, scales = fp8_matmul.quantize_rows(x)
    expected_codes, expected_scales = fp8_matmul.quantize_rows_torch(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    # Every row's largest magnitude maps onto 448 and comes back within half an E4M3 step.
    assert (codes.float().abs().amax(dim=1) == 448).all()
    back = codes.float() * scales[:, None]
    assert ((back - x.float()).abs() <= x.float().abs() * 2**-4 + scales[:, None] * 2**-10).all()


def test_quantize_rows_gives_a_zero_row_the_smallest_scale():
    codes, scales = fp8_matmul.quantize_rows(torch.zeros(2, 32, device=DEVICE))
    assert torch.equal(scales, torch.full((2,), fp8_matmul.MIN_SCALE, device=DEVICE))
    assert codes.float().abs().sum() == 0


def check_w8a16(rows, out_features, in_features, dtype, bias, tile=None):
    x = _rows(rows, in_features, dtype, seed=rows * in_features + out_features)
    weight = torch.randn(out_features, in_features, device=DEVICE) * torch.logspace(-2, 1, out_features,
                                                                                    device=DEVICE)[:, None]
    codes, scale = quantize_per_channel(weight)
    bias_vector = torch.randn(out_features, device=DEVICE).to(dtype) if bias else None
    got = fp8_matmul.w8a16_matmul(x, codes, scale, bias_vector, tile=tile)
    assert_one_rounding_of_exact_products(got, x, codes.double() * scale.double()[:, None], bias_vector)


def assert_one_rounding_of_exact_products(got, x, real_weight, bias_vector):
    """``got`` [rows, out] is ``x @ real_weight^T + bias`` (float64 of the exact operands) rounded once to
    x's dtype (half a subnormal step below its smallest normal), after float32 sums of the exact products
    in any order."""
    dtype = x.dtype
    assert got.dtype == dtype and got.shape == (x.shape[0], real_weight.shape[0]) and not got.isnan().any()
    expected = x.double() @ real_weight.T + (0 if bias_vector is None else bias_vector.double())
    terms = x.double().abs() @ real_weight.abs().T
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-11 if dtype == torch.float16 else 2**-20
    subnormal = unit * torch.finfo(dtype).smallest_normal
    assert ((got.double() - expected).abs() <= unit * expected.abs() + 2**-20 * terms + subnormal).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,out_features,in_features,tile", [
    (1, 48, 80, None), (3, 40, 300, None), (17, 32, 64, None),
    (20, 50, 70, fp8_matmul.RowsTile(16, 16, 32, 4, 2)),  # several row and column tiles, partial K slices
    (20, 64, 96, fp8_matmul.RowsTile(16, 32, 32, 4, 2)),  # tiles dividing both widths: unmasked weight loads
    (20, 50, 230, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3)),  # split K: 8 slices in splits of 3, 3, 2
    (3, 64, 96, fp8_matmul.RowsTile(16, 32, 32, 4, 2, split_k=4)),  # 3 slices: 3 splits of one, unmasked
    # Weights through TMA: partial column tiles, split K; then rows TMA cannot address (230 bytes apart),
    # which take the plain loads (test_rows_kernel_reads_through_tma_only_where_it_can).
    (20, 50, 96, fp8_matmul.RowsTile(16, 16, 32, 4, 2, tma=True)),
    (20, 50, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3, tma=True)),
    (5, 50, 230, fp8_matmul.RowsTile(16, 16, 32, 4, 2, tma=True)),
])
def test_w8a16_matmul_against_float64(rows, out_features, in_features, tile, bias, dtype):
    """Codes widened exactly, float32 sums, scaled per column, one rounding: against the float64
    product of the dequantised weights (no activation quantisation)."""
    check_w8a16(rows, out_features, in_features, dtype, bias, tile)


def check_rows_matmul(rows, out_features, in_features, dtype, bias, tile=None):
    """16-bit weights on the rows kernel against the float64 product (no NaN left: every element written)."""
    x = _rows(rows, in_features, dtype, seed=3 * rows + in_features)
    generator = torch.Generator().manual_seed(out_features * in_features)
    weight = (torch.randn(out_features, in_features, generator=generator)
              * torch.logspace(-2, 0, out_features)[:, None]).to(dtype).to(DEVICE)
    bias_vector = torch.randn(out_features, generator=generator).to(dtype).to(DEVICE) if bias else None
    got = fp8_matmul.rows_matmul(x, weight, bias_vector, tile=tile)
    assert_one_rounding_of_exact_products(got, x, weight.double(), bias_vector)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,out_features,in_features,tile", [
    (2, 48, 80, None), (5, 40, 300, None), (17, 32, 64, None),
    (20, 50, 70, fp8_matmul.RowsTile(16, 16, 32, 4, 2)),  # several row and column tiles, partial K slices
    (20, 64, 96, fp8_matmul.RowsTile(16, 32, 32, 4, 2)),  # unmasked weight loads
    (20, 50, 230, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3)),  # split K: 8 slices in splits of 3, 3, 2
    (20, 50, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3, tma=True)),  # through TMA, split
    (5, 50, 115, fp8_matmul.RowsTile(16, 16, 32, 4, 2, tma=True)),  # rows 230 bytes apart: plain loads
])
def test_rows_matmul_of_16bit_weights_against_float64(rows, out_features, in_features, tile, bias, dtype):
    """Products of 16-bit values are exact in float32: float32 sums in any order, one rounding."""
    check_rows_matmul(rows, out_features, in_features, dtype, bias, tile)


_NORM_TILES = [
    (5, 40, 300, None),
    (20, 50, 230, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3)),  # split K: every split reads whole rows
    (20, 50, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3, tma=True)),  # through TMA
    (3, 64, 96, fp8_matmul.RowsTile(16, 32, 32, 4, 2)),  # unmasked loads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,out_features,in_features,tile", _NORM_TILES)
def test_rows_matmul_norm_prologue_against_float64(rows, out_features, in_features, tile, dtype):
    """x is the residual stream, RMS-normalised in the kernel: the float64 product of the rows as
    rms_norm_torch rounds them, within one rounding, float32 sums in any order, and a few normalised
    inputs moved by a rounding each (1 / rms summed in another order); and, 16-bit, against the same
    tile's product of rms_norm_torch's rows, the same bits but for a few elements (where 1 / rms differs in its
    last bit and moves a normalised input by a rounding; without the kernel's rounding of the normalised
    rows most elements would differ)."""
    from graphrt.models.layers import rms_norm_torch

    x = _rows(rows, in_features, dtype, seed=rows + in_features) * 3.0
    generator = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(dtype).to(DEVICE)
    norm_weight = (torch.rand(in_features, generator=generator) + 0.5).to(dtype).to(DEVICE)
    got = fp8_matmul.rows_matmul(x, weight, tile=tile, norm_weight=norm_weight, eps=1e-5)
    normed = rms_norm_torch(x, norm_weight, 1e-5)
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 2**-20)
    expected = normed.double() @ weight.double().T
    terms = normed.double().abs() @ weight.double().abs().T
    largest = normed.double().abs().amax(1, keepdim=True) * weight.double().abs().amax(1)[None, :]
    assert got.shape == expected.shape and not got.isnan().any()
    bound = unit * expected.abs() + 2**-20 * terms + unit * (4 + in_features // 1024) * largest + 1e-30
    assert ((got.double() - expected).abs() <= bound).all()
    if dtype != torch.float32:  # in float32 a last bit of 1 / rms reaches every normalised input
        same_tile = fp8_matmul.rows_matmul(normed, weight, tile=tile)
        assert int((got != same_tile).sum()) <= max(1, got.numel() // 100)


@pytest.mark.parametrize("kind", ["w16", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,out_features,in_features,tile", _NORM_TILES)
def test_rows_matmul_residual_epilogue_is_the_product_added(rows, out_features, in_features, tile, dtype, kind):
    """residual += product in the epilogue (16-bit weights, or FP8 codes on W8A16): the bits of a torch add
    of the same tile's rounded product, into the tensor passed (every element of it updated)."""
    x = _rows(rows, in_features, dtype, seed=2 * rows + in_features)
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(dtype).to(DEVICE)
    bias = torch.randn(out_features, generator=generator).to(dtype).to(DEVICE)
    residual = _rows(rows, out_features, dtype, seed=7) * 4.0
    if kind == "w16":
        product = functools.partial(fp8_matmul.rows_matmul, x, weight, bias, tile=tile)
    else:
        product = functools.partial(fp8_matmul.w8a16_matmul, x, *quantize_per_channel(weight), bias, tile=tile)
    expected = residual + product()
    got = product(residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    assert torch.equal(got, expected)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,out_features,in_features", [
    (5, 3072, 2048), (8, 16384, 2048), (5, 2048, 2048), (16, 2048, 8192),  # Llama-3.2-1B QKV, gate/up, O, down
    (8, 6144, 4096), (2, 4096, 14336),  # Llama-3-8B QKV, down
])
def test_norm_prologue_and_residual_epilogue_at_model_shapes_gpu(rows, out_features, in_features, dtype):
    """The models' shapes at their default tiles (split K, TMA up to 16 tokens on sm_90+): the prologue
    against float64 and the same tile's product of rms_norm_torch's rows, the epilogue bit for bit."""
    test_rows_matmul_norm_prologue_against_float64(rows, out_features, in_features, None, dtype)
    for kind in ("w16", "w8a16"):
        test_rows_matmul_residual_epilogue_is_the_product_added(rows, out_features, in_features, None, dtype, kind)


def test_rows_matmul_refuses_a_bad_norm_weight_or_residual():
    x = _rows(3, 64, torch.bfloat16, seed=1)
    weight = torch.randn(32, 64, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_matmul.rows_matmul(x, weight, norm_weight=torch.ones(63, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm weight"):
        fp8_matmul.rows_matmul(x, weight, norm_weight=torch.ones(64, device=DEVICE))  # float32 against bf16 rows
    with pytest.raises(ValueError, match="residual"):
        fp8_matmul.rows_matmul(x, weight, residual=torch.zeros(3, 31, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one at a time"):
        fp8_matmul.rows_matmul(x, weight, silu_mul=True, residual=torch.zeros(3, 16, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows apart"):  # overlapping rows: programs would race
        fp8_matmul.rows_matmul(x, weight, residual=torch.zeros(1, 32, device=DEVICE, dtype=torch.bfloat16).expand(3, 32))
    with pytest.raises(ValueError, match="share memory"):
        square = torch.randn(64, 64, device=DEVICE).to(torch.bfloat16)
        fp8_matmul.rows_matmul(x, square, residual=x)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,out_features,in_features", [
    (2, 3072, 2048), (5, 2048, 2048), (8, 16384, 2048), (16, 2048, 8192), (5, 4096, 14336), (7, 6144, 4096),
    (64, 2048, 2048), (9, 200, 576),
])
def test_rows_matmul_of_16bit_weights_against_float64_gpu(rows, out_features, in_features, dtype):
    """The models' shapes at their default tiles (split K, TMA up to 16 tokens on sm_90+), and an odd one."""
    check_rows_matmul(rows, out_features, in_features, dtype, bias=False)


def _silu_mul_operands(kind: str, rows: int, intermediate: int, in_features: int, dtype, seed: int):
    """x, the product's arguments and the exact float64 (gate, up) products for a SiLU * up check."""
    x = _rows(rows, in_features, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(2 * intermediate, in_features, generator=generator) * in_features**-0.5).to(DEVICE)
    if kind == "w16":
        weight = weight.to(dtype)
        args, real_x, real_w = (x, weight), x.double(), weight.double()
    else:
        codes, scale = quantize_per_channel(weight)
        real_w = codes.double() * scale.double()[:, None]
        args, real_x = (x, codes, scale), x.double()
        if kind == "fp8":
            x_codes, x_scales = fp8_matmul.quantize_rows_torch(x)
            real_x = x_codes.double() * x_scales.double()[:, None]
    products, terms = real_x @ real_w.T, real_x.abs() @ real_w.abs().T
    return args, products[:, :intermediate], products[:, intermediate:], terms[:, :intermediate], terms[:, intermediate:]


_SILU_FUNCTIONS = {"w16": "rows_matmul", "w8a16": "w8a16_matmul", "fp8": "scaled_mm"}


@pytest.mark.parametrize("kind", list(_SILU_FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,intermediate,in_features,tile", [
    (5, 40, 96, fp8_matmul.RowsTile(16, 16, 32, 4, 2)),  # a partial column tile: gate rows past I masked
    (3, 64, 96, fp8_matmul.RowsTile(16, 32, 32, 4, 2)),  # unmasked loads
    (20, 40, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=3)),  # split K (3, 3, 1 slices): gate and up partials
    (5, 48, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=2, tma=True)),  # through TMA: the up box N rows on
    (5, 40, 224, fp8_matmul.RowsTile(16, 16, 32, 4, 2, tma=True)),  # TMA's last gate box runs into the up rows
])
def test_silu_mul_epilogue_equals_the_product_then_silu_and_mul(kind, rows, intermediate, in_features, tile, dtype):
    """The same tile's sums either way: the fused epilogue writes silu_and_mul's bits of the unfused product
    (poisoned outputs: every element written); and both lie within rounding of the float64 silu(gate) * up."""
    from graphrt.kernels.activation import silu_and_mul

    activation = interpreted(__import__("graphrt.kernels.activation", fromlist=["x"]), "_silu_and_mul_kernel")
    args, gate, up, gate_terms, up_terms = _silu_mul_operands(kind, rows, intermediate, in_features, dtype,
                                                              seed=rows + intermediate)
    function = getattr(fp8_matmul, _SILU_FUNCTIONS[kind])
    fused = function(*args, tile=tile, silu_mul=True)
    unfused = function(*args, tile=tile)
    assert fused.shape == (rows, intermediate) and fused.dtype == dtype
    assert torch.equal(fused, activation.silu_and_mul(unfused)), (fused - silu_and_mul(unfused)).abs().max()
    expected = torch.nn.functional.silu(gate) * up
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-20
    # Rounded gate (silu's slope at most 1.1), rounded silu and up, rounded product; float32 sums in any
    # order (2**-20 of the terms' absolute sum), moving gate and up before they are rounded.
    gate_error = unit * gate.abs() + 2**-20 * gate_terms
    silu = torch.nn.functional.silu(gate).abs()
    bound = (1.1 * gate_error * (up.abs() + unit * up.abs() + 2**-20 * up_terms)
             + silu * (2 * unit * up.abs() + 2**-20 * up_terms) + unit * silu * up.abs()) * 1.01 + 1e-30
    assert ((fused.double() - expected).abs() <= bound).all()


def test_silu_mul_refuses_an_odd_weight_a_short_bias_and_too_many_rows():
    weight = torch.randn(33, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate and up rows alike"):
        fp8_matmul.rows_matmul(x, weight, silu_mul=True)
    odd_codes, odd_scale = quantize_per_channel(torch.randn(33, 64))
    with pytest.raises(ValueError, match="gate and up rows alike"):
        fp8_matmul.w8a16_matmul(x, odd_codes.to(DEVICE), odd_scale.to(DEVICE), silu_mul=True)
    with pytest.raises(ValueError, match="bias must be a contiguous \\[64\\]"):  # [2 * I], gate's then up's
        fp8_matmul.rows_matmul(x, weight[:32].repeat(2, 1), torch.zeros(32, device=DEVICE, dtype=torch.bfloat16),
                               silu_mul=True)
    codes, scale = quantize_per_channel(torch.randn(64, 64))
    rows = fp8_matmul.TRITON_MAX_ROWS + 1
    with pytest.raises(ValueError, match="silu_mul takes at most"):
        fp8_matmul.scaled_mm(torch.randn(rows, 64, device=DEVICE), codes.to(DEVICE), scale.to(DEVICE), silu_mul=True)


def test_rows_matmul_refuses_mismatched_operands():
    weight = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        fp8_matmul.rows_matmul(torch.randn(3, 64, device=DEVICE), weight)  # float32 rows, bfloat16 weight
    with pytest.raises(ValueError, match="does not match"):
        fp8_matmul.rows_matmul(torch.randn(3, 48, device=DEVICE, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="16-bit or float32"):
        fp8_matmul.rows_matmul(torch.randn(3, 64, device=DEVICE), weight.to(fp8_matmul.FP8_DTYPE))
    with pytest.raises(ValueError, match="16-bit or float32"):
        fp8_matmul.rows_matmul(torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16), weight.t())
    with pytest.raises(ValueError, match="bias"):
        fp8_matmul.rows_matmul(torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16), weight,
                               torch.randn(31, device=DEVICE, dtype=torch.bfloat16))


def test_rows_tiles_pad_rows_to_16_and_take_at_most_64():
    assert fp8_matmul.rows_tile(1, 28672, 4096, 132) == fp8_matmul.RowsTile(16, 64, 256, 4, 4)
    assert fp8_matmul.rows_tile(33, 4096, 14336, 132).block_m == 64
    # Unsplit 64-token tiles: 128-code slices six deep.
    assert fp8_matmul.rows_tile(64, 28672, 4096, 132) == fp8_matmul.RowsTile(64, 64, 128, 4, 6)
    assert fp8_matmul.rows_tile(64, 4096, 4096, 132) == fp8_matmul.RowsTile(64, 64, 256, 4, 4, split_k=2)
    assert fp8_matmul.rows_tile(300, 4096, 14336, 132).block_m == 64
    assert fp8_matmul.rows_tile(8, 48, 80, 132).block_k == 128  # K slices no longer than the row (at least 32)


def test_rows_tiles_split_k_where_programs_would_leave_multiprocessors_idle():
    """About two programs an SM with 16-token tiles, one with larger ones: on an H200 (132 SMs) at 8 rows
    the 8B's QKV (96 tiles of 64 rows) splits 2 ways, O and down (64 tiles) 4 ways, gate/up (448) not at
    all; at 64 rows the 1B's QKV (48 tiles) 2 ways, O and down (32) 4; a short row keeps two K slices a
    split; more tiles, fewer splits. W8A16 is the faster kernel where K splits 4 ways."""
    def split(rows, out_features, in_features, sms=132):
        return fp8_matmul.rows_tile(rows, out_features, in_features, sms).split_k

    assert [split(8, n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [2, 4, 1, 4]
    assert [split(64, n, k) for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))] == [2, 4, 1, 4]
    assert [fp8_matmul.w8a16_is_faster(fp8_matmul.rows_tile(8, n, k, 132))
            for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048))] == [
        False, True, False, True, True]
    assert not fp8_matmul.w8a16_is_faster(fp8_matmul.rows_tile(64, 4096, 4096, 132))  # 64 tokens a tile: 2 splits
    # Where the device reads through TMA, tiles of up to 16 tokens do; the kernel each takes is unchanged.
    for n, k in ((28672, 4096), (4096, 4096)):
        through_tma = [fp8_matmul.rows_tile(rows, n, k, 132, tma=True) for rows in (2, 8, 16, 17, 64)]
        assert [tile.tma for tile in through_tma] == [True, True, True, False, False]
        assert [fp8_matmul.w8a16_is_faster(tile) for tile in through_tma] == [
            fp8_matmul.w8a16_is_faster(fp8_matmul.rows_tile(rows, n, k, 132)) for rows in (2, 8, 16, 17, 64)]
    assert split(8, 960, 576) == 1 and split(8, 960, 1024) == 2  # 576 codes: three 256-code slices
    assert split(8, 64, 4096, sms=4) == 4 and split(8, 512, 4096, sms=4) == 1
    with pytest.raises(ValueError, match="split_k must be 1 to 4"):
        fp8_matmul.RowsTile(16, 64, 256, 4, 4, split_k=5)


#: The sums' error allowed relative to the terms: Hopper's FP8 tensor cores accumulate in fewer bits than
#: float32 between promotions to float32 (about 14); the CPU interpreter multiplies in float32.
FP8_ACCUMULATION = 2**-13 if CUDA else 2**-20


def check_scaled_mm(rows, out_features, in_features, bias, tile=None):
    """scaled_mm against float64 products of the same codes (the activations quantised by
    quantize_rows_torch) and against the unquantised activations (half an E4M3 step per input)."""
    accumulation = FP8_ACCUMULATION
    x = _rows(rows, in_features, torch.bfloat16, seed=rows + in_features)
    weight = torch.randn(out_features, in_features, device=DEVICE) * torch.logspace(-2, 1, out_features,
                                                                                    device=DEVICE)[:, None]
    codes, scale = quantize_per_channel(weight)
    bias_vector = torch.randn(out_features, device=DEVICE, dtype=torch.bfloat16) if bias else None
    got = fp8_matmul.scaled_mm(x, codes, scale, bias_vector, tile=tile)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features) and not got.isnan().any()
    real_weight = codes.double() * scale.double()[:, None]
    added = 0 if bias_vector is None else bias_vector.double()
    x_codes, x_scales = fp8_matmul.quantize_rows_torch(x)
    quantised = (x_codes.double() * x_scales.double()[:, None]) @ real_weight.T + added
    # The same codes' products and one bf16 rounding (twice with a bias through cuBLAS).
    terms = (x_codes.double().abs() * x_scales.double()[:, None]) @ real_weight.abs().T
    rounding = 2**-7 if bias else 2**-8
    allowed = rounding * (quantised.abs() + added.abs() if bias else quantised.abs()) + accumulation * terms
    excess = ((got.double() - quantised).abs() - allowed) / terms.clamp(min=1e-30)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} off; worst error "
                               f"{(got.double() - quantised).flatten()[worst].item():.3g} at terms "
                               f"{terms.flatten()[worst].item():.3g}, value {quantised.flatten()[worst].item():.3g}")
    # Against the unquantised activations: each input within half an E4M3 step (2**-4 relative).
    exact = x.double() @ real_weight.T + added
    assert ((got.double() - exact).abs() <= 2**-4 * terms + 2**-7 * exact.abs() + 1e-6).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,out_features,in_features,tile", [
    (1, 48, 80, None), (5, 32, 304, None), (20, 48, 64, fp8_matmul.RowsTile(16, 16, 32, 4, 2)),
    (20, 48, 208, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=4)),  # split K, partial last slice
    # The same through TMA: the last K slice's codes past the row zero-filled (NaN codes there would show).
    (20, 48, 208, fp8_matmul.RowsTile(16, 16, 32, 4, 2, split_k=4, tma=True))])
def test_scaled_mm_rows_kernel_against_float64(rows, out_features, in_features, tile, bias):
    """Up to TRITON_MAX_ROWS rows scaled_mm is the quantisation launch and the Triton kernel (on the CPU
    in the interpreter, float32 products): odd row counts, partial K slices, several tiles."""
    check_scaled_mm(rows, out_features, in_features, bias, tile)


def test_split_k_launches_repeat_bit_for_bit_and_leave_their_counts_at_zero(monkeypatch):
    """The last split adds every split's partial sums in split order: a split launch gives the same bits
    again, its arrival counts are back at zero for the next launch (a graph replays it as is), and a
    launch larger than the fixed scratch is refused by name. (The interpreter runs the splits in order;
    the GPU's arrival order is exercised by the GPU tests of the models' shapes, whose default tiles
    split, against float64 at FP8_ACCUMULATION.)"""
    codes, scale = quantize_per_channel(torch.randn(96, 320, device=DEVICE))
    x = _rows(5, 320, torch.bfloat16, seed=11)
    tile = fp8_matmul.RowsTile(16, 32, 32, 4, 2, split_k=4)
    first = fp8_matmul.w8a16_matmul(x, codes, scale, tile=tile)
    _, arrivals = fp8_matmul.split_workspace(x.device, 0, 0)
    assert int(arrivals.abs().sum()) == 0
    again = fp8_matmul.scaled_mm(x, codes, scale, tile=tile), fp8_matmul.w8a16_matmul(x, codes, scale, tile=tile)
    assert torch.equal(again[1], first) and int(arrivals.abs().sum()) == 0
    unsplit = fp8_matmul.w8a16_matmul(x, codes, scale, tile=fp8_matmul.RowsTile(16, 32, 32, 4, 2))
    assert (unsplit.float() - first.float()).abs().max() <= 2**-7 * unsplit.float().abs().max()
    monkeypatch.setattr(fp8_matmul, "PARTIAL_CAPACITY", 1000)
    with pytest.raises(ValueError, match="split-K launch of 3 tiles and 6144 partial sums exceeds"):
        fp8_matmul.w8a16_matmul(x, codes, scale, tile=tile)


@pytest.mark.parametrize("in_features,out_features", [(0, 32), (48, 0)])
def test_empty_widths_give_the_bias_or_an_empty_product(in_features, out_features):
    codes = torch.zeros(out_features, in_features, dtype=fp8_matmul.FP8_DTYPE, device=DEVICE)
    scale = torch.ones(out_features, device=DEVICE)
    x = torch.randn(3, in_features, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(out_features, device=DEVICE).to(torch.bfloat16)
    for product in (fp8_matmul.w8a16_matmul, fp8_matmul.scaled_mm):
        got = product(x, codes, scale, bias)
        assert got.shape == (3, out_features) and torch.equal(got, bias.expand(3, -1))


@pytest.mark.parametrize("rows", [3, 64] + ([65, 257] if CUDA else []))  # above 64: cuBLAS (CUDA only)
def test_scaled_mm_of_quantized_rows_equals_scaled_mm_of_the_activations(rows):
    """Rows a producer kernel quantised (QuantizedRows) give the product of the activations they stand
    for bit for bit: the same codes and scales, minus the quantisation launch."""
    codes, scale = quantize_per_channel(torch.randn(48, 96, device=DEVICE))
    x = _rows(rows, 96, torch.bfloat16, seed=rows)
    quantized = fp8_matmul.QuantizedRows(*fp8_matmul.quantize_rows(x), x.dtype)
    bias = torch.randn(48, device=DEVICE).to(torch.bfloat16)
    got = fp8_matmul.scaled_mm(quantized, codes, scale, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp8_matmul.scaled_mm(x, codes, scale, bias))


def test_bad_quantized_rows_are_refused():
    codes, scale = quantize_per_channel(torch.randn(32, 48))
    x_codes, x_scales = fp8_matmul.quantize_rows_torch(torch.randn(2, 48))
    for bad in (fp8_matmul.QuantizedRows(x_codes.float(), x_scales, torch.bfloat16),
                fp8_matmul.QuantizedRows(x_codes, x_scales[:1], torch.bfloat16),
                fp8_matmul.QuantizedRows(x_codes, x_scales.double(), torch.bfloat16)):
        with pytest.raises(ValueError, match="quantized rows must be float8_e4m3fn codes"):
            fp8_matmul.scaled_mm(bad, codes, scale)
    with pytest.raises(ValueError, match="does not match"):
        fp8_matmul.scaled_mm(fp8_matmul.QuantizedRows(x_codes[:, :40].contiguous(), x_scales, torch.bfloat16),
                             codes, scale)


def test_bad_operands_are_refused():
    with pytest.raises(ValueError, match="floating-point \\[M, K\\]"):
        fp8_matmul.quantize_rows(torch.zeros(2, 3, 4, device=DEVICE))
    codes, scale = quantize_per_channel(torch.randn(32, 48))
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul.scaled_mm(x, codes.float(), scale)
    with pytest.raises(ValueError, match="does not match"):
        fp8_matmul.scaled_mm(torch.randn(2, 40), codes, scale)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        fp8_matmul.scaled_mm(x, codes, scale[:8])
    odd_codes, odd_scale = quantize_per_channel(torch.randn(30, 48))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_matmul.scaled_mm(x, odd_codes, odd_scale)
    assert fp8_matmul.supports_shape(32, 48) and not fp8_matmul.supports_shape(30, 48)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        fp8_matmul.w8a16_matmul(x, codes, scale, torch.zeros(64)[::2])
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        fp8_matmul.scaled_mm(x, codes, scale, torch.zeros(16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 7, 64, 257])
@pytest.mark.parametrize("out_features,in_features", [
    (3072, 2048), (2048, 8192), (16384, 2048),  # Llama-3.2-1B QKV, down, gate/up
    (6144, 4096), (4096, 14336), (28672, 4096),  # Llama-3-8B QKV, down, gate/up
    (960, 576), (576, 1536), (48, 80),  # SmolLM2 QKV, down; small
])
def test_scaled_mm_against_float64(rows, out_features, in_features, bias):
    """Up to 64 rows the Triton kernel, above cuBLAS (FP8 accumulation: FP8_ACCUMULATION)."""
    check_scaled_mm(rows, out_features, in_features, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [2, 5, 8, 16, 33, 64])
@pytest.mark.parametrize("out_features,in_features", [
    (3072, 2048), (2048, 8192), (16384, 2048), (2048, 2048),  # Llama-3.2-1B QKV, down, gate/up, O
    (6144, 4096), (4096, 14336), (28672, 4096),  # Llama-3-8B QKV, down, gate/up
    (960, 576), (576, 1536), (1000, 1100),  # SmolLM2 QKV, down; odd sizes
])
def test_w8a16_matmul_against_float64_gpu(rows, out_features, in_features, dtype):
    check_w8a16(rows, out_features, in_features, dtype, bias=rows == 5)


def test_w8a16_clamps_activations_to_the_float16_range():
    """The tensor cores take the activations in float16: bfloat16 values beyond 65504 are clamped (the
    CPU interpreter runs the same float16 branch)."""
    codes, scale = quantize_per_channel(torch.randn(64, 128, device=DEVICE))
    x = torch.randn(3, 128, device=DEVICE).to(torch.bfloat16)
    x[1, 5], x[2, 7] = 1e6, -3e5
    got = fp8_matmul.w8a16_matmul(x, codes, scale)
    clamped = x.double().clamp(-65504, 65504)
    expected = clamped @ (codes.double() * scale.double()[:, None]).T
    terms = clamped.abs() @ (codes.double() * scale.double()[:, None]).abs().T
    assert ((got.double() - expected).abs() <= 2**-8 * expected.abs() + 2**-20 * terms).all()


# -- the rows kernel as a programmatic dependent, and reading through TMA ---------------------------------


def test_rows_kernel_reads_through_tma_only_where_it_can():
    """A tile asking for TMA gets it for a weight TMA can address (rows 16-byte multiples apart, starting
    16-byte aligned; the interpreter runs the descriptor loads), not otherwise; a tile not asking never."""
    tile = fp8_matmul.RowsTile(16, 16, 32, 4, 2, tma=True)
    aligned, _ = quantize_per_channel(torch.randn(50, 96))
    odd_rows, _ = quantize_per_channel(torch.randn(50, 230))
    shifted = torch.empty(50 * 96 + 1, dtype=aligned.dtype)[1:].view(50, 96)  # contiguous, 1 byte off
    assert fp8_matmul.reads_through_tma(aligned, tile)
    assert not fp8_matmul.reads_through_tma(odd_rows, tile)
    assert not fp8_matmul.reads_through_tma(shifted, tile)
    assert not fp8_matmul.reads_through_tma(aligned, dataclasses.replace(tile, tma=False))


def _unsplit_placeholders(split_k: int) -> dict:
    """An unsplit launch passes the output (bfloat16 here) for the split scratch and its counters, as
    ``rows_launch`` does."""
    return {"partials_ptr": "*bf16", "arrivals_ptr": "*bf16"} if split_k == 1 else {}


def test_rows_kernel_as_a_dependent_compiles_with_nothing_read_before_its_wait():
    """sm_90: launched as a dependent, the rows kernel reads nothing before its wait (x comes from the
    kernel before, and the split scratch must not be touched while that kernel may still use it)."""
    from sm90_compile import compile_for_sm90

    signature = {"x_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_desc": "*fp8e4nv",
                 "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "partials_ptr": "*fp32",
                 "arrivals_ptr": "*i32",
                 **{name: "i32" for name in ("M", "N", "K", "stride_x", "stride_w", "stride_out", "slices_per_split")},
                 "norm_w_ptr": "*bf16", "eps": "fp32"}
    cases = []
    for x_codes, split_k, pdl in ((False, 4, True), (True, 1, True), (False, 4, False)):
        signature_case = {**signature, **({"x_ptr": "*fp8e4nv"} if x_codes else {}), **_unsplit_placeholders(split_k)}
        cases.append(dict(
            name=f"rows-{'fp8' if x_codes else 'w8a16'}-split{split_k}{'' if pdl else '-plain'}",
            module="graphrt.kernels.fp8_matmul", kernel="_weight_rows_kernel", signature=signature_case,
            constexprs=dict(X_CODES=x_codes, HAS_BIAS=False, DOT_F32=False, EVEN=True, SPLIT_K=split_k, BLOCK_M=16,
                            BLOCK_N=64, BLOCK_K=256, PDL=pdl, TMA=False, W_CODES=True, SILU_MUL=False, NORM=False,
                            ADD_TO_OUT=False),
            num_warps=4, num_stages=4, launch_pdl=pdl,
            aligned_ints=["N", "K", "stride_x", "stride_w", "stride_out"]))
    for case, result in zip(cases, compile_for_sm90(cases)):
        assert "error" not in result, (case["name"], result)
        if not case["constexprs"]["PDL"]:  # launched plainly: no wait
            assert result["dependency_waits"] == 0 and result["loads_before_wait"] is None, case["name"]
            continue
        assert result["dependency_waits"] >= 1 and result["dependency_launches"] >= 1, case["name"]
        assert result["loads_before_wait"] == 0, (case["name"], result)


def test_rows_kernel_reads_its_weights_through_tma_on_sm90():
    """sm_90: with TMA the weight slices arrive as bulk tensor copies, within the H200's shared memory;
    launched as a dependent, still nothing is read before the wait."""
    from sm90_compile import H200_SHARED_MEMORY, compile_for_sm90

    cases = []
    for x_codes, split_k, pdl, block_k, stages, w_type, silu in (
            (True, 1, False, 256, 4, "fp8e4nv", False), (False, 4, True, 256, 4, "fp8e4nv", False),
            (True, 2, True, 128, 8, "fp8e4nv", False),
            (False, 4, True, 128, 4, "bf16", False),  # 16-bit weights (rows_matmul): the same bytes a slice
            (True, 1, False, 256, 4, "fp8e4nv", True), (False, 2, False, 128, 4, "bf16", True)):  # SiLU * up
        signature = {"x_ptr": "*fp8e4nv" if x_codes else "*bf16", "x_scale_ptr": "*fp32", "w_ptr": f"*{w_type}",
                     "w_desc": f"tensordesc<{w_type}[64, {block_k}]>", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                     "out_ptr": "*bf16", "partials_ptr": "*fp32", "arrivals_ptr": "*i32",
                     **{name: "i32" for name in ("M", "N", "K", "stride_x", "stride_w", "stride_out",
                                                 "slices_per_split")}, **_unsplit_placeholders(split_k),
                     "norm_w_ptr": "*bf16", "eps": "fp32"}
        cases.append(dict(
            name=f"rows-tma-{'fp8' if x_codes else 'w8a16' if w_type == 'fp8e4nv' else 'w16'}-split{split_k}"
                 f"-k{block_k}x{stages}{'-pdl' if pdl else ''}{'-silu' if silu else ''}",
            module="graphrt.kernels.fp8_matmul", kernel="_weight_rows_kernel", signature=signature,
            constexprs=dict(X_CODES=x_codes, HAS_BIAS=False, DOT_F32=False, EVEN=True, SPLIT_K=split_k, BLOCK_M=16,
                            BLOCK_N=64, BLOCK_K=block_k, PDL=pdl, TMA=True,
                            W_CODES=w_type == "fp8e4nv", SILU_MUL=silu, NORM=False, ADD_TO_OUT=False),
            num_warps=4, num_stages=stages, launch_pdl=pdl,
            aligned_ints=["N", "K", "stride_x", "stride_w", "stride_out"]))
    one_row = dict(cases[3], name="rows-w16-one-output-row",  # a size of 1 is specialised to a constant
                   signature={k: v for k, v in cases[3]["signature"].items() if k != "N"},
                   constexprs={**cases[3]["constexprs"], "N": 1, "EVEN": False},
                   aligned_ints=["K", "stride_x", "stride_w", "stride_out"])
    cases.append(one_row)
    cases.append(dict(one_row, name="rows-w16-silu-one-output-row", constexprs={**one_row["constexprs"], "SILU_MUL": True}))
    # The 16-bit layers' norm prologue (with SiLU * up) and residual epilogue, split and unsplit (the unsplit
    # launch passing the output for the split scratch), as decode runs them.
    silu, plain = cases[5], cases[3]  # 16-bit weights, split 2 with SiLU * up / split 4 as a dependent
    for base, name, flag in ((silu, "norm-silu", "NORM"), (plain, "add", "ADD_TO_OUT")):
        cases.append(dict(base, name=f"rows-w16-split-{name}", constexprs={**base["constexprs"], flag: True}))
        cases.append(dict(base, name=f"rows-w16-unsplit-{name}", signature={**base["signature"], **_unsplit_placeholders(1)},
                          constexprs={**base["constexprs"], flag: True, "SPLIT_K": 1}))
    for case, result in zip(cases, compile_for_sm90(cases)):
        assert "error" not in result, (case["name"], result)
        assert result["tma_loads"] > 0, (case["name"], result)
        assert result["shared"] <= H200_SHARED_MEMORY, (case["name"], result)
        if case["constexprs"]["PDL"]:
            assert result["dependency_waits"] >= 1 and result["loads_before_wait"] == 0, (case["name"], result)


def test_fp8_layers_take_the_models_dependent_launch():
    from graphrt.attention.reference import ReferenceAttentionBackend
    from graphrt.loader.random_presets import PRESETS
    from graphrt.models.fp8 import Fp8Linear
    from graphrt.models.llama import LlamaForCausalLM

    for dependent in (False, True):
        model = LlamaForCausalLM(PRESETS["tiny"], ReferenceAttentionBackend, 64, torch.bfloat16, "meta",
                                 fused_kernels=True, dependent_launch=dependent, quantization="fp8")
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert layers and all(layer.dependent_launch is dependent for layer in layers)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [2, 8, 16, 64])
@pytest.mark.parametrize("out_features,in_features", [(2048, 8192), (6144, 4096), (4096, 14336), (28672, 4096)])
def test_rows_kernel_as_a_dependent_changes_no_bit_gpu(rows, out_features, in_features):
    """The rows kernel launched as a dependent, right after the kernel that writes its input (a GEMV
    launched as a dependent too, which lets the next kernel start at once) over NaN: a read of the input
    before the wait would see NaN. The same bits as the plain launches, on both paths (W8A16 and FP8 x
    FP8), split or not, through TMA (up to 16 rows on sm_90) or not."""
    from graphrt.kernels import gemv

    dependent = torch.cuda.get_device_capability()[0] >= 9
    codes, scale = quantize_per_channel(torch.randn(out_features, in_features, device=DEVICE) * in_features**-0.5)
    source = torch.randn(rows, 512, device=DEVICE, dtype=torch.bfloat16)
    producer = torch.randn(in_features, 512, device=DEVICE, dtype=torch.bfloat16) * 512**-0.5
    x = gemv.linear_gemv(source, producer)
    for function in (fp8_matmul.w8a16_matmul, fp8_matmul.scaled_mm):
        plain = function(x, codes, scale)
        produced = torch.full_like(x, float("nan"))
        gemv.linear_gemv(source, producer, out=produced, dependent_launch=dependent)
        early = function(produced, codes, scale, dependent_launch=dependent)
        assert torch.equal(produced, x) and torch.equal(plain, early), function.__name__


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90 (TMA) device")
@pytest.mark.parametrize("rows", [2, 8, 16, 64])
@pytest.mark.parametrize("out_features,in_features", [(2048, 8192), (4096, 14336), (1008, 4112), (28672, 4096)])
def test_rows_kernel_through_tma_changes_no_bit_gpu(rows, out_features, in_features):
    """The rows kernel reading its weight slices through TMA (edges past the matrix zero-filled: 1008 rows
    and 4112 columns leave partial tiles and slices) gives the bits of its plain loads, on both paths,
    at the default tile (split or not), a deeper pipeline, and launched as a dependent after the kernel
    that writes its input over NaN."""
    from graphrt.kernels import gemv

    codes, scale = quantize_per_channel(torch.randn(out_features, in_features, device=DEVICE) * in_features**-0.5)
    source = torch.randn(rows, 512, device=DEVICE, dtype=torch.bfloat16)
    producer = torch.randn(in_features, 512, device=DEVICE, dtype=torch.bfloat16) * 512**-0.5
    x = gemv.linear_gemv(source, producer)
    default = fp8_matmul.rows_tile(rows, out_features, in_features, fp8_matmul.multiprocessors(x.device))
    assert fp8_matmul.reads_through_tma(codes, dataclasses.replace(default, tma=True))  # TMA really taken
    for function in (fp8_matmul.w8a16_matmul, fp8_matmul.scaled_mm):
        for tile in (default, fp8_matmul.RowsTile(default.block_m, 64, 128, 4, 8, 2)):
            plain = function(x, codes, scale, tile=dataclasses.replace(tile, tma=False))
            through_tma = function(x, codes, scale, tile=dataclasses.replace(tile, tma=True))
            assert torch.equal(plain, through_tma), (function.__name__, tile)
        plain = function(x, codes, scale, tile=dataclasses.replace(default, tma=False))
        produced = torch.full_like(x, float("nan"))
        gemv.linear_gemv(source, producer, out=produced, dependent_launch=True)
        early = function(produced, codes, scale, tile=dataclasses.replace(default, tma=True), dependent_launch=True)
        assert torch.equal(produced, x) and torch.equal(plain, early), function.__name__
