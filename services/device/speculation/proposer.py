"""Draft proposers for speculative decoding: what guesses a row's next tokens before the target verifies them.

A proposer runs inside a step's device work (stream order, no host synchronisation), right before
the target's forward pass, and reads only device-resident state: `TokenHistory` holds every
sequence's prompt and output tokens as the device itself produced them, so it is exact even while
the host does not know yet how many drafts the step in flight accepted.

`Proposer` is the interface; `NgramProposer` (prompt lookup, no extra model) implements it here,
`draft_model.DraftModelProposer` (a smaller model with its own paged KV) and `mtp.MTPProposer`
(the checkpoint's own multi-token-prediction module, which also ``follow``s the target's hidden
states after each step's verification) in their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from stageserve.device.backends import to_device
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.sampler import argmax_rows
from stageserve.device.step_plan import StartedSequence
from stageserve.prompt_lookup import MAX_N, MIN_N


class TokenHistory:
    """Every sequence's tokens (prompt, then output) on the device, and how many there are.

    Args:
        max_num_seqs: N, the sequence table size.
        width: L, tokens a sequence may hold (max_model_len plus the drafts of one step, so that
            a write past a row's end stays inside).
        device: where the tensors live.

    Attributes:
        tokens: ``[N, L]`` int64; row ``s`` holds sequence ``s``'s tokens ``[0, length[s])``; the
            entries past that are stale (rejected drafts' targets) and never read.
        length: ``[N]`` int64, tokens known (prompt + published-or-not outputs); the last one is the
            pending token, sampled and not yet in the KV cache, at position ``length - 1``.
        prompt_len: ``[N]`` int64.
    """

    def __init__(self, max_num_seqs: int, width: int, device: torch.device) -> None:
        self.width = width
        self.tokens = torch.zeros(max_num_seqs, width, dtype=torch.int64, device=device)
        self.length = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.prompt_len = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)

    def stage_starts(self, started: list[StartedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Uploads (at stage time) that write ``started``'s prompts, all int64: ``seq_index`` ``[k]``,
        prompt lengths ``[k]``, coordinates ``[2, P]`` (row, column) and the prompt tokens ``[P]``."""
        rows, cols, tokens = [], [], []
        for start in started:
            rows += [start.seq_index] * len(start.prompt_token_ids)
            cols += range(len(start.prompt_token_ids))
            tokens += start.prompt_token_ids
        device = self.length.device
        return (
            to_device([s.seq_index for s in started], torch.int64, device),
            to_device([len(s.prompt_token_ids) for s in started], torch.int64, device),
            to_device([rows, cols], torch.int64, device),
            to_device(tokens, torch.int64, device),
        )

    def apply_starts(self, staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write the staged prompts (inside the step's device work)."""
        seq_index, lengths, coords, tokens = staged
        self.tokens[coords[0], coords[1]] = tokens
        self.length[seq_index] = lengths
        self.prompt_len[seq_index] = lengths


@dataclass(frozen=True)
class StepLayout:
    """Where a step's rows sit in its forward batch (host lists, known at submit time).

    Attributes:
        decode_entry: per decode row, the batch index of its first entry (the pending token; its
            ``k`` drafts' entries follow it).
        draft_limit: per decode row, the drafts it asks for (``k``).
        plain_single: batch indices of the single-token rows that are not decode rows (a prefill
            chunk of one token); the batch's rows past ``num_decode`` are the longer prefill chunks.
        token_seq: per batch token, its sequence's seq_index (a row's tokens sit together, in position order).
        row_first, row_last: per row of the plan, the batch indices of its first and last token.
        row_started: per row of the plan, whether its sequence started in this step.
        sample_rows: the rows of the plan that sample, in the order of the step's sampling rows.
        block_tables: per row of the plan, its KV block table.
    """

    decode_entry: list[int]
    draft_limit: list[int]
    plain_single: list[int]
    token_seq: list[int] = ()
    row_first: list[int] = ()
    row_last: list[int] = ()
    row_started: list[bool] = ()
    sample_rows: list[int] = ()
    block_tables: list[list[int]] = ()


@dataclass(frozen=True)
class ProposalStep:
    """The step a proposer drafts in, on the device.

    Attributes:
        batch: the target's forward batch as staged: prefill rows final, decode entries not yet
            corrected (their tokens are placeholders and their positions upper bounds).
        staged: what the proposer's ``stage`` returned for this step.
    """

    batch: ForwardBatch
    staged: object


class Proposer(Protocol):
    """Proposes up to ``num_drafts`` tokens for each of a step's decode rows, on the device."""

    def stage(self, layout: StepLayout) -> object:
        """Upload what ``propose`` will need for this step (host, submit time); ``None`` if nothing."""
        ...

    def propose(self, history: TokenHistory, seq_index: torch.Tensor, num_drafts: int, max_length: int,
                step: ProposalStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for the sequences ``seq_index`` ``[R]`` int64, given their tokens so far.

        Called in every step that has rows, also when no row drafts (``num_drafts`` 0), so a
        proposer with state of its own (a draft model's KV) can follow every sequence's tokens.
        ``max_length`` bounds ``history.length[seq_index]`` (host-known: the plan's positions), so
        the proposer reads ``history.tokens[:, :max_length]`` only. ``step``: the step's forward
        batch and staged inputs (``None`` outside a step, where a proposer needs none). Returns
        ``(draft_ids, valid)``, both ``[R, num_drafts]`` (int64 ids in the vocabulary; bool): draft
        ``j`` of row ``r`` is a proposal only where ``valid[r, j]`` (and then every earlier one of
        the row is too).
        """
        ...

    def follow(self, history: TokenHistory, step: ProposalStep, hidden: torch.Tensor, pending_entry: torch.Tensor) -> None:
        """After the step's verification, in its device work: what the target computed, for a
        proposer that conditions on it (`mtp.MTPProposer`; the others do nothing).

        ``step.batch`` is the batch the target ran (the staged one, less the entries of drafts not
        proposed on a CPU device), ``hidden`` ``[T, hidden]`` its hidden states before the final
        norm (activation dtype), ``pending_entry`` ``[Rs]`` int64 the batch index of the entry whose
        sampled token each sampling row now has pending; ``history`` holds the step's tokens.
        """
        ...


def greedy_drafts(logits: torch.Tensor, vocab_size: int, fused: bool) -> torch.Tensor:
    """``[R]`` int64 argmaxes of a proposer model's logits ``[R, V]`` among the first ``vocab_size``
    ids (the target's: a model sharing its tokenizer may pad its table to another size);
    ``fused``: the CPU kernels' argmax (`sampler.argmax_rows`)."""
    if logits.shape[1] > vocab_size:
        logits = logits[:, :vocab_size].contiguous()
    return argmax_rows(logits, fused)


def no_drafts(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(draft_ids, valid)`` of ``rows`` rows that propose nothing: ``[rows, 0]`` int64 and bool."""
    return torch.zeros(rows, 0, dtype=torch.int64, device=device), torch.zeros(rows, 0, dtype=torch.bool, device=device)


class NgramProposer:
    """Prompt lookup (as vLLM's ``ngram`` method and Hugging Face's prompt-lookup decoding): find the
    last ``n`` tokens of the sequence earlier in its own prompt and output, and propose the tokens
    that followed that earlier occurrence.

    The longest ``n`` in ``[min_n, max_n]`` with a match wins, and among its matches the most
    recent one; a row without any match proposes nothing (all ``valid`` false). Vectorised over the
    rows: one ``[R, L - n + 1, n]`` comparison per ``n``, no host synchronisation. The default
    sizes are `stageserve.prompt_lookup`'s, whose host copy of the rule prepare replays.
    """

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def stage(self, layout: StepLayout) -> None:
        """Nothing to upload: the history is all the lookup reads."""
        return None

    def follow(self, history: TokenHistory, step: ProposalStep, hidden: torch.Tensor, pending_entry: torch.Tensor) -> None:
        """Nothing: the lookup reads the history only."""

    def propose(self, history: TokenHistory, seq_index: torch.Tensor, num_drafts: int, max_length: int,
                step: ProposalStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See `Proposer.propose` (``step`` is not used)."""
        if num_drafts == 0:
            return no_drafts(seq_index.shape[0], seq_index.device)
        width = min(max_length, history.width)
        tokens = history.tokens[seq_index, :width]  # [R, W]
        length = history.length[seq_index]  # [R]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        # Index after the match (the first proposed token's), -1 where no n has matched yet.
        follow = torch.full_like(length, -1)
        for n in range(self.min_n, self.max_n + 1):
            if n >= width:
                break
            suffix_at = (length - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=tokens.device)  # [R, n]
            suffix = tokens[rows.unsqueeze(1), suffix_at]  # [R, n]
            windows = tokens.unfold(1, n, 1)  # [R, W - n + 1, n], window i = tokens[i : i + n]
            starts = torch.arange(windows.shape[1], device=tokens.device)
            # A match must end before the suffix starts' last token, so something follows it.
            match = (windows == suffix.unsqueeze(1)).all(dim=2) & (starts + n < length.unsqueeze(1)) & (length >= n + 1).unsqueeze(1)
            latest = torch.where(match, starts, -1).amax(dim=1)  # [R]
            follow = torch.where(latest >= 0, latest + n, follow)  # a longer n overrides
        offsets = torch.arange(num_drafts, device=tokens.device)
        at = follow.unsqueeze(1) + offsets  # [R, K]
        valid = (follow >= 0).unsqueeze(1) & (at < length.unsqueeze(1))
        drafts = tokens[rows.unsqueeze(1), at.clamp(0, width - 1)]
        return torch.where(valid, drafts, 0), valid


PROPOSERS = {"ngram": NgramProposer}
"""``--speculative-method`` name -> proposer class constructed without arguments (``draft`` and
``mtp`` need their models: `draft_model.DraftModelProposer`, `mtp.MTPProposer`)."""
