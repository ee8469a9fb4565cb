"""Top-k / top-p sampling without sorting the vocabulary.

``graphrt.sampling.sampler.sample`` filters in sorted order: it sorts each row of ``x = logits / temperature``
(descending, ties to the lower token id), keeps the first ``k`` positions, then every position whose
preceding mass is ``< p`` times the kept mass, and races the survivors. The kept set is therefore
always a prefix of that order: every token above a boundary value, plus the first ``c`` (by id) of the
tokens equal to it. These kernels find that boundary by search instead of a sort:

1. ``_softmax_stats_kernel``: each chunk's max and ``sum(exp(x - chunk max))``, from which every later
   program rebuilds the row's ``x_max`` and total mass ``Z``.
2. Top-k, then top-p, each a few passes of ``_search_kernel``. Values map to integer keys with the same
   order (16-bit logits: their own bits, since dividing by a temperature keeps their order and never
   merges two of them; float32: the scaled value's bits), so a row's boundary lies in an interval of
   keys ``(lo, hi]``. A pass evaluates ``THRESHOLDS`` keys of the interval: per chunk, how many tokens
   lie above each (top-k) or their mass ``sum(exp(x - x_max))`` (top-p); the next pass (every program
   of the row alike, from the same partials summed in the same order) keeps the part of the interval
   where the count first drops below ``k`` or the mass below ``p`` times the mass top-k keeps. The
   first pass puts its keys at the row's max and below it (from ~23 to 0.25 under it), where top-k's
   few tokens and nearly all of a row's mass lie; the passes after it split sixteenfold, 4 for 16-bit
   keys (``16 ** 4``), 8 for float32 ones (``16 ** 8``), enough for any interval, and stop working
   once a row's interval is one key. Pass by pass (P = 4 or 8):

   ====================  ==================================================================
   pass                  narrows (from the pass before's partials)     evaluates
   ====================  ==================================================================
   top-k 0               --                                             keys in value space
   top-k 1 .. P          its interval                                   sixteenfold split
   top-p 0               top-k's last interval: its boundary            keys in value space
   top-p 1               (target known: p times top-k's kept mass)      sixteenfold split
   top-p 2 .. P          its interval                                   sixteenfold split
   ``_boundary_kernel``  top-p's last interval: its boundary            tokens equal to it
   ====================  ==================================================================

3. ``_boundary_kernel``: the top-p search's last step, and each chunk's count of tokens equal to the
   boundary.
4. ``_filtered_race_kernel``: how many of the equal tokens survive (top-k: ``k`` minus those above;
   top-p: those whose preceding mass ``mass_above + rank * w`` stays below the target), each token's
   rank among them (the counts of the chunks before plus a running sum), and the exponential race over
   the survivors, as ``graphrt.sampling.fused`` races them; ``graphrt.sampling.argmax`` then picks
   each row's best chunk.

The kept set is the sorted path's, except where float32 sums decide differently: masses are summed per
chunk and then across chunks, where the sorted path takes a running sum, so a token whose preceding
mass lies within rounding of ``p`` times the kept mass may fall on the other side (as the race itself
differs only at float32 near-ties). Rows without filters race the whole row exactly as
``sample_temperature``; greedy rows take the argmax. The same kernels run whatever the rows ask for
(14 launches for 16-bit logits, 22 for float32, after zeroing the scratch), so the launch sequence
depends on ``[B, V]`` and the dtype only: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.sampling.argmax import store_chunk_best, two_pass_argmax
from graphrt.sampling.race_noise import log_race_noise, scale_logits, temperature_divisor
from graphrt.sampling.sampler import SamplingTensors

#: Keys a search pass evaluates in a row's interval; each pass narrows it sixteenfold.
THRESHOLDS = 16
#: Most vocabulary entries one program handles.
MAX_CHUNK = 4096
#: Entries a search program compares with the thresholds at a time ([THRESHOLDS, _SUB] tiles).
_SUB = 256

_T = tl.constexpr(THRESHOLDS)
#: The smallest top-p target: p * mass may underflow float32 (p is any value in (0, 1], and the GPU
#: flushes subnormals), and a target of 0 would keep nothing. The max weighs 1, so any target up to 1
#: keeps just the first token of the max, as the sorting path keeps position 0 whatever p is.
_MIN_TARGET = tl.constexpr(2.0**-100)
#: log2 of the first pass's largest gap below the row's max over 0.25: 0.25 * 2 ** 6.5 ~ 23.
_LARGEST_GAP_LOG2 = tl.constexpr((THRESHOLDS - 2) * 0.5)
#: A row's search state, float64 (keys, counts and float32 masses are exact in it): the interval
#: (lo, hi], the count or mass above hi, the top-k boundary key and how many tokens equal to it
#: survive top-k, the search's target, then the THRESHOLDS keys this pass evaluates (the next pass
#: reads them back rather than computing them again).
_LO, _HI, _STAT_HI, _KEY_K, _KEPT_K, _TARGET, _KEYS = (tl.constexpr(i) for i in range(7))
STATE_FIELDS = 6 + THRESHOLDS
_FIELDS = tl.constexpr(STATE_FIELDS)


def key_range(dtype: torch.dtype) -> tuple[int, int, int]:
    """(a key below every value's, the largest key, passes of each search) for logits of ``dtype``: the
    first pass in value space, then enough sixteenfold splits for any interval left."""
    if dtype.itemsize == 2:
        return -32769, 32767, 1 + 4  # int16 keys (+1 below): 65,536 = 16 ** 4
    return -2139095042, 2139095040, 1 + 8  # float32 keys from -inf - 1 to +inf: under 2 ** 32 = 16 ** 8


@triton.jit
def _flip_negatives(bits, KEY16: tl.constexpr):
    """Float bits (int32; 16-bit floats' sign-extended) to an integer key of the same order, and back:
    a negative value's magnitude bits are inverted, so larger magnitudes sort lower. Its own inverse."""
    if KEY16:
        flipped = tl.where(bits < 0, bits ^ 0x7FFF, bits)
    else:
        flipped = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return flipped


@triton.jit
def _entries(logits_ptr, row, stride_row, cols, in_vocab, temperature, KEY16: tl.constexpr, EXACT: tl.constexpr):
    """(x, key) of the entries ``cols``: ``x = logits / temperature`` in float32 (the raw logits for greedy
    rows; -inf outside the vocabulary) and an int32 key ordered as x, with -0.0 keyed as 0.0 since they
    compare equal (outside the vocabulary: the int32 minimum). EXACT: x divided as the sorting path
    divides (IEEE, dearer than the GPU's approximate division); needed where x decides an
    order (float32 keys come from x, and the race), not where it only weighs (a mass is compared with
    a target up to float rounding anyway)."""
    raw = tl.load(logits_ptr + row * stride_row + cols, mask=in_vocab, other=float("-inf"))
    if EXACT:
        x = scale_logits(raw.to(tl.float32), temperature)
    else:
        x = raw.to(tl.float32) / temperature_divisor(temperature)
    if KEY16:
        key = _flip_negatives(raw.to(tl.int16, bitcast=True).to(tl.int32), True)
    else:
        key = _flip_negatives(x.to(tl.int32, bitcast=True), False)
    key = tl.where(key == -1, 0, key)  # -0.0's key is -1
    return x, tl.where(in_vocab, key, -2147483648)  # entries past the vocabulary lie below every threshold


@triton.jit
def _key_weight(key, x_max, temperature, dtype, KEY16: tl.constexpr):
    """``exp(x - x_max)`` of the value whose key is ``key`` (int64 scalar; the inverse of _entries)."""
    bits = _flip_negatives(key.to(tl.int32), KEY16)
    if KEY16:
        x = scale_logits(bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32), temperature)
    else:
        x = bits.to(tl.float32, bitcast=True)
    return tl.exp(x - x_max)


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
    """The row's largest scaled value and ``sum(exp(x - x_max))`` from the per-chunk figures."""
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    maxes = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    masses = tl.load(chunk_mass_ptr + row * num_chunks + chunks, mask=mask, other=0.0)
    x_max = tl.max(maxes, axis=0)
    return x_max, tl.sum(tl.where(maxes > float("-inf"), masses * tl.exp(maxes - x_max), 0.0), axis=0)


@triton.jit
def _row_sum(partial_ptr, row, num_chunks, CHUNKS_BLOCK: tl.constexpr):
    """The sum over a row's chunks of a [B, C] partial (a tree sum, in the same order every time)."""
    chunks = tl.arange(0, CHUNKS_BLOCK)
    return tl.sum(tl.load(partial_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0), axis=0)


@triton.jit
def _key_thresholds(lo, hi):
    """[THRESHOLDS] int64 keys splitting (lo, hi] into sixteen parts; the first is lo itself."""
    j = tl.arange(0, _T).to(tl.int64)
    return lo + (j * (hi - lo) + (_T - 1)) // _T


@triton.jit
def _value_thresholds(lo, hi, x_max, temperature, dtype, KEY16: tl.constexpr):
    """[THRESHOLDS] int64 keys for a search's first pass: lo, then the keys of ``x_max - d`` for d from
    ~23 down to 0.25 (halving every two keys), then the max's own, clamped into (lo, hi]. Top-k's and
    top-p's boundaries usually lie within a few units of the max; the sixteenfold passes after this one
    narrow whatever interval it leaves (any monotone rounding of the values will do)."""
    j = tl.arange(0, _T)
    gap = tl.where(j == _T - 1, 0.0, 0.25 * tl.exp2(j.to(tl.float32) * -0.5 + _LARGEST_GAP_LOG2))
    value = x_max - gap
    if KEY16:  # the 16-bit logit nearest value * temperature
        bits = (value * temperature_divisor(temperature)).to(dtype).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits = value.to(tl.int32, bitcast=True)
    key = _flip_negatives(bits, KEY16)
    return tl.where(j == 0, lo, tl.minimum(tl.maximum(key.to(tl.int64), lo + 1), hi))


@triton.jit
def _advance(state_ptr, partial_ptr, row, num_chunks, target, CHUNKS_BLOCK: tl.constexpr):
    """The interval after a pass evaluated the keys ``state_ptr`` holds (ascending, the first its lo)
    of its interval (lo, hi]: the part where the statistic above a key (``partial_ptr``, [B, C,
    THRESHOLDS] counts or masses, summed over the row's chunks in a fixed order) first drops below
    ``target``. Returns (lo, hi, statistic above hi); hi and its statistic stay when no key is below the
    target."""
    j = tl.arange(0, _T)
    keys = tl.load(state_ptr + _KEYS + j).to(tl.int64)
    hi = tl.load(state_ptr + _HI).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    offsets = (row * num_chunks + chunks[:, None]) * _T + j[None, :]
    above = tl.sum(tl.load(partial_ptr + offsets, mask=(chunks < num_chunks)[:, None], other=0), axis=0)
    above = above.to(tl.float32)
    first = tl.min(tl.where((j >= 1) & (above < target), j, _T), axis=0)
    found = first < _T
    new_lo = tl.sum(tl.where(j == first - 1, keys, 0), axis=0)
    new_hi = tl.where(found, tl.sum(tl.where(j == first, keys, 0), axis=0), hi)
    stat_hi = tl.where(found, tl.sum(tl.where(j == first, above, 0.0), axis=0),
                       tl.load(state_ptr + _STAT_HI).to(tl.float32))
    return new_lo, new_hi, stat_hi


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
    x, _ = _entries(logits_ptr, row, stride_row, cols, cols < vocab_size, tl.load(temperature_ptr + row), False,
                    False)
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
    counts_in_ptr,  # [B, C, THRESHOLDS] int32: the top-k pass before's counts above its thresholds
    masses_in_ptr,  # [B, C, THRESHOLDS] float32: the top-p pass before's masses above its thresholds
    state_out_ptr,  # [B, STATE_FIELDS] float64: the interval this pass evaluates
    counts_out_ptr,  # [B, C, THRESHOLDS] int32 (top-k)
    masses_out_ptr,  # [B, C, THRESHOLDS] float32 (top-p)
    mass_above_k_ptr,  # [B, C] float32: per chunk, the mass above the top-k boundary (top-p step 0 writes it)
    stride_row,
    vocab_size,
    num_chunks,
    TOP_P: tl.constexpr,  # False: the top-k search (by count); True: the top-p search (by mass)
    STEP: tl.constexpr,  # 0: the search's first pass (thresholds in value space; top-p: after top-k's last
    #                      step); 1: its second (top-p: the target, p times the mass top-k keeps, known
    #                      from then); 2: later passes
    KEY16: tl.constexpr,  # 16-bit logits, keyed by their own bits
    BELOW: tl.constexpr,  # a key below every value's
    TOP: tl.constexpr,  # the largest key
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, k, p, k_on, p_on = _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size)
    x_max, total = _row_max_and_mass(chunk_max_ptr, chunk_mass_ptr, row, num_chunks, CHUNKS_BLOCK)
    dtype = logits_ptr.dtype.element_ty
    if TOP_P:
        searching = p_on
    else:
        searching = k_on
    state_in = state_in_ptr + row * _FIELDS
    lo = tl.load(state_in + _LO).to(tl.int64)
    hi = tl.load(state_in + _HI).to(tl.int64)
    stat_hi = tl.load(state_in + _STAT_HI).to(tl.float32)
    key_k = tl.load(state_in + _KEY_K).to(tl.int64)
    kept_k = tl.load(state_in + _KEPT_K).to(tl.float32)
    target = tl.load(state_in + _TARGET).to(tl.float32)
    if STEP == 0:
        if TOP_P:
            # The top-k boundary is the k-th largest value; of the tokens equal to it, the first k - (count
            # above) survive. Top-p then searches (key below the boundary, largest key]: above lo lies
            # everything top-k keeps, above the largest key nothing.
            if k_on & (hi - lo > 1):
                _lo_k, key_k, stat_hi = _advance(state_in, counts_in_ptr, row, num_chunks, k.to(tl.float32),
                                                 CHUNKS_BLOCK)
            else:
                key_k = hi
            kept_k = tl.where(k_on, k.to(tl.float32) - stat_hi, 0.0)
            key_k = tl.where(k_on, key_k, BELOW)
            lo = tl.where(k_on, key_k - 1, BELOW)
            target = p * total  # rows with top-k: replaced in the next pass, once their kept mass is summed
        else:
            lo = tl.full((), BELOW, tl.int64)
            key_k = tl.full((), BELOW, tl.int64)
            kept_k = tl.zeros((), tl.float32)
            target = k.to(tl.float32)
        hi = tl.full((), TOP, tl.int64)
        stat_hi = tl.zeros((), tl.float32)  # nothing lies above the largest key
        keys = _value_thresholds(lo, hi, x_max, temperature, dtype, KEY16)
    else:
        if TOP_P:
            if STEP == 1:
                mass_k = _row_sum(mass_above_k_ptr, row, num_chunks, CHUNKS_BLOCK) + kept_k * _key_weight(
                    tl.where(k_on, key_k, 0), x_max, temperature, dtype, KEY16)
                target = p * tl.where(k_on, mass_k, total)
            target = tl.maximum(target, _MIN_TARGET)
        # Rows that skip this search, or whose interval is down to one key, keep their state.
        if searching & (hi - lo > 1):
            if TOP_P:
                lo, hi, stat_hi = _advance(state_in, masses_in_ptr, row, num_chunks, target, CHUNKS_BLOCK)
            else:
                lo, hi, stat_hi = _advance(state_in, counts_in_ptr, row, num_chunks, target, CHUNKS_BLOCK)
        keys = _key_thresholds(lo, hi)
    if chunk == 0:
        state_out = state_out_ptr + row * _FIELDS
        tl.store(state_out + _LO, lo.to(tl.float64))
        tl.store(state_out + _HI, hi.to(tl.float64))
        tl.store(state_out + _STAT_HI, stat_hi.to(tl.float64))
        tl.store(state_out + _KEY_K, key_k.to(tl.float64))
        tl.store(state_out + _KEPT_K, kept_k.to(tl.float64))
        tl.store(state_out + _TARGET, target.to(tl.float64))
        tl.store(state_out + _KEYS + tl.arange(0, _T), keys.to(tl.float64))
    if searching & (hi - lo > 1):
        # [THRESHOLDS, SUB] tiles, the thresholds along the first axis: each thread keeps all sixteen
        # comparisons of its own entries in registers (entries along the first axis would be spread
        # over lanes and rebroadcast through shared memory every slice).
        thresholds = keys.to(tl.int32)[:, None]
        above_count = tl.zeros([_T, SUB], dtype=tl.int32)
        above_mass = tl.zeros([_T, SUB], dtype=tl.float32)
        mass_above_k = tl.zeros([SUB], dtype=tl.float32)
        for start in tl.static_range(0, CHUNK, SUB):  # unrolled: the slices' loads can all be in flight
            cols = chunk * CHUNK + start + tl.arange(0, SUB)
            in_vocab = cols < vocab_size
            x, key = _entries(logits_ptr, row, stride_row, cols, in_vocab, temperature, KEY16, not KEY16)
            above = key[None, :] > thresholds
            if TOP_P:
                weight = tl.exp(x - x_max)
                above_mass += tl.where(above, weight[None, :], 0.0)
                if STEP == 0:
                    mass_above_k += tl.where(key > key_k, weight, 0.0)
            else:
                above_count += above.to(tl.int32)
        offsets = (row * num_chunks + chunk) * _T + tl.arange(0, _T)
        if TOP_P:
            tl.store(masses_out_ptr + offsets, tl.sum(above_mass, axis=1))
            if STEP == 0:
                tl.store(mass_above_k_ptr + row * num_chunks + chunk, tl.sum(mass_above_k, axis=0))
        else:
            tl.store(counts_out_ptr + offsets, tl.sum(above_count, axis=1))


