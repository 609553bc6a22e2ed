"""The completion handler (ticket book + step processing) driven with hand-built tickets and outputs."""

from __future__ import annotations

import grpc
import pytest

from stageserve.reclaim.completion import CompletionHandler, Outcome
from stageserve.reclaim.ticket_book import DeviceProtocolError
from stageserve.v1 import common_pb2, device_pb2

EOS = 2
TIMEOUT_S = 30.0
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
STOP, LENGTH, ABORT = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_ABORT


def start(seq_index: int, request_id: str, generation: int = 1, logprobs: int = 0, **stop) -> common_pb2.SequenceStart:
    stop.setdefault("max_tokens", 100)
    return common_pb2.SequenceStart(
        seq_index=seq_index,
        generation=generation,
        request_id=request_id,
        sampling=common_pb2.SamplingParams(logprobs=logprobs),
        stop=common_pb2.StopParams(prompt_tokens=3, **stop),
        prompt_token_ids=[1, 504, 2988],
    )


def ticket(n: int, rows=(), started=(), aborted=()) -> device_pb2.CompletionEvent:
    """Ticket ``n`` of step ``100 + n``; rows are (seq_index, generation)."""
    return device_pb2.CompletionEvent(
        ticket=device_pb2.CompletionTicket(
            ticket=n,
            step_id=100 + n,
            slot=n % 2,
            started=list(started),
            seq_index=[r[0] for r in rows],
            generation=[r[1] for r in rows],
            aborted=list(aborted),
        )
    )


def output(n: int, token_ids=(), error: str = "", logprobs=()) -> device_pb2.CompletionEvent:
    return device_pb2.CompletionEvent(
        output=device_pb2.StepOutput(ticket=n, step_id=100 + n, token_ids=list(token_ids), error=error, logprobs=list(logprobs))
    )


@pytest.fixture
def handler(detokenizer) -> CompletionHandler:
    attach = device_pb2.AttachReply(eos_token_ids=[EOS], vocab_size=49152, max_num_seqs=8, instance_id="dev-1")
    return CompletionHandler(attach, detokenizer, completion_timeout_s=TIMEOUT_S)


def run(handler: CompletionHandler, events, now_s: float = 0.0) -> list[Outcome]:
    outcomes = []
    for event in events:
        outcomes += handler.handle(event, now_s)
    return outcomes


def by_request(outcomes: list[Outcome]) -> dict[str, list]:
    """request_id -> its SequenceEvents across the published steps, in order."""
    events: dict[str, list] = {}
    for outcome in outcomes:
        for event in outcome.events.events if outcome.events else ():
            events.setdefault(event.request_id, []).append(event)
    return events


def pipelined(tokens_per_step: list[list[int]], rows, started) -> list[device_pb2.CompletionEvent]:
    """Depth-2 pipeline order: T1, T2, O1, T3, O2, ..., On (ticket n+1 arrives before output n)."""
    n_steps = len(tokens_per_step)
    events = [ticket(1, rows, started)]
    for n in range(1, n_steps + 1):
        if n < n_steps:
            events.append(ticket(n + 1, rows))
        events.append(output(n, tokens_per_step[n - 1]))
    return events


def test_text_streams_in_step_order_and_every_step_is_published_and_released(handler, tokenizer):
    text = "東京タワーは😀です"
    ids = tokenizer.encode(text, add_special_tokens=False)
    outcomes = run(handler, pipelined([[t] for t in ids], rows=[(0, 1)], started=[start(0, "r1", max_tokens=len(ids))]))
    assert [o.events.step_id for o in outcomes] == [100 + n for n in range(1, len(ids) + 1)]
    assert [o.release_ticket for o in outcomes] == list(range(1, len(ids) + 1))
    events = by_request(outcomes)["r1"]
    assert all(o.events.device_instance_id == "dev-1" for o in outcomes)
    assert "".join(e.text for e in events) == text
    assert all("\ufffd" not in e.text for e in events)
    assert [list(e.token_ids) for e in events] == [[t] for t in ids]
    assert [e.completion_tokens for e in events] == list(range(1, len(ids) + 1))
    assert events[-1].finish_reason == LENGTH and events[-1].prompt_tokens == 3
    assert all(e.finish_reason == 0 for e in events[:-1])
    assert handler.live_count == 0


