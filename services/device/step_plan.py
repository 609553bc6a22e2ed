"""Decode a wire `StepPlan` into a host-side `Step` and check what needs no sequence state.

The plan's flat arrays (struct of arrays) are kept as Python lists; checks run on whole lists
(``min``/``max``/``sum``/``set``) so the per-step host cost does not grow with per-row Python
work. Checks that need the sequence table (generations, placeholders, block-table capacity) are in
`sequence_table.SequenceTable.admit`, which turns the `Step` into an `AdmittedStep`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from stageserve.v1 import common_pb2, device_pb2


class PlanError(ValueError):
    """The plan breaks the protocol; the message names the field and what to change. Nothing ran."""


@dataclass(frozen=True)
class PlanLimits:
    """What the device accepts (the facts `Attach` reports).

    Attributes:
        max_num_seqs: sequence table size; ``seq_index`` in ``[0, max_num_seqs)``.
        vocab_size: token ids in ``[0, vocab_size)`` (``-1`` = placeholder).
        num_blocks: KV block ids in ``[0, num_blocks)``.
        block_size: tokens per KV block.
        max_step_tokens: tokens one step may carry.
        max_model_len: positions a sequence may reach (tokens).
        num_speculative_tokens: drafts a decode row may ask for (0: the device does not speculate).
    """

    max_num_seqs: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_step_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0


@dataclass(slots=True)
class StartedSequence:
    """A sequence's start as the device needs it (from `SequenceStart`)."""

    seq_index: int
    generation: int
    sampling: common_pb2.SamplingParams
    prompt_token_ids: list[int]
    constraint: common_pb2.Constraint | None = None  # structured output; None = free text
    request_id: str = ""
    pooling: int = common_pb2.POOLING_NONE  # an embedding's pooling (`common_pb2.Pooling`)
    output_offset: int = 0  # a resumed sequence: its prompt's last tokens that are its own output


@dataclass(frozen=True, slots=True)
class Step:
    """One decoded plan (host memory), checked for shape but not yet against the sequence table.
    Per-row lists are parallel.

    Attributes:
        plan: the wire plan it was decoded from (its ``started`` and ``aborted`` go to reclaim
            with the ticket).
        step_id: the plan's ``step_id``.
        seq_index, generation, start_pos, num_tokens, sample: per row.
        token_ids: all rows' new tokens, flat; ``-1`` = placeholder.
        num_new_blocks, new_block_ids: blocks appended to the rows' block tables.
        started: sequences that start in this step (applied before its rows).
        finished: ``seq_index`` whose state is dropped after this step.
        sampled_seq_index, sampled_generation: per sampling row (``sample`` true), in row order.
        has_placeholder: some token is ``-1``.
        num_draft_tokens: per row, drafts it asks for (on a speculating device; else empty).
        sampled_num_drafts: the same per sampling row.
        speculative: the device speculates (decode rows take their positions from its own state).
        released: ``(seq_index, num_blocks)``: the sequence's block-table entries ``[0, num_blocks)``
            hold no KV block any more (a sliding window left them behind; applied before the rows).
    """

    plan: device_pb2.StepPlan
    step_id: int
    seq_index: list[int]
    generation: list[int]
    start_pos: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    sample: list[bool]
    num_new_blocks: list[int]
    new_block_ids: list[int]
    started: list[StartedSequence]
    finished: list[int]
    sampled_seq_index: list[int]
    sampled_generation: list[int]
    has_placeholder: bool
    num_draft_tokens: list[int] = field(default_factory=list)
    sampled_num_drafts: list[int] = field(default_factory=list)
    speculative: bool = False
    released: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AdmittedStep:
    """A `Step` the sequence table accepted and committed (`SequenceTable.admit`): what the executor
    submits and the step runner runs.

    Attributes:
        step: the decoded plan.
        block_tables: per row, the sequence's whole block table. Live lists of the table: build the
            forward batch from them before the next step is admitted.
        sampled_top_logprobs: per sampling row, top-n logprobs asked.
        sampled_step_index: per sampling row, index of the token it samples in its sequence's output.
        sampling_flags: sampling stages the step's rows need (bits of `sequence_table`).
        pooling: the rows of embedding sequences, in row order (empty when none).
    """

    step: Step
    block_tables: list[list[int]]
    sampled_top_logprobs: list[int]
    sampled_step_index: list[int]
    sampling_flags: int
    pooling: tuple[RowPooling, ...] = ()


