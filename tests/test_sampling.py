"""Tests for SamplingParams validation and the device-side sampler (CPU only)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrt.base.errors import InvalidRequestError
from graphrt.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from graphrt.sampling.sampler import SamplingTensors, _row_keys, exponential_noise, hash32, sample, uniform_noise

# --------------------------------------------------------------------------------------------
# helpers


def _batch(params, seeds=None, steps=None, device="cpu") -> SamplingTensors:
    n = len(params)
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return SamplingTensors.from_params(params, seeds, steps, device)


def _expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Reference distribution, in float64, for the convention documented in graphrt.sampling.sampler."""
    vocab = len(logits)
    scaled = [x / temperature for x in logits]
    # Descending by value, ties by ascending token id (a stable sort).
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    if top_k > 0:
        order = order[:top_k]
    top = max(scaled[i] for i in order)
    weights = {i: math.exp(scaled[i] - top) for i in order}
    total = sum(weights.values())
    kept, before = [], 0.0
    for i in order:
        if before < top_p or top_p >= 1.0:
            kept.append(i)
        before += weights[i] / total
    kept_total = sum(weights[i] for i in kept)
    return [weights[i] / kept_total if i in kept else 0.0 for i in range(vocab)]


def _lowbias32_reference(x: int) -> int:
    """Plain-Python 32-bit hash the torch version must match (unsigned arithmetic mod 2**32)."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


def _lowbias32_inverse(x: int) -> int:
    """The input that ``_lowbias32_reference`` maps to ``x``: each round undone, last first (an
    xorshift by 16 is its own inverse on 32 bits, one by 15 is undone by 15 then 30; each odd
    multiplier by its inverse mod 2**32)."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & m
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & m
    x ^= x >> 16
    return x


# --------------------------------------------------------------------------------------------
# SamplingParams validation: one test per field


def _assert_rejected(field: str, value, **extra):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}, **extra)
    message = str(info.value)
    assert field in message
    assert repr(value) in message
    assert isinstance(info.value, ValueError)


def test_defaults_are_valid():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 1.0, 0, 1.0, None)
    assert p.stop_token_ids == [] and p.ignore_eos is False
    assert SamplingParams().stop_token_ids is not p.stop_token_ids  # no shared mutable default


def test_edge_values_are_accepted():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=-1, top_p=1e-9, seed=2**63 - 1,
                       stop_token_ids=(0, 7), ignore_eos=True)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.stop_token_ids == [0, 7] and p.greedy
    assert SamplingParams(seed=0, top_k=1, top_p=1.0).seed == 0


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "16", None])
def test_max_tokens_rejected(value):
    _assert_rejected("max_tokens", value)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "1.0", None])
def test_temperature_rejected(value):
    _assert_rejected("temperature", value)


@pytest.mark.parametrize("value", [-2, 1.5, True, "5", None])
def test_top_k_rejected(value):
    _assert_rejected("top_k", value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, float("nan"), False, "0.9", None])
def test_top_p_rejected(value):
    _assert_rejected("top_p", value)


@pytest.mark.parametrize("value", [-1, 2**63, 1.0, True, "42"])
def test_seed_rejected(value):
    _assert_rejected("seed", value)


@pytest.mark.parametrize("value", [[-1], [1, 2.0], [True], "12", 5, None, [None]])
def test_stop_token_ids_rejected(value):
    _assert_rejected("stop_token_ids", value)


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_ignore_eos_rejected(value):
    _assert_rejected("ignore_eos", value)


# --------------------------------------------------------------------------------------------
# SamplingTensors


