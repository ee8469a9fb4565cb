"""Top-k / top-p sampling without sorting the vocabulary.

``graphrt.sampler.sample`` filters in sorted order: it sorts each row of ``x = logits / temperature``
(descending, ties to the lower token id), keeps the first ``k`` positions, then every position whose
preceding mass is ``< p`` times the kept mass, and races the survivors. The kept set is therefore
always a prefix of that order: every token above a boundary value, plus the first ``c`` (by id) of the
tokens equal to it. These kernels find that boundary by search instead of a sort:

1. ``_softmax_stats_kernel``: each chunk's max and ``sum(exp(x - chunk max))``, from which every later
   program rebuilds the row's ``x_max`` and total mass ``Z``.
2. Top-k, then top-p, each ``SEARCH_PASSES`` passes of ``_search_kernel``. A float32 value maps to an
   integer key with the same order (``_order_key``), so a row's boundary lies in an interval of keys
   ``(lo, hi]``. A pass evaluates ``THRESHOLDS`` keys spread over the interval: per chunk, how many
   tokens lie above each and their mass ``sum(exp(x - x_max))``; the next pass (every program of the row
   alike, from the same partials in the same order) keeps the sixteenth of the interval where the count
   (top-k: ``count < k``) or the mass (top-p: ``mass < p * kept mass``) first drops below the target.
   ``16 ** 8`` keys cover any interval, so eight passes end on one key: the boundary value.
3. ``_boundary_kernel``: the last step of the top-p search, and each chunk's count of tokens equal to
   the boundary.
4. ``_filtered_race_kernel``: how many of the equal tokens survive (top-k: ``k`` minus those above;
   top-p: those whose preceding mass ``mass_above + rank * w`` stays below the target), each token's
   rank among them (the counts of the chunks before plus a running sum), and the exponential race over
   the survivors, as ``graphrt.kernels.sampling`` races them; ``graphrt.kernels.argmax`` then picks
   each row's best chunk.

The kept set is the sorted path's, except where float32 sums decide differently: masses are summed per
chunk and then across chunks, where the sorted path takes a running sum, so a token whose preceding
mass lies within rounding of ``p`` times the kept mass may fall on the other side (as the race itself
differs only at float32 near-ties). Rows without filters race the whole row exactly as
``sample_temperature``; greedy rows take the argmax. 20 kernel launches whatever the rows ask for, so
the launch sequence depends on ``[B, V]`` only: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampler import SamplingTensors
from .argmax import store_chunk_best, two_pass_argmax
from .race_noise import log_race_noise

#: Keys a search pass evaluates in a row's interval; each pass narrows it sixteenfold.
THRESHOLDS = 16
#: Passes of each search: 16 ** 8 = 2 ** 32 keys, more than any interval of float32 keys spans.
SEARCH_PASSES = 8
#: Most vocabulary entries one program handles.
MAX_CHUNK = 4096
#: Entries a search program compares with the thresholds at a time ([_SUB, THRESHOLDS] tiles).
_SUB = 256

_T = tl.constexpr(THRESHOLDS)
#: An order key below every float32's (-inf's is -2139095041).
KEY_BELOW_ALL = -2139095042
_BELOW_ALL = tl.constexpr(KEY_BELOW_ALL)
#: A row's search state, float64 (keys, counts and float32 masses are exact in it): the interval
#: (lo, hi], the count and mass above hi, the top-k boundary key, how many tokens equal to it survive
#: top-k and the mass top-k keeps, and the search's target.
_LO, _HI, _COUNT_HI, _MASS_HI, _KEY_K, _KEPT_K, _MASS_K, _TARGET = (tl.constexpr(i) for i in range(8))
STATE_FIELDS = 8
_FIELDS = tl.constexpr(STATE_FIELDS)


@triton.jit
def _order_key(x):
    """int32 keys ordered as the float32 values ``x`` (no NaN; -0.0 sorts below 0.0, see _scaled)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """The float32 value of an int64 order key (the inverse of ``_order_key``)."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(logits_ptr, row, stride_row, cols, in_vocab, temperature):
    """``logits / temperature`` in float32 as the sorting path scales them (the raw logits for greedy
    rows), -inf outside the vocabulary; -0.0 becomes 0.0 so equal values share one key."""
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
    return x / tl.where(temperature > 0, temperature, 1.0) + 0.0  # x / 1.0 is x: greedy rows stay raw


@triton.jit
def _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size):
    """(temperature, k, p, top-k on, top-p on) of a row: filters apply to sampled rows only, and a k of
    at least the vocabulary keeps everything."""
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    sampled = temperature > 0
    return temperature, k, p, sampled & (k > 0) & (k < vocab_size), sampled & (p < 1.0)


@triton.jit
def _row_max_and_mass(chunk_max_ptr, chunk_mass_ptr, row, num_chunks, CHUNKS_BLOCK: tl.constexpr):
    """The row's largest scaled value and ``sum(exp(x - x_max))`` from pass 1's per-chunk figures."""
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    maxes = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    masses = tl.load(chunk_mass_ptr + row * num_chunks + chunks, mask=mask, other=0.0)
    x_max = tl.max(maxes, axis=0)
    return x_max, tl.sum(tl.where(maxes > float("-inf"), masses * tl.exp(maxes - x_max), 0.0), axis=0)


@triton.jit
def _thresholds(lo, hi):
    """[THRESHOLDS] int64 keys splitting (lo, hi] into sixteen parts; the first is lo itself."""
    j = tl.arange(0, _T).to(tl.int64)
    return lo + (j * (hi - lo) + (_T - 1)) // _T


@triton.jit
def _advance(state_ptr, counts_ptr, masses_ptr, row, num_chunks, target, BY_COUNT: tl.constexpr,
             CHUNKS_BLOCK: tl.constexpr):
    """The interval after a pass evaluated the thresholds of ``state_ptr``'s: the part where the count
    (BY_COUNT) or mass above a key first drops below ``target``. Returns (lo, hi, count above hi, mass
    above hi); hi stays when no threshold is below the target."""
    lo = tl.load(state_ptr + _LO).to(tl.int64)
    hi = tl.load(state_ptr + _HI).to(tl.int64)
    keys = _thresholds(lo, hi)
    j = tl.arange(0, _T)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    offsets = (row * num_chunks + chunks[:, None]) * _T + j[None, :]
    mask = (chunks < num_chunks)[:, None]
    counts = tl.sum(tl.load(counts_ptr + offsets, mask=mask, other=0), axis=0).to(tl.float32)
    masses = tl.sum(tl.load(masses_ptr + offsets, mask=mask, other=0.0), axis=0)
    if BY_COUNT:
        below = counts < target
    else:
        below = masses < target
    first = tl.min(tl.where((j >= 1) & below, j, _T), axis=0)
    found = first < _T
    new_lo = tl.sum(tl.where(j == first - 1, keys, 0), axis=0)
    new_hi = tl.where(found, tl.sum(tl.where(j == first, keys, 0), axis=0), hi)
    count_hi = tl.where(found, tl.sum(tl.where(j == first, counts, 0.0), axis=0),
                        tl.load(state_ptr + _COUNT_HI).to(tl.float32))
    mass_hi = tl.where(found, tl.sum(tl.where(j == first, masses, 0.0), axis=0),
                       tl.load(state_ptr + _MASS_HI).to(tl.float32))
    return new_lo, new_hi, count_hi, mass_hi


@triton.jit
def _softmax_stats_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32, 0 = greedy
    chunk_max_ptr,  # [B, C] float32
    chunk_mass_ptr,  # [B, C] float32: sum(exp(x - chunk max))
    stride_row,
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _scaled(logits_ptr, row, stride_row, cols, cols < vocab_size, tl.load(temperature_ptr + row))
    chunk_max = tl.max(x, axis=0)
    finite_max = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)  # a chunk of -inf only: mass 0, no NaN
    mass = tl.sum(tl.where(x > float("-inf"), tl.exp(x - finite_max), 0.0), axis=0)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, chunk_max)
    tl.store(chunk_mass_ptr + row * num_chunks + chunk, mass)


@triton.jit
def _search_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64, 0 = off
    top_p_ptr,  # [B] float32, 1 = off
    chunk_max_ptr,  # [B, C] float32
    chunk_mass_ptr,  # [B, C] float32
    state_in_ptr,  # [B, STATE_FIELDS] float64: the interval the pass before evaluated
    counts_in_ptr,  # [B, C, THRESHOLDS] int32: its counts above each threshold, per chunk
    masses_in_ptr,  # [B, C, THRESHOLDS] float32: its masses above each threshold, per chunk
    state_out_ptr,  # [B, STATE_FIELDS] float64: the interval this pass evaluates
    counts_out_ptr,  # [B, C, THRESHOLDS] int32
    masses_out_ptr,  # [B, C, THRESHOLDS] float32
    stride_row,
    vocab_size,
    num_chunks,
    TOP_P: tl.constexpr,  # False: the top-k search (by count); True: the top-p search (by mass)
    START: tl.constexpr,  # 0: narrow the pass before's interval; 1: the top-k search's first pass;
    #                       2: the top-p search's first pass (the top-k search's last step first)
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, k, p, k_on, p_on = _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size)
    x_max, total = _row_max_and_mass(chunk_max_ptr, chunk_mass_ptr, row, num_chunks, CHUNKS_BLOCK)
    searching = p_on if TOP_P else k_on
    state_in = state_in_ptr + row * _FIELDS
    if START == 0:
        target = tl.load(state_in + _TARGET).to(tl.float32)
        lo, hi, count_hi, mass_hi = _advance(state_in, counts_in_ptr, masses_in_ptr, row, num_chunks, target,
                                             not TOP_P, CHUNKS_BLOCK)
        key_k = tl.load(state_in + _KEY_K).to(tl.int64)
        kept_k = tl.load(state_in + _KEPT_K).to(tl.float32)
        mass_k = tl.load(state_in + _MASS_K).to(tl.float32)
    else:
        if START == 2:
            # The top-k boundary: the k-th largest value; of the tokens equal to it, the first k - (count
            # above) survive, so top-k keeps mass_above + kept * w(boundary).
            _, key_k, count_k, mass_above_k = _advance(state_in, counts_in_ptr, masses_in_ptr, row, num_chunks,
                                                       k.to(tl.float32), True, CHUNKS_BLOCK)
            kept_k = tl.where(k_on, k.to(tl.float32) - count_k, 0.0)
            mass_k = tl.where(k_on, mass_above_k + kept_k * tl.exp(_key_value(key_k) - x_max), total)
            key_k = tl.where(k_on, key_k, _BELOW_ALL)
        else:
            key_k = tl.full((), _BELOW_ALL, tl.int64)
            kept_k = tl.zeros((), tl.float32)
            mass_k = total
        # The search starts at (key below the first token it may keep, key of the row's max]: the mass
        # and count above the max are 0, below target, and above lo there is everything top-k keeps.
        lo = tl.where(key_k > _BELOW_ALL, key_k - 1, _BELOW_ALL)
        hi = _order_key(x_max).to(tl.int64)
        count_hi = tl.zeros((), tl.float32)
        mass_hi = tl.zeros((), tl.float32)
        if TOP_P:
            target = p * mass_k
        else:
            target = k.to(tl.float32)
    if chunk == 0:
        state_out = state_out_ptr + row * _FIELDS
        tl.store(state_out + _LO, lo.to(tl.float64))
        tl.store(state_out + _HI, hi.to(tl.float64))
        tl.store(state_out + _COUNT_HI, count_hi.to(tl.float64))
        tl.store(state_out + _MASS_HI, mass_hi.to(tl.float64))
        tl.store(state_out + _KEY_K, key_k.to(tl.float64))
        tl.store(state_out + _KEPT_K, kept_k.to(tl.float64))
        tl.store(state_out + _MASS_K, mass_k.to(tl.float64))
        tl.store(state_out + _TARGET, target.to(tl.float64))
    if searching:
        keys = _thresholds(lo, hi).to(tl.int32)
        above_count = tl.zeros([SUB, _T], dtype=tl.int32)
        above_mass = tl.zeros([SUB, _T], dtype=tl.float32)
        for start in range(0, CHUNK, SUB):
            cols = chunk * CHUNK + start + tl.arange(0, SUB)
            in_vocab = cols < vocab_size
            x = _scaled(logits_ptr, row, stride_row, cols, in_vocab, temperature)
            above = (_order_key(x)[:, None] > keys[None, :]) & in_vocab[:, None]
            above_count += above.to(tl.int32)
            above_mass += tl.where(above, tl.exp(x - x_max)[:, None], 0.0)
        offsets = (row * num_chunks + chunk) * _T + tl.arange(0, _T)
        tl.store(counts_out_ptr + offsets, tl.sum(above_count, axis=0))
        tl.store(masses_out_ptr + offsets, tl.sum(above_mass, axis=0))


@triton.jit
def _boundary_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64
    top_p_ptr,  # [B] float32
    chunk_max_ptr,  # [B, C] float32
    chunk_mass_ptr,  # [B, C] float32
    state_in_ptr,  # [B, STATE_FIELDS] float64: the top-p search's last interval
    counts_in_ptr,  # [B, C, THRESHOLDS] int32
    masses_in_ptr,  # [B, C, THRESHOLDS] float32
    boundary_ptr,  # [B, STATE_FIELDS] float64 out: the boundary key in _LO, the mass above it in _MASS_HI
    ties_ptr,  # [B, C] int32 out: tokens equal to the boundary, per chunk
    stride_row,
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, _, _, k_on, p_on = _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size)
    state_in = state_in_ptr + row * _FIELDS
    target = tl.load(state_in + _TARGET).to(tl.float32)
    _, key_p, _, mass_p = _advance(state_in, counts_in_ptr, masses_in_ptr, row, num_chunks, target, False,
                                   CHUNKS_BLOCK)
    key_k = tl.load(state_in + _KEY_K).to(tl.int64)
    # Rows without filters keep every token: no key is below _BELOW_ALL, none equal to it.
    boundary = tl.where(p_on, key_p, tl.where(k_on, key_k, _BELOW_ALL))
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    x = _scaled(logits_ptr, row, stride_row, cols, in_vocab, temperature)
    equal = (_order_key(x).to(tl.int64) == boundary) & in_vocab
    tl.store(ties_ptr + row * num_chunks + chunk, tl.sum(equal.to(tl.int32), axis=0))
    if chunk == 0:
        out = boundary_ptr + row * _FIELDS
        tl.store(out + _LO, boundary.to(tl.float64))
        tl.store(out + _MASS_HI, mass_p.to(tl.float64))
        tl.store(out + _KEY_K, key_k.to(tl.float64))
        tl.store(out + _KEPT_K, tl.load(state_in + _KEPT_K))
        tl.store(out + _TARGET, target.to(tl.float64))


@triton.jit
def _filtered_race_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64
    top_p_ptr,  # [B] float32
    chunk_max_ptr,  # [B, C] float32
    chunk_mass_ptr,  # [B, C] float32
    seeds_ptr,  # [B] int64
    steps_ptr,  # [B] int64
    boundary_ptr,  # [B, STATE_FIELDS] float64, from _boundary_kernel
    ties_ptr,  # [B, C] int32
    best_ptr,  # [B, C] float32 out: each chunk's best race value
    best_index_ptr,  # [B, C] int64 out: its token id
    stride_row,
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, _, _, k_on, p_on = _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size)
    x_max, _ = _row_max_and_mass(chunk_max_ptr, chunk_mass_ptr, row, num_chunks, CHUNKS_BLOCK)
    state = boundary_ptr + row * _FIELDS
    boundary = tl.load(state + _LO).to(tl.int64)
    key_k = tl.load(state + _KEY_K).to(tl.int64)
    kept_k = tl.load(state + _KEPT_K).to(tl.float32)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    ties = tl.load(ties_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0)
    equal_total = tl.sum(ties, axis=0).to(tl.float32)
    # How many tokens equal to the boundary survive: top-k's share, and top-p's: rank r survives while
    # mass_above + r * w < target, so ceil((target - mass_above) / w) of them (>= 1: mass_above < target).
    # (Rows without top-p take x_max's weight, 1, so that nothing below divides by 0.)
    weight = tl.exp(_key_value(tl.where(p_on, boundary, _order_key(x_max).to(tl.int64))) - x_max)
    by_mass = tl.ceil((tl.load(state + _TARGET).to(tl.float32) - tl.load(state + _MASS_HI).to(tl.float32)) / weight)
    available = tl.where(k_on & (boundary == key_k), kept_k, equal_total)
    survivors = tl.where(p_on, tl.minimum(by_mass, available), tl.where(k_on, kept_k, equal_total))

    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    x = _scaled(logits_ptr, row, stride_row, cols, in_vocab, temperature)
    key = _order_key(x).to(tl.int64)
    equal = ((key == boundary) & in_vocab).to(tl.int32)
    rank = tl.sum(tl.where(chunks < chunk, ties, 0), axis=0) + tl.cumsum(equal, axis=0) - equal  # by token id
    kept = in_vocab & ((key > boundary) | ((equal > 0) & (rank.to(tl.float32) < survivors)))
    if temperature > 0:
        noise = log_race_noise(cols, tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        x = tl.where(kept, x + noise, float("-inf"))
    store_chunk_best(x, row, chunk, best_ptr, best_index_ptr, num_chunks, CHUNK)


def sample_top_k_top_p(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None,
                       max_chunk: int = MAX_CHUNK) -> torch.Tensor:
    """One token per row with ``graphrt.sampler.sample``'s filtering convention, without sorting: greedy
    rows take the argmax, rows with top-k / top-p race their kept tokens, the others the whole row.

    logits: [B, V] float (columns contiguous; finite or -inf, at least one finite value a row);
    sampling: B rows on the same device; out: [B] int64 (allocated when not given). ``max_chunk``: the
    most columns a program handles (a power of two; small values exercise the chunking in tests).
    Allocates its scratch (a few [B, ceil(V / chunk), 16] buffers); capturable: the launches depend on
    B and V only.
    """
    if logits.dim() == 2 and sampling.batch_size != logits.shape[0]:  # other shapes: two_pass_argmax says
        raise ValueError(f"logits have {logits.shape[0]} rows, sampling tensors {sampling.batch_size}")

    def chunk_pass(grid, best, best_index, chunk, num_chunks):
        batch, vocab = logits.shape
        device = logits.device
        chunks_block = triton.next_power_of_2(num_chunks)
        chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
        chunk_mass = torch.empty_like(chunk_max)
        # Two sets of partials, one per pass parity: a pass reads the one before's while writing its own.
        # Zeroed, so a row that skips a search reads counts and masses of 0, never uninitialised memory.
        counts = torch.zeros(2, batch, num_chunks, THRESHOLDS, dtype=torch.int32, device=device)
        masses = torch.zeros(2, batch, num_chunks, THRESHOLDS, dtype=torch.float32, device=device)
        states = torch.empty(2 * SEARCH_PASSES + 1, batch, STATE_FIELDS, dtype=torch.float64, device=device)
        ties = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
        rows = (logits, sampling.temperature, sampling.top_k, sampling.top_p, chunk_max, chunk_mass)
        shape = (logits.stride(0), vocab, num_chunks)
        _softmax_stats_kernel[grid](logits, sampling.temperature, chunk_max, chunk_mass, *shape, CHUNK=chunk,
                                    num_warps=8)
        for n in range(2 * SEARCH_PASSES):
            start = 1 if n == 0 else 2 if n == SEARCH_PASSES else 0
            before = max(n - 1, 0)
            _search_kernel[grid](
                *rows, states[before], counts[before % 2], masses[before % 2], states[n], counts[n % 2],
                masses[n % 2], *shape, TOP_P=n >= SEARCH_PASSES, START=start, CHUNK=chunk, SUB=min(_SUB, chunk),
                CHUNKS_BLOCK=chunks_block, num_warps=8,
            )
        last = 2 * SEARCH_PASSES - 1
        boundary = states[2 * SEARCH_PASSES]
        _boundary_kernel[grid](*rows, states[last], counts[last % 2], masses[last % 2], boundary, ties, *shape,
                               CHUNK=chunk, CHUNKS_BLOCK=chunks_block, num_warps=8)
        _filtered_race_kernel[grid](*rows, sampling.seeds, sampling.steps, boundary, ties, best, best_index, *shape,
                                    CHUNK=chunk, CHUNKS_BLOCK=chunks_block, num_warps=8)

    return two_pass_argmax(logits, out, chunk_pass, max_chunk)
