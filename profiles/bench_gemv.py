"""Batch-1 linear layers: graphrt's GEMV kernels (with their fused neighbours) against cuBLAS.

For the decoder matrices of Llama-3.2-1B, Llama-3-8B and SmolLM2-135M (bf16), one run measures:

1. a tile sweep: each matrix's GEMV as the layer runs it (norm prologue, SiLU * up or residual-add
   epilogue; launched as dependents) for every tile of ``SWEEP_TILES``, against ``F.linear``;
2. per layer, at one row, what the fused decode path runs without the GEMV kernels (add+RMSNorm
   kernel, cuBLAS QKV; cuBLAS O; add+RMSNorm, cuBLAS gate/up, SiLU*up kernel; cuBLAS down) against
   the GEMV kernels that take those neighbours in, launched plainly and as dependents with
   ``gemv.general_config``'s tiles, and as dependents with the sweep's best tile per matrix; up to 16
   rows also the few-row kernels (``gemv_rows.linear_rows``, dependents, default tiles; ``rows_pdl``);
   and the LM head with the final norm;
3. with ``--rows-sweep R``: each matrix at R rows on the few-row kernels for every tile of
   ``ROWS_SWEEP_TILES``, beside cuBLAS and the GEMV kernels.

Every timing is a CUDA-graph replay of the op over enough weight copies (>= 256 MB) that the weights
stream from HBM as in a real step, so a time includes each kernel's in-graph latency. Medians of 20
replays; the HBM read bandwidth of the same run is recorded beside.

    python profiles/bench_gemv.py --json profiles/results/gemv_h200.json
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from graphrt.bench import measure_read_bandwidth, median_replay_ms
from graphrt.kernels import gemv, gemv_rows
from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.rms_norm import rms_norm

DTYPE = torch.bfloat16
#: (hidden, q + 2 kv width, intermediate, vocabulary) of each model.
MODELS = {
    "llama-3.2-1b": (2048, 3072, 8192, 128256),
    "llama-3-8b": (4096, 6144, 14336, 128256),
    "smollm2-135m": (576, 960, 1536, 49152),
}
MIN_BYTES = 256 << 20
#: Tiles tried (one row: products on CUDA cores, any number of outputs a program).
SWEEP_TILES = [gemv.TileConfig(bn, bk, w)
               for bn, bk, w in itertools.product((4, 8, 16), (256, 512, 1024, 2048), (4, 8)) if bn * bk <= 16384]
MATRICES = ("qkv", "o", "gate_up", "down")
#: Tiles of the few-row kernels tried by ``--rows-sweep`` (tensor-core products: 16 or more outputs).
ROWS_SWEEP_TILES = [gemv_rows.RowsTileConfig(bn, bk, 4, stages)
                    for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (2, 4))]


def time_graph(ops, replays: int = 20) -> float:
    """Median ms of one call of each op in ``ops`` (a list of thunks), all captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for op in ops[:2]:
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op in ops:
            op()
    graph.replay()
    torch.cuda.synchronize()
    ms = median_replay_ms(graph, replays) / len(ops)
    del graph
    return ms