def test_from_params_layout_and_flags():
    params = [
        SamplingParams(temperature=0.0, top_k=5),        # greedy: its filters do not count
        SamplingParams(temperature=0.8, top_k=-1),
        SamplingParams(temperature=1e-7),                 # below the greedy threshold
    ]
    t = _batch(params, seeds=[3, 2**63 - 1, 9], steps=[0, 4, 2**40])
    assert t.temperature.dtype == torch.float32 and t.top_p.dtype == torch.float32
    for name in ("top_k", "seeds", "steps"):
        assert getattr(t, name).dtype == torch.int64
    assert t.temperature.tolist() == pytest.approx([0.0, 0.8, 0.0])
    assert t.top_k.tolist() == [5, 0, 0]
    assert t.seeds.tolist() == [3, 2**63 - 1, 9]
    assert t.steps.tolist() == [0, 4, 2**40]
    assert not t.all_greedy and not t.needs_top_k_top_p

    assert _batch([SamplingParams(temperature=0)] * 3).all_greedy
    assert _batch([SamplingParams(top_p=0.9)]).needs_top_k_top_p
    assert _batch([SamplingParams(top_k=3)]).needs_top_k_top_p


def test_from_params_rejects_bad_lengths_and_values():
    with pytest.raises(ValueError, match="same length"):
        SamplingTensors.from_params([SamplingParams()], [1, 2], [0], "cpu")
    with pytest.raises(ValueError, match="seed"):
        SamplingTensors.from_params([SamplingParams()], [-1], [0], "cpu")
    with pytest.raises(ValueError, match="step"):
        SamplingTensors.from_params([SamplingParams()], [1], [-1], "cpu")


def test_copy_into_static_buffers():
    gen = torch.Generator().manual_seed(0)
    vocab, max_batch = 300, 8
    params = [SamplingParams(temperature=0.9, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_p=0.7)]
    batch = _batch(params, seeds=[11, 12, 13], steps=[1, 2, 3])
    logits = torch.randn(3, vocab, generator=gen)

    static = SamplingTensors.allocate(max_batch, "cpu")
    storage = [static.temperature.data_ptr(), static.seeds.data_ptr()]
    # Stale junk in the padding rows must not matter.
    static.temperature.fill_(0.5)
    static.top_k.fill_(2)
    static.seeds.fill_(99)
    assert batch.copy_into(static) is static
    assert [static.temperature.data_ptr(), static.seeds.data_ptr()] == storage
    assert static.seeds[:3].tolist() == [11, 12, 13] and static.seeds[3:].tolist() == [99] * 5
    assert static.all_greedy is False and static.needs_top_k_top_p is True

    padded = torch.randn(max_batch, vocab, generator=gen)
    padded[:3] = logits
    assert torch.equal(sample(padded, static)[:3], sample(logits, batch))

    with pytest.raises(ValueError, match="rows"):
        batch.copy_into(SamplingTensors.allocate(2, "cpu"))


def test_sample_rejects_mismatched_shapes():
    t = _batch([SamplingParams()] * 2)
    with pytest.raises(ValueError):
        sample(torch.zeros(3, 10), t)
    with pytest.raises(ValueError):
        sample(torch.zeros(10), t)


@pytest.mark.parametrize("needs_filter", [False, True])
def test_sample_has_no_data_dependence(needs_filter):
    """Proxy for CUDA-graph safety: on the meta device there is no data at all, so any host
    sync (.item(), .tolist(), nonzero, boolean indexing) or data-dependent shape would fail, as
    would creating a tensor on another device."""
    params = [SamplingParams(temperature=0.7, top_k=3 if needs_filter else 0), SamplingParams(temperature=0)]
    t = _batch(params, device="meta")
    out = sample(torch.empty(2, 1000, device="meta"), t)
    assert out.shape == (2,) and out.dtype == torch.int64 and out.device.type == "meta"


# --------------------------------------------------------------------------------------------
# greedy


