"""Experiment: does a batch-1 GEMV whose weight slices arrive by TMA, multi-buffered in shared memory,
stream the presets' matrices faster than ``graphrt.kernels.gemv`` (register loads, one slice in flight
a program)?

    python profiles/bench_gemv_tma.py --json results/gemv_tma_h200.json

For each matrix (one row, plain product, bf16): the current kernel at its measured tile, and a TMA
variant over a sweep of tiles and pipeline depths, each launched plainly inside a CUDA graph that cycles
through enough weight copies (>= 512 MB) that no launch finds its matrix in L2. Prints and writes the
median microseconds a launch and the read bandwidth. CUDA (sm_90) only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from bench_gemv import time_graph

#: (name, rows, in_features) of the bundled presets' decode matrices.
MATRICES = [
    ("1B qkv", 3072, 2048), ("1B o", 2048, 2048), ("1B gate_up", 16384, 2048), ("1B down", 2048, 8192),
    ("8B qkv", 6144, 4096), ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336),
    ("SmolLM2 qkv", 960, 576), ("SmolLM2 down", 576, 1536),
]
#: (outputs a program, K slice, pipeline stages, warps) tried for the TMA variant.
TMA_TILES = [(n, k, s, w) for n, k, s, w in itertools.product((8, 16), (128, 256), (4, 8), (4,))] + [
    (32, 128, 4, 4), (32, 128, 6, 8), (16, 256, 6, 8), (8, 256, 12, 4), (4, 256, 8, 4)]
COPY_BYTES = 512 << 20


@triton.jit
def _gemv_tma_kernel(x_ptr, w_desc, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    first_row = tl.program_id(0) * BLOCK_N
    k_offsets = tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([first_row, k]).to(tl.float32)  # out-of-range rows and columns read as zeros
        x = tl.load(x_ptr + k + k_offsets, mask=k + k_offsets < K, other=0.0).to(tl.float32)
        acc += w * x
    rows = first_row + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)


def _median_us(launch, copies: int) -> float:
    """Median GPU microseconds a launch, from a graph of ``copies`` launches (one per weight copy)."""
    return 1e3 * time_graph([lambda index=index: launch(index) for index in range(copies)], replays=30)


def measure(name: str, rows: int, in_features: int) -> dict:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from graphrt.kernels import gemv

    nbytes = rows * in_features * 2
    copies = max(4, -(-COPY_BYTES // nbytes))
    weights = [torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16) * in_features**-0.5
               for _ in range(copies)]
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), weights[0].float())

    current = _median_us(lambda i: gemv.linear_gemv(x, weights[i], out=out), copies)
    gemv.linear_gemv(x, weights[0], out=out)
    assert torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2), f"{name}: current kernel wrong"
    result = {"matrix": name, "rows": rows, "in_features": in_features, "bytes": nbytes,
              "current_tile": str(gemv.default_config(in_features, rows)), "current_us": round(current, 2),
              "current_tbps": round(nbytes / current / 1e6, 2), "tma": []}
    for block_n, block_k, stages, warps in TMA_TILES:
        if block_k > in_features:
            continue
        descriptors = [TensorDescriptor.from_tensor(w, [block_n, block_k]) for w in weights]

        def launch(index, descriptors=descriptors, block_n=block_n, block_k=block_k, stages=stages, warps=warps):
            _gemv_tma_kernel[(triton.cdiv(rows, block_n),)](x, descriptors[index], out, rows, in_features,
                                                             BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
                                                             num_warps=warps)

        try:
            launch(0)
            torch.cuda.synchronize()
            correct = torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2)
            us = _median_us(launch, copies)
        except Exception as error:  # a tile the compiler or the device refuses: reported, not fatal
            result["tma"].append({"tile": [block_n, block_k, stages, warps], "error": str(error)[:200]})
            continue
        result["tma"].append({"tile": [block_n, block_k, stages, warps], "us": round(us, 2),
                              "tbps": round(nbytes / us / 1e6, 2), "correct": correct})
    best = min((t for t in result["tma"] if "us" in t and t["correct"]), key=lambda t: t["us"], default=None)
    result["tma_best"] = best
    print(f"{name:14s} current {current:7.2f} us ({result['current_tbps']:.2f} TB/s)  TMA best "
          + ("none" if best is None else f"{best['us']:7.2f} us ({best['tbps']:.2f} TB/s) tile {best['tile']}"),
          flush=True)
    del weights
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("bench_gemv_tma: needs a CUDA device of compute capability 9.0 or later", file=sys.stderr)
        return 2
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "matrices": [measure(*matrix) for matrix in MATRICES]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
