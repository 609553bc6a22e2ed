"""The loop over one device's completion stream: what reclaim's device connection runs per
``Device.Complete`` stream, and what the in-process benchmark baseline runs over the device's outbox.

`receive` (on its own thread) moves the stream's events into an inbox and ends it with a
`StreamEnd`; `consume_stream` is the main loop over that inbox, feeding one
`~stageserve.reclaim.completion.CompletionHandler` (ticket book, sequence table, detokenization,
stops) and acting on what it returns.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from stageserve.reclaim.completion import CompletionHandler
from stageserve.reclaim.metrics import StepObserver
from stageserve.reclaim.ticket_book import DeviceProtocolError
from stageserve.tracing import clock_ns
from stageserve.v1 import device_pb2, reclaim_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEnd:
    """Inbox item: the device stream is over (or its consumer is stopping), and why."""

    reason: str


def receive(events: Iterable[device_pb2.CompletionEvent], inbox: queue.SimpleQueue) -> None:
    """Move ``events`` (a ``Device.Complete`` call, or the device's outbox) into ``inbox``; end with a `StreamEnd`."""
    try:
        for event in events:
            inbox.put(event)
        inbox.put(StreamEnd("the device closed the stream"))
    except grpc.RpcError as exc:
        inbox.put(StreamEnd(f"{exc.code().name}: {exc.details()}"))


def consume_stream(
    handler: CompletionHandler,
    inbox: queue.SimpleQueue,
    publish: Callable[[reclaim_pb2.StepEvents], None],
    release: Callable[[int], None],
    observer: StepObserver,
    note_live: Callable[[int], None] = lambda live: None,
    device: str = "the device",
) -> tuple[bool, str]:
    """Handle the events of ``inbox`` until a `StreamEnd`; return (any event received, why it ended).

    Args:
        handler: the stream's completion handler.
        inbox: filled by `receive`.
        publish: sends one step's ``StepEvents`` to the subscribers.
        release: sends ``SlotRelease`` for a ticket id.
        observer: the stream's spans and metrics.
        note_live: told the handler's live sequence count after each event.
        device: names the device in log messages.

    A device that breaks the protocol (`DeviceProtocolError`) ends the loop with that reason.
    """
    received = False
    while True:
        # 1. Receive the next device event, or wake when the oldest step's completion deadline passes.
        deadline_s = handler.next_deadline_s()
        try:
            item = inbox.get(timeout=None if deadline_s is None else max(0.0, deadline_s - time.monotonic()))
        except queue.Empty:
            item = None
        if isinstance(item, StreamEnd):
            return received, item.reason
        received = received or item is not None
        # 2. Dispatch on the event's kind (ticket: register sequences; output: process rows), or time out steps.
        start_ns = clock_ns()
        try:
            with observer.handling(item, start_ns):
                outcomes = handler.expire(time.monotonic()) if item is None else handler.handle(item, time.monotonic())
        except DeviceProtocolError as exc:
            log.error("device %s broke the completion protocol: %s", device, exc)
            return received, str(exc)
        # 3. Publish each ready step's StepEvents, in step order; 4. release its slot to the device.
        for outcome in outcomes:
            if outcome.events is not None:
                with observer.publishing(outcome.events):
                    publish(outcome.events)
                observer.published(outcome.events)
            if outcome.release_ticket:
                release(outcome.release_ticket)
        observer.handled(item, start_ns)
        note_live(handler.live_count)