@dataclass(frozen=True, slots=True)
class RowPooling:
    """A step's row of an embedding sequence.

    Attributes:
        row: its index among the step's rows.
        kind: the sequence's pooling (``common_pb2.POOLING_MEAN`` or ``POOLING_LAST``).
        prompt_len: the sequence's prompt tokens (a mean's divisor).
        output: the row's index among the step's sampling rows when it is the prompt's last chunk
            (its embedding is an output of the step), else ``None``.
    """

    row: int
    kind: int
    prompt_len: int
    output: int | None


def decode_plan(
    plan: device_pb2.StepPlan,
    limits: PlanLimits,
    check_sampling: Callable[[common_pb2.SamplingParams], None],
) -> Step:
    """Turn ``plan`` into a `Step`, checking shapes, ranges and the token budget.

    Args:
        check_sampling: raises ``ValueError`` naming the field (``sampling.top_p ...``) for invalid
            sampling parameters.

    Raises:
        PlanError: the first violation found, naming the field.
    """
    seq_index = list(plan.seq_index)
    rows = len(seq_index)
    generation, start_pos = list(plan.generation), list(plan.start_pos)
    num_tokens, sample = list(plan.num_tokens), list(plan.sample)
    num_new_blocks = list(plan.num_new_blocks)
    token_ids, new_block_ids = list(plan.token_ids), list(plan.new_block_ids)
    for name, values in (("generation", generation), ("start_pos", start_pos), ("num_tokens", num_tokens),
                         ("sample", sample), ("num_new_blocks", num_new_blocks)):
        if len(values) != rows:
            raise PlanError(f"step {plan.step_id}: {name} has {len(values)} entries, seq_index has {rows}; send one per row")
    total_tokens = sum(num_tokens)
    if rows and min(num_tokens) < 1:
        raise PlanError(f"step {plan.step_id}: num_tokens must be at least 1 in every row")
    if len(token_ids) != total_tokens:
        raise PlanError(f"step {plan.step_id}: token_ids has {len(token_ids)} entries, sum(num_tokens) is {total_tokens}")
    if total_tokens > limits.max_step_tokens:
        raise PlanError(f"step {plan.step_id}: {total_tokens} tokens exceed max_step_tokens={limits.max_step_tokens}; split the step")
    if len(new_block_ids) != sum(num_new_blocks):
        raise PlanError(f"step {plan.step_id}: new_block_ids has {len(new_block_ids)} entries, sum(num_new_blocks) is {sum(num_new_blocks)}")
    _check_indices(plan.step_id, "seq_index", seq_index, limits.max_num_seqs)
    if len(set(seq_index)) != rows:
        raise PlanError(f"step {plan.step_id}: a seq_index appears in more than one row; send one row per sequence")
    if token_ids and (min(token_ids) < -1 or max(token_ids) >= limits.vocab_size):
        raise PlanError(f"step {plan.step_id}: token_ids must be in [0, {limits.vocab_size}) or -1 (placeholder)")
    _check_indices(plan.step_id, "new_block_ids", new_block_ids, limits.num_blocks)
    if rows and max(map(operator.add, start_pos, num_tokens)) > limits.max_model_len:
        raise PlanError(f"step {plan.step_id}: start_pos + num_tokens exceeds max_model_len={limits.max_model_len}")
    finished = list(plan.finished)
    _check_indices(plan.step_id, "finished", finished, limits.max_num_seqs)
    started = [_decode_start(plan.step_id, start, limits, check_sampling) for start in plan.started]
    if len({s.seq_index for s in started}) != len(started):
        raise PlanError(f"step {plan.step_id}: started lists a seq_index twice")
    num_draft_tokens = _decode_drafts(plan, limits, num_tokens, token_ids)
    released = _decode_released(plan, limits)
    sampled_rows = [r for r, s in enumerate(sample) if s]
    return Step(
        plan=plan, step_id=plan.step_id, seq_index=seq_index, generation=generation, start_pos=start_pos,
        num_tokens=num_tokens, token_ids=token_ids, sample=sample, num_new_blocks=num_new_blocks,
        new_block_ids=new_block_ids, started=started, finished=finished,
        sampled_seq_index=[seq_index[r] for r in sampled_rows], sampled_generation=[generation[r] for r in sampled_rows],
        has_placeholder=-1 in token_ids, num_draft_tokens=num_draft_tokens,
        sampled_num_drafts=[num_draft_tokens[r] for r in sampled_rows] if num_draft_tokens else [], speculative=limits.num_speculative_tokens > 0,
        released=released,
    )


