"""The OpenAI-compatible HTTP API end to end, with the official ``openai`` SDK and third-party
clients from PyPI (LangChain's ``ChatOpenAI``, the OpenAI Agents SDK), through three real service
processes on loopback (prepare with ``--http-port 0``), started once for the module."""

from __future__ import annotations

import json

import agents
import grpc
import httpx
import jsonschema
import langchain_openai
import openai
import pytest
import torch

from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

from .conftest import launch
from .test_generation_api import wait_kv_all_free

SERVED_NAME, EMBEDDED_NAME = "smol", "SmolLM2-135M-Instruct"  # --served-model-name: shown, and an alias
# A small sequence table and queue, so that test_full_queue_is_rate_limited can fill them.
MAX_NUM_SEQS = 4
MAX_WAITING = 4  # at least n of test_n_choices: its choices wait together
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                         "parameters": WEATHER_SCHEMA}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now in a timezone",
                                              "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                                                             "required": ["tz"], "additionalProperties": False}}}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pipeline = launch(tmp_path_factory, "openai-api", device_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
                      prepare_args=["--http-port", "0", "--max-waiting", str(MAX_WAITING),
                                    "--served-model-name", SERVED_NAME, EMBEDDED_NAME, "--reasoning-parser", "qwen3"])
    try:
        yield pipeline
    finally:
        pipeline.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{served.prepare.http_port}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def generation(served):
    with grpc.insecure_channel(served.prepare.address) as channel:
        yield prepare_pb2_grpc.GenerationStub(channel)


def test_models_lists_the_served_model(client, generation):
    models = client.models.list().data
    assert [m.id for m in models] == [generation.GetModelInfo(prepare_pb2.GetModelInfoRequest()).model_name] == [SERVED_NAME]
    alias = client.completions.create(model=EMBEDDED_NAME, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert alias.model == SERVED_NAME and alias.choices[0].text


def test_tokenize_and_detokenize_over_http(served, tokenizer):
    base = f"http://127.0.0.1:{served.prepare.http_port}"
    chat = httpx.post(f"{base}/tokenize", json={"model": SERVED_NAME, "messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] > 0 and chat["token_strs"] is None
    text = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert text["tokens"] == tokenizer.encode("Hello world") and text["token_strs"] == tokenizer.convert_ids_to_tokens(text["tokens"])
    assert httpx.post(f"{base}/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello world"}
    refused = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base}/tokenize", json={"model": "gpt-4o", "prompt": "x"}).status_code == 404


def test_metrics_on_the_api_port(served, client, model):
    client.completions.create(model=model, prompt="Hi", max_tokens=2)
    scraped = httpx.get(f"http://127.0.0.1:{served.prepare.http_port}/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    assert "stageserve_time_to_first_token_seconds_count" in scraped.text


def test_chat_completion(client, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=24)
    assert reply.object == "chat.completion" and len(reply.choices) == 1
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_with_usage_equals_the_whole_text(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_text_completion(client, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert reply.object == "text_completion" and "Paris" in reply.choices[0].text
    assert reply.usage.completion_tokens <= 8
    streamed = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_n_choices_differ_and_seed_reproduces_them(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Write a word."}], n=3, temperature=1.0, max_tokens=12, seed=1234)
    first, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]  # seed reproduces every choice
    assert len(set(texts)) > 1  # choices sample with seeds seed + i
    assert 3 <= first.usage.completion_tokens <= 3 * 12  # summed over the choices
    other = client.chat.completions.create(**{**kwargs, "seed": 99})
    assert [c.message.content for c in other.choices] != texts


def test_logprobs(client, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    text = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2)
    assert len(text.choices[0].logprobs.tokens) == 4 and all(len(top) == 2 for top in text.choices[0].logprobs.top_logprobs)


def test_stop(client, model):
    whole = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=12)
    assert " 7" in whole.choices[0].text
    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=12, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == whole.choices[0].text.split(" 7")[0]


def test_penalties_and_logit_bias_change_the_tokens(client, model, generation):
    prompt = "1 1 1 1 1 1 1 1"  # greedy goes on repeating " 1": the penalties then count it
    base = dict(model=model, prompt=prompt, temperature=0, max_tokens=8)
    plain = generation.Generate(prepare_pb2.GenerateRequest(prompt=prompt, temperature=0.0, max_tokens=8))
    assert client.completions.create(**base).choices[0].text == plain.text
    assert client.completions.create(**base, frequency_penalty=2.0).choices[0].text != plain.text
    assert client.completions.create(**base, presence_penalty=2.0).choices[0].text != plain.text
    first = plain.token_ids[0]
    biased = generation.Generate(prepare_pb2.GenerateRequest(prompt=prompt, temperature=0.0, max_tokens=8, logit_bias={first: -100.0}))
    assert biased.token_ids[0] != first
    assert client.completions.create(**base, logit_bias={str(first): -100}).choices[0].text == biased.text


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"extra_body": {"best_of": 2}}, "best_of"),
    ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),  # json_schema missing
])
def test_invalid_or_unsupported_parameter_is_a_bad_request_naming_it(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=CHAT, **fields)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param and param in refused.value.body["message"]
    assert refused.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_closing_a_stream_midway_frees_its_kv(client, model, generation):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to a hundred."}],
                                            max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream) for _ in range(4)]
    assert chunks[-1].choices[0].delta.content  # generating
    assert kv_used(generation) > 0
    stream.close()
    wait_kv_all_free(generation)


