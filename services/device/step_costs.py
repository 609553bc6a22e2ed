"""What a decode step costs on this device, by decode rows, drafts per row and context: measured once at start-up.

Speculative decoding pays for a draft whether or not the target accepts it: a decode row with ``k``
drafts is ``1 + k`` entries of the step's forward pass (and, with a draft model, ``k`` passes of
it). Whether that pays depends on the device: on a CPU a one-row step on the few-row quantized
kernel is cheap and a six-entry step is not, while a bfloat16 step of a few rows is bound by the
weight stream and costs the same at one entry or six; and every entry attends to its row's whole
context. prepare's draft planner (``prepare/draft_planner.py``) weighs each row's expected accepted
drafts against these costs, as SmartSpec does with its profiled batch latency (Liu et al. 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput").

`measure_step_costs` runs real steps through the executor, as the warm-up does: for each row count
``R`` of `ROW_POINTS` that fits, ``R`` sequences of `SHORT_CONTEXT` prompt tokens are started (one
prefill step), then decode steps of ``R`` rows with ``k = 0 .. K`` drafts each; once more at
`LONG_CONTEXT` tokens for the largest ``R`` up to `LONG_CONTEXT_ROWS` (what the context adds).
Each step is submitted and waited for alone, so its time is the step's whole device work
(proposer, forward, sampling, verification) plus its staging: the fastest of `REPEATS` runs, taken
round-robin over the draft counts after one untimed round. The sequences are dropped afterwards (the table is reset).
"""

from __future__ import annotations

import logging
import time
from itertools import takewhile

from stageserve.device.step_plan import PlanLimits, decode_plan
from stageserve.v1 import common_pb2, device_pb2

log = logging.getLogger(__name__)

ROW_POINTS = (1, 2, 4, 8, 16, 32)  # decode rows measured; prepare interpolates between them and extrapolates past them
REPEATS = 3
SHORT_CONTEXT = 8  # prompt tokens of each measured sequence
LONG_CONTEXT = 256  # prompt tokens of the sequences that measure the context's cost
LONG_CONTEXT_ROWS = 8


def measure_step_costs(executor, table, limits: PlanLimits, check_sampling) -> list[device_pb2.StepCost]:
    """Seconds of a decode step of ``rows`` rows of ``context_tokens`` context each asking for
    ``drafts`` drafts: at `SHORT_CONTEXT` for every row count of `ROW_POINTS` that the sequence
    table, the step budget and the KV pool allow, at `LONG_CONTEXT` for the largest of them up to
    `LONG_CONTEXT_ROWS` (none when that does not fit), each at every ``drafts`` in
    ``[0, limits.num_speculative_tokens]``.

    Runs on the device before it serves (``executor`` and ``table`` idle; the table is reset after).

    Raises:
        RuntimeError: a measured step failed (the message carries the step's error).
    """
    measured = list(takewhile(lambda rows: _fits(limits, rows, SHORT_CONTEXT), ROW_POINTS))
    long_rows = [rows for rows in measured if rows <= LONG_CONTEXT_ROWS and _fits(limits, rows, LONG_CONTEXT)][-1:]
    costs = [cost for rows in measured for cost in _measure_rows(executor, table, limits, check_sampling, rows, SHORT_CONTEXT)]
    costs += [cost for rows in long_rows for cost in _measure_rows(executor, table, limits, check_sampling, rows, LONG_CONTEXT)]
    table.reset()
    log.info("decode step costs (ms, rows x drafts per row @ context tokens): %s",
             ", ".join(f"{cost.rows}x{cost.drafts}@{cost.context_tokens} {cost.seconds * 1e3:.1f}" for cost in costs))
    return costs


def _decode_tokens(limits: PlanLimits) -> int:
    """Tokens a measured sequence decodes at most (every run of every draft count)."""
    return (1 + REPEATS) * sum(1 + drafts for drafts in range(limits.num_speculative_tokens + 1))