@triton.jit
def _boundary_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64
    top_p_ptr,  # [B] float32
    state_in_ptr,  # [B, STATE_FIELDS] float64: the top-p search's last interval
    masses_in_ptr,  # [B, C, THRESHOLDS] float32: its masses
    boundary_ptr,  # [B, STATE_FIELDS] float64 out: the boundary key in _LO, the mass above it in _STAT_HI
    ties_ptr,  # [B, C] int32 out: tokens equal to the boundary, per chunk
    stride_row,
    vocab_size,
    num_chunks,
    KEY16: tl.constexpr,
    BELOW: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, _, _, k_on, p_on = _row_filters(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab_size)
    state_in = state_in_ptr + row * _FIELDS
    target = tl.load(state_in + _TARGET).to(tl.float32)
    key_p = tl.load(state_in + _HI).to(tl.int64)
    mass_above_p = tl.load(state_in + _STAT_HI).to(tl.float32)
    lo = tl.load(state_in + _LO).to(tl.int64)
    if p_on & (key_p - lo > 1):  # the last pass's interval, narrowed to its one key
        _lo_p, key_p, mass_above_p = _advance(state_in, masses_in_ptr, row, num_chunks, target, CHUNKS_BLOCK)
    key_k = tl.load(state_in + _KEY_K).to(tl.int64)
    # Rows without filters keep every token: no key is below BELOW, none equal to it.
    boundary = tl.where(p_on, key_p, tl.where(k_on, key_k, BELOW))
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    _, key = _entries(logits_ptr, row, stride_row, cols, in_vocab, temperature, KEY16, not KEY16)
    equal = (key.to(tl.int64) == boundary) & in_vocab
    tl.store(ties_ptr + row * num_chunks + chunk, tl.sum(equal.to(tl.int32), axis=0))
    if chunk == 0:
        out = boundary_ptr + row * _FIELDS
        tl.store(out + _LO, boundary.to(tl.float64))
        tl.store(out + _STAT_HI, mass_above_p.to(tl.float64))
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
    KEY16: tl.constexpr,
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
    # Rows without top-p take a weight of 1, so that nothing below divides by 0.
    weight = tl.where(p_on, _key_weight(tl.where(p_on, boundary, 0), x_max, temperature, logits_ptr.dtype.element_ty,
                                        KEY16), 1.0)
    by_mass = tl.ceil((tl.load(state + _TARGET).to(tl.float32) - tl.load(state + _STAT_HI).to(tl.float32)) / weight)
    available = tl.where(k_on & (boundary == key_k), kept_k, equal_total)
    survivors = tl.where(p_on, tl.minimum(by_mass, available), tl.where(k_on, kept_k, equal_total))

    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    x, key = _entries(logits_ptr, row, stride_row, cols, in_vocab, temperature, KEY16, True)
    equal = ((key.to(tl.int64) == boundary) & in_vocab).to(tl.int32)
    rank = tl.sum(tl.where(chunks < chunk, ties, 0), axis=0) + tl.cumsum(equal, axis=0) - equal  # by token id
    kept = in_vocab & ((key.to(tl.int64) > boundary) | ((equal > 0) & (rank.to(tl.float32) < survivors)))
    if temperature > 0:
        noise = log_race_noise(cols, tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        x = tl.where(kept, x + noise, float("-inf"))
    store_chunk_best(x, row, chunk, best_ptr, best_index_ptr, num_chunks, CHUNK)


def sample_top_k_top_p(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None,
                       max_chunk: int = MAX_CHUNK) -> torch.Tensor:
    """One token per row with ``graphrt.sampling.sampler.sample``'s filtering convention, without sorting: greedy
    rows take the argmax, rows with top-k / top-p race their kept tokens, the others the whole row.

    logits: [B, V] float16 / bfloat16 / float32 (columns contiguous; finite or -inf, at least one finite
    value a row); sampling: B rows on the same device; out: [B] int64 (allocated when not given).
    ``max_chunk``: the most columns a program handles (a power of two; small values exercise the chunking
    in tests). Allocates its scratch (a few [B, ceil(V / chunk), 16] buffers); capturable: the launches
    depend on B, V and the dtype only.
    """
    if logits.dim() == 2 and sampling.batch_size != logits.shape[0]:  # other shapes: two_pass_argmax says
        raise ValueError(f"logits have {logits.shape[0]} rows, sampling tensors {sampling.batch_size}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    below, top, passes = key_range(logits.dtype)
    key16 = logits.dtype.itemsize == 2

    def chunk_pass(grid, best, best_index, chunk, num_chunks):
        batch, vocab = logits.shape
        device = logits.device
        chunks_block = triton.next_power_of_2(num_chunks)
        chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
        chunk_mass = torch.empty_like(chunk_max)
        mass_above_k = torch.zeros_like(chunk_max)
        # Two sets of partials, one per pass parity: pass n writes set n % 2 and reads the other, the one
        # the pass before wrote. Zeroed, and states[0] too, so that nothing reads uninitialised memory
        # (a search's first pass loads the state before it and discards it).
        counts = torch.zeros(2, batch, num_chunks, THRESHOLDS, dtype=torch.int32, device=device)
        masses = torch.zeros(2, batch, num_chunks, THRESHOLDS, dtype=torch.float32, device=device)
        states = torch.zeros(2 * passes + 2, batch, STATE_FIELDS, dtype=torch.float64, device=device)
        ties = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
        filters = (sampling.temperature, sampling.top_k, sampling.top_p)
        shape = (logits.stride(0), vocab, num_chunks)
        _softmax_stats_kernel[grid](logits, sampling.temperature, chunk_max, chunk_mass, *shape, CHUNK=chunk,
                                    num_warps=8)
        for n in range(2 * passes):  # pass n reads states[n], writes states[n + 1]
            _search_kernel[grid](
                logits, *filters, chunk_max, chunk_mass, states[n], counts[(n + 1) % 2], masses[(n + 1) % 2],
                states[n + 1], counts[n % 2], masses[n % 2], mass_above_k, *shape, TOP_P=n >= passes,
                STEP=min(n % passes, 2), KEY16=key16, BELOW=below, TOP=top, CHUNK=chunk,
                SUB=min(_SUB, chunk), CHUNKS_BLOCK=chunks_block, num_warps=8,
            )
        last, boundary = states[2 * passes], states[2 * passes + 1]
        _boundary_kernel[grid](logits, *filters, last, masses[(2 * passes - 1) % 2], boundary, ties, *shape,
                               KEY16=key16, BELOW=below, CHUNK=chunk, CHUNKS_BLOCK=chunks_block, num_warps=8)
        _filtered_race_kernel[grid](logits, *filters, chunk_max, chunk_mass, sampling.seeds, sampling.steps, boundary,
                                    ties, best, best_index, *shape, KEY16=key16, CHUNK=chunk,
                                    CHUNKS_BLOCK=chunks_block, num_warps=8)

    return two_pass_argmax(logits, out, chunk_pass, max_chunk)
