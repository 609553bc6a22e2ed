"""A device's load, and which device a new request goes to: the least loaded one, by KV headroom,
then waiting work.

A request is placed once, when it is accepted, and never moves: its KV cache lives in that device's
pool and its sampled tokens in that device's sequence table. So placement looks at what admission
there will look at:

1. **KV headroom** (more first): blocks the device's pool can still promise
   (``BlockManager.num_available``: free blocks not reserved by running sequences) minus the blocks
   its waiting requests will reserve when admitted. Absolute blocks, so a bigger pool takes more.
2. **waiting requests** (fewer first): ahead of this one in that device's queue;
3. **running requests** (fewer first): the tie-break; more rows make each step slower.

Same ordering idea as "least outstanding requests" balancing, weighted by the resource that
actually bounds admission (the KV pool, as in vLLM's scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stageserve.v1 import device_pb2


@dataclass(frozen=True)
class DeviceLoad:
    """One device's figures, for ``GetModelInfo``, the metrics gauges and placement.

    Attributes:
        attach: the device's ``AttachReply`` (model facts and limits).
        running: sequences holding a seq index.
        waiting: requests waiting for admission.
        kv_blocks_free: KV blocks holding no sequence's KV (reserved ones included).
        kv_blocks_total: KV blocks of the device's pool.
        kv_blocks_available: free KV blocks not promised to a running sequence.
        waiting_kv_blocks: blocks the waiting requests will reserve at admission.
    """

    attach: device_pb2.AttachReply
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_available: int = 0
    waiting_kv_blocks: int = 0

    @property
    def kv_headroom(self) -> int:
        """Blocks left for a new request once the waiting ones are admitted (may be negative)."""
        return self.kv_blocks_available - self.waiting_kv_blocks


def placement_order(loads: Sequence[DeviceLoad]) -> list[int]:
    """Indices of ``loads``, best device first (see the module docstring); equal loads keep their order."""
    return sorted(range(len(loads)), key=lambda i: (-loads[i].kv_headroom, loads[i].waiting, loads[i].running))


def sum_loads(loads: Sequence[DeviceLoad]) -> DeviceLoad | None:
    """One :class:`DeviceLoad` with the figures of ``loads`` added up (model facts of the first); ``None`` for none."""
    if not loads:
        return None
    return DeviceLoad(
        loads[0].attach,
        running=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        kv_blocks_free=sum(load.kv_blocks_free for load in loads),
        kv_blocks_total=sum(load.kv_blocks_total for load in loads),
        kv_blocks_available=sum(load.kv_blocks_available for load in loads),
        waiting_kv_blocks=sum(load.waiting_kv_blocks for load in loads),
    )
