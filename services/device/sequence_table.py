"""Per-sequence state of the device, indexed by ``seq_index`` in ``[0, max_num_seqs)``.

Two halves with different owners:

- Host metadata, read and written only by the submitting thread at submit time (`admit`, which
  returns the step as an `AdmittedStep`):
  generation, "started and not finished", "a sampling row has been submitted" (so a placeholder
  can be resolved), block tables, how many live block tables hold each KV block, how many tokens
  each sequence has sampled, and per-sequence sampling stage flags. `admit` checks a step against
  it and commits the step atomically.

Ownership: the device accepts from its prepare only what that prepare itself set up. A row names a
sequence started on this stream with its current generation; a ``SequenceStart`` names a free
index; and a row *writes* (positions ``start_pos .. start_pos + num_tokens - 1``) only KV blocks
no other live sequence holds. Blocks shared by the prefix cache are held by several sequences but
only read: their writer finished them before they were shared. A block freed by a sequence listed
in the same plan's ``finished`` counts as free (prepare hands it on in that plan), and so does a
block a sliding window left behind (``released``: the table keeps the entry, pointing at
`RELEASED_BLOCK`; no row may write it again).
- Device tensors, written only inside a step's device work (stream order, or the CPU compute
  thread), so a write never races a step still in flight: the last sampled token per sequence,
  the sampling parameters packed as ``[fields, N]`` tensors (a step's `SamplingTensors` is one
  gather per dtype), the repetition-penalty presence mask, and each embedding sequence's pooled
  hidden state so far (its prompt may span several prefill chunks).

A new prepare stream calls `reset`: only host metadata is cleared; device values of a sequence
are never read before that sequence's `SequenceStart` (and, for the last token, its first
sampling row) has rewritten them. The ``[N, V]`` tables (presence, output counts, logit bias:
9 bytes per sequence and vocabulary entry, 108 MiB for 256 sequences of a 49k vocabulary) are the
exception: a start rewrites its row only where its parameters use the table (or, for the
logit bias, where an earlier sequence left one), and on the CPU they lie in memory maps
(`zeroed_pool`), so only the rows of requests that asked for penalties or biases hold memory. A
row nobody rewrote is still read harmlessly: a repetition penalty of 1 and presence/frequency
penalties of 0 leave every logit as it is whatever presence and counts say, and a bias row is
zero unless its sequence set one (`_biased_rows`, which outlives `reset` as the values do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import or_

import torch

from stageserve.device.backends import to_device
from stageserve.device.model.kv_cache import zeroed_pool
from stageserve.device.sampler import SamplingTensors
from stageserve.device.step_plan import AdmittedStep, PlanError, RowPooling, StartedSequence, Step
from stageserve.sampling_rules import is_greedy, seed_as_int64
from stageserve.v1 import common_pb2

# Per-sequence sampling stage bits; OR-ed over a step's sampling rows into its host flags.
_SAMPLED = 1  # not greedy
_TOP_K = 2  # not greedy and top_k > 0
_TOP_P = 4  # not greedy and top_p < 1
_MIN_P = 8  # not greedy and min_p > 0
_PENALTY = 16  # repetition_penalty != 1
_ADDITIVE = 32  # presence_penalty or frequency_penalty != 0 (needs the output counts)
_BIAS = 64  # a logit_bias

_POOLINGS = (common_pb2.POOLING_MEAN, common_pb2.POOLING_LAST)  # what `ModelStepRunner` pools by

RELEASED_BLOCK = 0
"""Where a released block-table entry points: block 0, like the padding of a step's decode tables
(`forward_batch`), which the torch path reads only under a mask and the fused kernel not at all
(its window starts after every released entry)."""


@dataclass
class StagedStarts:
    """Device tensors that write a step's new sequences into the table (built at stage time).

    Attributes:
        seq_index: ``[k]`` int64.
        floats: ``[6, k]`` float32: temperature (0 when greedy), top_p, min_p, repetition_penalty,
            presence_penalty, frequency_penalty.
        ints: ``[2, k]`` int64: top_k, seed (uint64 bits as int64).
        clear_presence, clear_counts, clear_bias: ``[r]`` int64 rows of the ``[N, V]`` tables to zero
            first (sequences with a repetition penalty; with a presence or frequency penalty; with a
            logit bias or in a row an earlier one biased); ``None`` when there are none.
        presence_rows, presence_tokens: ``[P]`` int64 coordinates of prompt tokens of sequences
            with a repetition penalty; ``None`` when there are none.
        bias_rows, bias_tokens, bias_values: ``[B]`` int64, int64, float32 entries of the
            sequences' logit biases; ``None`` when there are none.
        count_rows, count_tokens: ``[C]`` int64 coordinates of the earlier output of resumed
            sequences with a presence or frequency penalty (counted as output); ``None`` when none.
    """

    seq_index: torch.Tensor
    floats: torch.Tensor
    ints: torch.Tensor
    clear_presence: torch.Tensor | None
    clear_counts: torch.Tensor | None
    clear_bias: torch.Tensor | None
    presence_rows: torch.Tensor | None
    presence_tokens: torch.Tensor | None
    bias_rows: torch.Tensor | None
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    count_rows: torch.Tensor | None = None
    count_tokens: torch.Tensor | None = None


class SequenceTable:
    """Host metadata and device tensors of ``max_num_seqs`` sequences.

    Args:
        max_num_seqs: table size N.
        vocab_size: V, width of the presence mask.
        block_size: tokens per KV block (for the block-table capacity check).
        device: where the device tensors live.
        hidden_size: the model's hidden size, the width of ``pooled`` (0: the device does not embed).
    """

    def __init__(self, max_num_seqs: int, vocab_size: int, block_size: int, device: torch.device, hidden_size: int = 0) -> None:
        n, device = max_num_seqs, torch.device(device)
        self.max_num_seqs, self.vocab_size, self.block_size, self.device = n, vocab_size, block_size, device
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.floats = torch.ones(6, n, dtype=torch.float32, device=device)  # [6, N], see StagedStarts
        self.ints = torch.zeros(2, n, dtype=torch.int64, device=device)  # [2, N]
        self.presence = zeroed_pool((n, vocab_size), torch.bool, device)  # [N, V]
        # OpenAI's penalties and logit bias; float32 so that sampling reads them without a cast.
        self.output_counts = zeroed_pool((n, vocab_size), torch.float32, device)  # [N, V]
        self.logit_bias = zeroed_pool((n, vocab_size), torch.float32, device)  # [N, V]
        self._biased_rows: set[int] = set()  # rows of logit_bias that may be non-zero (stage time)
        # Embeddings: the weighted sum of each embedding sequence's final-normed hidden states so far.
        self.pooled = torch.zeros(n, hidden_size, dtype=torch.float32, device=device) if hidden_size else None  # [N, hidden]
        self.reset()

    def reset(self) -> None:
        """Forget every sequence (host metadata only; see the module docstring)."""
        n = self.max_num_seqs
        self._generation = [0] * n
        self._active = [False] * n
        self._has_token = [False] * n
        self._block_tables: list[list[int]] = [[] for _ in range(n)]
        self._holders: dict[int, int] = {}  # KV block id -> live block tables holding it
        self._num_released = [0] * n  # per table, the entries [0, n) released (`RELEASED_BLOCK`)
        self._num_sampled = [0] * n
        self._flags = [0] * n
        self._top_logprobs = [0] * n
        self._pooling = [common_pb2.POOLING_NONE] * n
        self._prompt_len = [0] * n
        self._num_pooling = 0  # live embedding sequences: a step without any skips their bookkeeping

    def active_count(self) -> int:
        """Sequences started and not finished."""
        return sum(self._active)

    # ---- host: submit time ---------------------------------------------------------------------

    def admit(self, step: Step) -> AdmittedStep:
        """Check ``step`` against the table, then commit it; nothing changes when it is refused.

        Returns the step with what the table adds (block tables, per-row logprobs and output
        index, sampling stage flags). The block tables handed out are live lists: consume them
        (build the forward batch) before admitting the next step.

        Raises:
            PlanError: a row names a sequence that is not started or with a stale generation, a
                placeholder has no sampled token to stand for (or sits in a multi-token row), a
                block table is too short for the row's tokens, a start names a live sequence, or a
                row writes a KV block another live sequence holds or a released entry, or a
                release names a sequence that is not live (or is finished in the step) or more
                entries than its table has. The message names row and field.
        """
        self._check(step)
        return self._commit(step)

    def _check(self, step: Step) -> None:
        started = {s.seq_index: s for s in step.started}
        for seq, start in started.items():
            if self._active[seq]:
                raise PlanError(f"step {step.step_id}: started[seq_index={seq}]: the sequence is live; list it in finished first")
            if start.pooling != common_pb2.POOLING_NONE and (self.pooled is None or start.pooling not in _POOLINGS):
                served = ", ".join(map(common_pb2.Pooling.Name, _POOLINGS)) if self.pooled is not None else "none: it does not embed"
                raise PlanError(f"step {step.step_id}: started[seq_index={seq}]: pooling {start.pooling} is not served here (served: {served})")
        token_ids, num_tokens, num_new_blocks = step.token_ids, step.num_tokens, step.num_new_blocks
        offset = 0
        for row, (seq, generation) in enumerate(zip(step.seq_index, step.generation)):
            where = f"step {step.step_id} row {row} (seq_index {seq})"
            start = started.get(seq)
            if start is not None:
                current, has_token, blocks = start.generation, False, 0
            elif self._active[seq]:
                current, has_token, blocks = self._generation[seq], self._has_token[seq], len(self._block_tables[seq])
            else:
                raise PlanError(f"{where}: sequence is not started; send its SequenceStart in started first")
            if generation != current:
                raise PlanError(f"{where}: generation {generation} is stale; the sequence's generation is {current}")
            n, drafts = num_tokens[row], step.num_draft_tokens[row] if step.num_draft_tokens else 0
            if step.has_placeholder:
                if n == 1 + drafts:
                    if token_ids[offset] == -1 and not has_token:
                        raise PlanError(f"{where}: token_ids placeholder -1 but no token has been sampled for this sequence yet")
                elif -1 in token_ids[offset : offset + n]:
                    raise PlanError(f"{where}: placeholder -1 is only allowed in single-token (decode) rows, or in rows of 1 + num_draft_tokens placeholders")
            if drafts and start is None and self._flags[seq] & (_PENALTY | _ADDITIVE):
                raise PlanError(f"{where}: num_draft_tokens must be 0 for a sequence with a repetition, presence or frequency penalty")
            if (blocks + num_new_blocks[row]) * self.block_size < step.start_pos[row] + n:
                raise PlanError(
                    f"{where}: block table of {blocks + num_new_blocks[row]} blocks cannot hold "
                    f"start_pos + num_tokens = {step.start_pos[row] + n} tokens; append blocks with new_block_ids"
                )
            offset += n
        finished = set(step.finished)
        for seq, count in step.released:
            if not self._active[seq] or seq in started or seq in finished:
                raise PlanError(f"step {step.step_id}: released_seq_index {seq} names no live sequence of an earlier step, or one finished in this step")
            if count > len(self._block_tables[seq]):
                raise PlanError(f"step {step.step_id}: released_num_blocks {count} for seq_index {seq} exceeds its block table of {len(self._block_tables[seq])} blocks")
        self._check_writes(step, set(started))

    def _check_writes(self, step: Step, started: set[int]) -> None:
        """Refuse a row that writes a KV block another live sequence holds (see the module docstring)."""
        appended: dict[int, int] = {}  # block -> times this step appends it
        for block in step.new_block_ids:
            appended[block] = appended.get(block, 0) + 1
        released: dict[int, int] = {}  # block -> tables of this step's finished sequences (without rows) or releases letting it go
        for seq in set(step.finished).difference(step.seq_index):
            if self._active[seq]:
                for block in self._block_tables[seq][self._num_released[seq] :]:
                    released[block] = released.get(block, 0) + 1
        num_released = {}  # seq -> its table's released entries once this step's releases apply
        for seq, count in step.released:
            num_released[seq] = max(count, self._num_released[seq])
            for block in self._block_tables[seq][self._num_released[seq] : count]:
                released[block] = released.get(block, 0) + 1
        offset, holders, size = 0, self._holders, self.block_size
        for row, seq in enumerate(step.seq_index):
            table = () if seq in started else self._block_tables[seq]
            new = step.new_block_ids[offset : offset + step.num_new_blocks[row]]
            offset += len(new)
            start = step.start_pos[row]
            if start // size < num_released.get(seq, self._num_released[seq]):
                raise PlanError(f"step {step.step_id} row {row} (seq_index {seq}): start_pos {start} writes a released block-table entry")
            for index in range(start // size, (start + step.num_tokens[row] - 1) // size + 1):  # the blocks the row writes
                block = table[index] if index < len(table) else new[index - len(table)]
                if holders.get(block, 0) + appended.get(block, 0) - released.get(block, 0) > 1:
                    raise PlanError(f"step {step.step_id} row {row} (seq_index {seq}): writes KV block {block}, which another live"
                                    " sequence holds; give the row a block of its own")

    def _commit(self, step: Step) -> AdmittedStep:
        for start in step.started:
            self._start(start)
        tables, new_blocks = self._block_tables, step.new_block_ids
        offset = 0
        holders = self._holders
        for seq, count in step.released:
            first = self._num_released[seq]
            if count > first:
                self._drop_holds(tables[seq][first:count])
                tables[seq][first:count] = [RELEASED_BLOCK] * (count - first)
                self._num_released[seq] = count
        for seq, count in zip(step.seq_index, step.num_new_blocks):
            if count:
                tables[seq].extend(new_blocks[offset : offset + count])
                offset += count
        for block in new_blocks:
            holders[block] = holders.get(block, 0) + 1
        sampled = step.sampled_seq_index
        admitted = AdmittedStep(
            step=step,
            block_tables=[tables[seq] for seq in step.seq_index],
            sampled_top_logprobs=[self._top_logprobs[seq] for seq in sampled],
            sampled_step_index=[self._num_sampled[seq] for seq in sampled],
            sampling_flags=reduce(or_, [self._flags[seq] for seq in sampled], 0),
            pooling=self._row_pooling(step) if self._num_pooling else (),
        )
        for seq in sampled:
            self._has_token[seq] = True
            self._num_sampled[seq] += 1
        for seq in step.finished:
            if self._active[seq]:
                self._drop_holds(tables[seq][self._num_released[seq] :])
                self._num_pooling -= self._pooling[seq] != common_pb2.POOLING_NONE
            self._active[seq] = False
            tables[seq] = []  # a new list: rows of this step keep the old one
        return admitted

    def _drop_holds(self, blocks: list[int]) -> None:
        """One live table fewer holds each of ``blocks``."""
        holders = self._holders
        for block in blocks:
            if holders[block] == 1:
                del holders[block]
            else:
                holders[block] -= 1

    def _row_pooling(self, step: Step) -> tuple[RowPooling, ...]:
        """The step's rows of embedding sequences (`AdmittedStep.pooling`)."""
        rows, output = [], 0
        for row, (seq, sample) in enumerate(zip(step.seq_index, step.sample)):
            if self._pooling[seq] != common_pb2.POOLING_NONE:
                rows.append(RowPooling(row, self._pooling[seq], self._prompt_len[seq], output if sample else None))
            output += sample
        return tuple(rows)

    def _start(self, start: StartedSequence) -> None:
        seq, params = start.seq_index, start.sampling
        self._pooling[seq], self._prompt_len[seq] = start.pooling, len(start.prompt_token_ids)
        self._num_pooling += start.pooling != common_pb2.POOLING_NONE
        self._generation[seq] = start.generation
        self._active[seq] = True
        self._has_token[seq] = False
        self._block_tables[seq] = []  # the index was free (`_check`): its old table's blocks are released
        self._num_released[seq] = 0
        self._num_sampled[seq] = start.output_offset  # a resumed sequence's draws go on where they were
        self._top_logprobs[seq] = params.logprobs
        greedy = is_greedy(params.temperature, params.top_k)
        flags = _PENALTY if params.repetition_penalty != 1.0 else 0
        flags |= _ADDITIVE if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 else 0
        flags |= _BIAS if params.logit_bias else 0
        if not greedy:
            flags |= _SAMPLED
            flags |= _TOP_K if params.top_k > 0 else 0
            flags |= _TOP_P if params.top_p < 1.0 else 0
            flags |= _MIN_P if params.min_p > 0.0 else 0
        self._flags[seq] = flags

    # ---- device: stage time (uploads) and step time (stream order) -----------------------------

    def stage_starts(self, started: list[StartedSequence]) -> StagedStarts:
        """Upload the parameters and prompt presence of ``started`` (non-empty) to the device."""
        floats, ints, rows, tokens = [[] for _ in range(6)], [[], []], [], []
        bias_rows, bias_tokens, bias_values, count_rows, count_tokens = [], [], [], [], []
        clear_presence, clear_counts, clear_bias = [], [], []
        for start in started:
            p = start.sampling
            if p.repetition_penalty != 1.0:
                clear_presence.append(start.seq_index)
            if p.presence_penalty or p.frequency_penalty:
                clear_counts.append(start.seq_index)
            if p.logit_bias or start.seq_index in self._biased_rows:
                clear_bias.append(start.seq_index)
            if p.logit_bias:
                self._biased_rows.add(start.seq_index)
            else:
                self._biased_rows.discard(start.seq_index)
            greedy = is_greedy(p.temperature, p.top_k)
            values = (0.0 if greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            for column, value in zip(floats, values):
                column.append(value)
            for token_id, bias in p.logit_bias.items():
                bias_rows.append(start.seq_index)
                bias_tokens.append(token_id)
                bias_values.append(bias)
            ints[0].append(p.top_k)
            ints[1].append(seed_as_int64(p.seed))
            if p.repetition_penalty != 1.0 and start.prompt_token_ids:
                rows += [start.seq_index] * len(start.prompt_token_ids)
                tokens += start.prompt_token_ids
            if start.output_offset and (p.presence_penalty or p.frequency_penalty):
                count_rows += [start.seq_index] * start.output_offset
                count_tokens += start.prompt_token_ids[-start.output_offset:]
        device = self.device
        return StagedStarts(
            seq_index=to_device([s.seq_index for s in started], torch.int64, device),
            floats=to_device(floats, torch.float32, device),
            ints=to_device(ints, torch.int64, device),
            clear_presence=to_device(clear_presence, torch.int64, device) if clear_presence else None,
            clear_counts=to_device(clear_counts, torch.int64, device) if clear_counts else None,
            clear_bias=to_device(clear_bias, torch.int64, device) if clear_bias else None,
            presence_rows=to_device(rows, torch.int64, device) if rows else None,
            presence_tokens=to_device(tokens, torch.int64, device) if tokens else None,
            bias_rows=to_device(bias_rows, torch.int64, device) if bias_rows else None,
            bias_tokens=to_device(bias_tokens, torch.int64, device) if bias_rows else None,
            bias_values=to_device(bias_values, torch.float32, device) if bias_rows else None,
            count_rows=to_device(count_rows, torch.int64, device) if count_rows else None,
            count_tokens=to_device(count_tokens, torch.int64, device) if count_rows else None,
        )

    def apply_starts(self, staged: StagedStarts) -> None:
        """Write new sequences' parameters and prompt presence (inside the step's device work)."""
        self.floats[:, staged.seq_index] = staged.floats
        self.ints[:, staged.seq_index] = staged.ints
        if staged.clear_presence is not None:
            self.presence[staged.clear_presence] = False
        if staged.presence_rows is not None:
            self.presence[staged.presence_rows, staged.presence_tokens] = True
        if staged.clear_counts is not None:
            self.output_counts[staged.clear_counts] = 0.0
        if staged.count_rows is not None:
            self.output_counts.index_put_((staged.count_rows, staged.count_tokens), torch.ones_like(staged.count_rows, dtype=torch.float32),
                                          accumulate=True)
        if staged.clear_bias is not None:
            self.logit_bias[staged.clear_bias] = 0.0
        if self.pooled is not None:
            self.pooled[staged.seq_index] = 0.0
        if staged.bias_rows is not None:
            self.logit_bias[staged.bias_rows, staged.bias_tokens] = staged.bias_values

    def sampling_tensors(self, step: AdmittedStep, rows: torch.Tensor, step_index: torch.Tensor) -> SamplingTensors:
        """The step's `SamplingTensors` for sampling rows ``rows`` ``[S]`` int64 (seq_index), by gather.

        ``step_index`` ``[S]`` int64 is each row's output index (from ``step.sampled_step_index``).
        """
        floats = self.floats[:, rows]  # [6, S]
        ints = self.ints[:, rows]  # [2, S]
        flags = step.sampling_flags
        return SamplingTensors(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            top_k=ints[0],
            seed=ints[1],
            step_index=step_index,
            all_greedy=not flags & _SAMPLED,
            any_top_k=bool(flags & _TOP_K),
            any_top_p=bool(flags & _TOP_P),
            any_min_p=bool(flags & _MIN_P),
            any_penalty=bool(flags & _PENALTY),
            max_logprobs=max(step.sampled_top_logprobs, default=0),
            presence_penalty=floats[4] if flags & _ADDITIVE else None,
            frequency_penalty=floats[5] if flags & _ADDITIVE else None,
            output_counts=self.output_counts[rows] if flags & _ADDITIVE else None,
            logit_bias=self.logit_bias[rows] if flags & _BIAS else None,
        )

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor, tensors: SamplingTensors) -> None:
        """Store sampled ``token_ids`` ``[S]`` int64 as the last token of ``rows`` ``[S]`` (distinct
        seq_index); mark presence and count the tokens when the step's rows use them."""
        self.last_token[rows] = token_ids
        if tensors.any_penalty:
            self.presence[rows, token_ids] = True
        if tensors.output_counts is not None:
            self.output_counts[rows, token_ids] += 1.0

