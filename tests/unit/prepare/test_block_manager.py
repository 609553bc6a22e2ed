"""The KV block pool: reservations at admission, blocks taken as rows reach them, all returned on free."""

from __future__ import annotations

import pytest

from stageserve.prepare.block_manager import BlockManager


def test_blocks_for_tokens_rounds_up():
    pool = BlockManager(num_blocks=8, block_size=16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocate_reserves_without_taking_blocks():
    pool = BlockManager(num_blocks=8, block_size=16)
    assert pool.can_allocate(80)  # 5 blocks
    table = pool.allocate(80)
    assert table.block_ids == [] and table.reserved == 5
    assert (pool.num_free, pool.num_used, pool.num_available) == (8, 0, 3)
    assert pool.can_allocate(48) and not pool.can_allocate(49)  # 3 blocks left to promise
    with pytest.raises(RuntimeError):
        pool.allocate(49)


def test_append_slots_adds_only_missing_blocks_low_ids_first():
    pool = BlockManager(num_blocks=8, block_size=4)
    table = pool.allocate(12)
    assert pool.append_slots(table, 5) == [0, 1]   # positions [0, 5) span two blocks
    assert pool.append_slots(table, 8) == []       # still inside block 1
    assert pool.append_slots(table, 9) == [2]
    assert table.block_ids == [0, 1, 2] and table.reserved == 0
    assert (pool.num_free, pool.num_used, pool.num_available) == (5, 3, 5)


def test_append_beyond_reservation_is_refused():
    pool = BlockManager(num_blocks=8, block_size=4)
    table = pool.allocate(4)
    assert pool.can_append(table, 4) and not pool.can_append(table, 5)
    with pytest.raises(RuntimeError):
        pool.append_slots(table, 5)


def test_free_returns_blocks_and_unused_reservation():
    pool = BlockManager(num_blocks=6, block_size=4)
    first, second = pool.allocate(12), pool.allocate(8)
    pool.append_slots(first, 6)
    pool.append_slots(second, 8)
    assert (pool.num_free, pool.num_available) == (2, 1)
    pool.free(first)
    assert first.block_ids == [] and first.reserved == 0
    assert (pool.num_free, pool.num_used, pool.num_available) == (4, 2, 4)
    pool.free(second)
    assert (pool.num_free, pool.num_used, pool.num_available) == (6, 0, 6)
    # Every id comes back exactly once: a fresh full reservation takes all six distinct ids.
    table = pool.allocate(24)
    assert sorted(pool.append_slots(table, 24)) == [0, 1, 2, 3, 4, 5]


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)
