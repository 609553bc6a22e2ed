"""The asyncio bridge: each accepted request's outcomes, handed from the engine's threads to the
RPC handler that serves the request.

- :class:`RequestHandle`: one request's events (and its terminal error), in order, put by the
  engine's threads and taken by one consumer: a thread (:meth:`RequestHandle.events`, the
  in-process baseline) or a coroutine (:meth:`RequestHandle.events_async`, prepare's ``grpc.aio``
  handlers).
- :class:`LoopWaker`: resolves the futures those coroutines await, with one wake-up of their event
  loop per burst of puts.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Callable, Iterator

from stageserve.prepare.errors import RequestError
from stageserve.prepare.metrics import RequestObserver
from stageserve.prepare.resumption import Resumption
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import reclaim_pb2

_CLIENT_GONE = object()  # handle sentinel: the RPC ended on the client's side, stop waiting


class LoopWaker:
    """Resolves futures of one event loop from any thread, with one wake-up of the loop per burst.

    A ``loop.call_soon_threadsafe`` per future would write the loop's self-pipe once per stream
    and step (a syscall, and a chance for the GIL to pass to the loop thread mid-burst); reclaim's
    reader thread routes a step's events to all of its streams in one go, so the futures it
    resolves share one wake-up.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Future] = []

    def wake(self, future: asyncio.Future) -> None:
        """Resolve ``future`` (to ``None``) on the loop soon; any thread, the loop's included."""
        with self._lock:
            self._due.append(future)
            first = len(self._due) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._resolve)
            except RuntimeError:  # the loop is closed: its consumers are gone with it
                pass

    def _resolve(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for future in due:
            if not future.done():  # a cancelled consumer leaves its future behind
                future.set_result(None)


class RequestHandle:
    """One accepted request's outcomes, in order, for the RPC handler that serves it.

    The engine's threads :meth:`put` items; one consumer takes them, with :meth:`events` on a
    thread (the in-process baseline) or :meth:`events_async` on an event loop (prepare's gRPC
    handlers). A consumer that finds nothing arms a one-shot wake-up, so a :meth:`put` wakes it
    only when it waits, and several items that arrive meanwhile are taken in one go.

    Attributes:
        request: the validated request (after a device failure: the one that resumes it).
        observer: its metrics and ``request.*`` trace events, fed by the RPC handler.
        accepted_ns: ``clock_ns()`` at acceptance.
        queued: no row of it has been scheduled yet (engine lock).
        cached_tokens: prompt tokens served from the prefix cache (set when first scheduled).
        prompt_tokens: the accepted request's prompt tokens (what usage reports, however resumed).
        resumption: what it published, to resume it elsewhere (``resumption.py``); every event
            put passes through it.
    """

    def __init__(self, request: GenerationRequest, observer: RequestObserver, accepted_ns: int) -> None:
        self.request = request
        self.observer = observer
        self.accepted_ns = accepted_ns
        self.queued = True
        self.cached_tokens = 0
        self.prompt_tokens = request.num_prompt_tokens
        self.resumption = Resumption(request)
        self._lock = threading.Lock()
        self._items: deque = deque()
        self._wake: Callable[[], None] | None = None  # armed by a waiting consumer, fired by the next put

    def put(self, item: reclaim_pb2.SequenceEvent | RequestError) -> None:
        """Deliver ``item`` (an event, or the terminal error) and wake the consumer if it waits; any thread
        (one at a time: the engine's lock, or the router's for a request between devices)."""
        if isinstance(item, reclaim_pb2.SequenceEvent):
            try:
                item = self.resumption.translate(item)
            except RequestError as error:
                item = error
            if item is None:
                return
        with self._lock:
            self._items.append(item)
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    def client_gone(self) -> None:
        """Wake the handler: the client cancelled, disconnected or hit its deadline."""
        self.put(_CLIENT_GONE)

    def events(self) -> Iterator[reclaim_pb2.SequenceEvent]:
        """Yield the request's events up to and including the one with a finish reason, blocking
        the calling thread while none is there.

        Ends early (without error) once the client is gone.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        ready = threading.Event()
        for event in self._events_or_waits(ready.set):
            if event is None:
                ready.wait()
                ready.clear()  # fired once per arming: no set can be lost here
            else:
                yield event

    async def events_async(self, waker: LoopWaker) -> AsyncIterator[reclaim_pb2.SequenceEvent]:
        """:meth:`events` for a coroutine on ``waker``'s loop: awaits while none is there.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        ready = waker.loop.create_future()
        # The wake-up reads ``ready`` when a put fires it: the future being awaited, since a new one
        # is made only after that one resolved, and armed only after that.
        for event in self._events_or_waits(lambda: waker.wake(ready)):
            if event is None:
                await ready
                ready = waker.loop.create_future()
            else:
                yield event

    def _events_or_waits(self, wake: Callable[[], None]) -> Iterator[reclaim_pb2.SequenceEvent | None]:
        """The request's events in order up to its end, with ``None`` each time none is there and
        ``wake`` is armed for the next :meth:`put`: the consumer then waits for ``wake`` and resumes.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        while True:
            with self._lock:
                items = self._items
                if items:
                    self._items = deque()
                else:  # not kept: a put right after this block appends to that deque, which stays the queue
                    items = None
                    self._wake = wake
            if items is None:
                yield None
                continue
            for item in items:
                if (event := _event(item)) is None:
                    return
                yield event
                if event.finish_reason:
                    return


def _event(item: reclaim_pb2.SequenceEvent | RequestError | object) -> reclaim_pb2.SequenceEvent | None:
    """The event ``item`` is; ``None`` for the client-gone mark.

    Raises:
        RequestError: ``item`` is the request's terminal error.
    """
    if item is _CLIENT_GONE:
        return None
    if isinstance(item, RequestError):
        raise item
    return item