def test_greedy_equals_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 5000, generator=gen)
    t = _batch([SamplingParams(temperature=0)] * 16)
    assert t.all_greedy
    assert torch.equal(sample(logits, t), torch.argmax(logits, dim=-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax_and_ties_go_to_lowest_id():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 4000, generator=gen)
    logits[0, [17, 9, 3000]] = 50.0  # tie: lowest id (9) must win
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=0, top_p=0.5), SamplingParams(temperature=2.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.9)]
    out = sample(logits, _batch(params))
    greedy_rows = [0, 2, 4]
    assert out[0].item() == 9
    assert torch.equal(out[greedy_rows], torch.argmax(logits[greedy_rows], dim=-1))


def test_top_k_one_equals_greedy():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 3000, generator=gen)
    logits[5, [40, 7]] = 20.0  # tie at the max: both argmax and top-1 pick id 7
    t = _batch([SamplingParams(temperature=0.8, top_k=1)] * 64, seeds=list(range(100, 164)))
    assert torch.equal(sample(logits, t), torch.argmax(logits, dim=-1))


def test_tiny_top_p_equals_greedy():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 3000, generator=gen)
    t = _batch([SamplingParams(temperature=1.5, top_p=1e-9)] * 64, seeds=list(range(64)), steps=[7] * 64)
    assert torch.equal(sample(logits, t), torch.argmax(logits, dim=-1))


# --------------------------------------------------------------------------------------------
# reproducibility and batch independence

_TARGETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.2, top_p=0.9),
    SamplingParams(temperature=0.9, top_k=100, top_p=0.8),
]

_OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3, top_k=5),
    SamplingParams(temperature=2.0, top_p=0.5),
]


@pytest.mark.parametrize("target", _TARGETS, ids=["plain", "top_k", "top_p", "top_k_top_p"])
def test_same_request_same_tokens_in_any_batch(target):
    vocab, seed = 2000, 1234
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(vocab, generator=gen) * 2
    for step in range(12):
        alone = sample(row[None], _batch([target], seeds=[seed], steps=[step]))[0].item()
        for size, position, others in [(2, 1, [1]), (3, 0, [0, 0]), (5, 2, [3, 1, 2, 0]), (9, 8, [2] * 8)]:
            others_params = [_OTHERS[i] for i in others]
            params = others_params[:position] + [target] + others_params[position:]
            seeds = [random.Random(size * 100 + i).randrange(2**63) for i in range(size)]
            seeds[position] = seed
            steps = [(step + 3 * i) % 7 for i in range(size)]
            steps[position] = step
            logits = torch.randn(size, vocab, generator=gen)
            logits[position] = row
            out = sample(logits, _batch(params, seeds=seeds, steps=steps))
            assert out[position].item() == alone, (size, position, step)


#: Temperatures around the greedy threshold: just below it (greedy), at it and just above (sampled, with
#: logits / T near 1e5: every weight but the row maximum's underflows).
_NEAR_GREEDY = [math.nextafter(GREEDY_TEMPERATURE, 0.0), GREEDY_TEMPERATURE, math.nextafter(GREEDY_TEMPERATURE, 1.0),
                1.5 * GREEDY_TEMPERATURE]


