"""Token sampling that runs entirely on the device and can be captured in a CUDA graph.

Design constraints, and how they are met:

* **Capturable.** ``sample`` never synchronises with the host: no ``.item()``, ``.tolist()``,
  ``nonzero`` or boolean indexing, every intermediate has a shape fixed by ``[B, V]``, and no
  CPU tensor is touched. Branches are taken only on host-side Python flags
  (``SamplingTensors.all_greedy`` / ``needs_top_k_top_p``) that are known before the call, so a
  graph captured for one combination of flags replays correctly for any batch with those flags.
* **Reproducible per request.** Randomness comes from a counter-based hash of
  ``(seed, step, token id)`` instead of a stateful generator, so the token drawn for a request
  depends only on its own logits row, its own parameters, its seed and its step -- not on its
  position in the batch, the batch size, or the other requests in it. Every other operation is
  row-wise too.
* **Exact sampling.** Tokens are drawn with the exponential race (equivalently, the Gumbel-max
  trick): with ``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i`` is distributed as ``p``.
  This needs one noise value per token and an argmax -- no cumulative search, no
  ``torch.multinomial`` (which is neither batch-independent nor, with its generator, easy to
  capture).

Filtering convention (rows with temperature > 0):

1. ``x = logits / temperature``.
2. top-k (``k >= 1``): keep the ``k`` largest ``x``; when values tie at the boundary the lower
   token ids are kept (stable sort), so exactly ``min(k, V)`` tokens survive.
3. top-p (``0 < p < 1``), over ``softmax`` of the survivors of step 2: sort them by probability
   (ties: lower id first) and keep each token whose *preceding* mass -- the summed probability
   of the tokens ranked strictly before it -- is ``< p``. This is the smallest prefix whose mass
   reaches ``p``; the most likely token is always kept.
4. Draw from the survivors, renormalised.

Rows with temperature 0 (or below ``GREEDY_TEMPERATURE``, which ``from_params`` stores as 0)
take ``argmax(logits)``; ties go to the lowest token id, as with ``torch.argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from graphrt.sampling.params import SEED_LIMIT, SamplingParams

__all__ = [
    "SamplingTensors",
    "host_rows",
    "sample",
    "uniform_noise",
    "exponential_noise",
    "hash32",
]

_MASK32 = 0xFFFFFFFF

# Constants of the "lowbias32" integer hash (Chris Wellons, "Prospecting for Hash Functions",
# public domain): xorshift / odd-multiply rounds, each a bijection on 32-bit integers.
_HASH_SHIFTS = (16, 15, 16)
_HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)

# Arbitrary odd constants (fractional digits of sqrt(2) and sqrt(3)) that make the two
# per-row key chains below differ from each other even for seed 0, step 0.
_KEY1_SALT = 0x6A09E667
_KEY2_SALT = 0xBB67AE85


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, never overflowing int64.

    A 32x32-bit product needs 64 bits, one more than int64 holds, so a multiplier of 2**31 or
    more is split in 16-bit halves: ``x*c = x*lo + (x*hi << 16)``, and of ``x*hi`` only the low
    16 bits survive the shift modulo 2**32. Every intermediate then stays below 2**49.
    """
    if c < 2**31:
        return (x * c) & _MASK32  # < 2**32 * 2**31 = 2**63
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash applied element-wise.

    Args:
        x: int64 tensor with values in ``[0, 2**32)``.

    Returns:
        int64 tensor of the same shape, values in ``[0, 2**32)``. The map is a bijection on
        32-bit integers, so distinct inputs give distinct outputs.
    """
    x = x ^ (x >> _HASH_SHIFTS[0])
    x = _mulmod32(x, _HASH_MULTIPLIERS[0])
    x = x ^ (x >> _HASH_SHIFTS[1])
    x = _mulmod32(x, _HASH_MULTIPLIERS[1])
    x = x ^ (x >> _HASH_SHIFTS[2])
    return x


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row from the 64-bit seed and step ([B] int64 each).

    Each key is a chain of hashes over the four 32-bit halves (in different orders and with
    different salts). Two keys make it vanishingly unlikely (~2**-64) that two (seed, step)
    pairs share a noise stream, and for a fixed seed every step gives a different first key
    (each link of the chain is a bijection), so a request never reuses noise across steps.
    """
    s_lo, s_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    t_lo, t_hi = steps & _MASK32, (steps >> 32) & _MASK32
    k1 = hash32(s_lo ^ _KEY1_SALT)
    k1 = hash32(k1 ^ s_hi)
    k1 = hash32(k1 ^ t_hi)
    k1 = hash32(k1 ^ t_lo)
    k2 = hash32(s_hi ^ _KEY2_SALT)
    k2 = hash32(k2 ^ t_hi)
    k2 = hash32(k2 ^ s_lo)
    k2 = hash32(k2 ^ t_lo)
    return k1, k2


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in the open interval (0, 1), a pure function of (seed, step, token id).

    Args:
        seeds: ``[B]`` int64, values in ``[0, 2**63)``.
        steps: ``[B]`` int64, values >= 0.
        token_ids: ``[N]`` (shared by every row) or ``[B, N]`` int64, values in ``[0, 2**32)``.

    Returns:
        ``[B, N]`` float32. Each value is an odd multiple of ``2**-24`` in
        ``[2**-24, 1 - 2**-24]``: 23 random bits, exactly representable in float32, so it is
        never 0 or 1 and ``-log(u)`` is always finite and positive.
    """
    k1, k2 = _row_keys(seeds, steps)
    # Two rounds keyed by independent row keys: with one round, rows whose keys differ only in
    # the low bits would see permutations of each other's noise.
    x = hash32(token_ids ^ k1[:, None])
    x = hash32(x ^ k2[:, None])
    # The top 23 bits (the best mixed ones) -> (2m + 1) / 2**24.
    return ((x >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``Exp(1)`` draws ``-log(U)`` with ``U`` from :func:`uniform_noise`; ``[B, N]`` float32, > 0.

    Since ``U <= 1 - 2**-24``, the smallest value is about 6e-8, never 0, so dividing by it is
    safe.
    """
    return -torch.log(uniform_noise(seeds, steps, token_ids))


