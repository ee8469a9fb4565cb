"""Prefill attention throughput on a CUDA device: xFormers' flash vs cutlass operators (and its own
dispatch), ALiBi (one padded call vs a per-prompt loop), and graphrt's Triton prefix-prefill kernel.

Workload (DESIGN.md §6): 5 prompts, 3,961 tokens, 32 query / 8 KV heads, head size 128, bf16, causal;
the same with a 256-token sliding window; ALiBi; and prefix prefill, where each prompt's first half is
already in a paged cache (block 16) and only its second half is new. FLOPs count only the (query, key)
pairs the mask allows: 4 * D * H per pair (QK^T and PV). Times are medians of
``triton.testing.do_bench`` (CUDA events), each taken twice (``ms``, ``ms_repeat``) to show the
spread. Masks/plans are built outside the timed region, as the runner builds them once per step for
all layers.

    python profiles/bench_prefill.py [--json profiles/results/prefill_h200.json]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

PROMPTS = [1021, 517, 1499, 389, 535]  # 3,961 tokens
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
WINDOW = 256
DTYPE = torch.bfloat16


def allowed_pairs(context_lens: list[int], query_lens: list[int], window: int | None) -> int:
    """(query, key) pairs a causal (windowed) mask lets through, summed over sequences."""
    total = 0
    for ctx, n in zip(context_lens, query_lens):
        for i in range(n):
            visible = ctx + i + 1
            total += min(visible, window) if window is not None else visible
    return total


def tflops(pairs: int, ms: float) -> float:
    return 4 * HEAD_SIZE * NUM_HEADS * pairs / (ms * 1e-3) / 1e12


def _paged_cache(context_lens, query_lens, key, value, gen):
    """A bf16 cache holding random context and then this step's keys/values, on shuffled blocks."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    counts = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(counts) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, used = [], [], 0
    for n, seq_len in zip(counts, seq_lens):
        tables.append(order[used:used + n] + [0] * (max(counts) - n))
        slots.append([order[used + p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)])
        used += n
    cache = torch.randn(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    start = 0
    for ctx, n, s in zip(context_lens, query_lens, slots):
        new_slots = torch.tensor(s[ctx:], device="cuda")
        cache[0, new_slots], cache[1, new_slots] = key[start:start + n], value[start:start + n]
        start += n
    return cache.view(2, num_blocks, -1), torch.tensor(tables, dtype=torch.int32, device="cuda"), seq_lens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per variant (ms)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill needs a CUDA device")

    import triton
    import xformers.ops.fmha as fmha

    from graphrt.attention import xformers_prefill as xp
    from graphrt.attention.triton_prefix_prefill import triton_prefix_prefill
    from graphrt.attention.xformers_compat import xformers_status

    status = xformers_status()
    print(status.describe())
    if not status.usable:
        raise SystemExit(1)

    gen = torch.Generator().manual_seed(0)
    total = sum(PROMPTS)
    q = torch.randn(total, NUM_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    scale = HEAD_SIZE**-0.5
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / NUM_HEADS) for h in range(NUM_HEADS)], device="cuda")
    ops = {"auto": None, "flash": fmha.flash.FwOp, "cutlass": fmha.cutlass.FwOp}
    rows = []

    def bench(name, fn, pairs, **extra):
        fn()
        torch.cuda.synchronize()
        ms, again = (triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median") for _ in range(2))
        row = {"case": name, "ms": ms, "ms_repeat": again, "tflops": tflops(pairs, ms) if pairs else None, **extra}
        rows.append(row)
        print(f"{name:<34} {ms:8.3f} ms " + (f"{row['tflops']:7.1f} TFLOP/s" if pairs else ""), flush=True)

    def plan(**kw):
        return xp.plan_prefill(PROMPTS, num_heads=NUM_HEADS, dtype=DTYPE,
                               device=q.device, **kw)

    zero_ctx = [0] * len(PROMPTS)
    for window in (None, WINDOW):
        p = plan(sliding_window=window)
        pairs = allowed_pairs(zero_ctx, PROMPTS, window)
        tag = f"w{window}" if window else "causal"
        for op_name, op in ops.items():
            bench(f"xformers {op_name} {tag}", lambda: xp.xformers_prefill(q, k, v, PROMPTS, scale, window, plan=p, op=op),
                  pairs, operator=op_name)

    # ALiBi: the shipped path (one call over a zero-padded batch) against a loop of one call per prompt.
    pairs = allowed_pairs(zero_ctx, PROMPTS, None)
    torch.cuda.synchronize()
    p = plan(alibi_slopes=slopes)
    bench("xformers alibi padded (1 call)", lambda: xp.xformers_prefill(q, k, v, PROMPTS, scale, None, slopes, plan=p),
          pairs, operator="auto")
    bench("alibi plan build (per step)", lambda: plan(alibi_slopes=slopes), None)
    per_kv = NUM_HEADS // NUM_KV_HEADS
    loop_biases = [
        fmha.attn_bias.LowerTriangularMaskWithTensorBias(
            xp._alibi_bias(slopes, n, None, DTYPE).unflatten(0, (NUM_KV_HEADS, per_kv)).unsqueeze(0)
        )
        for n in PROMPTS
    ]

    def alibi_loop():
        out = torch.empty_like(q)
        start = 0
        for n, bias in zip(PROMPTS, loop_biases):
            rows_ = slice(start, start + n)
            o = fmha.memory_efficient_attention_forward(
                q[rows_].view(1, n, NUM_KV_HEADS, per_kv, HEAD_SIZE),
                k[rows_].view(1, n, NUM_KV_HEADS, 1, HEAD_SIZE).expand(-1, -1, -1, per_kv, -1),
                v[rows_].view(1, n, NUM_KV_HEADS, 1, HEAD_SIZE).expand(-1, -1, -1, per_kv, -1),
                attn_bias=bias, scale=scale,
            )
            out[rows_] = o.view(n, NUM_HEADS, HEAD_SIZE)
            start += n
        return out

    ref_alibi = xp.xformers_prefill(q, k, v, PROMPTS, scale, None, slopes, plan=p).float()
    loop_err = ((alibi_loop().float() - ref_alibi).norm() / ref_alibi.norm()).item()
    bench("xformers alibi per-prompt loop", alibi_loop, pairs, operator="auto", diff_vs_padded=loop_err)

    # Triton prefix prefill: first with nothing cached (same work as above), then half of each prompt cached.
    starts = torch.tensor([0] + torch.tensor(PROMPTS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cache, tables, seq_lens = _paged_cache(zero_ctx, PROMPTS, k, v, gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flash_out = xp.xformers_prefill(q, k, v, PROMPTS, scale, op=ops["flash"]).float()
    for tiles in [(None, None), (128, 64), (64, 64), (128, 32), (64, 32)]:
        def run(tiles=tiles):
            triton_prefix_prefill(q, k, v, cache, tables, starts, seq_lens_t, max(PROMPTS), scale, out=out,
                                  block_r=tiles[0], block_n=tiles[1])
        run()
        err = ((out.float() - flash_out).norm() / flash_out.norm()).item()
        label = "auto" if tiles[0] is None else f"{tiles[0]}x{tiles[1]}"
        bench(f"triton prefix ctx0 tiles {label}", run, allowed_pairs(zero_ctx, PROMPTS, None),
              tiles=label, diff_vs_flash=err)

    new = [n - n // 2 for n in PROMPTS]
    ctx = [n // 2 for n in PROMPTS]
    qn = torch.randn(sum(new), NUM_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    kn = torch.randn(sum(new), NUM_KV_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    vn = torch.randn(sum(new), NUM_KV_HEADS, HEAD_SIZE, generator=gen).to("cuda", DTYPE)
    cache, tables, seq_lens = _paged_cache(ctx, new, kn, vn, gen)
    starts = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(qn)
    for window in (None, WINDOW):
        bench(f"triton prefix half-cached {'w%d' % window if window else 'causal'}",
              lambda: triton_prefix_prefill(qn, kn, vn, cache, tables, starts, seq_lens_t, max(new), scale, window,
                                            out=out),
              allowed_pairs(ctx, new, window))

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "xformers": status.version,
        "xformers_status": status.describe(),
        "python": platform.python_version(),
        "workload": {"prompts": PROMPTS, "tokens": total, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                     "head_size": HEAD_SIZE, "dtype": str(DTYPE), "window": WINDOW, "block_size": BLOCK_SIZE},
        "rows": rows,
    }
    print(f"\n{'case':<34} {'ms':>8} {'TFLOP/s':>8}")
    for row in rows:
        tf = f"{row['tflops']:8.1f}" if row["tflops"] is not None else f"{'-':>8}"
        print(f"{row['case']:<34} {row['ms']:8.3f} {tf}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