def weights(rows: int, cols: int) -> list[torch.Tensor]:
    """Copies of a random [rows, cols] weight, enough that a pass over them reads >= MIN_BYTES."""
    per = rows * cols * 2
    count = max(1, -(-MIN_BYTES // per))
    return [torch.randn(rows, cols, device="cuda", dtype=DTYPE) / cols**0.5 for _ in range(count)]


def shape(model: str, matrix: str) -> tuple[int, int]:
    """(rows N of the weight, in_features K) of one of a model's decoder matrices (gate/up fused)."""
    hidden, qkv, inter, _ = MODELS[model]
    return {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}[matrix]


def layer_op(matrix: str, x, w, out, norm_w, eps, linear=gemv.linear_gemv, **launch):
    """The matrix's GEMV as the decode layer runs it: QKV and gate/up with the norm (gate/up with SiLU *
    up), O and down adding into the residual stream ``out``. ``linear``: ``gemv.linear_gemv`` or the
    few-row ``gemv_rows.linear_rows`` (the same arguments)."""
    if matrix in ("qkv", "gate_up"):
        epilogue = gemv.EPILOGUE_SILU_MUL if matrix == "gate_up" else gemv.EPILOGUE_STORE
        return linear(x, w, norm_weight=norm_w, eps=eps, epilogue=epilogue, out=out, **launch)
    return linear(x, w, epilogue=gemv.EPILOGUE_ADD_TO_OUT, out=out, **launch)


def sweep(results: dict) -> None:
    """Every tile of SWEEP_TILES on each model's four matrices, as the layer runs them (dependent
    launches); records the best tile per matrix in ``results["best_tiles"]``."""
    eps = 1e-5
    for model in MODELS:
        for name in MATRICES:
            n, k = shape(model, name)
            ws = weights(n, k)
            x = torch.randn(1, k, device="cuda", dtype=DTYPE)
            out = torch.randn(1, n // 2 if name == "gate_up" else n, device="cuda", dtype=DTYPE)
            norm_w = torch.randn(k, device="cuda", dtype=DTYPE)
            row = {"model": model, "matrix": name, "n": n, "k": k, "rows": 1, "bytes": n * k * 2,
                   "cublas_us": 1e3 * time_graph([lambda w=w: F.linear(x, w) for w in ws]), "configs": {}}
            for cfg in SWEEP_TILES:
                label = f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"
                try:
                    row["configs"][label] = 1e3 * time_graph(
                        [lambda w=w, c=cfg: layer_op(name, x, w, out, norm_w, eps, config=c, dependent_launch=True)
                         for w in ws])
                except Exception as error:  # out of shared memory / registers for that tile
                    row["configs"][label] = repr(error)[:80]
            timed = {label: us for label, us in row["configs"].items() if isinstance(us, float)}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            row["default"] = "{0.block_n}x{0.block_k} w{0.num_warps}".format(gemv.general_config(k, name == "gate_up"))
            row["default_us"] = timed.get(row["default"])
            results["best_tiles"].setdefault(model, {})[name] = next(
                c for c in SWEEP_TILES if f"{c.block_n}x{c.block_k} w{c.num_warps}" == best).__dict__.copy()
            top = sorted(timed, key=timed.get)[:4]
            cublas_tb_per_s = n * k * 2 / row["cublas_us"] / 1e6
            print(f"{model:13} {name:8} cuBLAS {row['cublas_us']:7.2f} us ({cublas_tb_per_s:4.2f} TB/s)  default "
                  f"{row['default']} {row['default_us'] or float('nan'):.2f}  best: "
                  + ", ".join(f"{label} {timed[label]:.2f}" for label in top), flush=True)
            results["sweep"].append(row)
            del ws
            torch.cuda.empty_cache()


def rows_sweep(results: dict, rows: int) -> None:
    """Every tile of ROWS_SWEEP_TILES on each model's four matrices at ``rows`` rows, as the layer runs
    them on the few-row kernels (dependent launches), beside cuBLAS and the GEMV kernels at their
    default tiles; records the best tile per matrix in ``results["best_rows_tiles"]``."""
    eps = 1e-5
    for model in MODELS:
        for name in MATRICES:
            n, k = shape(model, name)
            ws = weights(n, k)
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            out = torch.randn(rows, n // 2 if name == "gate_up" else n, device="cuda", dtype=DTYPE)
            norm_w = torch.randn(k, device="cuda", dtype=DTYPE)
            row = {"model": model, "matrix": name, "n": n, "k": k, "rows": rows, "bytes": n * k * 2,
                   "cublas_us": 1e3 * time_graph([lambda w=w: F.linear(x, w) for w in ws]),
                   "gemv_us": 1e3 * time_graph([lambda w=w: layer_op(name, x, w, out, norm_w, eps,
                                                                     dependent_launch=True) for w in ws]),
                   "configs": {}}
            for cfg in ROWS_SWEEP_TILES:
                label = f"{cfg.block_n}x{cfg.block_k} s{cfg.num_stages}"
                try:
                    row["configs"][label] = 1e3 * time_graph(
                        [lambda w=w, c=cfg: layer_op(name, x, w, out, norm_w, eps, linear=gemv_rows.linear_rows,
                                                     config=c, dependent_launch=True) for w in ws])
                except Exception as error:  # out of shared memory / registers for that tile
                    row["configs"][label] = repr(error)[:80]
            timed = {label: us for label, us in row["configs"].items() if isinstance(us, float)}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            results["best_rows_tiles"].setdefault(model, {})[name] = next(
                c for c in ROWS_SWEEP_TILES if f"{c.block_n}x{c.block_k} s{c.num_stages}" == best).__dict__.copy()
            print(f"{model:13} {name:8} rows {rows:2}: cuBLAS {row['cublas_us']:7.2f} us  GEMV {row['gemv_us']:7.2f}  "
                  "few-row best: " + ", ".join(f"{label} {timed[label]:.2f}" for label in sorted(timed, key=timed.get)[:4]),
                  flush=True)
            results["rows_sweep"].append(row)
            del ws
            torch.cuda.empty_cache()


def cublas_layers(w_qkv, w_o, w_gu, w_down, norm_w, eps: float, rows: int) -> list:
    """One thunk per weight copy, each running a decode layer's linear work at ``rows`` rows as the fused
    path runs it without the GEMV kernels: add + RMSNorm kernel, cuBLAS QKV; cuBLAS O; add + RMSNorm,
    cuBLAS gate/up, the SiLU * up kernel; cuBLAS down (random activations, attention left out)."""
    hidden, qkv, inter = norm_w.shape[0], w_qkv[0].shape[0], w_down[0].shape[1]

    def buffer(width):
        return torch.randn(rows, width, device="cuda", dtype=DTYPE)

    hidden_in, residual, attn, normed = (buffer(hidden) for _ in range(4))
    qkv_out, act = buffer(qkv), buffer(inter)

    def run(i):
        rms_norm(hidden_in, norm_w, eps, residual, out=normed)
        torch.mm(normed, w_qkv[i].t(), out=qkv_out)
        o = F.linear(attn, w_o[i])
        rms_norm(o, norm_w, eps, residual, out=normed)
        silu_and_mul(F.linear(normed, w_gu[i]), out=act)
        F.linear(act, w_down[i])

    count = min(len(w_qkv), len(w_o), len(w_gu), len(w_down))
    return [lambda i=i: run(i) for i in range(count)]


def layer(results: dict, rows_list) -> None:
    eps = 1e-5
    for model, (hidden, qkv, inter, vocab) in MODELS.items():
        w_qkv, w_o, w_gu, w_down = (weights(n, k) for n, k in ((qkv, hidden), (hidden, hidden),
                                                                 (2 * inter, hidden), (hidden, inter)))
        layers = min(len(w_qkv), len(w_o), len(w_gu), len(w_down))
        norm_w = torch.randn(hidden, device="cuda", dtype=DTYPE)
        for rows in rows_list:
            residual = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            attn = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            act = torch.empty(rows, inter, device="cuda", dtype=DTYPE)
            qkv_out = torch.empty(rows, qkv, device="cuda", dtype=DTYPE)

            def matrices(i):
                """(name, input, weight copy i, output) of the layer's four products, in order."""
                return (("qkv", residual, w_qkv[i], qkv_out), ("o", attn, w_o[i], residual),
                        ("gate_up", residual, w_gu[i], act), ("down", act, w_down[i], residual))

            def with_gemv(i, dependent_launch, tiles):
                launch = dict(dependent_launch=dependent_launch)

                def run():
                    for name, x, w, out in matrices(i):
                        config = (gemv.TileConfig(**tiles[name]) if name in tiles
                                  else gemv.general_config(x.shape[1], name == "gate_up"))
                        layer_op(name, x, w, out, norm_w, eps, config=config, **launch)
                return run

            def with_rows(i):
                def run():
                    for name, x, w, out in matrices(i):
                        layer_op(name, x, w, out, norm_w, eps, linear=gemv_rows.linear_rows, dependent_launch=True)
                return run

            variants = {"gemv": (False, {}), "gemv_pdl": (True, {})}
            if model in results["best_tiles"]:
                variants["gemv_pdl_best"] = (True, results["best_tiles"][model])
            per_layer_bytes = 2 * hidden * (qkv + hidden + 3 * inter)
            row = {"model": model, "rows": rows, "layer_weight_bytes": per_layer_bytes,
                   "today_us": 1e3 * time_graph(cublas_layers(w_qkv, w_o, w_gu, w_down, norm_w, eps, rows))}
            for name, (dependent_launch, tiles) in variants.items():
                row[f"{name}_us"] = 1e3 * time_graph([with_gemv(i, dependent_launch, tiles) for i in range(layers)])
            if rows <= gemv_rows.MAX_ROWS:  # the few-row kernels (dependents, default tiles)
                row["rows_pdl_us"] = 1e3 * time_graph([with_rows(i) for i in range(layers)])
            row["floor_us"] = per_layer_bytes / results["hbm_tb_per_s"] / 1e6
            print(f"{model:13} layer rows {rows:2}: today {row['today_us']:7.2f} us  " + "  ".join(
                f"{name} {row[name + '_us']:7.2f}" for name in [*variants, "rows_pdl"] if name + "_us" in row)
                + f"  floor {row['floor_us']:6.2f} us",
                flush=True)
            results["layer"].append(row)
        del w_qkv, w_o, w_gu, w_down
        torch.cuda.empty_cache()
        # The LM head with the final norm, today (norm kernel + cuBLAS) against the GEMV (norm prologue).
        heads = weights(vocab, hidden) * 2  # at least two passes, so no head is read from L2 twice in a row
        for rows in rows_list:
            residual = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            logits = torch.empty(rows, vocab, device="cuda", dtype=DTYPE)
            normed = torch.empty(rows, hidden, device="cuda", dtype=DTYPE)
            row = {"model": model, "rows": rows, "matrix": "lm_head",
                   "today_us": 1e3 * time_graph([lambda h=h: torch.mm(rms_norm(residual, norm_w, eps, out=normed), h.t(),
                                                                      out=logits) for h in heads]),
                   "gemv_us": 1e3 * time_graph([lambda h=h: gemv.linear_gemv(residual, h, norm_weight=norm_w, eps=eps,
                                                                       out=logits) for h in heads]),
                   "floor_us": vocab * hidden * 2 / results["hbm_tb_per_s"] / 1e6}
            print(f"{model:13} lm_head rows {rows:2}: today {row['today_us']:7.2f} us  gemv {row['gemv_us']:7.2f} us"
                  f"  floor {row['floor_us']:6.2f} us", flush=True)
            results["lm_head"].append(row)
        del heads
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--sweep-only", action="store_true", help="only the tile sweep")
    parser.add_argument("--rows", default="1", help="row counts of the layer comparison")
    parser.add_argument("--rows-sweep", type=int, default=None, metavar="ROWS",
                        help="also sweep the few-row kernels' tiles at this many rows (2-16)")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "hbm_tb_per_s": measure_read_bandwidth(torch.device("cuda")) / 1e12,
               "sweep": [], "best_tiles": {}, "layer": [], "lm_head": [], "rows_sweep": [], "best_rows_tiles": {}}
    print(f"HBM read bandwidth {results['hbm_tb_per_s']:.2f} TB/s", flush=True)
    if not args.no_sweep:
        sweep(results)
    if args.rows_sweep is not None:
        rows_sweep(results, args.rows_sweep)
    if not args.sweep_only:
        layer(results, [int(r) for r in args.rows.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
