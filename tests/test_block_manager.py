"""Tests for graphrt.block_manager: unit tests, then stateful property tests
that check both classes against a plain-Python model after every step."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from graphrt.block_manager import (
    NULL_BLOCK_ID,
    BlockAllocator,
    BlockManager,
    NoFreeBlocksError,
)

# ---------------------------------------------------------------- allocator


def test_null_block_id_is_zero():
    assert NULL_BLOCK_ID == 0


def test_no_free_blocks_error_is_runtime_error():
    assert issubclass(NoFreeBlocksError, RuntimeError)


@pytest.mark.parametrize("bad", [-1, 0, 1, 2.0, "4"])
def test_allocator_rejects_too_few_blocks(bad):
    with pytest.raises(ValueError):
        BlockAllocator(bad)


def test_allocator_counts():
    a = BlockAllocator(5)
    assert a.num_blocks == 5
    assert a.num_usable_blocks == 4
    assert a.num_free_blocks == 4


def test_allocator_smallest_pool_has_one_block():
    a = BlockAllocator(2)
    assert a.allocate() == 1
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_allocator_order_is_lifo_and_deterministic():
    a = BlockAllocator(5)
    assert [a.allocate() for _ in range(4)] == [1, 2, 3, 4]
    a.free(2)
    a.free(4)
    # Most recently freed first.
    assert a.allocate() == 4
    assert a.allocate() == 2


def test_allocator_never_hands_out_null_block():
    a = BlockAllocator(8)
    got = [a.allocate() for _ in range(7)]
    assert NULL_BLOCK_ID not in got
    assert sorted(got) == list(range(1, 8))


def test_allocator_exhaustion_raises_and_changes_nothing():
    a = BlockAllocator(3)
    a.allocate()
    a.allocate()
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    assert a.num_free_blocks == 0
    a.free(1)
    assert a.allocate() == 1


def test_allocator_ref_counts_fork_and_free():
    a = BlockAllocator(4)
    b = a.allocate()
    assert a.ref_count(b) == 1
    assert a.fork(b) == b
    assert a.ref_count(b) == 2
    a.free(b)
    assert a.ref_count(b) == 1
    assert a.num_free_blocks == 2  # still held once
    a.free(b)
    assert a.ref_count(b) == 0
    assert a.num_free_blocks == 3


def test_allocator_ref_count_of_null_and_free_blocks_is_zero():
    a = BlockAllocator(4)
    assert a.ref_count(NULL_BLOCK_ID) == 0
    assert a.ref_count(3) == 0


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_allocator_out_of_range_ids_raise(bad):
    a = BlockAllocator(4)
    for op in (a.ref_count, a.fork, a.free):
        with pytest.raises(ValueError):
            op(bad)


def test_allocator_fork_free_block_raises():
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match="free"):
        a.fork(2)
    assert a.ref_count(2) == 0


def test_allocator_fork_null_block_raises():
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match="null"):
        a.fork(NULL_BLOCK_ID)


def test_allocator_double_free_raises_naming_block_and_changes_nothing():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    before = a.num_free_blocks
    with pytest.raises(ValueError, match=rf"\b{b}\b"):
        a.free(b)
    assert a.num_free_blocks == before
    # The block is in the pool exactly once: draining the pool yields each id once.
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3]
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_allocator_free_never_allocated_block_raises():
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match=r"\b3\b"):
        a.free(3)
    assert a.num_free_blocks == 3


def test_allocator_free_null_block_raises():
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match="null"):
        a.free(NULL_BLOCK_ID)
    assert a.num_free_blocks == 3


# ------------------------------------------------------------ block manager


def test_manager_rejects_bad_block_size():
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(1, 16)


def test_blocks_needed_is_ceil():
    m = BlockManager(4, 16)
    assert [m.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        m.blocks_needed(-1)


def test_manager_counts():
    m = BlockManager(6, 4)
    assert m.num_usable_blocks == 5
    assert m.num_free_blocks == 5
    m.allocate(1, 9)
    assert m.num_free_blocks == 2


def test_can_allocate():
    m = BlockManager(4, 4)  # 3 usable blocks = 12 positions
    assert m.can_allocate(0)
    assert m.can_allocate(12)
    assert not m.can_allocate(13)
    m.allocate(1, 5)
    assert m.can_allocate(4)
    assert not m.can_allocate(5)


def test_allocate_and_block_table():
    m = BlockManager(8, 4)
    m.allocate(7, 9)
    assert m.has(7)
    assert m.block_table(7) == [1, 2, 3]
    # block_table returns a copy.
    m.block_table(7).append(99)
    assert m.block_table(7) == [1, 2, 3]


def test_allocate_zero_tokens_gives_empty_table():
    m = BlockManager(4, 4)
    m.allocate(1, 0)
    assert m.has(1)
    assert m.block_table(1) == []
    assert m.num_free_blocks == 3


def test_allocate_existing_id_raises():
    m = BlockManager(8, 4)
    m.allocate(1, 4)
    with pytest.raises(ValueError, match="already"):
        m.allocate(1, 4)
    assert m.block_table(1) == [1]
    assert m.num_free_blocks == 6


def test_allocate_is_all_or_nothing():
    m = BlockManager(4, 4)  # 3 usable
    m.allocate(1, 4)
    with pytest.raises(NoFreeBlocksError):
        m.allocate(2, 12)
    assert not m.has(2)
    assert m.num_free_blocks == 2
    m.allocate(2, 8)  # the two free blocks are still obtainable
    assert m.num_free_blocks == 0


def test_can_grow_and_grow():
    m = BlockManager(5, 4)  # 4 usable
    m.allocate(1, 3)
    assert m.can_grow(1, 4)  # fits in the existing block
    m.grow(1, 4)
    assert m.block_table(1) == [1]
    assert m.can_grow(1, 16)
    assert not m.can_grow(1, 17)
    m.grow(1, 10)
    assert m.block_table(1) == [1, 2, 3]
    # Growing to fewer tokens than the table holds is a no-op (never shrinks).
    m.grow(1, 1)
    assert m.block_table(1) == [1, 2, 3]


def test_can_grow_all_counts_the_blocks_together():
    m = BlockManager(6, 4)  # 5 usable
    m.allocate(1, 4)
    m.allocate(2, 4)  # 3 free
    assert m.can_grow(1, 12) and m.can_grow(2, 12)  # each alone fits (2 more blocks)
    assert not m.can_grow_all([(1, 12), (2, 12)])  # together they need 4
    assert m.can_grow_all([(1, 12), (2, 8)])  # 2 + 1
    assert m.can_grow_all([(1, 4), (2, 3)])  # nothing to add
    assert m.num_free_blocks == 3  # asking changes nothing


def test_grow_is_all_or_nothing():
    m = BlockManager(4, 2)  # 3 usable
    m.allocate(1, 2)
    with pytest.raises(NoFreeBlocksError):
        m.grow(1, 7)  # needs 3 more, only 2 free
    assert m.block_table(1) == [1]
    assert m.num_free_blocks == 2


def test_unknown_seq_raises_key_error():
    m = BlockManager(4, 4)
    for call in (
        lambda: m.grow(1, 4),
        lambda: m.can_grow(1, 4),
        lambda: m.free(1),
        lambda: m.block_table(1),
        lambda: m.slot(1, 0),
        lambda: m.slots(1, 0, 0),
        lambda: m.prepare_write(1, 0),
        lambda: m.fork(1, 2),
    ):
        with pytest.raises(KeyError):
            call()
    assert not m.has(2)


def test_free_releases_blocks_and_double_free_raises():
    m = BlockManager(5, 4)
    m.allocate(1, 10)
    m.free(1)
    assert not m.has(1)
    assert m.num_free_blocks == 4
    with pytest.raises(KeyError):
        m.free(1)
    assert m.num_free_blocks == 4


def test_free_then_reallocate_gets_same_table():
    m = BlockManager(8, 4)
    m.allocate(1, 4)
    m.allocate(2, 12)
    table = m.block_table(2)
    m.free(2)
    m.allocate(3, 12)
    assert m.block_table(3) == table


def test_slot_and_slots():
    m = BlockManager(8, 4)
    m.allocate(1, 4)  # block 1
    m.allocate(2, 6)  # blocks 2, 3
    assert m.slot(2, 0) == 8
    assert m.slot(2, 3) == 11
    assert m.slot(2, 4) == 12
    assert m.slot(2, 7) == 15  # capacity is whole blocks, not the token count
    assert m.slots(2, 2, 6) == [10, 11, 12, 13]
    assert m.slots(2, 3, 3) == []
    assert m.slots(2, 0, 8) == [m.slot(2, p) for p in range(8)]


def test_slot_beyond_table_raises():
    m = BlockManager(8, 4)
    m.allocate(1, 5)  # 2 blocks = 8 positions
    for bad in (8, 100, -1):
        with pytest.raises(IndexError):
            m.slot(1, bad)
    for start, end in ((0, 9), (-1, 2), (3, 2)):
        with pytest.raises(IndexError):
            m.slots(1, start, end)


def test_fork_shares_blocks():
    m = BlockManager(8, 4)
    m.allocate(1, 6)
    free_before = m.num_free_blocks
    m.fork(1, 2)
    assert m.block_table(2) == m.block_table(1)
    assert m.num_free_blocks == free_before
    for b in m.block_table(1):
        assert m.allocator.ref_count(b) == 2
    assert m.slots(1, 0, 8) == m.slots(2, 0, 8)


def test_fork_into_existing_id_raises():
    m = BlockManager(8, 4)
    m.allocate(1, 4)
    m.allocate(2, 4)
    with pytest.raises(ValueError, match="already"):
        m.fork(1, 2)
    assert m.allocator.ref_count(1) == 1
    assert m.block_table(2) == [2]


def test_prepare_write_private_block_returns_none():
    m = BlockManager(8, 4)
    m.allocate(1, 4)
    assert m.prepare_write(1, 3) is None
    assert m.block_table(1) == [1]


def test_prepare_write_copy_on_write():
    m = BlockManager(8, 4)
    m.allocate(1, 6)  # blocks 1, 2
    m.fork(1, 2)
    src, dst = m.prepare_write(2, 5)
    assert src == 2
    assert dst not in (1, 2, NULL_BLOCK_ID)
    assert m.block_table(2) == [1, dst]
    assert m.block_table(1) == [1, 2]
    assert m.allocator.ref_count(2) == 1
    assert m.allocator.ref_count(dst) == 1
    assert m.allocator.ref_count(1) == 2
    # Now private to both sides.
    assert m.prepare_write(2, 4) is None
    assert m.prepare_write(1, 5) is None
    assert m.slot(1, 5) != m.slot(2, 5)
    assert m.slot(1, 0) == m.slot(2, 0)


def test_prepare_write_out_of_blocks_changes_nothing():
    m = BlockManager(3, 4)  # 2 usable
    m.allocate(1, 4)
    m.fork(1, 2)
    m.allocate(3, 4)  # pool now empty
    with pytest.raises(NoFreeBlocksError):
        m.prepare_write(2, 0)
    assert m.block_table(2) == [1]
    assert m.allocator.ref_count(1) == 2


def test_prepare_write_beyond_table_raises():
    m = BlockManager(8, 4)
    m.allocate(1, 4)
    with pytest.raises(IndexError):
        m.prepare_write(1, 4)


def test_free_forked_parent_keeps_child_blocks():
    m = BlockManager(8, 4)
    m.allocate(1, 8)
    m.fork(1, 2)
    m.free(1)
    assert m.block_table(2) == [1, 2]
    assert m.num_free_blocks == 5
    assert m.prepare_write(2, 0) is None  # sole holder now
    m.free(2)
    assert m.num_free_blocks == 7


# ------------------------------------------------------ property: allocator

FAST = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives BlockAllocator; the model is a dict block id -> ref count."""

    @initialize(num_blocks=st.integers(2, 10))
    def setup(self, num_blocks):
        self.a = BlockAllocator(num_blocks)
        self.n = num_blocks
        self.refs: dict[int, int] = {}

    @rule()
    def allocate(self):
        if len(self.refs) == self.n - 1:
            with pytest.raises(NoFreeBlocksError):
                self.a.allocate()
            return
        b = self.a.allocate()
        assert b != NULL_BLOCK_ID
        assert b not in self.refs, f"block {b} handed out while allocated"
        assert 1 <= b < self.n
        self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def fork(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        assert self.a.fork(b) == b
        self.refs[b] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.a.free(b)
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]

    @rule(data=st.data())
    def free_or_fork_unallocated_raises(self, data):
        # Includes the null block; never-allocated and already-freed blocks.
        candidates = [b for b in range(self.n) if b not in self.refs]
        b = data.draw(st.sampled_from(candidates))
        free_before = self.a.num_free_blocks
        with pytest.raises(ValueError):
            self.a.free(b)
        with pytest.raises(ValueError):
            self.a.fork(b)
        assert self.a.num_free_blocks == free_before

    @invariant()
    def matches_model(self):
        assert self.a.num_usable_blocks == self.n - 1
        assert self.a.num_free_blocks + len(self.refs) == self.a.num_usable_blocks
        assert self.a.ref_count(NULL_BLOCK_ID) == 0
        for b in range(1, self.n):
            assert self.a.ref_count(b) == self.refs.get(b, 0)

    def teardown(self):
        for b, count in list(self.refs.items()):
            for _ in range(count):
                self.a.free(b)
        assert self.a.num_free_blocks == self.a.num_usable_blocks
        # Draining the pool gives every usable block exactly once.
        got = [self.a.allocate() for _ in range(self.n - 1)]
        assert sorted(got) == list(range(1, self.n))


