"""What a decode step costs on this device, by decode rows and drafts per row: measured once at start-up.

Speculative decoding pays for a draft whether or not the target accepts it: a decode row with ``k``
drafts is ``1 + k`` entries of the step's forward pass (and, with a draft model, ``k`` passes of
it). Whether that pays depends on the device: on a CPU a one-row step on the few-row quantized
kernel is cheap and a six-entry step is not, while a bfloat16 step of a few rows is bound by the
weight stream and costs the same at one entry or six. prepare's draft planner
(``prepare/draft_planner.py``) weighs each row's expected accepted drafts against these costs, as
SmartSpec does with its profiled batch latency (Liu et al. 2024, "Optimizing Speculative Decoding
for Serving Large Language Models Using Goodput").

`measure_step_costs` runs real steps through the executor, as the warm-up does: for each row count
``R`` of `ROW_POINTS` that fits, ``R`` short sequences are started (one prefill step), then decode
steps of ``R`` rows with ``k = 0 .. K`` drafts each; each step is submitted and waited for alone, so
its time is the step's whole device work (proposer, forward, sampling, verification) plus its
staging, the median of `REPEATS` after one untimed run. The sequences are dropped afterwards (the table is reset).
"""

from __future__ import annotations

import logging
import statistics
import time

from stageserve.device.step_plan import PlanLimits, decode_plan
from stageserve.v1 import common_pb2, device_pb2

log = logging.getLogger(__name__)

ROW_POINTS = (1, 2, 4, 8, 16, 32)  # decode rows measured; prepare interpolates between them and extrapolates past them
REPEATS = 3
PROMPT_TOKENS = 8  # per measured sequence


def measure_step_costs(executor, table, limits: PlanLimits, check_sampling) -> list[device_pb2.StepCost]:
    """Median seconds of a decode step of ``rows`` rows each asking for ``drafts`` drafts, for every
    row count of `ROW_POINTS` that the sequence table, the step budget and the KV pool allow and
    every ``drafts`` in ``[0, limits.num_speculative_tokens]``.

    Runs on the device before it serves (``executor`` and ``table`` idle; the table is reset after).

    Raises:
        RuntimeError: a measured step failed (the message carries the step's error).
    """
    k = limits.num_speculative_tokens
    decode_tokens = (1 + REPEATS) * sum(1 + drafts for drafts in range(k + 1))  # per sequence, at most
    blocks_per_seq = -(-(PROMPT_TOKENS + decode_tokens + 1) // limits.block_size)
    costs = []
    for rows in ROW_POINTS:
        fits = (rows <= limits.max_num_seqs and rows * (1 + k) <= limits.max_step_tokens and rows * PROMPT_TOKENS <= limits.max_step_tokens
                and rows * blocks_per_seq <= limits.num_blocks and PROMPT_TOKENS + decode_tokens + 1 <= limits.max_model_len)
        if not fits:
            break
        costs += _measure_rows(executor, table, limits, check_sampling, rows, blocks_per_seq)
    table.reset()
    log.info("decode step costs (ms, rows x drafts per row): %s",
             ", ".join(f"{cost.rows}x{cost.drafts} {cost.seconds * 1e3:.1f}" for cost in costs))
    return costs


def _measure_rows(executor, table, limits: PlanLimits, check_sampling, rows: int, blocks_per_seq: int) -> list[device_pb2.StepCost]:
    """Start ``rows`` sequences and time decode steps of them at each draft count (see the module docstring)."""
    table.reset()
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    seqs = list(range(rows))
    # Distinct prompts without repeats, so that prompt lookup finds no match (a draft costs the same matched or not).
    prompts = [[(seq * PROMPT_TOKENS + i) % limits.vocab_size for i in range(PROMPT_TOKENS)] for seq in seqs]
    starts = [common_pb2.SequenceStart(seq_index=seq, generation=1, request_id=f"step-cost-{seq}", prompt_token_ids=prompts[seq],
                                       sampling=greedy) for seq in seqs]
    blocks = [list(range(seq * blocks_per_seq, (seq + 1) * blocks_per_seq)) for seq in seqs]
    prefill = dict(started=starts, seq_index=seqs, generation=[1] * rows, start_pos=[0] * rows, num_tokens=[PROMPT_TOKENS] * rows,
                   token_ids=sum(prompts, []), sample=[True] * rows, num_new_blocks=[blocks_per_seq] * rows, new_block_ids=sum(blocks, []))
    if limits.num_speculative_tokens:
        prefill["num_draft_tokens"] = [0] * rows
    positions = [PROMPT_TOKENS] * rows  # each sequence's pending token's position
    _run(executor, table, limits, check_sampling, device_pb2.StepPlan(step_id=1, **prefill))
    costs = []
    for drafts in range(limits.num_speculative_tokens + 1):
        seconds = []
        for repeat in range(1 + REPEATS):  # the first run of a shape builds its kernels' plans: not timed
            plan = device_pb2.StepPlan(step_id=2 + drafts * (1 + REPEATS) + repeat, seq_index=seqs, generation=[1] * rows, start_pos=positions, num_tokens=[1 + drafts] * rows,
                                       token_ids=[-1] * (rows * (1 + drafts)), sample=[True] * rows, num_new_blocks=[0] * rows)
            if limits.num_speculative_tokens:
                plan.num_draft_tokens.extend([drafts] * rows)
            began = time.perf_counter()
            result = _run(executor, table, limits, check_sampling, plan)
            if repeat:
                seconds.append(time.perf_counter() - began)
            emitted = result.num_tokens or [1] * rows
            positions = [pos + n for pos, n in zip(positions, emitted)]
        costs.append(device_pb2.StepCost(rows=rows, drafts=drafts, seconds=statistics.median(seconds)))
    return costs


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