def test_stop_string_across_tokens_is_cut_reported_and_later_rows_discarded(handler, tokenizer):
    ids = tokenizer.encode("The answer is 42.\n\nQuestion: why?", add_special_tokens=False)
    stop_at = ids.index(17872)  # 'Question': the stop string "\n\nQuestion" spans three tokens
    outcomes = run(handler, pipelined([[t] for t in ids], rows=[(0, 1)], started=[start(0, "r1", stop=["\n\nQuestion"])]))
    events = by_request(outcomes)["r1"]
    assert len(outcomes) == len(ids)  # every step published, also those after the finish
    assert len(events) == stop_at + 1  # rows after the finish are discarded (finish lag)
    assert "".join(e.text for e in events) == "The answer is 42."
    assert events[-1].finish_reason == STOP and events[-1].stop_string == "\n\nQuestion"
    assert not events[-1].HasField("stop_token_id")


def test_stop_string_included_when_asked(handler, tokenizer):
    ids = tokenizer.encode("Hello world! Goodbye", add_special_tokens=False)
    started = [start(0, "r1", stop=["world! Go"], include_stop_str_in_output=True)]
    events = by_request(run(handler, pipelined([[t] for t in ids], [(0, 1)], started)))["r1"]
    assert "".join(e.text for e in events) == "Hello world! Go"
    assert events[-1].stop_string == "world! Go"


def test_held_back_tail_is_released_when_it_stops_matching(handler, tokenizer):
    ids = tokenizer.encode("Hello world! Goodbye", add_special_tokens=False)  # 'Hello', ' world', '!', ' Good', 'bye'
    events = by_request(run(handler, pipelined([[t] for t in ids], [(0, 1)], [start(0, "r1", stop=[" world? no"], max_tokens=5)])))["r1"]
    assert [e.text for e in events] == ["Hello", "", " world!", " Good", "bye"]


def test_eos_stops_with_its_id_and_no_text(handler, tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [EOS]
    events = by_request(run(handler, pipelined([[t] for t in ids], [(0, 1)], [start(0, "r1")])))["r1"]
    assert "".join(e.text for e in events) == "Hi there"
    assert events[-1].finish_reason == STOP and events[-1].stop_token_id == EOS
    assert list(events[-1].token_ids) == [EOS] and events[-1].completion_tokens == len(ids)


def test_ignore_eos_and_min_tokens_keep_generating(handler, tokenizer):
    hi = tokenizer.encode("Hi", add_special_tokens=False)[0]
    steps = [[EOS, EOS], [hi, hi], [EOS, EOS], [hi, hi], [EOS, EOS]]  # rows: "ignore", "min3"
    started = [start(0, "ignore", ignore_eos=True, max_tokens=5), start(1, "min3", min_tokens=3)]
    events = by_request(run(handler, pipelined(steps, [(0, 1), (1, 1)], started)))
    assert [e.finish_reason for e in events["ignore"]] == [0, 0, 0, 0, LENGTH]
    assert "".join(e.text for e in events["ignore"]) == "HiHi"
    assert [e.finish_reason for e in events["min3"]] == [0, 0, STOP]
    assert events["min3"][-1].stop_token_id == EOS and events["min3"][-1].completion_tokens == 3


def test_stop_token_id_text_is_published_only_with_include_stop_str(handler, tokenizer):
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)  # 'Hello', ' world', '!'
    bang = ids[-1]
    started = [start(0, "plain", stop_token_ids=[bang]), start(1, "incl", stop_token_ids=[bang], include_stop_str_in_output=True)]
    events = by_request(run(handler, pipelined([[t, t] for t in ids], [(0, 1), (1, 1)], started)))
    assert "".join(e.text for e in events["plain"]) == "Hello world"
    assert "".join(e.text for e in events["incl"]) == "Hello world!"
    assert events["plain"][-1].stop_token_id == bang


def test_step_without_rows_is_still_published(handler):
    outcomes = run(handler, [ticket(1), output(1)])
    assert outcomes == [Outcome(outcomes[0].events, 1)]
    assert outcomes[0].events.step_id == 101 and len(outcomes[0].events.events) == 0


def test_outputs_are_published_in_step_order(handler, tokenizer):
    hello, world = tokenizer.encode("Hello world", add_special_tokens=False)
    outcomes = run(handler, [ticket(1, [(0, 1)], [start(0, "r1")]), ticket(2, [(0, 1)]), output(2, [world])])
    assert outcomes == []  # step 2 waits for step 1
    outcomes = run(handler, [output(1, [hello])])
    assert [(o.events.step_id, o.release_ticket) for o in outcomes] == [(101, 1), (102, 2)]
    assert [e.text for o in outcomes for e in o.events.events] == ["Hello", " world"]


