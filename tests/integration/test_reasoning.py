"""Reasoning apart from the answer on a checkpoint that really thinks: a tiny scripted Llama whose
greedy answer is ``<think>hm</think>OK`` (``tests/tiny_checkpoint.py``), served with
``--reasoning-parser qwen3``, read by the ``openai`` SDK (``reasoning_content``) and over gRPC
(``separate_reasoning``), streamed and whole."""

from __future__ import annotations

import grpc
import openai
import pytest

from stageserve.v1 import prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch
from tests.tiny_checkpoint import write_scripted_checkpoint

SCRIPT = ["<think>", "h", "m", "</think>", "O", "K"]
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), SCRIPT)
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, "reasoning", device_args=model, reclaim_args=model,
                      prepare_args=[*model, "--http-port", "0", "--reasoning-parser", "qwen3"])
    try:
        yield pipeline
    finally:
        pipeline.stop()


def test_the_openai_sdk_gets_reasoning_content_apart(served):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{served.prepare.http_port}/v1", api_key="unused", max_retries=0) as client:
        kwargs = dict(model=client.models.list().data[0].id, messages=CHAT, temperature=0, max_tokens=16)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == ("hm", "OK")
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "hm"
        assert "".join(d.content or "" for d in deltas) == "OK"


def test_grpc_separates_reasoning_when_asked(served):
    messages = [prepare_pb2.ChatMessage(role="user", content=CHAT[0]["content"])]
    with grpc.insecure_channel(served.prepare.address) as channel:
        stub = prepare_pb2_grpc.GenerationStub(channel)
        plain = stub.Generate(prepare_pb2.GenerateRequest(messages=messages, temperature=0.0, max_tokens=16), timeout=60)
        assert (plain.text, plain.reasoning_text) == ("<think>hm</think>OK", "")  # not asked: the text as generated
        request = prepare_pb2.GenerateRequest(messages=messages, temperature=0.0, max_tokens=16, separate_reasoning=True)
        whole = stub.Generate(request, timeout=60)
        assert (whole.reasoning_text, whole.text, whole.usage.completion_tokens) == ("hm", "OK", 7)  # 6 tokens and EOS
        chunks = list(stub.GenerateStream(request, timeout=60))
        assert "".join(c.reasoning_text for c in chunks) == "hm" and "".join(c.text for c in chunks) == "OK"
        constrained = stub.Generate(prepare_pb2.GenerateRequest(
            messages=messages, temperature=0.0, max_tokens=16, separate_reasoning=True,
            constraint={"choice": {"options": ["OK", "NO"]}}), timeout=60)  # the choice constrains the answer only
        assert (constrained.reasoning_text, constrained.text) == ("hm", "OK")