AllocatorMachine.TestCase.settings = FAST
TestAllocatorStateful = AllocatorMachine.TestCase


# -------------------------------------------------------- property: manager


class ManagerMachine(RuleBasedStateMachine):
    """Drives BlockManager; the model is an independent dict seq id -> table
    that is updated from what the operations are specified to do."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size)
        self.n = num_blocks
        self.bs = block_size
        self.tables: dict[int, list[int]] = {}
        self.next_id = 0
        self.versions_seen: dict[int, tuple[int, ...]] = {}  # table_version -> the table it named

    # -- model helpers

    def holders(self) -> Counter:
        return Counter(b for t in self.tables.values() for b in t)

    def model_free(self) -> int:
        return self.n - 1 - len(self.holders())

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def seq_ids(self):
        return st.sampled_from(sorted(self.tables))

    def assert_fresh(self, blocks, held_before):
        for b in blocks:
            assert b != NULL_BLOCK_ID
            assert b not in held_before, f"block {b} handed out while held"
        assert len(set(blocks)) == len(blocks)

    # -- rules

    @rule(num_tokens=st.integers(0, 20))
    def allocate(self, num_tokens):
        sid = self.new_id()
        need = -(-num_tokens // self.bs)
        assert self.m.blocks_needed(num_tokens) == need
        fits = need <= self.model_free()
        assert self.m.can_allocate(num_tokens) == fits
        held = self.holders()
        if not fits:
            with pytest.raises(NoFreeBlocksError):
                self.m.allocate(sid, num_tokens)
            assert not self.m.has(sid)
            return
        self.m.allocate(sid, num_tokens)
        table = self.m.block_table(sid)
        assert len(table) == need
        self.assert_fresh(table, held)
        self.tables[sid] = table

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def allocate_existing_raises(self, data):
        sid = data.draw(self.seq_ids())
        with pytest.raises(ValueError):
            self.m.allocate(sid, 1)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=st.integers(-4, 12))
    def grow(self, data, extra):
        sid = data.draw(self.seq_ids())
        old = self.tables[sid]
        num_tokens = max(0, len(old) * self.bs + extra)
        need = max(0, -(-num_tokens // self.bs) - len(old))
        fits = need <= self.model_free()
        assert self.m.can_grow(sid, num_tokens) == fits
        held = self.holders()
        if not fits:
            with pytest.raises(NoFreeBlocksError):
                self.m.grow(sid, num_tokens)
            assert self.m.block_table(sid) == old
            return
        self.m.grow(sid, num_tokens)
        table = self.m.block_table(sid)
        assert table[: len(old)] == old
        assert len(table) == len(old) + need
        self.assert_fresh(table[len(old):], held)
        self.tables[sid] = table

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(self.seq_ids())
        child = self.new_id()
        free_before = self.m.num_free_blocks
        self.m.fork(parent, child)
        assert self.m.num_free_blocks == free_before
        assert self.m.block_table(child) == self.tables[parent]
        self.tables[child] = list(self.tables[parent])

    @precondition(lambda self: any(self.tables.values()))
    @rule(data=st.data())
    def prepare_write(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, t in self.tables.items() if t)))
        table = self.tables[sid]
        pos = data.draw(st.integers(0, len(table) * self.bs - 1))
        index = pos // self.bs
        src = table[index]
        shared = self.holders()[src] > 1
        if not shared:
            assert self.m.prepare_write(sid, pos) is None
            assert self.m.block_table(sid) == table
            return
        if self.model_free() == 0:
            with pytest.raises(NoFreeBlocksError):
                self.m.prepare_write(sid, pos)
            assert self.m.block_table(sid) == table
            return
        held = self.holders()
        got = self.m.prepare_write(sid, pos)
        assert got is not None
        got_src, dst = got
        assert got_src == src
        self.assert_fresh([dst], held)
        table = list(table)
        table[index] = dst
        assert self.m.block_table(sid) == table
        self.tables[sid] = table
        # Written block is private now.
        assert self.m.prepare_write(sid, pos) is None

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(self.seq_ids())
        self.m.free(sid)
        del self.tables[sid]
        assert not self.m.has(sid)

    @rule()
    def free_unknown_raises(self):
        # A freed (or never allocated) id: no double free, nothing changes.
        sid = self.new_id()
        free_before = self.m.num_free_blocks
        with pytest.raises(KeyError):
            self.m.free(sid)
        assert self.m.num_free_blocks == free_before

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def slot_beyond_table_raises(self, data):
        sid = data.draw(self.seq_ids())
        cap = len(self.tables[sid]) * self.bs
        with pytest.raises(IndexError):
            self.m.slot(sid, cap)
        with pytest.raises(IndexError):
            self.m.slots(sid, 0, cap + 1)

    # -- invariants

    @invariant()
    def tables_and_counts_match_model(self):
        holders = self.holders()
        assert self.m.num_usable_blocks == self.n - 1
        # No leak: free + distinct held blocks == usable.
        assert self.m.num_free_blocks + len(holders) == self.m.num_usable_blocks
        assert NULL_BLOCK_ID not in holders
        for sid, table in self.tables.items():
            assert self.m.has(sid)
            assert self.m.block_table(sid) == table
            # A table never holds the same block twice.
            assert len(set(table)) == len(table)
        # Ref count == number of tables holding each block (0 for free ones).
        for b in range(self.n):
            assert self.m.allocator.ref_count(b) == holders.get(b, 0)

    @invariant()
    def a_table_version_names_one_table_forever(self):
        """Equal versions mean equal tables, across sequences and over time (what lets the graph
        runner skip restaging a block table)."""
        for sid, table in self.tables.items():
            version = self.m.table_version(sid)
            assert version > 0
            assert self.versions_seen.setdefault(version, tuple(table)) == tuple(table)

    @invariant()
    def slots_consistent_and_distinct(self):
        owners: dict[int, set[int]] = {}
        for sid, table in self.tables.items():
            cap = len(table) * self.bs
            slots = self.m.slots(sid, 0, cap)
            assert len(slots) == cap
            for p, s in enumerate(slots):
                assert s == self.m.slot(sid, p)
                assert s == table[p // self.bs] * self.bs + p % self.bs
                assert self.bs <= s < self.n * self.bs  # never the null block
                owners.setdefault(s, set()).add(sid)
        # A slot is shared by several sequences only when its block is shared.
        holders = self.holders()
        for s, sids in owners.items():
            assert len(sids) == holders[s // self.bs]

    def teardown(self):
        for sid in list(self.tables):
            self.m.free(sid)
        assert self.m.num_free_blocks == self.m.num_usable_blocks
        for b in range(self.n):
            assert self.m.allocator.ref_count(b) == 0


ManagerMachine.TestCase.settings = FAST
TestManagerStateful = ManagerMachine.TestCase
