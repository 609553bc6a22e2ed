"""Which device a new request goes to: the least loaded one, by KV headroom, then waiting work.

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

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LaneLoad:
    """One device's load as placement sees it.

    Attributes:
        kv_blocks_available: free KV blocks not promised to a running sequence.
        waiting_kv_blocks: blocks the waiting requests will reserve at admission.
        waiting: requests waiting for admission.
        running: sequences holding a seq index.
    """

    kv_blocks_available: int
    waiting_kv_blocks: int
    waiting: int
    running: int

    @property
    def kv_headroom(self) -> int:
        """Blocks left for a new request once the waiting ones are admitted (may be negative)."""
        return self.kv_blocks_available - self.waiting_kv_blocks


def placement_order(loads: Sequence[LaneLoad]) -> list[int]:
    """Indices of ``loads``, best device first (see the module docstring); equal loads keep their order."""
    return sorted(range(len(loads)), key=lambda i: (-loads[i].kv_headroom, loads[i].waiting, loads[i].running))
