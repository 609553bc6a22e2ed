"""The llama-server side's HTTP client: request body and stream events, against a local HTTP server
that answers ``/completion`` in llama-server's server-sent-event format (as its README documents)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stageserve.bench.llama_server import CompletionTransport
from stageserve.bench.loadgen import StreamFailed
from stageserve.v1 import common_pb2, prepare_pb2


class _Completion(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if body["n_predict"] == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"{\"error\": \"n_predict must be positive\"}")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"content": "Hi", "tokens": [11], "stop": False}, {"content": " there", "tokens": [12], "stop": False},
                  {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 2, "tokens_evaluated": 3}]
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Completion)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


async def _collect(port: int, request: prepare_pb2.GenerateRequest) -> list[prepare_pb2.GenerateStreamResponse]:
    return [chunk async for _, chunk in CompletionTransport(port).stream(request)]


def test_a_stream_becomes_one_chunk_per_token_and_a_final_chunk_with_usage(server):
    request = prepare_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True)
    chunks = asyncio.run(_collect(server.server_address[1], request))
    assert [list(c.token_ids) for c in chunks] == [[11], [12], []]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 2)
    body = _Completion.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 2 and body["stream"] and body["ignore_eos"] and body["top_k"] == 1


def test_an_http_error_is_a_failed_stream(server):
    _Completion.bodies.clear()
    request = prepare_pb2.GenerateRequest(prompt="text, not ids", max_tokens=2)
    with pytest.raises(ValueError, match="--input-len"):
        asyncio.run(_collect(server.server_address[1], request))
    assert not _Completion.bodies  # refused before sending
    with pytest.raises(StreamFailed, match="HTTP_400"):
        asyncio.run(_collect(server.server_address[1], prepare_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=0)))
