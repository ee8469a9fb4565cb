"""Prefill attention for prompts whose first tokens are already in the paged KV cache (prefix reuse,
recompute after preemption): each new query token attends to the sequence's cached context and,
causally, to the new tokens themselves.

Where K/V come from: the context (positions ``0 .. ctx-1``) is read from the paged cache through the
block table; the new tokens (positions ``ctx .. seq_len-1``) are read from the ``key``/``value``
tensors of this step, not from the cache. They are contiguous there (no block-table lookups) and, with
an fp8 cache, unquantised, so a prompt gets the same numbers whether its prefix was cached or not.
The caller may write them to the cache before or after this kernel.

One program handles a tile of ``BLOCK_R`` (token, query head) rows that share one KV head: the
``H/KVH`` query heads of a token are adjacent rows, so each K/V tile is loaded once for all of them
(GQA/MQA). Grid: (row tiles of the longest new chunk, sequences, KV heads x context splits); tiles past
a sequence's own rows exit at once. Online softmax in float32 with base-2 exponentials.

A program walks its keys one tile after another, so a short chunk over a long context (a chunked
prefill's step, a prompt after a cached prefix) has few programs, each long: the cached context is then
split into ``num_splits`` runs of key tiles, one program each (the last also takes the new tokens); each
writes its rows' partial result (output normalised by its own sum, the running maximum and sum) to a
float32 workspace, and a second kernel weighs the splits together.

Cache layout (shared with ``attention.reference``): ``kv_cache [2, num_blocks, block_size * KVH * D]``;
``kv_cache[0].view(num_blocks, block_size, KVH, D)`` are keys, ``[1]`` values; with
``torch.float8_e4m3fn`` a stored value times ``k_scale``/``v_scale`` is the real one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.attention.backend import SUPPORTED_HEAD_SIZES

_LOG2E = 1.4426950408889634


@triton.jit
def _accumulate(qk, v, v_scale, allowed, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                SCALE_V: tl.constexpr):
    """Fold one key tile into the online softmax. qk: [BLOCK_R, BLOCK_N] float32 logits in log2 units;
    v: [BLOCK_N, HEAD_PAD] as stored (times ``v_scale`` when SCALE_V)."""
    qk = tl.where(allowed, qk, float("-inf"))
    # m_i starts finite, so a row with every key masked so far keeps alpha = 1 and p = 0 (no inf - inf).
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if SCALE_V:
        pv = pv * v_scale
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _prefix_prefill_kernel(
    Q,  # [T, H, D]
    KNew,  # [T, KVH, D]
    VNew,
    KCache,  # [num_blocks, block_size * KVH * D]
    VCache,
    Out,  # [T, H, D]; with NUM_SPLITS > 1, the float32 partial outputs [NUM_SPLITS, T, H, D]
    PartialMax,  # [NUM_SPLITS, T, H] float32 (written only with NUM_SPLITS > 1)
    PartialSum,
    BlockTables,  # [B, M] int32
    QueryStart,  # [B + 1] int32
    SeqLens,  # [B] int32
    Slopes,  # [H] float32 (read only with HAS_ALIBI)
    ctx_qk_scale,  # softmax scale * log2(e) * k_scale: logits of cached keys
    new_qk_scale,  # softmax scale * log2(e): logits of this step's keys
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_os,  # Out's split stride (NUM_SPLITS > 1)
    stride_ms,  # PartialMax / PartialSum: split and token strides (the head stride is 1)
    stride_mt,
    stride_cache_block,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 dots (Hopper would round them to TF32), else None
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_start
    ctx = tl.load(SeqLens + seq) - q_len
    num_rows = q_len * QUERIES_PER_KV
    first_row = tile * BLOCK_R
    if first_row >= num_rows:
        return

    rows = first_row + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    tok = rows // QUERIES_PER_KV  # new-token index of each row
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    q_pos = ctx + tok
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        Q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        DOT_DTYPE = tl.float32
    else:
        DOT_DTYPE = Q.dtype.element_ty
    q = q.to(DOT_DTYPE)
    if HAS_ALIBI:
        slope = tl.load(Slopes + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634

    m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_PAD], tl.float32)
    last_tok = (tl.minimum(first_row + BLOCK_R, num_rows) - 1) // QUERIES_PER_KV
    lowest_key = 0  # no query of this tile sees a key before it
    if HAS_WINDOW:
        lowest_key = tl.maximum(ctx + first_row // QUERIES_PER_KV - window + 1, 0)
    cols = tl.arange(0, BLOCK_N)

    # Cached context: positions [lowest_key, ctx), every one before every query (no causal test); this
    # split's run of its key tiles.
    table = BlockTables + seq.to(tl.int64) * stride_bt
    first_key = (lowest_key // BLOCK_N) * BLOCK_N
    key_tiles = tl.cdiv(tl.maximum(ctx - first_key, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(key_tiles, NUM_SPLITS)
    split_start = first_key + split * tiles_per_split * BLOCK_N
    split_end = tl.minimum(split_start + tiles_per_split * BLOCK_N, ctx)
    for n0 in range(split_start, split_end, BLOCK_N):
        pos = n0 + cols
        pos_ok = pos < ctx
        block = tl.load(table + pos // CACHE_BLOCK, mask=pos_ok, other=0).to(tl.int64)
        offset = block * stride_cache_block + ((pos % CACHE_BLOCK) * NUM_KV_HEADS + kv_head) * HEAD_SIZE
        k = tl.load(KCache + offset[None, :] + dims[:, None], mask=pos_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(VCache + offset[:, None] + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
        qk = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * ctx_qk_scale
        if HAS_ALIBI:
            qk += slope[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        allowed = pos_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
        m_i, l_i, acc = _accumulate(qk, v, v_scale, allowed, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION, KV_FP8)

    # New tokens [.., last_tok] of this step, causally, from the key/value tensors (the last split's).
    new_end = tl.where(split == NUM_SPLITS - 1, last_tok + 1, 0)
    for n0 in range((tl.maximum(lowest_key - ctx, 0) // BLOCK_N) * BLOCK_N, new_end, BLOCK_N):
        idx = n0 + cols
        idx_ok = idx <= last_tok
        token = (q_start + idx).to(tl.int64)
        k = tl.load(KNew + token[None, :] * stride_kt + kv_head * stride_kh + dims[:, None],
                    mask=idx_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(VNew + token[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=idx_ok[:, None] & dim_ok[None, :], other=0.0)
        qk = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * new_qk_scale
        if HAS_ALIBI:
            qk += slope[:, None] * (idx[None, :] - tok[:, None]).to(tl.float32)
        allowed = (idx[None, :] <= tok[:, None]) & idx_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (tok[:, None] - idx[None, :] < window)
        m_i, l_i, acc = _accumulate(qk, v, 1.0, allowed, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION, False)

    # Rows past the sequence, and a split's rows that saw no key, divide by 1 (their sum is 0).
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    token = (q_start + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        tl.store(Out + split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out, mask=row_ok[:, None] & dim_ok[None, :])
        partial = split * stride_ms + token * stride_mt + head
        tl.store(PartialMax + partial, m_i, mask=row_ok)
        tl.store(PartialSum + partial, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    Partial,  # [NUM_SPLITS, T, H, D] float32
    PartialMax,  # [NUM_SPLITS, T, H] float32
    PartialSum,
    Out,  # [T, H, D]
    QueryStart,  # [B + 1] int32: tokens at or past QueryStart[B] belong to no sequence
    num_seqs,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One token's heads: the splits' partial outputs weighed by sum * 2^(max - the largest max)."""
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(QueryStart + num_seqs):
        return  # a padding token: nothing wrote its partials
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < NUM_HEADS
    mask = head_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    largest = tl.full([HEADS_PAD], -1.0e30, tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        m = tl.load(PartialMax + split * stride_ms + token * stride_mt + heads, mask=head_ok, other=-1.0e30)
        largest = tl.maximum(largest, m)
    total = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_PAD], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        offset = split * stride_ms + token * stride_mt + heads
        weight = tl.load(PartialSum + offset, mask=head_ok, other=0.0) * tl.exp2(
            tl.load(PartialMax + offset, mask=head_ok, other=-1.0e30) - largest)
        part = tl.load(Partial + split * stride_ps + token * stride_pt + heads[:, None] * stride_ph + dims[None, :],
                       mask=mask, other=0.0)
        acc += weight[:, None] * part
        total += weight
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(Out.dtype.element_ty),
             mask=mask)


