"""The multi-token-prediction proposer: the checkpoint's own MTP module (DeepSeek-V3 technical report
§2.2, ``num_nextn_predict_layers``) drafts, on the device, conditioned on the target's hidden states.

The module (the first of the checkpoint's MTP layers, ``model.layers.{num_hidden_layers}.*``, as
vLLM's ``deepseek_mtp.py`` reads it) maps the target's hidden state ``h`` at one position and the
embedding of the token at the next one to a hidden state predicting the token after that::

    x  = eh_proj(cat(enorm(embed(token)), hnorm(h)))     # [hidden]: the embedding half first
    h' = block(x)                                         # one decoder layer (MLA and its MLP)
    logits = shared_head.head(shared_head.norm(h'))

``h`` is the target's final-normed hidden state (what vLLM's DeepSeek model hands its MTP module).
Drafts beyond the first chain the module on its own output: ``h'`` and the draft it predicted give
the next draft (vLLM's ``num_speculative_tokens`` > ``num_nextn_predict_layers``).

The block has a paged KV pool of its own, with the target's block count and size and indexed by
the same block tables and slots (plus one scratch block), as the draft model's. Its entry at
position ``q`` is the module's input there: ``(h_{q-1}, token_q)``, so it depends on the tokens up to
``q`` only and a prefix-cache block holds the module's KV of its tokens as it does the target's.
(vLLM stores ``(h_q, token_{q+1})`` at ``q``; the attention sees the same pairs at relative
positions one apart either way, plus here one entry at position 0 of a zero ``h``.)

Per step, `follow` runs after the target's forward pass and verification, in the step's device
work (no host synchronisation):

1. one forward of the module over every token of the step's batch, each with the target's hidden
   state of the position before it (the previous token of its row, else the sequence's last one
   kept from an earlier step, zero at position 0 and on a prefix-cache hit): the module's KV of
   the step's tokens. Entries past a row's accepted run write KV that the next step writes again
   before it is read, as the target's;
2. for each sampling row, the module at its new pending token (``h`` of the entry that sampled it),
   then ``K - 1`` chained passes: the row's ``K`` drafts for the next step, kept per sequence. Their
   KV lands at positions the next step's first pass writes again (or in the scratch block, past
   the row's block table).

`propose`, in the next step before the target's forward pass, only reads the kept drafts: every
draft a row asks for is proposed. The drafts are argmaxes, a point-mass draft distribution, so the
acceptance rule of `verification` stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stageserve.device.backends import to_device
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.linear import Linear
from stageserve.device.model.weights import load_mtp_weights
from stageserve.device.speculation.proposer import ProposalStep, StepLayout, TokenHistory, greedy_drafts, no_drafts


@dataclass
class StagedMTP:
    """One step's uploads for the MTP module (tensors on the device).

    Attributes:
        token_seq: ``[T]`` int64 seq_index of each batch token.
        row_first: ``[B]`` int64 batch index of each row's first token; ``row_last``: ``[B]`` its last.
        row_seq: ``[B]`` int64 each row's seq_index; ``row_started``: ``[B]`` bool, started in this step.
        draft_limit: ``[Rd]`` int64 drafts each decode row asks for.
        sample_seq: ``[Rs]`` int64 seq_index of each sampling row.
        sample_blocks: ``[Rs, W]`` int64 the sampling rows' block tables, padded with block 0;
            ``sample_capacity``: ``[Rs]`` int64 the positions they cover.
    """

    token_seq: torch.Tensor
    row_first: torch.Tensor
    row_last: torch.Tensor
    row_seq: torch.Tensor
    row_started: torch.Tensor
    draft_limit: torch.Tensor
    sample_seq: torch.Tensor
    sample_blocks: torch.Tensor
    sample_capacity: torch.Tensor


class MTPModule:
    """A checkpoint's MTP layer on the device: ``block``, the layer as a one-layer `DecoderModel`
    (its embedding, ``shared_head.norm`` as its final norm, ``shared_head.head``), and its input
    projection.

    Args:
        block: the layer (``weights.load_mtp_weights``' names).
        enorm, hnorm: ``[hidden]`` RMSNorm weights; eh_proj: ``[hidden, 2 * hidden]``; any float dtype.
    """

    def __init__(self, block: DecoderModel, enorm: torch.Tensor, hnorm: torch.Tensor, eh_proj: torch.Tensor) -> None:
        self.block, self.config = block, block.config
        device, dtype = block.device, block.dtype
        self.enorm, self.hnorm = enorm.to(device, dtype), hnorm.to(device, dtype)
        self.eh_proj = Linear(eh_proj.to(device, dtype), None)

    @classmethod
    def from_path(cls, path: Path, dtype: torch.dtype, device: torch.device, cpu_kernels_allowed: bool = True) -> MTPModule:
        """The first MTP layer of the Hugging Face directory ``path`` (raises ``ModelLoadError`` for a
        checkpoint without one, saying what to use instead)."""
        config, weights = load_mtp_weights(path, dtype)
        enorm, hnorm, eh_proj = (weights.pop(f"mtp.{name}.weight") for name in ("enorm", "hnorm", "eh_proj"))
        return cls(DecoderModel(config, weights, device, cpu_kernels_allowed), enorm, hnorm, eh_proj)

    def inputs(self, token: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The block's input ``eh_proj(cat(enorm(embed(token)), hnorm(h)))`` ``[R, hidden]`` of tokens
        ``[R]`` int64 and hidden states ``[R, hidden]``."""
        eps, shape = self.config.rms_norm_eps, (self.config.hidden_size,)
        embedded = F.rms_norm(self.block.embed_tokens(token), shape, self.enorm, eps)
        return self.eh_proj(torch.cat([embedded, F.rms_norm(h.to(embedded.dtype), shape, self.hnorm, eps)], dim=1))


class MTPProposer:
    """Drafts ``num_drafts`` tokens per row with ``module`` over its own KV pool of ``num_blocks``
    (+ 1 scratch) blocks of ``block_size`` tokens in ``dtype`` (see the module docstring).

    Args:
        target: the served model (its final norm gives the module's ``h``).
        module: the checkpoint's MTP layer.
        max_num_seqs: N, the sequence table size.
    """

    def __init__(self, target: DecoderModel, module: MTPModule, num_drafts: int, max_num_seqs: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> None:
        device = module.block.device
        self.target, self.module, self.block_size, self.num_drafts = target, module, block_size, num_drafts
        self.kv_cache = PagedKVCache(module.config, num_blocks + 1, block_size, dtype, device)
        self.scratch_slot = num_blocks * block_size  # the first slot of the scratch block
        self.vocab_size = min(target.config.vocab_size, module.config.vocab_size)
        hidden = module.config.hidden_size
        self.last_hidden = torch.zeros(max_num_seqs, hidden, dtype=dtype, device=device)  # the target's h at each sequence's last position run
        self.drafts = torch.zeros(max_num_seqs, num_drafts, dtype=torch.int64, device=device)  # the next step's drafts per sequence

    def stage(self, layout: StepLayout) -> StagedMTP:
        """See `proposer.Proposer.stage`."""
        device = self.module.block.device

        def up(values, dtype=torch.int64) -> torch.Tensor:
            return to_device(list(values), dtype, device)

        tables = [layout.block_tables[row] for row in layout.sample_rows]
        width = max((len(t) for t in tables), default=0)
        row_seq = [layout.token_seq[first] for first in layout.row_first]
        return StagedMTP(
            token_seq=up(layout.token_seq), row_first=up(layout.row_first), row_last=up(layout.row_last), row_seq=up(row_seq),
            row_started=up(layout.row_started, torch.bool), draft_limit=up(layout.draft_limit),
            sample_seq=up(row_seq[row] for row in layout.sample_rows),
            sample_blocks=(up(b for t in tables for b in t + [0] * (width - len(t))).view(len(tables), width)),
            sample_capacity=up(len(t) * self.block_size for t in tables),
        )

    def propose(self, history: TokenHistory, seq_index: torch.Tensor, num_drafts: int, max_length: int,
                step: ProposalStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See `proposer.Proposer.propose`: the drafts the previous step's `follow` kept, every one asked valid."""
        if num_drafts == 0:
            return no_drafts(seq_index.shape[0], seq_index.device)
        valid = torch.arange(num_drafts, device=seq_index.device) < step.staged.draft_limit.unsqueeze(1)
        return self.drafts[seq_index, :num_drafts], valid

    def follow(self, history: TokenHistory, step: ProposalStep, hidden: torch.Tensor, pending_entry: torch.Tensor) -> None:
        """See `proposer.Proposer.follow` and the module docstring: the module's KV of the step's
        tokens, then the next step's drafts of each sampling row."""
        staged, batch = step.staged, step.batch
        if batch.input_ids.numel() == 0:
            return
        h = self.target.final_norm(hidden)  # [T, hidden]
        # The hidden state before each token: its row's previous token, else its sequence's last one run.
        before = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]])
        # Zero for a new sequence (after a prefix-cache hit the cached positions did not run) and at
        # position 0; torch.where, not a boolean index, which would wait for the device on CUDA/NPU.
        before[staged.row_first] = torch.where(staged.row_started.unsqueeze(1), 0.0, self.last_hidden[staged.row_seq])
        before = torch.where((batch.positions == 0).unsqueeze(1), 0.0, before)
        self.module.block.layers_of(self.module.inputs(batch.input_ids, before), batch, self.kv_cache)  # for its KV writes
        self.last_hidden[staged.row_seq] = h[staged.row_last]
        if pending_entry.numel() == 0:
            return
        self.last_hidden[staged.sample_seq] = h[pending_entry]
        token = history.tokens[staged.sample_seq, batch.positions[pending_entry] + 1]  # [Rs], the new pending tokens
        position = batch.positions[pending_entry] + 1
        state = h[pending_entry]
        for j in range(self.num_drafts):
            state = self.module.block.layers_of(self.module.inputs(token, state), self._single(position, staged), self.kv_cache)
            token = greedy_drafts(self.module.block.logits(state), self.vocab_size, self.module.block.cpu_kernels)
            self.drafts[staged.sample_seq, j] = token
            position = position + 1

    def _single(self, position: torch.Tensor, staged: StagedMTP) -> ForwardBatch:
        """Single-token rows of the sampling rows at ``position`` ``[Rs]`` int64 over their block
        tables; a position past a row's table writes to the scratch block (and is not attended)."""
        blocks, bs = staged.sample_blocks, self.block_size
        inside = position < staged.sample_capacity
        at = (position // bs).clamp(max=blocks.shape[1] - 1).unsqueeze(1)
        slots = torch.where(inside, blocks.gather(1, at).squeeze(1) * bs + position % bs, self.scratch_slot)
        span = torch.arange(blocks.shape[1] * bs, device=position.device)
        mask = (span <= position.unsqueeze(1)) & (span < staged.sample_capacity.unsqueeze(1))
        rows = position.shape[0]
        return ForwardBatch(torch.zeros(rows, dtype=torch.int64, device=position.device), position, slots, rows, blocks, mask, [],
                            torch.arange(rows, device=position.device))
