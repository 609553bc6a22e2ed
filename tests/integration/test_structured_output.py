"""Structured output end to end: constrained requests through three real service processes (async
dispatch, and one sync pipeline to compare), float32 and a context long enough for JSON outputs.
Requests are batched into few large runs so the whole file costs a few minutes."""

from __future__ import annotations

import ast
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import pytest

from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc

from .conftest import launch
from .structured_cases import ARITHMETIC_GRAMMAR, CHOICES, REGEXES, SCHEMAS
from .test_generation_api import PROMPTS, collect, wait_kv_all_free
from .test_observability import metric, scrape

STOP = common_pb2.FINISH_REASON_STOP
DEVICE_ARGS = ["--max-model-len", "1024"]
# The first batches prefill ~60 prompts at once: on a loaded shared machine one step can take longer
# than the default timeouts, which would fail these correctness tests for timing alone.
PREPARE_ARGS = ["--http-port", "0", "--stall-timeout", "300", "--step-timeout", "600"]
RECLAIM_ARGS = ["--completion-timeout", "600"]
MAX_TOKENS = 400  # every case's longest output is far shorter, so each one ends by its grammar
SEEDS = (1, 2, 3)


def start(tmp_path_factory, name: str, device_args: list[str] = ()):
    pipeline = launch(tmp_path_factory, name, device_args=[*DEVICE_ARGS, *device_args], prepare_args=PREPARE_ARGS, reclaim_args=RECLAIM_ARGS)
    channel = grpc.insecure_channel(pipeline.prepare.address)
    return pipeline, channel, prepare_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pipeline, channel, stub = start(tmp_path_factory, "structured-async")
    try:
        yield pipeline, stub
    finally:
        channel.close()
        pipeline.stop()


@pytest.fixture(scope="module")
def stub(served):
    return served[1]


def request(constraint: common_pb2.Constraint | None, content: str, seed: int = 0, temperature: float = 1.0,
            max_tokens: int = MAX_TOKENS) -> prepare_pb2.GenerateRequest:
    generate = prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content=content)], max_tokens=max_tokens,
                                           temperature=temperature, seed=seed)
    if constraint is not None:
        generate.constraint.CopyFrom(constraint)
    return generate


def schema_request(schema: dict, seed: int) -> prepare_pb2.GenerateRequest:
    return request(common_pb2.Constraint(json_schema=json.dumps(schema)), f"Reply with JSON matching this schema: {json.dumps(schema)}", seed)


