"""The KV block pool: which of the device's KV cache blocks each sequence holds.

The device owns the memory (``kv_num_blocks`` blocks of ``kv_block_size`` token slots, ids
``[0, kv_num_blocks)``, from its ``AttachReply``); prepare owns the bookkeeping: a free list, and
per sequence a :class:`BlockTable` whose new entries travel to the device as deltas
(``StepPlan.new_block_ids``). Paging as in vLLM (Kwon et al. 2023, PagedAttention); the
check-then-act pairs follow nano-vllm's ``BlockManager``.

Admission reserves a sequence's worst case up front (``can_allocate``/``allocate``): the blocks
for every token it may ever write to the KV cache. Blocks then leave the free list only as the
sequence's rows reach them (``can_append``/``append_slots``), so the pool figures show real use,
while a running sequence can never find the pool empty. That is what makes the scheduler
deadlock-free without preemption (see ``scheduler.py``).

Prefix caching (``prefix_cache.py``): blocks are reference-counted. A sequence may start with
blocks it shares (a prefix hit, one reference each); a block whose refcount drops to zero goes
back to the free list, unless it is cached: then it stays, evictable, until the free list is empty
and a sequence needs a block, and the least recently used one goes first. Evictable blocks count as
available to reservations, so a reservation is always backed by free or evictable blocks.

Sliding window (``release_prefix``): on a model whose every layer is windowed, a running
sequence lets go of the leading blocks no row of it will read again; they return to the pool as a
finished sequence's do (a cached one stays findable, evictable: its KV is still that prefix's),
while the table keeps their places (``RELEASED``) so later blocks keep their indices. As vLLM's
``SlidingWindowManager.remove_skipped_blocks`` (``vllm/v1/core/single_type_kv_cache_manager.py``),
which puts a null block in the freed places; unlike Mistral's rolling buffer cache (one buffer of
``window`` slots per sequence, overwritten in place), the paged pool's blocks can be shared by the
prefix cache. The reservation made at admission is not lowered (the blocks a sequence releases
serve others meanwhile).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stageserve.prepare.prefix_cache import BlockHash, PrefixCache

RELEASED = -1
"""A block-table entry whose block was released (`BlockManager.release_prefix`)."""


@dataclass(eq=False)
class BlockTable:
    """One sequence's KV blocks.

    Attributes:
        block_ids: block ids in position order: token ``p`` lives in block ``block_ids[p // block_size]``.
        reserved: blocks promised to this sequence at admission and not yet taken from the free list.
        num_released: the leading entries released (`RELEASED`) by a sliding window.
    """

    block_ids: list[int] = field(default_factory=list)
    reserved: int = 0
    num_released: int = 0


class BlockManager:
    """Free list, refcounts, reservations and the prefix cache over KV blocks ``[0, num_blocks)``
    of ``block_size`` tokens each.

    Not thread-safe: the scheduler that owns it is driven under one lock.

    Attributes:
        num_window_released: blocks released by `release_prefix` so far (a running count).

    Args:
        num_blocks: blocks in the device's pool (``AttachReply.kv_num_blocks``).
        block_size: token slots per block (``AttachReply.kv_block_size``).

    Raises:
        ValueError: either is not positive.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Reversed so that pop() hands out low ids first (easier to read in logs and tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._reserved = 0  # sum of BlockTable.reserved over live tables
        self.cache = PrefixCache()
        self.num_window_released = 0

    @property
    def num_free(self) -> int:
        """Blocks that hold no sequence's KV (reserved and evictable cached ones included)."""
        return len(self._free) + self.cache.num_evictable

    @property
    def num_used(self) -> int:
        """Blocks in some sequence's block table."""
        return self.num_blocks - self.num_free

    @property
    def num_available(self) -> int:
        """Free blocks not promised to an admitted sequence: what admission may still reserve."""
        return self.num_free - self._reserved

    def ref_count(self, block_id: int) -> int:
        """Block tables that hold ``block_id``."""
        return self._refs[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries (ceil division)."""
        return -(-num_tokens // self.block_size)

    def _blocks_needed(self, max_kv_tokens: int, shared: Sequence[int]) -> int:
        """Available blocks an admission takes: the blocks it will write, plus the shared ones that
        stop being evictable once it holds them."""
        evictable = sum(1 for block_id in shared if self.cache.is_evictable(block_id))
        return self.blocks_for_tokens(max_kv_tokens) - len(shared) + evictable

    def can_allocate(self, max_kv_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Whether a sequence that may write up to ``max_kv_tokens`` KV entries, starting with the
        cached blocks ``shared`` (a prefix hit), can be admitted now."""
        return self._blocks_needed(max_kv_tokens, shared) <= self.num_available

    def allocate(self, max_kv_tokens: int, shared: Sequence[int] = ()) -> BlockTable:
        """Hold the ``shared`` blocks, reserve the rest of ``max_kv_tokens`` KV entries, and return
        the block table (``shared`` so far).

        Raises:
            RuntimeError: ``can_allocate`` is false (a scheduler bug).
        """
        if not self.can_allocate(max_kv_tokens, shared):
            raise RuntimeError(f"allocate: {self._blocks_needed(max_kv_tokens, shared)} blocks needed, {self.num_available} available")
        for block_id in shared:
            if self._refs[block_id] == 0:
                self.cache.acquire(block_id)
            self._refs[block_id] += 1
        needed = self.blocks_for_tokens(max_kv_tokens) - len(shared)
        self._reserved += needed
        return BlockTable(block_ids=list(shared), reserved=needed)

    def can_append(self, table: BlockTable, num_kv_tokens: int) -> bool:
        """Whether ``table`` can grow to cover ``num_kv_tokens`` positions within its reservation."""
        return self.blocks_for_tokens(num_kv_tokens) - len(table.block_ids) <= table.reserved

    def append_slots(self, table: BlockTable, num_kv_tokens: int) -> list[int]:
        """Grow ``table`` to cover positions ``[0, num_kv_tokens)``; return the block ids added (maybe
        none). A block comes from the free list, else from the least recently used evictable one.

        Raises:
            RuntimeError: the growth exceeds the table's reservation (``can_append`` is false).
        """
        if not self.can_append(table, num_kv_tokens):
            raise RuntimeError(f"append_slots: {num_kv_tokens} positions exceed the reservation ({table.reserved} blocks left)")
        missing = self.blocks_for_tokens(num_kv_tokens) - len(table.block_ids)
        if missing <= 0:
            return []
        new_ids = [self._free.pop() if self._free else self.cache.evict() for _ in range(missing)]
        for block_id in new_ids:
            self._refs[block_id] = 1
        table.block_ids.extend(new_ids)
        table.reserved -= missing
        self._reserved -= missing
        return new_ids

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a held block, whose KV is written and published, shareable under ``block_hash``;
        whether it was added (``False``: that prefix is cached already, in another block)."""
        return self._refs[block_id] > 0 and self.cache.insert(block_id, block_hash)

    def release_prefix(self, table: BlockTable, num_blocks: int) -> None:
        """Drop the table's hold on its first ``num_blocks`` entries (those not released yet; more
        than the table has: all of them), which become `RELEASED`; see `free` for where the blocks go."""
        first, last = table.num_released, min(num_blocks, len(table.block_ids))
        if last <= first:
            return
        for j in range(first, last):
            self._drop(table.block_ids[j])
            table.block_ids[j] = RELEASED
        table.num_released = last
        self.num_window_released += last - first

    def free(self, table: BlockTable) -> None:
        """Drop the table's hold on its blocks and return its unused reservation; the table is left
        empty. A block nobody holds goes back to the free list, or stays cached (evictable)."""
        for block_id in reversed(table.block_ids[table.num_released :]):
            self._drop(block_id)
        self._reserved -= table.reserved
        table.block_ids = []
        table.reserved = table.num_released = 0

    def _drop(self, block_id: int) -> None:
        """One hold of ``block_id`` fewer: nobody's, it goes back to the free list or stays cached (evictable)."""
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            if self.cache.is_cached(block_id):
                self.cache.release(block_id)
            else:
                self._free.append(block_id)
