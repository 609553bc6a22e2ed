"""Request validation with the embedded model's real tokenizer: every bad field is
INVALID_ARGUMENT with a message naming the field; defaults are filled in."""

from __future__ import annotations

import math

import grpc
import pytest

from stageserve.prepare.errors import RequestError
from stageserve.prepare.validation import (
    DEFAULT_MAX_TOKENS,
    ModelLimits,
    tokenize_prompt,
    validate_generate_request,
    validate_request_id,
)
from stageserve.v1 import common_pb2, prepare_pb2

LIMITS = ModelLimits(vocab_size=49152, max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer():
    from stageserve.model_files import embedded_model_path
    from stageserve.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())


def validate(tokenizer, limits=LIMITS, **fields):
    return validate_generate_request(prepare_pb2.GenerateRequest(**fields), "req-1", tokenizer, limits)


def refused(tokenizer, limits=LIMITS, **fields) -> str:
    with pytest.raises(RequestError) as error:
        validate(tokenizer, limits, **fields)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return error.value.message


def user(text: str) -> prepare_pb2.ChatMessage:
    return prepare_pb2.ChatMessage(role="user", content=text)


def test_defaults_are_filled_in(tokenizer):
    request = validate(tokenizer, prompt="Hello there")
    assert request.request_id == "req-1"
    assert request.prompt_token_ids == tokenizer.encode("Hello there")
    assert request.max_tokens == DEFAULT_MAX_TOKENS
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert 0 <= sampling.seed < 2**63
    assert request.stop.max_tokens == DEFAULT_MAX_TOKENS and request.stop.prompt_tokens == len(request.prompt_token_ids)
    assert validate(tokenizer, prompt="Hello there").sampling.seed != sampling.seed  # random per request


def test_explicit_values_are_kept(tokenizer):
    request = validate(
        tokenizer, prompt_token_ids=[1, 2, 3], max_tokens=7, temperature=0.0, top_p=0.5, top_k=40, min_p=0.1,
        repetition_penalty=1.3, seed=11, stop=["\n"], stop_token_ids=[5], ignore_eos=True, min_tokens=2, logprobs=20,
        include_stop_str_in_output=True,
    )
    assert request.prompt_token_ids == [1, 2, 3] and request.max_tokens == 7
    assert request.sampling.temperature == 0.0 and math.isclose(request.sampling.top_p, 0.5) and request.sampling.top_k == 40
    assert request.sampling.seed == 11 and request.sampling.logprobs == 20
    stop = request.stop
    assert (list(stop.stop), list(stop.stop_token_ids), stop.ignore_eos, stop.min_tokens, stop.include_stop_str_in_output) == (["\n"], [5], True, 2, True)
    assert stop.prompt_tokens == 3


