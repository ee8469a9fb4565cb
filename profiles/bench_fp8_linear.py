"""FP8 linear layers on the GPU, one matrix at a time: which kernel and tile reads the weights fastest.

For the Llama-3.2-1B and Llama-3-8B matrices (QKV, O, gate/up, down) at decode row counts: the bf16
GEMM (cuBLAS), FP8 tensor cores with per-token activation scales (``fp8_matmul.scaled_mm``, its
quantisation launch included), the W8A16 kernel (``fp8_matmul.w8a16_matmul``) at its default tile, with ``--sweep rows`` both
Triton paths over tiles (``fp8_matmul.RowsTile``, at 8 and 64 rows); at one row the FP8 GEMV kernel
(``gemv.linear_gemv``), with ``--sweep gemv`` over tiles (``thread_sum`` the per-thread width); ``--sweep tma``
the rows kernel reading its weight slices through TMA (``RowsTile.tma``) beside its plain loads; ``--sweep
w16`` (``w16-only``: without the FP8 kernels) the rows kernel on the bf16 weights (``fp8_matmul.rows_matmul``)
beside cuBLAS at 2-64 rows. Each
time is a CUDA graph's replay over enough weight copies to exceed L2 (so every call reads HBM),
divided by the copies: per call, as inside a decode step. Prints ms and TB/s of weight bytes; writes
JSON (profiles/notes_fp8.md reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from graphrt.bench import median_replay_ms
from graphrt.kernels import fp8_matmul, gemv
from graphrt.models.fp8 import quantize_per_channel

MATRICES = {  # name -> (out_features, in_features, SiLU * up epilogue at one row)
    "1b_qkv": (3072, 2048, False), "1b_o": (2048, 2048, False), "1b_gate_up": (16384, 2048, True),
    "1b_down": (2048, 8192, False),
    "8b_qkv": (6144, 4096, False), "8b_o": (4096, 4096, False), "8b_gate_up": (28672, 4096, True),
    "8b_down": (4096, 14336, False),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Bytes of weights the copies of one matrix must exceed (H200 L2: 60 MiB).
ROTATE_BYTES = 256 << 20


def time_per_call(make_calls, copies: int, replays: int = 10) -> float:
    """ms of one call: a graph replaying ``make_calls()`` (one call per weight copy) timed with events."""
    calls = make_calls()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm outside the capture
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_replay_ms(graph, replays) / copies


def bench_matrix(name: str, out_features: int, in_features: int, silu: bool, sweep: set[str],
                 row_counts=ROWS) -> list[dict]:
    rows_out = []
    weight16 = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * in_features**-0.5
    codes, scale = quantize_per_channel(weight16)
    copies = max(2, -(-ROTATE_BYTES // codes.numel()))
    fp8_copies = [(codes.clone(), scale.clone()) for _ in range(copies)]
    bf16_copies = [weight16.clone() for _ in range(max(2, -(-ROTATE_BYTES // (2 * codes.numel()))))]

    def record(kernel, rows, ms, weight_bytes, **extra):
        rows_out.append(dict(matrix=name, kernel=kernel, rows=rows, ms=round(ms, 5),
                             tb_per_s=round(weight_bytes / ms / 1e9, 3), **extra))
        print(f"{name:>11} {kernel:>26} rows {rows:>4} {ms * 1e3:9.2f} us {weight_bytes / ms / 1e9:6.2f} TB/s "
              f"{extra if extra else ''}", flush=True)

    for rows in row_counts:
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        record("bf16 cublas", rows, time_per_call(
            lambda: [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_copies], len(bf16_copies)),
            2 * codes.numel())
        tiles = [None]
        if "rows" in sweep and rows in (8, 64):
            # Split K over 1-4 programs a tile, at 64 and 32 weight rows a program: more programs for the
            # matrices of few output rows (the 1B's, the 8B's QKV, O and down fill 32-96 of 64 rows).
            tiles += [fp8_matmul.RowsTile(min(64, max(16, rows)), bn, bk, 4, stages, split)
                      for bn, bk, stages in ((64, 256, 4), (64, 128, 6), (32, 256, 4)) for split in (1, 2, 4)]
        if "tma" in sweep and 1 < rows <= fp8_matmul.TRITON_MAX_ROWS:
            # The default tile through TMA and with the threads' loads (whichever the default is), then deeper
            # pipelines and other splits through TMA.
            default = fp8_matmul.rows_tile(rows, out_features, in_features, fp8_matmul.multiprocessors(x.device),
                                           fp8_matmul.tma_available(x.device))
            tiles += [dataclasses.replace(default, tma=True), dataclasses.replace(default, tma=False)]
            tiles += [fp8_matmul.RowsTile(default.block_m, 64, bk, 4, stages, split, tma=True)
                      for bk, stages in ((256, 6), (128, 8)) for split in (1, 2, 4)]
        if sweep & {"w16", "w16-only"} and 1 < rows <= fp8_matmul.TRITON_MAX_ROWS:
            bench_16bit_rows(name, x, bf16_copies, rows, record)
        if "w16-only" in sweep:
            continue
        for kernel, function in (("scaled_mm", fp8_matmul.scaled_mm), ("w8a16", fp8_matmul.w8a16_matmul)):
            for tile in tiles:
                chosen = tile or fp8_matmul.rows_tile(rows, out_features, in_features,
                                                    fp8_matmul.multiprocessors(x.device),
                                                    fp8_matmul.tma_available(x.device))
                try:
                    ms = time_per_call(lambda: [lambda c=c, s=s: function(x, c, s, tile=tile)
                                                for c, s in fp8_copies], copies)
                except Exception as error:  # noqa: BLE001 - a tile the compiler refuses (shared memory)
                    print(f"{name} {kernel} {chosen}: {type(error).__name__}")
                    continue
                triton_kernel = kernel == "w8a16" or rows <= fp8_matmul.TRITON_MAX_ROWS
                record(f"{kernel} {'default' if tile is None else 'sweep'}", rows, ms, codes.numel(),
                       **({"tile": chosen.__dict__} if triton_kernel else {}))
    if "w16-only" in sweep:
        return rows_out
    # One row: the FP8 GEMV kernel over tiles (its SiLU * up epilogue for gate/up, as the decode layer runs it).
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    epilogue = gemv.EPILOGUE_SILU_MUL if silu else gemv.EPILOGUE_STORE
    configs = [None] + ([gemv.TileConfig(bn, bk, warps, min(16, bk // (32 * warps))) for bn, bk, warps in
                         itertools.product((4, 8, 16), (1024, 2048), (4, 8))] if "gemv" in sweep else [])
    for config in configs:
        chosen = config or gemv.default_config(in_features, out_features, silu, 1)
        try:
            ms = time_per_call(lambda: [lambda c=c, s=s: gemv.linear_gemv(x, c, epilogue=epilogue, weight_scale=s,
                                                                         config=config)
                                        for c, s in fp8_copies], copies)
        except Exception as error:  # noqa: BLE001
            print(f"{name} gemv {chosen}: {type(error).__name__}")
            continue
        record("fp8 gemv default" if config is None else "fp8 gemv sweep", 1, ms, codes.numel(),
               tile=chosen.__dict__)
    return rows_out


def bench_16bit_rows(name: str, x: torch.Tensor, copies: list[torch.Tensor], rows: int, record) -> None:
    """The rows kernel on bf16 weights (``fp8_matmul.rows_matmul``): its default tile, the default with TMA
    the other way, then 64 and 32 weight rows a program on 128-element slices (the FP8 kernel's bytes a
    slice) four deep and 64-element slices six deep, split 1, 2 and 4 ways, through TMA where 16 tokens
    or fewer."""
    out_features, in_features = copies[0].shape
    default = fp8_matmul.rows_tile(rows, out_features, in_features, fp8_matmul.multiprocessors(x.device),
                                   fp8_matmul.tma_available(x.device), element_size=2)
    block_m = default.block_m
    tiles = [None, dataclasses.replace(default, tma=not default.tma)]
    tiles += [fp8_matmul.RowsTile(block_m, bn, bk, 4, stages, split, tma=block_m == 16)
              for bn, bk, stages in ((64, 128, 4), (64, 64, 6), (32, 128, 4)) for split in (1, 2, 4)]
    for tile in tiles:
        chosen = tile or default
        try:
            ms = time_per_call(lambda: [lambda w=w: fp8_matmul.rows_matmul(x, w, tile=tile) for w in copies],
                               len(copies))
        except Exception as error:  # noqa: BLE001 - a tile the compiler refuses (shared memory)
            print(f"{name} w16 rows {chosen}: {type(error).__name__}")
            continue
        record(f"w16 rows {'default' if tile is None else 'sweep'}", rows, ms, 2 * copies[0].numel(),
               tile=chosen.__dict__)


def best_by(rows: list[dict]) -> dict:
    """Per (matrix, rows): the fastest kernel and, per kernel family, its fastest tile."""
    summary = {}
    for row in rows:
        key = f"{row['matrix']} rows {row['rows']}"
        family = row["kernel"].removesuffix(" default").removesuffix(" sweep")
        entry = summary.setdefault(key, {})
        if family not in entry or row["ms"] < entry[family]["ms"]:
            entry[family] = {k: row[k] for k in ("kernel", "ms", "tb_per_s", *(("tile",) if "tile" in row else ()))}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every measurement and the per-point best here")
    parser.add_argument("--sweep", nargs="*", default=[], choices=["rows", "gemv", "tma", "w16", "w16-only"],
                        help="also sweep these kernels' tiles (the Triton rows kernel at 8 and 64 rows, the GEMV at "
                             "one; tma: the rows kernel reading its weights through TMA, at 2-64 rows; w16: the rows "
                             "kernel on the bf16 weights, beside cuBLAS; w16-only: that and cuBLAS, no FP8 kernel)")
    parser.add_argument("--matrices", nargs="*", default=list(MATRICES), choices=list(MATRICES))
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS), help="row counts (default %(default)s)")
    args = parser.parse_args()
    rows = []
    for name in args.matrices:
        rows += bench_matrix(name, *MATRICES[name], sweep=set(args.sweep), row_counts=args.rows)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, best=best_by(rows))
    for key, entry in result["best"].items():
        print(key, {family: (e["ms"], e.get("tile")) for family, e in entry.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
