"""Speculative decoding on the device: drafts in, one verifying forward pass, the accepted run out.

A decode row of a plan for a speculating device carries ``1 + k`` placeholders and a ``start_pos``
that is only an upper bound (prepare plans step N+1 before it knows how many drafts step N
accepted). The device knows: every correction below is made from device-resident state, inside
the step's device work, with no host synchronisation (as the placeholder substitution of plain
decoding, and tpu-inference's / vLLM's async scheduling with speculative decoding).

Per step (`Speculation`):

1. ``stage_rows`` (host, submit time) expands each decode row into ``1 + k`` single-token entries of
   the forward batch (position bound ``start_pos + j``), all sampling, so the target's logits at
   the pending token and at each draft come out of one forward pass;
2. ``fill_inputs`` (device): the proposer drafts from the sequence's own tokens (`TokenHistory`);
   entry 0 gets the pending token (``last_token``), entry ``j`` draft ``j - 1``; positions become
   ``length - 1 + j``, and the KV slots and attention masks follow them, so a rejected draft's KV
   (written at a position past the accepted run) is never read: the next step writes there again;
   on a CPU device (`drops_unproposed`) ``without_unproposed`` then drops the entries of drafts
   the proposer did not make: reading that count there waits for no accelerator;
3. the sampler draws the target's token at every entry, with its noise keyed by (seed, output
   index), where the output index follows from the position;
4. ``verify`` (device): `accept_drafts` keeps the drafts up to the first one that differs from the
   target's token there; the row emits the accepted drafts and the target's token after them;
5. ``follow`` (device, the step runner): the proposer sees the target's hidden states and each
   row's new pending entry (`proposer.Proposer.follow`; the MTP module drafts the next step there).

Exactness (Leviathan et al. 2023, Chen et al. 2023). For a proposer whose draft distribution is a
point mass ``q = 1[d]`` the rejection-sampling rule is: accept ``d`` with probability
``min(1, p(d) / q(d)) = p(d)``, else draw from ``max(0, p - q)`` normalised, i.e. ``p`` with ``d``
removed. Drawing the target's token ``y ~ p`` (independent noise per output index) and accepting
iff ``y == d`` is that rule: ``P(accept) = p(d)``, and on rejection ``y`` is distributed as ``p``
conditioned on ``y != d``. Because the noise depends only on (seed, output index), the emitted
tokens are exactly those the non-speculative run draws with the same seed, at any temperature
(temperature 0: the argmax). Every proposer drafts point masses (the draft model and the MTP
module their argmax); one with a proper draft distribution (sampled drafts) needs the general rule
instead; see docs/speculative.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch

from stageserve.device.backends import to_device
from stageserve.device.model.forward_batch import ForwardBatch, decode_slots_and_masks
from stageserve.device.speculation.proposer import ProposalStep, Proposer, StepLayout, TokenHistory
from stageserve.device.step_plan import AdmittedStep

PLACEHOLDER = -1


def accept_drafts(target_ids: torch.Tensor, draft_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per row: the length of the longest prefix where each draft is valid and equals
    the target's token at its position.

    Args:
        target_ids: ``[R, 1 + K]`` int64, the target's token at the pending position and after each draft.
        draft_ids: ``[R, K]`` int64; ``valid``: ``[R, K]`` bool, where a draft was proposed.

    Returns ``[R]`` int64 in ``[0, K]``; the row emits ``target_ids[r, : accepted[r] + 1]``.
    """
    width = draft_ids.shape[1]
    ok = valid & (draft_ids == target_ids[:, :width])
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


@dataclass
class StagedSpeculation:
    """One step's speculative bookkeeping, uploaded at stage time (all int64 tensors).

    Attributes:
        entry_index, entry_row, entry_offset: ``[E]``, per decode entry: its token index in the
            forward batch, its decode row (index into ``decode_seq``), and ``j`` (0 = the pending token).
        decode_seq: ``[Rd]`` seq_index of the decode rows; ``draft_limit``: ``[Rd]`` drafts each asked for.
        decode_sample_row: ``[Rd]`` each decode row's index among the sampling rows.
        num_drafts: K of this step (the largest ``draft_limit``); ``max_length``: host bound of the
            decode rows' history lengths.
        sample_seq: ``[S]`` seq_index of each sampling entry (logits row order).
        row_seq: ``[Rs]`` seq_index of each sampling row; ``row_entries``: ``[Rs, 1 + K]`` its
            entries (indices into S), padded with its last one.
        proposer_inputs: what the proposer staged for the step (`Proposer.stage`).
    """

    entry_index: torch.Tensor
    entry_row: torch.Tensor
    entry_offset: torch.Tensor
    decode_seq: torch.Tensor
    draft_limit: torch.Tensor
    decode_sample_row: torch.Tensor
    num_drafts: int
    max_length: int
    sample_seq: torch.Tensor
    row_seq: torch.Tensor
    row_entries: torch.Tensor
    proposer_inputs: object = None


