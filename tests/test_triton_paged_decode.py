"""Triton paged decode attention against a float64 reference (softmax attention over the keys the cache
holds, gathered with ``attention.reference.gather_from_paged_cache``), row by row and head by head.

Without CUDA the kernels run under Triton's interpreter (slow: shapes stay tiny). ``TRITON_INTERPRET``
is read when ``@triton.jit`` decorates (triton 3.6 and 3.9, ``triton.knobs.runtime.interpret``), so it
is set before the kernel module is imported, and the module is reloaded if another test imported it
first without it. The ``gpu`` tests sample the full grid of the issue: batch, context lengths around
block boundaries and long, block sizes, GQA ratios, head sizes, dtypes, ALiBi, window, padded rows and
CUDA-graph replay.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_paged_decode as tpd  # noqa: E402
from graphrt.attention.reference import gather_from_paged_cache  # noqa: E402

tpd = interpreted(tpd, "_decode_split_kernel")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Bounds on ||out[b, h] - ref[b, h]|| / ||ref[b, h]||, checked for every row b and head h (a fault in one
#: row, a long one whose output is small, must not hide behind the batch's norm). The output is rounded to
#: the query dtype and the softmax weights enter the second product in it: each of those roundings moves
#: a head's output by about u / sqrt(3) relative (u the dtype's unit roundoff, 2**-8 for bf16, 2**-11 for
#: fp16), so 4u bounds the largest head of a batch. Measured, worst [row, head]: the GPU grid on the H200
#: bf16 3.3e-3 (0.84u), fp16 3.9e-4 (0.80u); the CPU cases (interpreter) bf16 6.6e-3 (1.7u), fp16 3.6e-4
#: (0.7u), float32 2.6e-7 (5.3e-7 on the H200: IEEE float32 dots; bound 2e-6). An fp8 cache is compared
#: with its own dequantised values. One skipped 16-key block moves a 5,000-key row's heads by 5e-2 to
#: 1.7e-1 (the batch's norm by 1e-3).
TOLERANCE = {torch.float32: 2e-6, torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}


@dataclass
class Case:
    batch: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: list[int]
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None  # None: same as dtype
    alibi: bool = False
    window: int | None = None
    num_splits: int | None = None  # None: the host heuristic
    max_seq_len: int | None = None  # captured maximum; None: max(seq_lens)
    block_n: int | None = None  # K/V tile length; None: the default (16: several live splits at short lengths)
    block_ids_ahead: bool = False  # DecodeConfig.block_ids_ahead (with block_n given)


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)


def make_inputs(case: Case, seed: int):
    """Random query, a cache whose unused blocks (null block included) hold NaN, shuffled block tables."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    cache_dtype = case.cache_dtype or case.dtype
    blocks_per_seq = [-(-n // case.block_size) for n in case.seq_lens]
    # Wide enough for the captured maximum, plus a spare null entry, as a graph's fixed-width table is.
    width = -(-(case.max_seq_len or max(case.seq_lens)) // case.block_size) + 1
    num_blocks = sum(blocks_per_seq) + 2
    # Poison first, then fill the blocks the sequences own: a read of anything else shows up as NaN.
    row = case.block_size * case.num_kv_heads * case.head_size
    cache = torch.full((2, num_blocks, row), float("nan"), device=DEVICE, dtype=case.dtype)
    owned = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE)[: sum(blocks_per_seq)] + 1
    cache[:, owned] = torch.randn(2, len(owned), row, generator=gen, device=DEVICE, dtype=case.dtype)
    tables = torch.zeros(case.batch, width, dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = owned[start:start + n].int()
        start += n
    query = torch.randn(case.batch, case.num_heads, case.head_size, generator=gen, device=DEVICE)
    k_scale, v_scale = (0.25, 0.5) if cache_dtype == FP8 else (1.0, 1.0)
    return dict(
        query=query.to(case.dtype),
        kv_cache=cache.to(cache_dtype),
        block_tables=tables,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE),
        alibi_slopes=_alibi_slopes(case.num_heads).to(DEVICE) if case.alibi else None,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def reference(case: Case, inputs) -> torch.Tensor:
    """float64 attention of each sequence's query over its own (dequantised) keys: [B, H, D] float64."""
    outs = []
    group = case.num_heads // case.num_kv_heads
    for b, n in enumerate(case.seq_lens):
        k, v = gather_from_paged_cache(
            inputs["kv_cache"], inputs["block_tables"][b], n, case.num_kv_heads, case.head_size
        )
        k = k.double().repeat_interleave(group, dim=1) * inputs["k_scale"]  # [n, H, D]
        v = v.double().repeat_interleave(group, dim=1) * inputs["v_scale"]
        scores = torch.einsum("hd,nhd->hn", inputs["query"][b].double(), k) * case.head_size ** -0.5
        pos = torch.arange(n, device=scores.device)
        if inputs["alibi_slopes"] is not None:
            scores = scores + inputs["alibi_slopes"].double()[:, None] * (pos - (n - 1))
        if case.window is not None:
            scores = scores.masked_fill((n - 1 - pos) >= case.window, float("-inf"))
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(outs)


def run_kernel(case: Case, inputs, out=None, workspace=None) -> torch.Tensor:
    if out is None:
        out = torch.full_like(inputs["query"], float("nan"))  # poisoned: every element must be written
    return tpd.paged_decode_attention(
        out, inputs["query"], inputs["kv_cache"], inputs["block_tables"], inputs["seq_lens"],
        case.max_seq_len or max(case.seq_lens), case.head_size ** -0.5, case.num_kv_heads, case.block_size,
        workspace=workspace, alibi_slopes=inputs["alibi_slopes"], sliding_window=case.window,
        k_scale=inputs["k_scale"], v_scale=inputs["v_scale"], num_splits=case.num_splits,
        config=None if case.block_n is None else tpd.DecodeConfig(block_n=case.block_n, num_warps=4, num_stages=3,
                                                                  block_ids_ahead=case.block_ids_ahead),
    )


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[B, H] float64: ||out[b, h] - ref[b, h]|| / ||ref[b, h]||, each row and head on its own."""
    return (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what="") -> float:
    """Every [row, head] of ``out`` within ``TOLERANCE[dtype]`` of the reference; returns the largest error."""
    assert not out.isnan().any(), f"{what}: an output element was not written, or a poisoned block was read"
    errors = relative_errors(out, ref)
    worst = int(errors.argmax())
    row, head = divmod(worst, errors.shape[1])
    largest = errors[row, head].item()
    assert largest < TOLERANCE[dtype], (
        f"{what}: row {row}, head {head}: relative error {largest:.2e} >= {TOLERANCE[dtype]:.2e}"
        f" (whole batch {((out.double() - ref).norm() / ref.norm()).item():.2e})"
    )
    return largest


def check(case: Case, seed: int = 0) -> float:
    inputs = make_inputs(case, seed)
    out = run_kernel(case, inputs)
    return assert_matches_reference(out, reference(case, inputs), case.dtype, str(case))


# Small shapes for the CPU interpreter (each runs in well under a second there).
CPU_CASES = {
    "fp16-gqa2-d64-bs16-boundaries": Case(3, 4, 2, 64, 16, [1, 16, 17], torch.float16),
    "bf16-gqa4-d80-bs8-3splits": Case(2, 4, 1, 80, 8, [15, 33], num_splits=3),
    "fp32-mqa-d96-bs32-alibi": Case(2, 4, 1, 96, 32, [64, 65], torch.float32, alibi=True, num_splits=2),
    "bf16-mha-d112-window": Case(3, 2, 2, 112, 16, [31, 64, 5], window=20, num_splits=2),
    "fp8-bf16-d128": Case(2, 4, 2, 128, 16, [50, 70], cache_dtype=FP8, num_splits=2),
    "fp8-fp16-d64-alibi-window": Case(2, 8, 2, 64, 16, [40, 9], torch.float16, FP8, alibi=True, window=24),
    "bf16-d256-alibi-window-1split": Case(1, 2, 1, 256, 16, [40], alibi=True, window=17, num_splits=1),
    # 16-token tiles: the window's 40 keys make 3 live splits of 4, the short row 1.
    "fp16-gqa2-d64-window-merge": Case(2, 4, 2, 64, 16, [100, 12], torch.float16, window=40, num_splits=4,
                                       block_n=16),
    # A long row beside short ones: its output is a mean over 3,000 keys, ~40x smaller than theirs, so a
    # fault in it (one skipped 16-key block moves its heads by ~7e-2) hides in the batch's norm (~5e-3).
    "bf16-gqa2-d64-long-row-beside-short": Case(3, 4, 2, 64, 16, [3000, 5, 17], num_splits=2),
    "fp16-gqa2-d112-bs16": Case(2, 4, 2, 112, 16, [33, 70], torch.float16, num_splits=2),
    # Block ids a tile ahead: several tiles a split, a partial last tile, tiles spanning pages, an empty
    # split, a window and ALiBi.
    "fp8-bf16-d128-ids-ahead": Case(2, 4, 2, 128, 16, [90, 37], cache_dtype=FP8, num_splits=2, block_n=32,
                                    block_ids_ahead=True),
    "fp8-fp16-d64-alibi-window-ids-ahead": Case(2, 8, 2, 64, 8, [77, 9], torch.float16, FP8, alibi=True,
                                                window=40, num_splits=3, block_n=16, block_ids_ahead=True),
    "fp16-gqa2-d64-window-ids-ahead-3-tiles": Case(1, 4, 2, 64, 16, [77], torch.float16, window=40, num_splits=1,
                                                   block_n=16, block_ids_ahead=True),  # keys 37..76, off a page
    "bf16-gqa4-d80-ids-ahead": Case(2, 4, 1, 80, 16, [5, 100], num_splits=4, max_seq_len=160, block_n=16,
                                    block_ids_ahead=True),
}


@pytest.mark.parametrize("case", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_decode_matches_reference(case):
    check(case, seed=len(case.seq_lens))


def test_fp8_products_in_fp16():
    case = Case(2, 8, 2, 64, 16, [40, 9], torch.float16, FP8, alibi=True)
    inputs = make_inputs(case, seed=12)
    out = torch.full_like(inputs["query"], float("nan"))
    tpd.paged_decode_attention(
        out, inputs["query"], inputs["kv_cache"], inputs["block_tables"], inputs["seq_lens"], 40, 0.125, 2, 16,
        alibi_slopes=inputs["alibi_slopes"], k_scale=inputs["k_scale"], v_scale=inputs["v_scale"],
        num_splits=2, fp8_dot_f16=True,
    )
    assert_matches_reference(out, reference(case, inputs), torch.float16, "fp8 cache, fp16 products")


def test_split_count_does_not_change_the_result():
    """16-token tiles, so that 2 and 5 splits all hold keys (70 and 45 tokens) and merge."""
    case = Case(2, 4, 2, 64, 16, [70, 45], torch.float32, block_n=16)
    inputs = make_inputs(case, seed=3)
    results = []
    for splits in (1, 2, 5):
        case.num_splits = splits
        results.append(run_kernel(case, inputs))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter computing NaN padding rows
def test_padded_rows_do_not_disturb_real_rows():
    """Graph padding rows (length 1, table of null blocks whose content is NaN) next to real rows."""
    real = Case(2, 4, 2, 64, 16, [33, 20], torch.float16, num_splits=2)
    inputs = make_inputs(real, seed=4)
    expected = reference(real, inputs)
    pad = 2
    padded = dict(inputs)
    padded["query"] = torch.cat([inputs["query"], torch.randn_like(inputs["query"][:pad])])
    padded["block_tables"] = torch.cat([inputs["block_tables"], torch.zeros_like(inputs["block_tables"][:pad])])
    padded["seq_lens"] = torch.cat([inputs["seq_lens"], torch.ones(pad, dtype=torch.int32, device=DEVICE)])
    case = Case(4, 4, 2, 64, 16, real.seq_lens + [1] * pad, torch.float16, num_splits=2)
    out = run_kernel(case, padded)
    assert_matches_reference(out[:2], expected, torch.float16, "real rows beside padding rows")


def test_shorter_real_lengths_than_the_captured_maximum():
    """The launch is fixed by max_seq_len; real lengths below it (down to 1) still attend correctly."""
    check(Case(3, 4, 1, 64, 16, [1, 17, 9], torch.float16, max_seq_len=200), seed=5)


@pytest.mark.parametrize("seq_lens,splits", [([1, 17, 9], 16), ([40, 130, 3], 5), ([64, 64, 64], 8)])
def test_splits_past_the_live_length_stay_out(seq_lens, splits):
    """A launch fixed for a long context (max_seq_len 512, many splits) running short sequences: splits
    whose slice holds no key neither store nor count in (their workspace rows stay poisoned and unread),
    the live ones merge among themselves, a lone live split writes out alone, and every arrival counter
    is back at zero for the next launch."""
    case = Case(3, 4, 2, 64, 16, seq_lens, torch.float16, num_splits=splits, max_seq_len=512)
    workspace = tpd.DecodeWorkspace.allocate(3, 4, 64, max_splits=16, device=DEVICE)
    workspace.partial_out.fill_(float("nan"))
    workspace.max_logits.fill_(float("nan"))
    for seed in (31, 32):
        inputs = make_inputs(case, seed)
        out = run_kernel(case, inputs, workspace=workspace)
        assert_matches_reference(out, reference(case, inputs), case.dtype, f"seed {seed}")
        assert workspace.arrivals.count_nonzero().item() == 0
    block_n = tpd.default_config(64, 2, torch.device(DEVICE)).block_n
    for b, length in enumerate(seq_lens):
        slice_len = -(-(-(-length // splits)) // block_n) * block_n
        live = -(-length // slice_len)
        written = ~workspace.max_logits[b, :, :splits].isnan()
        assert written[:, live:].sum().item() == 0, (length, live)  # the empty splits wrote nothing
        assert written[:, :live].all().item() == (live > 1), (length, live)  # a lone split writes out alone


def test_last_split_merges_and_leaves_the_workspace_ready():
    """The split that arrives last merges its group's partials (in chunks of splits when the group's
    partials exceed one load: 8 heads x 256 channels take 4 splits at a time, 6 live splits in the first
    row here, one in the second), and every arrival counter is back at zero afterwards, so a second
    launch on the same workspace is right too."""
    case = Case(2, 8, 1, 256, 16, [90, 9], num_splits=6, block_n=16)
    workspace = tpd.DecodeWorkspace.allocate(2, 8, 256, max_splits=8, device=DEVICE)
    workspace.partial_out.fill_(float("nan"))  # stale partials must never be read
    for seed in (21, 22):
        workspace.max_logits.fill_(float("nan"))
        inputs = make_inputs(case, seed)
        out = run_kernel(case, inputs, workspace=workspace)
        assert_matches_reference(out, reference(case, inputs), case.dtype, f"seed {seed}")
        assert not workspace.arrivals.any(), workspace.arrivals
        assert not workspace.max_logits[0, :, :6].isnan().any()  # the first row merged six partials


def test_workspace_is_required_in_size():
    case = Case(2, 4, 2, 64, 16, [40, 40], torch.float16, num_splits=4)
    inputs = make_inputs(case, seed=6)
    small = tpd.DecodeWorkspace.allocate(2, 4, 64, max_splits=2, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        run_kernel(case, inputs, workspace=small)
    wrong_counters = tpd.DecodeWorkspace.allocate(2, 4, 64, device=DEVICE)
    wrong_counters.arrivals = wrong_counters.arrivals.long()
    with pytest.raises(ValueError, match="arrivals"):
        run_kernel(case, inputs, workspace=wrong_counters)


def test_split_heuristic_uses_host_values_only():
    resident = 396  # three 74 KiB programs on each of an H200's 132 multiprocessors
    assert tpd.resident_programs(tpd.DecodeConfig(128, 4, 3), 128, 2, torch.device("cpu")) == 4 * 3
    # A small batch splits to fill one wave, bounded by its context (128 tokens a split at least).
    assert tpd.choose_num_splits(1, 8, 32768, resident) == 49
    assert tpd.choose_num_splits(1, 8, 2048, resident) == 16
    assert tpd.choose_num_splits(8, 8, 2048, resident) == 6
    # 256 programs fit at once: no split; 512 are a wave and a third: 3 splits fill 3.9 waves.
    assert tpd.choose_num_splits(32, 8, 2048, resident) == 1
    assert tpd.choose_num_splits(64, 8, 2048, resident) == 3
    assert tpd.choose_num_splits(64, 8, 512, resident) == 1  # too short for slices of 4 tiles
    # Many waves: no split. A window caps the context that is split.
    assert tpd.choose_num_splits(128, 8, 2048, resident) == 1
    assert tpd.choose_num_splits(1, 1, 32768, resident, sliding_window=128) == 1
    assert tpd.choose_num_splits(1, 1, 10**6, resident, max_splits=8) == 8


def test_resident_programs_follow_registers_and_shared_memory():
    """Off CUDA the stand-in machine has 4 SMs and Hopper's shared memory: 16-bit caches fit 4 programs
    an SM at head size 64 (registers), 3 at 128 (shared memory); fp8 caches 2 (registers)."""
    assert tpd.resident_programs(tpd.default_config(64, 2), 64, 2) == 16
    assert tpd.resident_programs(tpd.default_config(128, 2), 128, 2) == 12
    assert tpd.resident_programs(tpd.default_config(64, 1), 64, 1) == 8
    # The 1B's shapes on an H200 (132 SMs): batch 64 at context 4096 runs unsplit, batch 8 in 8 splits,
    # both measured fastest (profiles/results/decode_splits_h200.json).
    assert tpd.choose_num_splits(64, 8, 4096, 132 * 4) == 1
    assert tpd.choose_num_splits(8, 8, 4096, 132 * 4) == 8


def test_short_contexts_take_short_tiles_and_twice_the_splits(monkeypatch):
    """Where 128-token slices split the captured context at most 4 ways and their programs fill at most
    half the SMs (batch 1 at context 512 on an H200), 64-token tiles and slices give twice the splits;
    longer contexts, larger batches and a caller's own tile keep today's choice."""
    monkeypatch.setattr(tpd, "_device_limits", lambda device: (132, 227 * 1024))
    for head_size in (64, 128):  # SmolLM2 and the 1B; the 8B
        tile = tpd.default_config(head_size, 2)
        assert tile.block_n == 128
        short, splits = tpd.choose_launch(tile, 1, 8, 513, head_size, 2)
        assert (short.block_n, short.num_warps, short.num_stages, splits) == (64, tile.num_warps, tile.num_stages, 8)
        assert tpd.choose_launch(tile, 1, 8, 513, head_size, 2, tile_given=True) == (tile, 4)
        resident = tpd.resident_programs(tile, head_size, 2)
        assert tpd.choose_launch(tile, 1, 8, 4097, head_size, 2) == (tile, tpd.choose_num_splits(1, 8, 4097, resident))
        assert tpd.choose_launch(tile, 256, 8, 513, head_size, 2) == (tile, 1)
        # A window as short as the context splits alike; a default tile of 64 tokens (head size 256, say)
        # keeps today's count (not measured otherwise).
        assert tpd.choose_launch(tile, 1, 8, 10**5, head_size, 2, sliding_window=512)[0].block_n == 64
        assert tpd.choose_launch(short, 1, 8, 513, head_size, 2) == (short, 4)
    tile = tpd.default_config(64, 2)
    # 640 tokens make five 128-token slices: not short. A long context stays long with few programs too
    # (1 kv head: 32 programs); under 128 tokens, or with the splits capped, a short tile adds no split.
    assert tpd.choose_launch(tile, 1, 8, 640, 64, 2) == (tile, 5)
    assert tpd.choose_launch(tile, 1, 8, 639, 64, 2)[1] == 9
    assert tpd.choose_launch(tile, 1, 1, 4097, 64, 2) == (tile, 32)
    assert tpd.choose_launch(tile, 1, 8, 100, 64, 2) == (tile, 1)
    assert tpd.choose_launch(tile, 1, 8, 513, 64, 2, max_splits=4) == (tile, 4)
    # Batch 8 at context 512 (measured no faster): the 1B's 256 programs, SmolLM2's 96 (3 kv heads).
    assert tpd.choose_launch(tile, 8, 8, 513, 64, 2) == (tile, 4)
    assert tpd.choose_launch(tile, 8, 3, 513, 64, 2) == (tile, 4)
    assert tpd.choose_launch(tile, 1, 3, 513, 64, 2)[0].block_n == 64  # SmolLM2 batch 1: 12 programs


def test_unsplit_programs_past_one_wave_take_short_tiles_where_those_fit_one(monkeypatch):
    """Batch 64 at context 512 with 8 kv heads (512 unsplit programs) on an H200: at head size 128 a wave
    of 128-token tiles holds 396 programs and one of 64-token tiles 660, so 64-token tiles; at head size
    64 (4 programs an SM, 528) or with an fp8 cache (not measured) today's tile; past one short wave
    (batch 256), with a caller's tile or 8 warps, today's too."""
    monkeypatch.setattr(tpd, "_device_limits", lambda device: (132, 227 * 1024))
    tile = tpd.default_config(128, 2)
    assert tpd.resident_programs(tile, 128, 2) == 396
    short, splits = tpd.choose_launch(tile, 64, 8, 513, 128, 2)
    assert (short.block_n, short.num_warps, short.num_stages, splits) == (64, 4, tile.num_stages, 1)
    assert tpd.choose_launch(tile, 165, 4, 513, 128, 2)[0].block_n == 64  # 660 programs: one short wave
    assert tpd.choose_launch(tile, 166, 4, 513, 128, 2) == (tile, 1)
    assert tpd.choose_launch(tile, 256, 8, 513, 128, 2) == (tile, 1)
    assert tpd.choose_launch(tile, 99, 4, 513, 128, 2) == (tile, 1)  # 396 programs: one wave already
    assert tpd.choose_launch(tile, 100, 4, 513, 128, 2)[0].block_n == 64
    assert tpd.choose_launch(tpd.default_config(96, 2), 64, 8, 513, 96, 2)[0].block_n == 64  # padded to 128
    # Not measured: a sliding window (more registers), long contexts (one split only when capped), and
    # less shared memory than an H200's (fewer short programs an SM).
    assert tpd.choose_launch(tile, 64, 8, 513, 128, 2, sliding_window=4096) == (tile, 1)
    assert tpd.choose_launch(tile, 64, 8, 32768, 128, 2, max_splits=1) == (tile, 1)
    monkeypatch.setattr(tpd, "_device_limits", lambda device: (132, 160 * 1024))
    assert tpd.choose_launch(tile, 64, 8, 513, 128, 2) == (tile, 1)  # 3 short programs an SM by memory
    monkeypatch.setattr(tpd, "_device_limits", lambda device: (132, 227 * 1024))
    assert tpd.choose_launch(tile, 64, 8, 513, 128, 2, tile_given=True) == (tile, 1)
    eight_warps = tpd.DecodeConfig(block_n=128, num_warps=8, num_stages=3)
    assert tpd.choose_launch(eight_warps, 64, 8, 513, 128, 2)[0] == eight_warps
    small_heads = tpd.default_config(64, 2)
    assert tpd.choose_launch(small_heads, 64, 8, 513, 64, 2) == (small_heads, 1)  # 512 <= 528 resident
    fp8 = tpd.default_config(128, 1)
    assert tpd.choose_launch(fp8, 64, 8, 513, 128, 1)[0] == fp8


def test_fp8_caches_at_head_size_128_take_small_programs_and_split_by_their_residency(monkeypatch):
    """fp8 caches at head size 128 (or padded to it): 64-token tiles of 2 warps, block ids a tile ahead
    (two K/V tiles in shared memory), 4 an SM on an H200 (528 resident), so batch 32 at context 2,048
    runs 2 splits and batch 64 at 4,096 one (the measured fastest counts for that tile); other head
    sizes keep the general tile."""
    monkeypatch.setattr(tpd, "_device_limits", lambda device: (132, 227 * 1024))
    fp8 = tpd.default_config(128, 1)
    assert fp8 == tpd.DecodeConfig(64, 2, 3, block_ids_ahead=True) == tpd.default_config(96, 1)
    assert fp8.kv_buffers == 2
    assert tpd.resident_programs(fp8, 128, 1) == 528
    assert tpd.choose_launch(fp8, 32, 8, 2048, 128, 1) == (fp8, 2)
    assert tpd.choose_launch(fp8, 64, 8, 4096, 128, 1) == (fp8, 1)
    assert tpd.default_config(64, 1).num_warps == 4 and tpd.default_config(256, 1).num_warps == 4


def test_default_config_fits_shared_memory():
    for head_size in (64, 80, 96, 112, 128, 256):
        for element_size in (1, 2, 4):
            cfg = tpd.default_config(head_size, element_size)
            tile = 2 * cfg.block_n * triton.next_power_of_2(head_size) * element_size
            assert 16 <= cfg.block_n <= 128 and tile <= 64 * 1024


# ---------------------------------------------------------------------------------------------------
# GPU: the full grid, sampled. Every head size meets every GQA ratio once (24 cases, 32 query heads);
# the other axes rotate through their values so that each value appears several times.

HEAD_SIZES = [64, 80, 96, 112, 128, 256]
GQA = [(32, 32), (32, 8), (32, 4), (32, 1)]  # ratios 1, 4, 8 and MQA
DTYPES = [(torch.float16, None), (torch.bfloat16, None), (torch.bfloat16, FP8), (torch.float16, FP8)]
BATCHES = [1, 3, 32]


def _lengths(batch: int, block_size: int, i: int) -> list[int]:
    special = [1, block_size - 1, block_size, block_size + 1, 5000, 2 * block_size + 1, 777]
    if batch == 1:  # alone, a long context is the case that splits most
        return [(5000, block_size - 1, 5000, block_size + 1, 1, 5000)[i % 6]]
    return [special[(i + j) % len(special)] for j in range(batch)]


def _gpu_cases() -> dict[str, Case]:
    cases = {}
    for i, (head_size, (heads, kv_heads)) in enumerate(itertools.product(HEAD_SIZES, GQA)):
        r, c = divmod(i, len(GQA))  # head-size row, GQA column: shift each axis per row (a Latin square)
        dtype, cache_dtype = DTYPES[(c + r) % 4]
        block_size = (16, 32)[(c + r // 2) % 2]
        batch = BATCHES[(c + 2 * r) % 3]
        alibi = (c + r) % 3 == 1
        window = (None, 1000, None, 33)[(2 * c + r + r // 4) % 4]
        lens = _lengths(batch, block_size, r)
        name = (f"d{head_size}-h{heads}/{kv_heads}-{str(dtype)[6:]}{'-fp8' if cache_dtype else ''}-bs{block_size}"
                f"-b{batch}{'-alibi' if alibi else ''}{f'-w{window}' if window else ''}")
        cases[name] = Case(batch, heads, kv_heads, head_size, block_size, lens,
                           dtype, cache_dtype, alibi, window)
    return cases


GPU_CASES = _gpu_cases()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed,case", list(enumerate(GPU_CASES.values())), ids=list(GPU_CASES))
def test_decode_grid_on_gpu(seed, case, record_property):
    record_property("largest_head_relative_error", check(case, seed=seed))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_products_in_fp16_on_gpu(dtype):
    """The fp8 cache's fp16-product path (``fp8_dot_f16=True``, 12 % faster at the headline point)."""
    for seed, case in enumerate([
        Case(32, 32, 8, 128, 16, _lengths(32, 16, 1), dtype, FP8),
        Case(3, 32, 4, 96, 32, [5000, 33, 1], dtype, FP8, alibi=True, window=1000),
        Case(1, 32, 1, 256, 16, [5000], dtype, FP8),
    ]):
        inputs = make_inputs(case, seed)
        out = torch.full_like(inputs["query"], float("nan"))
        tpd.paged_decode_attention(
            out, inputs["query"], inputs["kv_cache"], inputs["block_tables"], inputs["seq_lens"],
            max(case.seq_lens), case.head_size ** -0.5, case.num_kv_heads, case.block_size,
            alibi_slopes=inputs["alibi_slopes"], sliding_window=case.window, k_scale=inputs["k_scale"],
            v_scale=inputs["v_scale"], fp8_dot_f16=True,
        )
        assert_matches_reference(out, reference(case, inputs), dtype, str(case))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,kv_heads,head_size,length", [(1, 8, 64, 4096), (1, 3, 64, 512), (4, 8, 128, 5000),
                                                             (16, 8, 128, 3000), (3, 8, 64, 4096)])
