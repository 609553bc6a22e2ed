"""What the scheduler hands the step loop: a :class:`ScheduledStep` (its rows are
:class:`SequenceState` objects, the scheduler's per-sequence state) and its wire form,
:func:`build_step_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stageserve.prepare.block_manager import BlockManager, BlockTable
from stageserve.prepare.draft_planner import SequenceDrafts
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import common_pb2, device_pb2

PLACEHOLDER_TOKEN = -1  # decode input the device fills with the token it sampled last for the sequence


@dataclass(eq=False)
class SequenceState:
    """An admitted request's state in the scheduler (identity compares).

    Attributes:
        num_kv_tokens: positions ``[0, num_kv_tokens)`` are written by steps already scheduled. With
            speculative decoding an upper bound while a decode row is in flight (it assumes every
            draft accepted), lowered to the real count as each step is published.
        num_sampled: sampling rows scheduled so far (at most ``request.max_tokens``).
        steps_in_flight: scheduled steps with a row of this sequence, not yet published or refused.
        num_tokens_in_flight: the tokens of those rows (drafts included): ``num_kv_tokens`` less
            them is what published steps wrote, the first position a row still to run may compute.
        stopped: gets no more rows.
        finished: its terminal event was published by reclaim, or prepare ended it locally.
        abort_forwarded: its request id was put in a plan's ``aborted`` list.
        block_hashes: hash chain of the prompt's full blocks (empty with prefix caching off).
        num_cached_tokens: prompt tokens it started with from the prefix cache (never prefilled).
        num_blocks_sent: entries of ``blocks.block_ids`` already sent to the device.
        cache_poisoned: a step of it failed; none of its blocks may become shareable.
        num_released_sent: ``blocks.num_released`` as the plans sent so far told the device.
        drafts: its drafting state (speculative decoding; `draft_planner`).
    """

    request: GenerationRequest
    seq_index: int
    generation: int
    blocks: BlockTable
    num_kv_tokens: int = 0
    num_sampled: int = 0
    steps_in_flight: int = 0
    num_tokens_in_flight: int = 0
    stopped: bool = False
    finished: bool = False
    abort_forwarded: bool = False
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_blocks_sent: int = 0
    cache_poisoned: bool = False
    num_released_sent: int = 0
    drafts: SequenceDrafts = field(default_factory=lambda: SequenceDrafts(0))

    @property
    def in_prefill(self) -> bool:
        return self.num_kv_tokens < self.request.num_prompt_tokens


@dataclass(eq=False)
class ScheduledStep:
    """One step as the scheduler built it: the ``StepPlan`` fields as flat lists (row ``r`` has
    ``num_tokens[r]`` tokens in ``token_ids`` and ``num_new_blocks[r]`` ids in ``new_block_ids``),
    plus ``rows``, the host-side sequence of each row, and ``cache_writes``: ``(sequence, block
    index)`` of each prompt block whose last token a row writes (shareable once the step is published).
    With speculative decoding (``speculative``: the device speculates) ``num_draft_tokens`` has one
    entry per row and ``decode_drafts`` the drafts each decode row asked for. ``released``:
    ``(sequence, num_released)`` of the sequences whose leading blocks the plan tells the device
    are released (sliding window)."""

    step_id: int
    finished: list[int]
    aborted: list[str]
    speculative: bool = False
    started: list[SequenceState] = field(default_factory=list)
    rows: list[SequenceState] = field(default_factory=list)
    seq_index: list[int] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    cache_writes: list[tuple[SequenceState, int]] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    decode_drafts: dict[SequenceState, int] = field(default_factory=dict)
    released: list[tuple[SequenceState, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.rows or self.finished or self.aborted or self.released)

    def add_row(self, seq: SequenceState, num_tokens: int, block_manager: BlockManager, drafts: int = 0) -> int:
        """Append one row of ``num_tokens`` tokens for ``seq`` (a decode row: plus ``drafts``
        placeholders for the device's drafts), its blocks appended from ``block_manager``, and advance
        ``seq``; return the tokens it takes from the step's budget."""
        start = seq.num_kv_tokens
        num_tokens += drafts
        end = start + num_tokens
        prompt_tokens = seq.request.num_prompt_tokens
        block_manager.append_slots(seq.blocks, end)
        new_blocks = seq.blocks.block_ids[seq.num_blocks_sent :]  # the shared ones too, in a first row
        seq.num_blocks_sent = len(seq.blocks.block_ids)
        block_size = block_manager.block_size
        self.cache_writes.extend((seq, j) for j in range(start // block_size, min(end // block_size, len(seq.block_hashes))))
        sample = end >= prompt_tokens
        self.rows.append(seq)
        self.seq_index.append(seq.seq_index)
        self.generation.append(seq.generation)
        self.start_pos.append(start)
        self.num_tokens.append(num_tokens)
        if start < prompt_tokens:
            self.token_ids.extend(seq.request.prompt_token_ids[start:end])
        else:
            self.token_ids.extend([PLACEHOLDER_TOKEN] * num_tokens)
            if self.speculative:
                self.decode_drafts[seq] = drafts
        if self.speculative:
            self.num_draft_tokens.append(drafts)
        self.sample.append(sample)
        self.num_new_blocks.append(len(new_blocks))
        self.new_block_ids.extend(new_blocks)
        seq.num_kv_tokens = end
        seq.steps_in_flight += 1
        seq.num_tokens_in_flight += num_tokens
        if sample:
            seq.num_sampled += 1
            if seq.num_sampled >= seq.request.max_tokens:
                seq.stopped = True
        return num_tokens


def build_step_plan(step: ScheduledStep) -> device_pb2.StepPlan:
    """The wire form of a scheduled step: flat repeated fields; one ``SequenceStart`` per new sequence
    only; ``refusals_only``: the engine reads a receipt only when it refuses the plan (its steps'
    outcomes come from reclaim)."""
    return device_pb2.StepPlan(
        step_id=step.step_id,
        started=[
            common_pb2.SequenceStart(
                seq_index=seq.seq_index,
                generation=seq.generation,
                request_id=seq.request.request_id,
                sampling=seq.request.sampling,
                stop=seq.request.stop,
                prompt_token_ids=seq.request.prompt_token_ids,
                constraint=seq.request.constraint,
                pooling=seq.request.pooling,
                output_offset=seq.request.output_offset,
            )
            for seq in step.started
        ],
        finished=step.finished,
        seq_index=step.seq_index,
        generation=step.generation,
        start_pos=step.start_pos,
        num_tokens=step.num_tokens,
        token_ids=step.token_ids,
        sample=step.sample,
        num_new_blocks=step.num_new_blocks,
        new_block_ids=step.new_block_ids,
        aborted=step.aborted,
        num_draft_tokens=step.num_draft_tokens,
        released_seq_index=[seq.seq_index for seq, _ in step.released],
        released_num_blocks=[count for _, count in step.released],
        refusals_only=True,
    )


def step_size_args(step: ScheduledStep) -> dict[str, int]:
    """Trace args of a step's size: rows, prompt tokens, decode tokens (decode rows carry the
    placeholder), and the prompt tokens its new sequences skipped (prefix-cache hits)."""
    decode = step.token_ids.count(PLACEHOLDER_TOKEN)
    return {"step_id": step.step_id, "batch_size": len(step.rows), "prefill_tokens": len(step.token_ids) - decode, "decode_tokens": decode,
            "prefill_tokens_skipped": sum(seq.num_cached_tokens for seq in step.started)}
