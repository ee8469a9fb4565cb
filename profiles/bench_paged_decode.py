"""Paged decode attention: achieved K/V read bandwidth against the HBM read bandwidth of this run.

One run measures, on one CUDA device:

1. HBM read bandwidth: a large float32 sum (bytes read / median time).
2. graphrt's Triton paged decode over batch x context (32 query / 8 kv heads, head size 128, bf16,
   page 16; page 256 beside it), timed as CUDA-graph replays with the L2 flushed before each replay;
   several independent input sets are captured in one graph when one set is small, so a tiny
   problem is not timed as one graph launch. Bandwidth = K/V bytes the step must read / time.
3. xFormers' Triton split-k operator on the same shapes (its paged path needs a page size divisible
   by its 64/128-token tile: page 256), if it imports and runs; otherwise the reason is recorded.
4. Optionally (``--sweep``) tile shapes and split counts at the headline point.

    python profiles/bench_paged_decode.py --json profiles/results/paged_decode_h200.json
"""

import argparse
import json
import math
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from graphrt.attention.triton_paged_decode import (
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    default_config,
    paged_decode_attention,
    resident_programs,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [128, 512, 2048, 8192, 32768]
HEADLINE = (32, 2048)
#: Bytes one graph replay should read at least; smaller problems are repeated with fresh inputs.
MIN_BYTES_PER_REPLAY = 256 << 20
MAX_COPIES = 32
DEVICE = "cuda"


def hbm_read_bandwidth(device) -> dict:
    """Median bandwidth of summing 4 GiB of float32 (read once, result negligible)."""
    x = torch.randn(1 << 30, device=device)
    ms = do_bench(lambda: x.sum(), warmup=50, rep=300, return_mode="median")
    result = {"bytes": x.numel() * 4, "ms": ms, "tb_per_s": x.numel() * 4 / ms / 1e9}
    del x
    torch.cuda.empty_cache()
    return result


class Pool:
    """One large bf16 paged cache; problems take random, disjoint runs of its blocks."""

    def __init__(self, max_tokens: int, block_size: int, device, dtype=DTYPE):
        self.block_size = block_size
        self.num_blocks = max_tokens // block_size + 1
        self.cache = torch.empty(2, self.num_blocks, block_size * NUM_KV_HEADS * HEAD_SIZE, device=device, dtype=dtype)
        for half in self.cache.view(2, -1).split(1 << 28, dim=1):  # chunks: randn needs float32 scratch
            half.copy_(torch.randn(half.shape, device=device))
        self.device = device

    def tables(self, batch: int, context: int, copies: int) -> list[torch.Tensor]:
        per_seq = -(-context // self.block_size)
        needed = batch * per_seq * copies
        if needed > self.num_blocks - 1:
            raise MemoryError(f"{needed} blocks wanted, pool has {self.num_blocks - 1}")
        ids = (torch.randperm(self.num_blocks - 1, device=self.device)[:needed] + 1).int()
        return list(ids.view(copies, batch, per_seq).unbind(0))


def copies_for(kv_bytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(MIN_BYTES_PER_REPLAY / kv_bytes)))


def kv_bytes(batch: int, context: int, element_size: int = 2) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * element_size


def time_graph(step, copies: int, rep_ms: int = 150) -> float:
    """Median ms of one call, from replays of a graph holding ``copies`` calls (L2 flushed per replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            step(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    ms = do_bench(graph.replay, warmup=min(25, rep_ms), rep=rep_ms, return_mode="median")
    del graph
    return ms / copies


def bench_ours(pool: Pool, batch: int, context: int, workspace, num_splits=None, config=None,
               k_scale=1.0, v_scale=1.0, element_size=2, rep_ms=100, eager=False, fp8_dot_f16=True) -> dict:
    nbytes = kv_bytes(batch, context, element_size)
    copies = copies_for(nbytes)
    tables = pool.tables(batch, context, copies)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=pool.device)
    queries = [torch.randn(batch, NUM_HEADS, HEAD_SIZE, device=pool.device, dtype=DTYPE) for _ in range(copies)]
    outs = [torch.empty_like(q) for q in queries]
    cfg = config or default_config(HEAD_SIZE, element_size, pool.device)
    resident = resident_programs(cfg, HEAD_SIZE, element_size, pool.device)
    splits = num_splits or choose_num_splits(batch, NUM_KV_HEADS, context, resident)

    def step(i):
        paged_decode_attention(outs[i], queries[i], pool.cache, tables[i], seq_lens, context, HEAD_SIZE ** -0.5,
                               NUM_KV_HEADS, pool.block_size, workspace=workspace, num_splits=splits,
                               config=cfg, k_scale=k_scale, v_scale=v_scale, fp8_dot_f16=fp8_dot_f16)

    ms = time_graph(step, copies, rep_ms)
    if eager:
        torch.cuda.synchronize()
        ms_eager = do_bench(lambda: step(0), warmup=25, rep=100, return_mode="median")
    return {"batch": batch, "context": context, "page": pool.block_size, "splits": splits, "copies": copies,
            "config": cfg.__dict__, "resident": resident, **({"ms_eager": ms_eager} if eager else {}), "ms": ms,
            "kv_bytes": nbytes, "tb_per_s": nbytes / ms / 1e9}


class XFormersSplitK:
    """xFormers' Triton split-k forward on our cache (same layout: pages, token, kv head, channel)."""

    def __init__(self):
        self.reason = None
        self.ignored = []
        try:
            from xformers.ops.fmha import triton_splitk
            from xformers.ops.fmha.attn_bias import PagedBlockDiagonalPaddedKeysMask
            from xformers.ops.fmha.common import Inputs
        except Exception as exc:  # noqa: BLE001 - any import failure is the answer
            self.reason = f"import failed: {type(exc).__name__}: {exc}"
            return
        self.op, self.mask_cls, self.inputs_cls = triton_splitk.FwOp, PagedBlockDiagonalPaddedKeysMask, Inputs
        import xformers

        self.version = xformers.__version__

    def make(self, pool: Pool, query, table, seq_lens: list[int]):
        """A callable computing attention for query [B, H, D] through xFormers, output [1, B, G, Hg, D]."""
        batch = query.shape[0]
        group = NUM_HEADS // NUM_KV_HEADS
        bias = self.mask_cls.from_seqlens([1] * batch, seq_lens, table, pool.block_size, device=pool.device)
        q = query.view(1, batch, NUM_KV_HEADS, group, HEAD_SIZE)
        flat = pool.cache.view(2, 1, -1, NUM_KV_HEADS, 1, HEAD_SIZE).expand(-1, -1, -1, -1, group, -1)
        inp = self.inputs_cls(query=q, key=flat[0], value=flat[1], attn_bias=bias, scale=HEAD_SIZE ** -0.5)
        reasons = self.op.not_supported_reasons(inp)
        # Its compiled extension may not load (torch mismatch); the Triton kernel does not need it.
        blocking = [r for r in reasons if "build with CUDA" not in r]
        self.ignored = sorted(set(self.ignored) | (set(reasons) - set(blocking)))
        if blocking:
            raise RuntimeError("; ".join(blocking))
        return lambda: self.op.apply(inp, needs_gradient=False)[0]

    def bench(self, pool: Pool, batch: int, context: int) -> dict:
        nbytes = kv_bytes(batch, context)
        copies = copies_for(nbytes)
        tables = pool.tables(batch, context, copies)
        calls = [self.make(pool, torch.randn(batch, NUM_HEADS, HEAD_SIZE, device=pool.device, dtype=DTYPE), t,
                           [context] * batch) for t in tables]
        extra = {}
        if (batch, context) == HEADLINE:  # eager too: one call from Python, host included
            extra["ms_eager"] = do_bench(calls[0], warmup=25, rep=100, return_mode="median")
        try:
            ms, mode = time_graph(lambda i: calls[i](), copies), "graph"
        except Exception:  # noqa: BLE001 - fall back to eager timing if it cannot be captured
            torch.cuda.synchronize()
            ms, mode = sum(do_bench(c, warmup=25, rep=100, return_mode="median") for c in calls) / copies, "eager"
        return {"batch": batch, "context": context, "page": pool.block_size, "copies": copies, "ms": ms,
                "kv_bytes": nbytes, "tb_per_s": nbytes / ms / 1e9, "timing": mode, **extra}


def check_agreement(pool256: Pool, xf: XFormersSplitK, workspace) -> dict:
    """Ours vs xFormers vs a float32 reference at the headline shape (same cache, same query)."""
    from graphrt.attention.reference import attend, gather_from_paged_cache

    batch, context = HEADLINE
    (table,) = pool256.tables(batch, context, 1)
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, device=pool256.device, dtype=DTYPE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=pool256.device)
    ours = paged_decode_attention(torch.empty_like(query), query, pool256.cache, table, seq_lens, context,
                                  HEAD_SIZE ** -0.5, NUM_KV_HEADS, 256, workspace=workspace)
    ref = torch.stack([
        attend(query[b:b + 1], *gather_from_paged_cache(pool256.cache, table[b], context, NUM_KV_HEADS, HEAD_SIZE),
               context - 1, HEAD_SIZE ** -0.5)[0]
        for b in range(batch)
    ])
    result = {"ours_vs_reference": ((ours.float() - ref).norm() / ref.norm()).item()}
    if xf.reason is None:
        try:
            theirs = xf.make(pool256, query, table, [context] * batch)().view(batch, NUM_HEADS, HEAD_SIZE)
            result["xformers_vs_reference"] = ((theirs.float() - ref).norm() / ref.norm()).item()
        except Exception as exc:  # noqa: BLE001
            xf.reason = f"run failed: {type(exc).__name__}: {exc}"
    return result