def _property_row(kind: str, vocab: int, seed: int) -> torch.Tensor:
    """One row of logits: ``plain`` N(0, 9); ``masked`` a third of it -inf (masked tokens); ``ties`` on a
    grid of 0.5, so values repeat (top-k and top-p boundaries inside runs of equal values); ``tied_max``
    three tokens sharing the maximum; ``one_finite`` every token but one -inf."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=gen) * 3
    if kind == "masked":
        row[torch.randperm(vocab, generator=gen)[: vocab // 3]] = float("-inf")
    elif kind == "ties":
        row = (row * 2).round() / 2
    elif kind == "tied_max":
        row[torch.randperm(vocab, generator=gen)[:3]] = row.max() + 1.0
    elif kind == "one_finite":
        keep = int(torch.randint(vocab, (1,), generator=gen))
        row = torch.full((vocab,), float("-inf")).index_fill(0, torch.tensor([keep]), float(row[keep]))
    return row


_ROW_KINDS = ["plain", "masked", "ties", "tied_max", "one_finite"]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    temperature=st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.7] + _NEAR_GREEDY),
                          st.floats(GREEDY_TEMPERATURE, 4 * GREEDY_TEMPERATURE)),
    top_k=st.sampled_from([0, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.01]),
    seed=st.integers(0, 2**63 - 1),
    step=st.integers(0, 2**40),
    size=st.integers(1, 6),
    kind=st.sampled_from(_ROW_KINDS),
    data=st.data(),
)
def test_batch_independence_property(temperature, top_k, top_p, seed, step, size, kind, data):
    """A row draws the same token alone and in any batch (rows of any kind beside it), and that token is
    one the row allows: a finite logit, within the top-k values, the argmax with the lowest id among
    ties for greedy rows and top-k 1, a maximal logit (up to what the noise can lift) at temperatures
    near the greedy threshold."""
    vocab = 500
    position = data.draw(st.integers(0, size - 1))
    others = data.draw(st.lists(st.sampled_from(_OTHERS), min_size=size - 1, max_size=size - 1))
    target = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    row = _property_row(kind, vocab, seed % 1000)
    alone = sample(row[None], _batch([target], seeds=[seed], steps=[step]))[0].item()

    params = others[:position] + [target] + others[position:]
    seeds = [data.draw(st.integers(0, 2**63 - 1)) for _ in range(size)]
    seeds[position] = seed
    steps = [data.draw(st.integers(0, 100)) for _ in range(size)]
    steps[position] = step
    kinds = [data.draw(st.sampled_from(_ROW_KINDS)) for _ in range(size)]
    logits = torch.stack([_property_row(k, vocab, size * 10 + i) for i, k in enumerate(kinds)])
    logits[position] = row
    out = sample(logits, _batch(params, seeds=seeds, steps=steps))
    assert out[position].item() == alone

    assert math.isfinite(row[alone].item()), "drew a masked (-inf) token"
    if target.greedy or top_k == 1:
        assert alone == int(torch.argmax(row)), "not the argmax with the lowest id among ties"
    elif temperature <= 4 * GREEDY_TEMPERATURE:
        # A token g below the maximum weighs exp(-g / T) of it; the noise's ratio (E_i / E_max) is at least
        # 6e-8 / 16.6, so at T <= 4e-5 it can win only when g < 7.8e-4.
        assert row.max().item() - row[alone].item() < 1e-3, "a near-greedy row drew a token below its maximum"
    if top_k > 0:
        assert (row > row[alone]).sum().item() < top_k, "drew a token outside the top-k values"


def test_fast_path_and_sorted_path_agree():
    """A row with no filters draws the same token whether or not the batch takes the sort path."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(200, 1000, generator=gen)
    params = [SamplingParams(temperature=1.1)] * 200
    t = _batch(params, seeds=list(range(1000, 1200)), steps=list(range(200)))
    assert not t.needs_top_k_top_p
    fast = sample(logits, t)
    t.needs_top_k_top_p = True
    assert torch.equal(sample(logits, t), fast)


def test_different_seeds_and_steps_give_different_draws():
    vocab, n_steps = 1000, 60
    logits = torch.zeros(n_steps, vocab)  # uniform: any repetition would be a coincidence
    plain = [SamplingParams()] * n_steps
    steps = list(range(n_steps))

    def draws(seed):
        return sample(logits, _batch(plain, seeds=[seed] * n_steps, steps=steps))

    a, b, c = draws(7), draws(8), draws(7 + 2**32)  # c: only the seed's high half differs
    assert torch.equal(a, draws(7))  # reproducible
    assert (a == b).sum() <= 3 and (a == c).sum() <= 3 and (b == c).sum() <= 3
    assert len(set(a.tolist())) >= n_steps - 6  # steps of one request differ from each other

    seeds = torch.tensor([7, 7, 8, 7], dtype=torch.int64)
    steps_t = torch.tensor([0, 1, 0, 2**32], dtype=torch.int64)
    noise = uniform_noise(seeds, steps_t, torch.arange(vocab))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(noise[i], noise[j])


