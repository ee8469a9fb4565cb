"""Prompt lookup's draft lengths: the acceptance estimate, the step-cost model, the plan that weighs a
verify's rows against the tokens they may bring, lookups scored while nothing is drafted, the measured
payoff that stops drafting where verifies turned out slower than plain steps, and the engine with
measured-looking costs on the CPU (drafting stops where verifies cost more than they bring, and the
output never changes)."""

from __future__ import annotations

import pytest

from graphrt import LLM, SamplingParams
from graphrt.capture import choose_bucket
from graphrt.speculative import draft_policy, ngram, payoff
from graphrt.speculative.draft_policy import MIN_TOKEN_GAIN, Acceptance, plan_lengths
from graphrt.speculative.payoff import FIRST_PROBE, LAST_PROBE, MIN_VERIFIES, Payoff
from graphrt.speculative.step_costs import PIPELINED, SYNCHRONOUS, WINDOW, StepCosts

BUCKETS = [1, 2, 4, 8, 16]


def _costs(replay_ms: dict[int, float]) -> StepCosts:
    seconds = {size: ms / 1e3 for size, ms in replay_ms.items()}
    return StepCosts(lambda: seconds, lambda rows: choose_bucket(sorted(seconds), rows))


def test_acceptance_follows_the_latest_outcomes():
    acceptance = Acceptance()
    assert acceptance.rate == pytest.approx(0.5)  # the prior
    for _ in range(10):
        acceptance.observe(4, 4)
    high = acceptance.rate
    assert high > 0.95
    acceptance.observe(0, 0)  # nothing proposed: no evidence
    assert acceptance.rate == high
    for _ in range(10):
        acceptance.observe(4, 0)
    assert acceptance.rate < 0.4  # misses outweigh older runs within about ten outcomes


def test_step_costs_add_each_kinds_measured_host_share_to_the_replay():
    costs = _costs({1: 1.0, 2: 1.5, 4: 2.0})
    assert costs.known and costs.step(3, SYNCHRONOUS) == pytest.approx(2e-3)  # bucket 4, nothing learnt yet
    assert costs.step(5, SYNCHRONOUS) is None  # past the largest bucket
    costs.observe(3, SYNCHRONOUS, 2.5e-3)  # the first step of a kind sets its share
    assert costs.step(1, SYNCHRONOUS) == pytest.approx(1.5e-3) and costs.step(1, PIPELINED) == pytest.approx(1e-3)
    for _ in range(3):  # then the lower quartile of the latest (a step faster than its replay adds 0)
        costs.observe(1, SYNCHRONOUS, 1.2e-3)
    assert costs.extra_seconds[SYNCHRONOUS] == pytest.approx(0.2e-3)
    for _ in range(WINDOW):  # slow first steps do not last, nor price the kind out while they are seen
        costs.observe(1, SYNCHRONOUS, 1.1e-3)
    assert costs.extra_seconds[SYNCHRONOUS] == pytest.approx(0.1e-3)
    for _ in range(WINDOW // 2):
        costs.observe(1, SYNCHRONOUS, 50e-3)
    assert costs.extra_seconds[SYNCHRONOUS] == pytest.approx(0.1e-3)
    for _ in range(WINDOW):  # steps that stay slow are believed
        costs.observe(1, SYNCHRONOUS, 3e-3)
    assert costs.extra_seconds[SYNCHRONOUS] == pytest.approx(2e-3)
    assert not StepCosts(dict, lambda rows: 1).known


def test_plan_drafts_where_the_rows_pay_for_themselves():
    # One row 1 ms; 8 rows 1.4 ms; 16 rows 3 ms: drafting 7 tokens fills bucket 8, an eighth would cost bucket 16.
    costs = _costs({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 3.0})
    assert plan_lengths([0.97], [10], costs, PIPELINED, 16) == [7]
    assert plan_lengths([0.97], [3], costs, PIPELINED, 16) == [3]  # the lookup's length caps it
    assert plan_lengths([0.35], [10], costs, PIPELINED, 16) == [1]  # a second row costs a tenth of a step
    assert plan_lengths([0.25], [10], costs, PIPELINED, 16) == [0]  # below MIN_TOKEN_GAIN
    # The same acceptance against rows that cost almost a step each: nothing pays.
    steep = _costs({1: 1.0, 2: 1.9, 4: 3.7, 8: 7.0, 16: 14.0})
    assert plan_lengths([0.9], [8], steep, PIPELINED, 16) == [0]
    # A verify must beat the plain step it replaces, host share included.
    costs.observe(1, SYNCHRONOUS, 3.4e-3)  # verifies wait 2 ms on the host; pipelined steps hide it
    assert plan_lengths([0.6], [10], costs, PIPELINED, 16) == [0]
    assert plan_lengths([0.6], [10], costs, SYNCHRONOUS, 16) == [2]  # a synchronous plain step pays it too
    assert plan_lengths([0.97], [10], costs, PIPELINED, 16) == [7]  # long drafts still pay


def test_plan_prefers_likely_tokens_and_keeps_within_the_rows():
    costs = _costs({size: 1.0 for size in BUCKETS})  # rows free up to 16
    lengths = plan_lengths([0.9, 0.5, 0.99], [4, 4, 4], costs, PIPELINED, 16)
    assert lengths == [4, 1, 4]  # 0.5 ** 2 < MIN_TOKEN_GAIN
    assert 0.5 ** 2 < MIN_TOKEN_GAIN <= 0.5
    assert plan_lengths([0.6, 0.9], [8, 8], costs, PIPELINED, 8) == [1, 5]  # 6 spare rows, likeliest first
    assert plan_lengths([0.9, 0.9], [8, 8], costs, PIPELINED, 4) == [1, 1]  # ties: earlier sequences first
    # Without measured costs (no graphs) rows count as free.
    assert plan_lengths([0.9, 0.5], [4, 4], None, PIPELINED, 16) == [4, 1]
    assert plan_lengths([0.9], [4], StepCosts(dict, lambda rows: rows), PIPELINED, 16) == [4]


def test_payoff_stops_drafting_where_verifies_measured_slower_and_probes_less_often():
    gate = Payoff(lambda sequences: choose_bucket(BUCKETS, sequences))
    plain = 1e-3  # a plain step of the sequences: 1 ms
    for _ in range(MIN_VERIFIES - 1):  # too few verifies to judge: drafting goes on
        gate.observe(1, 2, 4e-3, plain)  # 2 tokens in 4 ms: half a plain step's rate
        assert gate.allows(1)
    gate.observe(1, 2, 4e-3, plain)
    assert gate.speedups()[1] == pytest.approx(0.5)
    waits = []
    for _ in range(3):  # probes that do not pay: each waits twice as long as the one before
        wanted = 0
        while not gate.allows(1):
            wanted += 1
        assert gate.allows(1)  # the probe stays allowed until it is measured (planned blind, then read)
        waits.append(wanted)
        gate.observe(1, 2, 4e-3, plain)
    assert waits == [FIRST_PROBE, 2 * FIRST_PROBE, 4 * FIRST_PROBE]
    assert gate.allows(2) and gate.allows(5)  # other buckets are judged on their own
    while not gate.allows(1):
        pass
    gate.observe(1, 9, 1e-3, plain)  # a probe that paid well (9 tokens in a plain step's time)
    assert gate.speedups()[1] > 1 and all(gate.allows(1) for _ in range(2 * LAST_PROBE))
    gate.observe(1, 2, 2e-3, None)  # no plain step to weigh it against: not counted
    gate.observe(1, 2, 2e-3, plain)  # verifies at the plain rate pay (not slower)
    assert gate.allows(1)


def test_payoff_probes_wait_at_most_the_last_probe():
    gate = Payoff(lambda sequences: 1)
    for _ in range(20):
        gate.observe(1, 1, 5e-3, 1e-3)
        wanted = 0
        while not gate.allows(1):
            wanted += 1
    assert wanted == LAST_PROBE


def _llm(**options) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_model_len=96, max_num_seqs=4, num_kv_blocks=64,
                    block_size=4, loader_options={"init_std": 0.2}, progress=False)
    return LLM("random:tiny", **{**defaults, **options})


PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17)]


def _lookups_from(monkeypatch, reference: dict[tuple, list[int]], right_from: int):
    """Lookups that guess the output without speculation (``reference``), wrong in their first token
    before output index ``right_from``."""
    def propose(index, num_tokens):
        prompt = next(p for p in reference if tuple(index.tokens[:len(p)]) == p)
        done = len(index.tokens) - len(prompt)
        guess = list(reference[prompt][done:done + num_tokens])
        return [(guess[0] + 1) % 512, *guess[1:]] if guess and done < right_from else guess
    monkeypatch.setattr(ngram.NgramIndex, "propose", propose)


@pytest.mark.parametrize("async_decode", [False, True])
def test_lookups_scored_while_not_drafting_bring_drafting_back(monkeypatch, async_decode):
    """Lookups wrong at first: acceptance falls below what a draft token needs and drafting stops;
    the lookups go on being checked against the target's tokens without a verify, and once they are
    right drafting resumes. The output is the output without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    _lookups_from(monkeypatch, {tuple(p): out for p, out in zip(PROMPTS, plain)}, right_from=12)
    with _llm(speculative="ngram:4", async_decode=async_decode) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.speculative_stats
    assert [out.token_ids for out in outs] == plain
    # Early drafts (the prior) miss; then none until lookups score well; then whole drafts.
    assert stats.proposed_tokens > stats.accepted_tokens > 20 and stats.tokens_per_step > 1.5
    for out in outs:
        assert out.speculative.proposed_tokens - out.speculative.accepted_tokens <= 4


def test_measured_costs_that_rows_do_not_pay_for_stop_drafting(monkeypatch):
    """With replay times where every row costs a step, prompt lookup drafts nothing even when its
    lookups are always right; with rows almost free it drafts them. Same output either way. One
    sequence at a time: a batch padded to its bucket has rows to spare, which cost nothing."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    _lookups_from(monkeypatch, {tuple(p): out for p, out in zip(PROMPTS, plain)}, right_from=0)
    proposed = {}
    for name, per_row in (("steep", 1.0), ("flat", 0.01)):
        with _llm(speculative="ngram:4", max_num_seqs=1) as llm:
            # Replays of seconds: the CPU's steps take less, so nothing is learnt on top of them.
            replay = {size: 1.0 + per_row * (size - 1) for size in llm.engine.decode_runner.capture_sizes}
            llm.engine.decode_runner.stats.replay_seconds = replay
            outs = llm.generate(PROMPTS, params)
            proposed[name] = llm.engine.speculative_stats.proposed_tokens
        assert [out.token_ids for out in outs] == plain
    assert proposed["steep"] == 0 and proposed["flat"] > 20
    assert draft_policy.MARGIN > 0


