"""fp8-cache paged decode: tiles, warps, stages and split counts, with the registers each compiled kernel takes.

The fp8 kernel reads half the bytes of the bf16 one; where it is not faster, its registers are the first
suspect (profiles/notes_paged_decode.md). This sweep times every tile at the issue's point (batch 32,
context 2,048) and at the 8B's long-context point (batch 64, context 4,096), 32 query / 8 kv heads of
128, page 16, next to the bf16 cache's default at both points and the HBM read bandwidth of the run, and
records each compiled kernel's registers and spills as Triton reports them.

    python profiles/bench_paged_decode_fp8.py --json profiles/results/paged_decode_fp8_tiles_h200.json
"""

import argparse
import json
import sys
import time

import torch
import triton
from bench_paged_decode import HEAD_SIZE, NUM_HEADS, Pool, bench_ours, hbm_read_bandwidth

from graphrt.attention.triton_paged_decode import (
    DecodeConfig,
    DecodeWorkspace,
    compiled_kernel_resources,
    default_config,
)

POINTS = [(32, 2048), (64, 4096)]
TILES = [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)
         if not (n == 32 and w == 8)]
SPLITS = (1, 2, 4)


def parse_tile(text: str) -> DecodeConfig:
    """``TOKENSxWARPSxSTAGES``, with a trailing ``a`` for block ids loaded a tile ahead: ``64x2x3a``."""
    ahead = text.endswith("a")
    try:
        tokens, warps, stages = (int(part) for part in text.removesuffix("a").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {text!r} is not TOKENSxWARPSxSTAGES[a], e.g. 64x2x3a") from None
    return DecodeConfig(tokens, warps, stages, block_ids_ahead=ahead)


def compiled_kernels() -> dict:
    """Every compiled variant of the decode kernel so far, by identity: warps, stages, registers, spills."""
    return {k.pop("key"): k for k in compiled_kernel_resources()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tiles", type=parse_tile, nargs="*", default=TILES,
                        help="TOKENSxWARPSxSTAGES[a] (a: block ids a tile ahead); default: 24 tiles")
    parser.add_argument("--splits", type=int, nargs="*", default=list(SPLITS))
    parser.add_argument("--bf16-tiles", type=parse_tile, nargs="*", default=[],
                        help="also time these tiles with a bf16 cache (its default is always timed)")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    started = time.time()
    hbm = hbm_read_bandwidth(device)
    print(f"HBM read (float32 sum of 4 GiB): {hbm['tb_per_s']:.2f} TB/s", flush=True)
    max_tokens = max(b * c for b, c in POINTS) + 4096
    workspace = DecodeWorkspace.allocate(max(b for b, _ in POINTS), NUM_HEADS, HEAD_SIZE, device=device)
    rows = []
    bf16 = Pool(max_tokens, 16, device)
    for batch, context in POINTS:
        r = bench_ours(bf16, batch, context, workspace, rep_ms=60)
        rows.append({"cache": "bf16", "default": True, **r})
        print(f"bf16 default B={batch} ctx={context}: {r['ms'] * 1e3:.1f} us {r['tb_per_s']:.2f} TB/s", flush=True)
        for cfg in args.bf16_tiles:
            for splits in args.splits:
                r = bench_ours(bf16, batch, context, workspace, num_splits=splits, config=cfg, rep_ms=40)
                rows.append({"cache": "bf16", "default": False, **r})
                print(f"bf16 B={batch} ctx={context} {cfg} splits {splits}: {r['ms'] * 1e3:.1f} us "
                      f"{r['tb_per_s']:.2f} TB/s", flush=True)
    del bf16
    torch.cuda.empty_cache()
    fp8 = Pool(max_tokens, 16, device, torch.float8_e4m3fn)
    default = default_config(HEAD_SIZE, 1, device)
    for batch, context in POINTS:
        for cfg in args.tiles:
            for splits in args.splits:
                seen = compiled_kernels()
                try:
                    r = bench_ours(fp8, batch, context, workspace, num_splits=splits, config=cfg, k_scale=0.5,
                                   v_scale=0.5, element_size=1, rep_ms=40)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is a result
                    r = {"batch": batch, "context": context, "splits": splits, "config": cfg.__dict__,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                new = [k for key, k in compiled_kernels().items() if key not in seen]
                r["compiled"] = new
                r["default_tile"] = cfg == default
                r["fraction_of_hbm"] = r.get("tb_per_s", 0.0) / hbm["tb_per_s"]
                rows.append({"cache": "fp8", **r})
                regs = ", ".join(f"{k['registers']} regs {k['spills']} spills" for k in new)
                shown = f"{r['ms'] * 1e3:7.1f} us {r['tb_per_s']:.2f} TB/s ({r['fraction_of_hbm']:.0%})" \
                    if "ms" in r else r["error"][:80]
                print(f"fp8 B={batch} ctx={context} tile {cfg.block_n:3d} warps {cfg.num_warps} stages "
                      f"{cfg.num_stages}{' ids ahead' if cfg.block_ids_ahead else ''} splits {splits}: {shown} {regs}",
                      flush=True)
    best = {}
    for r in rows:
        if r["cache"] == "fp8" and "ms" in r:
            key = (r["batch"], r["context"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for (batch, context), r in sorted(best.items()):
        c = r["config"]
        print(f"best fp8 B={batch} ctx={context}: tile {c['block_n']} warps {c['num_warps']} stages "
              f"{c['num_stages']} ids ahead {c.get('block_ids_ahead', False)} splits {r['splits']}: {r['ms'] * 1e3:.1f} us {r['tb_per_s']:.2f} TB/s "
              f"({r['fraction_of_hbm']:.0%} of HBM read)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "triton": triton.__version__, "hbm_read": hbm, "rows": rows,
                       "wall_s": time.time() - started}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    main()