def test_timed_out_step_fails_its_sequences_and_its_late_output_only_releases_the_slot(handler, tokenizer):
    hi, there = tokenizer.encode("Hi there", add_special_tokens=False)
    # step 1 starts "in-step" (sampled) and "other" (an earlier prefill chunk: no sampling row)
    run(handler, [ticket(1, [(0, 1)], [start(0, "in-step"), start(1, "other")]), output(1, [hi])], now_s=0.0)
    # step 2 holds "in-step" (a row) and "new" (started, no sampling row yet); "other" is not in it
    run(handler, [ticket(2, [(0, 1)], [start(2, "new")])], now_s=1.0)
    assert handler.next_deadline_s() == 1.0 + TIMEOUT_S
    assert handler.expire(TIMEOUT_S) == []
    (failed,) = handler.expire(1.0 + TIMEOUT_S)
    assert failed.release_ticket == 0  # the device may still write that slot
    assert failed.events.step_id == 102
    assert sorted(e.request_id for e in failed.events.events) == ["in-step", "new"]
    for event in failed.events.events:
        assert event.error_code == UNAVAILABLE and event.finish_reason == 0
        assert "step 102" in event.error_message and "30 s" in event.error_message
    assert handler.live_count == 1  # "other"
    assert run(handler, [output(2, [there])]) == [Outcome(None, 2)]  # late: discarded, slot released
    (step3,) = run(handler, [ticket(3, [(0, 1), (1, 1)]), output(3, [there, hi])])
    assert [(e.request_id, e.text) for e in step3.events.events] == [("other", "Hi")]  # "in-step" row discarded


def test_failed_output_fails_exactly_that_steps_sequences(handler, tokenizer):
    hi, there = tokenizer.encode("Hi there", add_special_tokens=False)
    run(handler, [ticket(1, [(0, 1)], [start(0, "a"), start(1, "b")]), output(1, [hi])])
    (failed,) = run(handler, [ticket(2, [(0, 1)]), output(2, error="NaN in logits")])
    assert failed.release_ticket == 2
    assert [(e.request_id, e.error_code) for e in failed.events.events] == [("a", INTERNAL)]
    assert failed.events.events[0].error_message == "step 102 failed on the device: NaN in logits"
    assert failed.events.events[0].completion_tokens == 1
    (step3,) = run(handler, [ticket(3, [(0, 1), (1, 1)]), output(3, [there, there])])
    assert [(e.request_id, e.text) for e in step3.events.events] == [("b", " there")]


def test_a_row_error_fails_that_request_alone(handler, tokenizer):
    hi, there = tokenizer.encode("Hi there", add_special_tokens=False)
    run(handler, [ticket(1, [(0, 1), (1, 1)], [start(0, "a"), start(1, "b")]), output(1, [hi, hi])])
    step2 = output(2, [there, there])
    step2.output.row_errors[1] = "structured output: the constraint rejected sampled token 7"
    (published,) = run(handler, [ticket(2, [(0, 1), (1, 1)]), step2])
    a, b = published.events.events
    assert (a.request_id, a.text, a.error_code) == ("a", " there", 0)
    assert (b.request_id, b.error_code, b.error_message, b.completion_tokens) == ("b", INTERNAL, step2.output.row_errors[1], 1)
    (step3,) = run(handler, [ticket(3, [(0, 1), (1, 1)]), output(3, [hi, hi])])
    assert [e.request_id for e in step3.events.events] == ["a"]  # b's later rows are discarded


def test_output_with_wrong_row_count_fails_the_step(handler):
    (failed,) = run(handler, [ticket(1, [(0, 1)], [start(0, "a")]), output(1, [5, 6])])
    assert failed.events.events[0].error_code == INTERNAL
    assert "2 token ids" in failed.events.events[0].error_message and "1 sampling rows" in failed.events.events[0].error_message


@pytest.mark.parametrize("bad_token", [-1, 49152])
def test_token_id_outside_the_vocabulary_fails_the_step(handler, bad_token):
    (failed,) = run(handler, [ticket(1, [(0, 1), (1, 1)], [start(0, "a"), start(1, "b")]), output(1, [5, bad_token])])
    assert [(e.request_id, e.error_code) for e in failed.events.events] == [("a", INTERNAL), ("b", INTERNAL)]
    assert "outside [0, 49152)" in failed.events.events[0].error_message


