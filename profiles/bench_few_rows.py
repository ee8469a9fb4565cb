"""Experiment: decode layers at 2-16 rows on a tensor-core kernel that takes the layer's neighbours
along, against what the fused decode path runs there (add + RMSNorm kernels, cuBLAS GEMMs, the SiLU *
up kernel). It lost for the 1B and 8B (profiles/notes_fusion.md, change 11; results/few_rows_h200.json),
so the kernel lives here, not in graphrt.

The kernel pads the rows to 16 (the tensor cores' smallest tile) and multiplies W[BLOCK_N, K] @ x^T, so
each weight slice is read once for all rows, the weight loads multi-buffered by Triton (cp.async); the
GEMV's prologue (RMSNorm) and epilogues (SiLU * up, residual add) are fused as in graphrt.kernels.gemv.

For Llama-3.2-1B, Llama-3-8B and SmolLM2-135M (bf16), one run measures:

1. a tile sweep at 8 rows: each matrix as the layer runs it (QKV with the norm, O and down adding into
   the residual stream, gate/up with the norm and SiLU * up) for every tile of ``SWEEP_TILES``, beside
   cuBLAS's bare product;
2. per layer (the four matrices and their neighbours, no attention) at 2, 4, 8 and 16 rows: today's path
   against the kernel with the sweep's best tile per matrix and with ``DEFAULT_TILE``, and with the
   best tiles and the norm applied after the products (``norm_after``: no prologue, the row's sum of
   squares taken in the K loop; profiles/notes_fusion.md "Next" item 1);
3. first, the norm variants' largest error against a float64 reference (1B QKV, 8 rows) beside the
   unfused torch ops'.

``--tiles-from results/few_rows_h200.json`` takes the best tiles of an earlier run and skips the sweep.

Timings as in bench_gemv.py: CUDA-graph replays over enough weight copies (>= 256 MB) that weights
stream from HBM, medians of 20 replays.

    python profiles/bench_few_rows.py --json profiles/results/few_rows_h200.json
    python profiles/bench_few_rows.py --tiles-from profiles/results/few_rows_h200.json --json few_rows_norm_after.json"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_gemv import DTYPE, MATRICES, MODELS, cublas_layers, shape, time_graph, weights

from graphrt.bench import measure_read_bandwidth
from graphrt.kernels import gemv
from graphrt.kernels.dependent_launch import launch_options, wait_for_previous_kernel
from graphrt.kernels.rounding import round_to

#: Rows a launch takes at most: the padded tile of the product.
ROWS_PAD = 16


@dataclass(frozen=True)
class FewRowsTile:
    """Outputs a program computes, K slice, warps, and weight slices in flight a program."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: Until measured per shape: 32 outputs, K slices of 128, 4 warps, 4 slices in flight.
DEFAULT_TILE = FewRowsTile(32, 128, 4, 4)


