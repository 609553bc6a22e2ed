"""The HTTP API's edges (issue 34): bodies that break parsers, slow request heads, ambiguous framing
and the latency of a kept-alive connection, on the real :class:`HttpServer` over loopback with the
real application (no pipeline: every case here is decided before the frontend is used)."""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time

import httpx
import pytest

from stageserve.prepare import http_edge
from stageserve.prepare.openai_api import MAX_BODY_DEPTH, HttpServer, create_app


@pytest.fixture(scope="module")
def server():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http = HttpServer(create_app(frontend=None), "127.0.0.1", 0, loop)
    try:
        yield http
    finally:
        http.stop(timeout_s=1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def post_raw(port: int, body: bytes) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)


def test_a_body_nested_100000_deep_or_past_the_limit_is_a_400(server):
    for depth in (100_000, MAX_BODY_DEPTH + 1):
        response = post_raw(server.port, b"[" * depth + b"]" * depth)
        assert response.status_code == 400, response.text
        assert f"nested deeper than the maximum of {MAX_BODY_DEPTH} levels" in response.json()["error"]["message"]


def test_a_lone_surrogate_is_a_400(server):
    for body in (rb'{"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}',
                 rb'{"model": "m", "messages": [{"role": "user", "\udfff": "x"}]}'):
        response = post_raw(server.port, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "lone surrogate" in error["message"] and error["type"] == "invalid_request_error"


def test_content_length_with_chunked_is_refused_and_the_connection_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\n{}\r\n0\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):  # the server closes: recv ends with b""
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding together" in reply


def test_a_request_head_dripped_in_is_cut_at_the_header_timeout(server, monkeypatch):
    monkeypatch.setattr(http_edge, "HEADER_TIMEOUT_S", 1.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        start = time.monotonic()
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        closed = False
        while time.monotonic() - start < 8:
            try:
                conn.sendall(b"X")  # one header byte every 0.1 s: never a whole head
            except OSError:
                closed = True
                break
            conn.settimeout(0.1)
            try:
                if conn.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed and time.monotonic() - start < 4


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(server, monkeypatch):
    monkeypatch.setattr(http_edge, "HEADER_TIMEOUT_S", 1.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=6) as conn:
        start = time.monotonic()
        assert conn.recv(1) == b""
        assert time.monotonic() - start < 4


def request_ms(client: httpx.Client, url: str) -> float:
    start = time.perf_counter()
    assert client.get(url).status_code == 404  # OpenAI's error body for an unrouted path: a whole response
    return (time.perf_counter() - start) * 1e3


def test_a_kept_alive_connection_answers_as_fast_as_a_fresh_one(server):
    """Was ~44 ms per kept-alive request: the listener's socket lacked IPPROTO_TCP, so asyncio set
    no TCP_NODELAY and the body waited behind the headers for the client's delayed ACK."""
    url = f"http://127.0.0.1:{server.port}/v1/unrouted"
    with httpx.Client() as client:
        request_ms(client, url)  # the connection opens here
        kept = [request_ms(client, url) for _ in range(12)]
    fresh = []
    for _ in range(12):
        with httpx.Client() as client:
            fresh.append(request_ms(client, url))
    print(f"kept-alive median {statistics.median(kept):.1f} ms, fresh {statistics.median(fresh):.1f} ms")
    assert statistics.median(kept) <= 1.5 * statistics.median(fresh) + 2.0  # + 2 ms: a loaded 2-core machine's noise
    assert statistics.median(kept) < 20.0
