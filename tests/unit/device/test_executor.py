"""The completion-ticket contract and output slots of `StepExecutor`, plus async vs sync dispatch on the real model.

Contract tests use the real CPU backend (its compute thread) with `GatedFakeRunner`, a FAKE step
runner whose steps block until the test opens their gate, so "in flight" is a state the test
controls instead of a timing guess.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from stageserve.device.backends import CpuBackend
from stageserve.device.executor import SlotTimeout, StepExecutor
from stageserve.device.step_ticket import SlotBuffers, TicketTimeout
from stageserve.device.step_plan import AdmittedStep, Step
from stageserve.v1 import device_pb2


def make_step(step_id: int, rows: int = 2) -> AdmittedStep:
    """An admitted step with ``rows`` single-token sampling rows (seq_index 0..rows-1)."""
    seqs = list(range(rows))
    step = Step(
        plan=device_pb2.StepPlan(step_id=step_id), step_id=step_id, seq_index=seqs, generation=[1] * rows, start_pos=[0] * rows,
        num_tokens=[1] * rows, token_ids=[5] * rows, sample=[True] * rows, num_new_blocks=[0] * rows, new_block_ids=[], started=[],
        finished=[], sampled_seq_index=seqs, sampled_generation=[1] * rows, has_placeholder=False,
    )
    return AdmittedStep(step, block_tables=[[] for _ in seqs], sampled_top_logprobs=[0] * rows, sampled_step_index=[0] * rows, sampling_flags=0)


class FakeUploads:
    """Stands for a step's transient device uploads; its collection is counted with weakref.finalize."""

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id


class GatedFakeRunner:
    """A FAKE step runner (no model): step ``k`` writes ids ``100 * k + row`` after its gate opens.

    ``fail_steps`` raise ``RuntimeError`` instead. ``finalized`` counts, per step id, how many times
    its uploads object was garbage-collected (a second free would be a second count).
    """

    def __init__(self, fail_steps: tuple[int, ...] = ()) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.fail_steps = fail_steps
        self.finalized: dict[int, int] = {}

    def gate(self, step_id: int) -> threading.Event:
        return self.gates.setdefault(step_id, threading.Event())

    def stage(self, admitted: AdmittedStep) -> FakeUploads:
        step_id = admitted.step.step_id
        uploads = FakeUploads(step_id)
        self.finalized.setdefault(step_id, 0)
        weakref.finalize(uploads, self._count_free, step_id)
        return uploads

    def _count_free(self, step_id: int) -> None:
        self.finalized[step_id] += 1

    def run(self, uploads: FakeUploads, out: SlotBuffers) -> None:
        self.started.setdefault(uploads.step_id, threading.Event()).set()
        assert self.gate(uploads.step_id).wait(10), "test forgot to open a gate"
        if uploads.step_id in self.fail_steps:
            raise RuntimeError(f"fake device fault in step {uploads.step_id}")
        out.token_ids[:2] = torch.tensor([100 * uploads.step_id, 100 * uploads.step_id + 1])

    def observe(self, uploads: FakeUploads, result) -> dict[int, str]:
        return {}


@pytest.fixture
def fake():
    """An executor over the CPU backend and a gated fake runner; records delivered outputs."""
    runner = GatedFakeRunner(fail_steps=(3,))
    delivered: list[tuple[int, object, object]] = []
    executor = StepExecutor(
        CpuBackend(threads=1), runner, pipeline_depth=2, max_rows=4, max_top_logprobs=1,
        on_output=lambda ticket, result, error: delivered.append((ticket.ticket_id, result, error)),
    )
    try:
        yield executor, runner, delivered
    finally:
        for gate in runner.gates.values():
            gate.set()
        executor.close()


def test_submit_returns_before_the_step_completes(fake):
    executor, runner, _ = fake
    ticket = executor.submit(make_step(1))
    assert not ticket.done()
    with pytest.raises(TicketTimeout):
        ticket.wait(timeout=0.05)
    assert not ticket.done()
    runner.gate(1).set()
    assert ticket.wait(timeout=10).token_ids == [100, 101]


