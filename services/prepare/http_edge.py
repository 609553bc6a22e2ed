"""The HTTP API's connection-level bounds, below the application: how long a client may take to send
a request's headers, how long an idle kept-alive connection stays, how many connections and
requests are served at once, how large the headers may be, and which framing is refused.

uvicorn (on h11) bounds idle kept-alive connections (``timeout_keep_alive``), concurrency
(``limit_concurrency``: one more connection or request is answered 503) and the size of an
incomplete request head (``h11_max_incomplete_event_size``: 400), but has no header timeout: a
client sending one byte a second (slowloris) would hold its connection forever.
:class:`HeaderDeadlineProtocol` adds one. A TLS handshake ends before the protocol sees the
connection; asyncio bounds it (60 s, its ``ssl_handshake_timeout`` default).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
"""A connection that has not sent a whole request head this long after it opened (or after the
first byte of its next request) is closed."""
KEEP_ALIVE_S = 5
"""An idle kept-alive connection is closed after this long (uvicorn's ``timeout_keep_alive``)."""
MAX_CONNECTIONS = 1024
"""Connections, and requests in progress, at most; past either, a request is answered 503."""
MAX_HEADER_BYTES = 16384
"""A request head (request line and headers) of more bytes is answered 400."""


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head (`HEADER_TIMEOUT_S`).

    The deadline starts when the connection opens, or with the first byte of a later request on a
    kept-alive connection (the wait before that byte is uvicorn's keep-alive timeout), and ends when
    the head is complete. Bytes dripped in do not move it.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = self.loop.call_later(HEADER_TIMEOUT_S, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_overdue)
        else:
            self._cancel_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        """The client has not sent the whole head of its current request (h11: still ``IDLE``)."""
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self._waiting_for_head():
            self.transport.close()


def refuse_ambiguous_framing(app, refuse: Callable[[str], object]):
    """``app`` behind a check that refuses a request with both ``Content-Length`` and
    ``Transfer-Encoding`` (RFC 9112 6.1: a front proxy and this server could read different bodies
    from it: request smuggling) with ``refuse(message)`` (an ASGI response), closing the connection.
    """
    async def checked(scope, receive, send):
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                response = refuse("headers: Content-Length and Transfer-Encoding together frame the body two ways;"
                                  " send one of them")
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
        await app(scope, receive, send)

    return checked
