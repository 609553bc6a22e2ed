"""The device's outbox of Complete-stream events: order, and hand-over between two reclaim streams."""

from __future__ import annotations

import threading

import pytest

from stageserve.device.service import CompletionOutbox
from stageserve.v1 import device_pb2


def ticket(ticket_id: int) -> device_pb2.CompletionEvent:
    return device_pb2.CompletionEvent(ticket=device_pb2.CompletionTicket(ticket=ticket_id, step_id=ticket_id))


def output(ticket_id: int) -> device_pb2.CompletionEvent:
    return device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=ticket_id, step_id=ticket_id))


def kinds(events: list[device_pb2.CompletionEvent]) -> list[tuple[str, int]]:
    return [(e.WhichOneof("kind"), getattr(e, e.WhichOneof("kind")).ticket) for e in events]


def test_an_event_a_detached_stream_refuses_stays_first_for_the_next_stream():
    outbox = CompletionOutbox()
    outbox.push(ticket(3))
    assert outbox.pop(0.01, claim=lambda event: False) is None  # the old stream, already detached
    outbox.push(output(3))
    taken = [outbox.pop(0.01), outbox.pop(0.01)]
    assert kinds(taken) == [("ticket", 3), ("output", 3)]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a consumer's exception fails the test
def test_two_streams_racing_for_events_never_see_an_output_before_its_ticket():
    # One consumer detaches halfway through and refuses from then on, as a vanished reclaim's
    # generator does while it still polls; the other takes everything it is offered.
    outbox = CompletionOutbox()
    detached = threading.Event()
    old, new = [], []

    def old_stream() -> None:
        while not detached.is_set():
            event = outbox.pop(0.001, claim=lambda event: not detached.is_set())
            if event is not None:
                old.append(event)

    def new_stream() -> None:
        detached.wait()
        while len(old) + len(new) < 2000:
            event = outbox.pop(0.01)
            if event is not None:
                new.append(event)

    threads = [threading.Thread(target=old_stream), threading.Thread(target=new_stream)]
    for t in threads:
        t.start()
    for ticket_id in range(1, 1001):
        outbox.push(ticket(ticket_id))
        outbox.push(output(ticket_id))
        if ticket_id == 500:
            detached.set()
    for t in threads:
        t.join(30)
    # Every event once, in order: whatever the old stream took precedes what the new one took.
    assert kinds(old + new) == [(kind, i) for i in range(1, 1001) for kind in ("ticket", "output")]


def test_the_outputs_of_orphaned_tickets_are_dropped():
    outbox = CompletionOutbox()
    outbox.push(output(1))
    outbox.push(ticket(2))
    outbox.orphan([1])
    assert kinds([outbox.pop(0.01)]) == [("ticket", 2)]
    assert outbox.pop(0.01) is None