@dataclass
class Verified:
    """What `Speculation.verify` returns per sampling row (``[Rs]`` int64 tensors on the device)."""

    num_tokens: torch.Tensor  # tokens the row emits: accepted drafts + 1
    num_drafted: torch.Tensor  # valid drafts the proposer made for the row
    last_token: torch.Tensor  # the row's new pending token
    pending_entry: torch.Tensor  # the sampling entry (index into S) that drew it


class Speculation:
    """The device's speculative decoding: a proposer and the token history it reads.

    Args:
        proposer: what drafts (see `proposer.Proposer`).
        num_speculative_tokens: K, drafts a row may ask for at most.
        max_num_seqs, max_model_len: the sequence table's size and the longest sequence (tokens).
        block_size: tokens per KV block.
        device: where the history lives.

    Attributes:
        drops_unproposed: whether a step runs only the entries of proposed drafts (a CPU device).
    """

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.proposer, self.num_speculative_tokens, self.block_size = proposer, num_speculative_tokens, block_size
        self.history = TokenHistory(max_num_seqs, max_model_len + 1, device)  # + 1: a row's write past its last position
        self.device = device
        # Where the device's work runs on the host, reading how many drafts were proposed costs no
        # synchronisation with an accelerator, so a step runs only the entries of proposed drafts;
        # on CUDA/NPU the entries' count would be a host sync inside the step: every asked entry runs.
        self.drops_unproposed = device.type == "cpu"

    @contextmanager
    def proposing_every_draft(self) -> Iterator[None]:
        """Within: every draft a row asks for counts as proposed (the proposer still runs; a draft it
        did not make is token 0), so a step runs all its entries: for measuring what they cost
        (`step_costs`), never while serving."""
        proposer = self.proposer
        self.proposer = _EveryDraftProposed(proposer)
        try:
            yield
        finally:
            self.proposer = proposer

    def stage_rows(self, admitted: AdmittedStep) -> tuple[list[tuple], StagedSpeculation]:
        """The forward batch's rows ``(token_ids, start_pos, block_table, sample)`` with each decode row
        expanded into ``1 + k`` single-token entries, and the step's `StagedSpeculation`."""
        step = admitted.step
        rows: list[tuple] = []
        entry_index, entry_row, entry_offset = [], [], []
        decode_seq, draft_limit, decode_sample_row, max_length = [], [], [], 0
        sample_seq, row_seq, row_entries, plain_single = [], [], [], []
        single = 0  # single-token rows so far: the forward batch puts them first, in row order
        # The longer prefill chunks follow the single-token rows (decode entries, one-token chunks).
        long_at = sum(n for n, end in zip(step.num_tokens, accumulate(step.num_tokens))
                      if n == 1 or step.token_ids[end - n] == PLACEHOLDER)
        started = {start.seq_index for start in step.started}
        row_first, sample_rows = [], []
        for seq, n, end, start, table, sample in zip(step.seq_index, step.num_tokens, accumulate(step.num_tokens),
                                                     step.start_pos, admitted.block_tables, step.sample):
            tokens = step.token_ids[end - n : end]
            if tokens[0] == PLACEHOLDER or n == 1:
                row_first.append(single)
            else:
                row_first.append(long_at)
                long_at += n
            if tokens[0] == PLACEHOLDER:  # a decode row: the pending token, then n - 1 drafts
                decode_sample_row.append(len(row_seq))
                for j in range(n):
                    rows.append(([PLACEHOLDER], start + j, table, True))
                    entry_index.append(single + j)
                    entry_row.append(len(decode_seq))
                    entry_offset.append(j)
                single += n
                decode_seq.append(seq)
                draft_limit.append(n - 1)
                max_length = max(max_length, start + 1)
                entries = list(range(len(sample_seq), len(sample_seq) + n))
            else:
                rows.append((tokens, start, table, sample))
                if n == 1:
                    plain_single.append(single)
                    single += 1
                entries = [len(sample_seq)] if sample else []
            if entries:
                sample_rows.append(len(row_first) - 1)
                row_seq.append(seq)
                sample_seq += [seq] * len(entries)
                row_entries.append(entries)
        width = 1 + max(draft_limit, default=0)
        decode_entry = [index for index, offset in zip(entry_index, entry_offset) if offset == 0]
        token_seq = [0] * long_at
        for seq, n, first in zip(step.seq_index, step.num_tokens, row_first):
            token_seq[first : first + n] = [seq] * n
        proposer_inputs = self.proposer.stage(StepLayout(
            decode_entry, draft_limit, plain_single, token_seq, row_first, [first + n - 1 for first, n in zip(row_first, step.num_tokens)],
            [seq in started for seq in step.seq_index], sample_rows, admitted.block_tables))
        padded = [entries + [entries[-1]] * (width - len(entries)) for entries in row_entries]
        device = self.device

        def up(values: list) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        return rows, StagedSpeculation(
            entry_index=up(entry_index), entry_row=up(entry_row), entry_offset=up(entry_offset),
            decode_seq=up(decode_seq), draft_limit=up(draft_limit), decode_sample_row=up(decode_sample_row),
            num_drafts=width - 1, max_length=max_length, sample_seq=up(sample_seq), row_seq=up(row_seq),
            row_entries=up(padded) if padded else up([]).view(0, width), proposer_inputs=proposer_inputs,
        )

    def fill_inputs(self, staged: StagedSpeculation, batch: ForwardBatch, last_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put the pending tokens and the drafts into ``batch`` and correct its decode entries'
        positions, KV slots and masks from the history (in place, on the device).

        ``last_token``: ``[N]`` int64, the sequence table's last sampled token per sequence.
        Returns the decode rows' ``(draft_ids, valid)``, ``[Rd, K]``.
        """
        seq, k = staged.decode_seq, staged.num_drafts
        drafts, valid = self.proposer.propose(self.history, seq, k, staged.max_length, ProposalStep(batch, staged.proposer_inputs))
        valid &= torch.arange(k, device=seq.device) < staged.draft_limit.unsqueeze(1)
        if staged.entry_index.numel() == 0:
            return drafts, valid
        inputs = torch.cat([last_token[seq].unsqueeze(1), drafts], dim=1)  # [Rd, 1 + K]
        index, row, offset = staged.entry_index, staged.entry_row, staged.entry_offset
        batch.input_ids[index] = inputs[row, offset]
        # The plan's positions are upper bounds: the real one never exceeds it (the min only keeps a
        # broken plan inside the row's block table).
        position = torch.minimum((self.history.length[seq] - 1)[row] + offset, batch.positions[index])
        batch.positions[index] = position
        batch.slot_mapping[index], batch.decode_mask[index] = decode_slots_and_masks(
            batch.decode_blocks[index], position, self.block_size, batch.decode_mask.shape[1])
        return drafts, valid

    def without_unproposed(self, staged: StagedSpeculation, batch: ForwardBatch, valid: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor | None]:
        """``batch`` without the entries of drafts the proposer did not make (``valid`` ``[Rd, K]``
        from `fill_inputs`), and the sampling entries it keeps (``[S']`` int64 indices into ``[S]``;
        ``None``: all of them, ``batch`` itself), on a CPU device (`drops_unproposed`); elsewhere
        ``(batch, None)``. A dropped entry's target token would follow a draft that does not exist:
        no accepted run reaches it."""
        if not self.drops_unproposed or staged.num_drafts == 0:
            return batch, None
        runs = torch.cat([torch.ones(valid.shape[0], 1, dtype=torch.bool), valid], dim=1)  # [Rd, 1 + K]: the pending token, each proposed draft
        needed = runs[staged.entry_row, staged.entry_offset]  # [E]
        if bool(needed.all()):
            return batch, None
        keep = torch.ones(batch.num_decode, dtype=torch.bool)
        keep[staged.entry_index] = needed
        return batch.keep_decode(keep)

    def output_index(self, staged: StagedSpeculation, batch: ForwardBatch) -> torch.Tensor:
        """``[S]`` int64: the index in its sequence's output of the token each sampling entry draws
        (its position + 1 - prompt length), the key of its sampling noise."""
        return batch.positions[batch.sample_indices] + 1 - self.history.prompt_len[staged.sample_seq]

    def verify(self, staged: StagedSpeculation, batch: ForwardBatch, sampled: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor) -> Verified:
        """Accept drafts against the target's tokens ``sampled`` ``[S]`` int64 and record the emitted
        tokens in the history (see the module docstring)."""
        target = sampled[staged.row_entries]  # [Rs, 1 + K]
        rows, k = staged.row_seq.shape[0], staged.num_drafts
        row_drafts = torch.zeros(rows, k, dtype=torch.int64, device=sampled.device)
        row_valid = torch.zeros(rows, k, dtype=torch.bool, device=sampled.device)
        row_drafts[staged.decode_sample_row] = drafts
        row_valid[staged.decode_sample_row] = valid
        accepted = accept_drafts(target, row_drafts, row_valid)
        history = self.history
        position = batch.positions[batch.sample_indices]  # [S]
        # Every entry's token goes after its position; those past the accepted run lie beyond the new length.
        history.tokens[staged.sample_seq, position + 1] = sampled
        history.length[staged.row_seq] = position[staged.row_entries[:, 0]] + accepted + 2
        pending = staged.row_entries.gather(1, accepted.unsqueeze(1)).squeeze(1)
        return Verified(accepted + 1, row_valid.sum(dim=1), sampled[pending], pending)


class _EveryDraftProposed:
    """`Speculation.proposing_every_draft`'s proposer: ``inner``'s drafts, all valid."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner

    def stage(self, layout: StepLayout) -> object:
        return self.inner.stage(layout)

    def propose(self, history: TokenHistory, seq_index: torch.Tensor, num_drafts: int, max_length: int,
                step: ProposalStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        drafts, valid = self.inner.propose(history, seq_index, num_drafts, max_length, step)
        return drafts, torch.ones_like(valid)

    def follow(self, history: TokenHistory, step: ProposalStep, hidden: torch.Tensor, pending_entry: torch.Tensor) -> None:
        self.inner.follow(history, step, hidden, pending_entry)
