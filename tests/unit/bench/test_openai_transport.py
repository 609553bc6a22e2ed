"""The load generator's OpenAI transport: requests as OpenAI bodies, SSE chunks as the generator's chunks."""

from __future__ import annotations

import pytest

from stageserve.bench.loadgen import StreamFailed
from stageserve.bench.openai_transport import _chunk, openai_body
from stageserve.v1 import prepare_pb2


def test_chat_and_prompt_requests_become_openai_bodies():
    chat = prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content="hi")], max_tokens=8,
                                       temperature=0.0, ignore_eos=True)
    path, body = openai_body(chat, "m")
    assert path == "/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"], body["stream_options"]) == (8, 0.0, True, {"include_usage": True})
    assert "top_p" not in body  # unset fields stay unset
    path, body = openai_body(prepare_pb2.GenerateRequest(prompt_token_ids=[1, 2]), "m")
    assert path == "/completions" and body["prompt"] == [1, 2]


def test_sse_chunks_become_loadgen_chunks():
    assert _chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) is None
    text = _chunk({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert (text.text, len(text.token_ids)) == ("Hi", 1)
    assert _chunk({"choices": [{"index": 0, "text": " there"}]}).text == " there"
    usage = _chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
    assert usage.finish_reason and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (3, 5)
    with pytest.raises(StreamFailed, match="boom"):
        _chunk({"error": {"message": "boom", "code": "internal"}})
