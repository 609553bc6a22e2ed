"""The continuous-batching scheduler, driven with hand-built StepEvents (no gRPC, no device)."""

from __future__ import annotations

import grpc
import pytest

from stageserve.prepare.errors import RequestError
from stageserve.prepare.scheduled_step import ScheduledStep
from stageserve.prepare.scheduler import AbortOutcome, Scheduler
from stageserve.prepare.scheduler_config import SchedulerConfig
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import common_pb2, reclaim_pb2

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


def make_request(request_id: str, prompt_tokens: int, max_tokens: int) -> GenerationRequest:
    ids = [100 + i for i in range(prompt_tokens)]
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0),
        stop=common_pb2.StopParams(max_tokens=max_tokens, prompt_tokens=prompt_tokens),
    )


def make_scheduler(**overrides) -> Scheduler:
    limits = dict(max_num_seqs=8, max_step_tokens=16, kv_num_blocks=64, kv_block_size=4, max_prefill_chunk=8, max_waiting=8)
    limits.update(overrides)
    return Scheduler(SchedulerConfig(**limits))


def event(step: ScheduledStep, request_id: str, finish: int = 0, error_code: int = 0, tokens=(7,)) -> reclaim_pb2.SequenceEvent:
    """The event reclaim would publish for ``request_id``'s row in ``step``."""
    row = next(r for r, seq in enumerate(step.rows) if seq.request.request_id == request_id)
    return reclaim_pb2.SequenceEvent(
        request_id=request_id, seq_index=step.seq_index[row], generation=step.generation[row],
        token_ids=list(tokens), finish_reason=finish, error_code=error_code,
    )


def publish(scheduler: Scheduler, step: ScheduledStep, *events: reclaim_pb2.SequenceEvent):
    return scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=step.step_id, events=list(events)))


def rows(step: ScheduledStep) -> list[tuple[str, int, int, bool]]:
    """(request id, start_pos, num_tokens, sample) per row."""
    return [(seq.request.request_id, s, n, smp) for seq, s, n, smp in zip(step.rows, step.start_pos, step.num_tokens, step.sample)]