def _blocks_per_seq(limits: PlanLimits, context: int) -> int:
    return -(-(context + _decode_tokens(limits) + 1) // limits.block_size)


def _fits(limits: PlanLimits, rows: int, context: int) -> bool:
    """Whether ``rows`` sequences of ``context`` prompt tokens fit the table, a step and the KV pool."""
    return (rows <= limits.max_num_seqs and rows * (1 + limits.num_speculative_tokens) <= limits.max_step_tokens
            and rows * context <= limits.max_step_tokens and rows * _blocks_per_seq(limits, context) <= limits.num_blocks
            and context + _decode_tokens(limits) + 1 <= limits.max_model_len)


def _measure_rows(executor, table, limits: PlanLimits, check_sampling, rows: int, context: int) -> list[device_pb2.StepCost]:
    """Start ``rows`` sequences of ``context`` prompt tokens and time decode steps of them at each
    draft count (see the module docstring)."""
    table.reset()
    blocks_per_seq = _blocks_per_seq(limits, context)
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    seqs = list(range(rows))
    # Distinct prompts without repeats, so that prompt lookup finds no match (a draft costs the same matched or not).
    prompts = [[(seq * context + i) % limits.vocab_size for i in range(context)] for seq in seqs]
    starts = [common_pb2.SequenceStart(seq_index=seq, generation=1, request_id=f"step-cost-{seq}", prompt_token_ids=prompts[seq],
                                       sampling=greedy) for seq in seqs]
    blocks = [list(range(seq * blocks_per_seq, (seq + 1) * blocks_per_seq)) for seq in seqs]
    prefill = dict(started=starts, seq_index=seqs, generation=[1] * rows, start_pos=[0] * rows, num_tokens=[context] * rows,
                   token_ids=sum(prompts, []), sample=[True] * rows, num_new_blocks=[blocks_per_seq] * rows, new_block_ids=sum(blocks, []))
    if limits.num_speculative_tokens:
        prefill["num_draft_tokens"] = [0] * rows
    positions = [context] * rows  # each sequence's pending token's position
    _run(executor, table, limits, check_sampling, device_pb2.StepPlan(step_id=1, **prefill))
    seconds: list[list[float]] = [[] for _ in range(limits.num_speculative_tokens + 1)]  # per draft count
    step_id = 2
    # Round-robin over the draft counts, so that a slow spell of the machine touches all of them; the
    # first round builds each shape's kernel plans and is not timed.
    for repeat in range(1 + REPEATS):
        for drafts, times in enumerate(seconds):
            plan = device_pb2.StepPlan(step_id=step_id, seq_index=seqs, generation=[1] * rows, start_pos=positions, num_tokens=[1 + drafts] * rows,
                                       token_ids=[-1] * (rows * (1 + drafts)), sample=[True] * rows, num_new_blocks=[0] * rows)
            step_id += 1
            if limits.num_speculative_tokens:
                plan.num_draft_tokens.extend([drafts] * rows)
            began = time.perf_counter()
            result = _run(executor, table, limits, check_sampling, plan)
            if repeat:
                times.append(time.perf_counter() - began)
            positions = [pos + n for pos, n in zip(positions, result.num_tokens or [1] * rows)]
    # The fastest run: another process taking a core only ever adds time.
    return [device_pb2.StepCost(rows=rows, drafts=drafts, context_tokens=context, seconds=min(times)) for drafts, times in enumerate(seconds)]


def _run(executor, table, limits: PlanLimits, check_sampling, plan: device_pb2.StepPlan):
    """Submit ``plan``, wait for it, release its slot; its `StepResult`."""
    ticket = executor.submit(table.admit(decode_plan(plan, limits, check_sampling)))
    try:
        return ticket.wait()
    except Exception as exc:
        raise RuntimeError(f"step cost measurement failed: {type(exc).__name__}: {exc}") from exc
    finally:
        executor.flush()
        executor.release(ticket.ticket_id)
