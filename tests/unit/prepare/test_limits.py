"""The documented bounds of the public API (``limits.py``): every one refuses an over-limit request
with INVALID_ARGUMENT naming the field and the limit, before the tokenizer is called."""

from __future__ import annotations

import grpc
import pytest

from stageserve.prepare import limits
from stageserve.prepare.errors import RequestError
from stageserve.prepare.limits import check_tokenize_bounds
from stageserve.prepare.validation import ModelLimits, validate_generate_request
from stageserve.sampling_rules import MAX_LOGIT_BIAS, MAX_LOGPROBS
from stageserve.v1 import prepare_pb2


class NeverTokenizes:
    """A tokenizer stand-in that fails the test when anything is tokenized or rendered."""

    def __getattr__(self, name):
        pytest.fail(f"the tokenizer was used ({name}) for a request over a bound")


def message(text: str = "hi") -> prepare_pb2.ChatMessage:
    return prepare_pb2.ChatMessage(role="user", content=text)


OVER_LIMIT = [
    (dict(prompt="x" * (limits.MAX_PROMPT_CHARS + 1)), f"prompt: {limits.MAX_PROMPT_CHARS + 1} characters is more than the maximum"),
    (dict(messages=[message("x" * (limits.MAX_PROMPT_CHARS // 2))] * 3), "messages: "),
    (dict(messages=[message()] * (limits.MAX_MESSAGES + 1)), f"messages: {limits.MAX_MESSAGES + 1} messages is more than the maximum"),
    (dict(prompt_token_ids=[1] * (limits.MAX_PROMPT_TOKEN_IDS + 1)), "prompt_token_ids: "),
    (dict(prompt="hi", stop=["s"] * (limits.MAX_STOP_STRINGS + 1)), f"stop: {limits.MAX_STOP_STRINGS + 1} strings"),
    (dict(prompt="hi", stop=["ok", "s" * (limits.MAX_STOP_STRING_CHARS + 1)]), "stop[1]: "),
    (dict(prompt="hi", stop_token_ids=[1] * (limits.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids: "),
    (dict(prompt="hi", logprobs=MAX_LOGPROBS + 1), f"logprobs: {MAX_LOGPROBS + 1} is more than the maximum of {MAX_LOGPROBS}"),
    (dict(prompt="hi", logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), f"logit_bias: {MAX_LOGIT_BIAS + 1} entries"),
    (dict(prompt="hi", n=limits.MAX_CHOICES + 1), f"n: {limits.MAX_CHOICES + 1} is more than the maximum of {limits.MAX_CHOICES}"),
    (dict(prompt="hi", user="u" * (limits.MAX_USER_CHARS + 1)), "user: "),
    (dict(prompt="hi", cache_salt="s" * (limits.MAX_CACHE_SALT_CHARS + 1)), "cache_salt: "),
]


@pytest.mark.parametrize(("fields", "expected"), OVER_LIMIT, ids=[expected.split(":")[0] for _, expected in OVER_LIMIT])
def test_each_bound_is_refused_before_tokenizing(fields, expected):
    with pytest.raises(RequestError) as error:
        validate_generate_request(prepare_pb2.GenerateRequest(**fields), "req", NeverTokenizes(), ModelLimits(49152, 10**7))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.message.startswith(expected) and "maximum of" in error.value.message
    assert error.value.field == expected.split(":")[0]  # the BadRequest field violation


def test_tokenize_bounds():
    check_tokenize_bounds(prepare_pb2.TokenizeRequest(prompt="x" * limits.MAX_PROMPT_CHARS))
    with pytest.raises(RequestError) as error:
        check_tokenize_bounds(prepare_pb2.TokenizeRequest(messages=[message()] * (limits.MAX_MESSAGES + 1)))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and error.value.field == "messages"
