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


def test_a_capped_reservation_is_given_back_as_blocks_are_released():
    """A sequence writing 10 blocks that never holds more than 3 at once reserves 3; each released
    block gives one back, up to what it may still write, and the pool's figures stay consistent."""
    pool = BlockManager(num_blocks=5, block_size=4)
    assert pool.reservation(40) == 10 and pool.reservation(40, max_held_blocks=3) == 3
    assert not pool.can_allocate(40) and pool.can_allocate(40, max_held_blocks=3)
    table = pool.allocate(40, max_held_blocks=3)
    assert (table.reserved, table.max_blocks, table.capped) == (3, 10, True)
    assert pool.append_slots(table, 12) == [0, 1, 2]
    assert not pool.can_append(table, 13)  # holding 3: its bound
    pool.release_prefix(table, 2)
    assert table.reserved == 2 and (pool.num_free, pool.num_available) == (4, 2)  # unchanged by the release
    for end in range(16, 41, 4):  # write on, holding 3 at most
        pool.release_prefix(table, end // 4 - 3)
        pool.append_slots(table, end)
        assert len(table.block_ids) - table.num_released <= 3 and pool.num_available == 2
    assert table.reserved == 0  # the refunds stopped at the 10 blocks it may write
    pool.release_prefix(table, 9)
    assert table.reserved == 0 and pool.num_available == 4
    pool.free(table)
    assert (pool.num_free, pool.num_used, pool.num_available) == (5, 0, 5)


def test_refunds_for_shared_blocks_are_backed_while_they_are_shared():
    """Capped tables A and B share block 0 (B's prefix hit): B pays its whole reservation, one block
    of it backing the refund of whichever releases block 0 first while the other keeps it."""
    pool = BlockManager(num_blocks=8, block_size=4)
    first = pool.allocate(40, max_held_blocks=3)
    pool.append_slots(first, 4)
    assert pool.cache_block(0, b"prefix")
    assert pool.num_available == 5
    second = pool.allocate(40, pool.cache.longest_prefix([b"prefix"]), max_held_blocks=3)
    assert second.block_ids == [0] and second.reserved == 2
    assert pool.num_available == 2  # 3 for the second, hit or not: 2 reserved and 1 backing
    pool.release_prefix(first, 1)  # block 0 stays the second's: the first's refund is the backing
    assert (first.reserved, pool.num_free, pool.num_available) == (3, 7, 2)
    pool.release_prefix(second, 1)  # now nobody holds it: cached, evictable
    assert (second.reserved, pool.num_free, pool.num_available) == (3, 8, 2)
    pool.free(first)
    pool.free(second)
    assert (pool.num_free, pool.num_available) == (8, 8)


def test_an_uncapped_hit_on_a_block_only_capped_tables_hold_pays_its_backing():
    pool = BlockManager(num_blocks=8, block_size=4)
    capped = pool.allocate(40, max_held_blocks=3)
    pool.append_slots(capped, 4)
    pool.cache_block(0, b"prefix")
    hit = pool.cache.longest_prefix([b"prefix"])
    assert pool.num_available == 5
    uncapped = pool.allocate(8, hit)  # 2 blocks, 1 of them shared: 1 reserved + 1 backing
    assert pool.num_available == 3
    also_uncapped = pool.allocate(8, hit)  # block 0 now has an uncapped holder: the hit is free
    assert pool.num_available == 2
    pool.release_prefix(uncapped, 1)  # no refund for an uncapped table; block 0 still shared
    assert (uncapped.reserved, pool.num_available) == (1, 2)
    pool.release_prefix(also_uncapped, 1)  # the capped table holds block 0 alone: its backing is let go
    assert pool.num_available == 3
    for table in (capped, uncapped, also_uncapped):
        pool.free(table)
    assert pool.num_available == 8