@triton.jit
def _few_rows_kernel(
    x_ptr,  # [M, K] rows (with NORM: the residual stream, normalised here)
    w_ptr,  # [N, K], or [2 * N, K] gate then up with SILU_MUL
    bias_ptr,  # [N] (unused without HAS_BIAS)
    norm_w_ptr,  # [K] RMSNorm weight (unused without NORM)
    out_ptr,  # [M, N]; with ADD_TO_OUT read and updated in place
    stride_x,
    stride_w,
    stride_out,
    eps,
    M,
    N,
    K,
    NORM: tl.constexpr,
    NORM_AFTER: tl.constexpr,  # with NORM: 1 / rms applied to the products, its sums taken in the K loop
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,  # M padded (>= 16)
    DOT_F32: tl.constexpr,  # products in float32: fp32 models, and the CPU interpreter's 16-bit dots
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
):
    wait_for_previous_kernel(PDL)
    dtype = out_ptr.dtype.element_ty
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    rows_m = tl.arange(0, ROWS)
    m_mask = rows_m < M
    k_offsets = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_x + k_offsets[None, :]  # [ROWS, BLOCK_K]
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w + k_offsets[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N.to(tl.int64) * stride_w  # SILU_MUL's up rows

    inv_rms = tl.full([ROWS], 1.0, tl.float32)
    sum_squares_after = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)  # NORM_AFTER's, taken in the K loop
    if NORM and not NORM_AFTER:
        # 1 / rms of each row, recomputed by every program: the rows come from L2.
        sum_squares = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k, mask=m_mask[:, None] & (k + k_offsets < K)[None, :], other=0.0).to(tl.float32)
            sum_squares += x * x
        inv_rms = tl.math.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)

    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if EPILOGUE == 2:  # EPILOGUE_SILU_MUL: the up outputs too (acc_up exists only then)
        acc_up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = k + k_offsets < K
        w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM and NORM_AFTER:  # the norm weight now, the row's 1 / rms on the products
            x32 = x.to(tl.float32)
            sum_squares_after += x32 * x32
            norm_w = tl.load(norm_w_ptr + k + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
            x = round_to(x32 * norm_w[None, :], dtype)
        elif NORM:  # as rms_norm_torch rounds it: weight * (x * inv_rms).to(dtype), rounded to dtype
            norm_w = tl.load(norm_w_ptr + k + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
            x = round_to(norm_w[None, :] * round_to(x.to(tl.float32) * inv_rms[:, None], dtype).to(tl.float32),
                         dtype)
        if DOT_F32:
            x_t = tl.trans(x.to(tl.float32))
            acc = tl.dot(w.to(tl.float32), x_t, acc, input_precision="ieee")
            if EPILOGUE == 2:
                up_w = tl.load(up_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up = tl.dot(up_w.to(tl.float32), x_t, acc_up, input_precision="ieee")
        else:
            x_t = tl.trans(x.to(w.dtype))
            acc = tl.dot(w, x_t, acc)
            if EPILOGUE == 2:
                up_w = tl.load(up_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up = tl.dot(up_w, x_t, acc_up)

    if NORM and NORM_AFTER:  # W (w * x / rms) = (W (w * x)) / rms, row by row
        inv_rms = tl.math.rsqrt(tl.sum(sum_squares_after, axis=1) / K + eps)
        acc = acc * inv_rms[None, :]
        if EPILOGUE == 2:
            acc_up = acc_up * inv_rms[None, :]
    result = acc  # [BLOCK_N, ROWS]: output n of row m at [n, m]
    if HAS_BIAS:
        result += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    up = acc
    if EPILOGUE == 2:
        up = acc_up
    out_ptrs = out_ptr + rows_m.to(tl.int64)[None, :] * stride_out + cols_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    addend = result
    if EPILOGUE == 1:
        addend = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    gemv.store_linear_output(result, up, addend, out_ptrs, out_mask, EPILOGUE, dtype)


def linear_few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    epilogue: int = gemv.EPILOGUE_STORE,
    out: torch.Tensor | None = None,
    tile: FewRowsTile | None = None,
    dependent_launch: bool = False,
    norm_after: bool = False,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` for 1 to ``ROWS_PAD`` rows, optionally with RMSNorm before and SiLU *
    up or a residual add after, in one kernel; arguments, shapes and dtypes as
    ``graphrt.kernels.gemv.linear_gemv``'s. ``tile``: the launch's tiling (default ``DEFAULT_TILE``).
    ``norm_after`` (with ``norm_weight``): no prologue; the K loop multiplies x by the norm weight and
    sums its squares, and the products are divided by the row's rms in the epilogue. Mathematically the
    same; it rounds ``x * weight`` to the model dtype where the unfused ops round ``weight * (x / rms)``.
    Nothing is allocated when ``out`` is given, and the launch depends on shapes only: safe inside a
    CUDA graph."""
    rows, in_features, out_features, out = gemv.linear_operands(x, weight, bias, norm_weight, epilogue, out)
    if rows > ROWS_PAD:
        raise ValueError(f"{rows} rows exceed the {ROWS_PAD} this kernel takes; use torch.nn.functional.linear")
    if rows == 0:
        return out
    tile = tile or DEFAULT_TILE
    _few_rows_kernel[(triton.cdiv(out_features, tile.block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, out,
        x.stride(0), weight.stride(0), out.stride(0), float(eps), rows, out_features, in_features,
        NORM=norm_weight is not None, NORM_AFTER=norm_after, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ROWS=ROWS_PAD,
        DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(dependent_launch),
    )
    return out


SWEEP_TILES = [FewRowsTile(n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5))] + [
    FewRowsTile(64, 128, 8, 4), FewRowsTile(128, 64, 4, 4), FewRowsTile(128, 128, 8, 3)]
EPS = 1e-5


def label(tile: FewRowsTile) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def layer_op(matrix: str, x, w, out, norm_w, tile, norm_after: bool = False):
    """The matrix as the decode layer runs it (as bench_gemv.layer_op), on the few-rows kernel."""
    if matrix in ("qkv", "gate_up"):
        epilogue = gemv.EPILOGUE_SILU_MUL if matrix == "gate_up" else gemv.EPILOGUE_STORE
        return linear_few_rows(x, w, norm_weight=norm_w, eps=EPS, epilogue=epilogue, out=out, tile=tile,
                               dependent_launch=True, norm_after=norm_after)
    return linear_few_rows(x, w, epilogue=gemv.EPILOGUE_ADD_TO_OUT, out=out, tile=tile, dependent_launch=True)


def sweep(results: dict, rows: int = 8) -> None:
    for model in MODELS:
        for name in MATRICES:
            n, k = shape(model, name)
            ws = weights(n, k)
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            out = torch.randn(rows, n // 2 if name == "gate_up" else n, device="cuda", dtype=DTYPE)
            norm_w = torch.randn(k, device="cuda", dtype=DTYPE)
            row = {"model": model, "matrix": name, "n": n, "k": k, "rows": rows, "bytes": n * k * 2,
                   "cublas_us": 1e3 * time_graph([lambda w=w: F.linear(x, w) for w in ws]), "tiles": {}}
            for tile in SWEEP_TILES:
                try:
                    row["tiles"][label(tile)] = 1e3 * time_graph(
                        [lambda w=w, t=tile: layer_op(name, x, w, out, norm_w, t) for w in ws])
                except Exception as error:  # out of shared memory for that tile
                    row["tiles"][label(tile)] = repr(error)[:80]
            timed = {key: us for key, us in row["tiles"].items() if isinstance(us, float)}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            results["best_tiles"].setdefault(model, {})[name] = next(
                t for t in SWEEP_TILES if label(t) == best).__dict__.copy()
            top = sorted(timed, key=timed.get)[:4]
            print(f"{model:13} {name:8} rows {rows}: cuBLAS {row['cublas_us']:7.2f} us "
                  f"({n * k * 2 / row['cublas_us'] / 1e6:4.2f} TB/s)  best: "
                  + ", ".join(f"{key} {timed[key]:.2f}" for key in top), flush=True)
            results["sweep"].append(row)
            del ws
            torch.cuda.empty_cache()


def layer(results: dict, rows_list) -> None:
    for model, (hidden, qkv, inter, _) in MODELS.items():
        w_qkv, w_o, w_gu, w_down = (weights(n, k) for n, k in ((qkv, hidden), (hidden, hidden),
                                                                 (2 * inter, hidden), (hidden, inter)))
        layers = min(len(w_qkv), len(w_o), len(w_gu), len(w_down))
        norm_w = torch.randn(hidden, device="cuda", dtype=DTYPE)
        best = results["best_tiles"].get(model, {})
        for rows in rows_list:
            residual = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            attn = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            act = torch.empty(rows, inter, device="cuda", dtype=DTYPE)
            qkv_out = torch.empty(rows, qkv, device="cuda", dtype=DTYPE)

            def few_rows(i, tiles, norm_after=False):
                def run():
                    for name, x, w, out in (("qkv", residual, w_qkv[i], qkv_out), ("o", attn, w_o[i], residual),
                                            ("gate_up", residual, w_gu[i], act), ("down", act, w_down[i], residual)):
                        layer_op(name, x, w, out, norm_w, FewRowsTile(**tiles[name]) if name in tiles else None,
                                 norm_after)
                return run

            today = cublas_layers(w_qkv, w_o, w_gu, w_down, norm_w, EPS, rows)
            row = {"model": model, "rows": rows, "today_us": 1e3 * time_graph(today),
                   "few_rows_default_us": 1e3 * time_graph([few_rows(i, {}) for i in range(layers)]),
                   "few_rows_best_us": 1e3 * time_graph([few_rows(i, best) for i in range(layers)]),
                   "few_rows_norm_after_us": 1e3 * time_graph([few_rows(i, best, True) for i in range(layers)])}
            per_layer_bytes = 2 * hidden * (qkv + hidden + 3 * inter)
            row["floor_us"] = per_layer_bytes / results["hbm_tb_per_s"] / 1e6
            print(f"{model:13} layer rows {rows:2}: today {row['today_us']:7.2f} us  few-rows default "
                  f"{row['few_rows_default_us']:7.2f}  best {row['few_rows_best_us']:7.2f}  norm after "
                  f"{row['few_rows_norm_after_us']:7.2f}  floor {row['floor_us']:6.2f}",
                  flush=True)
            results["layer"].append(row)
        del w_qkv, w_o, w_gu, w_down
        torch.cuda.empty_cache()


def norm_after_error(rows: int = 8) -> list[dict]:
    """Largest |difference| against a float64 reference of the normalised products (1B QKV shape, bf16),
    for the prologue norm (rounded as the unfused ops) and the norm applied after the products, beside
    the unfused torch ops' own: what rounding the row's scale later costs."""
    hidden, qkv = MODELS["llama-3.2-1b"][0], MODELS["llama-3.2-1b"][1]
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, generator=generator)
    w = (torch.randn(qkv, hidden, device="cuda", dtype=DTYPE, generator=generator) / hidden**0.5).to(DTYPE)
    norm_w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).to(DTYPE)
    x64 = x.double()
    reference = F.linear(norm_w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS), w.double())
    unfused = F.linear((norm_w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS))
                        .to(DTYPE).float()).to(DTYPE), w)
    out = []
    for name, result in (("unfused torch", unfused),
                         ("prologue", linear_few_rows(x, w, norm_weight=norm_w, eps=EPS)),
                         ("norm after", linear_few_rows(x, w, norm_weight=norm_w, eps=EPS, norm_after=True))):
        out.append({"variant": name, "max_abs_error": float((result.double() - reference).abs().max())})
        print(f"norm error, 1B QKV, {rows} rows: {name:13} {out[-1]['max_abs_error']:.3e}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tiles-from", metavar="JSON",
                        help="take the best tiles from an earlier run's JSON and skip the sweep")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "default_tile": DEFAULT_TILE.__dict__,
               "hbm_tb_per_s": measure_read_bandwidth(torch.device("cuda")) / 1e12,
               "sweep": [], "best_tiles": {}, "layer": []}
    print(f"HBM read bandwidth {results['hbm_tb_per_s']:.2f} TB/s", flush=True)
    results["norm_error"] = norm_after_error()
    if args.tiles_from:
        with open(args.tiles_from) as f:
            results["best_tiles"] = json.load(f)["best_tiles"]
    else:
        sweep(results)
    layer(results, (2, 4, 8, 16))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