def test_split_merge_is_deterministic_on_gpu(batch, kv_heads, head_size, length):
    """Fifty launches on one workspace give the same bits as the first: a merge that read a partial before
    its split had stored it, or a counter left non-zero, would show as a difference or NaN."""
    case = Case(batch, kv_heads * 4, kv_heads, head_size, 16, [length - i for i in range(batch)])
    inputs = make_inputs(case, seed=batch + length)
    workspace = tpd.DecodeWorkspace.allocate(batch, case.num_heads, head_size, device=DEVICE)
    resident = tpd.resident_programs(tpd.default_config(head_size, 2, inputs["query"].device), head_size, 2,
                                     inputs["query"].device)
    assert tpd.choose_num_splits(batch, kv_heads, length, resident) > 1, "the case must exercise the merge"
    first = run_kernel(case, inputs, workspace=workspace)
    assert_matches_reference(first, reference(case, inputs), case.dtype, str(case))
    for _ in range(50):
        assert torch.equal(run_kernel(case, inputs, workspace=workspace), first)
    assert not workspace.arrivals.any()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", [
    Case(1, 32, 8, 128, 16, [513]), Case(8, 32, 8, 64, 16, [2048, 1, 15, 16, 17, 600, 31, 1000]),
    Case(4, 32, 8, 128, 16, [4096, 77, 9, 300], cache_dtype=FP8), Case(3, 32, 4, 96, 32, [900, 33, 1], alibi=True,
                                                                     window=100)], ids=str)
