"""Rows with several tokens (speculative decoding): published in order and cut exactly at a finish."""

from __future__ import annotations

from stageserve.v1 import device_pb2

from .test_completion import EOS, LENGTH, STOP, by_request, handler, run, start, ticket  # noqa: F401 - handler is a fixture


def spec_output(n: int, runs: list[list[int]], drafted: list[int]) -> device_pb2.CompletionEvent:
    """Output of ticket ``n``: row ``r`` emitted ``runs[r]`` (1 + accepted drafts) of ``drafted[r]`` drafts."""
    return device_pb2.CompletionEvent(output=device_pb2.StepOutput(
        ticket=n, step_id=100 + n, token_ids=[t for tokens in runs for t in tokens],
        num_tokens=[len(tokens) for tokens in runs], num_drafted=drafted))


def test_a_run_is_published_in_order_with_its_text_and_draft_counts(handler, tokenizer):
    ids = tokenizer.encode("Hello world! Goodbye", add_special_tokens=False)  # 5 tokens
    events = by_request(run(handler, [
        ticket(1, [(0, 1)], [start(0, "r1", max_tokens=10)]), spec_output(1, [ids[:1]], [0]),
        ticket(2, [(0, 1)]), spec_output(2, [ids[1:4]], [3]),
        ticket(3, [(0, 1)]), spec_output(3, [ids[4:]], [3]),
    ]))["r1"]
    assert [list(e.token_ids) for e in events] == [ids[:1], ids[1:4], ids[4:]]
    assert "".join(e.text for e in events) == "Hello world! Goodbye"
    assert [e.completion_tokens for e in events] == [1, 4, 5]
    assert [(e.draft_tokens, e.accepted_tokens) for e in events] == [(0, 0), (3, 2), (6, 2)]


def test_max_tokens_inside_a_run_cuts_it_there(handler, tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    events = by_request(run(handler, [ticket(1, [(0, 1)], [start(0, "r1", max_tokens=3)]), spec_output(1, [ids[:4]], [3])]))["r1"]
    assert list(events[0].token_ids) == ids[:3] and events[0].finish_reason == LENGTH
    assert events[0].completion_tokens == 3 and events[0].accepted_tokens == 3  # the 4th was accepted, not published


def test_stop_token_and_stop_string_inside_a_run_cut_it_there(handler, tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    steps = [ticket(1, [(0, 1), (1, 1)], [start(0, "eos"), start(1, "str", stop=[" there"])]),
             spec_output(1, [[*ids, EOS, ids[0]], [*ids, ids[0]]], [3, 2])]
    events = by_request(run(handler, steps))
    eos, string = events["eos"][0], events["str"][0]
    assert list(eos.token_ids) == [*ids, EOS] and eos.finish_reason == STOP and eos.stop_token_id == EOS
    assert eos.text == "Hi there"
    assert list(string.token_ids) == ids and string.finish_reason == STOP and string.stop_string == " there"
    assert string.text == "Hi"
    assert handler.live_count == 0


def test_counts_that_do_not_add_up_fail_the_step(handler):
    outcomes = run(handler, [ticket(1, [(0, 1)], [start(0, "r1")]), spec_output(1, [[5, 6]], [1])])
    assert not outcomes[0].events.error_code
    bad = device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=2, step_id=102, token_ids=[5, 6, 7], num_tokens=[2]))
    outcomes = run(handler, [ticket(2, [(0, 1)]), bad])
    assert outcomes[0].events.error_code and "token counts" in outcomes[0].events.error_message
