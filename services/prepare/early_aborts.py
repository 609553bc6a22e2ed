"""Aborts that arrive before their request: remembered for a short time, per caller.

A client that calls ``GenerateStream`` and then ``Abort`` at once can have its Abort handled
first (the request is still being validated and tokenized off the event loop). Such an Abort finds
no request; :class:`EarlyAborts` keeps it for ``EARLY_ABORT_TTL_S`` seconds, so that the request,
when it registers within that time, ends at once with ``finish_reason`` abort instead of running
to ``max_tokens``.

An early abort is scoped to its caller (:func:`caller_of`): the client's TLS identity when it has
one, else its host address. So one client cannot abort another's future request by guessing its
id, and a request id reused after the time is up is not touched. A late Abort (for a request
of that caller registered within the time, since finished) is not kept: reusing the id right
after must not end the new request. At most ``MAX_EARLY_ABORTS`` of each are kept (the oldest go
first), so a flood of Aborts for ids that never come costs bounded memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import grpc

EARLY_ABORT_TTL_S = 10.0
MAX_EARLY_ABORTS = 10_000


def caller_of(context: grpc.ServicerContext) -> str:
    """Who calls: the TLS peer identity when the channel has one, else the peer's host (no port:
    a client's Abort may come on another connection than its request)."""
    identities = context.peer_identities()
    if identities:
        return "tls:" + b",".join(identities).decode(errors="replace")
    peer = context.peer()  # "ipv4:127.0.0.1:5678", "ipv6:[::1]:5678", "unix:/path"
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class EarlyAborts:
    """Abort requests for ids not (yet) known, each kept ``ttl_s`` seconds (see the module docstring).

    Not thread-safe: the router calls it under its lock.

    Args:
        ttl_s: seconds an early abort is kept.
        max_entries: early aborts kept at most; the oldest is dropped first.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, ttl_s: float = EARLY_ABORT_TTL_S, max_entries: int = MAX_EARLY_ABORTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._expiry = _ExpiringKeys(ttl_s, max_entries, clock)  # aborts waiting for their request
        self._registered = _ExpiringKeys(ttl_s, max_entries, clock)  # requests registered lately

    def __len__(self) -> int:
        return len(self._expiry)

    def remember(self, caller: str, request_id: str) -> None:
        """Keep an abort of ``request_id`` by ``caller`` for ``ttl_s`` seconds, unless it is late
        (that request registered within ``ttl_s``)."""
        if (caller, request_id) not in self._registered:
            self._expiry.add((caller, request_id))

    def take(self, caller: str, request_id: str) -> bool:
        """A request of ``caller`` registers: whether it was aborted within ``ttl_s`` (the abort is used up)."""
        self._registered.add((caller, request_id))
        return self._expiry.discard((caller, request_id))


class _ExpiringKeys:
    """Keys kept ``ttl_s`` seconds each, ``max_entries`` at most (the oldest dropped first)."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self._ttl_s, self._max_entries, self._clock = ttl_s, max_entries, clock
        self._expiry: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> expiry, oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._expiry)

    def __contains__(self, key: tuple[str, str]) -> bool:
        self._expire()
        return key in self._expiry

    def add(self, key: tuple[str, str]) -> None:
        self._expiry.pop(key, None)
        self._expiry[key] = self._clock() + self._ttl_s
        while len(self._expiry) > self._max_entries:
            self._expiry.popitem(last=False)

    def discard(self, key: tuple[str, str]) -> bool:
        """Remove ``key``; whether it was there (and not expired)."""
        self._expire()
        return self._expiry.pop(key, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