def run_all(stub, requests: list[prepare_pb2.GenerateRequest]) -> list[tuple[str, list[int], list]]:
    """Stream every request at once (the device batches them); results in request order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: collect(stub.GenerateStream(r, timeout=600)), requests))


def test_twenty_json_schemas_at_temperature_one_give_valid_json(stub):
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    results = run_all(stub, [schema_request(schema, seed) for schema, seed in cases])
    for (schema, seed), (text, ids, chunks) in zip(cases, results):
        assert chunks[-1].finish_reason == STOP, (schema, seed, text)
        jsonschema.validate(json.loads(text), schema)
        assert chunks[-1].usage.completion_tokens == len(ids)


def test_regex_choice_and_grammar_outputs_are_valid(stub):
    regex = [(r, request(common_pb2.Constraint(regex=r), "Answer briefly.", seed)) for r in REGEXES for seed in SEEDS]
    choice = [(c, request(common_pb2.Constraint(choice=common_pb2.Choice(options=c)), f"Pick one of {', '.join(c)}.", seed))
              for c in CHOICES for seed in SEEDS]
    grammar = [request(common_pb2.Constraint(grammar=ARITHMETIC_GRAMMAR), "Write a sum of small numbers.", seed) for seed in SEEDS]
    results = run_all(stub, [r for _, r in regex] + [r for _, r in choice] + grammar)
    for (pattern, _), (text, _, chunks) in zip(regex, results):
        assert chunks[-1].finish_reason == STOP and re.fullmatch(pattern, text), (pattern, text)
    for (options, _), (text, _, chunks) in zip(choice, results[len(regex):]):
        assert chunks[-1].finish_reason == STOP and text in options, (options, text)
    for text, _, chunks in results[len(regex) + len(choice):]:
        assert chunks[-1].finish_reason == STOP and re.fullmatch(r"[0-9+\-() ]+", text), text
        ast.parse(text, mode="eval")  # a Python expression too: the grammar's parentheses balance


def test_a_mixed_batch_leaves_unconstrained_rows_as_they_are_alone(stub):
    """16 greedy requests at once, every other one constrained: the unconstrained produce exactly
    the tokens they produce alone, the constrained ones are valid."""
    schema = SCHEMAS[3]
    unconstrained = [request(None, prompt, temperature=0.0, max_tokens=16) for prompt in PROMPTS[:8]]
    constrained = [request(common_pb2.Constraint(json_schema=json.dumps(schema)), prompt, temperature=0.0) for prompt in PROMPTS[8:]]
    alone = [collect(stub.GenerateStream(r, timeout=120))[1] for r in unconstrained]
    mixed = run_all(stub, [r for pair in zip(unconstrained, constrained) for r in pair])
    assert [ids for _, ids, _ in mixed[0::2]] == alone
    for text, _, chunks in mixed[1::2]:
        assert chunks[-1].finish_reason == STOP
        jsonschema.validate(json.loads(text), schema)


def test_sync_dispatch_gives_the_tokens_of_async(stub, tmp_path_factory):
    requests = [schema_request(SCHEMAS[19], 7), schema_request(SCHEMAS[12], 8),
                request(common_pb2.Constraint(regex=REGEXES[1]), "Answer briefly.", 9)]
    for r in requests:
        r.cache_salt = "dispatch"  # no prefix-cache hit on either pipeline: the same prefill
    expected = [collect(stub.GenerateStream(r, timeout=300))[1] for r in requests]  # one at a time: the same batches
    pipeline, channel, sync_stub = start(tmp_path_factory, "structured-sync", ["--dispatch", "sync"])
    try:
        assert [collect(sync_stub.GenerateStream(r, timeout=300))[1] for r in requests] == expected
    finally:
        channel.close()
        pipeline.stop()


def test_aborting_a_constrained_request_frees_its_matcher_and_kv(served):
    pipeline, stub = served
    endless = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}
    stream = stub.GenerateStream(schema_request(endless, 1))
    for _ in range(4):
        next(stream)
    assert metric(scrape(pipeline.device), "stageserve_constrained_sequences") == 1
    stream.cancel()
    wait_kv_all_free(stub, timeout_s=30)
    deadline = time.monotonic() + 30
    while metric(scrape(pipeline.device), "stageserve_constrained_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(scrape(pipeline.device), "stageserve_constrained_sequences") == 0


@pytest.mark.parametrize("constraint, message", [
    (common_pb2.Constraint(json_schema='{"type": "objec"}'), 'constraint.json_schema: Unsupported type "objec"'),
    (common_pb2.Constraint(json_schema='{"type": '), "constraint.json_schema: not JSON"),
    (common_pb2.Constraint(regex="[a-"), "constraint.regex: Regex parsing error at position 4: Unclosed '['"),
    (common_pb2.Constraint(grammar='start ::= "a"'), 'constraint.grammar: EBNF parser error at line 1, column 1: The root rule with name "root" is not found'),
    (common_pb2.Constraint(choice=common_pb2.Choice()), "constraint.choice.options: empty"),
])
def test_a_bad_constraint_is_invalid_argument_and_the_service_keeps_serving(stub, constraint, message):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request(constraint, "Hi"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(message), refused.value.details()
    served = stub.Generate(request(common_pb2.Constraint(choice=common_pb2.Choice(options=["ok"])), "Say ok."), timeout=60)
    assert served.text == "ok" and served.finish_reason == STOP


def test_openai_response_format_json_schema(served):
    pipeline, _ = served
    schema = SCHEMAS[10]
    body = {"model": "m", "messages": [{"role": "user", "content": "Give a user as JSON."}], "max_tokens": MAX_TOKENS, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}}
    with httpx.Client(base_url=f"http://127.0.0.1:{pipeline.prepare.http_port}/v1", timeout=120) as http:
        body["model"] = http.get("/models").json()["data"][0]["id"]
        choice = http.post("/chat/completions", json=body).raise_for_status().json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        refused = http.post("/chat/completions", json={**body, "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "objec"}}}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "constraint"
