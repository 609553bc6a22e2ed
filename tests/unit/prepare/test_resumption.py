"""``Resumption``: a request resumed after its device failed continues from its last settled token;
what the new sequence regenerates is dropped, checked, so the client sees each token and character once."""

from __future__ import annotations

import grpc
import pytest

from stageserve.prepare.errors import RequestError
from stageserve.prepare.resumption import Resumption
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import common_pb2, reclaim_pb2

PROMPT = [5, 6, 7]


def request() -> GenerationRequest:
    return GenerationRequest("r", PROMPT, 10, common_pb2.SamplingParams(seed=3), common_pb2.StopParams(max_tokens=10, min_tokens=4))


def event(ids, text, completion, settled=True, finish=0) -> reclaim_pb2.SequenceEvent:
    return reclaim_pb2.SequenceEvent(token_ids=ids, text=text, completion_tokens=completion, prompt_tokens=len(PROMPT),
                                     settled=settled, finish_reason=finish)


def test_a_resumed_sequence_goes_on_from_the_last_settled_token_and_shows_nothing_twice():
    resumption = Resumption(request())
    assert resumption.translate(event([10], "a", 1)) is not None
    assert resumption.translate(event([11, 12], "b", 3, settled=False)) is not None  # "b" and a held-back tail
    resumed = resumption.resumed_request()
    assert resumed.prompt_token_ids == PROMPT + [10] and resumed.output_offset == 1 and resumed.max_tokens == 9
    assert (resumed.stop.max_tokens, resumed.stop.min_tokens, resumed.stop.prompt_tokens) == (9, 3, 4)
    # The new sequence regenerates 11, 12 (text "b" and what was held back: "c"), then goes on.
    assert resumption.translate(event([11], "", 1, settled=False)) is None  # nothing new to show
    shown = resumption.translate(event([12, 13], "bcd", 3))
    assert (list(shown.token_ids), shown.text, shown.completion_tokens, shown.prompt_tokens) == ([13], "cd", 4, 3)
    assert resumption.generated == [10, 11, 12, 13] and resumption.settled == 4
    last = resumption.translate(event([14], "e", 4, finish=common_pb2.FINISH_REASON_LENGTH))
    assert (list(last.token_ids), last.text, last.completion_tokens, last.finish_reason) == ([14], "e", 5, common_pb2.FINISH_REASON_LENGTH)


def test_a_second_failure_while_regenerating_resumes_from_the_same_point():
    resumption = Resumption(request())
    resumption.translate(event([10], "a", 1))
    resumption.translate(event([11], "b", 2, settled=False))
    resumption.resumed_request()
    assert resumption.translate(event([11, 12], "bc", 2, settled=False)).text == "c"  # "c" is new
    again = resumption.resumed_request()
    assert again.prompt_token_ids == PROMPT + [10]
    shown = resumption.translate(event([11, 12, 13], "bcd", 3))
    assert (list(shown.token_ids), shown.text) == ([13], "d")


def test_diverging_tokens_fail_the_request():
    resumption = Resumption(request())
    resumption.translate(event([10], "a", 1, settled=False))
    resumption.resumed_request()
    with pytest.raises(RequestError) as diverged:
        resumption.translate(event([99], "z", 1))
    assert diverged.value.code == grpc.StatusCode.UNAVAILABLE and "position 0" in diverged.value.message
