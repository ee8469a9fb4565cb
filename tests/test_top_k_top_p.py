"""The sort-free top-k / top-p sampler (graphrt.sampling.top_k_top_p) against the sorting sampler
(graphrt.sampling.sampler.sample), which defines the convention: same noise, so the same token for every row,
except where float32 sums round a near-tie differently (the race's, or the top-p boundary's).

Small vocabularies with small chunks run on the CPU under Triton's interpreter (several chunks a row,
so the cross-chunk sums and tie ranks are exercised); the gpu-marked grid uses the presets' vocabularies.
Outputs are poisoned before the kernels write them.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton_cpu import interpreted  # noqa: E402

from graphrt.sampling import fused as fused_sampling
from graphrt.sampling import top_k_top_p
from graphrt.sampling.params import SamplingParams
from graphrt.sampling.sampler import SamplingTensors, filtered_order, sample

top_k_top_p = interpreted(top_k_top_p, "_search_kernel")
fused_sampling = interpreted(fused_sampling, "_temperature_chunk_kernel")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

#: Every kind of row: greedy, temperature only, top-k alone (small and at the vocabulary), top-p alone
#: (small and near 1), both, and filters on a greedy row (ignored).
KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.9, top_k=7),
    SamplingParams(temperature=1.1, top_p=0.6),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.5, top_p=0.01),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.2),
    SamplingParams(temperature=2.0, top_k=100_000),
    SamplingParams(temperature=0.6, top_k=2, top_p=0.99),
    SamplingParams(temperature=1.0, top_p=1e-40),  # p * mass flushes to 0 on the GPU: keeps the max only
]


def _rows(params, seed=0, step=3):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**63 - 1, (len(params),), generator=gen).tolist()
    return SamplingTensors.from_params(params, seeds, [step + i for i in range(len(params))], DEVICE)


def _poisoned(batch):
    return torch.full((batch,), -7, dtype=torch.int64, device=DEVICE)


def check_against_sorting_sampler(logits, params, seed=0, max_chunk=top_k_top_p.MAX_CHUNK, allowed_mismatches=0):
    rows = _rows(params, seed)
    out = _poisoned(len(params))
    got = top_k_top_p.sample_top_k_top_p(logits, rows, out=out, max_chunk=max_chunk)
    assert got.data_ptr() == out.data_ptr()
    want = sample(logits, rows)
    greedy = rows.temperature == 0
    assert torch.equal(got[greedy], want[greedy])
    mismatched = (got != want).nonzero().flatten().tolist()
    assert len(mismatched) <= allowed_mismatches, (mismatched, got.tolist(), want.tolist())


@pytest.mark.parametrize("dtype,vocab,max_chunk", [
    (torch.float32, 300, 64), (torch.bfloat16, 300, 64), (torch.float32, 37, 16), (torch.bfloat16, 37, 16),
    (torch.float16, 37, 16),
], ids=str)
def test_every_kind_of_row_matches_the_sorting_sampler(vocab, max_chunk, dtype):
    """bf16 logits repeat values often, so top-k and top-p boundaries fall inside runs of equal values
    and the lower ids must be the ones kept."""
    params = KINDS
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(len(params), vocab, generator=gen) * 2.5).to(dtype).to(DEVICE)
    check_against_sorting_sampler(logits, params, seed=vocab, max_chunk=max_chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_boundaries_far_below_the_max(dtype):
    """Logits spread over hundreds of units: top-k boundaries (k = 150-200 of 257) lie far below the
    first pass's thresholds, which reach ~20 below the row's max, so the passes after it narrow nearly
    the whole key range; the top-p rows' boundaries sit at the max."""
    gen = torch.Generator().manual_seed(12)
    params = [SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=3.0, top_k=200),
              SamplingParams(temperature=2.0, top_k=150, top_p=0.99), SamplingParams(temperature=0.5, top_p=0.9)]
    logits = (torch.randn(len(params), 257, generator=gen) * 60).to(dtype).to(DEVICE)
    check_against_sorting_sampler(logits, params, seed=12, max_chunk=32)


@triton.jit
def _lift_the_token_of_the_step(cols, seed, step):
    """Race noise that lifts token ``step`` above every other: a row draws it iff the row keeps it."""
    return tl.where(cols == step.to(tl.int32), 1.0e30, 0.0)


#: Rows for the kept-set check (vocabulary ``PROBE_VOCAB``): top-k at 1, inside the row and at V - 1 / V,
#: top-p small, large and below float32's range, both filters, a boundary shared by both.
PROBE_VOCAB = 16
PROBE_ROWS = [
    SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_k=PROBE_VOCAB - 1), SamplingParams(temperature=1.0, top_k=PROBE_VOCAB),
    SamplingParams(temperature=0.8, top_p=0.3), SamplingParams(temperature=1.5, top_p=0.97),
    SamplingParams(temperature=1.0, top_p=1e-50), SamplingParams(temperature=0.9, top_k=10, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.99),
]


