"""Aborts that arrive before their request: remembered for a short time, per caller.

A client that calls ``GenerateStream`` and then ``Abort`` at once can have its Abort handled
first (the request is still being validated and tokenized off the event loop). Such an Abort finds
no request; :class:`EarlyAborts` keeps it for ``EARLY_ABORT_TTL_S`` seconds, so that the request,
when it registers within that time, ends at once with ``finish_reason`` abort instead of running
to ``max_tokens``.

An early abort is scoped to its caller (:func:`caller_of`): the client's TLS identity when it has
one, else its host address. So one client cannot abort another's future request by guessing its
id, and a request id reused after the time is up is not touched. At most ``MAX_EARLY_ABORTS``
are kept (the oldest go first), so a flood of Aborts for ids that never come costs bounded memory.
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
        self._ttl_s, self._max_entries, self._clock = ttl_s, max_entries, clock
        self._expiry: OrderedDict[tuple[str, str], float] = OrderedDict()  # (caller, request id) -> expiry, oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._expiry)

    def remember(self, caller: str, request_id: str) -> None:
        """Keep an abort of ``request_id`` by ``caller`` for ``ttl_s`` seconds."""
        key = (caller, request_id)
        self._expiry.pop(key, None)
        self._expiry[key] = self._clock() + self._ttl_s
        while len(self._expiry) > self._max_entries:
            self._expiry.popitem(last=False)
        self._expire()

    def take(self, caller: str, request_id: str) -> bool:
        """Whether ``caller`` aborted ``request_id`` within ``ttl_s``; the abort is used up."""
        self._expire()
        return self._expiry.pop((caller, request_id), None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
