"""The KV block pool: which of the device's KV cache blocks each sequence holds.

The device owns the memory (``kv_num_blocks`` blocks of ``kv_block_size`` token slots, ids
``[0, kv_num_blocks)``, from its ``AttachReply``); prepare owns the bookkeeping: a free list, and
per sequence a :class:`BlockTable` whose new entries travel to the device as deltas
(``StepPlan.new_block_ids``). Paging as in vLLM (Kwon et al. 2023, PagedAttention); the
check-then-act pairs follow nano-vllm's ``BlockManager``.

Admission reserves a sequence's worst case up front (``can_allocate``/``allocate``): the most
blocks it can hold at once, i.e. one for every token it may ever write to the KV cache, or, on a
windowed model, the fewer its window lets it hold (``max_held_blocks``, the scheduler's bound: see
``scheduler.py``). Blocks then leave the free list only as the sequence's rows reach them
(``can_append``/``append_slots``), so the pool figures show real use, while a running sequence can
never find the pool empty. That is what makes the scheduler deadlock-free without preemption.

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
prefix cache.

A windowed sequence whose bound is below its whole length reserves the bound (``BlockTable.capped``)
and gets a block of reservation back for every block it releases, up to the blocks it may still
write: what it holds plus what it may still take stays the bound (or all it has left to write), so
its next rows always fit. (vLLM allocates on demand and preempts instead, so it has no reservation
to give back.) A released block nobody else holds went back to the free list or the cache
(evictable): ``num_available`` is unchanged by the refund. A released block another table still
holds went nowhere: that refund is backed by free blocks set aside while the block is shared,
``min(capped holders, holders - 1)`` per block (``_backing``: at most that many of its holders
release it while another one keeps it, and only capped ones get a refund). So a capped sequence's
prefix hit costs its whole reservation, as without the hit, and another sequence's hit costs one
block more only on a block that capped tables alone hold. Without a window no table is capped and
nothing changes.
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
        reserved: blocks promised to this sequence and not yet taken from the free list.
        num_released: the leading entries released (`RELEASED`) by a sliding window.
        max_blocks: the entries it may ever have: one per block of the positions it may write.
        capped: its reservation is a window's bound on the blocks it holds at once, below
            ``max_blocks``: each block it releases gives a block of reservation back.
    """

    block_ids: list[int] = field(default_factory=list)
    reserved: int = 0
    num_released: int = 0
    max_blocks: int = 0
    capped: bool = False


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
        self._capped_refs = [0] * num_blocks  # per block, the capped tables among its holders
        self._reserved = 0  # sum of BlockTable.reserved over live tables
        self._refund_backing = 0  # sum of _backing over blocks (module docstring)
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
        """Free blocks not promised to an admitted sequence, nor set aside to back the refunds of
        capped tables that share blocks (module docstring): what admission may still reserve."""
        return self.num_free - self._reserved - self._refund_backing

    def ref_count(self, block_id: int) -> int:
        """Block tables that hold ``block_id``."""
        return self._refs[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries (ceil division)."""
        return -(-num_tokens // self.block_size)

    def reservation(self, max_kv_tokens: int, max_held_blocks: int | None = None) -> int:
        """Blocks a sequence that may write up to ``max_kv_tokens`` KV entries, and never holds more
        than ``max_held_blocks`` at once (``None``: no bound), reserves at admission without a hit."""
        whole = self.blocks_for_tokens(max_kv_tokens)
        return whole if max_held_blocks is None else min(whole, max_held_blocks)

    def _is_capped(self, max_kv_tokens: int, max_held_blocks: int | None) -> bool:
        """Whether the reservation is the bound, below the whole length (``BlockTable.capped``)."""
        return self.reservation(max_kv_tokens, max_held_blocks) < self.blocks_for_tokens(max_kv_tokens)

    def _blocks_needed(self, max_kv_tokens: int, shared: Sequence[int], max_held_blocks: int | None) -> int:
        """Available blocks an admission takes: its reservation less the shared blocks, plus those of
        them that stop being evictable once it holds them, plus the refund backing its holds add."""
        capped = self._is_capped(max_kv_tokens, max_held_blocks)
        return self.reservation(max_kv_tokens, max_held_blocks) - len(shared) + sum(self._hold_cost(block_id, capped) for block_id in shared)

    def _hold_cost(self, block_id: int, capped: bool) -> int:
        """Available blocks one more hold of the cached ``block_id``, by a capped table or not, takes."""
        refs, capped_refs = self._refs[block_id], self._capped_refs[block_id]
        evictable = self.cache.is_evictable(block_id)
        return evictable + _backing(refs + 1, capped_refs + capped) - _backing(refs, capped_refs)

    def can_allocate(self, max_kv_tokens: int, shared: Sequence[int] = (), max_held_blocks: int | None = None) -> bool:
        """Whether a sequence that may write up to ``max_kv_tokens`` KV entries, starting with the
        cached blocks ``shared`` (a prefix hit), and never holding more than ``max_held_blocks`` at
        once (``None``: no bound), can be admitted now."""
        return self._blocks_needed(max_kv_tokens, shared, max_held_blocks) <= self.num_available

    def allocate(self, max_kv_tokens: int, shared: Sequence[int] = (), max_held_blocks: int | None = None) -> BlockTable:
        """Hold the ``shared`` blocks, reserve the rest of `reservation` blocks, and return the block
        table (``shared`` so far). The shared blocks count within ``max_held_blocks`` (the scheduler's
        bound covers a hit and its first row).

        Raises:
            RuntimeError: ``can_allocate`` is false, or ``shared`` is more than the reservation (scheduler bugs).
        """
        needed = self._blocks_needed(max_kv_tokens, shared, max_held_blocks)
        if needed > self.num_available:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.num_available} available")
        reserve = self.reservation(max_kv_tokens, max_held_blocks)
        if len(shared) > reserve:
            raise RuntimeError(f"allocate: a hit of {len(shared)} blocks is more than the {reserve} blocks the sequence may hold")
        table = BlockTable(block_ids=list(shared), reserved=reserve - len(shared), max_blocks=self.blocks_for_tokens(max_kv_tokens),
                           capped=self._is_capped(max_kv_tokens, max_held_blocks))
        for block_id in shared:
            if self._refs[block_id] == 0:
                self.cache.acquire(block_id)
            self._hold(block_id, table.capped)
        self._reserved += table.reserved
        return table

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
            self._hold(block_id, table.capped)
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
        than the table has: all of them), which become `RELEASED`; see `free` for where the blocks
        go. A capped table gets a block of reservation back for each, up to the blocks it may still
        write (an uncapped one's reservation is all of those already)."""
        first, last = table.num_released, min(num_blocks, len(table.block_ids))
        if last <= first:
            return
        for j in range(first, last):
            self._drop(table.block_ids[j], table.capped)
            table.block_ids[j] = RELEASED
        table.num_released = last
        self.num_window_released += last - first
        refund = min(last - first, table.max_blocks - len(table.block_ids) - table.reserved)
        table.reserved += refund
        self._reserved += refund

    def free(self, table: BlockTable) -> None:
        """Drop the table's hold on its blocks and return its unused reservation; the table is left
        empty. A block nobody holds goes back to the free list, or stays cached (evictable)."""
        for block_id in reversed(table.block_ids[table.num_released :]):
            self._drop(block_id, table.capped)
        self._reserved -= table.reserved
        table.block_ids = []
        table.reserved = table.num_released = 0

    def _hold(self, block_id: int, capped: bool, holds: int = 1) -> None:
        """``holds`` holds of ``block_id`` more (negative: fewer), by a capped table or not; the refund
        backing follows."""
        before = _backing(self._refs[block_id], self._capped_refs[block_id])
        self._refs[block_id] += holds
        self._capped_refs[block_id] += holds * capped
        self._refund_backing += _backing(self._refs[block_id], self._capped_refs[block_id]) - before

    def _drop(self, block_id: int, capped: bool) -> None:
        """One hold of ``block_id`` fewer: nobody's, it goes back to the free list or stays cached (evictable)."""
        self._hold(block_id, capped, -1)
        if self._refs[block_id] == 0:
            if self.cache.is_cached(block_id):
                self.cache.release(block_id)
            else:
                self._free.append(block_id)


def _backing(holders: int, capped_holders: int) -> int:
    """Refunds a block with ``holders`` holders, ``capped_holders`` of them capped, may give while
    another holder keeps it: each capped holder's, but never the last holder's."""
    return max(0, min(capped_holders, holders - 1))