@pytest.mark.skipif(CUDA, reason="swaps the race noise, which only the interpreter looks up when it runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kept_sets_are_the_sorting_samplers(dtype, monkeypatch):
    """Every token of every row, one at a time, lifted above the others by the race noise: the row
    draws it exactly when its kept set holds it, so the kept sets themselves are compared with
    ``graphrt.sampling.sampler.filtered_order``'s (finite tokens; a kept -inf token can never be drawn). Logits
    on a coarse grid, so values repeat and boundaries fall inside runs of equal values; one row masked."""
    monkeypatch.setattr(top_k_top_p, "log_race_noise", _lift_the_token_of_the_step)
    gen = torch.Generator().manual_seed(21)
    rows = len(PROBE_ROWS)
    logits = (torch.randn(rows, PROBE_VOCAB, generator=gen) * 4).round() / 2
    logits[1, ::4] = float("-inf")
    logits = logits.to(dtype)
    batch = logits.repeat_interleave(PROBE_VOCAB, dim=0)  # row r's copies probe tokens 0 .. V-1
    params = [params for params in PROBE_ROWS for _ in range(PROBE_VOCAB)]
    probes = SamplingTensors.from_params(params, [0] * len(params), list(range(PROBE_VOCAB)) * rows, DEVICE)
    drawn = top_k_top_p.sample_top_k_top_p(batch, probes, max_chunk=8).reshape(rows, PROBE_VOCAB)
    kept_by_search = drawn == torch.arange(PROBE_VOCAB)

    reference = SamplingTensors.from_params(PROBE_ROWS, [0] * rows, [0] * rows, DEVICE)
    scaled = logits.float() / reference.temperature[:, None]
    sorted_ids, _, kept_sorted = filtered_order(scaled, reference)
    kept = torch.zeros(rows, PROBE_VOCAB, dtype=torch.bool).scatter(1, sorted_ids, kept_sorted)
    kept &= torch.isfinite(logits)
    for row, params in enumerate(PROBE_ROWS):
        assert kept_by_search[row].tolist() == kept[row].tolist(), (params, logits[row].tolist())


def test_boundaries_inside_runs_of_equal_values_keep_the_lowest_ids():
    """Constant rows: every token weighs 1, so the masses are exact integers. top-k 3 keeps ids 0-2;
    top-p 0.5 of 10 tokens keeps ranks whose preceding mass (0, 1, ... 4) is below 5: ids 0-4; with
    top-k 6 as well, 0.5 of 6 keeps ids 0-2. Over many steps every draw stays inside and equals the
    sorting sampler's."""
    steps = 24
    cases = [(SamplingParams(temperature=1.0, top_k=3), 3), (SamplingParams(temperature=1.0, top_p=0.5), 5),
             (SamplingParams(temperature=1.0, top_k=6, top_p=0.5), 3)]
    for params, kept in cases:
        rows = SamplingTensors.from_params([params] * steps, [11] * steps, list(range(steps)), DEVICE)
        logits = torch.full((steps, 10), 0.25, device=DEVICE)
        got = top_k_top_p.sample_top_k_top_p(logits, rows, max_chunk=4)
        assert got.max().item() < kept, (params, got.tolist())
        assert got.tolist() == sample(logits, rows).tolist()
        assert len(set(got.tolist())) == kept  # every kept token drawn at least once in 24 steps


def test_masked_tokens_and_top_k_beyond_the_finite_ones():
    """-inf logits (masked tokens) weigh 0: never drawn, even when top-k keeps more tokens than are finite."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen) * 2
    logits[:, ::3] = float("-inf")
    logits[2, 5:] = float("-inf")  # 4 finite tokens, top-k 10
    params = [SamplingParams(temperature=1.0, top_k=10), SamplingParams(temperature=0.9, top_p=0.7),
              SamplingParams(temperature=1.2, top_k=10), SamplingParams(temperature=0.0)]
    logits = logits.to(DEVICE)
    check_against_sorting_sampler(logits, params, seed=2, max_chunk=16)
    got = top_k_top_p.sample_top_k_top_p(logits, _rows(params, seed=2), max_chunk=16)
    assert torch.isfinite(logits[torch.arange(4, device=DEVICE), got]).all()


def test_rows_without_filters_race_exactly_as_the_temperature_sampler():
    """In a batch that takes this sampler (one top-p row), temperature-only and greedy rows get the
    tokens the two-pass temperature sampler gives them in a batch without filters: a row's token never
    depends on what shares its batch."""
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(5, 700, generator=gen) * 3).to(DEVICE)
    plain = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0), SamplingParams(temperature=1.7),
             SamplingParams(temperature=0.4)]
    alone = fused_sampling.sample_temperature(logits[:4].contiguous(), _rows(plain, seed=4))
    mixed = fused_sampling.sample_fused(logits, _rows(plain + [SamplingParams(temperature=0.9, top_p=0.5)], seed=4))
    assert mixed[:4].tolist() == alone.tolist()
    assert mixed[4].item() == sample(logits, _rows(plain + [SamplingParams(temperature=0.9, top_p=0.5)], seed=4))[4]


def _sm90_cases() -> list[dict]:
    """Every kernel of the sampler, as launched for bf16, fp16 and float32 logits of a 128k vocabulary."""
    module, cases = "graphrt.sampling.top_k_top_p", []
    sizes = {"stride_row": "i32", "vocab_size": "i32", "num_chunks": "i32"}
    chunk = dict(CHUNK=top_k_top_p.MAX_CHUNK, CHUNKS_BLOCK=32)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        below, top, _ = top_k_top_p.key_range(torch_dtype)
        keys = dict(KEY16=dtype != "fp32")
        rows = {"logits_ptr": f"*{dtype}", "temperature_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32"}
        stats = {"chunk_max_ptr": "*fp32", "chunk_mass_ptr": "*fp32"}
        search = {**rows, **stats, "state_in_ptr": "*fp64", "counts_in_ptr": "*i32", "masses_in_ptr": "*fp32",
                  "state_out_ptr": "*fp64", "counts_out_ptr": "*i32", "masses_out_ptr": "*fp32",
                  "mass_above_k_ptr": "*fp32", **sizes}
        kernels = [("_softmax_stats_kernel", {"logits_ptr": f"*{dtype}", "temperature_ptr": "*fp32", **stats, **sizes},
                    dict(CHUNK=top_k_top_p.MAX_CHUNK))]
        kernels += [("_search_kernel", search, dict(TOP_P=top_p, STEP=step, BELOW=below, TOP=top, SUB=256, **keys,
                                                    **chunk)) for top_p in (False, True) for step in (0, 1, 2)]
        kernels.append(("_boundary_kernel", {**rows, "state_in_ptr": "*fp64", "masses_in_ptr": "*fp32",
                                             "boundary_ptr": "*fp64", "ties_ptr": "*i32", **sizes},
                        dict(BELOW=below, **keys, **chunk)))
        kernels.append(("_filtered_race_kernel", {**rows, **stats, "seeds_ptr": "*i64", "steps_ptr": "*i64",
                                                  "boundary_ptr": "*fp64", "ties_ptr": "*i32", "best_ptr": "*fp32",
                                                  "best_index_ptr": "*i64", **sizes}, dict(**keys, **chunk)))
        cases += [dict(name=f"{kernel} {dtype} {constexprs}", module=module, kernel=kernel, signature=signature,
                       constexprs=constexprs, num_warps=8, num_stages=3) for kernel, signature, constexprs in kernels]
    return cases


def test_kernels_compile_for_sm90():
    """The GPU compiler checks what the interpreter lets through (globals that are not constexpr,
    branches whose values differ in type)."""
    from sm90_compile import compile_for_sm90

    cases = _sm90_cases()
    for case, result in zip(cases, compile_for_sm90(cases)):
        assert "error" not in result, (case["name"], result)


def test_mismatched_rows_are_rejected():
    logits = torch.randn(3, 20, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        top_k_top_p.sample_top_k_top_p(logits, _rows([SamplingParams(temperature=1.0, top_k=2)] * 2))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        top_k_top_p.sample_top_k_top_p(logits.double(), _rows([SamplingParams(temperature=1.0, top_k=2)] * 3))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 11, 64, 256])
@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
def test_sorting_sampler_agreement_grid_gpu(batch, vocab, dtype):
    """Presets' vocabularies, every kind of row: at most one row in a hundred may differ (near-ties)."""
    params = [KINDS[i % len(KINDS)] for i in range(batch)]
    gen = torch.Generator().manual_seed(batch + vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    check_against_sorting_sampler(logits, params, seed=batch, allowed_mismatches=batch // 100)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_captured_sampler_replays_new_rows_gpu(dtype):
    """Captured once in a CUDA graph, replayed with other parameters and logits written in place: the
    tokens are the sorting sampler's for the new rows."""
    batch, vocab = 16, 128256
    logits = torch.randn(batch, vocab, device=DEVICE).to(dtype)
    static = SamplingTensors.allocate(batch, DEVICE)
    _rows([KINDS[0]] * batch).copy_into(static)
    static.all_greedy, static.needs_top_k_top_p = False, True
    out = _poisoned(batch)
    top_k_top_p.sample_top_k_top_p(logits, static, out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top_k_top_p.sample_top_k_top_p(logits, static, out=out)
    for seed in range(3):
        params = [KINDS[(i + seed) % len(KINDS)] for i in range(batch)]
        rows = _rows(params, seed=seed)
        rows.copy_into(static)
        logits.copy_(torch.randn(batch, vocab, device=DEVICE) * 3)
        out.fill_(-7)
        graph.replay()
        assert out.tolist() == sample(logits, rows).tolist()
