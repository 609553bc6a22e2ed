"""The device work of one step on the real model: the `StepRunner` the executor launches.

``stage`` (submitting thread) builds the step's transient uploads: the forward batch, the sampling
rows, the new sequences' parameters. ``run`` (backend compute context, in submission order):

1. write the step's new sequences into the sequence table;
2. resolve placeholders on the device: ``ids = where(ids == -1, last_token[seq_index], ids)``;
3. forward pass (fills the KV cache, logits ``[S, vocab]`` of the sampling rows);
3a. embedding rows only: add their tokens' final-normed hidden states, weighted, to their
   sequences' pooled sums (`SequenceTable.pooled`; the mean's weight is 1 / prompt length, the
   last token's 1), and copy the L2-normalised sum of each prompt that ends here into the slot;
3b. constrained rows only (structured output): mask their logits to what their grammar allows
   (`grammar.GrammarTable.mask_logits`, which waits for just those rows' previous tokens);
4. sample, gathering the rows' parameters from the sequence table;
5. scatter the sampled ids into ``last_token`` (and the presence mask), on the device;
6. copy the sampled ids (+ logprobs) into the step's slot-local host buffers (non-blocking).

With speculative decoding (``speculation``), steps 2, 4 and 5 are those of `speculation.verification`: each
decode row verifies the proposer's drafts in the same forward pass (on a CPU device, only the
entries of drafts the proposer made run) and emits 1 + accepted tokens, after which the proposer
follows the target's hidden states (`proposer.Proposer.follow`: the MTP module drafts there)
(a constrained row asks for no drafts: prepare plans it with none, so its one entry is masked as
in step 3b).

Nothing here synchronises with the host, except step 3b, on constrained rows only. ``observe``
(once the step's ids are on the host) advances the constrained rows' matchers.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from stageserve.device.backends import to_device
from stageserve.device.step_ticket import SlotBuffers, StepResult
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import ForwardBatch, build_forward_batch, row_token_starts
from stageserve.device.grammar import GrammarRows, GrammarTable
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.sampler import SampleResult, sample
from stageserve.device.sequence_table import SequenceTable, StagedStarts
from stageserve.device.speculation.proposer import ProposalStep
from stageserve.device.speculation.verification import Speculation, StagedSpeculation
from stageserve.device.step_plan import AdmittedStep
from stageserve.v1 import common_pb2


@dataclass
class StagedStep:
    """A step's transient uploads; alive until the step's completion has been observed.

    Attributes:
        admitted: the admitted step.
        batch: forward inputs on the device; ``None`` when the step has no rows.
        sampled: ``[2, S]`` int64: seq_index and output index of each sampling row; ``None`` if S = 0.
        placeholder_seq: ``[num_decode]`` int64 seq_index of the single-token rows, in the batch's
            decode order; ``None`` when the step has no placeholder.
        starts: the new sequences' table writes; ``None`` when none start.
        grammar: the constrained sampling rows; ``None`` when no row is constrained.
        speculation: the step's speculative bookkeeping (a speculating device), else ``None``.
        history_starts: the new sequences' prompts for the speculative token history, else ``None``.
        pooling: the embedding rows' pooling inputs, else ``None``.
    """

    admitted: AdmittedStep
    batch: ForwardBatch | None
    sampled: torch.Tensor | None
    placeholder_seq: torch.Tensor | None
    starts: StagedStarts | None
    grammar: GrammarRows | None = None
    speculation: StagedSpeculation | None = None
    history_starts: tuple | None = None
    pooling: StagedPooling | None = None


@dataclass
class StagedPooling:
    """What a step's embedding rows add to their sequences' pooled sums (step 3a).

    Attributes:
        token_index: ``[P]`` int64 tokens of the forward batch that are pooled.
        token_seq: ``[P]`` int64 the seq_index each belongs to.
        token_weight: ``[P]`` float32 its weight (1 / prompt length for a mean, 1 for the last token).
        output_seq: ``[E]`` int64 the sequences whose prompt ends in this step, in sampling-row
            order (their embeddings are the step's outputs); ``None`` when none ends.
    """

    token_index: torch.Tensor
    token_seq: torch.Tensor
    token_weight: torch.Tensor
    output_seq: torch.Tensor | None


class ModelStepRunner:
    """Runs steps of ``model`` over ``kv_cache``, keeping per-sequence state in ``table``, the
    constrained sequences' grammar state in ``grammar`` (``None``: constraints are not served); with
    ``speculation``, decode rows verify drafts (see the module docstring)."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, table: SequenceTable, grammar: GrammarTable | None = None,
                 speculation: Speculation | None = None) -> None:
        self.model, self.kv_cache, self.table, self.grammar, self.speculation = model, kv_cache, table, grammar, speculation
        self.device = model.device

    def stage(self, admitted: AdmittedStep) -> StagedStep:
        """Build the step's device inputs, right after ``SequenceTable.admit`` (its block tables are live)."""
        if self.speculation is not None:
            return self._stage_speculative(admitted)
        step = admitted.step
        batch = placeholder_seq = sampled = starts = None
        if step.seq_index:
            tokens, ends = step.token_ids, list(accumulate(step.num_tokens))
            rows = [
                (tokens[end - n : end], start_pos, table, sample)
                for n, end, start_pos, table, sample in zip(step.num_tokens, ends, step.start_pos, admitted.block_tables, step.sample)
            ]
            batch = build_forward_batch(rows, self.table.block_size, self.device)
            if step.has_placeholder:
                # ForwardBatch puts single-token rows first, in row order.
                placeholder_seq = to_device([s for s, n in zip(step.seq_index, step.num_tokens) if n == 1], torch.int64, self.device)
        if step.sampled_seq_index:
            sampled = to_device([step.sampled_seq_index, admitted.sampled_step_index], torch.int64, self.device)
        if step.started:
            starts = self.table.stage_starts(step.started)
        pooling = self._stage_pooling(admitted) if admitted.pooling else None
        return StagedStep(admitted, batch, sampled, placeholder_seq, starts, self._stage_grammar(step), pooling=pooling)

    def _stage_pooling(self, admitted: AdmittedStep) -> StagedPooling:
        step, index, seqs, weights, outputs = admitted.step, [], [], [], []
        starts = row_token_starts(step.num_tokens)
        for pooling in admitted.pooling:
            seq, start, n = step.seq_index[pooling.row], starts[pooling.row], step.num_tokens[pooling.row]
            if pooling.kind == common_pb2.POOLING_MEAN:
                index += range(start, start + n)
                weights += [1.0 / pooling.prompt_len] * n
                seqs += [seq] * n
            elif pooling.output is not None:  # the last token: that of the prompt's last chunk
                index.append(start + n - 1)
                weights.append(1.0)
                seqs.append(seq)
            if pooling.output is not None:
                outputs.append(seq)
        device = self.device
        return StagedPooling(to_device(index, torch.int64, device), to_device(seqs, torch.int64, device),
                             to_device(weights, torch.float32, device), to_device(outputs, torch.int64, device) if outputs else None)

    def _stage_grammar(self, step) -> GrammarRows | None:
        return self.grammar.stage(step) if self.grammar is not None else None

    def _stage_speculative(self, admitted: AdmittedStep) -> StagedStep:
        step, speculation = admitted.step, self.speculation
        batch = staged = starts = history_starts = None
        if step.seq_index:
            rows, staged = speculation.stage_rows(admitted)
            batch = build_forward_batch(rows, self.table.block_size, self.device)
        if step.started:
            starts = self.table.stage_starts(step.started)
            history_starts = speculation.history.stage_starts(step.started)
        return StagedStep(admitted, batch, None, None, starts, self._stage_grammar(step), staged, history_starts)

    def run(self, staged: StagedStep, out: SlotBuffers) -> None:
        """Enqueue the step's device work (see the module docstring); no host synchronisation."""
        table = self.table
        if staged.starts is not None:
            table.apply_starts(staged.starts)
        if staged.history_starts is not None:
            self.speculation.history.apply_starts(staged.history_starts)
        if staged.batch is None:
            return
        if staged.speculation is not None:
            self._run_speculative(staged, out)
            return
        batch = staged.batch
        if staged.placeholder_seq is not None:
            ids = batch.input_ids[: batch.num_decode]  # [Bd]
            ids.copy_(torch.where(ids < 0, table.last_token[staged.placeholder_seq], ids))
        if staged.pooling is None:
            logits = self.model.forward(batch, self.kv_cache)  # [S, vocab], the activation dtype
        else:
            hidden = self.model.hidden_states(batch, self.kv_cache)  # [T, hidden]
            logits = self.model.logits(batch.sampled_rows(hidden))
            self._pool(staged.pooling, hidden, out)
        if staged.sampled is None:
            return
        if staged.grammar is not None:
            self.grammar.mask_logits(staged.grammar, logits)
        rows, step_index = staged.sampled[0], staged.sampled[1]
        tensors = table.sampling_tensors(staged.admitted, rows, step_index)
        result = sample(logits, tensors, table.presence[rows] if tensors.any_penalty else None, fused_argmax=self.model.cpu_kernels)
        table.record_sampled(rows, result.token_ids, tensors)
        count = rows.shape[0]
        out.token_ids[:count].copy_(result.token_ids, non_blocking=True)
        _copy_logprobs(result, tensors.max_logprobs, count, out)

    def _pool(self, pooling: StagedPooling, hidden: torch.Tensor, out: SlotBuffers) -> None:
        """Step 3a: add the pooled tokens to their sums; copy the embeddings that are complete out."""
        pooled = self.table.pooled
        normed = self.model.final_norm(hidden[pooling.token_index]).float()  # [P, hidden]
        pooled.index_add_(0, pooling.token_seq, normed * pooling.token_weight[:, None])
        if pooling.output_seq is not None:
            out.embeddings[: pooling.output_seq.shape[0]].copy_(F.normalize(pooled[pooling.output_seq], dim=-1), non_blocking=True)

    def observe(self, staged: StagedStep, result: StepResult | None) -> dict[int, str]:
        """Advance the constrained rows' matchers by each row's first token (`GrammarTable.observe`,
        `StepResult.first_tokens`); ``{row: error}``. A step without constrained rows costs nothing."""
        if staged.grammar is None:
            return {}
        return self.grammar.observe(staged.grammar, None if result is None else result.first_tokens())

    def _run_speculative(self, staged: StagedStep, out: SlotBuffers) -> None:
        """Draft, verify in one forward pass, sample every entry, accept, copy out (`speculation.verification`)."""
        table, speculation, spec, batch = self.table, self.speculation, staged.speculation, staged.batch
        drafts, valid = speculation.fill_inputs(spec, batch, table.last_token)
        forward, kept = speculation.without_unproposed(spec, batch, valid)
        hidden = self.model.hidden_states(forward, self.kv_cache)  # [T', hidden]: the entries run
        logits = self.model.logits(forward.sampled_rows(hidden))  # [S', vocab]
        entries, rows = spec.sample_seq, spec.row_seq
        proposal = ProposalStep(forward, spec.proposer_inputs)
        if entries.numel() == 0:
            speculation.proposer.follow(speculation.history, proposal, hidden, entries)
            return
        output_index = speculation.output_index(spec, batch)
        if kept is not None:
            entries, output_index = entries[kept], output_index[kept]
        if staged.grammar is not None:  # a constrained row has no drafts: one entry, at its row's first
            first_entry = list(accumulate([0, *(1 + k for k in staged.admitted.step.sampled_num_drafts)]))
            at = [first_entry[row] for row in staged.grammar.rows]
            if kept is not None:  # where each (kept: a row's first entry always runs) sits among the entries run
                at = torch.searchsorted(kept, torch.tensor(at, dtype=torch.int64)).tolist()
            self.grammar.mask_logits(staged.grammar, logits, at)
        tensors = table.sampling_tensors(staged.admitted, entries, output_index)
        result = sample(logits, tensors, table.presence[entries] if tensors.any_penalty else None, fused_argmax=self.model.cpu_kernels)
        count, num_rows = spec.sample_seq.shape[0], rows.shape[0]
        sampled = result.token_ids
        if kept is not None:  # a dropped entry's token is never emitted (its row's accepted run ends before it)
            sampled = torch.zeros(count, dtype=torch.int64).index_copy_(0, kept, sampled)
        verified = speculation.verify(spec, batch, sampled, drafts, valid)
        # A row's pending entry always ran (a draft accepted was proposed), so it has a place in ``forward``.
        pending = verified.pending_entry if kept is None else torch.searchsorted(kept, verified.pending_entry)
        speculation.proposer.follow(speculation.history, proposal, hidden, forward.sample_indices[pending])
        table.record_sampled(rows, verified.last_token, tensors)  # penalised rows never draft: one token each
        out.token_ids[:count].copy_(sampled, non_blocking=True)
        out.num_tokens[:num_rows].copy_(verified.num_tokens, non_blocking=True)
        out.num_drafted[:num_rows].copy_(verified.num_drafted, non_blocking=True)
        _copy_logprobs(result, tensors.max_logprobs, count, out, kept)


def _copy_logprobs(result: SampleResult, top: int, count: int, out: SlotBuffers, kept: torch.Tensor | None = None) -> None:
    """Copy the first ``count`` rows' logprobs (when computed) into the slot's host buffers, non-blocking;
    with ``kept`` (a CPU step that ran only some entries), ``result``'s rows go to rows ``kept``."""
    if result.logprobs is None:
        return
    if kept is None:
        out.logprobs[:count].copy_(result.logprobs, non_blocking=True)
        out.top_token_ids[:count, :top].copy_(result.top_ids, non_blocking=True)
        out.top_logprobs[:count, :top].copy_(result.top_logprobs, non_blocking=True)
    else:
        out.logprobs[kept] = result.logprobs
        out.top_token_ids[kept, :top] = result.top_ids
        out.top_logprobs[kept, :top] = result.top_logprobs
