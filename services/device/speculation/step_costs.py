"""What a decode step costs on this device, by decode rows, drafts per row and context: measured once at start-up.

Speculative decoding pays for a draft whether or not the target accepts it: a decode row running
``k`` drafts is ``1 + k`` entries of the step's forward pass (and, with a draft model, ``k`` passes
of it; a CPU device runs only the drafts its proposer made, so every asked draft counts as proposed
while measuring: the table is the cost of the drafts run). Whether that pays depends on the device:
on a CPU a one-row step on the few-row quantized kernel is cheap and a six-entry step is not, while
a bfloat16 step of a few rows is bound by the weight stream and costs the same at one entry or six;
and every entry attends to its row's whole context. prepare's draft planner
(``prepare/draft_planner.py``) weighs each row's expected accepted drafts against these costs, as
SmartSpec does with its profiled batch latency (Liu et al. 2024, "Optimizing Speculative Decoding
for Serving Large Language Models Using Goodput").

`measure_step_costs` runs real steps through the executor, as the warm-up does. A group of ``R``
sequences of `SHORT_CONTEXT` prompt tokens is started for each row count ``R`` of `ROW_POINTS`
that fits, and one of `LONG_CONTEXT` tokens for the largest ``R`` up to `LONG_CONTEXT_ROWS` (what
the context adds); then rounds of decode steps, each round one step of every group at every
``k = 0 .. K`` drafts per row. Each step is submitted and waited for alone, so its time is the
step's whole device work (proposer, forward, sampling, verification) plus its staging; a cost is
the fastest of `REPEATS` timed rounds, after an untimed one that builds every shape's kernel plans.
Interleaving the rounds spreads a slow spell of the machine over all the cells instead of one row
count. The sequences are dropped afterwards (the table is reset).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from stageserve.device.step_plan import PlanLimits, decode_plan
from stageserve.v1 import common_pb2, device_pb2

log = logging.getLogger(__name__)

ROW_POINTS = (1, 2, 4, 8, 16, 32)  # decode rows measured; prepare interpolates between them and extrapolates past them
REPEATS = 3
SHORT_CONTEXT = 8  # prompt tokens of each measured sequence
LONG_CONTEXT = 256  # prompt tokens of the sequences that measure the context's cost
LONG_CONTEXT_ROWS = 8
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)  # of every sequence run at start-up


@dataclass
class _Group:
    """``rows`` measured sequences of ``context`` prompt tokens, from seq index ``first`` and KV
    block ``first_block`` on."""

    rows: int
    context: int
    first: int
    first_block: int
    num_drafts: int  # K: draft counts 0..K are measured
    positions: list[int] = field(init=False)  # each sequence's pending token's position
    seconds: list[list[float]] = field(init=False)  # per draft count, the timed runs

    def __post_init__(self) -> None:
        self.positions = [self.context] * self.rows
        self.seconds = [[] for _ in range(self.num_drafts + 1)]

    @property
    def seqs(self) -> list[int]:
        return list(range(self.first, self.first + self.rows))


def measure_step_costs(executor, table, limits: PlanLimits, check_sampling, speculation) -> list[device_pb2.StepCost]:
    """Seconds (wall clock, submit to completion) of a decode step of ``rows`` rows of
    ``context_tokens`` tokens of context each asking for ``drafts`` drafts: at `SHORT_CONTEXT` for
    every row count of `ROW_POINTS` that the sequence table, the step budget and the KV pool allow,
    at `LONG_CONTEXT` for the most rows up to `LONG_CONTEXT_ROWS` that fit (fewer tokens where
    ``max_model_len`` asks, none when even that does not fit), each at every ``drafts`` in
    ``[0, limits.num_speculative_tokens]``.

    Args:
        executor: the device's `StepExecutor`, idle (nothing submitted).
        table: its `SequenceTable`, empty; reset again afterwards.
        limits: the device's `PlanLimits`.
        check_sampling: raises ``ValueError`` for bad sampling parameters (as for served plans).
        speculation: the runner's `Speculation`; every asked draft counts as proposed while measuring
            (`Speculation.proposing_every_draft`): the costs are those of the entries run.

    Raises:
        RuntimeError: a measured step failed (the message carries the step's error).
    """
    groups: list[_Group] = []
    # The long-context group first, so that a small KV pool drops the largest row counts rather than it.
    long_context = min(LONG_CONTEXT, limits.max_model_len - _decode_tokens(limits) - 1)  # a short --max-model-len: as long as it allows
    if long_context >= 4 * SHORT_CONTEXT:
        for rows in reversed([rows for rows in ROW_POINTS if rows <= LONG_CONTEXT_ROWS]):  # the most rows that fit
            if _add_group(groups, limits, rows, long_context):
                break
    for rows in ROW_POINTS:  # as far as the table and the pool allow
        if not _add_group(groups, limits, rows, SHORT_CONTEXT):
            break
    table.reset()
    step_id = 1
    for group in groups:
        _start(executor, table, limits, check_sampling, group, step_id)
        step_id += 1
    with speculation.proposing_every_draft():
        for repeat in range(1 + REPEATS):
            for group in groups:
                for drafts, times in enumerate(group.seconds):
                    seconds = _decode(executor, table, limits, check_sampling, group, drafts, step_id)
                    step_id += 1
                    if repeat:  # the first round builds each shape's kernel plans
                        times.append(seconds)
    table.reset()
    # The fastest run: another process taking a core only ever adds time.
    costs = [device_pb2.StepCost(rows=group.rows, drafts=drafts, context_tokens=group.context, seconds=min(times))
             for group in groups for drafts, times in enumerate(group.seconds)]
    log.info("decode step costs (ms, rows x drafts per row @ context tokens): %s",
             ", ".join(f"{cost.rows}x{cost.drafts}@{cost.context_tokens} {cost.seconds * 1e3:.1f}" for cost in costs))
    return costs


def _add_group(groups: list[_Group], limits: PlanLimits, rows: int, context: int) -> bool:
    """Append a group of ``rows`` sequences of ``context`` prompt tokens if it fits a step, the
    context, and the sequence table and the KV pool beside ``groups``; whether it did."""
    seqs = sum(g.rows for g in groups)
    blocks = sum(g.rows * _blocks_per_seq(limits, g.context) for g in groups)
    fits = (rows * (1 + limits.num_speculative_tokens) <= limits.max_step_tokens and rows * context <= limits.max_step_tokens
            and context + _decode_tokens(limits) + 1 <= limits.max_model_len and seqs + rows <= limits.max_num_seqs
            and blocks + rows * _blocks_per_seq(limits, context) <= limits.num_blocks)
    if fits:
        groups.append(_Group(rows, context, seqs, blocks, limits.num_speculative_tokens))
    return fits


def _decode_tokens(limits: PlanLimits) -> int:
    """Tokens a measured sequence decodes at most (every run of every draft count)."""
    return (1 + REPEATS) * sum(1 + drafts for drafts in range(limits.num_speculative_tokens + 1))


def _blocks_per_seq(limits: PlanLimits, context: int) -> int:
    return -(-(context + _decode_tokens(limits) + 1) // limits.block_size)


def _start(executor, table, limits: PlanLimits, check_sampling, group: _Group, step_id: int) -> None:
    """Start ``group``'s sequences with one prefill step (distinct prompts)."""
    seqs, per_seq = group.seqs, _blocks_per_seq(limits, group.context)
    prompts = [[(seq * group.context + i) % limits.vocab_size for i in range(group.context)] for seq in seqs]
    starts = [common_pb2.SequenceStart(seq_index=seq, generation=1, request_id=f"step-cost-{seq}", prompt_token_ids=prompt, sampling=GREEDY)
              for seq, prompt in zip(seqs, prompts)]
    plan = device_pb2.StepPlan(step_id=step_id, started=starts, seq_index=seqs, generation=[1] * group.rows, start_pos=[0] * group.rows,
                               num_tokens=[group.context] * group.rows, token_ids=sum(prompts, []), sample=[True] * group.rows,
                               num_new_blocks=[per_seq] * group.rows, new_block_ids=list(range(group.first_block, group.first_block + group.rows * per_seq)))
    if limits.num_speculative_tokens:
        plan.num_draft_tokens.extend([0] * group.rows)
    run_alone(executor, table, limits, check_sampling, plan, "step cost measurement")


def _decode(executor, table, limits: PlanLimits, check_sampling, group: _Group, drafts: int, step_id: int) -> float:
    """Run one decode step of ``group`` with ``drafts`` drafts per row; its seconds."""
    rows = group.rows
    plan = device_pb2.StepPlan(step_id=step_id, seq_index=group.seqs, generation=[1] * rows, start_pos=group.positions,
                               num_tokens=[1 + drafts] * rows, token_ids=[-1] * (rows * (1 + drafts)), sample=[True] * rows,
                               num_new_blocks=[0] * rows)
    if limits.num_speculative_tokens:
        plan.num_draft_tokens.extend([drafts] * rows)
    began = time.perf_counter()
    result = run_alone(executor, table, limits, check_sampling, plan, "step cost measurement")
    seconds = time.perf_counter() - began
    group.positions = [pos + n for pos, n in zip(group.positions, result.num_tokens or [1] * rows)]
    return seconds


def run_alone(executor, table, limits: PlanLimits, check_sampling, plan: device_pb2.StepPlan, what: str):
    """Submit ``plan`` on the idle ``executor`` (after ``table`` admits it), wait for it and every
    output delivered, release its slot; its `StepResult`. Start-up only (the warm-up, the cost
    measurement): the device does not serve yet.

    Raises:
        RuntimeError: the step failed; the message starts with ``what`` and carries the step's error.
    """
    ticket = executor.submit(table.admit(decode_plan(plan, limits, check_sampling)))
    try:
        return ticket.wait()
    except Exception as exc:
        raise RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        executor.flush()
        executor.release(ticket.ticket_id)
