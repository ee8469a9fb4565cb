"""Paged KV-cache bookkeeping: which physical cache blocks each sequence owns.

The KV cache is one big array of ``num_blocks`` physical blocks, each holding
``block_size`` token positions. A *block id* is an index into that array; a
*slot* is a flat token index into it, ``block_id * block_size + offset``, and
is what the attention kernels use to write a token's key/value. A sequence's
*block table* lists, in order, the block ids holding its positions
``0..block_size-1``, ``block_size..2*block_size-1``, and so on.

Nothing here touches tensors: this module only decides ids, and returns
``(src, dst)`` pairs when the caller must copy a block's cache contents.

Prefix caching (``BlockManager(prefix_caching=True)``): a full block whose K/V
a sequence has computed is named by a key, (its parent block's id and
generation, its tokens), so that equal keys mean equal prefixes; a sequence
allocated later with the same leading tokens shares those blocks instead of
computing them. A cached block that nobody holds keeps its contents until a
fresh block is needed and no uncached one is free: then the least recently
freed cached block is handed out and its key dropped (its generation bumped,
so keys of blocks that followed it never match again).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = [
    "NULL_BLOCK_ID",
    "NoFreeBlocksError",
    "BlockAllocator",
    "BlockManager",
]

# Block 0 is reserved: padding rows of captured CUDA graphs need *some* valid
# block to point their slot mappings and block tables at, and writes there must
# never land in a live sequence's cache. So it is never handed out.
NULL_BLOCK_ID = 0


class NoFreeBlocksError(RuntimeError):
    """The allocator has no free block left for a request; nothing was changed.

    This is a capacity condition the scheduler is expected to avoid (check
    ``can_allocate``/``can_grow`` first) or handle by preempting a sequence.
    """


class BlockAllocator:
    """Reference-counted pool of physical KV-cache block ids.

    Usable block ids are ``1 .. num_blocks - 1``; :data:`NULL_BLOCK_ID` (0) is
    reserved and never handed out, forked or freed. A block is *free* when its
    reference count is 0 and *allocated* when it is 1 or more (more than 1
    means several block tables share it).

    Allocation order is LIFO and deterministic: a fresh allocator hands out
    1, 2, 3, ...; a freed block is the next one handed out. LIFO reuses blocks
    that were just touched, and makes runs reproducible.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block {NULL_BLOCK_ID} is reserved), "
                f"got {num_blocks!r}"
            )
        self._num_blocks = num_blocks
        # Index = block id. The null block's count stays 0 forever; it is
        # simply never in the free stack.
        self._ref_counts = [0] * num_blocks
        # Stack of free ids; the top (end) is handed out next. Built reversed
        # so a fresh allocator yields 1, 2, 3, ...
        self._free = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))
        # Free blocks that keep cached contents, least recently freed first: handed out only when the
        # stack is empty. A block is in at most one of the two.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._generations = [0] * num_blocks

    @property
    def num_blocks(self) -> int:
        """Total physical blocks, including the reserved null block."""
        return self._num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self._num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0, available to :meth:`allocate` (cached ones included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents are named by a key (held or free)."""
        return len(self._key_of)

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(
                f"block id {block_id!r} is out of range 0..{self._num_blocks - 1}"
            )

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id`` (0 = free; always 0 for the null block)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take a free block; it gets reference count 1.

        Raises :class:`NoFreeBlocksError` when none is free.
        """
        if self._free:
            block_id = self._free.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._drop_key(block_id)
        else:
            raise NoFreeBlocksError(
                f"no free KV-cache block (all {self.num_usable_blocks} usable blocks in use)"
            )
        self._ref_counts[block_id] = 1
        return block_id

    def fork(self, block_id: int) -> int:
        """Add one more holder to an allocated block and return its id.

        Raises ValueError for the null block or a free block: sharing a block
        nobody owns would let it be handed out again while still referenced.
        """
        self._check_id(block_id)
        if block_id == NULL_BLOCK_ID:
            raise ValueError(f"cannot fork the reserved null block {NULL_BLOCK_ID}")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot fork block {block_id}: it is free")
        self._ref_counts[block_id] += 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one holder of ``block_id``; at 0 it returns to the free pool.

        Raises ValueError (and changes nothing) for the null block or a block
        that is already free, so a double free is caught instead of putting a
        block in the pool twice.
        """
        self._check_id(block_id)
        if block_id == NULL_BLOCK_ID:
            raise ValueError(f"cannot free the reserved null block {NULL_BLOCK_ID}")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"double free of block {block_id}: it is already free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._key_of:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    # ---- cached contents --------------------------------------------------

    def cache(self, block_id: int, key: Hashable) -> bool:
        """Name a held block's contents by ``key``; False (nothing changed) when another block holds
        that key or this one already has a key."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot cache block {block_id}: it is free")
        if key in self._block_of or block_id in self._key_of:
            return self._block_of.get(key) == block_id
        self._key_of[block_id], self._block_of[key] = key, block_id
        return True

    def cached_block(self, key: Hashable) -> int | None:
        """The block whose contents ``key`` names, held or free, or None."""
        return self._block_of.get(key)

    def hold_cached(self, block_id: int) -> int:
        """One more holder of a cached block (taken back from the free ones when nobody held it)."""
        if block_id not in self._key_of:
            raise ValueError(f"block {block_id} holds no cached contents")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1
        return block_id

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` nobody holds (reference count 0)."""
        counts = self._ref_counts
        return sum(counts[block_id] == 0 for block_id in block_ids)

    def generation(self, block_id: int) -> int:
        """How many times ``block_id``'s cached contents were dropped: part of the keys of the blocks
        that follow it in a prefix."""
        return self._generations[block_id]

    def _drop_key(self, block_id: int) -> None:
        del self._block_of[self._key_of.pop(block_id)]
        self._generations[block_id] += 1


class BlockTables:
    """Block tables and what they map positions to: the lookups of :class:`BlockManager`, which owns
    the tables, and of a tensor-parallel rank's copies of rank 0's tables (``update``, ``drop``)."""

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}
        self._versions: dict[int, int] = {}

    def has(self, seq_id: int) -> bool:
        """Whether ``seq_id`` currently has a block table."""
        return seq_id in self._tables

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no block table") from None

    def update(self, tables: dict[int, tuple[list[int], int]]) -> None:
        """Take the given tables, each with its version (another holder's ``block_table`` and
        ``table_version``), in place of any held for those sequences."""
        for seq_id, (table, version) in tables.items():
            self._tables[seq_id], self._versions[seq_id] = table, version

    def drop(self, seq_id: int) -> None:
        """Forget a sequence's table (one taken by ``update``); nothing for one never held."""
        self._tables.pop(seq_id, None)
        self._versions.pop(seq_id, None)

    # ---- lookups ---------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of ``seq_id``'s physical block ids, in position order."""
        return list(self._table(seq_id))

    def table_version(self, seq_id: int) -> int:
        """A positive int naming the current contents of ``seq_id``'s table: it changes with every
        change to the table (allocate, grow, fork, copy-on-write) and no other table state, of any
        sequence, ever has it. Equal versions mean equal tables, so a reader that staged a table
        can skip restaging it (``DecodeBatch.block_table_versions``)."""
        self._table(seq_id)
        return self._versions[seq_id]

    def _block_index(self, table: list[int], position: int) -> int:
        if not isinstance(position, int) or not 0 <= position < len(table) * self.block_size:
            raise IndexError(
                f"position {position!r} is outside the block table "
                f"(capacity {len(table) * self.block_size} positions)"
            )
        return position // self.block_size

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV-cache slot of ``seq_id``'s token at ``position``.

        ``table[position // block_size] * block_size + position % block_size``;
        IndexError when the position is beyond the table.
        """
        table = self._table(seq_id)
        index = self._block_index(table, position)
        return table[index] * self.block_size + position % self.block_size

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions ``start`` (inclusive) to ``end`` (exclusive).

        IndexError unless ``0 <= start <= end <= capacity``.
        """
        table = self._table(seq_id)
        capacity = len(table) * self.block_size
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= capacity):
            raise IndexError(
                f"positions [{start!r}, {end!r}) are outside the block table "
                f"(capacity {capacity} positions)"
            )
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class BlockManager(BlockTables):
    """Per-sequence block tables over a :class:`BlockAllocator`.

    Sequences are identified by an int ``seq_id`` chosen by the caller.
    Position ``p`` of a sequence lives in block ``table[p // block_size]`` at
    offset ``p % block_size``. Tables only grow (until :meth:`free`).

    Forked sequences share blocks copy-on-write: before writing the token at
    position ``p`` the caller calls :meth:`prepare_write`; if that block is
    shared it is swapped for a private copy and the caller must copy the
    cache contents from ``src`` to ``dst`` before writing.

    Errors: an unknown ``seq_id`` raises KeyError; re-using an existing one
    raises ValueError; a position outside the table raises IndexError; lack of
    blocks raises :class:`NoFreeBlocksError`. Every failing call leaves the
    state unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        super().__init__(block_size)
        self.allocator = BlockAllocator(num_blocks)
        #: Whether full computed blocks are shared by later sequences with the same leading tokens.
        self.prefix_caching = prefix_caching
        # Per sequence: how many of its leading blocks are cached under its own prefix's keys; a sequence
        # whose block could not take its key (another block had it) stops there.
        self._cached_blocks: dict[int, int] = {}
        self._chain_ended: set[int] = set()
        #: Prompt tokens looked up in the prefix cache and found there, since the start.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        # A version per table, drawn from one counter, so that a version names one table's contents:
        # it changes whenever the table does and is never reused (see ``table_version``).
        self._version_counter = itertools.count(1)

    # ---- capacity -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks free in the underlying allocator."""
        return self.allocator.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.allocator.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` positions (ceil division)."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether :meth:`allocate` for ``num_tokens`` would succeed now."""
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def _extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self._table(seq_id)))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """Whether :meth:`grow` to ``num_tokens`` total would succeed now."""
        return self._extra_blocks(seq_id, num_tokens) <= self.num_free_blocks

    def can_grow_all(self, targets: list[tuple[int, int]]) -> bool:
        """Whether :meth:`grow` of every ``(seq_id, num_tokens)`` in ``targets``, one after another,
        would succeed now (the blocks they need together fit)."""
        return sum(self._extra_blocks(seq_id, n) for seq_id, n in targets) <= self.num_free_blocks

    # ---- table lifecycle ------------------------------------------------

    def _take(self, count: int) -> list[int]:
        # Check before taking anything so a failure never leaves a partial
        # allocation behind (all-or-nothing).
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {count} KV-cache blocks, only {self.num_free_blocks} free"
            )
        return [self.allocator.allocate() for _ in range(count)]

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Create a table for ``seq_id`` with room for ``num_tokens`` positions.

        All-or-nothing: raises :class:`NoFreeBlocksError` without allocating
        anything when there are too few free blocks; raises ValueError when
        ``seq_id`` already has a table.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self._tables[seq_id] = self._take(self.blocks_needed(num_tokens))
        self._new_version(seq_id)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Extend ``seq_id``'s table to hold ``num_tokens`` positions in total.

        Appends fresh (unshared) blocks as needed; never shrinks. All-or-
        nothing. Writing into an existing shared block still needs
        :meth:`prepare_write`.
        """
        table = self._table(seq_id)
        added = self._take(self._extra_blocks(seq_id, num_tokens))
        if added:
            table.extend(added)
            self._new_version(seq_id)

    def allocate_with_prefix(self, seq_id: int, token_ids: list[int], count: bool = True) -> int:
        """``allocate(seq_id, len(token_ids))``, the leading full blocks taken from the prefix cache where
        their tokens were computed before; returns how many positions they cover (their K/V is in the
        cache). The last token is never taken from the cache (its forward gives the next token).
        ``count``: add the lookup to the hit statistics (a prompt's first, not a recomputation's).
        Without ``prefix_caching``, plainly ``allocate`` (returns 0). All-or-nothing."""
        if not self.prefix_caching:
            self.allocate(seq_id, len(token_ids))
            return 0
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        hits: list[int] = []
        size, allocator, parent = self.block_size, self.allocator, None
        # Inside every prompt's time to first token: one dict lookup a block, keys built as ``_key`` does.
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            block = allocator.cached_block((parent, tuple(token_ids[start:start + size])))
            if block is None:
                break
            hits.append(block)
            parent = (block, allocator.generation(block))
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        if fresh + allocator.num_unheld(hits) > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {fresh} fresh KV-cache blocks besides {len(hits)} cached ones, only "
                                    f"{self.num_free_blocks} free")
        table = [self.allocator.hold_cached(b) for b in hits]  # before any fresh block can evict them
        self._tables[seq_id] = table + self._take(fresh)
        self._new_version(seq_id)
        self._cached_blocks[seq_id] = len(hits)
        if count:
            self.prefix_queried_tokens += len(token_ids)
            self.prefix_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def cache_computed(self, seq_id: int, num_computed: int, tokens: Callable[[int, int], list[int]]) -> None:
        """With ``prefix_caching``: name the full blocks among ``seq_id``'s first ``num_computed``
        positions (their K/V written) by their prefix, for later sequences to share. ``tokens(start,
        end)``: the sequence's token ids at those positions."""
        if not self.prefix_caching or seq_id in self._chain_ended:
            return
        table = self._table(seq_id)
        done = self._cached_blocks.setdefault(seq_id, 0)
        while done < num_computed // self.block_size:
            start = done * self.block_size
            key = self._key(table[done - 1] if done else None, tokens(start, start + self.block_size))
            if not self.allocator.cache(table[done], key):
                self._chain_ended.add(seq_id)
                break
            done += 1
        self._cached_blocks[seq_id] = done

    def _key(self, parent: int | None, tokens: list[int]) -> tuple:
        """The key of a full block: the block before it in the prefix (id and generation; None for the
        first) and its tokens. Equal keys mean equal prefixes: a parent's generation changes whenever
        its cached contents are dropped, so a key never outlives the prefix it named."""
        return (None if parent is None else (parent, self.allocator.generation(parent))), tuple(tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` a table sharing all of ``parent_id``'s blocks.

        Needs no free block: each shared block's reference count goes up by 1.
        """
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        self._tables[child_id] = [self.allocator.fork(b) for b in parent]
        self._new_version(child_id)

    def prepare_write(self, seq_id: int, position: int) -> tuple[int, int] | None:
        """Make the block holding ``position`` private to ``seq_id`` (copy-on-write).

        Returns None when the block is already private. When it is shared,
        a fresh block replaces it in this table only and ``(src_block,
        dst_block)`` is returned: the caller must copy the cache contents of
        ``src_block`` into ``dst_block`` before writing. Raises
        :class:`NoFreeBlocksError` (nothing changed) when a copy is needed but
        no block is free.
        """
        table = self._table(seq_id)
        index = self._block_index(table, position)
        src = table[index]
        if self.allocator.ref_count(src) == 1:
            return None
        dst = self.allocator.allocate()
        # The other holders keep ``src``; this sequence just stops holding it.
        self.allocator.free(src)
        table[index] = dst
        self._new_version(seq_id)
        return src, dst

    def _new_version(self, seq_id: int) -> None:
        self._versions[seq_id] = next(self._version_counter)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table, releasing one reference to each of its blocks."""
        table = self._table(seq_id)
        del self._tables[seq_id]
        del self._versions[seq_id]
        self._cached_blocks.pop(seq_id, None)
        self._chain_ended.discard(seq_id)
        # Release back to front: with the LIFO allocator, the sequence's first
        # block ends on top of the free stack, so a re-allocation of the same
        # size gets the same table back.
        for block_id in reversed(table):
            self.allocator.free(block_id)
