"""The scheduler with a speculating device: drafts per decode row, worst-case positions and blocks,
and the real counts learnt from published events (no gRPC, no device)."""

from __future__ import annotations

from stageserve.v1 import common_pb2

from .test_scheduler import LENGTH, event, make_request, make_scheduler, publish, rows


def test_decode_rows_ask_for_drafts_at_worst_case_positions_corrected_by_events():
    scheduler = make_scheduler(num_speculative_tokens=3, max_step_tokens=32)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=20))
    prefill = scheduler.schedule()
    assert rows(prefill) == [("a", 0, 4, True)] and prefill.num_draft_tokens == [0]
    first = scheduler.schedule()  # the prefill is in flight: its token is the pending one, at 4
    assert rows(first) == [("a", 4, 4, True)] and first.num_draft_tokens == [3]
    assert first.token_ids == [-1] * 4
    second = scheduler.schedule()  # assumes all three drafts of `first` accepted
    assert rows(second) == [("a", 8, 4, True)]
    publish(scheduler, prefill, event(prefill, "a", tokens=[7]))
    publish(scheduler, first, event(first, "a", tokens=[7, 8]))  # one draft accepted: two fewer than assumed
    third = scheduler.schedule()
    assert rows(third) == [("a", 10, 4, True)]  # 4 + 2 (first) + 4 (second, still assumed whole)
    sent = sum(sum(step.num_new_blocks) for step in (prefill, first, second, third))
    assert sent * 4 >= 10 + 4  # the rows' blocks cover the worst case: third's last draft at 13


def test_drafts_never_pass_max_tokens_and_a_sequence_at_its_bound_waits():
    scheduler = make_scheduler(num_speculative_tokens=3, max_step_tokens=32)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=4))
    prefill = scheduler.schedule()
    first = scheduler.schedule()
    assert first.num_draft_tokens == [2]  # output tokens 2..4 at most: the pending one + 2 drafts
    assert scheduler.schedule() is None and not scheduler.has_work()  # `first` may have reached max_tokens
    publish(scheduler, prefill, event(prefill, "a", tokens=[7]))
    publish(scheduler, first, event(first, "a", tokens=[8]))  # nothing accepted: 2 produced of 4
    second = scheduler.schedule()
    assert rows(second) == [("a", 5, 2, True)] and second.num_draft_tokens == [1]
    publish(scheduler, second, event(second, "a", tokens=[9, 10], finish=LENGTH))
    assert scheduler.schedule() is None and scheduler.num_running == 0


def test_drafts_share_the_step_budget_after_every_decode_row_has_its_token():
    scheduler = make_scheduler(num_speculative_tokens=3, max_step_tokens=5)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, prompt_tokens=2, max_tokens=20))
    scheduler.schedule()
    step = scheduler.schedule()
    assert step.num_draft_tokens == [3, 0] and sum(step.num_tokens) == 5


def test_penalised_requests_never_draft_and_devices_without_speculation_get_no_field():
    scheduler = make_scheduler(num_speculative_tokens=3, max_step_tokens=32)
    request = make_request("p", prompt_tokens=2, max_tokens=20)
    request.sampling.CopyFrom(common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.2))
    scheduler.add_request(request)
    scheduler.schedule()
    assert scheduler.schedule().num_draft_tokens == [0]
    plain = make_scheduler()
    plain.add_request(make_request("a", prompt_tokens=2, max_tokens=20))
    plain.schedule()
    step = plain.schedule()
    assert step.num_draft_tokens == [] and rows(step) == [("a", 2, 1, True)]