# --------------------------------------------------------------------------------------------
# statistical correctness

# Upper 1e-9 tail of chi-square with <= 7 degrees of freedom is below 60, so these bounds
# cannot fail for a correct sampler (and the seeds are fixed, so the test is deterministic).
_CHI2_LIMIT = 60.0
_MAX_ABS_DEV = 0.015  # about 6 standard deviations of a frequency at n = 40000

_SMALL_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.6, 0, 1.0),
        (2.5, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.6),
        (0.8, 5, 0.75),
        (1.7, 6, 0.9),
    ],
)
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p, vary):
    n = 40_000
    logits = torch.tensor(_SMALL_LOGITS).expand(n, -1)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    if vary == "seed":  # many requests, consecutive seeds, same step
        t = _batch(params, seeds=list(range(n)), steps=[3] * n)
    else:  # one request, many consecutive steps
        t = _batch(params, seeds=[987654321] * n, steps=list(range(n)))
    counts = torch.bincount(sample(logits, t), minlength=len(_SMALL_LOGITS)).double()
    expected = torch.tensor(_expected_probs(_SMALL_LOGITS, temperature, top_k, top_p), dtype=torch.float64)

    assert torch.all(counts[expected == 0] == 0), "a filtered-out token was drawn"
    support = expected > 0
    freq = counts / n
    assert (freq - expected).abs().max().item() < _MAX_ABS_DEV
    chi2 = (((counts - n * expected)[support]) ** 2 / (n * expected[support])).sum().item()
    assert chi2 < _CHI2_LIMIT, (chi2, freq.tolist(), expected.tolist())


def test_expected_probs_reference_convention():
    """Pin the documented top-p / top-k boundary convention on hand-made examples."""
    probs = [0.5, 0.3, 0.2]
    logits = [math.log(p) for p in probs]
    assert _expected_probs(logits, 1.0, 0, 0.45) == pytest.approx([1.0, 0.0, 0.0])
    assert _expected_probs(logits, 1.0, 0, 0.79) == pytest.approx([0.625, 0.375, 0.0])
    assert _expected_probs(logits, 1.0, 0, 0.81) == pytest.approx(probs)
    # top-p sees the top-k-renormalised distribution [0.625, 0.375]: 0.625 >= 0.6 drops id 1,
    # which the unfiltered mass 0.5 < 0.6 would have kept.
    assert _expected_probs(logits, 1.0, 2, 0.6) == pytest.approx([1.0, 0.0, 0.0])
    assert _expected_probs(logits, 1.0, 2, 0.7) == pytest.approx([0.625, 0.375, 0.0])

    n = 2000
    rows = torch.tensor(logits, dtype=torch.float32).expand(n, -1)
    for top_k, top_p, allowed in [(0, 0.45, {0}), (0, 0.79, {0, 1}), (0, 0.81, {0, 1, 2}),
                                  (2, 0.6, {0}), (2, 0.7, {0, 1})]:
        t = _batch([SamplingParams(top_k=top_k, top_p=top_p)] * n)
        assert set(sample(rows, t).tolist()) == allowed, (top_k, top_p)


def test_filtered_tokens_are_never_drawn():
    n, vocab = 4000, 64
    gen = torch.Generator().manual_seed(8)
    row = torch.randn(vocab, generator=gen) * 1.5
    row[[3, 30]] = float("-inf")
    logits = row.expand(n, -1)

    def support(params):
        drawn = set(sample(logits, _batch([params] * n)).tolist())
        allowed = {i for i, p in enumerate(_expected_probs(row.tolist(), params.temperature,
                                                            params.top_k, params.top_p)) if p > 0}
        return drawn, allowed

    drawn, allowed = support(SamplingParams(temperature=1.0, top_k=4))
    assert drawn == allowed and len(allowed) == 4
    drawn, allowed = support(SamplingParams(temperature=1.0, top_p=0.5))
    assert drawn <= allowed and len(drawn) >= 2
    drawn, allowed = support(SamplingParams(temperature=3.0))
    assert 3 not in drawn and 30 not in drawn

    # Top-k ties at the boundary keep the lower ids.
    tied = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0]).expand(n, -1)
    drawn = set(sample(tied, _batch([SamplingParams(top_k=2)] * n)).tolist())
    assert drawn == {1, 2}