def test_aborted_ids_end_with_abort_in_that_step(handler, tokenizer):
    hi, there = tokenizer.encode("Hi there", add_special_tokens=False)
    run(handler, [ticket(1, [(0, 1), (1, 1)], [start(0, "keep"), start(1, "gone", stop=["XYZ"])]), output(1, [hi, hi])])
    # the aborted request still has a row in step 2 (scheduled before prepare saw the abort): discarded
    (step2,) = run(handler, [ticket(2, [(0, 1), (1, 1)], aborted=["gone", "never-started"]), output(2, [there, there])])
    events = {e.request_id: e for e in step2.events.events}
    assert set(events) == {"keep", "gone"}
    assert events["gone"].finish_reason == ABORT and events["gone"].completion_tokens == 1
    assert events["keep"].text == " there" and events["keep"].finish_reason == 0


def test_abort_after_finish_is_ignored(handler):
    run(handler, [ticket(1, [(0, 1)], [start(0, "done")]), output(1, [EOS])])
    (step2,) = run(handler, [ticket(2, aborted=["done"]), output(2)])
    assert len(step2.events.events) == 0


def test_abort_of_a_step_that_times_out_still_aborts(handler):
    run(handler, [ticket(1, [(0, 1)], [start(0, "a")]), output(1, [5])])
    run(handler, [ticket(2, aborted=["a"])], now_s=0.0)
    (step2,) = handler.expire(TIMEOUT_S)
    assert [(e.request_id, e.finish_reason, e.error_code) for e in step2.events.events] == [("a", ABORT, 0)]


def test_lost_stream_fails_held_steps_then_the_rest(handler, tokenizer):
    run(handler, [ticket(1, [(0, 1)], [start(0, "a"), start(1, "idle")]), output(1, [5])])
    run(handler, [ticket(2, [(0, 1)])])
    outcomes = handler.fail_in_flight("device stream lost")
    assert [(o.events.ticket, o.release_ticket) for o in outcomes] == [(2, 0), (0, 0)]
    assert [[e.request_id for e in o.events.events] for o in outcomes] == [["a"], ["idle"]]
    assert all(e.error_code == UNAVAILABLE for o in outcomes for e in o.events.events)
    assert handler.live_count == 0 and handler.next_deadline_s() is None
    assert handler.fail_in_flight("again") == []


def test_seq_index_reused_while_live_fails_the_older_request(handler):
    run(handler, [ticket(1, [(0, 1)], [start(0, "old")]), output(1, [5])])
    (step2,) = run(handler, [ticket(2, [(0, 2)], [start(0, "young", generation=2)]), output(2, [6])])
    events = {e.request_id: e for e in step2.events.events}
    assert events["old"].error_code == INTERNAL and "reused" in events["old"].error_message
    assert events["young"].error_code == 0 and list(events["young"].token_ids) == [6]


def test_seq_index_reused_in_the_ticket_that_aborts_it_ends_the_older_with_abort(handler):
    run(handler, [ticket(1, [(0, 1)], [start(0, "old", stop=["XYZ"])]), output(1, [72])])  # 72 = "X": held back
    (step2,) = run(handler, [ticket(2, [(0, 2)], [start(0, "young", generation=2)], aborted=["old"]), output(2, [6])])
    events = {e.request_id: e for e in step2.events.events}
    assert events["old"].finish_reason == ABORT and events["old"].error_code == 0
    assert events["old"].text == "X"  # the held-back tail is released with the abort
    assert list(events["young"].token_ids) == [6]


def test_seq_index_outside_the_table_fails_that_request(handler):
    (step1,) = run(handler, [ticket(1, [(9, 1)], [start(9, "far")]), output(1, [5])])
    assert [(e.request_id, e.error_code) for e in step1.events.events] == [("far", INTERNAL)]
    assert handler.live_count == 0


def test_logprobs_go_to_the_rows_that_asked(handler):
    lp = [common_pb2.TokenLogprob(token_id=5, logprob=-0.5, top_token_ids=[5, 6], top_logprobs=[-0.5, -1.0]), common_pb2.TokenLogprob()]
    started = [start(0, "wants", logprobs=2), start(1, "not")]
    (step1,) = run(handler, [ticket(1, [(0, 1), (1, 1)], started), output(1, [5, 7], logprobs=lp)])
    events = {e.request_id: e for e in step1.events.events}
    assert list(events["wants"].logprobs) == [lp[0]]
    assert len(events["not"].logprobs) == 0


def test_reused_ticket_id_is_a_protocol_error(handler):
    run(handler, [ticket(1)])
    with pytest.raises(DeviceProtocolError):
        run(handler, [ticket(1)])
    with pytest.raises(DeviceProtocolError):
        run(handler, [device_pb2.CompletionEvent()])
