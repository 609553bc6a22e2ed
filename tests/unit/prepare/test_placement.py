"""Placement of new requests over devices: KV headroom first, then waiting work, then running requests."""

from __future__ import annotations

from stageserve.prepare.placement import DeviceLoad, placement_order
from stageserve.v1 import device_pb2


def load(kv_blocks_available: int, waiting_kv_blocks: int, waiting: int, running: int) -> DeviceLoad:
    """A device's load with just the figures placement weighs."""
    return DeviceLoad(device_pb2.AttachReply(), running=running, waiting=waiting, kv_blocks_free=kv_blocks_available,
                      kv_blocks_total=kv_blocks_available, kv_blocks_available=kv_blocks_available, waiting_kv_blocks=waiting_kv_blocks)


def test_the_device_with_more_kv_headroom_comes_first():
    loads = [load(kv_blocks_available=10, waiting_kv_blocks=0, waiting=0, running=1),
             load(kv_blocks_available=40, waiting_kv_blocks=0, waiting=0, running=9)]
    assert placement_order(loads) == [1, 0]


def test_waiting_requests_count_against_the_headroom_they_will_reserve():
    # Device 0 has more free blocks, but its queue will take 35 of them at admission.
    loads = [load(kv_blocks_available=50, waiting_kv_blocks=35, waiting=5, running=2),
             load(kv_blocks_available=30, waiting_kv_blocks=0, waiting=0, running=4)]
    assert placement_order(loads) == [1, 0]


def test_ties_go_to_fewer_waiting_then_fewer_running_then_listing_order():
    loads = [load(20, 0, waiting=1, running=0), load(20, 0, waiting=0, running=3),
             load(20, 0, waiting=0, running=1), load(20, 0, waiting=0, running=1)]
    assert placement_order(loads) == [2, 3, 1, 0]


def test_a_burst_splits_evenly_between_equal_devices():
    """What the router sees as requests arrive faster than admission: each placement adds the
    request's blocks to its device's waiting demand, and admission moves them to reserved, which
    keeps the headroom the same; so equal devices share the burst whatever admission does."""
    available, waiting_blocks, waiting = [45, 45], [0, 0], [0, 0]
    chosen = []
    for _ in range(8):
        best = placement_order([load(available[i], waiting_blocks[i], waiting[i], 0) for i in range(2)])[0]
        chosen.append(best)
        waiting_blocks[best] += 3
        waiting[best] += 1
        if best == 1:  # device 1's step loop admits at once: reserved now, no longer waiting
            available[1] -= 3
            waiting_blocks[1] -= 3
            waiting[1] -= 1
    assert (chosen.count(0), chosen.count(1)) == (4, 4)
    assert available[0] - waiting_blocks[0] == available[1] - waiting_blocks[1] == 45 - 4 * 3


def test_no_devices_no_order():
    assert placement_order([]) == []
