"""Paged decode attention in Triton: one query token per sequence, flash-decoding split-K.

Cache layout (shared with ``reference.py``): per layer ``kv_cache [2, num_blocks, block_size * KVH * D]``,
index 0 keys, 1 values; inside a block token-major, then kv head, then channel. Token ``n`` of sequence
``b`` lives in physical block ``block_tables[b, n // block_size]`` at offset ``n % block_size``.

Work split. Program ``(b, g, s)`` takes sequence ``b``, kv head ``g`` and the ``s``-th of ``num_splits``
equal slices of that sequence's key range (the whole context, or its last ``W`` tokens with a sliding
window, so tiles outside the window are never visited). It walks its slice in tiles of ``BLOCK_N``
tokens (a tile may span several cache blocks), loads each K/V tile once for all ``H / KVH`` query heads
of the group (padded to 16 rows so both products run on the tensor cores), and keeps an online softmax.
With one split it normalises and writes ``out`` directly; otherwise it writes its running max, sum and
unnormalised output to a ``DecodeWorkspace`` and counts itself in at the workspace's arrival counter of
its (sequence, kv head): the split that arrives last merges the group's partials and writes ``out``, then
sets the counter back to zero for the next launch. Only the splits whose slice holds keys at the live
length take part (a graph captured for long contexts runs short sequences with most slices empty); a
lone live split writes ``out`` directly. One kernel per attention call, not a split kernel and
a reduce kernel: at batch 1 a separate reduce launch costs a large share of a layer's attention time.

Launched as a programmatic dependent, the kernel can ask L2 for its first K/V tile before it waits for
the kernel before it (``l2_prefetch``, off by default: ``L2_PREFETCH_FIRST_TILE``): the cache rows of
earlier steps and the host-uploaded lengths and block tables are final before the step's first kernel,
so their lines can stream while the QKV kernel finishes, and the loads after the wait find them in L2
(rows this step writes are written through L2, so a line prefetched before the write is updated, never
stale: the hint changes no result).

CUDA graphs. The grid is ``(B, KVH, num_splits)``, with ``num_splits`` and the K/V tile chosen on the host
from the batch size, the *captured maximum* context ``max_seq_len`` and the head counts, never from the
data (``choose_launch``). Slice
bounds and loop trip counts come from ``seq_lens`` on the device, so one captured launch replays
correctly for any real lengths up to ``max_seq_len``. Preallocate the workspace with
``DecodeWorkspace.allocate`` so that nothing is allocated inside capture.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from graphrt.kernels.dependent_launch import launch_options, wait_for_previous_kernel
from graphrt.kernels.device import multiprocessors
from graphrt.kernels.l2_prefetch import line_elements, prefetch_to_l2, prefetching

#: Whether a dependent launch asks L2 for each program's first K/V tile before its wait by default
#: (``l2_prefetch``): off until a measurement of the captured step says otherwise (profiles/step_ab.py).
L2_PREFETCH_FIRST_TILE = False

#: Upper bound on splits per (sequence, kv head); the default workspace width.
MAX_SPLITS = 64
#: Fewest tokens a split is given before another split is worth its partial result.
MIN_TOKENS_PER_SPLIT = 128
#: K/V tile and fewest tokens a split where 128-token slices split the captured context (the graph's
#: ``max_seq_len``, under 640 tokens) at most 4 ways and their programs fill at most half the SMs
#: (batch 1 of an engine captured for a short context): each program's chain of dependent loads,
#: not bandwidth, sets the time, and shorter slices shorten it. Once the programs fill more than half
#: the SMs the extra splits no longer pay for their merge, hence that bound (profiles/notes_paged_decode.md).
SHORT_CONTEXT_TILE = 64
#: Programs an SM holds with ``SHORT_CONTEXT_TILE``-token tiles, 4 warps, a 16-bit cache and head size 128
#: (the compiled sm_90 kernel takes fewer registers a thread and about half the shared memory of the
#: 128-token one): 5, where 128-token tiles fit 3. Used where unsplit programs overflow one wave of
#: 128-token tiles but fit one of 64-token tiles (``choose_launch``): one wave of programs instead of
#: a partial second one (profiles/notes_paged_decode.md).
#: Not with a sliding window (that kernel takes more registers: 4 programs an SM) and only for captured
#: contexts under ``_ONE_WAVE_CONTEXT_BOUND`` (where one split is the heuristic's choice for such batches). ``resident_programs`` keeps its own estimate (3) for the short-context rule.
_SHORT_TILE_PROGRAMS_PER_SM = {(2, 128): 5}
_ONE_WAVE_CONTEXT_BOUND = 1024
#: K + V bytes of one tile: enough bytes in flight per program to cover HBM latency
#: (profiles/notes_paged_decode.md).
TILE_BYTES = 64 * 1024
#: Shared memory a program needs beyond its K/V tile (what the kernel Triton compiles for sm_90 takes
#: over a 64 KiB tile, rounded up). Triton keeps one K/V tile in shared memory unless the block ids are
#: loaded a tile ahead (``DecodeConfig.block_ids_ahead``).
_SMEM_OVERHEAD = 9 * 1024
#: Programs of 4 warps per SM at most, from the registers the compiled sm_90 kernel takes a thread, by
#: cache element size: 16-bit caches fit 3 at head size 128 (beside the shared memory limit) and 4 at
#: head size 64 (profiles/notes_paged_decode.md has the split counts this gives); fp8 caches, whose
#: kernel takes the most registers, fit 2 (4 of the 2-warp programs of ``_FP8_TILES``).
_MAX_PROGRAMS_PER_SM = {1: 2, 2: 3, 4: 3}
_MAX_PROGRAMS_PER_SM_SMALL_HEADS = {2: 4}  # head size <= 64
#: Shared memory assumed where the device does not say (Hopper's per-block opt-in limit).
_DEFAULT_SMEM = 227 * 1024

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time tile shape of the split kernel. ``block_ids_ahead``: each tile's block ids are loaded
    one tile ahead, so its K/V addresses do not wait on a load of the same iteration and Triton keeps
    ``num_stages - 1`` K/V tiles in flight in shared memory (one otherwise)."""

    block_n: int  # tokens per K/V tile
    num_warps: int
    num_stages: int
    block_ids_ahead: bool = False

    @property
    def kv_buffers(self) -> int:
        """K/V tiles a program holds in shared memory."""
        return max(1, self.num_stages - 1) if self.block_ids_ahead else 1