def choose_tiles(rows: int, head_pad: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps): rows of (token, head) pairs per program, keys per step (64 x 64 for
    heads up to 128: the tile sweep in profiles/notes_serving.md)."""
    block_r = 64
    block_r = max(16, min(block_r, triton.next_power_of_2(rows)))
    block_n = 64 if head_pad <= 128 else 32
    return block_r, block_n, 8 if block_r * head_pad >= 128 * 128 else 4


#: Most context splits a launch takes; the automatic choice fills about two programs an SM.
MAX_SPLITS = 8
_sm_counts: dict[int, int] = {}


def choose_num_splits(row_tiles: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits for a launch of ``row_tiles`` row tiles a sequence: 1 where one sequence's programs
    already cover the SMs (a long prompt), else enough for about two programs an SM, at most
    ``MAX_SPLITS`` (a short chunk over a long context). Always 1 on the CPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs, sms = row_tiles * num_kv_heads, _sm_counts[index]
    return 1 if programs >= sms else min(MAX_SPLITS, -(-2 * sms // programs))


def triton_prefix_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    *,
    block_r: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context and, causally, over themselves.

    query: [T, H, D]; key, value: [T, KVH, D] this step's new K/V (fp16/bf16/fp32, query's dtype; last
    dim contiguous); kv_cache: [2, num_blocks, block_size * KVH * D] in query's dtype or
    ``torch.float8_e4m3fn`` (real = stored * k_scale / v_scale); block_tables: [B, M] int32;
    query_start_loc: [B + 1] int32 prefix sums of new-token counts; seq_lens: [B] int32 context + new
    tokens (context_len = seq_len - query_len, may be 0); max_query_len: host int, the longest new chunk
    (sizes the grid); scale: softmax scale; sliding_window W: a query at position p sees keys k <= p with
    p - k < W; alibi_slopes: [H] float, adds ``slope[h] * (k - p)``; out: optional [T, H, D] to write
    (allocated when None). block_r/block_n override the tile sizes (tests); num_splits the context splits
    (None: ``choose_num_splits``, a launch shape fixed by ``max_query_len`` alone, so a captured graph keeps
    it). Returns out.
    Semantics: ``attention.reference.attend`` per sequence with its cached prefix as context.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head size {head_size} is not supported; supported head sizes: {list(SUPPORTED_HEAD_SIZES)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    block_size, rem = divmod(kv_cache.shape[2], num_kv_heads * head_size)
    if rem or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache of shape {tuple(kv_cache.shape)} does not hold {num_kv_heads} x {head_size} heads")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not kv_fp8 and kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is neither fp8 e4m3 nor the query's {query.dtype}")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    per_kv = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    auto_r, auto_n, num_warps = choose_tiles(max_query_len * per_kv, head_pad)
    block_r, block_n = block_r or auto_r, block_n or auto_n
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else query  # unread without ALiBi
    row_tiles = triton.cdiv(max_query_len * per_kv, block_r)
    num_splits = num_splits or choose_num_splits(row_tiles, num_kv_heads, query.device)
    if num_splits > 1:  # float32 partials per split, then weighed together
        partial = torch.empty((num_splits, *out.shape), dtype=torch.float32, device=out.device)
        partial_max = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=out.device)
        partial_sum = torch.empty_like(partial_max)
        target = partial
    else:
        partial_max = partial_sum = target = out  # unread
    grid = (row_tiles, num_seqs, num_kv_heads * num_splits)
    dot_fp32 = query.device.type == "cpu" and query.dtype == torch.bfloat16
    _prefix_prefill_kernel[grid](
        query,
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        target,
        partial_max,
        partial_sum,
        block_tables,
        query_start_loc,
        seq_lens,
        slopes,
        scale * _LOG2E * (k_scale if kv_fp8 else 1.0),
        scale * _LOG2E,
        float(v_scale if kv_fp8 else 1.0),
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        target.stride(-3),
        target.stride(-2),
        target.stride(0) if num_splits > 1 else 0,
        partial_max.stride(0) if num_splits > 1 else 0,
        partial_max.stride(1) if num_splits > 1 else 0,
        kv_cache.stride(1),
        block_tables.stride(0),
        QUERIES_PER_KV=per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        CACHE_BLOCK=block_size,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_WINDOW=sliding_window is not None,
        KV_FP8=kv_fp8,
        # Triton's CPU interpreter (3.9) computes bf16 tl.dot wrongly; there, dot in float32 instead.
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 or query.dtype == torch.float32 else None,
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
        num_stages=2,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens,)](
            partial, partial_max, partial_sum, out, query_start_loc, num_seqs,
            partial.stride(0), partial.stride(1), partial.stride(2), partial_max.stride(0), partial_max.stride(1),
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads), HEAD_SIZE=head_size,
            HEAD_PAD=head_pad, NUM_SPLITS=num_splits, num_warps=4,
        )
    return out