def test_first_tile_prefetch_changes_no_bit_on_gpu(case):
    """Each program asking L2 for its first K/V tile before its dependent wait (``l2_prefetch``), launched
    right after the kernel that writes its query (a GEMV launched as a dependent too, which lets the next
    kernel start at once) over NaN: a read of the query before the wait would see NaN. The same bits as
    without the prefetch."""
    from graphrt.kernels import gemv

    inputs = make_inputs(case, seed=case.batch)
    dependent = torch.cuda.get_device_capability()[0] >= 9
    source = torch.randn(case.batch, 256, device=DEVICE, dtype=inputs["query"].dtype)
    producer = torch.randn(case.num_heads * case.head_size, 256, device=DEVICE, dtype=source.dtype) * 256**-0.5
    inputs["query"] = gemv.linear_gemv(source, producer).view(case.batch, case.num_heads, case.head_size)
    outs = []
    for prefetch in (False, True):
        out = torch.full_like(inputs["query"], float("nan"))
        query = torch.full_like(inputs["query"], float("nan"))
        gemv.linear_gemv(source, producer, out=query.view(case.batch, -1), dependent_launch=dependent)
        tpd.paged_decode_attention(
            out, query, inputs["kv_cache"], inputs["block_tables"], inputs["seq_lens"],
            max(case.seq_lens), case.head_size ** -0.5, case.num_kv_heads, case.block_size,
            alibi_slopes=inputs["alibi_slopes"], sliding_window=case.window, k_scale=inputs["k_scale"],
            v_scale=inputs["v_scale"], dependent_launch=dependent, l2_prefetch=prefetch)
        outs.append(out)
        assert torch.equal(query, inputs["query"])
    assert_matches_reference(outs[1], reference(case, inputs), case.dtype, str(case))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@needs_gpu