def sweep(pool: Pool, fp8_pool: Pool, workspace) -> list[dict]:
    """fp8 product dtype and tiles at the headline point; split counts around the heuristic's choices."""
    rows = []
    batch, context = HEADLINE
    for cfg in (DecodeConfig(128, 4, 3), DecodeConfig(64, 4, 3)):
        for f16 in (False, True):
            try:
                r = bench_ours(fp8_pool, batch, context, workspace, config=cfg, element_size=1, rep_ms=60,
                               fp8_dot_f16=f16)
            except Exception as exc:  # noqa: BLE001
                r = {"error": f"{type(exc).__name__}: {str(exc)[:200]}", "batch": batch, "context": context}
            rows.append({"cache": "fp8", "fp8_dot_f16": f16, **r})
    points = {HEADLINE: (1, 2, 3), (64, 2048): (1, 2, 3, 4), (64, 8192): (1, 2, 3, 4), (8, 8192): (4, 6, 8),
              (16, 8192): (2, 3, 4), (1, 32768): (32, 49, 64), (128, 2048): (1, 2)}
    for (batch, context), splits_list in points.items():
        for splits in splits_list:
            r = bench_ours(pool, batch, context, workspace, num_splits=splits, rep_ms=60)
            rows.append({"cache": "bf16", **r})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the full results here")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile shapes and split counts")
    parser.add_argument("--batches", type=int, nargs="*", default=BATCHES)
    parser.add_argument("--contexts", type=int, nargs="*", default=CONTEXTS)
    parser.add_argument("--no-xformers", action="store_true")
    args = parser.parse_args()
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    started = time.time()
    props = torch.cuda.get_device_properties(device)
    results = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE, "dtype": "bfloat16"},
        "timing": "CUDA-graph replay, L2 flushed before each replay, median (triton.testing.do_bench)",
    }
    hbm = hbm_read_bandwidth(device)
    results["hbm_read"] = hbm
    print(f"HBM read (float32 sum of 4 GiB): {hbm['tb_per_s']:.2f} TB/s", flush=True)

    free = torch.cuda.mem_get_info(device)[0]
    token_bytes = kv_bytes(1, 1)
    pool_tokens = min(max(b * c for b in args.batches for c in args.contexts) + (1 << 20),
                      int(free * 0.8) // token_bytes)
    pool16 = Pool(pool_tokens, 16, device)
    max_splits = 64
    workspace = DecodeWorkspace.allocate(max(args.batches), NUM_HEADS, HEAD_SIZE, max_splits, device)

    xf = XFormersSplitK() if not args.no_xformers else None
    if xf is not None and xf.reason is None:
        results["xformers_version"] = xf.version

    grid = []
    for batch in args.batches:
        for context in args.contexts:
            if -(-context // 16) * batch > pool16.num_blocks - 1:
                grid.append({"batch": batch, "context": context, "skipped": "does not fit the pool"})
                continue
            row = bench_ours(pool16, batch, context, workspace, eager=(batch, context) == HEADLINE)
            row["fraction_of_hbm"] = row["tb_per_s"] / hbm["tb_per_s"]
            grid.append(row)
            print(f"ours  page 16  B={batch:4d} ctx={context:6d} splits={row['splits']:2d} "
                  f"{row['ms'] * 1e3:9.1f} us {row['tb_per_s']:5.2f} TB/s ({row['fraction_of_hbm']:.0%})", flush=True)
    results["ours_page16"] = grid

    # Page 256: ours and xFormers on the same pool (xFormers' paged path needs page % 64 == 0).
    del pool16
    torch.cuda.empty_cache()
    pool256 = Pool(pool_tokens, 256, device)
    if xf is not None:
        results["agreement_headline"] = check_agreement(pool256, xf, workspace)
    rows256, rows_xf = [], []
    for batch in args.batches:
        for context in args.contexts:
            if -(-context // 256) * batch > pool256.num_blocks - 1:
                continue
            row = bench_ours(pool256, batch, context, workspace)
            row["fraction_of_hbm"] = row["tb_per_s"] / hbm["tb_per_s"]
            rows256.append(row)
            line = f"ours  page 256 B={batch:4d} ctx={context:6d} {row['tb_per_s']:5.2f} TB/s"
            if xf is not None and xf.reason is None:
                try:
                    x = xf.bench(pool256, batch, context)
                    x["fraction_of_hbm"] = x["tb_per_s"] / hbm["tb_per_s"]
                    rows_xf.append(x)
                    line += f" | xformers split-k {x['tb_per_s']:5.2f} TB/s ({x['timing']})"
                except Exception as exc:  # noqa: BLE001
                    xf.reason = f"run failed at B={batch} ctx={context}: {type(exc).__name__}: {str(exc)[:300]}"
            print(line, flush=True)
    results["ours_page256"] = rows256
    if xf is not None:
        results["xformers_splitk_page256"] = rows_xf
        results["xformers_status"] = xf.reason or "ran"
        results["xformers_ignored_checks"] = xf.ignored

    # fp8 cache at the headline point: half the bytes.
    del pool256
    torch.cuda.empty_cache()
    batch, context = HEADLINE
    fp8 = Pool(batch * context * copies_for(kv_bytes(batch, context, 1)) + 4096, 16, device, torch.float8_e4m3fn)
    row = bench_ours(fp8, batch, context, workspace, k_scale=0.5, v_scale=0.5, element_size=1)
    row["fraction_of_hbm"] = row["tb_per_s"] / hbm["tb_per_s"]
    results["ours_fp8_headline_page16"] = row

    if args.sweep:
        pool_sweep = Pool(1 << 22, 16, device)
        results["sweep"] = sweep(pool_sweep, fp8, workspace)
        del pool_sweep
        ok = [r for r in results["sweep"] if "ms" in r]
        print("\nsweep, headline point (cache, block_n, warps, stages, splits: TB/s of cache bytes, us):")
        head = [r for r in ok if (r["batch"], r["context"]) == HEADLINE]
        for r in head:
            c = r["config"]
            print(f"  {r['cache']}{' f16-dot' if r.get('fp8_dot_f16') else ''} {c['block_n']:4d} {c['num_warps']} "
                  f"{c['num_stages']} {r['splits']:2d}: {r['tb_per_s']:.2f} {r['ms'] * 1e3:.1f}")
        for key in sorted({(r["batch"], r["context"]) for r in ok} - {HEADLINE}):
            cells = [f"{r['splits']}:{r['tb_per_s']:.2f}" for r in ok if (r["batch"], r["context"]) == key]
            print(f"  splits at B={key[0]} ctx={key[1]}: " + " ".join(cells))
        errors = [r for r in results["sweep"] if "error" in r]
        if errors:
            print(f"  {len(errors)} sweep configs failed, first: {errors[0]}")

    def at(rows, key):
        return next((r for r in rows if (r.get("batch"), r.get("context")) == key and "ms" in r), None)

    head16, head256 = at(grid, HEADLINE), at(rows256, HEADLINE)
    headx = at(rows_xf, HEADLINE) if xf is not None else None
    results["headline"] = {
        "batch": HEADLINE[0], "context": HEADLINE[1], "hbm_read_tb_per_s": hbm["tb_per_s"],
        "ours_page16": head16, "ours_page256": head256, "xformers_page256": headx,
        "ours_fp8_page16": row, "goal_fraction": 0.70,
    }
    results["wall_s"] = time.time() - started

    print("\nK/V read bandwidth, TB/s (fraction of measured HBM read "
          f"{hbm['tb_per_s']:.2f} TB/s); ours page 16 / ours page 256 / xFormers split-k page 256")
    print("batch \\ context " + "".join(f"{c:>22d}" for c in args.contexts))
    for batch in args.batches:
        cells = []
        for context in args.contexts:
            a, b = at(grid, (batch, context)), at(rows256, (batch, context))
            c = at(rows_xf, (batch, context)) if xf is not None else None
            fmt = lambda r: f"{r['tb_per_s']:.2f}" if r else "-"  # noqa: E731
            cells.append(f"{fmt(a)}/{fmt(b)}/{fmt(c)}".rjust(22))
        print(f"{batch:>15d} " + "".join(cells))
    if head16:
        print(f"\nheadline B={HEADLINE[0]} ctx={HEADLINE[1]}: ours page 16 {head16['ms'] * 1e3:.1f} us = "
              f"{head16['tb_per_s']:.2f} TB/s "
              f"({head16['fraction_of_hbm']:.0%} of HBM read), page 256 "
              f"{head256['tb_per_s']:.2f} TB/s; fp8 cache {row['tb_per_s']:.2f} TB/s of fp8 bytes "
              f"({row['ms'] * 1e3:.1f} us)")
        if "ms_eager" in head16:
            print(f"  eager (Python launcher per call, do_bench): {head16['ms_eager'] * 1e3:.1f} us")
    if headx:
        print(f"xFormers split-k page 256: {headx['ms'] * 1e3:.1f} us = {headx['tb_per_s']:.2f} TB/s in a graph; "
              f"eager FwOp.apply {headx.get('ms_eager', float('nan')) * 1e3:.1f} us")
    elif xf is not None:
        print(f"xFormers split-k: {xf.reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    main()