def test_full_queue_is_rate_limited(client, model, generation):
    long = dict(model=model, messages=[{"role": "user", "content": "Count to a hundred."}], max_tokens=200, stream=True,
                extra_body={"ignore_eos": True})
    streams = []
    try:
        for _ in range(MAX_NUM_SEQS):  # running: each has produced a token
            streams.append(client.chat.completions.create(**long))
            next(streams[-1]), next(streams[-1])
        for _ in range(MAX_WAITING):  # accepted (the response has started) and waiting
            streams.append(client.chat.completions.create(**long))
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(**long)
        assert refused.value.response.headers["retry-after"] == "1"
        assert "queue" in refused.value.body["message"]
    finally:
        for stream in streams:
            stream.close()
    wait_kv_all_free(generation)


def test_grpc_and_http_give_the_same_text(client, model, generation):
    grpc_reply = generation.Generate(prepare_pb2.GenerateRequest(
        messages=[prepare_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT], temperature=0.0, max_tokens=40))
    http_reply = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=40)
    assert http_reply.choices[0].message.content == grpc_reply.text
    assert http_reply.usage.completion_tokens == grpc_reply.usage.completion_tokens


def test_grpc_n_returns_every_choice(generation):
    reply = generation.Generate(prepare_pb2.GenerateRequest(prompt="Once upon a time", n=3, seed=7, max_tokens=6))
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.text == reply.choices[0].text
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    chunks = list(generation.GenerateStream(prepare_pb2.GenerateRequest(prompt="Once upon a time", n=3, seed=7, max_tokens=6)))
    for choice in reply.choices:
        assert "".join(c.text for c in chunks if c.index == choice.index) == choice.text


def test_health_and_bad_json(served, client, model):
    base = f"http://127.0.0.1:{served.prepare.http_port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    with pytest.raises(openai.NotFoundError) as unserved:  # a 404 in OpenAI's shape, naming what is served
        client.post("/images/generations", body={"model": model, "prompt": "hi"}, cast_to=dict)
    assert "POST /v1/images/generations: not served here" in unserved.value.body["message"]
    assert "POST /v1/embeddings" in unserved.value.body["message"]
    refused = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "body"