def test_batch_past_one_wave_takes_short_tiles_on_gpu():
    """Llama-3-8B's attention at batch 64, captured context 513 (the heuristic's 64-token tiles, one
    split), lengths around block and tile boundaries, against the reference."""
    lengths = [1 + (37 * i) % 513 for i in range(64)]
    lengths[:4] = [513, 64, 65, 128]
    case = Case(64, 32, 8, 128, 16, lengths, max_seq_len=513)
    device = torch.device(DEVICE)
    if tpd.choose_launch(tpd.default_config(128, 2, device), 64, 8, 513, 128, 2, device)[0].block_n != 64:
        pytest.skip("on this GPU 512 programs fit one wave of 128-token tiles, or not one of 64-token tiles")
    check(case, seed=64)


@pytest.mark.gpu
@needs_gpu
def test_padded_batch_on_gpu():
    """32 real rows plus 32 padding rows at long context: real rows are unchanged by the padding."""
    real = Case(32, 32, 8, 128, 16, _lengths(32, 16, 0), num_splits=4)
    inputs = make_inputs(real, seed=7)
    alone = run_kernel(real, inputs)
    pad = 32
    padded = dict(inputs)
    padded["query"] = torch.cat([inputs["query"], torch.randn_like(inputs["query"])])
    padded["block_tables"] = torch.cat([inputs["block_tables"], torch.zeros_like(inputs["block_tables"])])
    padded["seq_lens"] = torch.cat([inputs["seq_lens"], torch.ones(pad, dtype=torch.int32, device=DEVICE)])
    case = Case(64, 32, 8, 128, 16, real.seq_lens + [1] * pad, num_splits=4)
    out = run_kernel(case, padded)
    assert_matches_reference(alone, reference(real, inputs), torch.bfloat16, "real rows alone")
    assert torch.equal(out[:32], alone), "padding rows changed a real row"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_cuda_graph_replay_equals_eager(cache_dtype):
    """Capture cache write + decode once at max_seq_len 3000, replay with new lengths, tables and K/V."""
    from graphrt.attention.triton_cache_write import write_kv_cache

    batch, heads, kv_heads, head_size, block_size, max_len = 8, 32, 8, 128, 16, 3000
    case = Case(batch, heads, kv_heads, head_size, block_size, [max_len] * batch, cache_dtype=cache_dtype,
                alibi=True, max_seq_len=max_len)
    static = make_inputs(case, seed=8)
    row = kv_heads * head_size
    new_key = torch.randn(batch, row, device=DEVICE, dtype=torch.bfloat16)
    new_value = torch.randn_like(new_key)
    slots = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    out = torch.full_like(static["query"], float("nan"))
    workspace = tpd.DecodeWorkspace.allocate(batch, heads, head_size, device=DEVICE)

    def step():
        write_kv_cache(new_key, new_value, static["kv_cache"], slots, kv_heads, static["k_scale"], static["v_scale"])
        run_kernel(case, static, out=out, workspace=workspace)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator().manual_seed(9)
    for trial in range(3):
        lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
        lens[trial] = 1
        # New tables over the same cache: each row takes a random run of its blocks.
        tables = static["block_tables"][torch.randperm(batch, generator=gen)]
        # The new token of each sequence goes into its last slot; row 0 is padding (slot -1).
        last = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size for b, n in enumerate(lens)]
        slots.copy_(torch.tensor([-1] + last[1:]))
        static["block_tables"].copy_(tables)
        static["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["query"].copy_(torch.randn(batch, heads, head_size, generator=gen))
        new_key.copy_(torch.randn(batch, row, generator=gen))
        new_value.copy_(torch.randn(batch, row, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        out.fill_(float("nan"))
        step()  # eager, same inputs (the write is idempotent)
        assert torch.equal(replayed, out), "replay differs from eager"
        real = Case(batch, heads, kv_heads, head_size, block_size, lens, cache_dtype=cache_dtype, alibi=True)
        assert_matches_reference(replayed, reference(real, static), torch.bfloat16, f"replay {trial}")