# --------------------------------------------------------------------------------------------
# the counter-based hash


def test_hash32_matches_reference_and_stays_in_range():
    rng = random.Random(9)
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(5000)]
    out = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert out == [_lowbias32_reference(x) for x in xs]
    assert [_lowbias32_inverse(_lowbias32_reference(x)) for x in xs] == xs
    assert all(0 <= v < 2**32 for v in out)
    # a bijection: consecutive inputs never collide
    block = hash32(torch.arange(2**20, dtype=torch.int64))
    assert torch.unique(block).numel() == 2**20


def test_uniform_noise_is_uniform_and_open():
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    steps = torch.arange(64, dtype=torch.int64) % 5
    u = uniform_noise(seeds, steps, torch.arange(50_000, dtype=torch.int64)).double()
    assert u.shape == (64, 50_000)
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 1e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    # 16 equal buckets, 3.2M samples: every bucket within 1% of 1/16
    hist = torch.histc(u, bins=16, min=0.0, max=1.0) / u.numel()
    assert (hist - 1 / 16).abs().max().item() < 1e-2 / 16
    # Every value is an odd multiple of 2**-24 (23 random bits), so never 0 or 1.
    scaled = u * 2**24  # exact: u holds float32 values widened to float64
    not_odd = (scaled != scaled.round()) | (scaled.remainder(2) != 1)
    assert not not_odd.any(), f"{int(not_odd.sum())} values are not odd multiples of 2**-24: {u[not_odd][:3].tolist()}"
    assert u.min().item() >= 2**-24 and u.max().item() <= 1 - 2**-24
    # The extremes are reached, exactly: the token ids whose hashes are 0 and 2**32 - 1 (the two rounds
    # inverted) draw 2**-24 and 1 - 2**-24, and their exponential noise is finite and positive.
    seed, step = torch.tensor([12345], dtype=torch.int64), torch.tensor([6], dtype=torch.int64)
    k1, k2 = (int(k) for k in _row_keys(seed, step))
    extreme_ids = torch.tensor([[_lowbias32_inverse(_lowbias32_inverse(x) ^ k2) ^ k1 for x in (0, 2**32 - 1)]])
    extreme = uniform_noise(seed, step, extreme_ids)
    assert extreme.dtype == torch.float32
    assert extreme.tolist() == [[2**-24, 1 - 2**-24]]
    e_extreme = exponential_noise(seed, step, extreme_ids)
    assert torch.isfinite(e_extreme).all() and (e_extreme > 0).all()
    e = exponential_noise(seeds, steps, torch.arange(1000))
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.double().mean().item() - 1.0) < 0.02


def test_noise_depends_only_on_seed_step_and_token():
    seeds = torch.tensor([5, 2**62 + 3, 5], dtype=torch.int64)
    steps = torch.tensor([9, 0, 9], dtype=torch.int64)
    full = uniform_noise(seeds, steps, torch.arange(100))
    assert torch.equal(full[0], full[2])
    # A row's noise for a token does not depend on which other tokens or rows are asked for.
    ids = torch.tensor([[99, 3, 42], [0, 1, 2], [42, 42, 7]])
    picked = uniform_noise(seeds, steps, ids)
    assert torch.equal(picked, full.gather(1, ids))
    alone = uniform_noise(seeds[1:2], steps[1:2], torch.arange(100))
    assert torch.equal(alone[0], full[1])