def test_second_submit_proceeds_while_first_is_in_flight(fake):
    executor, runner, delivered = fake
    first = executor.submit(make_step(1))
    second = executor.submit(make_step(2))  # returns although step 1 is blocked on the device
    assert not first.done() and not second.done()
    assert executor.in_flight() == 2
    runner.gate(2).set()
    runner.gate(1).set()
    assert executor.flush(timeout=10)
    assert [ticket_id for ticket_id, _, _ in delivered] == [first.ticket_id, second.ticket_id]
    assert [result.token_ids for _, result, _ in delivered] == [[100, 101], [200, 201]]


def test_waiting_twice_and_concurrently_returns_the_same_result(fake):
    executor, runner, _ = fake
    ticket = executor.submit(make_step(1))
    results = []
    waiters = [threading.Thread(target=lambda: results.append(ticket.wait(10))) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    runner.gate(1).set()
    for waiter in waiters:
        waiter.join()
    again = ticket.wait()
    assert again.token_ids == [100, 101]
    assert all(result is again for result in results) and len(results) == 4
    assert executor.flush(timeout=10)
    assert ticket.uploads_freed == 1
    assert runner.finalized[1] == 1


def test_failed_step_reraises_the_same_error_and_frees_uploads_once(fake):
    executor, runner, delivered = fake
    ticket = executor.submit(make_step(3))
    errors = []

    def wait_and_keep_error() -> None:
        try:
            ticket.wait(10)
        except RuntimeError as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=wait_and_keep_error) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    runner.gate(3).set()
    for waiter in waiters:
        waiter.join()
    with pytest.raises(RuntimeError, match="fake device fault in step 3") as raised:
        ticket.wait()
    assert len(errors) == 3 and all(error is raised.value for error in errors)
    assert executor.flush(timeout=10)
    assert delivered == [(ticket.ticket_id, None, raised.value)]
    assert ticket.uploads_freed == 1
    assert runner.finalized[3] == 1
    # The executor keeps serving after a failed step.
    executor.release(ticket.ticket_id)
    runner.gate(4).set()
    assert executor.submit(make_step(4)).wait(10).token_ids == [400, 401]


def test_a_slot_is_not_reused_before_its_output_is_released(fake):
    executor, runner, _ = fake
    runner.gate(1).set()
    runner.gate(2).set()
    first, second = executor.submit(make_step(1)), executor.submit(make_step(2))
    assert {first.slot, second.slot} == {0, 1}
    assert executor.flush(timeout=10)
    # Both outputs are unread by reclaim: a third step must not take (and overwrite) either slot.
    with pytest.raises(SlotTimeout):
        executor.submit(make_step(5), slot_timeout=0.2)
    assert first.wait().token_ids == [100, 101] and second.wait().token_ids == [200, 201]
    assert executor._slot_buffers[first.slot].token_ids[:2].tolist() == [100, 101]
    assert executor._slot_buffers[second.slot].token_ids[:2].tolist() == [200, 201]
    # Releasing the first output frees exactly its slot for the next step.
    assert executor.release(first.ticket_id)
    assert not executor.release(first.ticket_id)  # idempotent
    runner.gate(6).set()
    third = executor.submit(make_step(6), slot_timeout=1)
    assert third.slot == first.slot
    assert third.wait(10).token_ids == [600, 601]
    assert executor._slot_buffers[second.slot].token_ids[:2].tolist() == [200, 201]


def test_a_release_before_delivery_frees_the_slot_only_after_the_step_completes(fake):
    executor, runner, _ = fake
    first = executor.submit(make_step(1))
    executor.submit(make_step(2))
    assert executor.release(first.ticket_id)  # e.g. reclaim's stream ended while step 1 runs
    assert not executor.wait_for_free_slot(0.1)  # step 1 could still write its slot
    runner.gate(1).set()
    assert executor.wait_for_free_slot(10)


# ---- real model: async and sync dispatch give the same tokens --------------------------------------


@pytest.fixture(scope="module")
def real_model():
    """The embedded model in float32 on the CPU (loaded once for this module)."""
    from stageserve.device.model.decoder import DecoderModel
    from stageserve.model_files import embedded_model_path

    return DecoderModel.from_path(embedded_model_path(), torch.float32, "cpu")


EMBEDDED_PROMPTS = ([1, 9690, 198, 2683, 359, 253, 5356], [1, 4093, 1050, 28, 6128, 314])