class FakeReclaim:
    """Publishes a step as reclaim would: one token per sampling row of a live sequence, a LENGTH
    finish at max_tokens, an ABORT finish for aborted ids, nothing for rows after a finish."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[int, int, int]] = {}  # request id -> (seq_index, generation, max_tokens)
        self.produced: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    def publish(self, scheduler: Scheduler, step: ScheduledStep):
        for seq in step.started:
            self.live[seq.request.request_id] = (seq.seq_index, seq.generation, seq.request.max_tokens)
            self.produced[seq.request.request_id] = 0
        events = []
        for rid in step.aborted:
            if rid in self.live:
                index, generation, _ = self.live.pop(rid)
                self.finished[rid] = ABORT
                events.append(reclaim_pb2.SequenceEvent(request_id=rid, seq_index=index, generation=generation, finish_reason=ABORT))
        for seq, sample in zip(step.rows, step.sample):
            rid = seq.request.request_id
            if not sample or rid not in self.live:
                continue
            index, generation, max_tokens = self.live[rid]
            self.produced[rid] += 1
            finish = LENGTH if self.produced[rid] == max_tokens else 0
            if finish:
                del self.live[rid]
                self.finished[rid] = finish
            events.append(reclaim_pb2.SequenceEvent(request_id=rid, seq_index=index, generation=generation, token_ids=[5], finish_reason=finish))
        return scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=step.step_id, events=events))


def run_pipeline(scheduler: Scheduler, reclaim: FakeReclaim, depth: int = 2, max_steps: int = 1000) -> list[ScheduledStep]:
    """Schedule with ``depth`` unpublished steps at most, publishing the oldest when out of credits
    or out of work, until nothing is left; return every step sent."""
    sent: list[ScheduledStep] = []
    in_flight: list[ScheduledStep] = []
    for _ in range(max_steps):
        step = scheduler.schedule() if len(in_flight) < depth else None
        if step is not None:
            sent.append(step)
            in_flight.append(step)
            assert sum(step.num_tokens) <= scheduler.config.max_step_tokens
            continue
        if not in_flight:
            return sent
        reclaim.publish(scheduler, in_flight.pop(0))
    raise AssertionError("the scheduler did not drain (deadlock or livelock)")


def test_chunked_prefill_mixed_with_decode_rows():
    scheduler = make_scheduler(max_step_tokens=16, max_prefill_chunk=8)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_tokens=20, max_tokens=10))

    first = scheduler.schedule()
    assert [s.request.request_id for s in first.started] == ["a", "b"]
    assert rows(first) == [("a", 0, 4, True), ("b", 0, 8, False)]
    assert first.token_ids == [100, 101, 102, 103, *range(100, 108)]
    second = scheduler.schedule()  # a decodes on a placeholder while b's prompt continues
    assert second.started == []
    assert rows(second) == [("a", 4, 1, True), ("b", 8, 8, False)]
    assert second.token_ids == [-1, *range(108, 116)]
    third = scheduler.schedule()
    assert rows(third) == [("a", 5, 1, True), ("b", 16, 4, True)]  # b's last chunk samples
    fourth = scheduler.schedule()
    assert rows(fourth) == [("a", 6, 1, True), ("b", 20, 1, True)]
    assert fourth.token_ids == [-1, -1]
    assert [s.step_id for s in (first, second, third, fourth)] == [1, 2, 3, 4]


def test_new_blocks_travel_as_deltas():
    scheduler = make_scheduler(kv_block_size=4, max_prefill_chunk=6)
    scheduler.add_request(make_request("a", prompt_tokens=6, max_tokens=4))
    first = scheduler.schedule()
    assert first.num_new_blocks == [2] and first.new_block_ids == [0, 1]
    second = scheduler.schedule()  # position 6: still block 1
    assert second.num_new_blocks == [0] and second.new_block_ids == []
    third = scheduler.schedule()   # position 7
    assert third.num_new_blocks == [0]
    fourth = scheduler.schedule()  # position 8: block 2
    assert fourth.num_new_blocks == [1] and fourth.new_block_ids == [2]


def test_step_token_budget_is_respected_with_decode_rows_first():
    scheduler = make_scheduler(max_step_tokens=3, max_prefill_chunk=2, max_num_seqs=8)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", prompt_tokens=1 + i, max_tokens=4))
    reclaim = FakeReclaim()
    sent = run_pipeline(scheduler, reclaim)  # asserts sum(num_tokens) <= 3 for every step
    assert reclaim.finished == {f"r{i}": LENGTH for i in range(5)}
    for step in sent:
        decode = [start >= seq.request.num_prompt_tokens for seq, start in zip(step.rows, step.start_pos)]
        assert decode == sorted(decode, reverse=True)  # decode rows before prefill chunks
        assert all(n <= 2 for n in step.num_tokens)     # chunks of max_prefill_chunk at most


def test_waiting_queue_full_is_resource_exhausted():
    scheduler = make_scheduler(max_waiting=2, max_num_seqs=1)
    for request_id in "abc":  # "a" takes the free slot at the next step; "b" and "c" wait
        scheduler.add_request(make_request(request_id, 4, 4))
    with pytest.raises(RequestError) as full:
        scheduler.add_request(make_request("d", 4, 4))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full (2 requests)" in full.value.message


def test_a_burst_the_free_slots_take_is_not_counted_as_waiting():
    """Issue 20: six requests at once against max_waiting 4 with 4 free slots are all accepted."""
    scheduler = make_scheduler(max_waiting=4, max_num_seqs=4)
    for request_id in "abcdef":
        scheduler.add_request(make_request(request_id, 4, 4))
    assert scheduler.num_waiting == 6
    step = scheduler.schedule()
    assert len(step.started) == 4 and scheduler.num_waiting == 2


def test_request_larger_than_the_whole_pool_is_refused_with_sizes():
    scheduler = make_scheduler(kv_num_blocks=4, kv_block_size=4)  # 16 tokens in all
    scheduler.add_request(make_request("fits", prompt_tokens=10, max_tokens=7))  # 16 KV tokens
    with pytest.raises(RequestError) as refused:
        scheduler.add_request(make_request("big", prompt_tokens=10, max_tokens=8))  # 17 KV tokens
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = refused.value.message
    assert "5 KV blocks" in message and "prompt 10 + max_tokens 8" in message and "4 blocks" in message


def test_admission_waits_for_kv_and_never_deadlocks():
    """Each request reserves 3 of 4 blocks, so they run one at a time, first come first served,
    and all finish with the pool whole again."""
    scheduler = make_scheduler(kv_num_blocks=4, kv_block_size=4, max_step_tokens=8)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prompt_tokens=6, max_tokens=5))  # 10 KV tokens -> 3 blocks
    reclaim = FakeReclaim()
    sent = run_pipeline(scheduler, reclaim)
    assert reclaim.finished == {f"r{i}": LENGTH for i in range(4)}
    assert [seq.request.request_id for step in sent for seq in step.started] == ["r0", "r1", "r2", "r3"]
    for step in sent:
        assert len({seq.request.request_id for seq in step.rows}) <= 1  # never two at once
    assert scheduler.block_manager.num_free == 4 and scheduler.block_manager.num_available == 4
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.num_steps_in_flight) == (0, 0, 0)


def test_many_requests_under_pressure_all_finish():
    scheduler = make_scheduler(kv_num_blocks=12, kv_block_size=4, max_step_tokens=10, max_prefill_chunk=4, max_num_seqs=3, max_waiting=32)
    for i in range(20):
        scheduler.add_request(make_request(f"r{i}", prompt_tokens=3 + i % 7, max_tokens=1 + i % 9))
    reclaim = FakeReclaim()
    sent = run_pipeline(scheduler, reclaim, depth=3)
    assert reclaim.finished == {f"r{i}": LENGTH for i in range(20)}
    assert all(reclaim.produced[f"r{i}"] == 1 + i % 9 for i in range(20))
    # seq indices stay in [0, 3); a step never carries two rows of one sequence
    for step in sent:
        assert all(0 <= i < 3 for i in step.seq_index)
        assert len(set(step.seq_index)) == len(step.seq_index)
    assert scheduler.block_manager.num_free == 12


def test_max_tokens_stops_scheduling_before_reclaim_reports():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=2))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert rows(first) == [("a", 0, 4, True)] and rows(second) == [("a", 4, 1, True)]
    assert scheduler.schedule() is None  # two sampling rows scheduled: no third row
    assert not scheduler.has_work()


def test_finish_lag_frees_blocks_only_after_last_referencing_step_is_published():
    scheduler = make_scheduler(kv_block_size=4)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=100))
    first, second, third = scheduler.schedule(), scheduler.schedule(), scheduler.schedule()
    used = scheduler.block_manager.num_used
    assert used == 2  # positions [0, 6)

    # Reclaim finishes "a" (EOS) in step 2's output; step 3 is already in flight with a row of it.
    publish(scheduler, first, event(first, "a"))
    routed = publish(scheduler, second, event(second, "a", finish=STOP))
    assert [(req.request_id, ev.finish_reason) for req, ev in routed] == [("a", STOP)]
    assert scheduler.block_manager.num_used == used and scheduler.num_running == 1
    assert scheduler.schedule() is None  # no more rows for a finished sequence

    publish(scheduler, third)  # reclaim discards the lagging row: no event
    assert scheduler.block_manager.num_used == 0 and scheduler.num_running == 0
    assert scheduler.block_manager.num_available == 64

    # The freed index is listed in the next plan and not reused in it (the generation bump on reuse
    # is test_seq_index_reuse_bumps_generation).
    index = first.seq_index[0]
    scheduler.add_request(make_request("b", prompt_tokens=4, max_tokens=4))
    nxt = scheduler.schedule()
    assert nxt.finished == [index]
    assert nxt.seq_index[0] != index


def test_seq_index_reuse_bumps_generation():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", prompt_tokens=2, max_tokens=1))
    scheduler.add_request(make_request("b", prompt_tokens=2, max_tokens=1))
    first = scheduler.schedule()
    assert rows(first) == [("a", 0, 2, True)]
    assert scheduler.schedule() is None  # b waits for the only index
    publish(scheduler, first, event(first, "a", finish=LENGTH))
    release = scheduler.schedule()  # lists index 0 as finished; b cannot take it in the same plan
    assert release.finished == [0] and release.rows == []
    second = scheduler.schedule()
    assert [s.request.request_id for s in second.started] == ["b"]
    assert second.seq_index == [0] and second.generation == [first.generation[0] + 1]


def test_stale_events_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_tokens=2, max_tokens=8))
    step = scheduler.schedule()
    stale = reclaim_pb2.SequenceEvent(request_id="a", seq_index=step.seq_index[0], generation=step.generation[0] + 1, finish_reason=STOP)
    other = reclaim_pb2.SequenceEvent(request_id="zzz", seq_index=step.seq_index[0], generation=step.generation[0], finish_reason=STOP)
    assert publish(scheduler, step, stale, other) == []
    assert scheduler.has_work()  # "a" still runs


def test_abort_of_waiting_request_removes_it():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 2, 8), make_request("wait", 2, 8)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    scheduler.schedule()
    assert scheduler.abort(waiting) is AbortOutcome.REMOVED_WAITING
    assert scheduler.num_waiting == 0
    assert scheduler.abort(waiting) is AbortOutcome.NOT_FOUND


def test_abort_of_running_request_goes_into_next_plan_even_an_empty_one():
    scheduler = make_scheduler(kv_block_size=4)
    request = make_request("a", prompt_tokens=4, max_tokens=100)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert scheduler.abort(request) is AbortOutcome.FORWARDED
    assert scheduler.abort(request) is AbortOutcome.FORWARDED  # idempotent: forwarded once
    plan = scheduler.schedule()
    assert plan.aborted == ["a"] and plan.rows == []  # nothing else runnable: an empty plan
    assert scheduler.schedule() is None

    publish(scheduler, first, event(first, "a"))
    publish(scheduler, second, event(second, "a"))
    assert scheduler.block_manager.num_used == 2  # finish not yet published
    index = first.seq_index[0]
    abort_event = reclaim_pb2.SequenceEvent(request_id="a", seq_index=index, generation=first.generation[0], finish_reason=ABORT)
    routed = scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=plan.step_id, events=[abort_event]))
    assert [ev.finish_reason for _, ev in routed] == [ABORT]
    assert scheduler.block_manager.num_used == 0 and scheduler.num_running == 0
    assert scheduler.abort(request) is AbortOutcome.NOT_FOUND


def test_refused_step_fails_its_requests_and_resends_its_aborts():
    scheduler = make_scheduler()
    old, new = make_request("old", 2, 8), make_request("new", 2, 8)
    scheduler.add_request(old)
    first = scheduler.schedule()
    publish(scheduler, first, event(first, "old"))
    aborted_one = make_request("gone", 2, 8)
    scheduler.add_request(aborted_one)
    step2 = scheduler.schedule()  # "gone" started, "old" decodes (step 2, in flight)
    scheduler.abort(aborted_one)
    scheduler.add_request(new)
    refused = scheduler.schedule()  # old decodes, new starts, "gone" aborted
    assert refused.aborted == ["gone"] and {s.request.request_id for s in refused.rows} == {"old", "new"}

    failed = scheduler.fail_step(refused.step_id)
    assert sorted(r.request_id for r in failed) == ["new", "old"]
    assert scheduler.fail_step(refused.step_id) == []  # once
    nxt = scheduler.schedule()
    # the lost abort is sent again; "old" (known to reclaim) is aborted there; "new" never reached it
    assert nxt.aborted == ["gone", "old"] and nxt.rows == []
    assert scheduler.num_running == 2  # "old" and "gone" both have a row in step 2, still in flight
    publish(scheduler, step2)
    assert scheduler.num_running == 1  # "old" is freed; "gone" waits for reclaim's ABORT event


def test_error_event_finishes_the_sequence():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_tokens=2, max_tokens=8))
    step = scheduler.schedule()
    routed = publish(scheduler, step, event(step, "a", error_code=grpc.StatusCode.INTERNAL.value[0], tokens=()))
    assert routed[0][1].error_code == grpc.StatusCode.INTERNAL.value[0]
    assert scheduler.num_running == 0 and scheduler.block_manager.num_used == 0


def test_failed_step_fails_sequences_whose_rows_did_not_sample():
    """A step-level failure fails a sequence whose earlier prefill chunk ran in that step, although
    reclaim (which only knows sampling rows) could not name it in an event."""
    scheduler = make_scheduler(max_step_tokens=16, max_prefill_chunk=8)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=8))
    scheduler.add_request(make_request("b", prompt_tokens=20, max_tokens=8))
    first = scheduler.schedule()
    assert rows(first) == [("a", 0, 4, True), ("b", 0, 8, False)]
    failure = reclaim_pb2.StepEvents(
        step_id=first.step_id, error_code=grpc.StatusCode.INTERNAL.value[0], error_message="device step failed",
        events=[event(first, "a", error_code=grpc.StatusCode.INTERNAL.value[0], tokens=())],
    )
    routed = scheduler.update_from_output(failure)
    assert sorted((request.request_id, e.error_code) for request, e in routed) == [("a", 13), ("b", 13)]
    assert [e.error_message for request, e in routed if request.request_id == "b"] == ["device step failed"]
    assert scheduler.num_running == 0 and scheduler.block_manager.num_used == 0


def test_new_session_carries_generations_and_lists_stale_indices():
    old = make_scheduler(max_num_seqs=4)
    old.add_request(make_request("a", 2, 8))
    old.add_request(make_request("b", 2, 8))
    step = old.schedule()
    fresh = Scheduler(old.config, generations=old.generations, stale_seq_indices=old.seq_indices_in_use)
    fresh.add_request(make_request("c", 2, 8))
    first = fresh.schedule()
    assert first.finished == [0, 1]
    assert first.seq_index == [2]
    assert fresh.generations[0] == step.generation[0]


def test_waiting_kv_blocks_follow_the_queue():
    """Placement weighs the blocks the waiting requests will reserve: added on queueing, removed on
    admission and on an abort while waiting."""
    scheduler = make_scheduler(max_num_seqs=1)
    first, second, third = make_request("a", 20, 13), make_request("b", 4, 1), make_request("c", 17, 16)
    for request in (first, second, third):
        scheduler.add_request(request)
    block = scheduler.block_manager.block_size
    assert scheduler.num_waiting_kv_blocks == -(-32 // block) + -(-4 // block) + -(-32 // block)
    scheduler.schedule()  # admits "a" only (one seq index)
    assert scheduler.num_waiting_kv_blocks == -(-4 // block) + -(-32 // block)
    assert scheduler.abort(third) is AbortOutcome.REMOVED_WAITING
    assert scheduler.num_waiting_kv_blocks == -(-4 // block)


def test_a_mean_pooled_embedding_never_starts_from_the_prefix_cache():
    """Its mean needs every prompt token's hidden state; a last-token embedding may start from a hit."""
    from dataclasses import replace

    scheduler = make_scheduler()
    base = make_request("a", 40, max_tokens=1)
    assert scheduler.block_hashes(base) and scheduler.block_hashes(replace(base, pooling=common_pb2.POOLING_LAST))
    assert scheduler.block_hashes(replace(base, pooling=common_pb2.POOLING_MEAN)) == []