def test_fields_that_cannot_change_the_result_are_served(client, model):
    plain = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Answer briefly."}, *CHAT],
                                           temperature=0, max_tokens=16)
    tolerated = client.chat.completions.create(
        model=model, messages=[{"role": "developer", "content": "Answer briefly."}, *CHAT], temperature=0, max_tokens=16,
        user="u-1", metadata={"run": "7"}, store=False, service_tier="auto", modalities=["text"], reasoning_effort="low",
        prediction={"type": "content", "content": "Paris"}, parallel_tool_calls=True,
        extra_body={"an_unknown_field": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "add_generation_prompt": True, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    assert tolerated.choices[0].message.content == plain.choices[0].message.content  # developer = system, the rest ignored


def test_continuous_usage_stats_puts_usage_in_every_chunk(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None and u.prompt_tokens == usages[-1].prompt_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[0] == 0 and 0 < counts[-1] <= 12
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert chunks[-1].choices == [] and counts[-2] == counts[-1]  # the finish chunk already has the final count


def _arguments(call, schema: dict) -> dict:
    """A tool call's arguments, checked to parse and to satisfy ``schema``."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def _streamed_message(stream) -> tuple[str, dict[int, dict], str]:
    """A streamed chat choice 0 joined: its content, its tool calls by index (name, id, arguments), its finish reason."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content.append(delta.content or "")
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "id": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["id"] += part.id or ""
            call["arguments"] += part.function.arguments or ""
            json.loads(call["arguments"])  # every call is sent whole: what arrived so far parses
    return "".join(content), calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_it_with_arguments_matching_its_schema(client, model, stream):
    kwargs = dict(model=model, messages=WEATHER_CHAT, tools=[TOOL, TIME_TOOL], temperature=0, max_tokens=48,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert [c.function.name for c in message.tool_calls] == ["get_weather"] and message.tool_calls[0].id.startswith("call_")
        assert _arguments(message.tool_calls[0], WEATHER_SCHEMA)["unit"] in ("celsius", "fahrenheit")
        return
    content, calls, finish = _streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_makes_calls_that_match_their_schemas(client, model, stream):
    tools = [TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kwargs = dict(model=model, messages=WEATHER_CHAT, tools=tools, tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=64)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1  # parallel_tool_calls false: one call
        _arguments(calls[0], schemas[calls[0].function.name])
        return
    content, calls, finish = _streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])


def test_required_calls_cut_by_max_tokens_keep_the_calls_they_completed(client, model):
    kwargs = dict(model=model, messages=WEATHER_CHAT, tools=[TOOL, TIME_TOOL], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=64)
    assert whole.choices[0].finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    cut = dict(kwargs, max_tokens=whole.usage.completion_tokens - 1)  # the array's closing bracket is not generated
    reply = client.chat.completions.create(**cut)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content is None
    assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls] == expected
    content, calls, finish = _streamed_message(client.chat.completions.create(**cut, stream=True))
    assert content == "" and finish == "length" and [(c["name"], c["arguments"]) for c in calls.values()] == expected


def test_embeddings_by_the_sdk_in_base64_and_in_floats(client, model, tokenizer):
    texts = ["The capital of France is Paris.", "Paris is the capital city of France.", "Bananas are a yellow fruit."]
    sdk = client.embeddings.create(model=model, input=texts)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    vectors = torch.tensor([item.embedding for item in sdk.data])  # [3, hidden]
    assert [item.index for item in sdk.data] == [0, 1, 2] and vectors.shape == (3, 576)
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([item.embedding for item in floats.data]), vectors, atol=0.02, rtol=0)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[1, 2]  # meaning, not length
    assert sdk.usage.prompt_tokens == sdk.usage.total_tokens == sum(len(tokenizer.encode(text)) for text in texts)
    one = client.embeddings.create(model=model, input=[1, 9690, 198], encoding_format="float")  # token ids
    assert len(one.data) == 1 and one.usage.prompt_tokens == 3


@pytest.mark.parametrize("body, param", [({"input": "Hi", "dimensions": 8}, "dimensions"), ({"input": ""}, "input"),
                                         ({"input": []}, "input"), ({"input": [[1], [10**9]]}, "input")])
def test_bad_embeddings_requests_name_the_field(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/embeddings", body={"model": model, **body}, cast_to=dict)
    assert refused.value.body["param"] == param, refused.value.body


def test_a_tool_result_in_the_history_is_answered(client, model):
    first = client.chat.completions.create(model=model, messages=WEATHER_CHAT, tools=[TOOL], tool_choice="required",
                                           temperature=0, max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    history = [*WEATHER_CHAT, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=history, tools=[TOOL], temperature=0, max_tokens=24)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered into the prompt


def test_responses_api_plain_and_streamed(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Answer briefly."}, *CHAT],
                                          temperature=0, max_tokens=24)
    kwargs = dict(model=model, instructions="Answer briefly.", input=CHAT[0]["content"], temperature=0, max_output_tokens=24)
    reply = client.responses.create(**kwargs, store=False)
    assert reply.object == "response" and reply.status in ("completed", "incomplete")
    assert reply.output_text == chat.choices[0].message.content and reply.output[0].type == "message"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if reply.status == "completed" else "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text and [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_function_call_and_its_output(client, model):
    tool = {"type": "function", **TOOL["function"]}
    first = client.responses.create(model=model, input=WEATHER_CHAT[0]["content"], tools=[tool], temperature=0, max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[-1]  # after a reasoning item when the model thought first (--reasoning-parser qwen3)
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(client.responses.create(model=model, input=WEATHER_CHAT[0]["content"], tools=[tool], temperature=0,
                                          max_output_tokens=48, tool_choice="required", stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"] and json.loads(done[0].arguments) is not None
    second = client.responses.create(model=model, tools=[tool], temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": WEATHER_CHAT[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens


def test_responses_api_is_stateless(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id" and "whole conversation in input" in refused.value.body["message"]


# vLLM's structured_outputs covers the whole text: it forces the embedded model to write as Qwen3 does
THINKING = r"<think>[a-z ]{4,40}</think>[A-Z][a-z ]{2,30}\."


def test_reasoning_comes_apart_from_the_answer(client, model):
    kwargs = dict(model=model, messages=CHAT, temperature=0, max_tokens=48, extra_body={"structured_outputs": {"regex": THINKING}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning, answer = message.model_extra["reasoning_content"], message.content
    assert reasoning and answer and "<think>" not in reasoning + answer and "</think>" not in reasoning + answer
    assert answer[0].isupper() and answer.endswith(".")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer
    plain = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=8).choices[0].message
    assert plain.content and plain.model_extra["reasoning_content"] is None  # no <think>: all answer
    formatted = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": False}}}).choices[0].message
    assert json.loads(formatted.content).keys() == {"city"}  # the schema constrains the answer, after any reasoning
    response = client.responses.create(model=model, input=CHAT[0]["content"], temperature=0, max_output_tokens=48,
                                       extra_body={"structured_outputs": {"regex": THINKING}})
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == answer
    assert response.output[0].content[0].text == reasoning


WEATHER_REPORT = "sunny, 21 C"


def test_langchain_chat_openai_with_bound_tools(served, model):
    """LangChain's ChatOpenAI (PyPI ``langchain-openai``), unmodified: bind_tools, streamed tool calls, plain chat."""
    base_url = f"http://127.0.0.1:{served.prepare.http_port}/v1"
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                                "parameters": WEATHER_SCHEMA}}  # an OpenAI tool dict, as bind_tools takes one
    llm = langchain_openai.ChatOpenAI(model=model, base_url=base_url, api_key="unused", temperature=0, max_tokens=48, max_retries=0)
    message = llm.bind_tools([weather], tool_choice="get_weather").invoke(WEATHER_CHAT[0]["content"])
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_SCHEMA)
    streamed = list(llm.bind_tools([weather], tool_choice="required").stream(WEATHER_CHAT[0]["content"]))
    whole = streamed[0]
    for chunk in streamed[1:]:
        whole += chunk
    assert [call["name"] for call in whole.tool_calls] == ["get_weather"] and not whole.invalid_tool_calls
    answer = llm.invoke([("user", CHAT[0]["content"])])
    assert "Paris" in answer.content


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_tool(served, model, api):
    """The OpenAI Agents SDK (PyPI ``openai-agents``), unmodified, with a chat-completions or a Responses model."""
    base_url = f"http://127.0.0.1:{served.prepare.http_port}/v1"
    agents.set_tracing_disabled(True)  # no traces exported to OpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city.

        Args:
            city: the city's name.
        """
        return WEATHER_REPORT

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model_class = agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
    agent = agents.Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                         model=model_class(model=model, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, WEATHER_CHAT[0]["content"])
    assert result.final_output == WEATHER_REPORT
    calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1 and isinstance(json.loads(calls[0].arguments)["city"], str)


def kv_used(generation) -> int:
    info = generation.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    return info.kv_blocks_total - info.kv_blocks_free


def test_grpc_reads_the_models_tool_calls_when_asked(generation):
    """``parse_tool_calls``: the model's ``<tool_call>`` (forced here by a choice constraint) comes
    back as a structured call, whole and streamed; without it the text is what the model wrote."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    weather = prepare_pb2.Tool(name="get_weather", parameters=json.dumps(TOOL["function"]["parameters"]))
    request = prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content=WEATHER_CHAT[0]["content"])],
                                          tools=[weather], temperature=0.0, max_tokens=48, parse_tool_calls=True,
                                          constraint={"choice": {"options": [call]}})
    whole = generation.Generate(request, timeout=60)
    assert whole.text == "" and [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert whole.tool_calls[0].id.startswith("call_")
    chunks = list(generation.GenerateStream(request, timeout=60))
    assert "".join(c.text for c in chunks) == "" and [c.name for chunk in chunks for c in chunk.tool_calls] == ["get_weather"]
    request.parse_tool_calls = False
    assert generation.Generate(request, timeout=60).text == call
