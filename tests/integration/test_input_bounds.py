"""The public API's bounds and malformed messages on real services (the shared plaintext pipeline):
each over-limit request is refused with INVALID_ARGUMENT naming the limit (or RESOURCE_EXHAUSTED
for a message over the size limit), and the service answers the next request."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stageserve.prepare import limits
from stageserve.sampling_rules import MAX_LOGIT_BIAS, MAX_LOGPROBS
from stageserve.v1 import prepare_pb2

OVER_LIMIT = {
    "prompt": dict(prompt="x" * (limits.MAX_PROMPT_CHARS + 1)),
    "messages": dict(messages=[prepare_pb2.ChatMessage(role="user", content="hi")] * (limits.MAX_MESSAGES + 1)),
    "prompt_token_ids": dict(prompt_token_ids=[1] * (limits.MAX_PROMPT_TOKEN_IDS + 1)),
    "stop": dict(prompt="hi", stop=["s"] * (limits.MAX_STOP_STRINGS + 1)),
    "stop[0]": dict(prompt="hi", stop=["s" * (limits.MAX_STOP_STRING_CHARS + 1)]),
    "stop_token_ids": dict(prompt="hi", stop_token_ids=[1] * (limits.MAX_STOP_TOKEN_IDS + 1)),
    "logprobs": dict(prompt="hi", logprobs=MAX_LOGPROBS + 1),
    "logit_bias": dict(prompt="hi", logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    "n": dict(prompt="hi", n=limits.MAX_CHOICES + 1),
}


def answers_next(generation) -> None:
    reply = generation.Generate(prepare_pb2.GenerateRequest(prompt="Hello", max_tokens=2, temperature=0.0), timeout=120)
    assert len(reply.token_ids) == 2


@pytest.mark.parametrize("field", list(OVER_LIMIT))
def test_each_bound_is_invalid_argument_naming_the_field(generation, field):
    with pytest.raises(grpc.RpcError) as refused:
        generation.Generate(prepare_pb2.GenerateRequest(**OVER_LIMIT[field]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}: ") and "is more than the maximum of" in refused.value.details()
    (violation,) = next(detail for detail in _details(refused.value) if isinstance(detail, error_details_pb2.BadRequest)).field_violations
    assert violation.field == field
    answers_next(generation)


def _details(error: grpc.RpcError) -> list:
    status = rpc_status.from_call(error)
    found = []
    for packed in status.details:
        for kind in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo):
            if packed.Is(kind.DESCRIPTOR):
                detail = kind()
                packed.Unpack(detail)
                found.append(detail)
    return found


def test_tokenize_refuses_a_prompt_over_the_bound(generation):
    with pytest.raises(grpc.RpcError) as refused:
        generation.Tokenize(prepare_pb2.TokenizeRequest(prompt="x" * (limits.MAX_PROMPT_CHARS + 1)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum of 1048576" in refused.value.details()
    assert generation.Tokenize(prepare_pb2.TokenizeRequest(prompt="Hello"), timeout=60).count >= 1


def test_a_message_over_the_size_limit_is_resource_exhausted(generation):
    with pytest.raises(grpc.RpcError) as refused:
        generation.Tokenize(prepare_pb2.TokenizeRequest(prompt="x" * (limits.MAX_REQUEST_BYTES + 1)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    answers_next(generation)


@pytest.mark.parametrize("service", ["prepare", "reclaim"])
def test_undecodable_messages_are_invalid_argument(pipeline, generation, service):
    method = {"prepare": "/stageserve.v1.Generation/GenerateStream", "reclaim": "/stageserve.v1.Reclaim/Subscribe"}[service]
    with grpc.insecure_channel(getattr(pipeline, service).address) as channel:  # no serializers: raw bytes
        with pytest.raises(grpc.RpcError) as refused:
            list(channel.unary_stream(method)(b"\xff\xff", timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode as its protobuf type" in refused.value.details()
    answers_next(generation)