@lru_cache(maxsize=None)
def _cuda_shared_memory(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) or _DEFAULT_SMEM


def _device_limits(device: torch.device | None) -> tuple[int, int]:
    """(multiprocessors, shared memory per block); a small stand-in machine off CUDA (interpreter)."""
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return multiprocessors(device), _cuda_shared_memory(index)
    return multiprocessors(torch.device("cpu")), _DEFAULT_SMEM


def _bytes_per_token(head_size: int, cache_element_size: int) -> int:
    return 2 * triton.next_power_of_2(head_size) * cache_element_size  # K and V rows, padded


def _program_shared_memory(block_n: int, head_size: int, cache_element_size: int, buffers: int = 1) -> int:
    """Shared memory one split-kernel program takes with ``buffers`` ``block_n``-token K/V tiles."""
    return buffers * block_n * _bytes_per_token(head_size, cache_element_size) + _SMEM_OVERHEAD


#: fp8 caches at head size 128 (padded): 64-token tiles of 2 warps, 3 stages, block ids a tile ahead.
#: The fp8 kernel is register-bound (the codes and their fp16 widening both live in registers), so
#: smaller programs, more of them an SM, keep more bytes in flight, and with the block ids loaded ahead
#: Triton keeps two K/V tiles a program in shared memory: the fastest of the tiles, warps, stages and
#: split counts timed at batch 32, context 2,048 and batch 64, context 4,096 (profiles/notes_paged_decode.md;
#: 16-bit caches gained nothing from the ids ahead there). Other head sizes keep the general rule (not
#: measured).
_FP8_TILES = {128: DecodeConfig(block_n=64, num_warps=2, num_stages=3, block_ids_ahead=True)}


