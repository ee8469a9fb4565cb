"""Speculative decoding on the CPU: prompt-lookup drafts, draft lengths, the option's checks, and the
engine's output with speculation against the output without it (float32, random checkpoints), greedy
and sampled, across block boundaries, under preemption, with stop tokens and logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.cli import build_parser
from graphrt.speculative import ngram
from graphrt.speculative.config import SpeculativeConfig, speculative_config
from graphrt.speculative.drafting import FIRST_PAUSE, DraftLength
from graphrt.speculative.ngram import NgramIndex


def _index(tokens, min_n=1, max_n=3):
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def test_prompt_lookup_takes_the_longest_newest_ngram_and_its_latest_earlier_occurrence():
    # "7 8 9" occurred twice before the end: the later occurrence's continuation is drafted.
    assert _index([7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9]).propose(3) == [3, 4, 5]
    # The 3-gram "5 7 8" never occurred; its 2-gram suffix "7 8" did, followed by 9 then 1.
    assert _index([7, 8, 9, 1, 5, 7, 8]).propose(2) == [9, 1]
    # Only the 1-gram matches; its continuation reaches the end, so the lookup goes on over the draft.
    assert _index([4, 6, 2, 6]).propose(5) == [2, 6, 2, 6, 2]
    assert _index([5, 5, 5]).propose(4) == [5, 5, 5, 5]
    assert _index([1, 2, 3]).propose(4) == []  # nothing occurred before
    assert _index([5]).propose(2) == [] and _index([]).propose(2) == []
    assert _index([7, 8, 9, 7, 8], min_n=3).propose(2) == []  # shorter n-grams not matched


def test_prompt_lookup_indexes_tokens_as_they_arrive():
    index = _index([1, 2, 3, 4])
    assert index.propose(2) == []
    index.extend([1, 2])
    assert index.propose(2) == [3, 4]
    index.extend([9])
    assert index.propose(2) == []
    index.extend([3])
    assert index.propose(3) == [4, 1, 2]


def test_draft_length_follows_acceptance_and_pauses_after_misses():
    length = DraftLength(4, adaptive=True)
    assert length.next() == 4
    length.update(4, 1)  # kept 1 of 4: one row to spare next time
    assert length.next() == 2
    length.update(2, 2)  # kept all: one more
    assert length.next() == 3
    length.update(3, 0)  # kept nothing: pause
    assert [length.next() for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE and length.next() == 1
    length.update(1, 0)  # a second miss in a row: twice the pause
    assert [length.next() for _ in range(2 * FIRST_PAUSE)] == [0] * (2 * FIRST_PAUSE)
    fixed = DraftLength(3, adaptive=False)
    fixed.update(3, 0)
    assert fixed.next() == 3


def test_speculative_option_forms_and_bad_values():
    assert speculative_config("ngram:4") == SpeculativeConfig("ngram", 4)
    assert speculative_config({"method": "ngram", "num_tokens": 2, "ngram_max": 5}) == SpeculativeConfig(
        "ngram", 2, ngram_max=5)
    assert speculative_config(None) is None
    assert EngineConfig(speculative="ngram:3").speculative == SpeculativeConfig("ngram", 3)
    assert speculative_config("draft:random:tiny:3") == SpeculativeConfig("draft", 3, model="random:tiny")
    for bad, message in (("ngram", "not ngram:NUM_TOKENS"), ("ngram:x", "not an integer"),
                         ("draft:4", "not ngram:NUM_TOKENS or draft:MODEL"), ("eagle:4", "unknown method 'eagle'"),
                         ({"method": "draft", "num_tokens": 2}, "needs a model"),
                         ({"method": "ngram", "model": "random:tiny"}, "needs a model"),
                         ({"method": "ngram", "num_tokens": 0}, "num_tokens"),
                         ({"num_tokens": 2, "depth": 3}, "unknown field"),
                         ({"ngram_min": 4, "ngram_max": 2}, "exceeds"), (4, "must be None, a dict"),
                         ("draft:random:tiny", "draft:MODEL:NUM_TOKENS")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(speculative=bad)
    assert build_parser().parse_args(["generate", "--speculative", "ngram:4"]).speculative == "ngram:4"


PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33)]


def _llm(**options):
    defaults = dict(dtype="float32", device="cpu", max_model_len=96, max_num_seqs=4, num_kv_blocks=64,
                    block_size=4, loader_options={"init_std": 0.2}, progress=False)
    return LLM("random:tiny", **{**defaults, **options})


def _oracle(monkeypatch, reference: dict[tuple, list[int]], wrong_every: int):
    """Drafts from the output without speculation (``reference``: prompt -> its tokens), the draft's
    second token made wrong every ``wrong_every``-th position, so verification keeps some drafts whole
    and cuts others short."""
    def propose(index, num_tokens):
        for prompt, output in reference.items():
            if tuple(index.tokens[:len(prompt)]) == prompt:
                done = len(index.tokens) - len(prompt)
                draft = list(output[done:done + num_tokens])
                if draft[1:] and done % wrong_every == 0:
                    draft[1] = (draft[1] + 1) % 512
                return draft
        return []
    monkeypatch.setattr(ngram.NgramIndex, "propose", propose)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculation_gives_the_output_without_it(monkeypatch, sampling):
    """Drafts kept whole, cut short and refused; greedy and seeded sampling (the kept tokens are the
    target's own draws at their output indices); prompts and drafts across 4-token blocks."""
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=7, max_tokens=24, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    _oracle(monkeypatch, {tuple(p): out for p, out in zip(PROMPTS, plain)}, wrong_every=3)
    with _llm(speculative={"method": "ngram", "num_tokens": 4}) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert 0 < stats.accepted_tokens < stats.proposed_tokens and stats.tokens_per_step > 1.5
    assert all(out.speculative.verify_steps > 0 and out.speculative.accepted_tokens > 0 for out in outs)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_pipelined_steps_while_drafting_pauses_change_no_token(monkeypatch, sampling):
    """async_decode: while every sequence pauses its drafting (after drafts that kept nothing) decode
    steps are queued blind as without speculation; drafting resumes after the pause, and the output is
    still the output without speculation."""
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=5, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:2]
    with _llm(async_decode=True) as llm:
        plain = [out.token_ids for out in llm.generate(prompts, params)]
    reference = {tuple(p): out for p, out in zip(prompts, plain)}

    def propose(index, num_tokens):  # wrong from the first token for the first 10 positions, then right
        prompt = next(p for p in reference if tuple(index.tokens[:len(p)]) == p)
        done = len(index.tokens) - len(prompt)
        draft = list(reference[prompt][done:done + num_tokens])
        return [(draft[0] + 1) % 512, *draft[1:]] if draft and done < 10 else draft
    monkeypatch.setattr(ngram.NgramIndex, "propose", propose)
    with _llm(async_decode=True, speculative="ngram:3") as llm:
        launch = llm.engine.runner.launch_decode
        pipelined = []
        monkeypatch.setattr(llm.engine.runner, "launch_decode",
                            lambda seqs, **kw: pipelined.append(len(seqs)) or launch(seqs, **kw))
        outs = llm.generate(prompts, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert len(pipelined) >= 4 and stats.accepted_tokens > 0
    assert stats.produced_tokens == sum(len(t) for t in plain) - len(prompts)  # the prefills' tokens aside


def test_speculation_under_preemption_stop_tokens_and_logprobs(monkeypatch):
    """Too few blocks for every sequence (preemption and recompute, drafts refused for want of blocks), a
    stop token inside a verify's kept tokens, max_tokens cutting one short, logprobs of kept tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    with _llm() as llm:
        reference = llm.generate(PROMPTS, params)
    plain = {tuple(p): out.token_ids for p, out in zip(PROMPTS, reference)}
    stop = reference[1].token_ids[13]
    stopped = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, stop_token_ids=[stop])
    with _llm() as llm:
        expected = llm.generate(PROMPTS, stopped)
    _oracle(monkeypatch, plain, wrong_every=4)
    with _llm(speculative="ngram:4", num_kv_blocks=30) as llm:
        outs = llm.generate(PROMPTS, stopped)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
    assert sum(o.num_preemptions for o in outs) > 0
    for got, want in zip(outs, expected):
        assert len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def _draft(seed: int, num_tokens: int = 3) -> dict:
    """A draft model: the target itself (seed 0, the same random weights) or another random model."""
    return {"method": "draft", "model": "random:tiny", "num_tokens": num_tokens,
            "loader_options": {"init_std": 0.2, "seed": seed}}


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_draft_model_that_is_the_target_drafts_everything_the_target_keeps(sampling):
    """The draft draws with the request's seed and output index, so a draft model equal to the target
    drafts the target's own tokens: every draft kept, about k + 1 tokens a verify."""
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=11, max_tokens=24, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    with _llm(speculative=_draft(seed=0)) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert stats.accepted_tokens == stats.proposed_tokens > 0 and stats.tokens_per_step > 3.5


def test_another_draft_model_changes_nothing_but_the_acceptance():
    """A draft model that disagrees (other random weights), with too few blocks (preemption; the draft's
    shadows rebuilt): the output without speculation, the misses pausing the drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    with _llm(speculative=_draft(seed=1), num_kv_blocks=30) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    assert sum(out.num_preemptions for out in outs) > 0
    assert stats.proposed_tokens < stats.verify_steps  # paused after misses: fewer than a token a verify


def test_a_draft_model_needs_the_targets_vocabulary():
    with pytest.raises(ConfigError, match="vocabulary \\(49152 tokens\\) is not the target's \\(512\\)"):
        _llm(speculative={"method": "draft", "model": "random:smollm2-135m", "num_tokens": 2})


def test_kept_draft_tokens_follow_the_targets_distribution(monkeypatch):
    """Statistically, on a 3-token vocabulary (top_k=3, temperature 1): requests that drew token m, then
    the drafted A, keep the draft's next row's token; its frequencies over 3000 seeds match the target's
    top-3 distribution after (prompt, m, A) (chi-square, 2 degrees of freedom, p = 0.001)."""
    prompt = [17, 250, 3, 99, 41]
    sampled = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    with _llm(max_num_seqs=256, num_kv_blocks=1024, max_model_len=16) as llm:
        firsts = [out.token_ids[0] for out in llm.generate([prompt] * 400, SamplingParams(
            temperature=1.0, top_k=3, max_tokens=1, seed=None))]
        m = max(set(firsts), key=firsts.count)
        [after_m] = llm.generate([prompt + [m]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
        a = after_m.token_ids[0]
        [after_a] = llm.generate([prompt + [m, a]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    top = after_a.logprobs[0].top  # the three most likely tokens and their log probabilities
    weights = {token: math.exp(logprob) for token, logprob in top}
    expected = {token: w / sum(weights.values()) for token, w in weights.items()}
    monkeypatch.setattr(ngram.NgramIndex, "propose",
                        lambda index, n: [a, 7][:n] if index.tokens == prompt + [m] else [])
    params = [dataclasses.replace(sampled, seed=seed) for seed in range(3000)]
    with _llm(speculative="ngram:2", max_num_seqs=256, num_kv_blocks=1024, max_model_len=16) as llm:
        outs = llm.generate([prompt] * len(params), params)
        assert llm.engine.speculative_stats.accepted_tokens > 0
    kept = [out.token_ids[2] for out in outs if out.token_ids[:2] == [m, a]]
    assert len(kept) > 200
    chi2 = sum((kept.count(t) - len(kept) * p) ** 2 / (len(kept) * p) for t, p in expected.items())
    assert set(kept) <= set(expected) and chi2 < 13.8, (chi2, expected, {t: kept.count(t) for t in set(kept)})


def test_a_draft_models_drafts_are_its_own_greedy_continuations(monkeypatch):
    """With a draft model that mostly agrees (weights drawn at another scale), so that verifies keep
    all, some or none of a draft and drafting pauses: every draft equals the draft model's own greedy
    continuation of the sequence, computed afresh. A shadow whose cache kept rejected tokens as valid
    would draft from a context the sequence does not have."""
    from graphrt.speculative.draft_model import DraftModel

    options = {"init_std": 0.19}
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    checks = []
    with _llm(loader_options=options) as alone:
        propose = DraftModel.propose

        def checked(self, seqs, lengths):
            drafts = propose(self, seqs, lengths)
            for seq, draft in zip(seqs, drafts):
                if draft:
                    [out] = alone.generate([seq.all_token_ids], dataclasses.replace(params, max_tokens=len(draft)))
                    checks.append(out.token_ids == draft)
            return drafts

        monkeypatch.setattr(DraftModel, "propose", checked)
        draft = {"method": "draft", "model": "random:tiny", "num_tokens": 3, "loader_options": options}
        with _llm(speculative=draft) as llm:
            outs = llm.generate(PROMPTS[:3], params)
            stats = llm.engine.speculative_stats
    with _llm() as llm:
        assert [out.token_ids for out in outs] == [out.token_ids for out in llm.generate(PROMPTS[:3], params)]
    assert len(checks) > 10 and all(checks), checks
    assert 0 < stats.accepted_tokens < stats.proposed_tokens


def test_stops_inside_a_verify_interrupts_and_finished_requests_leave_nothing_behind(monkeypatch):
    """A stop token inside a verify's kept tokens: the counts say what was appended. An interrupt while
    drafting: the step's new prompts are prefilled again later (not decoded on an empty cache), the
    outputs unchanged. Afterwards no drafting state and no draft-model block is left."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    stop = plain[0][6]
    stopped = dataclasses.replace(params, stop_token_ids=[stop])
    with _llm() as llm:
        expected = [out.token_ids for out in llm.generate(PROMPTS, stopped)]
    with _llm(speculative=_draft(seed=0), num_kv_blocks=40) as llm:
        engine = llm.engine
        engine.add_request(PROMPTS[0], stopped, request_id="first")
        engine.step()  # its prefill: it decodes from the next step on
        for index, prompt in enumerate(PROMPTS[1:], start=1):
            engine.add_request(prompt, stopped, request_id=str(index))
        propose = engine.drafter.propose
        monkeypatch.setattr(engine.drafter, "propose", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        monkeypatch.setattr(engine.drafter, "propose", propose)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        outs = [finished["first"]] + [finished[str(i)] for i in range(1, len(PROMPTS))]
        assert [out.token_ids for out in outs] == expected
        stats = engine.speculative_stats
        assert stats.produced_tokens == sum(len(out.token_ids) - 1 for out in outs)  # the first is the prefill's
        draft_blocks = engine.drafter.draft_model.block_manager
        assert not engine.drafter.request_stats and draft_blocks.num_free_blocks == draft_blocks.num_usable_blocks