def test_prompts_are_indexed_in_their_prefill_step():
    """The prompt's n-gram index (work in the prompt's length) is built in the prefill's step, not in the
    first decode step, whose time the draft lengths weigh."""
    with _llm(speculative="ngram:4") as llm:
        engine = llm.engine
        engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prefill
        [seq] = engine.scheduler.running
        index = engine.drafter._indexes[seq.seq_id]
        assert len(index.tokens) == seq.num_tokens and seq.seq_id in engine.drafter._lookups


@pytest.mark.parametrize("adaptive", [True, False])
def test_more_sequences_than_verify_rows_draft_nothing_past_the_rows(adaptive):
    """Four sequences, verify steps of at most two rows (capture_sizes): drafts fit the rows left, never
    a negative length (a slice from the end would draft anyway), adaptive or not."""
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 5, [20, 21] * 6, [30, 31, 32, 33] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with _llm(capture_sizes=[1, 2]) as llm:
        plain = [out.token_ids for out in llm.generate(prompts, params)]
    speculative = {"method": "ngram", "num_tokens": 4, "adaptive": adaptive}
    with _llm(capture_sizes=[1, 2], speculative=speculative) as llm:
        drafter, plans = llm.engine.drafter, []
        propose = drafter.propose
        drafter.propose = lambda seqs, plan: plans.append((len(seqs), plan.lengths)) or propose(seqs, plan)
        outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == plain
    assert plans and all(min(lengths) >= 0 and n + sum(lengths) <= max(n, 2) for n, lengths in plans)


def test_verifies_measured_slower_than_plain_steps_stop_drafting(monkeypatch):
    """Replay times say rows are free and lookups are always right, and one verify in three takes 1 ms
    of wall time, so the cost model (a low quantile of the host's share) judges verifies as cheap as the
    1 ms plain steps queued blind and drafts at every step; but the other verifies take 40 ms (a clock
    the test drives). The measured payoff stops drafting after a few verifies, but for probes. Same
    output."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _llm() as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    _lookups_from(monkeypatch, {tuple(p): out for p, out in zip(PROMPTS, plain)}, right_from=0)
    import graphrt.engine

    proposed, verifies, speedups = {}, {}, {}
    for name, min_verifies in (("measured", MIN_VERIFIES), ("never judged", 10**9)):
        monkeypatch.setattr(payoff, "MIN_VERIFIES", min_verifies)
        clock = [0.0]
        monkeypatch.setattr(graphrt.engine, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))
        with _llm(speculative="ngram:4", max_num_seqs=1, async_decode=True) as llm:
            engine, verifies[name] = llm.engine, 0
            engine.decode_runner.stats.replay_seconds = {size: 1e-3 for size in engine.decode_runner.capture_sizes}
            runner = engine.runner
            verify, execute, launch_decode = runner.verify, runner.execute, runner.launch_decode

            def timed_verify(decodes, drafts, name=name, verify=verify):
                if any(drafts):
                    clock[0] += 1e-3 if verifies[name] % 3 == 0 else 40e-3
                    verifies[name] += 1
                else:
                    clock[0] += 1e-3
                return verify(decodes, drafts)

            def timed(call):
                def run(*args, **kwargs):
                    clock[0] += 1e-3
                    return call(*args, **kwargs)
                return run

            monkeypatch.setattr(runner, "verify", timed_verify)
            monkeypatch.setattr(runner, "execute", timed(execute))
            monkeypatch.setattr(runner, "launch_decode", timed(launch_decode))
            outs = llm.generate(PROMPTS, params)
            proposed[name] = engine.speculative_stats.proposed_tokens
            speedups[name] = engine.drafter.payoff.speedups()
        assert [out.token_ids for out in outs] == plain
    # The verifies' measured rate: up to 5 tokens in 27 ms on average, against 1 ms a token.
    assert 0 < speedups["measured"][1] < 0.5 and 0 < speedups["never judged"][1] < 0.5
    assert verifies["never judged"] >= 20 and verifies["measured"] <= MIN_VERIFIES + 4, verifies
    assert proposed["measured"] < proposed["never judged"] / 3
