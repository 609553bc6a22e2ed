"""Paged key/value cache: fixed-size blocks of token slots, shared by all sequences.

A sequence owns a list of block ids (its block table, kept by the prepare service's block pool);
token ``p`` of that sequence lives in flat slot ``block_table[p // block_size] * block_size +
p % block_size``. Paging as in vLLM (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from stageserve.device.model.config import ModelConfig


class PagedKVCache:
    """Keys and values of every layer in one pool ``kv`` ``[num_layers, 2 * num_kv_heads, num_blocks, block_size, head_dim]``.

    Per layer the K heads come first, then the V heads, and the pool is head-major: viewed as
    ``[2 * num_kv_heads * num_blocks, block_size * head_dim]`` it has one contiguous row per (head,
    block). Gathering a step's blocks is then a single row ``index_select`` (memcpy speed) for keys
    and values together, whose halves are already the ``[kv_head * row, tokens, head_dim]`` operands
    of batched matmuls, with no transpose copy; storing a step's new keys and values is one
    ``index_copy_``. (One call instead of one per K and V: on a CPU each call's fixed cost is a few
    µs, times two per layer per step.) The pool is zero-filled: attention reads padded slots under
    a mask, and a masked NaN from uninitialised memory would still poison ``softmax(scores) @ V``.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        heads = 2 * config.num_kv_heads
        self.kv = torch.zeros((config.num_layers, heads, num_blocks, block_size, config.head_dim), dtype=dtype, device=device)
        # Per-layer views, made once for the hot path: slots [2K, num_blocks * block_size, head_dim] and
        # block rows [2K * num_blocks, block_size, head_dim].
        self._slots = [layer.view(heads, -1, config.head_dim) for layer in self.kv]
        self._block_rows = [layer.view(-1, block_size, config.head_dim) for layer in self.kv]
        self._head_offsets = torch.arange(heads, device=device)[:, None] * num_blocks  # [2K, 1]

    def layer(self, index: int) -> torch.Tensor:
        """``index``'s pool ``[2 * num_kv_heads, num_blocks, block_size, head_dim]`` (a contiguous view)."""
        return self.kv[index]

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Pool rows ``[2 * num_kv_heads * B * W]`` int64 of block tables ``blocks`` ``[B, W]``, head-major
        (K heads, then V heads); compute once per step."""
        return (self._head_offsets + blocks.view(1, -1)).view(-1)

    def gather_blocks(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each ``[num_kv_heads * B * W, block_size, head_dim]``, of ``layer``'s pool ``rows`` (from ``block_rows``)."""
        return self._block_rows[layer].index_select(0, rows).chunk(2)

    def gather_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each ``[num_kv_heads, len(slots), head_dim]``, of ``layer`` at flat slots ``slots`` ``[n]`` int64."""
        return self._slots[layer].index_select(1, slots).chunk(2)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new keys/values ``[T, num_kv_heads, head_dim]`` of ``layer`` at flat slots ``slot_mapping`` ``[T]`` int64."""
        self._slots[layer].index_copy_(1, slot_mapping, torch.cat((k, v), 1).transpose(0, 1))


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return 2 * config.num_layers * block_size * config.kv_size * dtype.itemsize


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
    ``/proc/meminfo``, falling back to ``os.sysconf`` free pages where that file does not exist.
    """
    device = torch.device(device)
    if device.type != "cpu":
        free, _total = torch.get_device_module(device.type).mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_memory_budget(device: torch.device | str, fraction: float) -> int:
    """Bytes for the KV pools: ``fraction`` (0 < fraction <= 1) of the memory free on ``device`` now.

    Call after the weights are loaded and warm-up has run, so their memory is already taken.
    Raises ``ValueError`` for a fraction outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(available_memory_bytes(device) * fraction)
