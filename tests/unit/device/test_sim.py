"""The simulated device (`stageserve.device.sim`) through the real `StepExecutor`: steps take their
set time without using the CPU, complete in order, and sample ids that depend only on position."""

from __future__ import annotations

import time

import pytest

from stageserve.device.executor import StepExecutor
from stageserve.device.sim import SimBackend, SimStepRunner, sim_token_id
from stageserve.device.step_plan import AdmittedStep, Step
from stageserve.v1 import device_pb2

VOCAB, EOS = 49152, (2,)


def decode_step(step_id: int, positions: list[int], top_logprobs: int = 0) -> AdmittedStep:
    """An admitted step of single-token sampling rows; row ``r`` of sequence ``r`` sits at ``positions[r]``
    and asks for ``top_logprobs`` alternatives."""
    rows = len(positions)
    seqs = list(range(rows))
    step = Step(
        plan=device_pb2.StepPlan(step_id=step_id), step_id=step_id, seq_index=seqs, generation=[1] * rows, start_pos=positions,
        num_tokens=[1] * rows, token_ids=[5] * rows, sample=[True] * rows, num_new_blocks=[0] * rows, new_block_ids=[], started=[],
        finished=[], sampled_seq_index=seqs, sampled_generation=[1] * rows, has_placeholder=False,
    )
    return AdmittedStep(step, block_tables=[[] for _ in seqs], sampled_top_logprobs=[top_logprobs] * rows,
                        sampled_step_index=[0] * rows, sampling_flags=0)


def make_executor(step_ms: float, token_us: float = 0.0, dispatch: str = "async") -> StepExecutor:
    runner = SimStepRunner(step_ms / 1e3, token_us / 1e6, VOCAB, EOS)
    return StepExecutor(SimBackend(), runner, pipeline_depth=2, max_rows=8, max_top_logprobs=4, dispatch=dispatch)


def test_steps_take_the_set_time_with_the_cpu_idle():
    executor = make_executor(step_ms=20.0)
    try:
        wall, cpu = time.monotonic(), time.process_time()
        tickets = [executor.submit(decode_step(1, [10, 20])), executor.submit(decode_step(2, [11, 21]))]
        submitted_s = time.monotonic() - wall
        first = tickets[0].wait(5)
        first_s = time.monotonic() - wall
        tickets[1].wait(5)
        both_s = time.monotonic() - wall
        cpu_s = time.process_time() - cpu
    finally:
        executor.close()
    assert submitted_s < 0.010  # submit does not wait for the simulated device
    assert first_s >= 0.020 and both_s >= 0.040  # steps queue on one timeline, 20 ms each
    assert cpu_s < 0.5 * both_s  # waiting sleeps: the process is mostly idle
    assert first.token_ids == [sim_token_id(11, VOCAB, EOS), sim_token_id(21, VOCAB, EOS)]


def test_per_token_cost_and_sync_dispatch():
    executor = make_executor(step_ms=5.0, token_us=2000.0, dispatch="sync")  # 5 ms + 4 tokens x 2 ms = 13 ms
    try:
        start = time.monotonic()
        ticket = executor.submit(decode_step(1, [0, 1, 2, 3]))
        elapsed = time.monotonic() - start
        assert ticket.done() and elapsed >= 0.013  # sync: submit returned after the step completed
    finally:
        executor.close()


def test_token_ids_are_deterministic_in_range_and_never_eos():
    ids = [sim_token_id(p, VOCAB, EOS) for p in range(5000)]
    assert ids == [sim_token_id(p, VOCAB, EOS) for p in range(5000)]
    assert all(1000 <= t < VOCAB for t in ids) and len(set(ids)) > 4000
    # an EOS id inside the range is stepped over
    hit = sim_token_id(0, 2000, ())
    assert sim_token_id(0, 2000, (hit,)) == hit + 1


def test_logprobs_are_written_when_asked():
    executor = make_executor(step_ms=1.0)
    step = decode_step(1, [7], top_logprobs=3)
    try:
        result = executor.submit(step).wait(5)
    finally:
        executor.close()
    token = sim_token_id(8, VOCAB, EOS)
    assert result.token_ids == [token]
    assert result.logprobs[0].top_token_ids == [token, token + 1, token + 2]
    assert result.logprobs[0].top_logprobs == [0.0, -100.0, -100.0] and result.logprobs[0].logprob == 0.0


def test_negative_times_are_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        SimStepRunner(-0.001, 0.0, VOCAB, EOS)
