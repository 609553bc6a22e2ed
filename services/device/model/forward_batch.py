"""The flattened input of one forward pass: prefill chunks and single-token decode rows of one step.

``build_forward_batch`` turns a step's rows into one ``ForwardBatch`` (token ids, positions, KV
slot mapping, block tables and attention masks), built once per step on the host and moved to the
device; ``DecoderModel.forward`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class BatchRow(NamedTuple):
    """One sequence's part of a step.

    ``token_ids`` are the new tokens (a prefill chunk, or one token when decoding); ``start_pos``
    counts the sequence's tokens already in the KV cache; ``block_table`` lists the KV block ids
    the sequence owns, covering at least ``start_pos + len(token_ids)`` tokens; ``sample`` asks for
    the logits of the row's last token.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclass
class PrefillSegment:
    """Attention inputs of one row with more than one new token.

    The row's tokens are ``ForwardBatch`` tokens ``[start, start + length)``. A row that starts a
    sequence (nothing cached yet) attends to its own new keys with a causal mask and has
    ``context_slots``/``mask`` ``None``; a later chunk reads its whole context back from the cache.
    """

    start: int
    length: int
    context_slots: torch.Tensor | None  # [context] int64 flat KV slots of tokens 0..context-1
    mask: torch.Tensor | None  # [length, context] bool, True where attention is allowed


