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
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class BlockTable:
    """One sequence's KV blocks.

    Attributes:
        block_ids: block ids in position order: token ``p`` lives in block ``block_ids[p // block_size]``.
        reserved: blocks promised to this sequence at admission and not yet taken from the free list.
    """

    block_ids: list[int] = field(default_factory=list)
    reserved: int = 0


class BlockManager:
    """Free list and reservations over KV blocks ``[0, num_blocks)`` of ``block_size`` tokens each.

    Not thread-safe: the scheduler that owns it is driven under one lock.

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
        self._reserved = 0  # sum of BlockTable.reserved over live tables

    @property
    def num_free(self) -> int:
        """Blocks that hold no sequence's KV (reserved ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks in some sequence's block table."""
        return self.num_blocks - len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks not promised to an admitted sequence: what admission may still reserve."""
        return len(self._free) - self._reserved

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries (ceil division)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, max_kv_tokens: int) -> bool:
        """Whether a sequence that may write up to ``max_kv_tokens`` KV entries can be admitted now."""
        return self.blocks_for_tokens(max_kv_tokens) <= self.num_available

    def allocate(self, max_kv_tokens: int) -> BlockTable:
        """Reserve blocks for ``max_kv_tokens`` KV entries and return the (still empty) block table.

        Raises:
            RuntimeError: ``can_allocate`` is false (a scheduler bug).
        """
        needed = self.blocks_for_tokens(max_kv_tokens)
        if needed > self.num_available:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.num_available} available")
        self._reserved += needed
        return BlockTable(reserved=needed)

    def can_append(self, table: BlockTable, num_kv_tokens: int) -> bool:
        """Whether ``table`` can grow to cover ``num_kv_tokens`` positions within its reservation."""
        return self.blocks_for_tokens(num_kv_tokens) - len(table.block_ids) <= table.reserved

    def append_slots(self, table: BlockTable, num_kv_tokens: int) -> list[int]:
        """Grow ``table`` to cover positions ``[0, num_kv_tokens)``; return the block ids added (maybe none).

        Raises:
            RuntimeError: the growth exceeds the table's reservation (``can_append`` is false).
        """
        if not self.can_append(table, num_kv_tokens):
            raise RuntimeError(f"append_slots: {num_kv_tokens} positions exceed the reservation ({table.reserved} blocks left)")
        missing = self.blocks_for_tokens(num_kv_tokens) - len(table.block_ids)
        if missing <= 0:
            return []
        new_ids = [self._free.pop() for _ in range(missing)]
        table.block_ids.extend(new_ids)
        table.reserved -= missing
        self._reserved -= missing
        return new_ids

    def free(self, table: BlockTable) -> None:
        """Return the table's blocks and its unused reservation to the pool; the table is left empty."""
        self._free.extend(reversed(table.block_ids))
        self._reserved -= table.reserved
        table.block_ids = []
        table.reserved = 0
