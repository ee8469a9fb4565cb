"""Prefix caching: the block manager's cached blocks (keys, least-recently-freed reuse, generations, a
hypothesis state machine that checks a taken block holds the prefix it is taken for), and the engine on
the CPU (float32, random checkpoints): output with the cache equals output without, greedy and seeded,
across block boundaries, with chunked prefill, preemption, speculation and pipelined steps; hit rates;
prompt logprobs computed whole."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.block_manager import NULL_BLOCK_ID, BlockManager, NoFreeBlocksError
from graphrt.cli import build_parser


def _computed(manager: BlockManager, seq_id: int, tokens: list[int], num_computed: int | None = None) -> None:
    manager.cache_computed(seq_id, len(tokens) if num_computed is None else num_computed,
                           lambda start, end: tokens[start:end])


def test_a_prompt_takes_the_blocks_of_its_computed_prefix():
    manager = BlockManager(12, 4, prefix_caching=True)
    first = list(range(100, 114))  # 14 tokens: 3 full blocks
    assert manager.allocate_with_prefix(1, first) == 0
    _computed(manager, 1, first)
    assert manager.allocator.num_cached_blocks == 3
    # Same first 12 tokens: three blocks shared (the 13th token and on computed anew).
    assert manager.allocate_with_prefix(2, first[:12] + [7, 8]) == 12
    assert manager.block_table(2)[:3] == manager.block_table(1)[:3]
    assert [manager.allocator.ref_count(b) for b in manager.block_table(2)] == [2, 2, 2, 1]
    # The last token always computed: a prompt of exactly 12 cached tokens takes 2 blocks.
    assert manager.allocate_with_prefix(3, first[:12]) == 8
    # A different first block: nothing shared, even where later blocks' tokens agree.
    assert manager.allocate_with_prefix(4, [9] + first[1:]) == 0
    assert manager.prefix_hit_tokens == 20 and manager.prefix_queried_tokens == 14 + 14 + 12 + 14
    for seq_id in (1, 2, 3, 4):
        manager.free(seq_id)
    assert manager.num_free_blocks == manager.num_usable_blocks  # cached blocks count as free
    assert manager.allocate_with_prefix(5, first) == 12  # unheld cached blocks are taken back


def test_unheld_cached_blocks_are_reused_last_and_least_recently_freed_first():
    manager = BlockManager(7, 2, prefix_caching=True)  # 6 usable blocks
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    for seq_id, tokens in ((1, a), (2, b)):
        manager.allocate_with_prefix(seq_id, tokens)
        _computed(manager, seq_id, tokens)
    a_blocks, b_blocks = manager.block_table(1), manager.block_table(2)
    manager.free(1)
    manager.free(2)  # a's cached blocks were freed first
    assert manager.allocator.num_cached_blocks == 4
    manager.allocate(3, 8)  # four blocks: the two uncached free ones first, then a's two cached ones
    assert set(manager.block_table(3)) == {a_blocks[2], b_blocks[2], a_blocks[0], a_blocks[1]}
    assert manager.allocator.num_cached_blocks == 2
    manager.free(3)
    assert manager.allocate_with_prefix(4, a) == 0  # a's prefix is gone (its blocks held other contents)
    manager.free(4)
    assert manager.allocate_with_prefix(5, b) == 4  # b's is still there


def test_a_reused_parent_block_never_matches_its_old_children():
    """When a prefix's first block is handed out for other contents, the key of the block that followed
    it (still cached) names a prefix that no longer exists: it must not match, even when the same
    block later holds the same first tokens again."""
    manager = BlockManager(5, 2, prefix_caching=True)  # 4 usable blocks
    old = [1, 2, 3, 4, 9]
    manager.allocate_with_prefix(1, old)
    _computed(manager, 1, old)
    parent, child, _ = manager.block_table(1)
    manager.free(1)
    allocator = manager.allocator
    allocator.hold_cached(child)  # the child stays cached; the parent is the only cached block left free
    taken = [allocator.allocate() for _ in range(3)]  # two uncached blocks, then the parent, its key dropped
    assert parent in taken and allocator.generation(parent) == 1
    assert allocator.cache(parent, manager._key(None, [1, 2]))  # new contents: the same tokens again
    for block in taken:
        if block != parent:
            allocator.free(block)
    assert manager.allocate_with_prefix(2, old) == 2  # the first block is found, the old child is not
    assert manager.block_table(2)[0] == parent and child not in manager.block_table(2)


def test_a_failed_allocation_changes_nothing():
    manager = BlockManager(4, 2, prefix_caching=True)
    tokens = [1, 2, 3]
    manager.allocate_with_prefix(1, tokens)
    _computed(manager, 1, tokens)
    free, cached = manager.num_free_blocks, manager.allocator.num_cached_blocks
    with pytest.raises(NoFreeBlocksError):
        manager.allocate_with_prefix(2, [1, 2, 5, 6, 7, 8])  # one cached block, three fresh: one free
    assert (manager.num_free_blocks, manager.allocator.num_cached_blocks) == (free, cached)
    assert not manager.has(2) and manager.allocator.ref_count(manager.block_table(1)[0]) == 1


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences of tokens over a two-letter alphabet (so prefixes repeat), allocated with the prefix
    cache, computed part by part, freed. The model: which token prefix each block's K/V holds (written
    when a sequence computes it), and who holds each block."""

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size, prefix_caching=True)
        self.bs = block_size
        self.seqs: dict[int, tuple[list[int], int]] = {}  # seq id -> (tokens, positions computed)
        self.contents: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V holds
        self.next_id = 0

    def holders(self) -> Counter:
        return Counter(b for sid in self.seqs for b in self.m.block_table(sid))

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=10))
    def allocate(self, tokens):
        self.next_id += 1
        sid, held, free = self.next_id, self.holders(), self.m.num_free_blocks
        try:
            cached = self.m.allocate_with_prefix(sid, tokens)
        except NoFreeBlocksError:  # shared blocks need no free one: only a prompt larger than the free ones fails
            assert self.m.blocks_needed(len(tokens)) > free
            assert not self.m.has(sid) and self.m.num_free_blocks == free
            return
        table = self.m.block_table(sid)
        assert cached % self.bs == 0 and cached < len(tokens) and len(table) == self.m.blocks_needed(len(tokens))
        for index in range(cached // self.bs):  # a taken block holds exactly this prefix's K/V
            assert self.contents.get(table[index]) == tuple(tokens[:(index + 1) * self.bs])
        for block in table[cached // self.bs:]:  # fresh blocks: nobody else's, contents to be written
            assert block != NULL_BLOCK_ID and block not in held
            self.contents.pop(block, None)
        self.seqs[sid] = (tokens, cached)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, done = self.seqs[sid]
        upto = data.draw(st.integers(done, len(tokens)))
        table = self.m.block_table(sid)
        for index in range(done // self.bs, upto // self.bs):  # the K/V of these full blocks is written
            if self.holders()[table[index]] == 1:  # a shared block already holds it
                self.contents[table[index]] = tuple(tokens[:(index + 1) * self.bs])
        _computed(self.m, sid, tokens, upto)
        self.seqs[sid] = (tokens, upto)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.free(sid)
        del self.seqs[sid]

    @invariant()
    def counts_match_the_holders(self):
        holders = self.holders()
        assert NULL_BLOCK_ID not in holders
        assert self.m.num_free_blocks + len(holders) == self.m.num_usable_blocks
        for block in range(1, self.m.allocator.num_blocks):
            assert self.m.allocator.ref_count(block) == holders.get(block, 0)
        assert self.m.allocator.num_cached_blocks <= self.m.num_usable_blocks

    def teardown(self):
        for sid in list(self.seqs):
            self.m.free(sid)
        assert self.m.num_free_blocks == self.m.num_usable_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheStateful = PrefixCacheMachine.TestCase


SHARED = [(13 * i) % 400 + 3 for i in range(23)]
PROMPTS = [SHARED + [(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (1, 5, 9, 16)] + [SHARED[:7], SHARED]


def _llm(**options) -> LLM:
    defaults = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, num_kv_blocks=64,
                    block_size=4, loader_options={"init_std": 0.2}, progress=False)
    return LLM("random:tiny", **{**defaults, **options})


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_cached_prefixes_give_the_output_without_them(sampling):
    params = SamplingParams(temperature=0.0 if sampling == "greedy" else 0.9, seed=3, max_tokens=12, ignore_eos=True)
    with _llm(enable_prefix_caching=False) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    with _llm() as llm:  # prefix caching is on by default
        assert llm.engine.prefix_cache_hit_rate == 0.0
        first = [out.token_ids for out in llm.generate(PROMPTS, params)]
        again = [out.token_ids for out in llm.generate(PROMPTS, params)]  # every prompt's blocks cached now
        rate = llm.engine.prefix_cache_hit_rate
    assert first == plain and again == plain
    assert 0.3 < rate < 1.0
    with _llm(enable_prefix_caching=False) as llm:
        assert llm.engine.prefix_cache_hit_rate is None


def test_prefix_caching_with_chunks_preemption_speculation_and_pipelined_steps():
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with _llm(enable_prefix_caching=False, enable_chunked_prefill=False) as llm:
        plain = [out.token_ids for out in llm.generate(PROMPTS, params)]
    cases = [dict(enable_chunked_prefill=True, max_num_batched_tokens=9), dict(num_kv_blocks=30),
             dict(speculative="ngram:3"), dict(async_decode=True)]
    for options in cases:
        with _llm(enable_prefix_caching=True, **options) as llm:
            outs = llm.generate(PROMPTS, params)
            assert [out.token_ids for out in outs] == plain, options
            assert llm.engine.prefix_cache_hit_rate > 0, options
            if "num_kv_blocks" in options:
                assert sum(out.num_preemptions for out in outs) > 0


def test_prompt_logprobs_are_computed_from_the_whole_prompt_and_bad_values_refused():
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    with _llm(enable_prefix_caching=False) as llm:
        plain = llm.generate(PROMPTS, params)
    with _llm(enable_prefix_caching=True) as llm:
        llm.generate(PROMPTS, SamplingParams(max_tokens=2))  # the prefixes cached
        cached = llm.generate(PROMPTS, params)
    for a, b in zip(plain, cached):
        assert a.token_ids == b.token_ids
        assert [p.logprob for p in a.prompt_logprobs[1:]] == pytest.approx([p.logprob for p in b.prompt_logprobs[1:]])
    with pytest.raises(ConfigError, match="enable_prefix_caching must be True or False"):
        EngineConfig(enable_prefix_caching=1)
    assert build_parser().parse_args(["generate", "--enable-prefix-caching"]).enable_prefix_caching


def test_recomputation_is_not_counted_as_a_prompt_lookup():
    """Preempted sequences recomputed through the cache (their own blocks) add nothing to the hit rate,
    which counts prompts' first lookups: prompts that share nothing score 0."""
    prompts = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33)]
    with _llm(enable_prefix_caching=True, num_kv_blocks=22, max_model_len=96) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        assert sum(out.num_preemptions for out in outs) > 0
        assert llm.engine.prefix_cache_hit_rate == 0.0