@dataclass
class ForwardBatch:
    """Inputs of one forward pass, shared by all layers.

    Tokens are ordered with the ``num_decode`` single-token rows first (so decode attention is one
    batched call over ``[0, num_decode)``), then each prefill row's chunk. ``sample_indices`` keeps
    the caller's row order, so logits row ``i`` belongs to the ``i``-th row that asked to sample.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot (block_id * block_size + offset) each new K/V is written to
    num_decode: int
    decode_blocks: torch.Tensor | None  # [num_decode, W] int64 block tables of the decode rows, cut to the longest context's W blocks, padded
    decode_mask: torch.Tensor | None  # [num_decode, W * block_size] bool, True for the row's real context tokens
    prefills: list[PrefillSegment]
    sample_indices: torch.Tensor  # [S] int64 index into T of each sampling row's last token

    def sampled_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sampling rows of ``hidden`` ``[T, hidden]`` in ``sample_indices`` order: ``[S, hidden]``.

        ``index_select`` gathers them on the calling thread; ``hidden[sample_indices]`` (a TensorIterator)
        forks an OpenMP region for a 32-row decode step's [32, 576] bfloat16 (36 KiB: less work than the
        fork and join)."""
        return hidden.index_select(0, self.sample_indices)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """A copy with every tensor on ``device`` (non-blocking where the source is pinned)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            num_decode=self.num_decode,
            decode_blocks=move(self.decode_blocks),
            decode_mask=move(self.decode_mask),
            prefills=[PrefillSegment(p.start, p.length, move(p.context_slots), move(p.mask)) for p in self.prefills],
            sample_indices=move(self.sample_indices),
        )

    def keep_decode(self, keep: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
        """This batch without the single-token rows where ``keep`` ``[num_decode]`` bool is false,
        and the sampling rows it keeps: ``[S']`` int64 indices into ``sample_indices`` (its logits
        row ``i`` is this batch's logits row ``kept[i]``). Reads ``keep`` on the host: a CPU batch."""
        tokens = keep.nonzero().squeeze(1)  # [Bd'] decode tokens kept
        dropped = self.num_decode - tokens.shape[0]
        rest = torch.arange(self.num_decode, self.input_ids.shape[0])
        order = torch.cat([tokens, rest])

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[tokens]

        # Old token index -> new one (-1: dropped), then the sampling rows whose token stays.
        new_index = torch.full((self.input_ids.shape[0],), -1, dtype=torch.int64)
        new_index[order] = torch.arange(order.shape[0])
        remapped = new_index[self.sample_indices]
        kept = (remapped >= 0).nonzero().squeeze(1)
        batch = ForwardBatch(
            input_ids=self.input_ids[order], positions=self.positions[order], slot_mapping=self.slot_mapping[order],
            num_decode=tokens.shape[0], decode_blocks=rows(self.decode_blocks), decode_mask=rows(self.decode_mask),
            prefills=[PrefillSegment(p.start - dropped, p.length, p.context_slots, p.mask) for p in self.prefills],
            sample_indices=remapped[kept],
        )
        return batch, kept


def build_forward_batch(rows: list[BatchRow] | list[tuple], block_size: int, device: torch.device | str) -> ForwardBatch:
    """Build the step's ``ForwardBatch`` on the host from ``(token_ids, start_pos, block_table, sample)`` rows, then move it to ``device``.

    Raises ``ValueError`` for a row with no new tokens or a block table too short for its context.
    """
    rows = [BatchRow(*row) for row in rows]
    for i, row in enumerate(rows):
        if not row.token_ids:
            raise ValueError(f"row {i} has no new tokens")
        if len(row.block_table) * block_size < row.start_pos + len(row.token_ids):
            raise ValueError(f"row {i}: block table of {len(row.block_table)} blocks cannot hold {row.start_pos + len(row.token_ids)} tokens")
    order = batch_order([len(r.token_ids) for r in rows])
    num_decode = sum(len(r.token_ids) == 1 for r in rows)

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slot_mapping: list[torch.Tensor] = []
    last_token = [0] * len(rows)
    decode_blocks = decode_mask = None
    if num_decode:
        decode = [rows[i] for i in order[:num_decode]]
        context = [r.start_pos + 1 for r in decode]
        width = -(-max(context) // block_size)
        decode_blocks = _pad_tables([r.block_table[:width] for r in decode], width)  # [Bd, W]
        position = torch.tensor(context) - 1  # [Bd]
        decode_mask = torch.arange(width * block_size) <= position[:, None]  # [Bd, W * block_size]
        input_ids += [r.token_ids[0] for r in decode]
        positions.append(position)
        slot_mapping.append(decode_blocks.gather(1, (position // block_size)[:, None]).view(-1) * block_size + position % block_size)
        for t, i in enumerate(order[:num_decode]):
            last_token[i] = t
    prefills = []
    for i in order[num_decode:]:
        row, start = rows[i], len(input_ids)
        n, context = len(row.token_ids), row.start_pos + len(row.token_ids)
        j = torch.arange(context)
        slots = torch.tensor(row.block_table)[j // block_size] * block_size + j % block_size  # [context]
        pos = j[row.start_pos :]  # [n]
        fresh = row.start_pos == 0
        prefills.append(PrefillSegment(start, n, None if fresh else slots, None if fresh else j <= pos[:, None]))
        input_ids += row.token_ids
        positions.append(pos)
        slot_mapping.append(slots[row.start_pos :])
        last_token[i] = start + n - 1
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slot_mapping),
        num_decode=num_decode,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        prefills=prefills,
        sample_indices=torch.tensor([last_token[i] for i, r in enumerate(rows) if r.sample], dtype=torch.int64),
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def batch_order(num_tokens: list[int]) -> list[int]:
    """The rows in the order their tokens sit in a ``ForwardBatch``: single-token rows first, then
    the longer ones, each group in row order (``num_tokens``: new tokens per row)."""
    return [i for i, n in enumerate(num_tokens) if n == 1] + [i for i, n in enumerate(num_tokens) if n > 1]


def row_token_starts(num_tokens: list[int]) -> list[int]:
    """Where each row's first token sits among a ``ForwardBatch``'s tokens (see `batch_order`)."""
    starts, at = [0] * len(num_tokens), 0
    for row in batch_order(num_tokens):
        starts[row], at = at, at + num_tokens[row]
    return starts


def decode_slots_and_masks(blocks: torch.Tensor, positions: torch.Tensor, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat KV slots ``[E]`` int64 and attention masks ``[E, width]`` bool of single-token entries at
    ``positions`` ``[E]`` int64, over their block tables ``blocks`` ``[E, W]`` int64; device ops only,
    no host synchronisation (for positions known on the device alone)."""
    slots = blocks.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1) * block_size + positions % block_size
    return slots, torch.arange(width, device=positions.device) <= positions.unsqueeze(1)


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor, block_size: int) -> ForwardBatch:
    """A `ForwardBatch` of single-token rows only, built on the device from device tensors: tokens
    ``input_ids`` ``[E]`` int64 at ``positions`` ``[E]`` int64 over block tables ``blocks`` ``[E, W]``
    int64, every row sampling (in order)."""
    slots, mask = decode_slots_and_masks(blocks, positions, block_size, blocks.shape[1] * block_size)
    rows = input_ids.shape[0]
    return ForwardBatch(input_ids, positions, slots, rows, blocks, mask, [], torch.arange(rows, device=input_ids.device))


def _pad_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables of at most ``width`` blocks -> [rows, width] int64, padded with block 0 (read only under a mask)."""
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
