"""Matrix-vector products for decode at batch 1, with the layer's neighbours fused in.

At batch 1 a decoder layer's GEMMs stream their weights once and do almost no arithmetic, so a
layer's cost is bytes plus one latency per kernel. cuBLAS streams such small matrices well below the
memory bandwidth (the down projection as a GEMM plus a split-K reduce), and the norms and SiLU around
them are kernels of their own. Here one program computes ``BLOCK_N``
outputs of one row, streaming its ``BLOCK_N`` rows of W in long K slices (the products run on CUDA
cores; nothing here needs tensor cores), and takes the neighbours along:

* prologue ``NORM``: x is the residual stream, normalised first (RMSNorm with the layer's norm
  weight): the row is KBs against MBs of weights, so each program recomputing the row's scale costs
  little and saves the norm kernel;
* epilogue ``SILU_MUL``: W is the fused gate/up weight ``[2 * I, K]``; a program computes gate
  outputs ``n`` and up outputs ``I + n`` together and writes ``silu(gate) * up`` ``[M, I]``;
* epilogue ``ADD_TO_OUT``: the result is added into ``out`` in place (the residual stream), which
  saves the next norm's residual add.

Rows are independent programs, so more rows re-read W (from L2, as a tile's programs for every row
are launched back to back): the kernels are built for one row, and the model uses them for one token, in layers up to the size where they beat cuBLAS
(``graphrt.models.kernel_policy`` holds the bounds; profiles/notes_fusion.md the measurements). So a sequence decoding
alone sums its products in another order than in a batch: its logits can differ in the last bits
(as cuBLAS's own kernels differ between batch sizes), and a greedy near-tie can resolve differently.

Rounding follows the unfused ops (``graphrt.models.layers``): the normalised row and the product are
rounded to the model dtype where the torch ops round them. The float32 sums run in another order than
cuBLAS's, so results differ from ``torch.nn.functional.linear`` by a last-place rounding, as two GEMM
libraries do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrt.kernels.dependent_launch import launch_options
from graphrt.kernels.rounding import round_to

EPILOGUE_STORE, EPILOGUE_ADD_TO_OUT, EPILOGUE_SILU_MUL = 0, 1, 2

#: The one-byte weight format the kernels read besides the activations' dtype (with a scale per row).
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn

#: Output tiles sit on the launch grid's second axis, which CUDA caps at 65535; rows on the first, so
#: that the programs of one tile for every row are launched one after another and the rows after the
#: first read its weights from L2 rather than from memory.
MAX_GRID_TILES = 65535


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: outputs and reduction depth per program, warps, and ``thread_sum``: how many
    adjacent K elements of a slice each thread adds up in registers before they join its accumulator
    (a power of two dividing ``block_k``; 1: one float32 accumulator per element of the slice)."""

    block_n: int
    block_k: int
    num_warps: int
    thread_sum: int = 1

    def __post_init__(self):
        if self.thread_sum < 1 or self.thread_sum & (self.thread_sum - 1) or self.block_k % self.thread_sum:
            raise ValueError(f"thread_sum must be a power of two dividing block_k {self.block_k}, "
                             f"got {self.thread_sum}")