def run_plans(model, dispatch: str, backend=None, prompts: tuple[list[int], list[int]] = EMBEDDED_PROMPTS) -> list[list[int]]:
    """Two sequences (one greedy, one seeded with top-p and a repetition penalty), prefill then 5 decode
    steps with placeholders, through a fresh table/KV cache/executor on ``backend`` (default: a new
    `CpuBackend`; closed at the end); returns each step's sampled ids."""
    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.sampler import validate_sampling_params
    from stageserve.sampling_rules import MAX_LOGPROBS
    from stageserve.device.sequence_table import SequenceTable
    from stageserve.device.step_plan import PlanLimits, decode_plan
    from stageserve.device.step_runner import ModelStepRunner
    from stageserve.v1 import common_pb2, device_pb2

    backend = backend or CpuBackend()
    vocab = model.config.vocab_size
    kv = PagedKVCache(model.config, 16, 16, model.dtype, backend.device)
    table = SequenceTable(4, vocab, 16, backend.device)
    executor = StepExecutor(backend, ModelStepRunner(model, kv, table), pipeline_depth=2, max_rows=4,
                            max_top_logprobs=MAX_LOGPROBS, dispatch=dispatch)
    limits = PlanLimits(max_num_seqs=4, vocab_size=vocab, num_blocks=16, block_size=16, max_step_tokens=256, max_model_len=256)
    samplings = [
        common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0),
        common_pb2.SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=7, logprobs=2),
    ]
    starts = [common_pb2.SequenceStart(seq_index=i, generation=1, request_id=f"r{i}", sampling=samplings[i], prompt_token_ids=p)
              for i, p in enumerate(prompts)]
    plans = [device_pb2.StepPlan(
        step_id=1, started=starts, seq_index=[0, 1], generation=[1, 1], start_pos=[0, 0],
        num_tokens=[len(p) for p in prompts], token_ids=prompts[0] + prompts[1], sample=[True, True],
        num_new_blocks=[1, 1], new_block_ids=[3, 9])]
    for k in range(5):
        plans.append(device_pb2.StepPlan(
            step_id=2 + k, seq_index=[0, 1], generation=[1, 1], start_pos=[len(p) + k for p in prompts],
            num_tokens=[1, 1], token_ids=[-1, -1], sample=[True, True], num_new_blocks=[0, 0]))
    tickets = []
    try:
        for plan in plans:
            step = decode_plan(plan, limits, lambda p: validate_sampling_params(p, vocab))
            assert executor.wait_for_free_slot(30)
            tickets.append(executor.submit(table.admit(step)))
            if len(tickets) >= 2:  # play reclaim: read and release the older output
                executor.release(tickets[-2].ticket_id)
        return [ticket.wait(30).token_ids for ticket in tickets]
    finally:
        executor.close()


def test_async_and_sync_dispatch_give_identical_tokens(real_model):
    async_ids = run_plans(real_model, "async")
    sync_ids = run_plans(real_model, "sync")
    assert async_ids == sync_ids
    assert len(async_ids) == 6 and all(len(ids) == 2 for ids in async_ids)
    # The greedy row matches a plain greedy loop of the model (placeholders resolved on the device).
    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.model.forward_batch import build_forward_batch

    ids, reference = list(EMBEDDED_PROMPTS[0]), []
    kv = PagedKVCache(real_model.config, 1, 16, torch.float32, "cpu")
    for _ in range(6):
        logits = real_model.forward(build_forward_batch([(ids, 0, [0], True)], 16, "cpu"), kv)
        reference.append(int(logits.argmax(-1)[0]))
        ids.append(reference[-1])
    assert [step[0] for step in async_ids] == reference


def test_the_backend_is_told_each_steps_token_rows(real_model):
    """The launch hint counts token rows, not sequences: a prefill is a large step for the cpu
    backend's thread governors however few prompts it holds."""
    class RecordingCpuBackend(CpuBackend):  # the real backend; records the hint it is given
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def launch(self, run, rows=0):
            self.rows.append(rows)
            return super().launch(run, rows)

    backend = RecordingCpuBackend()
    run_plans(real_model, "async", backend)
    assert backend.rows == [sum(len(p) for p in EMBEDDED_PROMPTS)] + [2] * 5
