"""Paged key/value cache: fixed-size blocks of token slots, shared by all sequences.

A sequence owns a list of block ids (its block table, kept by the prepare service's block pool);
token ``p`` of that sequence lives in flat slot ``block_table[p // block_size] * block_size +
p % block_size``. Paging as in vLLM (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention").
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

from stageserve.device.model.config import ModelConfig


class PagedKVCache:
    """Keys and values of every layer in one pool ``kv`` ``[num_layers, entries, num_blocks, block_size, width]``.

    For grouped-query attention the entries are the ``2 * num_kv_heads`` K heads, then the V heads,
    each ``head_dim`` wide; for multi-head latent attention (``ModelConfig.kv_lora_rank``, ``mla.py``)
    one entry of ``kv_lora_rank + head_dim`` values per token: the latent and the rotated key that
    every head shares (DeepSeek-V2 paper, §2.1.2: what MLA caches), not the keys and values
    expanded per head. The pool is entry-major: viewed as ``[entries * num_blocks, block_size *
    width]`` it has one contiguous row per (entry, block). Gathering a step's blocks is then a single
    row ``index_select`` (memcpy speed) for keys and values together, whose halves are already the
    ``[kv_head * row, tokens, head_dim]`` operands of batched matmuls, with no transpose copy;
    storing a step's new keys and values is one ``index_copy_``. (One call instead of one per K and
    V: on a CPU each call's fixed cost is a few µs, times two per layer per step.) The pool is
    zero-filled: attention reads padded slots under a mask, and a masked NaN from uninitialised
    memory would still poison ``softmax(scores) @ V``. On the CPU the zeros are the kernel's
    (`zeroed_pool`), so the pool's memory becomes resident only as its blocks are first written.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        entries = 1 if config.kv_lora_rank else 2 * config.num_kv_heads
        width = config.kv_entry_size // entries
        self.kv = zeroed_pool((config.num_layers, entries, num_blocks, block_size, width), dtype, torch.device(device))
        # Per-layer views, made once for the hot path: slots [entries, num_blocks * block_size, width] and
        # block rows [entries * num_blocks, block_size, width].
        self._slots = [layer.view(entries, -1, width) for layer in self.kv]
        self._block_rows = [layer.view(-1, block_size, width) for layer in self.kv]
        self._head_offsets = torch.arange(entries, device=device)[:, None] * num_blocks  # [entries, 1]

    def layer(self, index: int) -> torch.Tensor:
        """``index``'s pool ``[entries, num_blocks, block_size, width]`` (a contiguous view)."""
        return self.kv[index]

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Pool rows ``[entries * B * W]`` int64 of block tables ``blocks`` ``[B, W]``, entry-major
        (K heads, then V heads); compute once per step."""
        return (self._head_offsets + blocks.view(1, -1)).view(-1)

    def gather_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """``layer``'s pool ``rows`` (from ``block_rows``): ``[entries * B * W, block_size, width]``."""
        return self._block_rows[layer].index_select(0, rows)

    def gather_blocks(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each ``[num_kv_heads * B * W, block_size, head_dim]``, of ``layer``'s pool ``rows`` (from ``block_rows``)."""
        return self.gather_rows(layer, rows).chunk(2)

    def gather_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``layer``'s entries at flat slots ``slots`` ``[n]`` int64: ``[entries, n, width]``."""
        return self._slots[layer].index_select(1, slots)

    def gather_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each ``[num_kv_heads, len(slots), head_dim]``, of ``layer`` at flat slots ``slots`` ``[n]`` int64."""
        return self.gather_entries(layer, slots).chunk(2)

    def write_entries(self, layer: int, entries: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' ``entries`` ``[T, entries, width]`` of ``layer`` at flat slots ``slot_mapping`` ``[T]`` int64."""
        self._slots[layer].index_copy_(1, slot_mapping, entries.transpose(0, 1))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new keys/values ``[T, num_kv_heads, head_dim]`` of ``layer`` at flat slots ``slot_mapping`` ``[T]`` int64."""
        self.write_entries(layer, torch.cat((k, v), 1), slot_mapping)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape``; on the CPU backed by an anonymous memory map, whose pages the
    operating system zeroes when first touched, so an unused part of a large pool holds no memory
    (``torch.zeros`` writes, and so commits, every page at once). Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the map alive (frombuffer holds the buffer).
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype).view(shape)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (``ModelConfig.kv_entry_size`` values per token and layer)."""
    return config.num_layers * block_size * config.kv_entry_size * dtype.itemsize


def num_blocks_for_memory(config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int, draft: ModelConfig | None = None) -> int:
    """How many whole blocks fit in ``memory_bytes`` (0 when not even one does).

    With a ``draft`` model (speculative decoding, `draft_model`): blocks of both pools, which have
    the same block count, the draft's holding one more (its scratch block).
    """
    if draft is None:
        return max(0, memory_bytes // bytes_per_block(config, block_size, dtype))
    per_draft = bytes_per_block(draft, block_size, dtype)
    return max(0, (memory_bytes - per_draft) // (bytes_per_block(config, block_size, dtype) + per_draft))


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory on ``device`` in bytes.

    Accelerators answer through their torch device module's ``mem_get_info`` (``torch.cuda``,
    ``torch.npu`` once ``torch_npu`` is imported); the CPU reads ``MemAvailable`` from
    ``/proc/meminfo`` (falling back to ``os.sysconf`` free pages where that file does not exist),
    at most what the process's memory cgroup still allows (a container's limit, `_cgroup_room_bytes`).
    """
    device = torch.device(device)
    if device.type != "cpu":
        free, _total = torch.get_device_module(device.type).mem_get_info(device)
        return int(free)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts kB
    room = _cgroup_room_bytes()
    return available if room is None else min(available, room)


# (limit, usage) files of the memory cgroup: v2, then v1; a limit past this means none.
_CGROUP_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                 (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
_NO_CGROUP_LIMIT = 2**60


def _cgroup_room_bytes() -> int | None:
    """What this process's memory cgroup (a container's memory limit) still allows, in bytes;
    ``None`` where no limit is set or none can be read. /proc/meminfo shows the host's memory,
    which a container may not use."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= _NO_CGROUP_LIMIT:
            return None
        return max(0, int(limit) - usage)
    return None


def kv_memory_budget(device: torch.device | str, fraction: float) -> int:
    """Bytes for the KV pools: ``fraction`` (0 < fraction <= 1) of the memory free on ``device`` now.

    Call after the weights are loaded and warm-up has run, so their memory is already taken.
    Raises ``ValueError`` for a fraction outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(available_memory_bytes(device) * fraction)