@triton.jit
def _row_slice(x_row, norm_w, k_cols, K, inv_rms, NORM: tl.constexpr, dtype: tl.constexpr):
    """The row's K slice ``k_cols`` ([1, BLOCK_K]) as float32, normalised with NORM as rms_norm_torch
    rounds it: ``norm_w * (x * inv_rms).to(dtype)``, rounded to dtype (``norm_w``: the norm weight's
    slice, [1, BLOCK_K] float32, loaded by the caller)."""
    x = tl.load(x_row + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
    if NORM:
        x = round_to(norm_w * round_to(x * inv_rms, dtype).to(tl.float32), dtype).to(tl.float32)
    return x


@triton.jit
def _slice_sums(products, BLOCK_K: tl.constexpr, THREAD_SUM: tl.constexpr):
    """[BLOCK_N, BLOCK_K] float32 products -> [BLOCK_N, BLOCK_K // THREAD_SUM]: each run of THREAD_SUM
    adjacent columns summed (the products themselves with THREAD_SUM 1)."""
    if THREAD_SUM == 1:
        return products
    else:
        return tl.sum(tl.reshape(products, [products.shape[0], BLOCK_K // THREAD_SUM, THREAD_SUM]), axis=2)


@triton.jit
def row_products(
    x_row,  # the row's first element (with NORM: the residual stream, normalised here)
    w_ptr,
    stride_w,
    rows,  # [BLOCK_N] weight rows to multiply with
    paired_rows,  # [BLOCK_N] a second set of rows (read only with PAIRED)
    n_mask,  # [BLOCK_N] rows that exist
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    addend_ptrs,  # [BLOCK_N] what the caller's epilogue adds (read only with ADDEND)
    scale_ptr,  # [rows of W] float32 per-row scales of an FP8 weight (read only with W_SCALED)
    K,
    eps,
    NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    ADDEND: tl.constexpr,
    W_SCALED: tl.constexpr,  # W holds FP8 codes: the products are multiplied by their rows' scales
    BLOCK_K: tl.constexpr,
    THREAD_SUM: tl.constexpr,  # adjacent products a thread sums before accumulating (TileConfig.thread_sum)
    NORM_BLOCK: tl.constexpr,  # with NORM: the row's elements one load takes (norm_block: a power of two)
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
    dtype: tl.constexpr,
):
    """``W[rows] @ x`` and, with PAIRED, ``W[paired_rows] @ x`` for one row x of K: float32 [BLOCK_N]
    each (without PAIRED the second is the first), and with ADDEND the values at ``addend_ptrs`` as
    float32 [BLOCK_N] (zeros without). With W_SCALED, W is FP8 (E4M3) codes whose real values are
    ``code * scale[row]``: the codes are widened to float32 in registers and each product is scaled
    once after the sum (the same value as summing the dequantised weights). With PDL it lets the next kernel start, loads the first weight
    and norm-weight slices, then waits for the previous kernel before reading x and the addend: call it
    before anything in the kernel that reads what the step's kernels write (only what none of them
    writes, weights, tables and the step's host-uploaded inputs, may be read before it; see
    ``graphrt.kernels.dependent_launch``).

    After the wait everything a program does is on the step's critical path, so the loads there are
    arranged to take few round trips in turn: the addend (the residual stream, which the previous
    kernels wrote) is requested at once with the row rather than after the products, and the norm's
    sum of squares reads the row in one load of NORM_BLOCK elements rather than slice after slice."""
    # The row is handled as a [1, BLOCK_K] tile, in the 2-D layout of the weight tile it multiplies
    # (a 1-D row broadcast into it needs a layout conversion, through shared memory, every slice).
    k_offsets = tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + k_offsets
    paired_ptrs = w_ptr + paired_rows.to(tl.int64)[:, None] * stride_w + k_offsets

    if PDL:
        # The next kernel may be scheduled once every program here has started. Weights are static,
        # so the first slices are loaded before waiting for the previous kernel; x and the addend are
        # read only after the wait.
        tl.extra.cuda.gdc_launch_dependents()
    first_mask = n_mask[:, None] & (k_offsets < K)
    w_first = tl.load(w_ptrs, mask=first_mask, other=0.0)
    if PAIRED:
        paired_first = tl.load(paired_ptrs, mask=first_mask, other=0.0)
    if W_SCALED:  # static like the weights
        scale = tl.load(scale_ptr + rows, mask=n_mask, other=0.0)
        if PAIRED:
            paired_scale = tl.load(scale_ptr + paired_rows, mask=n_mask, other=0.0)
    norm_w = 1.0
    if NORM:
        # A norm weight is read by every program of the kernel at once, first from HBM: loaded before
        # the wait, its latency overlaps the previous kernel instead of following the sum of squares.
        norm_w = tl.load(norm_w_ptr + k_offsets, mask=k_offsets < K, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    addend = tl.zeros_like(rows).to(tl.float32)
    if ADDEND:
        addend = tl.load(addend_ptrs, mask=n_mask, other=0.0).to(tl.float32)

    inv_rms = 1.0
    if NORM:
        # 1 / rms of the row, recomputed by every program: the row comes from L2. The loop runs once
        # for rows up to NORM_BLOCK long (the launcher's cap), one round trip instead of K / BLOCK_K.
        norm_offsets = tl.arange(0, NORM_BLOCK)[None, :]
        sum_squares = tl.zeros([1, NORM_BLOCK], dtype=tl.float32)
        for k in range(0, K, NORM_BLOCK):
            x = tl.load(x_row + k + norm_offsets, mask=k + norm_offsets < K, other=0.0).to(tl.float32)
            sum_squares += x * x
        inv_rms = tl.math.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)[:, None]  # [1, 1]

    # Products accumulate per column (or per run of THREAD_SUM columns, which a thread holds together:
    # the accumulator then takes 1 / THREAD_SUM of the registers, which one-byte weights need to keep
    # many bytes a slice in flight) and are reduced across the threads once after the loop: a
    # reduction per slice would synchronise the warps every slice. The first slice was loaded above.
    x = _row_slice(x_row, norm_w, k_offsets, K, inv_rms, NORM, dtype)
    acc = _slice_sums(w_first.to(tl.float32) * x, BLOCK_K, THREAD_SUM)
    if PAIRED:  # acc_paired exists only then
        acc_paired = _slice_sums(paired_first.to(tl.float32) * x, BLOCK_K, THREAD_SUM)
    for k in range(BLOCK_K, K, BLOCK_K):
        k_cols = k + k_offsets
        if NORM:
            norm_w = tl.load(norm_w_ptr + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
        x = _row_slice(x_row, norm_w, k_cols, K, inv_rms, NORM, dtype)
        w_mask = n_mask[:, None] & (k_cols < K)
        w = tl.load(w_ptrs + k, mask=w_mask, other=0.0).to(tl.float32)
        acc += _slice_sums(w * x, BLOCK_K, THREAD_SUM)
        if PAIRED:
            paired_w = tl.load(paired_ptrs + k, mask=w_mask, other=0.0).to(tl.float32)
            acc_paired += _slice_sums(paired_w * x, BLOCK_K, THREAD_SUM)

    products = tl.sum(acc, axis=1)
    if W_SCALED:
        products = products * scale
    paired_products = products
    if PAIRED:
        paired_products = tl.sum(acc_paired, axis=1)
        if W_SCALED:
            paired_products = paired_products * paired_scale
    return products, paired_products, addend


#: Most row elements the norm's sum of squares loads at once (``norm_block``): 32 float32 registers
#: a thread at 8 warps, 64 at 4.
_MAX_NORM_BLOCK = 8192


def norm_block(in_features: int) -> int:
    """``row_products``' NORM_BLOCK for rows of ``in_features``: the whole row up to ``_MAX_NORM_BLOCK``."""
    return min(_MAX_NORM_BLOCK, triton.next_power_of_2(max(in_features, 1)))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [N, K], or [2 * N, K] gate then up with SILU_MUL
    bias_ptr,  # [N] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    scale_ptr,  # [N] or [2 * N] float32 per-row scales of an FP8 weight (unused without W_SCALED)
    out_ptr,  # [M, N]; with ADD_TO_OUT read and updated in place
    stride_x,
    stride_w,
    stride_out,
    eps,
    N,
    K,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALED: tl.constexpr,  # w holds FP8 codes, real values code * scale[row]
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    THREAD_SUM: tl.constexpr,  # TileConfig.thread_sum
    NORM_BLOCK: tl.constexpr,  # row elements the norm's sum of squares loads at once (norm_block)
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + tl.program_id(0).to(tl.int64) * stride_x
    cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    out_ptrs = out_ptr + tl.program_id(0).to(tl.int64) * stride_out + cols_n
    if HAS_BIAS:  # static: read before row_products waits
        bias = tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)
    # With SILU_MUL a program computes gate outputs n and up outputs I + n together; with ADD_TO_OUT
    # row_products reads out's values (the residual stream) along with the row.
    result, up, addend = row_products(x_row, w_ptr, stride_w, cols_n, cols_n + N, n_mask, norm_w_ptr, out_ptrs,
                                      scale_ptr, K, eps, NORM, EPILOGUE == 2, EPILOGUE == 1, W_SCALED, BLOCK_K,
                                      THREAD_SUM, NORM_BLOCK, PDL, dtype)
    if HAS_BIAS:
        result += bias
    store_linear_output(result, up, addend, out_ptrs, n_mask, EPILOGUE, dtype)


@triton.jit
def store_linear_output(result, up, addend, out_ptrs, mask, EPILOGUE: tl.constexpr, dtype: tl.constexpr):
    """Rounds float32 products (bias added) as the linear layer's output tensor, applies the epilogue
    as the unfused torch ops round it and stores: ``EPILOGUE_STORE``; ``EPILOGUE_ADD_TO_OUT`` adds
    ``addend`` (out's values, float32, loaded by the caller); ``EPILOGUE_SILU_MUL`` writes ``silu(result)
    * up`` (``up``: the up products, read only then). Any tile shape: ``result``, ``up``, ``addend``,
    ``out_ptrs`` and ``mask`` share it."""
    result = round_to(result, dtype).to(tl.float32)
    if EPILOGUE == 1:  # EPILOGUE_ADD_TO_OUT
        result += addend
    elif EPILOGUE == 2:  # EPILOGUE_SILU_MUL
        up = round_to(up, dtype).to(tl.float32)
        result = round_to(result / (1.0 + tl.exp(-result)), dtype).to(tl.float32) * up
    tl.store(out_ptrs, round_to(result, dtype), mask=mask)


#: Tiles measured fastest for the bundled presets' matrices, 16-bit weights: (weight rows, in_features,
#: SiLU * up epilogue) -> tile. Chosen first for each matrix alone, as the decode layer runs it and
#: launched as dependents, against the general 8x1024, 8-warp tile; then inside the captured decode
#: step, where each kernel follows another one: the entries marked
#: "step" won there. The measurements are in profiles/notes_fusion.md. The QKV entries set the fused
#: QKV kernel's tile (``qkv_tile``).
MEASURED_TILES = {
    (3072, 2048, False): TileConfig(8, 1024, 4),  # Llama-3.2-1B QKV
    (2048, 2048, False): TileConfig(8, 2048, 8),  # 1B O (step)
    (16384, 2048, True): TileConfig(16, 256, 4),  # 1B gate/up
    (2048, 8192, False): TileConfig(16, 2048, 8),  # 1B down (step)
    (6144, 4096, False): TileConfig(16, 512, 4),  # Llama-3-8B QKV (step)
    (4096, 4096, False): TileConfig(16, 512, 4),  # 8B O (step)
    (28672, 4096, True): TileConfig(8, 1024, 4),  # 8B gate/up
    (4096, 14336, False): TileConfig(4, 2048, 8),  # 8B down (step)
    (960, 576, False): TileConfig(16, 1024, 8),  # SmolLM2-135M QKV
    (576, 576, False): TileConfig(16, 1024, 8),  # SmolLM2 O
    (3072, 576, True): TileConfig(8, 1024, 8),  # SmolLM2 gate/up (step)
    (576, 1536, False): TileConfig(4, 2048, 4),  # SmolLM2 down
}

#: The same for FP8 (one-byte) weights, each chosen inside the captured decode step by
#: ``profiles/tiles_in_step.py`` against ``general_config``'s FP8 tile (which the shapes not listed take,
#: and the 1B's QKV and O kept: no candidate beat it by 1 %). In the step, where each kernel starts during
#: the previous one's tail, 8 outputs a program beat the 4 that won on the matrices alone.
MEASURED_FP8_TILES: dict[tuple[int, int, bool], TileConfig] = {
    (16384, 2048, True): TileConfig(8, 1024, 4, 8),  # Llama-3.2-1B gate/up
    (2048, 8192, False): TileConfig(4, 4096, 4, 16),  # 1B down
    (6144, 4096, False): TileConfig(8, 2048, 8, 16),  # Llama-3-8B QKV
    (4096, 4096, False): TileConfig(8, 2048, 4, 16),  # 8B O
    (28672, 4096, True): TileConfig(8, 1024, 4, 8),  # 8B gate/up
    (4096, 14336, False): TileConfig(8, 2048, 4, 16),  # 8B down
}


def general_config(in_features: int, silu_mul: bool = False, element_size: int = 2) -> TileConfig:
    """The tile for shapes nobody measured: 8 outputs a program, K slices of up to 1024, 8 warps (4
    with SiLU * up, whose programs carry gate and up tiles). On the measured matrices it came close to
    the best tile on some and far from it on others (profiles/notes_fusion.md), hence
    ``MEASURED_TILES``; the loads are not software-pipelined, so each slice must carry many bytes, and
    few outputs a program keep enough programs in flight for the smallest matrices.

    One-byte (FP8) weights: 4 outputs a program, K slices of up to 2048 codes, 4 warps, each thread
    summing the adjacent products it holds before accumulating (``thread_sum``: 16 with 2048-code
    slices, a 16-byte load a row and thread, with a 16th of the accumulator registers; fewer with
    shorter rows). Of 16 tiles timed on each Llama-3.2-1B and Llama-3-8B matrix it was the fastest
    or within 3.2 % on all eight (profiles/notes_fp8.md); other shapes were not timed."""
    if element_size == 1:
        block_k = min(2048, max(16, triton.next_power_of_2(in_features)))
        return TileConfig(block_n=4, block_k=block_k, num_warps=4, thread_sum=max(1, min(16, block_k // 128)))
    block_k = min(1024, max(16, triton.next_power_of_2(in_features)))
    return TileConfig(block_n=8, block_k=block_k, num_warps=4 if silu_mul else 8)


def default_config(in_features: int, weight_rows: int | None = None, silu_mul: bool = False,
                   element_size: int = 2) -> TileConfig:
    """The tile for a ``[weight_rows, in_features]`` weight: the measured one for a measured shape
    (``MEASURED_TILES`` for 16-bit weights, ``MEASURED_FP8_TILES`` for FP8 codes), else
    ``general_config``'s."""
    table = {2: MEASURED_TILES, 1: MEASURED_FP8_TILES}.get(element_size, {})
    measured = table.get((weight_rows, in_features, silu_mul))
    return measured if measured is not None else general_config(in_features, silu_mul, element_size)


def grid_tiles(out_features: int, block_n: int) -> int:
    """Programs a row's ``out_features`` outputs take, ``block_n`` a program; ValueError past the grid's
    ``MAX_GRID_TILES``."""
    tiles = triton.cdiv(out_features, block_n)
    if tiles > MAX_GRID_TILES:
        raise ValueError(f"{out_features} outputs in tiles of {block_n} exceed the launch grid's {MAX_GRID_TILES} "
                         "programs; use torch.nn.functional.linear")
    return tiles


def check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                   paired_bias_free: bool = False, weight_scale: torch.Tensor | None = None) -> tuple[int, int]:
    """Checks a GEMV's inputs (shapes and dtypes as ``linear_gemv`` documents them); returns (M, K).
    ``paired_bias_free``: the weight's rows come in two halves (gate then up) and take no bias.
    ``weight_scale``: the per-row scales an FP8 weight needs (and only an FP8 weight takes)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous columns, got shape {tuple(x.shape)}")
    rows, in_features = x.shape
    if bias is not None and (not bias.is_contiguous() or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be a contiguous {x.dtype} tensor on {x.device}")
    check_norm_weight(x, norm_weight)
    fp8 = weight.dtype == FP8_WEIGHT_DTYPE
    if weight.dim() != 2 or weight.shape[1] != in_features or not weight.is_contiguous() or (
            weight.dtype != x.dtype and not fp8):
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be a contiguous [N, {in_features}] "
                         f"{x.dtype} or float8_e4m3fn tensor")
    if fp8 != (weight_scale is not None):
        raise ValueError("an FP8 weight needs weight_scale (float32, one per weight row), and only an FP8 weight "
                         "takes one")
    if fp8 and (weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32
                or not weight_scale.is_contiguous() or weight_scale.device != x.device):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must be a contiguous "
                         f"float32 [{weight.shape[0]}] tensor on {x.device}, one scale per weight row")
    out_features = weight.shape[0]
    if paired_bias_free:
        if out_features % 2 or bias is not None:
            raise ValueError("SiLU * up needs a bias-free [2 * I, K] gate/up weight")
        out_features //= 2
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {out_features} output features")
    return rows, in_features


def check_norm_weight(x: torch.Tensor, norm_weight: torch.Tensor | None) -> None:
    """ValueError unless ``norm_weight`` is None or the RMSNorm weight a fused norm prologue takes for x [M, K]:
    a contiguous [K] tensor in x's dtype on x's device."""
    if norm_weight is None:
        return
    if not norm_weight.is_contiguous() or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise ValueError(f"norm weight must be a contiguous {x.dtype} tensor on {x.device}")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match {x.shape[1]} input features")


def output_for(x: torch.Tensor, out: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``out`` checked as the output of a product of x [M, K] (``[M, out_features]``, x's dtype,
    contiguous columns, not sharing x's memory: programs would read x while others write out), or a new
    tensor when None."""
    rows = x.shape[0]
    if out is None:
        return torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if out.shape != (rows, out_features) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{rows}, {out_features}] {x.dtype} with "
                         "contiguous columns")
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with x: programs would read x while others write out")
    return out


def linear_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    norm_weight: torch.Tensor | None, epilogue: int,
                    out: torch.Tensor | None, weight_scale: torch.Tensor | None = None,
                    ) -> tuple[int, int, int, torch.Tensor]:
    """Checks a fused linear launch's operands as ``linear_gemv`` documents them (epilogue, shapes,
    dtypes, the residual add's ``out``); returns (rows, in_features, out_features, out), ``out``
    allocated when None."""
    if epilogue not in (EPILOGUE_STORE, EPILOGUE_ADD_TO_OUT, EPILOGUE_SILU_MUL):
        raise ValueError(f"unknown epilogue {epilogue!r}")
    rows, in_features = check_operands(x, weight, bias, norm_weight, paired_bias_free=epilogue == EPILOGUE_SILU_MUL,
                                       weight_scale=weight_scale)
    out_features = weight.shape[0] // 2 if epilogue == EPILOGUE_SILU_MUL else weight.shape[0]
    if out is None and epilogue == EPILOGUE_ADD_TO_OUT:
        raise ValueError("the residual-add epilogue needs out, the tensor to add into")
    return rows, in_features, out_features, output_for(x, out, out_features)


def linear_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    epilogue: int = EPILOGUE_STORE,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
    dependent_launch: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` for a row or a few, optionally with RMSNorm before and SiLU * up or
    a residual add after, in one kernel.

    x: [M, K] (columns contiguous), model dtype (fp16/bf16/fp32); weight: [N_w, K] contiguous, same
    dtype, or ``torch.float8_e4m3fn`` codes with ``weight_scale`` [N_w] float32 (real weights ``code *
    scale[row]``, widened in registers: W8A16); bias: None or [N_w] (not with SILU_MUL); norm_weight: None, or [K]: x is normalised first,
    ``norm_weight * x / rms(x)`` with ``eps``. epilogue:

    * ``EPILOGUE_STORE``: returns ``out`` [M, N_w];
    * ``EPILOGUE_SILU_MUL``: weight is gate then up ([2 * I, K]); returns ``silu(gate) * up`` [M, I];
    * ``EPILOGUE_ADD_TO_OUT``: ``out`` ([M, N_w], required) += the linear output, in place.

    Any M is correct; one row is what it is fast for (each row's results do not depend on M). ``out`` must not share memory with
    x. ``config``: the tile (default: ``default_config``'s for the weight's shape). Nothing is
    allocated when ``out`` is given, and the launch depends on shapes only: safe inside a CUDA graph.
    ``dependent_launch``: launch as a programmatic dependent of the previous kernel, whose tail then
    overlaps this kernel's start and first weight loads (``graphrt.kernels.dependent_launch``).
    """
    rows, in_features, out_features, out = linear_operands(x, weight, bias, norm_weight, epilogue, out, weight_scale)
    if rows == 0:
        return out
    config = config or default_config(in_features, weight.shape[0], epilogue == EPILOGUE_SILU_MUL,
                                      weight.element_size())
    _gemv_kernel[(rows, grid_tiles(out_features, config.block_n))](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight,
        weight if weight_scale is None else weight_scale, out,
        x.stride(0), weight.stride(0), out.stride(0), float(eps), out_features, in_features,
        NORM=norm_weight is not None, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        W_SCALED=weight_scale is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, THREAD_SUM=config.thread_sum,
        NORM_BLOCK=norm_block(in_features),
        num_warps=config.num_warps, **launch_options(dependent_launch),
    )
    return out
