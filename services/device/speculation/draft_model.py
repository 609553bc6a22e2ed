"""The draft-model proposer: a smaller model that shares the target's tokenizer drafts greedily, on
the device, with a paged KV pool of its own.

The draft's pool has the target's block count and block size and is indexed by the same block ids
and slot mapping (plus one scratch block, see below), so prepare's block tables, reservations and
prefix cache apply to it unchanged: every prefill row also runs through the draft model and writes
the draft's KV of the same tokens into the same slots, so a shared prefix block holds both models'
KV of its tokens.

Per step, inside the step's device work right before the target's forward pass (no host
synchronisation; ``pos`` is a decode row's pending token's position, from the device's
`proposer.TokenHistory`):

1. first pass, one forward of the draft model: the step's prefill rows (the target's own chunks,
   for their KV; no logits) and two entries per decode row, the token at ``pos - 1`` and the
   pending token at ``pos``. Writing ``pos - 1`` again is needed when the previous step accepted
   every draft (its last draft never went through the draft model) and harmless otherwise (the
   same token at the same place). Where ``pos - 1`` is a prompt position (a row's first decode
   step) the prefill wrote it, maybe into a block the prefix cache shares: that write goes to the
   scratch block instead, which nothing reads. The argmax at ``pos`` is draft 1 of each row that
   asks for drafts;
2. passes ``j = 2..K``: one forward of single-token entries over the rows asking for at least ``j``
   drafts, draft ``j - 1`` at ``pos + j - 1``; its argmax is draft ``j``.

A decode row that asks for no drafts (not chosen by prepare's draft planner, constrained, penalised)
still takes part in the first pass, so the draft's KV follows its tokens. The KV of drafts the
target rejects lies past the accepted run and is written again before it is read, as the
target's. The drafts are argmaxes, a point-mass draft distribution, so the acceptance rule of
`verification` stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stageserve.device.backends import to_device
from stageserve.device.model.forward_batch import ForwardBatch, PrefillSegment, decode_batch, decode_slots_and_masks
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.speculation.proposer import ProposalStep, StepLayout, TokenHistory, greedy_drafts, no_drafts


@dataclass
class StagedDraft:
    """One step's uploads for the draft model (int64 tensors on the device).

    Attributes:
        decode_entry: ``[Rd]`` per decode row, the target batch index of its first entry (whose
            block table row and position bound the draft reads).
        draft_limit: ``[Rd]`` drafts each decode row asks for.
        plain_single: ``[P]`` target batch indices of the one-token prefill rows.
        drafting: ``[Rk]`` the decode rows (indices into ``Rd``) asking for at least one draft.
        first_samples: ``[Rk]`` their pending entries' indices in the first pass (``2 * row + 1``).
        later_rows: per pass ``j = 2..K``, ``[Rj]`` indices into ``drafting`` of the rows asking
            for at least ``j`` drafts.
    """

    decode_entry: torch.Tensor
    draft_limit: torch.Tensor
    plain_single: torch.Tensor
    drafting: torch.Tensor
    first_samples: torch.Tensor
    later_rows: list[torch.Tensor]


class DraftModelProposer:
    """Drafts with ``model`` (greedy) over its own KV pool of ``num_blocks`` (+ 1 scratch) blocks of
    ``block_size`` tokens in ``dtype``, on the model's device (see the module docstring).

    ``model`` must share the target's tokenizer (the device checks it at start-up); its embedding
    table may be padded to another size than the target's ``vocab_size``: drafts are argmaxes over
    the ids both have.
    """

    def __init__(self, model: DecoderModel, vocab_size: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        self.model, self.block_size = model, block_size
        self.vocab_size = min(vocab_size, model.config.vocab_size)
        self.kv_cache = PagedKVCache(model.config, num_blocks + 1, block_size, dtype, model.device)
        self.scratch_slot = num_blocks * block_size  # the first slot of the scratch block

    def stage(self, layout: StepLayout) -> StagedDraft:
        """See `proposer.Proposer.stage`."""
        limits = layout.draft_limit
        drafting = [row for row, limit in enumerate(limits) if limit]
        device = self.model.device

        def up(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        later = [up([i for i, row in enumerate(drafting) if limits[row] >= j]) for j in range(2, max(limits, default=0) + 1)]
        return StagedDraft(up(layout.decode_entry), up(limits), up(layout.plain_single), up(drafting), up([2 * row + 1 for row in drafting]), later)

    def follow(self, history: TokenHistory, step: ProposalStep, hidden: torch.Tensor, pending_entry: torch.Tensor) -> None:
        """Nothing: the draft model reads tokens only (its KV follows them in ``propose``)."""

    def propose(self, history: TokenHistory, seq_index: torch.Tensor, num_drafts: int, max_length: int,
                step: ProposalStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See `proposer.Proposer.propose`; ``step`` is required (the step's forward batch)."""
        staged, batch = step.staged, step.batch
        # The plan's position bound only keeps a broken plan inside the row's block table (as the target's entries).
        pos = torch.minimum(history.length[seq_index] - 1, batch.positions[staged.decode_entry])  # [Rd]
        logits = self.model.forward(self._first_pass(history, seq_index, pos, batch, staged), self.kv_cache)  # [Rk, vocab]
        if num_drafts == 0:
            return no_drafts(seq_index.shape[0], seq_index.device)
        rows = staged.drafting
        drafts = torch.zeros(seq_index.shape[0], num_drafts, dtype=torch.int64, device=seq_index.device)
        drafts[rows, 0] = self._argmax(logits)
        blocks, pos = batch.decode_blocks[staged.decode_entry[rows]], pos[rows]  # [Rk, W], [Rk]
        for j, later in enumerate(staged.later_rows, start=1):
            chosen = rows[later]
            entries = decode_batch(drafts[chosen, j - 1], pos[later] + j, blocks[later], self.block_size)
            drafts[chosen, j] = self._argmax(self.model.forward(entries, self.kv_cache))
        valid = torch.arange(num_drafts, device=seq_index.device) < staged.draft_limit.unsqueeze(1)
        return drafts, valid

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``[R]`` int64 greedy drafts from the draft's logits ``[R, draft vocab]``, among the ids the target has."""
        return greedy_drafts(logits, self.vocab_size, self.model.cpu_kernels)

    def _first_pass(self, history: TokenHistory, seq_index: torch.Tensor, pos: torch.Tensor, batch: ForwardBatch,
                    staged: StagedDraft) -> ForwardBatch:
        """The first pass's batch: two entries per decode row (``pos - 1``, ``pos``), then the target
        batch's one-token prefill rows, then its longer prefill chunks (see the module docstring)."""
        single, tail = staged.plain_single, slice(batch.num_decode, None)
        pair_pos = torch.stack([(pos - 1).clamp(min=0), pos], dim=1).view(-1)  # [2 Rd]
        pair_seq = seq_index.repeat_interleave(2)
        ids = [history.tokens[pair_seq, pair_pos], batch.input_ids[single], batch.input_ids[tail]]
        positions = [pair_pos, batch.positions[single], batch.positions[tail]]
        slots = [batch.slot_mapping[single], batch.slot_mapping[tail]]
        num_decode = pair_pos.shape[0] + single.shape[0]
        blocks = mask = None
        if num_decode:
            pair_blocks = batch.decode_blocks[staged.decode_entry].repeat_interleave(2, dim=0)  # [2 Rd, W]
            pair_slots, pair_mask = decode_slots_and_masks(pair_blocks, pair_pos, self.block_size, batch.decode_mask.shape[1])
            # A prompt position was written by the prefill (maybe in a shared block): not again.
            prompt = pair_pos[0::2] < history.prompt_len[seq_index]
            pair_slots[0::2] = torch.where(prompt, self.scratch_slot, pair_slots[0::2])
            slots.insert(0, pair_slots)
            blocks = torch.cat([pair_blocks, batch.decode_blocks[single]])
            mask = torch.cat([pair_mask, batch.decode_mask[single]])
        shift = num_decode - batch.num_decode
        return ForwardBatch(
            input_ids=torch.cat(ids), positions=torch.cat(positions), slot_mapping=torch.cat(slots), num_decode=num_decode,
            decode_blocks=blocks, decode_mask=mask,
            prefills=[PrefillSegment(p.start + shift, p.length, p.context_slots, p.mask) for p in batch.prefills],
            sample_indices=staged.first_samples,
        )