def host_rows(
    params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> tuple[list[float], list[int], list[float], bool, bool]:
    """Validate a batch's rows and convert them as ``SamplingTensors`` stores them.

    Returns ``(temperatures, top_ks, top_ps, all_greedy, needs_top_k_top_p)``: temperature 0 for
    greedy rows, top-k 0 for "off". Raises ValueError if the lengths differ or a seed / step is out of
    range (see ``SamplingTensors.from_params``).
    """
    batch = len(params)
    if len(seeds) != batch or len(steps) != batch:
        raise ValueError(
            f"from_params: got {batch} params, {len(seeds)} seeds and {len(steps)} steps; "
            "they must have the same length"
        )
    temps: list[float] = []
    top_ks: list[int] = []
    top_ps: list[float] = []
    all_greedy = True
    needs_filter = False
    for p, seed, step in zip(params, seeds, steps):
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"from_params: seed {seed!r} is not in [0, 2**63)")
        if step < 0:
            raise ValueError(f"from_params: step {step!r} is negative")
        greedy = p.greedy
        temps.append(0.0 if greedy else p.temperature)
        top_ks.append(p.top_k if p.top_k > 0 else 0)
        top_ps.append(p.top_p)
        all_greedy &= greedy
        needs_filter |= p.filtered  # filters on greedy rows do not force the sort
    return temps, top_ks, top_ps, all_greedy, needs_filter


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, on the device.

    Tensors (all ``[B]``, on the logits' device):
        temperature: float32; 0 marks a greedy row.
        top_k: int64; 0 = off (``-1`` from ``SamplingParams`` is stored as 0).
        top_p: float32 in (0, 1]; 1 = off.
        seeds: int64 in ``[0, 2**63)``; the request's seed.
        steps: int64 >= 0; index of the token being sampled within that request's output (0 for
            its first generated token). With ``seeds`` it selects the random numbers.

    Host-side flags (plain bools, chosen before the call so no sync is needed):
        all_greedy: every row is greedy -> ``sample`` only takes an argmax.
        needs_top_k_top_p: some non-greedy row uses top-k or top-p -> ``sample`` sorts the
            logits; otherwise the sort is skipped.

    The fast paths give the same tokens as the general path (up to exact floating-point ties),
    so a graph runner may capture the general path only (both flags set as
    ``all_greedy=False, needs_top_k_top_p=True``) and still serve every batch.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    all_greedy: bool
    needs_top_k_top_p: bool

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """Build the tensors for a batch (one row per request).

        Args:
            params: each request's (already validated) sampling parameters.
            seeds: each request's resolved seed in ``[0, 2**63)``: its own ``params.seed``, or
                one the engine drew for it when it arrived.
            steps: each request's number of tokens generated so far.
            device: where the tensors go (the logits' device).

        Raises:
            ValueError: if the lengths differ or a seed / step is out of range.
        """
        batch = len(params)
        temps, top_ks, top_ps, all_greedy, needs_filter = host_rows(params, seeds, steps)
        # Two host-to-device copies (one per dtype) instead of five, from pinned memory on CUDA: a copy
        # from pageable memory waits for the stream, so a prompt step's sampling would wait there for
        # the forward queued before it, its own launches then exposed after it.
        device = torch.device(device)
        pinned = device.type == "cuda"
        floats = torch.tensor([temps, top_ps], dtype=torch.float32, pin_memory=pinned)
        ints = torch.tensor([top_ks, [int(s) for s in seeds], [int(s) for s in steps]], dtype=torch.int64,
                            pin_memory=pinned)
        floats = floats.to(device, non_blocking=True).reshape(2, batch)
        ints = ints.to(device, non_blocking=True).reshape(3, batch)
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            seeds=ints[1],
            steps=ints[2],
            all_greedy=all_greedy,
            needs_top_k_top_p=needs_filter,
        )

    @classmethod
    def allocate(cls, max_batch_size: int, device: torch.device | str) -> SamplingTensors:
        """Static buffers for ``max_batch_size`` rows (e.g. for a captured graph), all greedy."""
        return cls(
            temperature=torch.zeros(max_batch_size, dtype=torch.float32, device=device),
            top_k=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            top_p=torch.ones(max_batch_size, dtype=torch.float32, device=device),
            seeds=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            steps=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            all_greedy=True,
            needs_top_k_top_p=False,
        )

    def copy_into(self, dst: SamplingTensors) -> SamplingTensors:
        """Write this batch into rows ``[:B]`` of ``dst``'s (larger, static) tensors, in place.

        ``dst``'s tensors keep their storage, so a CUDA graph that reads them sees the new values
        on replay. ``dst``'s flags are set to this batch's (a graph must have been captured for
        those flags, or for the general path). Rows ``B:`` are left as they were: ``sample``
        works row by row, so whatever they hold cannot change rows ``[:B]``.

        Returns:
            ``dst``.

        Raises:
            ValueError: if ``dst`` has fewer rows than this batch or lives on another device.
        """
        batch = self.batch_size
        if dst.batch_size < batch:
            raise ValueError(f"copy_into: destination has {dst.batch_size} rows, batch needs {batch}")
        if dst.temperature.device != self.temperature.device:
            raise ValueError(
                f"copy_into: destination is on {dst.temperature.device}, batch on {self.temperature.device}"
            )
        for name in ("temperature", "top_k", "top_p", "seeds", "steps"):
            getattr(dst, name)[:batch].copy_(getattr(self, name), non_blocking=True)
        dst.all_greedy = self.all_greedy
        dst.needs_top_k_top_p = self.needs_top_k_top_p
        return dst


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` float32, or another float dtype (upcast, except for an all-greedy batch's
            argmax, which needs no upcast), on the same device as ``t``.
            Rows may contain ``-inf`` but each needs at least one finite value.
        t: the batch's parameters, ``B`` rows.

    Returns:
        ``[B]`` int64 token ids.

    Capturable in a CUDA graph; see the module docstring for the exact semantics.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] != t.batch_size:
        raise ValueError(f"sample: logits have {logits.shape[0]} rows, sampling tensors {t.batch_size}")
    if t.all_greedy:
        # Upcasting is exact, so the argmax of the raw logits is the float32 one; skipping it saves a
        # pass over [B, V].
        return torch.argmax(logits, dim=-1)
    logits = logits.float()  # no-op (no copy) for float32
    greedy_tokens = torch.argmax(logits, dim=-1)

    is_greedy = t.temperature <= 0
    # Greedy rows divide by 1 instead of 0 so they produce no inf/NaN; their result is
    # replaced by the argmax at the end anyway.
    scaled = logits / t.temperature.masked_fill(is_greedy, 1.0)[:, None]
    if t.needs_top_k_top_p:
        random_tokens = _sample_filtered(scaled, t)
    else:
        random_tokens = _sample_unfiltered(scaled, t)
    return torch.where(is_greedy, greedy_tokens, random_tokens)


def _sample_unfiltered(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Exponential race over the full vocabulary; ``scaled`` is ``[B, V]`` logits / temperature."""
    vocab = scaled.shape[1]
    # Unnormalised probabilities: the race is scale-invariant per row, and skipping the sum
    # keeps the result bit-identical to the filtered path (whose sum runs in another order).
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    token_ids = torch.arange(vocab, device=scaled.device)
    race = weights / exponential_noise(t.seeds, t.steps, token_ids)
    return torch.argmax(race, dim=-1)


def filtered_order(scaled: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row in sorted order with top-k, then top-p, applied (the convention in the module docstring).

    Args:
        scaled: ``[B, V]`` float32 logits / temperature.
        t: the batch's parameters.

    Returns:
        ``(sorted_ids, weights, kept)``, each ``[B, V]``: token ids in sorted order (value descending,
        ties by ascending id), their weights ``exp(x - row max)`` with dropped positions zeroed, and the
        kept positions (bool; a kept token may still weigh 0 if its logit is -inf or underflows).
    """
    vocab = scaled.shape[1]
    # Stable, so equal logits keep ascending token-id order: deterministic top-k/top-p ties.
    sorted_x, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=scaled.device)

    weights = torch.exp(sorted_x - sorted_x[:, :1])  # column 0 holds the row max

    # top-k as a position mask; k = 0 (off) or k > V keeps all V positions.
    k = torch.where(t.top_k > 0, t.top_k.clamp(max=vocab), vocab)
    kept = positions < k[:, None]
    weights = weights.masked_fill(~kept, 0.0)

    # top-p on the top-k-filtered distribution. Mass ranked strictly before each position,
    # compared against p * (total kept mass) so no per-row normalisation is needed.
    cum = torch.cumsum(weights, dim=-1)
    mass_before = F.pad(cum[:, :-1], (1, 0))
    drop = mass_before >= t.top_p[:, None] * cum[:, -1:]
    # Position 0 always survives; rows with top_p == 1 drop nothing (float rounding in the
    # cumsum could otherwise push the tail's preceding mass to >= 1.0).
    drop &= positions > 0
    drop &= (t.top_p < 1.0)[:, None]
    kept &= ~drop
    return sorted_ids, weights.masked_fill(drop, 0.0), kept


def _sample_filtered(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Top-k, then top-p, then the exponential race, all in sorted order.

    Working on the sorted row turns both filters into position masks (no scatter back): the
    noise is looked up by each position's token id, so the draw for a row with neither filter
    equals ``_sample_unfiltered``'s.
    """
    sorted_ids, weights, _ = filtered_order(scaled, t)
    # Dropped tokens weigh 0 and so can never win: position 0 weighs 1 and the noise is
    # bounded, so the winner always has a positive race value.
    race = weights / exponential_noise(t.seeds, t.steps, sorted_ids)
    choice = torch.argmax(race, dim=-1, keepdim=True)
    return sorted_ids.gather(1, choice).squeeze(1)
