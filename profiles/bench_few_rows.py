"""Decode layers at 2-16 rows: the few-rows tensor-core kernel (``graphrt.kernels.gemm_few_rows``, its
neighbours fused in, launched as dependents) against what the fused decode path runs there today
(add + RMSNorm kernels, cuBLAS GEMMs, the SiLU * up kernel).

For Llama-3.2-1B, Llama-3-8B and SmolLM2-135M (bf16), one run measures:

1. a tile sweep at 8 rows: each matrix as the layer runs it (QKV with the norm, O and down adding into
   the residual stream, gate/up with the norm and SiLU * up) for every tile of ``SWEEP_TILES``, beside
   cuBLAS's bare product;
2. per layer (the four matrices and their neighbours, no attention) at 2, 4, 8 and 16 rows: today's path
   against the kernel with the sweep's best tile per matrix and with ``DEFAULT_TILE``.

Timings as in bench_gemv.py: CUDA-graph replays over enough weight copies (>= 256 MB) that weights
stream from HBM, medians of 20 replays.

    python profiles/bench_few_rows.py --json profiles/results/few_rows_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from bench_gemv import DTYPE, MATRICES, MODELS, shape, time_graph, weights

from graphrt.bench import measure_read_bandwidth
from graphrt.kernels import gemv
from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.gemm_few_rows import DEFAULT_TILE, FewRowsTile, linear_few_rows
from graphrt.kernels.rms_norm import rms_norm

SWEEP_TILES = [FewRowsTile(n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5))] + [
    FewRowsTile(64, 128, 8, 4), FewRowsTile(128, 64, 4, 4), FewRowsTile(128, 128, 8, 3)]
EPS = 1e-5


def label(tile: FewRowsTile) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def layer_op(matrix: str, x, w, out, norm_w, tile):
    """The matrix as the decode layer runs it (as bench_gemv.layer_op), on the few-rows kernel."""
    if matrix in ("qkv", "gate_up"):
        epilogue = gemv.EPILOGUE_SILU_MUL if matrix == "gate_up" else gemv.EPILOGUE_STORE
        return linear_few_rows(x, w, norm_weight=norm_w, eps=EPS, epilogue=epilogue, out=out, tile=tile,
                               dependent_launch=True)
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
            hidden_in = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            attn = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            act = torch.empty(rows, inter, device="cuda", dtype=DTYPE)
            qkv_out = torch.empty(rows, qkv, device="cuda", dtype=DTYPE)
            normed = torch.empty(rows, hidden, device="cuda", dtype=DTYPE)
            res_copy = residual.clone()

            def today(i):
                def run():
                    rms_norm(hidden_in, norm_w, EPS, res_copy, out=normed)
                    torch.mm(normed, w_qkv[i].t(), out=qkv_out)
                    o = F.linear(attn, w_o[i])
                    rms_norm(o, norm_w, EPS, res_copy, out=normed)
                    silu_and_mul(F.linear(normed, w_gu[i]), out=act)
                    F.linear(act, w_down[i])
                return run

            def few_rows(i, tiles):
                def run():
                    for name, x, w, out in (("qkv", residual, w_qkv[i], qkv_out), ("o", attn, w_o[i], residual),
                                            ("gate_up", residual, w_gu[i], act), ("down", act, w_down[i], residual)):
                        layer_op(name, x, w, out, norm_w, FewRowsTile(**tiles[name]) if name in tiles else None)
                return run

            row = {"model": model, "rows": rows, "today_us": 1e3 * time_graph([today(i) for i in range(layers)]),
                   "few_rows_default_us": 1e3 * time_graph([few_rows(i, {}) for i in range(layers)]),
                   "few_rows_best_us": 1e3 * time_graph([few_rows(i, best) for i in range(layers)])}
            per_layer_bytes = 2 * hidden * (qkv + hidden + 3 * inter)
            row["floor_us"] = per_layer_bytes / results["hbm_tb_per_s"] / 1e6
            print(f"{model:13} layer rows {rows:2}: today {row['today_us']:7.2f} us  few-rows default "
                  f"{row['few_rows_default_us']:7.2f}  best {row['few_rows_best_us']:7.2f}  floor {row['floor_us']:6.2f}",
                  flush=True)
            results["layer"].append(row)
        del w_qkv, w_o, w_gu, w_down
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "default_tile": DEFAULT_TILE.__dict__,
               "hbm_tb_per_s": measure_read_bandwidth(torch.device("cuda")) / 1e12,
               "sweep": [], "best_tiles": {}, "layer": []}
    print(f"HBM read bandwidth {results['hbm_tb_per_s']:.2f} TB/s", flush=True)
    sweep(results)
    layer(results, (2, 4, 8, 16))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
