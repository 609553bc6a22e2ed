"""The OpenAI request bodies as the gRPC API's GenerateRequest, and what is refused before validation."""

from __future__ import annotations

import json

import pytest

from stageserve.prepare.errors import RequestError
from stageserve.prepare.openai_api import _parse
from stageserve.prepare.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_request, completion_request
from stageserve.prepare.openai_tolerance import IGNORED_FIELDS
from stageserve.v1 import common_pb2

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}


def test_chat_body_maps_every_sampling_field():
    body = _parse(ChatCompletionRequest, {**CHAT, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": -1, "stop": "\n",
                                          "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": -3},
                                          "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 9, "user": "u1", "tools": None})
    request = chat_request(body)
    assert [(m.role, m.content) for m in request.messages] == [("user", "Hi there")]
    assert (request.temperature, request.top_p, request.n, request.max_tokens, request.logprobs) == (0.5, pytest.approx(0.9), 2, 9, 4)
    assert request.seed == (1 << 64) - 1 and list(request.stop) == ["\n"] and dict(request.logit_bias) == {7: -3.0}
    assert (request.presence_penalty, request.frequency_penalty, request.user) == (0.5, -0.5, "u1")
    assert not request.HasField("repetition_penalty")  # unset fields keep the gRPC API's defaults


def test_completion_defaults_to_openais_max_tokens_and_takes_token_ids():
    request = completion_request(_parse(CompletionRequest, {"model": "m", "prompt": [[1, 2, 3]], "logprobs": 0}))
    assert list(request.prompt_token_ids) == [1, 2, 3] and request.max_tokens == 16 and request.logprobs == 1


@pytest.mark.parametrize("extra, constraint", [
    ({"response_format": {"type": "json_object"}}, common_pb2.Constraint(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}}},
     common_pb2.Constraint(json_schema='{"type": "integer"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, common_pb2.Constraint(json_object=True)),
    ({"structured_outputs": {"json": {"type": "integer"}}}, common_pb2.Constraint(json_schema='{"type": "integer"}')),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, common_pb2.Constraint(choice=common_pb2.Choice(options=["yes", "no"]))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, common_pb2.Constraint(regex="[0-9]+")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, common_pb2.Constraint(grammar='root ::= "a"')),
])
def test_response_format_and_structured_outputs_map_onto_the_constraint(extra, constraint):
    assert chat_request(_parse(ChatCompletionRequest, {**CHAT, **extra})).constraint == constraint
    assert completion_request(_parse(CompletionRequest, {"model": "m", "prompt": "x", **extra})).constraint == constraint


def test_text_response_format_is_no_constraint():
    request = chat_request(_parse(ChatCompletionRequest, {**CHAT, "response_format": {"type": "text"}}))
    assert not request.HasField("constraint")


@pytest.mark.parametrize("body, message", [
    ({**CHAT, "tools": [{"type": "function"}]}, "tools.0.function: Field required"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name: 'g' is not"),
    ({**CHAT, "tools": [TOOL, TOOL]}, "tools: two functions share a name"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
     "tools: the parameters cannot constrain a forced call"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities: only text output"),
    ({**CHAT, "audio": {"voice": "alloy"}}, "audio: audio output is not served"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions: the legacy functions field"),
    ({**CHAT, "messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format: cannot be combined"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema: required"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs: set exactly one"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens: differs"),
    ({**CHAT, "logit_bias": {"the": 1}}, "logit_bias: key 'the' is not a token id"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo: true is not supported"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of: only 1"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt: a list of 2 prompts"),
    ({"model": "m", "prompt": "x", "n": -1}, "n: -1 is negative"),
    # Past the wire's integer widths: refused naming the field (the protobuf assignment would raise, a 500).
    ({**CHAT, "max_tokens": 5_000_000_000}, "max_tokens: 5000000000 is too large"),
    ({**CHAT, "top_k": 2**32}, "top_k: 4294967296 is too large"),
    ({**CHAT, "logit_bias": {"5000000000": 1.0}}, "logit_bias: token id 5000000000 is out of range"),
    ({**CHAT, "stop_token_ids": [2**31]}, "stop_token_ids: token id 2147483648 is out of range"),
    ({"model": "m", "prompt": [5_000_000_000]}, "prompt: token id 5000000000 is out of range"),
])
def test_unsupported_values_are_refused_naming_the_field(body, message):
    model, convert = (ChatCompletionRequest, chat_request) if "messages" in body else (CompletionRequest, completion_request)
    with pytest.raises(RequestError, match="^" + message.replace("(", r"\(")) as refused:
        convert(_parse(model, body))
    assert refused.value.code.name == "INVALID_ARGUMENT"


def test_fields_that_cannot_change_the_result_are_ignored(caplog):
    harmless = {"metadata": {"k": "v"}, "store": True, "service_tier": "auto", "modalities": ["text"], "reasoning_effort": "low",
                "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": False, "best_of": 1,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False},
                "a_field_nobody_knows": 1}
    assert set(harmless) - {"modalities", "best_of", "stream_options", "a_field_nobody_knows", "parallel_tool_calls"} <= set(IGNORED_FIELDS)
    with caplog.at_level("DEBUG", logger="stageserve.prepare.openai_tolerance"):
        body = _parse(ChatCompletionRequest, {**CHAT, **harmless})
        _parse(ChatCompletionRequest, {**CHAT, **harmless})  # logged once per field name
    assert chat_request(body) == chat_request(_parse(ChatCompletionRequest, CHAT))
    assert body.include_usage and body.continuous_usage
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'metadata' ignored" in line for line in logged) == 1
    assert any("'a_field_nobody_knows' is not known" in line for line in logged)


def test_developer_role_is_system_and_tool_history_reaches_the_template_fields():
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    request = chat_request(_parse(ChatCompletionRequest, {"model": "m", "messages": messages, "tools": [TOOL],
                                                          "chat_template_kwargs": {"enable_thinking": False}}))
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    call = request.messages[2].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert request.messages[3].tool_call_id == "call_1" and request.messages[2].content == ""
    assert [t.name for t in request.tools] == ["get_weather"] and request.chat_template_kwargs == '{"enable_thinking": false}'
    assert not request.HasField("constraint")  # auto: the model decides


def test_forced_tool_calls_are_constrained():
    named = chat_request(_parse(ChatCompletionRequest, {**CHAT, "tools": [TOOL],
                                                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert json.loads(named.constraint.json_schema) == TOOL["function"]["parameters"]
    required = chat_request(_parse(ChatCompletionRequest, {**CHAT, "tools": [TOOL], "tool_choice": "required",
                                                           "parallel_tool_calls": False}))
    schema = json.loads(required.constraint.json_schema)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    none = chat_request(_parse(ChatCompletionRequest, {**CHAT, "tools": [TOOL], "tool_choice": "none"}))
    assert not none.HasField("constraint") and len(none.tools) == 1
