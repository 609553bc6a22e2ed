"""Tensors copied into one anonymous memory map advised for transparent huge pages (``MADV_HUGEPAGE``).

A decode step streams every weight of the model once. On 4 KiB pages the quantized kernels' ~100
MiB of the embedded model's size touch ~25,000 pages a step: each is a TLB walk, and the hardware
prefetchers stop at each page's edge. On 2 MiB pages a one-row decode step of the embedded model
(Q4_1, and requantized to Q4_K_M and Q6_K) ran 1.10-1.15x as fast on two threads and 1.24-1.38x on
one (2-core AMD EPYC; docs/benchmarks.md, "Weights on huge pages"). Linux maps an anonymous region on huge pages
when transparent huge pages are ``always`` or, as most distributions set them, ``madvise`` and the
region is advised; where they are ``never`` (or elsewhere than Linux) the copy is still made and
simply stays on small pages.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page (PMD size)
ALIGN = 64  # each tensor starts on a cache line


def onto_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU; any dtype and shape) one after another, in the order given, each on
    a cache line, from a huge page boundary of one anonymous memory map advised ``MADV_HUGEPAGE``;
    each copy keeps its tensor's dtype and shape (contiguous) and holds the map alive. Where they hold
    less than one huge page in all, the tensors themselves, uncopied.

    Raises:
        ValueError: a tensor is not on the CPU.
    """
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("onto_huge_pages takes CPU tensors only")
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.nbytes // ALIGN) * ALIGN
    if end < HUGE_PAGE:
        return list(tensors)
    # Private: a shared map (mmap's default) is shared memory, which follows shmem's huge page setting
    # instead. One huge page to spare, so the copies can start on a boundary whatever address Linux
    # gives the map: the pages before that boundary and past `end` are never touched, so never held.
    region = mmap.mmap(-1, (-(-end // HUGE_PAGE) + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        region.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    whole = torch.frombuffer(region, dtype=torch.uint8, count=end, offset=start)
    copies = []
    for t, offset in zip(tensors, offsets):
        copy = whole[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