def _decode_released(plan: device_pb2.StepPlan, limits: PlanLimits) -> list[tuple[int, int]]:
    """``plan.released_seq_index`` and ``released_num_blocks`` checked for shape: one count per
    sequence, each sequence once."""
    seqs, counts = list(plan.released_seq_index), list(plan.released_num_blocks)
    if len(counts) != len(seqs):
        raise PlanError(f"step {plan.step_id}: released_num_blocks has {len(counts)} entries, released_seq_index has {len(seqs)}; send one per sequence")
    _check_indices(plan.step_id, "released_seq_index", seqs, limits.max_num_seqs)
    if len(set(seqs)) != len(seqs):
        raise PlanError(f"step {plan.step_id}: released_seq_index lists a seq_index twice")
    return list(zip(seqs, counts))


def _decode_drafts(plan: device_pb2.StepPlan, limits: PlanLimits, num_tokens: list[int], token_ids: list[int]) -> list[int]:
    """``plan.num_draft_tokens`` checked (one per row, at most the device's K, a drafting row all
    placeholders); all 0 when a plan to a speculating device sent none, empty for any other device."""
    drafts = list(plan.num_draft_tokens)
    if not drafts:
        return [0] * len(num_tokens) if limits.num_speculative_tokens else []
    where = f"step {plan.step_id}"
    if limits.num_speculative_tokens == 0:
        raise PlanError(f"{where}: num_draft_tokens given but this device does not speculate (--num-speculative-tokens 0); send none")
    if len(drafts) != len(num_tokens):
        raise PlanError(f"{where}: num_draft_tokens has {len(drafts)} entries, seq_index has {len(num_tokens)}; send one per row")
    if max(drafts) > limits.num_speculative_tokens:
        raise PlanError(f"{where}: num_draft_tokens {max(drafts)} exceeds the device's num_speculative_tokens={limits.num_speculative_tokens}")
    offset = 0
    for row, (n, k) in enumerate(zip(num_tokens, drafts)):
        placeholders = token_ids[offset : offset + n].count(-1)
        if k and (n != 1 + k or placeholders != n):
            raise PlanError(f"{where} row {row}: a row with num_draft_tokens {k} must carry 1 + {k} placeholders (-1), got {n} tokens, {placeholders} of them placeholders")
        offset += n
    return drafts


def _check_indices(step_id: int, name: str, values: list[int], bound: int) -> None:
    if values and max(values) >= bound:
        raise PlanError(f"step {step_id}: {name} {max(values)} is out of range; must be < {bound}")


def _decode_start(
    step_id: int,
    start: common_pb2.SequenceStart,
    limits: PlanLimits,
    check_sampling: Callable[[common_pb2.SamplingParams], None],
) -> StartedSequence:
    where = f"step {step_id}: started[seq_index={start.seq_index}, request_id={start.request_id!r}]"
    if start.seq_index >= limits.max_num_seqs:
        raise PlanError(f"{where}: seq_index must be < {limits.max_num_seqs}")
    try:
        check_sampling(start.sampling)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    prompt = list(start.prompt_token_ids)
    if prompt and (min(prompt) < 0 or max(prompt) >= limits.vocab_size):
        raise PlanError(f"{where}: prompt_token_ids must be in [0, {limits.vocab_size})")
    if start.output_offset > len(prompt):
        raise PlanError(f"{where}: output_offset {start.output_offset} is more than the prompt's {len(prompt)} tokens")
    constraint = start.constraint if start.HasField("constraint") else None
    return StartedSequence(start.seq_index, start.generation, start.sampling, prompt, constraint, start.request_id, start.pooling,
                           start.output_offset)