def default_config(head_size: int, cache_element_size: int, device: torch.device | None = None) -> DecodeConfig:
    """Tiles of ~``TILE_BYTES`` of K/V (at most 128 tokens), 4 warps, halved until they fit; fp8 caches
    at head size 128: ``_FP8_TILES``."""
    if cache_element_size == 1 and triton.next_power_of_2(head_size) in _FP8_TILES:
        return _FP8_TILES[triton.next_power_of_2(head_size)]
    _, smem = _device_limits(device)
    block_n = max(16, min(128, TILE_BYTES // _bytes_per_token(head_size, cache_element_size)))
    while block_n > 16 and _program_shared_memory(block_n, head_size, cache_element_size) > smem:
        block_n //= 2
    # With the block ids loaded in the same iteration Triton keeps one K/V tile in shared memory whatever
    # the stages (profiles/notes_paged_decode.md compares them).
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=3)


def resident_programs(config: DecodeConfig, head_size: int, cache_element_size: int,
                      device: torch.device | None = None) -> int:
    """Split-kernel programs the whole device runs at once, estimated from shared memory and registers."""
    sms, smem = _device_limits(device)
    per_program = _program_shared_memory(config.block_n, head_size, cache_element_size, config.kv_buffers)
    by_registers = _MAX_PROGRAMS_PER_SM.get(cache_element_size, 3)
    if head_size <= 64:
        by_registers = _MAX_PROGRAMS_PER_SM_SMALL_HEADS.get(cache_element_size, by_registers)
    cap = by_registers * 4 // config.num_warps
    return sms * max(1, min(cap, smem // per_program))


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    resident: int,
    sliding_window: int | None = None,
    max_splits: int = MAX_SPLITS,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """Splits per (sequence, kv head), from host values only (safe to call before capture).

    ``resident``: programs the device runs at once (``resident_programs``); ``base = batch *
    num_kv_heads`` programs exist without splitting. Rules measured at d = 128, bf16
    (profiles/notes_paged_decode.md):

    * ``base <= resident``: split so that one wave holds as many programs as fit, ``resident // base``;
      all run at once (a full wave beat a wave and a third).
    * ``resident < base < 2.5 * resident``: pick 1-4 splits for the fullest last wave, each split
      keeping at least 4 x ``MIN_TOKENS_PER_SPLIT`` tokens (a 512-token context ran faster unsplit than
      in 3 splits).
    * larger: no split (the last wave's loss is small; a split costs its partials and the merge).

    No split gets fewer than ``min_tokens_per_split`` tokens of the captured (window-limited) context.
    """
    span = _span(max_seq_len, sliding_window)
    base = max(batch * num_kv_heads, 1)
    by_length = max(span // min_tokens_per_split, 1)
    if 2 * base >= 5 * resident:
        return 1
    if base > resident:

        def last_wave_fill(splits: int) -> float:
            waves = base * splits / resident
            return waves / math.ceil(waves)

        wanted = max(range(1, 5), key=lambda s: (round(last_wave_fill(s), 2), -s))
        by_length = max(span // (4 * min_tokens_per_split), 1)
    else:
        wanted = resident // base
    return max(1, min(wanted, by_length, max_splits))


def _span(max_seq_len: int, sliding_window: int | None) -> int:
    """Keys a sequence attends to at most: the captured context, or the window when shorter."""
    return max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)


def choose_launch(
    config: DecodeConfig,
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    head_size: int,
    cache_element_size: int,
    device: torch.device | None = None,
    sliding_window: int | None = None,
    max_splits: int = MAX_SPLITS,
    tile_given: bool = False,
) -> tuple[DecodeConfig, int]:
    """(tile, splits) for a launch from host values only: ``config`` with ``choose_num_splits``' count,
    or, unless ``tile_given`` (the caller chose ``config``), where 128-token slices split the captured
    context (``max_seq_len``, or the window) at most 4 ways and their programs fill at most half the SMs,
    ``SHORT_CONTEXT_TILE``-token tiles and slices when they give more splits (twice as many at the
    captured context of 513 tokens that was measured faster in the batch-1 step: see
    ``SHORT_CONTEXT_TILE``). Graphs captured for long contexts keep 128-token tiles whatever the live
    lengths, as the split count follows the captured context too. And where one split a (sequence, kv
    head) makes more programs than one wave of ``config``'s tiles holds but one wave of ``SHORT_CONTEXT_TILE``
    tiles would (``_SHORT_TILE_PROGRAMS_PER_SM``: head size 128, 16-bit caches, 4 warps, no window,
    captured contexts under 1024 tokens; shared memory permitting), those shorter tiles."""
    sms, smem = _device_limits(device)
    resident = resident_programs(config, head_size, cache_element_size, device)
    splits = choose_num_splits(batch, num_kv_heads, max_seq_len, resident, sliding_window, max_splits)
    programs = max(batch * num_kv_heads, 1) * splits
    short_per_sm = _SHORT_TILE_PROGRAMS_PER_SM.get((cache_element_size, triton.next_power_of_2(head_size)))
    if (not tile_given and short_per_sm is not None and config.block_n > SHORT_CONTEXT_TILE
            and config.num_warps == 4 and splits == 1 and sliding_window is None
            and max_seq_len < _ONE_WAVE_CONTEXT_BOUND):
        # Unsplit programs that overflow one wave of config's tiles but fit one wave of shorter ones.
        by_smem = smem // _program_shared_memory(SHORT_CONTEXT_TILE, head_size, cache_element_size)
        if resident < programs <= sms * min(short_per_sm, by_smem):
            return dataclasses.replace(config, block_n=SHORT_CONTEXT_TILE), 1
    short_context = _span(max_seq_len, sliding_window) // MIN_TOKENS_PER_SPLIT <= 4
    few_programs = 2 * programs <= sms
    if tile_given or config.block_n <= SHORT_CONTEXT_TILE or not short_context or not few_programs:
        return config, splits
    short = dataclasses.replace(config, block_n=SHORT_CONTEXT_TILE)
    resident = resident_programs(short, head_size, cache_element_size, device)
    short_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, resident, sliding_window, max_splits,
                                     min_tokens_per_split=SHORT_CONTEXT_TILE)
    # A shorter tile without more splits (contexts under 128 tokens, a workspace's split cap) would only
    # walk more tiles a program: not measured, and not the point.
    return (short, short_splits) if short_splits > splits else (config, splits)


@dataclass
class DecodeWorkspace:
    """Per-split partial results, allocated once at the largest batch a graph will see.

    max_logits, exp_sums: [max_batch, H, max_splits] float32 (base-2 logits);
    partial_out: [max_batch, H, max_splits, D] float32 (unnormalised, already times ``v_scale``);
    arrivals: [max_batch, H] int32, splits finished per (sequence, kv head) (column = kv head; H >= KVH
    columns), zero between launches: the split kernel's last program of a group resets its count.
    """

    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    partial_out: torch.Tensor
    arrivals: torch.Tensor

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        head_size: int,
        max_splits: int = MAX_SPLITS,
        device: torch.device | str = "cuda",
    ) -> DecodeWorkspace:
        stats = (max_batch, num_heads, max_splits)
        return cls(
            max_logits=torch.empty(stats, dtype=torch.float32, device=device),
            exp_sums=torch.empty(stats, dtype=torch.float32, device=device),
            partial_out=torch.empty(stats + (head_size,), dtype=torch.float32, device=device),
            arrivals=torch.zeros((max_batch, num_heads), dtype=torch.int32, device=device),
        )

    @property
    def max_batch(self) -> int:
        return self.max_logits.shape[0]

    @property
    def max_splits(self) -> int:
        return self.max_logits.shape[2]


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    kv_ptr,  # [2, num_blocks, block_size * KVH * D]
    block_tables_ptr,  # [B, M] int32
    seq_lens_ptr,  # [B] int32
    alibi_ptr,  # [H] float32 (unused without ALiBi)
    out_ptr,  # [B, H, D] (written by a lone live split, or by the merge)
    m_ptr,  # [max_batch, H, max_splits] float32 (written by live splits when more than one)
    l_ptr,  # same
    acc_ptr,  # [max_batch, H, max_splits, D] float32
    arrivals_ptr,  # [max_batch, H] int32, zero on entry (used when num_splits > 1)
    stride_qb,
    stride_qh,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_token,  # KVH * D
    stride_bt,
    stride_ob,
    stride_oh,
    stride_wb,  # workspace strides (max_logits / exp_sums); partial_out adds a D axis
    stride_wh,
    stride_arrivals,
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,
    window,
    num_splits,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: normalise and write ``out`` directly
    GROUP_MERGE: tl.constexpr,  # GROUP padded to a power of two (the merge's head tile)
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
    SPLITS_CHUNK: tl.constexpr,  # splits the merge loads at once (bounds its registers)
    USE_ALIBI: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # CPU interpreter only: its bf16 products are wrong, so run them in fp32
    FP8_DOT_F16: tl.constexpr,  # fp8 cache: both products in fp16 (one native convert per 2 values)
    BLOCK_IDS_AHEAD: tl.constexpr,  # DecodeConfig.block_ids_ahead
    PDL: tl.constexpr,  # launched as a programmatic dependent (graphrt.kernels.dependent_launch)
    PREFETCH_LINES: tl.constexpr = 0,  # l2_prefetch: lines of a token's K (and V) row to prefetch (0: none)
    LINE_ELEMS: tl.constexpr = 1,  # cache elements a line holds
):
    if PREFETCH_LINES > 0:  # the wait comes after the first tile's prefetch, below
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    # Equal slices of the live key range, each a whole number of tiles.
    slice_len = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    start = first_key + split * slice_len
    end = tl.minimum(start + slice_len, seq_len)
    if PREFETCH_LINES > 0:
        # Lengths and block tables are the host's upload, the rows of earlier steps final: both readable
        # before the wait (graphrt.kernels.dependent_launch). A line of this step's row, prefetched
        # before the QKV kernel writes it, is updated in L2 by that write.
        first = start + tl.arange(0, BLOCK_N)
        first_ok = first < end
        first_blocks = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + first // BLOCK_SIZE, mask=first_ok,
                               other=0).to(tl.int64)
        lines = (first_blocks * stride_kv_block + (first % BLOCK_SIZE) * stride_kv_token + kv_head * HEAD_SIZE)[:, None] \
            + tl.arange(0, PREFETCH_LINES)[None, :] * LINE_ELEMS
        lines_ok = first_ok[:, None] & (tl.arange(0, PREFETCH_LINES) * LINE_ELEMS < HEAD_SIZE)[None, :]
        prefetch_to_l2(kv_ptr + lines, lines_ok)
        prefetch_to_l2(kv_ptr + stride_kv_kind + lines, lines_ok)
        if PDL:
            tl.extra.cuda.gdc_wait()

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_PAD]
    if DOT_F32:
        dot_dtype = tl.float32
        q_op = q.to(tl.float32)
    elif FP8_DOT_F16:
        # e4m3 converts to fp16 natively (to bf16 it goes through fp32); fp16 also keeps more of the
        # query's mantissa than bf16. Clamped so a (pathological) |q| above fp16's range stays finite.
        dot_dtype = tl.float16
        q_op = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        dot_dtype = q.dtype
        q_op = q
    if USE_ALIBI:
        # Base-2 units, like the scores.
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_ptr + kv_head * HEAD_SIZE
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_IDS_AHEAD:
        block = tl.load(table + (start + offs_n) // BLOCK_SIZE, mask=start + offs_n < end, other=0)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        pos_ok = pos < end
        if BLOCK_IDS_AHEAD:
            # This tile's ids came from the previous iteration: Triton multi-buffers the K/V loads.
            block_ids = block.to(tl.int64)
            block = tl.load(table + (pos + BLOCK_N) // BLOCK_SIZE, mask=pos + BLOCK_N < end, other=0)
        else:
            block_ids = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        token = block_ids * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_token
        kv_off = token[:, None] + dims[None, :]
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(head_base + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(head_base + stride_kv_kind + kv_off, mask=kv_ok, other=0.0)

        s = tl.dot(q_op, tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION) * qk_scale
        if USE_ALIBI:
            s += slopes[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
        s = tl.where(pos_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_op = p.to(q.dtype).to(dot_dtype) if DOT_F32 else p.to(dot_dtype)  # interpreter: bf16 rounding kept
        acc = acc * alpha[:, None] + tl.dot(p_op, v.to(dot_dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc * v_scale
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SINGLE_SPLIT:
        # The whole live range was one slice: seq_len >= 1 guarantees l_i > 0.
        _store_normalised(out_ptrs, acc, l_i, out_mask)
    else:
        # Splits whose slice starts past the live range (a graph captured for a long context running a
        # short sequence: most of them) have nothing to add and neither store nor count in; the live
        # ones merge among themselves, and a lone live split writes out directly.
        # (A length of 0 breaks the contract; the maximum keeps it from dividing by zero.)
        live_splits = tl.cdiv(seq_len - first_key, tl.maximum(slice_len, 1))
        if live_splits == 1:
            if split == 0:
                _store_normalised(out_ptrs, acc, l_i, out_mask)
        elif split < live_splits:
            stat = seq.to(tl.int64) * stride_wb + heads * stride_wh + split
            tl.store(m_ptr + stat, m_i, mask=row_ok)
            tl.store(l_ptr + stat, l_i, mask=row_ok)
            tl.store(acc_ptr + stat[:, None] * HEAD_SIZE + dims[None, :], acc, mask=out_mask)
            # Count this split in. One thread performs a scalar atomic: the barrier orders every thread's
            # partial stores before its release, and its acquire (the count is broadcast to the others)
            # orders the merge's loads after the other splits' stores.
            tl.debug_barrier()
            counter = arrivals_ptr + seq.to(tl.int64) * stride_arrivals + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == live_splits - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # all in: ready for the next launch
                _merge_splits(out_ptr, m_ptr, l_ptr, acc_ptr, seq, kv_head * GROUP, stride_ob, stride_oh,
                              stride_wb, stride_wh, live_splits, GROUP, GROUP_MERGE, HEAD_SIZE, HEAD_PAD,
                              SPLITS_PAD, SPLITS_CHUNK)


@triton.jit
def _store_normalised(out_ptrs, acc, l_i, mask):
    """A split that covered the whole live range writes its output itself: ``acc / l_i`` ([GROUP_PAD,
    HEAD_PAD] float32 over [GROUP_PAD]), in the output's dtype, at ``out_ptrs`` under ``mask``."""
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _merge_splits(
    out_ptr,  # [B, H, D]
    m_ptr,  # [max_batch, H, max_splits] float32
    l_ptr,
    acc_ptr,  # [max_batch, H, max_splits, D] float32
    seq,
    first_head,
    stride_ob,
    stride_oh,
    stride_wb,
    stride_wh,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_MERGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLITS_CHUNK: tl.constexpr,
):
    """Merges the ``num_splits`` partials of heads ``first_head .. first_head + GROUP`` of sequence
    ``seq`` and writes their rows of ``out``. The partials were written by other programs of this
    launch: loaded with ``.cg`` (from L2, never a stale L1 line). When one chunk holds every split
    (SPLITS_CHUNK >= SPLITS_PAD) the outputs are loaded with the maxima and sums, one round trip
    instead of two in turn: this runs on the step's critical path, after the last split arrives."""
    rows = tl.arange(0, GROUP_MERGE)
    row_ok = rows < GROUP
    heads = first_head + rows
    head_stat = seq.to(tl.int64) * stride_wb + heads * stride_wh  # [GROUP_MERGE]
    splits = tl.arange(0, SPLITS_PAD)
    stat_ok = row_ok[:, None] & (splits < num_splits)[None, :]
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    stat = head_stat[:, None] + splits[None, :]  # [GROUP_MERGE, SPLITS_PAD]
    # Only live splits are merged (each holds keys); the -inf guard keeps masked lanes (padded heads and
    # splits) at weight 0.
    m = tl.load(m_ptr + stat, mask=stat_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + stat, mask=stat_ok, other=0.0, cache_modifier=".cg")
    if SPLITS_CHUNK >= SPLITS_PAD:
        partial = tl.load(acc_ptr + stat[:, :, None] * HEAD_SIZE + dims[None, None, :],
                          mask=stat_ok[:, :, None] & dim_ok[None, None, :], other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, axis=1)  # [GROUP_MERGE]; finite for real heads (seq_len >= 1)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_all[:, None]), 0.0)
    denom = tl.sum(l * weight, axis=1)

    if SPLITS_CHUNK >= SPLITS_PAD:
        out = tl.sum(partial * weight[:, :, None], axis=1)
    else:
        chunk = tl.arange(0, SPLITS_CHUNK)
        out = tl.zeros([GROUP_MERGE, HEAD_PAD], tl.float32)
        for first_split in range(0, num_splits, SPLITS_CHUNK):
            chunk_stat = head_stat[:, None] + (first_split + chunk)[None, :]  # [GROUP_MERGE, SPLITS_CHUNK]
            chunk_ok = row_ok[:, None] & ((first_split + chunk) < num_splits)[None, :]
            m_chunk = tl.load(m_ptr + chunk_stat, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
            chunk_weight = tl.where(m_chunk > float("-inf"), tl.exp2(m_chunk - m_all[:, None]), 0.0)
            partial = tl.load(acc_ptr + chunk_stat[:, :, None] * HEAD_SIZE + dims[None, None, :],
                              mask=chunk_ok[:, :, None] & dim_ok[None, None, :], other=0.0, cache_modifier=".cg")
            out += tl.sum(partial * chunk_weight[:, :, None], axis=1)
    out = out / denom[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


#: Partial-output elements the merge loads at once (64 float32 a thread at 4 warps). The merge shares
#: the kernel's register allocation: at head size 64, 32+ splits (or a group of 8 with 8+) raise the
#: split kernel's registers past the 4 programs an SM that ``resident_programs`` assumes there; a
#: quarter of this tile would not, but merges 32 splits in four passes, not one. Kept until measured
#: otherwise: the measured points (batch 1 and 8, batch 64 unsplit) are unaffected or are the 1B's
#: batch 1 at context 4096, which merges 32 splits in one pass with this tile.
_MERGE_TILE_ELEMENTS = 8192


def compiled_kernel_resources() -> list[dict]:
    """What each compiled variant of the split kernel takes so far (profiling: registers bound the fp8
    kernel): per variant its warps, stages, registers and spills a thread (None until first launched) and
    shared memory in bytes. Read from Triton's kernel cache, whose layout differs between versions: what
    cannot be read is left out."""
    found = []
    for cache in _decode_split_kernel.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in getattr(kernels, "values", lambda: [])():
            metadata = getattr(kernel, "metadata", None)
            found.append({"num_warps": getattr(metadata, "num_warps", None),
                          "num_stages": getattr(metadata, "num_stages", None),
                          "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                          "shared": getattr(metadata, "shared", None), "key": id(kernel)})
    return found


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_kv_heads: int,
    block_size: int,
    workspace: DecodeWorkspace | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    fp8_dot_f16: bool = True,
    dependent_launch: bool = False,
    l2_prefetch: bool | None = None,
) -> torch.Tensor:
    """Attend one query token per sequence over its paged K/V; writes and returns ``out``.

    out: [B, H, D] (query's dtype or any float dtype; written in place); query: [B, H, D] fp16, bf16 or
    fp32, channels contiguous; kv_cache: [2, num_blocks, block_size * KVH * D] in the model
    dtype or ``torch.float8_e4m3fn`` (then ``k_scale``/``v_scale`` are its per-tensor float scales);
    block_tables: [B, M] int32 (unused entries point at the null block); seq_lens: [B] int32 real key
    counts, each in ``1 .. max_seq_len`` (read on the device). ``max_seq_len`` is the captured maximum
    context that fixes the launch; ``alibi_slopes``: [H] float32, adds ``slope * (k_pos - q_pos)`` with
    ``q_pos = seq_len - 1``; ``sliding_window`` W keeps keys with ``q_pos - k_pos < W``.

    ``workspace`` is needed when more than one split is used; pass one from ``DecodeWorkspace.allocate``
    (mandatory inside CUDA-graph capture: this function then allocates nothing). ``num_splits`` and
    ``config`` override the host heuristics (tests, tuning); ``fp8_dot_f16`` (the default) runs an fp8
    cache's products in fp16 instead of the query dtype: E4M3 widens to fp16 in one instruction a pair
    (to bf16 through fp32), and measured faster (profiles/notes_paged_decode.md); fp16 keeps more of the
    query's and probabilities' mantissa, and the query is clamped to fp16's range.
    ``dependent_launch``: launch the kernel as a programmatic dependent of the kernel before it (see
    ``graphrt.kernels.dependent_launch``); ``l2_prefetch`` (None: ``L2_PREFETCH_FIRST_TILE``; CUDA only,
    the same results): each program asks L2 for its first K/V tile before its wait.
    """
    batch, num_heads, head_size = query.shape
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("query and out channels must be contiguous")
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != block_size * num_kv_heads * head_size:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, {block_size} * {num_kv_heads} * {head_size}]"
        )
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError("kv_cache blocks must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if max_seq_len > block_tables.shape[1] * block_size:
        capacity = block_tables.shape[1] * block_size
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block-table capacity {capacity}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = config or default_config(head_size, kv_cache.element_size(), query.device)
    if num_splits is None:
        max_splits = workspace.max_splits if workspace is not None else MAX_SPLITS
        cfg, num_splits = choose_launch(cfg, batch, num_kv_heads, max_seq_len, head_size, kv_cache.element_size(),
                                        query.device, sliding_window, max_splits, tile_given=config is not None)
    if num_splits > 1:
        if workspace is None:
            if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("pass a preallocated DecodeWorkspace when capturing a CUDA graph")
            workspace = DecodeWorkspace.allocate(batch, num_heads, head_size, num_splits, query.device)
        if (
            workspace.max_batch < batch
            or workspace.max_splits < num_splits
            or workspace.partial_out.shape[1:] != (num_heads, workspace.max_splits, head_size)
            or workspace.arrivals.shape != (workspace.max_batch, num_heads)
            or workspace.arrivals.dtype != torch.int32
            or workspace.arrivals.stride(1) != 1
        ):
            raise ValueError(
                f"workspace (partial_out {tuple(workspace.partial_out.shape)}, arrivals "
                f"{tuple(workspace.arrivals.shape)} {workspace.arrivals.dtype}) does not fit batch {batch}, "
                f"{num_heads} heads, {num_splits} splits, head size {head_size}: use DecodeWorkspace.allocate"
            )
        m_buf, l_buf, acc_buf = workspace.max_logits, workspace.exp_sums, workspace.partial_out
        arrivals = workspace.arrivals
    else:
        m_buf = l_buf = acc_buf = out  # not touched by the single-split path
        arrivals = seq_lens
    head_pad = triton.next_power_of_2(head_size)
    group_merge = triton.next_power_of_2(group)
    splits_pad = triton.next_power_of_2(num_splits)
    use_alibi = alibi_slopes is not None
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        alibi_slopes if use_alibi else query,
        out,
        m_buf,
        l_buf,
        acc_buf,
        arrivals,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        num_kv_heads * head_size,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        m_buf.stride(0) if num_splits > 1 else 0,
        m_buf.stride(1) if num_splits > 1 else 0,
        arrivals.stride(0),
        float(scale) * float(k_scale) * _LOG2E,
        float(v_scale),
        int(sliding_window or 0),
        num_splits,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        SINGLE_SPLIT=num_splits == 1,
        GROUP_MERGE=group_merge,
        SPLITS_PAD=splits_pad,
        SPLITS_CHUNK=max(1, min(splits_pad, _MERGE_TILE_ELEMENTS // (group_merge * head_pad))),
        USE_ALIBI=use_alibi,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        DOT_F32=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        FP8_DOT_F16=fp8_dot_f16 and kv_cache.dtype == torch.float8_e4m3fn and query.dtype != torch.float32,
        BLOCK_IDS_AHEAD=cfg.block_ids_ahead,
        **first_tile_prefetch(kv_cache, head_size, l2_prefetch),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(dependent_launch),
    )
    return out


def first_tile_prefetch(kv_cache: torch.Tensor, head_size: int, l2_prefetch: bool | None) -> dict:
    """The split kernel's ``PREFETCH_LINES`` (the lines a token's K row spans; 0: no prefetch) and
    ``LINE_ELEMS``: with ``l2_prefetch`` (None: ``L2_PREFETCH_FIRST_TILE``) on CUDA only (the
    interpreter has no PTX)."""
    line_elems = line_elements(kv_cache.element_size())
    on = prefetching(l2_prefetch, L2_PREFETCH_FIRST_TILE, kv_cache.device)
    return {"PREFETCH_LINES": triton.next_power_of_2(-(-head_size // line_elems)) if on else 0,
            "LINE_ELEMS": line_elems}


__all__ = [
    "DecodeConfig",
    "L2_PREFETCH_FIRST_TILE",
    "first_tile_prefetch",
    "compiled_kernel_resources",
    "DecodeWorkspace",
    "MAX_SPLITS",
    "choose_launch",
    "choose_num_splits",
    "default_config",
    "paged_decode_attention",
    "resident_programs",
]