def test_chat_messages_use_the_chat_template(tokenizer):
    messages = [prepare_pb2.ChatMessage(role="system", content="Be brief."), user("What is the capital of France?")]
    request = validate(tokenizer, messages=messages)
    expected = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert request.prompt_token_ids == list(expected)
    assert tokenizer.decode(request.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_default_max_tokens_is_capped_by_the_remaining_context(tokenizer):
    request = validate(tokenizer, ModelLimits(49152, 20), prompt_token_ids=list(range(12)))
    assert request.max_tokens == 8
    assert validate(tokenizer, ModelLimits(49152, 20), prompt_token_ids=list(range(12)), max_tokens=8).max_tokens == 8


def test_tokenize_prompt_matches_validation(tokenizer):
    assert tokenize_prompt(tokenizer, messages=[user("hi")]) == validate(tokenizer, messages=[user("hi")]).prompt_token_ids


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(), "set exactly one of prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", prompt_token_ids=[1]), "prompt and prompt_token_ids"),
        (dict(prompt="hi", messages=[user("hi")]), "prompt and messages"),
        (dict(messages=[prepare_pb2.ChatMessage(role="wizard", content="hi")]), "messages[0].role: 'wizard' is not one of system, user, assistant, tool"),
        (dict(prompt_token_ids=[1, 49152]), "prompt_token_ids[1]: token id 49152 is outside the vocabulary [0, 49152)"),
        (dict(prompt_token_ids=[-3]), "prompt_token_ids[0]"),
        (dict(prompt="hi", max_tokens=0), "max_tokens: must be at least 1"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", temperature=math.inf), "temperature"),
        (dict(prompt="hi", temperature=math.nan), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p: 0.0 is outside (0, 1]"),
        (dict(prompt="hi", top_p=1.5), "top_p: 1.5 is outside (0, 1]"),
        (dict(prompt="hi", top_p=math.nan), "top_p"),
        (dict(prompt="hi", min_p=-0.1), "min_p"),
        (dict(prompt="hi", min_p=1.5), "min_p: 1.5 is outside [0, 1]"),
        (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
        (dict(prompt="hi", repetition_penalty=-1.0), "repetition_penalty"),
        (dict(prompt="hi", logprobs=21), "logprobs: 21 is more than the maximum of 20"),
        (dict(prompt="hi", max_tokens=4, min_tokens=5), "min_tokens: 5 is more than max_tokens (4)"),
        (dict(prompt="hi", stop=[f"s{i}" for i in range(17)]), "stop: 17 strings is more than the maximum of 16"),
        (dict(prompt="hi", stop=["ok", ""]), "stop[1]: empty"),
        (dict(prompt="hi", stop_token_ids=[60000]), "stop_token_ids[0]"),
        (dict(prompt="hi", top_k=49153), "top_k: 49153 is more than the vocabulary (49152 tokens)"),
    ],
)
def test_bad_field_is_invalid_argument_naming_it(tokenizer, fields, expected):
    assert expected in refused(tokenizer, **fields)


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers(tokenizer):
    message = refused(tokenizer, ModelLimits(49152, 20), prompt_token_ids=list(range(12)), max_tokens=9)
    assert "max_tokens" in message and "12" in message and "9" in message and "20" in message and "<= 8" in message


def test_prompt_that_fills_the_context_is_refused(tokenizer):
    message = refused(tokenizer, ModelLimits(49152, 20), prompt_token_ids=list(range(20)))
    assert "20 tokens" in message and "at most 19" in message


def test_text_that_cannot_fit_is_refused_before_tokenizing(tokenizer, monkeypatch):
    """Megabytes of prompt are refused from their length alone: the tokenizer is never called."""
    limits = ModelLimits(49152, 64)
    validate(tokenizer, limits, prompt="x")  # fills the longest-token cache, which reads the vocabulary
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a prompt that cannot fit"))
    message = refused(tokenizer, limits, prompt="word " * 200_000)
    assert "prompt: 1000000 characters cannot fit in the model's context of 64 tokens" in message
    message = refused(tokenizer, limits, messages=[user("word " * 200_000)])
    assert message.startswith("messages: 1000000 characters")


def test_request_id_checks():
    assert validate_request_id("abc-123") == "abc-123"
    for bad, expected in (("x" * 257, "257 characters"), ("héllo", "printable ASCII"), ("a\nb", "printable ASCII")):
        with pytest.raises(RequestError) as error:
            validate_request_id(bad)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and expected in error.value.message


@pytest.mark.parametrize("fields, message", [
    ({"constraint": common_pb2.Constraint(regex="[a-")}, "constraint.regex: Regex parsing error at position 4: Unclosed '['"),
    ({"constraint": common_pb2.Constraint(regex="a"), "ignore_eos": True}, "ignore_eos: cannot be combined with a constraint"),
    ({"constraint": common_pb2.Constraint(regex="a"), "min_tokens": 2}, "min_tokens: cannot be combined with a constraint"),
])
def test_bad_constraints_are_refused(tokenizer, fields, message):
    with pytest.raises(RequestError) as refused:
        validate_generate_request(prepare_pb2.GenerateRequest(prompt="Hi", **fields), "r", tokenizer, LIMITS)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.message.startswith(message)


def test_a_constraint_is_kept_and_none_is_none(tokenizer):
    constraint = common_pb2.Constraint(choice=common_pb2.Choice(options=["a", "b"]))
    request = validate_generate_request(prepare_pb2.GenerateRequest(prompt="Hi", constraint=constraint), "r", tokenizer, LIMITS)
    assert request.constraint == constraint
    assert validate_generate_request(prepare_pb2.GenerateRequest(prompt="Hi"), "r", tokenizer, LIMITS).constraint is None


TOOL_TEMPLATE = (  # a template that shows tools, tool calls, tool results and a template variable, as Qwen's do
    "{% for t in tools or [] %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is false %}(no thinking){% endif %}{% endif %}")


def test_tools_tool_history_and_template_kwargs_reach_the_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TOOL_TEMPLATE)
    messages = [user("Weather?"),
                prepare_pb2.ChatMessage(role="assistant", tool_calls=[prepare_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')]),
                prepare_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="c1")]
    tools = [prepare_pb2.Tool(name="get_weather", parameters='{"type": "object"}')]
    request = validate(tokenizer, messages=messages, tools=tools, chat_template_kwargs='{"enable_thinking": false}')
    assert tokenizer.decode(request.prompt_token_ids) == (
        '[tool get_weather {"type": "object"}]<user>Weather?<assistant>[call c1 get_weather Oslo]<tool>sunny[for c1]'
        '<assistant>(no thinking)')


@pytest.mark.parametrize("fields, message", [
    (dict(prompt="hi", tools=[prepare_pb2.Tool(name="f")]), "tools: only with messages"),
    (dict(messages=[user("hi")], chat_template_kwargs="[1]"), "chat_template_kwargs: must be a JSON object"),
    (dict(messages=[user("hi")], chat_template_kwargs='{"tools": 1}'), "chat_template_kwargs.tools: set by the server"),
    (dict(messages=[user("hi")], tools=[prepare_pb2.Tool(name="f", parameters="{")]), "tools[0].parameters: not valid JSON"),
    (dict(messages=[prepare_pb2.ChatMessage(role="assistant", tool_calls=[prepare_pb2.ToolCall(name="f", arguments="1")])]),
     "messages[0].tool_calls[0].arguments: must be a JSON object"),
    (dict(messages=[user("hi")], tools=[prepare_pb2.Tool(name="f")] * 129), "tools: 129 tools is more than the maximum of 128"),
])
def test_bad_tools_or_template_kwargs_are_refused(tokenizer, fields, message):
    assert message in refused(tokenizer, **fields)


def test_embedding_inputs_become_one_pooled_prefill_each(tokenizer):
    from stageserve.prepare.embeddings import embedding_requests

    texts = embedding_requests(prepare_pb2.EmbedRequest(input=["Hello", "a b c"]), "e", tokenizer, LIMITS, common_pb2.POOLING_MEAN)
    assert [r.request_id for r in texts] == ["e#0", "e#1"] and [r.prompt_token_ids for r in texts] == [tokenizer.encode("Hello"), tokenizer.encode("a b c")]
    assert all(r.pooling == common_pb2.POOLING_MEAN and r.max_tokens == 1 and r.sampling.temperature == 0 for r in texts)
    ids = embedding_requests(prepare_pb2.EmbedRequest(input_token_ids=[prepare_pb2.TokenIds(token_ids=[5, 6])]), "e", tokenizer, LIMITS,
                             common_pb2.POOLING_LAST)
    assert ids[0].prompt_token_ids == [5, 6] and ids[0].pooling == common_pb2.POOLING_LAST


@pytest.mark.parametrize("request_fields, code, words", [
    ({"input": ["x"]}, grpc.StatusCode.FAILED_PRECONDITION, "does not serve embeddings"),  # pooling NONE, below
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "input: set exactly one"),
    ({"input": ["x"], "input_token_ids": [prepare_pb2.TokenIds(token_ids=[1])]}, grpc.StatusCode.INVALID_ARGUMENT, "input: set exactly one"),
    ({"input": ["ok", ""]}, grpc.StatusCode.INVALID_ARGUMENT, "input[1]: empty"),
    ({"input_token_ids": [prepare_pb2.TokenIds(token_ids=[1] * 512)]}, grpc.StatusCode.INVALID_ARGUMENT, "input[0]: prompt: 512 tokens"),
    ({"input": ["x"] * 2049}, grpc.StatusCode.INVALID_ARGUMENT, "at most 2048"),
])
def test_bad_embedding_requests_say_what_to_change(tokenizer, request_fields, code, words):
    from stageserve.prepare.embeddings import embedding_requests

    pooling = common_pb2.POOLING_NONE if code == grpc.StatusCode.FAILED_PRECONDITION else common_pb2.POOLING_MEAN
    with pytest.raises(RequestError) as error:
        embedding_requests(prepare_pb2.EmbedRequest(**request_fields), "e", tokenizer, LIMITS, pooling)
    assert error.value.code == code and words in error.value.message, error.value.message
