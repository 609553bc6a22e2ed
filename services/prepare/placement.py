"""A device's load, and which device a new request goes to: the one holding the longest cached
prefix of it unless that one is clearly busier, else the least loaded one, by KV headroom, then
waiting work.

A request is placed once, when it is accepted, and never moves: its KV cache lives in that device's
pool and its sampled tokens in that device's sequence table. So placement looks at what admission
there will look at:

1. **KV headroom** (more first): blocks the device's pool can still promise
   (``BlockManager.num_available``: free blocks not reserved by running sequences nor set aside for their refunds) minus the blocks
   its waiting requests will reserve when admitted. Absolute blocks, so a bigger pool takes more.
2. **waiting requests** (fewer first): ahead of this one in that device's queue;
3. **running requests** (fewer first): the tie-break; more rows make each step slower.

Same ordering idea as "least outstanding requests" balancing, weighted by the resource that
actually bounds admission (the KV pool, as in vLLM's scheduler).

**Cache affinity** (prefix caching): when some device's prefix cache holds part of the prompt,
devices with KV headroom left go first, ordered by outstanding (waiting + running) requests less
one request per :data:`HIT_TOKENS_PER_REQUEST` prompt tokens their cache holds; ties keep the
load order. So the turns of a long conversation stay where their KV is, while a short shared
prefix (a chat template's system line) only breaks ties, and a burst of requests with one shared
prefix still spreads (as SGLang's cache-aware router balances prefix matches against load).
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
        kv_blocks_cached: blocks in the device's prefix cache (held by a sequence or not).
    """

    attach: device_pb2.AttachReply
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_available: int = 0
    waiting_kv_blocks: int = 0
    kv_blocks_cached: int = 0

    @property
    def kv_headroom(self) -> int:
        """Blocks left for a new request once the waiting ones are admitted (may be negative)."""
        return self.kv_blocks_available - self.waiting_kv_blocks


HIT_TOKENS_PER_REQUEST = 256  # cached prompt tokens worth one more outstanding request on a device


def placement_order(loads: Sequence[DeviceLoad], hit_tokens: Sequence[int] = ()) -> list[int]:
    """Indices of ``loads``, best device first (see the module docstring); equal loads keep their order.

    Args:
        hit_tokens: per device, prompt tokens of the request its prefix cache holds (none: all 0).
    """
    by_load = sorted(range(len(loads)), key=lambda i: (-loads[i].kv_headroom, loads[i].waiting, loads[i].running))
    if not any(hit_tokens):
        return by_load
    return sorted(by_load, key=lambda i: (loads[i].kv_headroom <= 0,
                                          loads[i].waiting + loads[i].running - hit_tokens[i] / HIT_TOKENS_PER_REQUEST))


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
        kv_blocks_cached=sum(load.kv_blocks_cached for load in loads),
    )
