"""The load generator's transport over prepare's OpenAI-compatible HTTP API (``stageserve bench --openai URL``).

Each workload request (a ``GenerateRequest``) is sent as the OpenAI request it stands for:
``messages`` to ``/v1/chat/completions``, ``prompt`` or ``prompt_token_ids`` to ``/v1/completions``,
``stream: true`` with ``stream_options.include_usage``; ``ignore_eos`` travels as vLLM's extension
field. The server-sent events are read with httpx as they arrive. A chunk with text counts as
one token (a streamed OpenAI chunk names no token ids; prepare sends one per decode step), so the
ITL of this transport is per chunk; TTFT (first text) and output tokens (the usage chunk) are exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from google.protobuf.json_format import MessageToDict

from stageserve.bench.loadgen import StreamFailed
from stageserve.v1 import common_pb2, prepare_pb2

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


def openai_body(request: prepare_pb2.GenerateRequest, model: str) -> tuple[str, dict]:
    """The endpoint path and JSON body of ``request`` (the fields the workload sets)."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": request.ignore_eos}
    for field in ("max_tokens", "temperature", "top_p", "seed"):
        if request.HasField(field):
            body[field] = getattr(request, field)
    if request.constraint.WhichOneof("kind") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.loads(request.constraint.json_schema)}}
    if request.messages:
        body["messages"] = [MessageToDict(m) for m in request.messages]
        return "/chat/completions", body
    body["prompt"] = request.prompt or list(request.prompt_token_ids)
    return "/completions", body


class OpenAITransport:
    """Streams each request from the OpenAI-compatible API at ``base_url`` (``http://HOST:PORT/v1``;
    create inside the event loop). ``model`` is read from ``/v1/models`` at the first request."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=None,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self._model: str | None = None

    async def stream(self, request: prepare_pb2.GenerateRequest) -> AsyncIterator[tuple[float, prepare_pb2.GenerateStreamResponse]]:
        if self._model is None:
            self._model = (await self._client.get("/models")).json()["data"][0]["id"]
        path, body = openai_body(request, self._model)
        try:
            async with self._client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    error = json.loads(await response.aread())["error"]
                    raise StreamFailed(f"HTTP_{response.status_code}", error["message"])
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = _chunk(json.loads(line[6:]))
                        if chunk is not None:
                            yield time.perf_counter(), chunk
        except self._httpx.HTTPError as exc:
            raise StreamFailed("HTTP_ERROR", str(exc)) from None

    async def close(self) -> None:
        await self._client.aclose()


def _chunk(data: dict) -> prepare_pb2.GenerateStreamResponse | None:
    """The load generator's view of one SSE chunk: text (one token), the finish, or the usage."""
    if "error" in data:
        raise StreamFailed(data["error"].get("code") or "ERROR", data["error"]["message"])
    if data.get("usage"):
        usage = data["usage"]
        chunk = prepare_pb2.GenerateStreamResponse(finish_reason=common_pb2.FINISH_REASON_STOP)
        chunk.usage.prompt_tokens, chunk.usage.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        return chunk
    choice = data["choices"][0] if data.get("choices") else None
    text = (choice.get("delta", {}).get("content") or "") if choice and "delta" in choice else (choice or {}).get("text", "")
    if not text:
        return None
    return prepare_pb2.GenerateStreamResponse(text=text, token_ids=[0])  # one token per text chunk (see the module docstring)
