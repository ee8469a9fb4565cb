"""Triton prefix prefill (new tokens over a cached prefix plus themselves) against the float32 reference.

Without CUDA the kernel runs under Triton's interpreter: ``TRITON_INTERPRET`` is read when
``@triton.jit`` decorates (triton 3.6 and 3.9), so it is set before the kernel module is imported, and
the module is reloaded if another test imported it first without it. Every case packs several
sequences whose context lengths straddle block boundaries (0, 1, block-1, block, block+1, long), on
shuffled physical blocks; cache slots no sequence owns hold NaN, and so does the output before the run.
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

# Triton's own helpers (tl.zeros, ...) are decorated when triton is imported: too late if it already was.
INTERPRETER_MISSED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_prefix_prefill as tpp  # noqa: E402
from graphrt.attention.reference import attend, gather_from_paged_cache  # noqa: E402

tpp = interpreted(tpp, "_prefix_prefill_kernel")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn

#: ||out - ref|| / ||ref||: the output is rounded to the query dtype and the softmax weights enter the
#: second product in it; an fp8 cache is compared with its own dequantised values. float32: the kernel's
#: dots are IEEE float32 on the CPU interpreter and on CUDA alike (on CUDA ``tl.dot`` would round float32
#: operands to TF32, a 10-bit mantissa, unless told otherwise: enough to change a float32 model's greedy
#: tokens between a chunked and a whole prefill); 1.8e-7 on the float32 CPU cases, 2e-6 bounds it at 10x.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 2e-2}
K_SCALE, V_SCALE = 0.37, 0.61


@dataclass
class Case:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    context_lens: list[int]
    query_lens: list[int]
    dtype: torch.dtype = torch.bfloat16
    fp8_cache: bool = False
    alibi: bool = False
    window: int | None = None
    tiles: tuple[int, int] | None = None  # (block_r, block_n) override; None: the launcher's choice
    splits: int | None = None  # context splits; None: the launcher's choice (1 on the CPU)


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def run_case(case: Case, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    H, KVH, D, bs = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # block 0 is the null block; two more nobody owns
    cache_dtype = FP8 if case.fp8_cache else case.dtype

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    # Owned slots get real values; everything else stays NaN, so a stray read shows up in the output.
    cache = torch.full((2, num_blocks, bs, KVH, D), float("nan"))
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, owned, used = [], [], 0
    for n, seq_len in zip(blocks_per_seq, seq_lens):
        table = physical[used:used + n]
        used += n
        tables.append(table)
        owned += [table[pos // bs] * bs + pos % bs for pos in range(seq_len)]
    cache.view(2, -1, KVH, D)[:, owned] = rand(2, len(owned), KVH, D)
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv_cache = cache.view(2, num_blocks, -1).to(cache_dtype)

    T = sum(case.query_lens)
    query, key, value = rand(T, H, D).to(case.dtype), rand(T, KVH, D).to(case.dtype), rand(T, KVH, D).to(case.dtype)
    starts = [0]
    for q in case.query_lens:
        starts.append(starts[-1] + q)
    slopes = _alibi_slopes(H) if case.alibi else None
    k_scale, v_scale = (K_SCALE, V_SCALE) if case.fp8_cache else (1.0, 1.0)
    scale = D**-0.5

    out = torch.full((T, H, D), float("nan"), dtype=case.dtype, device=DEVICE)
    block_r, block_n = case.tiles or (None, None)
    tpp.triton_prefix_prefill(
        query.to(DEVICE),
        key.to(DEVICE),
        value.to(DEVICE),
        kv_cache.to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max(case.query_lens),
        scale,
        case.window,
        slopes.to(DEVICE) if slopes is not None else None,
        k_scale,
        v_scale,
        out,
        block_r=block_r,
        block_n=block_n,
        num_splits=case.splits,
    )
    out = out.cpu().float()
    assert not out.isnan().any(), "an output row was left unwritten or read a slot it does not own"

    for i, (ctx, q_len) in enumerate(zip(case.context_lens, case.query_lens)):
        rows = slice(starts[i], starts[i] + q_len)
        cached_k, cached_v = gather_from_paged_cache(kv_cache, block_tables[i], ctx, KVH, D)
        k = torch.cat([cached_k.float() * k_scale, key[rows].float()])
        v = torch.cat([cached_v.float() * v_scale, value[rows].float()])
        ref = attend(query[rows], k, v, ctx, scale, case.window, slopes)
        err = ((out[rows] - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[case.dtype], f"sequence {i} (context {ctx}, {q_len} new): relative error {err:.2e}"


def _boundary_contexts(block_size: int, long: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1, long]


# Small shapes for the interpreter; tiles of 16 so rows and keys span several tiles.
CPU_CASES = {
    "mha-d64-bs16-fp16": Case(2, 2, 64, 16, _boundary_contexts(16, 45), [3, 1, 17, 5, 2, 9], torch.float16, tiles=(16, 16)),
    "gqa4-d80-bs16-bf16": Case(8, 2, 80, 16, [0, 17, 40], [5, 9, 2], torch.bfloat16, tiles=(16, 16)),
    "gqa8-d64-bs32-fp16": Case(8, 1, 64, 32, _boundary_contexts(32, 70)[1:], [1, 4, 2, 7, 3], torch.float16),
    "mqa-d96-bs16-bf16": Case(6, 1, 96, 16, [15, 16, 33], [3, 6, 1], torch.bfloat16, tiles=(16, 16)),
    "fp8-gqa4-d64-bs16": Case(4, 1, 64, 16, [0, 16, 31, 50], [4, 3, 2, 6], torch.float16, fp8_cache=True, tiles=(16, 16)),
    "fp8-bf16-d128-bs32": Case(4, 2, 128, 32, [1, 33], [5, 2], torch.bfloat16, fp8_cache=True),
    "alibi-gqa2-d64": Case(4, 2, 64, 16, [0, 15, 37], [6, 3, 4], torch.float16, alibi=True, tiles=(16, 16)),
    "window-gqa2-d64": Case(4, 2, 64, 16, [0, 20, 47], [9, 4, 13], torch.float16, window=7, tiles=(16, 16)),
    "window-alibi-mqa-d112": Case(3, 1, 112, 16, [3, 33], [18, 5], torch.bfloat16, alibi=True, window=20, tiles=(16, 16)),
    "window1-d64-fp32": Case(2, 1, 64, 16, [5, 0], [4, 3], torch.float32, window=1),
    # float32 over real contexts: prefixes ending before, at and after block boundaries (and a new run
    # crossing one), then a window of 9 that starts inside the cached prefix for some rows and inside the
    # new tokens for others, with ALiBi.
    "fp32-gqa2-d64-bs16-boundaries": Case(4, 2, 64, 16, _boundary_contexts(16, 37), [2, 3, 18, 1, 4, 6],
                                          torch.float32, tiles=(16, 16)),
    "fp32-mqa-d80-window9-alibi": Case(4, 1, 80, 16, [0, 16, 29], [12, 3, 20], torch.float32, alibi=True,
                                       window=9, tiles=(16, 16)),
    # The cached context split across programs: more splits than some contexts have key tiles (empty
    # splits), a window that leaves the first splits nothing, an fp8 cache.
    "split3-fp32-gqa2-d64-boundaries": Case(4, 2, 64, 16, _boundary_contexts(16, 70), [2, 3, 18, 1, 4, 6],
                                            torch.float32, tiles=(16, 16), splits=3),
    "split5-bf16-mqa-d80-window-alibi": Case(4, 1, 80, 16, [0, 29, 64], [12, 3, 20], torch.bfloat16, alibi=True,
                                             window=9, tiles=(16, 16), splits=5),
    "split2-fp8-gqa4-d64": Case(4, 1, 64, 16, [0, 31, 50], [4, 2, 6], torch.float16, fp8_cache=True,
                                tiles=(16, 16), splits=2),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
@pytest.mark.skipif(
    not torch.cuda.is_available() and INTERPRETER_MISSED,
    reason="triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
)
def test_prefix_prefill_small(name):
    run_case(CPU_CASES[name], seed=zlib.crc32(name.encode()))


def test_rejects_unsupported_head_size():
    q = torch.zeros(1, 1, 48, device=DEVICE)
    cache = torch.zeros(2, 1, 16 * 48, device=DEVICE)
    lens = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head size 48"):
        tpp.triton_prefix_prefill(q, q, q, cache, lens[None], lens, lens[1:], 1, 1.0)


def _gpu_cases() -> dict[str, Case]:
    cases = {}
    ratios = [(32, 32), (32, 8), (32, 4), (16, 1)]  # query/KV heads: 1, 4, 8, MQA
    for i, head_size in enumerate((64, 80, 96, 112, 128, 256)):
        num_heads, num_kv_heads = ratios[i % 4]
        block_size = (16, 32)[i % 2]
        dtype = (torch.bfloat16, torch.float16)[(i // 2) % 2]
        contexts = _boundary_contexts(block_size, 1500) + [3 * block_size - 1]
        queries = [1, 37, 200, 5, 129, 64, 300]
        cases[f"d{head_size}-h{num_heads}/{num_kv_heads}-bs{block_size}-{str(dtype)[6:]}"] = Case(
            num_heads, num_kv_heads, head_size, block_size, contexts, queries, dtype
        )
    mixed = dict(context_lens=_boundary_contexts(16, 900), query_lens=[70, 1, 16, 130, 3, 257])
    cases["fp8-bf16-gqa4-d128"] = Case(32, 8, 128, 16, fp8_cache=True, **mixed)
    cases["fp8-fp16-mqa-d64"] = Case(8, 1, 64, 32, dtype=torch.float16, fp8_cache=True, **mixed)
    cases["alibi-gqa4-d128"] = Case(32, 8, 128, 16, alibi=True, **mixed)
    cases["alibi-mha-d80-fp16"] = Case(16, 16, 80, 32, dtype=torch.float16, alibi=True, **mixed)
    cases["window256-gqa4-d128"] = Case(32, 8, 128, 16, window=256, **mixed)
    cases["window33-mqa-d64-fp16"] = Case(16, 1, 64, 32, dtype=torch.float16, window=33, **mixed)
    cases["window-alibi-fp8-gqa8-d128"] = Case(32, 4, 128, 16, alibi=True, window=100, fp8_cache=True, **mixed)
    # Forced context splits (the automatic choice splits only short chunks: the 1B shape's below).
    cases["split4-gqa4-d128"] = Case(32, 8, 128, 16, splits=4, **mixed)
    cases["split8-window33-mqa-d64-fp16"] = Case(16, 1, 64, 32, dtype=torch.float16, window=33, splits=8, **mixed)
    cases["auto-splits-1b-chunk"] = Case(32, 8, 64, 16, [0, 1500, 2047], [96, 64, 1], dtype=torch.bfloat16)
    return cases


GPU_CASES = _gpu_cases()


@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefix_prefill_gpu(name, seed):
    run_case(GPU_CASES[name], seed=seed)
