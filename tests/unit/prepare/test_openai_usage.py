"""The OpenAI response's usage: the speculative decoding counts appear only when a request drafted."""

from __future__ import annotations

from stageserve.prepare.openai_responses import ResponseBuilder
from stageserve.v1 import common_pb2, reclaim_pb2

STOP = common_pb2.FINISH_REASON_STOP


def finished(completion_tokens: int, draft_tokens: int = 0, accepted_tokens: int = 0) -> reclaim_pb2.SequenceEvent:
    return reclaim_pb2.SequenceEvent(text="hi", finish_reason=STOP, completion_tokens=completion_tokens,
                                     draft_tokens=draft_tokens, accepted_tokens=accepted_tokens)


def test_usage_carries_drafts_summed_over_choices_only_when_speculating():
    builder = ResponseBuilder(chat=True, request_id="r", model="m", n=2, top_logprobs=None, prompt_tokens=5, tokenizer=None)
    builder.add(0, finished(10, draft_tokens=11, accepted_tokens=10))
    builder.add(1, finished(4, draft_tokens=3, accepted_tokens=1))
    assert builder.response()["usage"] == {"prompt_tokens": 5, "completion_tokens": 14, "total_tokens": 19,
                                           "draft_tokens": 14, "accepted_tokens": 11}
    plain = ResponseBuilder(chat=False, request_id="r", model="m", n=1, top_logprobs=None, prompt_tokens=5, tokenizer=None)
    plain.add(0, finished(3))
    assert plain.usage() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
